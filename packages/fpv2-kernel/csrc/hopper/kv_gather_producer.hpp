// The producer of the prefill kernel for page sizes that are not a multiple of the kBlockN-token tile (1, 16,
// 64, ...): the 128 threads of the producer warpgroup gather the K and V rows of each KV tile of the
// BlockSchedule with 16-byte cp.async, in the order the consumers read them.
//
// Lane groups: the four lanes of a group copy one token row together, lane 4 g + h taking the chunks 4 m + h
// of each 128-byte segment, so every instruction of a warp reads 8 rows as 8 contiguous 64-byte pieces (two
// 32-byte sectors a request). Measured on the H200 at page size 1 (benchmarks/NOTES.md, 2026-12-03): one row
// per thread (half a sector a request) was L2-bound, 26.5 ms dense at 32K; lane pairs (one sector a request)
// 18.8 ms with the L2 still at 77% (TMA at page 128: 47%, 13 ms); four lanes 16.9 ms. Whole rows per
// instruction (16 lanes a row, page ids shuffled) relieved the L2 but made the producer latency-bound on 32
// shuffle + copy steps a tile; four lanes take four passes of 8 rows a warp at kBlockN = 128. The older
// layouts (row, warp rows, page lookups shared through shared memory) measured slower and were removed.
//
// Page lookups: lane l of warp w looks up the cache row of tile row kRowsPerWarp w + l (one page-table read
// per thread and tile, a tile ahead), and pass j of group g takes row kRowsPerWarp w + 8 j + g from lane
// 8 j + g by a shuffle (at the 64-token tiles of d = 256 a warp owns 16 rows in two passes; lanes 16..31
// repeat the lookups of lanes 0..15).
//
// Row r of KV block n is token t = kBlockN n + r, at slot t % page_size of page page_table[b][t / page_size],
// i.e. row page * page_size + t % page_size of the (num_pages * page_size, Hkv * d) view of the cache
// (the same view the TMA path uses). Rows past the request's length are zero-filled (a zero-size cp.async
// reads nothing), so stale or NaN cache slots never reach shared memory. The pooled tiles of the mean
// correction are gathered the same way from the (total_blocks, Hkv * d) pooled tensors, without a page table.
//
// Each thread issues its copies of a K (then V) tile into a stage, then arrives on that stage's full
// barrier when they have landed (cp.async.mbarrier.arrive.noinc; the barrier expects 128 arrivals in this
// mode). The warpgroup runs in 32 registers (24 at d = 256; the consumers need the rest): cache rows are 32-bit, each
// source address is formed just before its copies, the destinations are 32-bit shared addresses
// (copy_row_share) and the lane's rows are derived again at each use (lane_id()). The consumers fence the
// async proxy after their wait before wgmma reads the stage (cp.async writes through the generic proxy; moving
// that fence to the producer measured no faster, 2026-12-03).
#pragma once

#include <cstdint>

#include <cute/tensor.hpp>

#include "hopper/block_schedule.hpp"
#include "hopper/kv_pipeline.hpp"
#include "hopper/shared_copy.hpp"
#include "hopper/shared_storage.hpp"

