// Device-side comparison of the kernel's outputs with the reference, and the check that nothing outside
// the output rows was written (the outputs are poisoned with NaN bit patterns before the run).
#pragma once

#include <cstdint>

#include <cuda_bf16.h>

#include "device_fill.cuh"

namespace fpv2::native_test {

struct ErrorStats {
  float max_abs_err;       // over every output element compared
  float max_abs_ref;
  double sum_sq_err;
  double sum_sq_ref;
  float max_lse_err;
  unsigned long long nonfinite_out;  // NaN/inf in compared output elements (poison left behind, or NaN math)
  unsigned long long nonfinite_lse;
  unsigned long long stray_writes;  // elements outside the outputs' rows that lost their poison
};

// atomicMax for non-negative floats: their bit patterns order like the values.
__device__ inline void atomic_max_nonneg(float* address, float value) {
  atomicMax(reinterpret_cast<int*>(address), __float_as_int(value));
}

// One thread per (listed token, query head, column).
__global__ void compare_outputs(const __nv_bfloat16* out, int64_t out_token_stride, int64_t out_head_stride,
                                const float* lse, int64_t lse_token_stride, const float* out_ref,
                                const float* lse_ref, const int32_t* tokens, int32_t num_tokens, int32_t num_q_heads,
                                int32_t head_dim, ErrorStats* stats) {
  const int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (idx >= int64_t(num_tokens) * num_q_heads * head_dim) return;
  const int64_t row = idx / head_dim;  // (listed token, head)
  const int c = int(idx % head_dim);
  const int t = tokens[row / num_q_heads];
  const int hq = int(row % num_q_heads);
  const float got = __bfloat162float(out[t * out_token_stride + hq * out_head_stride + c]);
  const float want = out_ref[idx];
  if (!isfinite(got)) {
    atomicAdd(&stats->nonfinite_out, 1ull);
  } else {
    const float err = fabsf(got - want);
    atomic_max_nonneg(&stats->max_abs_err, err);
    atomicAdd(&stats->sum_sq_err, double(err) * err);
  }
  atomic_max_nonneg(&stats->max_abs_ref, fabsf(want));
  atomicAdd(&stats->sum_sq_ref, double(want) * want);
  if (c == 0) {
    const float got_lse = lse[t * lse_token_stride + hq];
    if (!isfinite(got_lse)) {
      atomicAdd(&stats->nonfinite_lse, 1ull);
    } else {
      atomic_max_nonneg(&stats->max_lse_err, fabsf(got_lse - lse_ref[row]));
    }
  }
}

// Every bf16 element of the out allocation that is not one of the (total_q, Hq, d) outputs (token-stride
// padding, guard rows after the last token) must still hold the poison pattern.
__global__ void count_stray_bf16(const __nv_bfloat16* out, int64_t allocated, int64_t total_q, int64_t token_stride,
                                 int64_t row_elems, ErrorStats* stats) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < allocated;
       i += int64_t(gridDim.x) * blockDim.x) {
    const bool is_output = i / token_stride < total_q && i % token_stride < row_elems;
    if (!is_output && __bfloat16_as_ushort(out[i]) != kBf16Poison) atomicAdd(&stats->stray_writes, 1ull);
  }
}

__global__ void count_stray_f32(const float* lse, int64_t allocated, int64_t used, ErrorStats* stats) {
  for (int64_t i = used + blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < allocated;
       i += int64_t(gridDim.x) * blockDim.x) {
    if (__float_as_uint(lse[i]) != kF32Poison) atomicAdd(&stats->stray_writes, 1ull);
  }
}

}  // namespace fpv2::native_test
