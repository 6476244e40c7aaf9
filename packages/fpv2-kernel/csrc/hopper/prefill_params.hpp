// Device parameters of the prefill kernel: plain pointers, strides and sizes, plus the TMA descriptors
// over the paged KV cache and over the bf16 pooled statistics of the mean correction. Passed by value as a __grid_constant__ kernel parameter so that
// the TMA unit reads the descriptors straight from the parameter space.
//
// The cache (num_pages, page_size, Hkv, d) is viewed as a row-major matrix of num_pages * page_size
// token rows and Hkv * d columns (row stride = the cache's token stride). The tile of KV block n of
// KV head h is the 128-row, d-column box at row block page_table[b][n / blocks_per_page] *
// blocks_per_page + n % blocks_per_page and column block h. V is described transposed, (Hkv * d, rows),
// because its shared-memory tile is the MN-major B operand of the PV wgmma.
#pragma once

#include <cstdint>

#include <cute/atom/copy_traits_sm90_tma.hpp>
#include <cute/tensor.hpp>
#include <cutlass/fast_math.h>

namespace fpv2::hopper {

template <class Traits>
struct PrefillParams {
  using Element = typename Traits::Element;
  using CacheShape = cute::Shape<int32_t, int32_t>;
  using RowMajorStride = cute::Stride<int64_t, cute::_1>;
  using ColMajorStride = cute::Stride<cute::_1, int64_t>;
  using TileK = cute::Shape<cute::Int<Traits::kBlockN>, cute::Int<Traits::kHeadDim>>;
  using TileVt = cute::Shape<cute::Int<Traits::kHeadDim>, cute::Int<Traits::kBlockN>>;

  using TmaK = decltype(cute::make_tma_copy(
      cute::SM90_TMA_LOAD{},
      cute::make_tensor(cute::make_gmem_ptr(static_cast<Element const*>(nullptr)), CacheShape{}, RowMajorStride{}),
      typename Traits::SmemLayoutKStage{}, TileK{}, cute::_1{}));
  using TmaV = decltype(cute::make_tma_copy(
      cute::SM90_TMA_LOAD{},
      cute::make_tensor(cute::make_gmem_ptr(static_cast<Element const*>(nullptr)), CacheShape{}, ColMajorStride{}),
      typename Traits::SmemLayoutVtStage{}, TileVt{}, cute::_1{}));

  using ElementE4M3 = typename Traits::ElementE4M3;
  using TmaKE4M3 = decltype(cute::make_tma_copy(
      cute::SM90_TMA_LOAD{},
      cute::make_tensor(cute::make_gmem_ptr(static_cast<ElementE4M3 const*>(nullptr)), CacheShape{},
                        RowMajorStride{}),
      typename Traits::SmemLayoutKE4M3Stage{}, TileK{}, cute::_1{}));
  using TmaVtE4M3 = decltype(cute::make_tma_copy(
      cute::SM90_TMA_LOAD{},
      cute::make_tensor(cute::make_gmem_ptr(static_cast<ElementE4M3 const*>(nullptr)), CacheShape{},
                        RowMajorStride{}),
      typename Traits::SmemLayoutVtE4M3Stage{}, TileVt{}, cute::_1{}));

  TmaK tma_k;
  TmaV tma_v;
  int32_t cache_rows;  // num_pages * page_size
  int32_t cache_cols;  // Hkv * d

  // Queries (total_q, Hq, d) and outputs, strides in elements.
  Element const* q;
  int64_t q_token_stride;
  int64_t q_head_stride;
  Element* out;
  int64_t out_token_stride;
  int64_t out_head_stride;
  float* lse;  // optional (nullptr): (total_q, Hq) fp32, natural log
  int64_t lse_token_stride;
  int64_t lse_head_stride;

  // Batch metadata (device memory).
  int32_t const* cu_seqlens_q;  // (B+1,)
  int32_t const* seqlens_k;     // (B,)
  int32_t const* page_table;    // (B, max_pages)
  int64_t page_table_stride;
  int32_t blocks_per_page;  // page_size / kBlockN

  int32_t group;         // Hq / Hkv
  int32_t num_kv_heads;  // Hkv
  int32_t num_requests;  // B
  int32_t num_m_blocks;  // query tiles of the longest request; gridDim.x = num_m_blocks * Hkv * B
  float softmax_scale_log2;  // softmax_scale * log2(e): scores go through exp2

  // Block-sparse traversal (fpv2_block_index_t, block_size = kBlockN); all nullptr for dense attention.
  int32_t const* index_offsets;       // (S+1,)
  int32_t const* index_blocks;        // kept block ids, ascending within a segment
  int32_t const* index_tile_offsets;  // (B+1,) cumulative tiles per request

