// Naive fp32 reference of dense causal paged prefill attention: one thread per (query token, query head),
// written straight from the definition (ALGORITHM.md section 1), independent of the kernel's tiling,
// PackGQA packing, TMA view and online softmax.
//
// Query i of request b (token t = cu_seqlens_q[b] + i) of head hq sees KV tokens 0 .. prefix_b + i of KV
// head hq / g, prefix_b = seqlens_k[b] - q_len_b; token j of request b is slot j % page_size of page
// page_table[b][j / page_size]. Two passes: the row maximum, then exp-sum and the weighted sum of V.
// Outputs out_ref (num_tokens, Hq, D) and lse_ref (num_tokens, Hq), natural log, for the listed tokens.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>

namespace fpv2::native_test {

struct ReferenceProblem {
  const __nv_bfloat16* q;
  int64_t q_token_stride, q_head_stride;
  const __nv_bfloat16* k_cache;
  const __nv_bfloat16* v_cache;
  int64_t cache_page_stride, cache_token_stride, cache_head_stride;  // same for K and V
  const int32_t* page_table;
  int64_t page_table_stride;
  int32_t page_size;
  const int32_t* cu_seqlens_q;
  const int32_t* seqlens_k;
  int32_t num_requests;
  int32_t num_q_heads;
  int32_t group;
  float softmax_scale;
};

// 8 consecutive bf16 (one 16-byte load: the cache rows and query rows are 16-byte aligned) as floats.
__device__ inline void load8(const __nv_bfloat16* p, float (&out)[8]) {
  const uint4 raw = *reinterpret_cast<const uint4*>(p);
  const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&raw);
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(pairs[i]);
    out[2 * i] = f.x;
    out[2 * i + 1] = f.y;
  }
}

template <int D>
__global__ void reference_attention(ReferenceProblem p, const int32_t* tokens, int32_t num_tokens, float* out_ref,
                                    float* lse_ref) {
  const int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (idx >= int64_t(num_tokens) * p.num_q_heads) return;
  const int t = tokens[idx / p.num_q_heads];
  const int hq = int(idx % p.num_q_heads);
  int b = 0;
  while (b + 1 < p.num_requests && p.cu_seqlens_q[b + 1] <= t) ++b;
  const int q_len = p.cu_seqlens_q[b + 1] - p.cu_seqlens_q[b];
  const int i = t - p.cu_seqlens_q[b];
  const int last = p.seqlens_k[b] - q_len + i;  // last visible KV token
  const int h = hq / p.group;

  float q[D];
  const __nv_bfloat16* q_row = p.q + t * p.q_token_stride + hq * p.q_head_stride;
  for (int c = 0; c < D; ++c) q[c] = __bfloat162float(q_row[c]);

  auto slot = [&](const __nv_bfloat16* cache, int j) {
    const int page = p.page_table[b * p.page_table_stride + j / p.page_size];
    return cache + page * p.cache_page_stride + (j % p.page_size) * p.cache_token_stride + h * p.cache_head_stride;
  };
  auto score = [&](int j) {
    const __nv_bfloat16* k = slot(p.k_cache, j);
    float s = 0.0f;
    for (int c = 0; c < D; c += 8) {
      float kc[8];
      load8(k + c, kc);
      for (int e = 0; e < 8; ++e) s += q[c + e] * kc[e];
    }
    return s * p.softmax_scale;
  };

  float m = -INFINITY;
  for (int j = 0; j <= last; ++j) m = fmaxf(m, score(j));
  float acc[D];
  for (int c = 0; c < D; ++c) acc[c] = 0.0f;
  float l = 0.0f;
  for (int j = 0; j <= last; ++j) {
    const float w = expf(score(j) - m);
    l += w;
    const __nv_bfloat16* v = slot(p.v_cache, j);
    for (int c = 0; c < D; c += 8) {
      float vc[8];
      load8(v + c, vc);
      for (int e = 0; e < 8; ++e) acc[c + e] += w * vc[e];
    }
  }
  float* out = out_ref + idx * D;
  for (int c = 0; c < D; ++c) out[c] = acc[c] / l;
  lse_ref[idx] = m + logf(l);
}

}  // namespace fpv2::native_test
