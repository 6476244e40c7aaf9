"""Input generators for tests and benchmarks (planted and needle workloads)."""

from .workloads import PlantedWorkload, planted_workload

__all__ = ["PlantedWorkload", "planted_workload"]
