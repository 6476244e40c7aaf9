// What the host launcher hands to one compiled instantiation of the dense prefill kernel: raw pointers,
// element strides and sizes already checked against what the kernel can serve. Free of CuTe and CUDA
// headers so that the launcher translation unit stays cheap to compile.
#pragma once

#include <cstdint>

namespace fpv2::hopper {

struct DensePrefillPlan {
  // Queries and outputs (total_q, Hq, d), lse (total_q, Hq) or nullptr; strides in elements.
  const void* q;
  int64_t q_token_stride;
  int64_t q_head_stride;
  void* out;
  int64_t out_token_stride;
  int64_t out_head_stride;
  float* lse;
  int64_t lse_token_stride;
  int64_t lse_head_stride;

  // Paged cache (num_pages, page_size, Hkv, d), viewed as (num_pages * page_size, Hkv * d) rows.
  const void* k_cache;
  const void* v_cache;
  int64_t k_token_stride;  // row stride of the view (elements)
  int64_t v_token_stride;
  int32_t cache_rows;      // num_pages * page_size
  int32_t cache_cols;      // Hkv * d

  // Batch metadata (device pointers).
  const int32_t* cu_seqlens_q;
  const int32_t* seqlens_k;
  const int32_t* page_table;
  int64_t page_table_stride;
  int32_t page_size;

  int32_t num_requests;  // B
  int32_t num_kv_heads;  // Hkv
  int32_t group;         // Hq / Hkv
  int32_t head_dim;      // d
  int32_t max_seqlen_q;  // host-side bound on every q_len_b (sizes the grid)
  float softmax_scale;   // > 0
};

}  // namespace fpv2::hopper