namespace fpv2::hopper {

template <class Traits>
struct KvGatherProducer {
  using Element = typename Traits::Element;
  static constexpr int kElementsPerChunk = 16 / int(sizeof(Element));        // 8 bf16 = 16 bytes
  static constexpr int kElementsPerSegment = 128 / int(sizeof(Element));     // one 128-byte swizzle row: 64
  static constexpr int kChunksPerSegment = kElementsPerSegment / kElementsPerChunk;  // 8
  static constexpr int kSegmentsPerRow = Traits::kHeadDim / kElementsPerSegment;     // 2 for d = 128, 1 for 64
  static_assert(Traits::kHeadDim % kElementsPerSegment == 0, "rows are whole 128-byte swizzle segments");
  static_assert(kSmemTileAlignment % 1024 == 0, "the chunk XOR needs 1024-byte aligned stage buffers");
  static constexpr int kWarps = Traits::kThreadsPerWarpGroup / 32;
  // Lanes that copy one token row together: lane g * kLanesPerRow + h takes the chunks kLanesPerRow m + h of
  // each segment, so one warp instruction reads kLanesPerRow * 16 contiguous bytes of each of its rows.
  static constexpr int kLanesPerRow = 4;
  static constexpr int kRowsPerPass = 32 / kLanesPerRow;  // rows one warp instruction reads
  // Tile rows a lane group copies, one per pass: 4 at kBlockN = 128 (d <= 128), 2 at the 64-token tiles of d = 256.
  static constexpr int kPasses = Traits::kBlockN / (kWarps * kRowsPerPass);
  static constexpr int kRowsPerWarp = kPasses * kRowsPerPass;
  static_assert(kChunksPerSegment % kLanesPerRow == 0, "the lanes of a row share each segment's chunks evenly");
  static_assert(kRowsPerWarp <= 32, "a warp's lanes look up its rows: at most 32 rows a warp");
  static_assert(kPasses * kWarps * kRowsPerPass == Traits::kBlockN, "the lane groups cover the tile's rows");

  // This lane's share (chunks kLanesPerRow m + part of every segment) of tile row `row` into K (row-major
  // (N, d)) or V^T ((d, N)) of `stage`, at 32-bit shared addresses (with CuTe's 64-bit swizzled pointers
  // ptxas spilled in 24 registers). Within one 128-byte segment of a row the 128-byte swizzle permutes the
  // eight chunks by XOR with the row's swizzle phase, so chunk k of a segment lies at the address of chunk 0
  // XOR 16 k (the stage buffers are 1024-byte aligned): one layout evaluation per segment, the rest
  // immediates. fpv2_hopper_layout_check checks both facts on the layouts of every built head dim.
  template <bool kTransposed>
  __device__ __forceinline__ static void copy_row_share(Element* smem_tile, int stage, int row, int part,
                                                        Element const* src, bool valid) {
    using Layout = cute::conditional_t<kTransposed, typename Traits::SmemLayoutVt, typename Traits::SmemLayoutK>;
    const uint32_t tile_address = cute::cast_smem_ptr_to_uint(smem_tile);
    src += part * kElementsPerChunk;
    CUTE_UNROLL
    for (int s = 0; s < kSegmentsPerRow; ++s) {
      const int col = s * kElementsPerSegment;
      const int first = kTransposed ? smem_offset<Layout>(col, row, stage) : smem_offset<Layout>(row, col, stage);
      const uint32_t address = (tile_address + uint32_t(first) * uint32_t(sizeof(Element))) ^ uint32_t(16 * part);
      CUTE_UNROLL
      for (int m = 0; m < kChunksPerSegment / kLanesPerRow; ++m) {
        cp_async_16_zfill(address ^ uint32_t(16 * kLanesPerRow * m), src + col + kLanesPerRow * m * kElementsPerChunk,
                          valid);
      }
    }
  }

