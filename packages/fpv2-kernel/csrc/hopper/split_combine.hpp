// The combine step of split-KV (split_kv.hpp): merges the normalised fp32 partial rows and lse of the
// num_splits splits into the bf16 output and its lse.
//
// Row x = token * Hq + head: lse = log sum_s exp(lse_s), out = sum_s exp(lse_s - lse) out_s. A split that
// saw no key of the row has lse_s = -inf and weight 0; a row no split saw (none in a causal call: every
// row sees its own token) would get zeros and -inf. One warp per row, d / 32 consecutive columns per lane.
#pragma once

#include <cmath>
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

namespace fpv2::hopper {

struct SplitCombineArgs {
  float const* split_out;  // (num_splits, rows, d)
  float const* split_lse;  // (num_splits, rows)
  int32_t num_splits;
  int64_t rows;            // total_q * Hq
  int32_t num_q_heads;     // Hq
  __nv_bfloat16* out;      // (total_q, Hq, d) with strides
  int64_t out_token_stride;
  int64_t out_head_stride;
  float* lse;              // optional: (total_q, Hq) with strides
  int64_t lse_token_stride;
  int64_t lse_head_stride;
};

template <int kHeadDim>
__global__ void __launch_bounds__(128) split_combine_kernel(const SplitCombineArgs a) {
  constexpr int kPerLane = kHeadDim / 32;
  static_assert(kHeadDim % 64 == 0, "pairs of columns per lane");
  const int64_t row = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = int(threadIdx.x) % 32;
  if (row >= a.rows) return;
  float top = -INFINITY;
  for (int s = 0; s < a.num_splits; ++s) top = fmaxf(top, a.split_lse[s * a.rows + row]);
  float acc[kPerLane];
  for (int e = 0; e < kPerLane; ++e) acc[e] = 0.0f;
  float total = 0.0f;
  if (top != -INFINITY) {
    for (int s = 0; s < a.num_splits; ++s) {
      const float weight = __expf(a.split_lse[s * a.rows + row] - top);  // exp(-inf) = 0
      total += weight;
      float const* src = a.split_out + (s * a.rows + row) * kHeadDim + lane * kPerLane;
      for (int e = 0; e < kPerLane; e += 2) {
        const float2 v = *reinterpret_cast<float2 const*>(src + e);
        acc[e] += weight * v.x;
        acc[e + 1] += weight * v.y;
      }
    }
  }
  const float inverse = total > 0.0f ? 1.0f / total : 0.0f;
  const int64_t token = row / a.num_q_heads;
  const int head = int(row % a.num_q_heads);
  __nv_bfloat16* dst = a.out + token * a.out_token_stride + int64_t(head) * a.out_head_stride + lane * kPerLane;
  for (int e = 0; e < kPerLane; e += 2) {
    *reinterpret_cast<__nv_bfloat162*>(dst + e) = __floats2bfloat162_rn(acc[e] * inverse, acc[e + 1] * inverse);
  }
  if (lane == 0 && a.lse != nullptr) {
    a.lse[token * a.lse_token_stride + int64_t(head) * a.lse_head_stride] =
        total > 0.0f ? top + logf(total) : -INFINITY;
  }
}

// Launches the combine on `stream` (after the split kernel on the same stream).
template <int kHeadDim>
cudaError_t launch_split_combine(SplitCombineArgs const& args, cudaStream_t stream) {
  constexpr int kThreads = 128;  // 4 rows per block
  const int64_t blocks = (args.rows * 32 + kThreads - 1) / kThreads;
  split_combine_kernel<kHeadDim><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(args);
  return cudaGetLastError();
}

}  // namespace fpv2::hopper
