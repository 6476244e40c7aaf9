// Naive fp32 reference of dense causal paged prefill attention: one thread per (query token, query head),
// written straight from the definition (ALGORITHM.md section 1), independent of the kernel's tiling,
// PackGQA packing, TMA view and online softmax.
//
// Query i of request b (token t = cu_seqlens_q[b] + i) of head hq sees KV tokens 0 .. prefix_b + i of KV
// head hq / g, prefix_b = seqlens_k[b] - q_len_b; token j of request b is slot j % page_size of page
// page_table[b][j / page_size]. Two passes: the row maximum, then exp-sum and the weighted sum of V.
// Outputs out_ref (num_tokens, Hq, D) and lse_ref (num_tokens, Hq), natural log, for the listed tokens.
//
// Block-sparse problems (offsets != nullptr) restrict the keys to the kept 128-token blocks of the row's
// CSR segment (row r = i * g + hq % g of KV head h, tile r / 128); with pooled_k set, every eligible pruned
// block J (J < floor((prefix + p_first) / 128), p_first the tile's first position) adds one key pooled_k[J]
// with logit q . pooled_k[J] * scale + log(block_lengths[J]) and value pooled_v[J] (ALGORITHM.md section 6).
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
  // Block-sparse (all nullptr: dense).
  const int32_t* offsets;
  const int32_t* blocks;
  const int32_t* tile_offsets;
  int32_t num_kv_heads;
  // Mean correction (nullptr: none): bf16 (total_blocks, Hkv, D) rows.
  const __nv_bfloat16* pooled_k;
  const __nv_bfloat16* pooled_v;
  const int32_t* block_lengths;
  const int32_t* block_offsets;
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

  auto dot = [&](const __nv_bfloat16* k) {
    float s = 0.0f;
    for (int c = 0; c < D; c += 8) {
      float kc[8];
      load8(k + c, kc);
      for (int e = 0; e < 8; ++e) s += q[c + e] * kc[e];
    }
    return s * p.softmax_scale;
  };

  // Keys: every token 0..last (dense), or the tokens <= last of the kept blocks, plus the pooled keys.
  int kept_begin = 0, kept_end = 0, n_block_masked = 0;
  const __nv_bfloat16* pooled_k = nullptr;
  const __nv_bfloat16* pooled_v = nullptr;
  const int32_t* lengths = nullptr;
  const int kBlock = 128;
  if (p.offsets != nullptr) {
    const int row = i * p.group + hq % p.group;
    const int tile = row / kBlock;
    const int tiles = p.tile_offsets[b + 1] - p.tile_offsets[b];
    const int64_t segment = int64_t(p.num_kv_heads) * p.tile_offsets[b] + int64_t(h) * tiles + tile;
    kept_begin = p.offsets[segment];
    kept_end = p.offsets[segment + 1];
    n_block_masked = (p.seqlens_k[b] - q_len + tile * kBlock / p.group) / kBlock;
    if (p.pooled_k != nullptr) {
      const int64_t row_elems = int64_t(p.num_kv_heads) * D;
      pooled_k = p.pooled_k + int64_t(p.block_offsets[b]) * row_elems + h * D;
      pooled_v = p.pooled_v + int64_t(p.block_offsets[b]) * row_elems + h * D;
      lengths = p.block_lengths + p.block_offsets[b];
    }
  }
  auto is_kept = [&](int block) {
    for (int e = kept_begin; e < kept_end; ++e) {
      if (p.blocks[e] == block) return true;
    }
    return false;
  };
  // visit(logit, value row) for every key of the row.
  auto for_each_key = [&](auto&& visit) {
    if (p.offsets == nullptr) {
      for (int j = 0; j <= last; ++j) visit(score(j), slot(p.v_cache, j));
      return;
    }
    for (int e = kept_begin; e < kept_end; ++e) {
      const int block = p.blocks[e];
      for (int j = block * kBlock; j < (block + 1) * kBlock && j <= last; ++j) visit(score(j), slot(p.v_cache, j));
    }
    if (pooled_k == nullptr) return;
    const int64_t row_elems = int64_t(p.num_kv_heads) * D;
    for (int J = 0; J < n_block_masked; ++J) {
      if (is_kept(J) || lengths[J] <= 0) continue;
      visit(dot(pooled_k + J * row_elems) + logf(float(lengths[J])), pooled_v + J * row_elems);
    }
  };

  float m = -INFINITY;
  for_each_key([&](float s, const __nv_bfloat16*) { m = fmaxf(m, s); });
  float acc[D];
  for (int c = 0; c < D; ++c) acc[c] = 0.0f;
  float l = 0.0f;
  for_each_key([&](float s, const __nv_bfloat16* v) {
    const float w = expf(s - m);
    l += w;
    for (int c = 0; c < D; c += 8) {
      float vc[8];
      load8(v + c, vc);
      for (int e = 0; e < 8; ++e) acc[c + e] += w * vc[e];
    }
  });
  float* out = out_ref + idx * D;
  for (int c = 0; c < D; ++c) out[c] = acc[c] / l;
  lse_ref[idx] = m + logf(l);
}

}  // namespace fpv2::native_test
