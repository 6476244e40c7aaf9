// The instantiations of the prefill kernel that this build compiles: one .cu file each under
// hopper/instantiations/, listed here once so that the launcher, the build description and the native
// tests agree.
#pragma once

#include <cstdint>
#include <string>

#include <cuda_runtime_api.h>

#include "hopper/prefill_plan.hpp"

namespace fpv2::hopper {

// Head dims with a compiled bf16 instantiation (instantiations/prefill_bf16_hd<d>.cu), ascending. Each runs
// with the K/V stage count of prefill_stages() (prefill_traits.hpp).
inline constexpr int kPrefillHeadDims[] = {64, 128, 256};

inline constexpr bool prefill_head_dim_built(int head_dim) {
  for (int d : kPrefillHeadDims) {
    if (d == head_dim) return true;
  }
  return false;
}

// "64, 128, 256": the built head dims, for messages and the build description.
inline std::string prefill_head_dims_text() {
  std::string text;
  for (int d : kPrefillHeadDims) {
    text += (text.empty() ? "" : ", ") + std::to_string(d);
  }
  return text;
}

// Builds the TMA descriptors and launches the kernel for head dim kHeadDim on `stream`; returns an
// fpv2_status_t and sets the thread's last-error message on failure. `plan` is already checked.
template <int kHeadDim>
int32_t run_prefill(const PrefillPlan& plan, cudaStream_t stream);

extern template int32_t run_prefill<64>(const PrefillPlan& plan, cudaStream_t stream);
extern template int32_t run_prefill<128>(const PrefillPlan& plan, cudaStream_t stream);
extern template int32_t run_prefill<256>(const PrefillPlan& plan, cudaStream_t stream);

}  // namespace fpv2::hopper
