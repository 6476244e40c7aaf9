// What the host launcher hands to one compiled instantiation of the prefill kernel: raw pointers,
// element strides and sizes already checked against what the kernel can serve. Free of CuTe and CUDA
// headers so that the launcher translation unit stays cheap to compile.
#pragma once

#include <cstdint>

namespace fpv2::hopper {

// Pooled rows (128-token blocks) that one tile's mean correction can cover: the size of its shared-memory
// table of shifts (correction_mask.hpp). 16384 (2^21 tokens) up to d = 128; 8192 (2^20 tokens) at d = 256,
// whose Q tile leaves room for half the table only (prefill_traits.hpp). The launcher refuses longer
// requests when the correction is on.
constexpr int max_correction_blocks(int head_dim) { return head_dim == 256 ? 8192 : 16384; }

// With the second-order mass shift the table's upper half holds each row's key spread (two 16-bit values), so
// a tile covers half as many pooled rows (2^20 tokens up to d = 128, 2^19 at d = 256).
constexpr int max_second_order_blocks(int head_dim) { return max_correction_blocks(head_dim) / 2; }

// KV tokens per K/V tile of the instantiation for `head_dim` (PrefillTraits::kBlockN): the whole 128-token
// block up to d = 128, half of it at d = 256, where the consumers' registers hold 128 fp32 accumulators of
// O and a 128-token tile's scores would not fit beside them (prefill_traits.hpp).
constexpr int prefill_kv_tile(int head_dim) { return head_dim == 256 ? 64 : 128; }

struct PrefillPlan {
  // Split-KV (split_kv.hpp): the splits chosen by the launcher (1 = none) and the caller's workspace that
  // holds their partial rows.
  int32_t num_splits;
  // Kept-block work order (work_order.hpp): 1 = the launch first sorts the tiles by decreasing work into
  // the workspace (calls that do not split only).
  int32_t work_order;
  void* workspace;
  uint64_t workspace_bytes;
  int64_t total_q;
  int32_t max_seqlen_k;
  int32_t sm_count;  // the call's device, queried once by plan_prefill (splits, default schedule, persistent grid)

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

  // Block index (device pointers), all nullptr for dense attention.
  const int32_t* index_offsets;
  const int32_t* index_blocks;
  const int32_t* index_tile_offsets;

  // Mean correction: bf16 pooled K/V (total_blocks, Hkv, d), contiguous; pooled_k == nullptr: none.
  const void* pooled_k;
  const void* pooled_v;
  int32_t pooled_rows;
  const int32_t* pooled_block_offsets;
  const int32_t* block_lengths;
  // Optional E4M3 copies (fpv2.h, ABI 1.2): the FP8 pooled products; pooled_k_e4m3 == nullptr: bf16 ones.
  const void* pooled_k_e4m3;   // (rows, Hkv, d)
  const void* pooled_vt_e4m3;  // (Hkv, d, rows), slots permuted within 16
  int32_t pooled_e4m3_rows;
  const int32_t* e4m3_offsets;  // (B+1,)
  const float* e4m3_scales;     // (B, Hkv, 2)
  // Optional key spread (fpv2.h, ABI 1.5): the second-order mass shift; key_variance == nullptr: mean only.
  const float* key_variance;  // (total_blocks, Hkv)
  const float* key_radius;    // (total_blocks, Hkv)

  int32_t pingpong;    // FPV2_HOPPER_PINGPONG: 0 (default) or 1 (measured, not faster)
  // FPV2_HOPPER_PERSISTENT: 0, 1 = persistent CTAs in the static snake order, 2 ("dynamic") = the tile queue of
  // tile_queue.hpp (needs its counter in the workspace); both measured: NOTES.md. Unset: 0, or 2 with the work
  // order for the calls of schedule_default.hpp (launch_prefill.cu, choose_default_schedule).
  int32_t persistent;
  int32_t overlap;     // FPV2_HOPPER_OVERLAP: 1 (default) or 0; PV of tile n-1 in flight during softmax n
  int32_t request_major;  // FPV2_HOPPER_REQUEST_MAJOR: 1 (default) or 0; the order when head_major is 0
  int32_t pooled_half_exp;  // FPV2_HOPPER_POOLED_HALF_EXP: 0 (default) or 1; fp16x2 exponentials on pooled tiles
  int32_t head_major;       // FPV2_HOPPER_HEAD_MAJOR: 1 (default) or 0; tile order, see PrefillParams
};

}  // namespace fpv2::hopper
