"""Version of the fpv2-kernel wheel (moves independently of the sibling wheels)."""

__version__ = "0.1.12"
