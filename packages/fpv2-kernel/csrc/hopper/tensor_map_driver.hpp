// CuTe encodes TMA descriptors through the driver entry point cuTensorMapEncodeTiled and asserts on failure;
// launchers that build descriptors check first that the entry point resolves, so that a missing driver is
// reported as an error, not asserted.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "abi/errors.hpp"

namespace fpv2::hopper {

// FPV2_OK, or FPV2_ERROR_CUDA with "<caller>: the CUDA driver does not provide cuTensorMapEncodeTiled (needed
// for <needed_for>): ...". The driver is asked once per process (launchers call this on every launch).
inline int32_t check_tensor_map_entry_point(const char* caller, const char* needed_for) {
  struct Lookup {
    cudaError_t err = cudaSuccess;
    bool found = false;
  };
  static const Lookup lookup = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult result = cudaDriverEntryPointSymbolNotFound;
#if CUDART_VERSION >= 12050
    const cudaError_t err = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000,
                                                             cudaEnableDefault, &result);
#else
    const cudaError_t err = cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &fn, cudaEnableDefault, &result);
#endif
    return Lookup{err, err == cudaSuccess && result == cudaDriverEntryPointSuccess && fn != nullptr};
  }();
  if (!lookup.found) {
    return fpv2::detail::fail(FPV2_ERROR_CUDA,
                              fpv2::detail::format("%s: the CUDA driver does not provide cuTensorMapEncodeTiled "
                                                   "(needed for %s): %s",
                                                   caller, needed_for, cudaGetErrorString(lookup.err)));
  }
  return FPV2_OK;
}

}  // namespace fpv2::hopper
