// The instantiations of the dense prefill kernel that this build compiles: one .cu file each under
// hopper/instantiations/, listed here once so that the launcher and the native tests agree.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "hopper/dense_prefill_plan.hpp"

namespace fpv2::hopper {

// Head dims with a compiled bf16 instantiation (instantiations/dense_prefill_bf16_hd<d>.cu).
inline constexpr int kDensePrefillHeadDims[] = {128};

inline constexpr bool dense_prefill_head_dim_built(int head_dim) {
  for (int d : kDensePrefillHeadDims) {
    if (d == head_dim) return true;
  }
  return false;
}

// Builds the TMA descriptors and launches the kernel for head dim kHeadDim on `stream`; returns an
// fpv2_status_t and sets the thread's last-error message on failure. `plan` is already checked.
template <int kHeadDim>
int32_t run_dense_prefill(const DensePrefillPlan& plan, cudaStream_t stream);

extern template int32_t run_dense_prefill<128>(const DensePrefillPlan& plan, cudaStream_t stream);

}  // namespace fpv2::hopper