  template <class Params, class Geometry, class Storage>
  __device__ static void run(Params const& params, Geometry const& tile, Storage& smem,
                             typename KvPipeline<Traits::kStages>::State& state) {
    using namespace cute;
    using Pipeline = KvPipeline<Traits::kStages>;
    // The lane and the rows derived from it are read again at each use (a volatile %laneid read cannot be
    // hoisted out of the loop): kept live across the loop, they pushed the 24-register warpgroup into
    // spills at d = 64 and d = 256 (tools/check_ptxas_report.py); re-deriving them costs a few integer
    // instructions per tile.
    auto warp_rows = []() { return warp_in_warpgroup() * kRowsPerWarp; };
    auto group = []() { return lane_id() / kLanesPerRow; };
    auto part = []() { return lane_id() % kLanesPerRow; };
    auto first_row = [&]() { return warp_rows() + group(); };  // pass j copies row first_row() + kRowsPerPass j
    // Lane l looks up row l of the warp's rows (lanes past kRowsPerWarp repeat a lookup).
    auto lookup_row = [&]() { return warp_rows() + lane_id() % kRowsPerWarp; };

    int32_t const* pages = params.page_table + int64_t(tile.request) * params.page_table_stride;
    const int page_size = params.page_size;
    const int head_offset = tile.kv_head * Traits::kHeadDim;  // < Hkv * d, far below 2^31
    // Cache row of this lane's lookup token in block n, or -1 past the request's KV length (32 bits: the
    // launcher refuses caches of 2^31 rows or more; the producer runs in 24 registers).
    auto cache_row_of = [&](int n_block) -> int {
      const int token = n_block * Traits::kBlockN + lookup_row();
      if (token >= tile.seqlen_k) return -1;
      return pages[token / page_size] * page_size + token % page_size;
    };
    // Pass j's source row: from the lane that looked it up (at one pass, this lane itself).
    auto source_row = [&](int looked_up, int pass) -> int {
      return __shfl_sync(0xffffffffu, looked_up, pass * kRowsPerPass + group());
    };
    auto copy_tile = [&](auto transposed, int stage, Element const* base, int64_t token_stride, int looked_up) {
      Element* smem_tile = decltype(transposed)::value ? smem.v : smem.k;
      CUTE_UNROLL
      for (int pass = 0; pass < kPasses; ++pass) {
        const int cache_row = source_row(looked_up, pass);
        const bool valid = cache_row >= 0;
        // A zero-size copy reads nothing: the cache base stands in for rows past the request.
        const int64_t offset = valid ? int64_t(cache_row) * token_stride + head_offset : 0;
        copy_row_share<decltype(transposed)::value>(smem_tile, stage, first_row() + pass * kRowsPerPass, part(),
                                                    base + offset, valid);
      }
    };

    // Pooled rows are contiguous: each pass forms its own row, no page table and no shuffle.
    auto copy_pooled_tile = [&](auto transposed, int stage, Element const* base, int64_t tile_base) {
      Element* smem_tile = decltype(transposed)::value ? smem.v : smem.k;
      CUTE_UNROLL
      for (int pass = 0; pass < kPasses; ++pass) {
        const int row = first_row() + pass * kRowsPerPass;
        const bool valid = tile_base + row < params.pooled_rows;
        const int64_t offset = valid ? (tile_base + row) * params.cache_cols + head_offset : 0;
        copy_row_share<decltype(transposed)::value>(smem_tile, stage, row, part(), base + offset, valid);
      }
    };

    const BlockScheduleFor<Traits> schedule = BlockScheduleFor<Traits>::make(params, tile, Traits::kBlockN);
    Pipeline pipeline_k(smem.pipeline_k);
    Pipeline pipeline_v(smem.pipeline_v);
    const int num_kept = schedule.num_kept;
    int cache_row = num_kept > 0 ? cache_row_of(schedule.block(0)) : -1;
    CUTE_NO_UNROLL
    for (int i = 0; i < num_kept; ++i) {
      const int next_row = i + 1 < num_kept ? cache_row_of(schedule.block(i + 1)) : -1;
      pipeline_k.producer_wait_empty(state);
      copy_tile(cute::false_type{}, state.stage, params.k_cache, params.k_token_stride, cache_row);
      pipeline_k.producer_commit_cp_async(state);
      pipeline_v.producer_wait_empty(state);
      copy_tile(cute::true_type{}, state.stage, params.v_cache, params.v_token_stride, cache_row);
      pipeline_v.producer_commit_cp_async(state);
      state.advance();
      cache_row = next_row;
    }

    if (schedule.num_correction > 0) {
      const int pooled_base = params.pooled_block_offsets[tile.request];
      CUTE_NO_UNROLL
      for (int c = 0; c < schedule.num_correction; ++c) {
        const int64_t tile_base = int64_t(pooled_base) + int64_t(schedule.pooled_tile(c)) * Traits::kBlockN;
        pipeline_k.producer_wait_empty(state);
        copy_pooled_tile(cute::false_type{}, state.stage, params.pooled_k, tile_base);
        pipeline_k.producer_commit_cp_async(state);
        pipeline_v.producer_wait_empty(state);
        copy_pooled_tile(cute::true_type{}, state.stage, params.pooled_v, tile_base);
        pipeline_v.producer_commit_cp_async(state);
        state.advance();
      }
    }
  }
};

}  // namespace fpv2::hopper
