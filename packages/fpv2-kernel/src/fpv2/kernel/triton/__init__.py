"""fpv2.kernel.triton: the portable (Triton) block-sparse prefill attention kernel.

Same contracts and semantics as the PyTorch reference and the Hopper kernel,
for GPUs without the native build and for CPU tests under the Triton
interpreter (set ``TRITON_INTERPRET=1`` before ``triton`` is first imported).
Needs the ``triton`` extra: ``pip install fpv2-kernel[triton]``.
"""

try:
    import triton as _triton  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "fpv2.kernel.triton needs Triton: install it with `pip install fpv2-kernel[triton]` (or `pip install triton`)"
    ) from exc

from .key_spread import key_spread_triton
from .launch import BLOCK_M, is_interpreted, sparse_attention_triton
from .tuning import TUNING_TABLE, LaunchConfig, launch_config

__all__ = [
    "BLOCK_M",
    "TUNING_TABLE",
    "LaunchConfig",
    "is_interpreted",
    "key_spread_triton",
    "launch_config",
    "sparse_attention_triton",
]