  // Mean correction (fpv2_correction_plan_t with bf16 pooled tensors); has_correction = 0: none. The pooled
  // tensors (total_blocks, Hkv, d) are viewed like the cache, one row per block, and loaded as 128-row tiles.
  TmaK tma_pooled_k;
  TmaV tma_pooled_v;
  int32_t pooled_rows;                   // total_blocks
  int32_t const* pooled_block_offsets;   // (B+1,) first pooled row of each request
  int32_t const* block_lengths;          // (total_blocks,) tokens pooled into each row
  float inverse_softmax_scale;           // log|B| / softmax_scale is the raw-score shift of a pooled key
  int32_t has_correction;

  // cp.async gather (page_size % kBlockN != 0): the producer warpgroup reads the cache and the pooled
  // tensors through these pointers instead of the TMA descriptors.
  int32_t gather;  // 0: TMA; 1: the lane-pair cp.async gather (kv_gather_producer.hpp)
  int32_t page_size;
  Element const* k_cache;
  Element const* v_cache;
  int64_t k_token_stride;
  int64_t v_token_stride;
  Element const* pooled_k;
  Element const* pooled_v;

  // Pingpong of the two consumer warpgroups' QK products (FPV2_HOPPER_PINGPONG=1; off by default until
  // measured): a warpgroup issues its QK only on its turn and hands the turn over right after issuing.
  int32_t pingpong;

  // Persistent CTAs (FPV2_HOPPER_PERSISTENT=1 or dynamic, TMA path only; opt-in, measured: NOTES.md):
  // gridDim.x CTAs walk the tiles (snake order, or the tile queue with tile_counter) instead of one CTA per
  // tile.
  int32_t persistent;

  // Tile order (prefill_kernel.hpp): 1 = request-major (default: the CTAs running together share one
  // request's K/V in L2), 0 = (KV head, request) fastest; the same order at B = 1.
  int32_t request_major;

  // The FP8 pooled products of the mean correction (fpv2.h ABI 1.2; pooled_e4m3 = 0: the bf16 tensors
  // above). Pooled K (rows, Hkv * d) and V^T (Hkv * d, rows), both row-major; request b's pooled tile c is
  // rows / columns e4m3_offsets[b] + 128 c .. + 127. Scores and outputs are scaled back with the per
  // (request, KV head) scales e4m3_scales[b][h] = {K scale, V scale}.
  TmaKE4M3 tma_pooled_k_e4m3;
  TmaVtE4M3 tma_pooled_vt_e4m3;
  int32_t pooled_e4m3;
  int32_t pooled_e4m3_rows;
  int32_t const* e4m3_offsets;
  float const* e4m3_scales;

  // FPV2_HOPPER_POOLED_HALF_EXP=1: the pooled tiles' exponentials two per ex2.approx.f16x2 (A/B switch).
  int32_t pooled_half_exp;

  // FPV2_HOPPER_HEAD_MAJOR (default 1): tile order request, KV head, query tile (fastest), overriding
  // request_major; see prefill_kernel.hpp.
  int32_t head_major;

  // The hot integer divisions, precomputed by the launcher: by group (PackGQA rows: packed_row.hpp), by
  // num_m_blocks and by num_kv_heads (the head-major tile order).
  cutlass::FastDivmod group_divmod;
  cutlass::FastDivmod m_blocks_divmod;
  cutlass::FastDivmod kv_heads_divmod;

  // Split-KV (split_kv.hpp; 1 = none): num_splits CTAs per query tile, CTA blockIdx.x taking split
  // blockIdx.x % num_splits of tile blockIdx.x / num_splits. Each writes its normalised fp32 rows and lse
  // to split_out (num_splits, total_q, Hq, d) and split_lse (num_splits, total_q, Hq) in the caller's
  // workspace; split_combine.hpp merges them into out and lse.
  int32_t num_splits;
  int32_t num_q_heads;  // Hq
  int64_t total_q;
  float* split_out;
  float* split_lse;

  // Work order (work_order.hpp): tile slot i computes tile tile_order[i] of the decoded order; nullptr: the
  // decoded order itself (tile_order.hpp).
  int32_t const* tile_order;

  // Dynamic tile scheduler of the persistent CTAs (tile_queue.hpp): the claim counter, zeroed before the
  // launch; nullptr for the static snake order (and for one CTA per tile).
  int32_t* tile_counter;

  // Second-order mass shift (fpv2.h ABI 1.5; correction_mask.hpp): the key spread of each pooled row, row-major
  // (total_blocks, Hkv); key_variance == nullptr: the mean correction alone.
  float const* key_variance;
  float const* key_radius;
};

}  // namespace fpv2::hopper
