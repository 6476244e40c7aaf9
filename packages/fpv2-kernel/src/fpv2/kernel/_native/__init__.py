"""Native binding of fpv2.kernel: ``libfpv2_kernel`` through its stable C ABI (ctypes).

The library is found through ``$FPV2_KERNEL_LIBRARY`` or in the wheel
(``fpv2/kernel/lib``); its ABI version is checked on load. Nothing here is
needed by the reference or portable backends, and importing this module never
loads the library: loading happens on first use.
"""

from .api import (
    DEFAULT_TILE_QUEUE_MIN_REQUEST_TILES,
    check_status,
    hopper_available,
    hopper_head_dims,
    hopper_prefill,
    validate_prefill_native,
)
from .codes import CORRECTION_CHUNK, KERNEL_TILE_SIZE, MAX_NDIM, PREFILL_CAUSAL, DType, Status
from .errors import HopperKernelNotBuiltError, NativeError, NativeLibraryError, UnsupportedConfigurationError
from .library import (
    ABI_VERSION_MAJOR,
    ABI_VERSION_MINOR,
    LIBRARY_ENV,
    abi_version,
    check_abi_version,
    library_path,
    load_native_library,
    native_status,
)
from .structs import (
    TORCH_TO_DTYPE,
    BlockIndexStruct,
    CorrectionPlanStruct,
    PagedBatchStruct,
    PrefillArgsStruct,
    TensorDesc,
    block_index_struct,
    correction_plan_struct,
    paged_batch_struct,
    prefill_args_struct,
    tensor_desc,
)

__all__ = [
    "ABI_VERSION_MAJOR",
    "ABI_VERSION_MINOR",
    "CORRECTION_CHUNK",
    "DEFAULT_TILE_QUEUE_MIN_REQUEST_TILES",
    "KERNEL_TILE_SIZE",
    "LIBRARY_ENV",
    "MAX_NDIM",
    "PREFILL_CAUSAL",
    "TORCH_TO_DTYPE",
    "BlockIndexStruct",
    "CorrectionPlanStruct",
    "DType",
    "HopperKernelNotBuiltError",
    "NativeError",
    "NativeLibraryError",
    "PagedBatchStruct",
    "PrefillArgsStruct",
    "Status",
    "TensorDesc",
    "UnsupportedConfigurationError",
    "abi_version",
    "block_index_struct",
    "check_abi_version",
    "check_status",
    "correction_plan_struct",
    "hopper_available",
    "hopper_head_dims",
    "hopper_prefill",
    "library_path",
    "load_native_library",
    "native_status",
    "paged_batch_struct",
    "prefill_args_struct",
    "tensor_desc",
    "validate_prefill_native",
]
