// The producer of the prefill kernel for page sizes that are not a multiple of the kBlockN-token tile (1, 16,
// 64, ...): the 128 threads of the producer warpgroup gather the K and V rows of each KV tile of the
// BlockSchedule with 16-byte cp.async, in the order the consumers read them.
//
// Lane pairs: the two lanes of a pair copy one token row together, lane 2p + h taking the chunks 2m + h of
// each 128-byte segment, so every instruction of a warp reads 16 rows as 16 whole 32-byte sectors. With one
// row per thread (this file until 2026-12-02) a warp's 16-byte copies came from 32 rows, each half of a
// sector: the L2 served twice the sectors and ran at 95% of its throughput at page size 1 (ncu, 32K dense
// 25.8 ms against 14.2 ms on the TMA path, benchmarks/NOTES.md). Whole rows per instruction (16 lanes a
// row, page ids shuffled) fixed the L2 but made the producer latency-bound on 32 shuffle + copy steps a
// tile; pairs keep the step count of the row layout (two passes of 16 rows at kBlockN = 128). Both older
// layouts, and one sharing the page lookups through shared memory, measured slower than pairs and were
// removed (2026-12-03).
//
// Page lookups: at kBlockN = 128 lane l of warp w looks up the cache row of tile row 32 w + l (one
// page-table read per thread and tile, one tile ahead) and pass j of pair p takes row 32 w + 16 j + p from
// lane 16 j + p by a shuffle; at 64-token tiles (d = 256) pair p of warp w owns row 16 w + p in one pass and
// both of its lanes look it up.
//
// Row r of KV block n is token t = kBlockN n + r, at slot t % page_size of page page_table[b][t / page_size],
// i.e. row page * page_size + t % page_size of the (num_pages * page_size, Hkv * d) view of the cache
// (the same view the TMA path uses). Rows past the request's length are zero-filled (a zero-size cp.async
// reads nothing), so stale or NaN cache slots never reach shared memory. The pooled tiles of the mean
// correction are gathered the same way from the (total_blocks, Hkv * d) pooled tensors, without a page table.
//
// Each thread issues its copies of a K (then V) tile into a stage, then arrives on that stage's full
// barrier when they have landed (cp.async.mbarrier.arrive.noinc; the barrier expects 128 arrivals in this
// mode). The warpgroup runs in 24 registers (the consumers need the rest): cache rows are 32-bit, each
// source address is formed just before its copies, the destinations are 32-bit shared addresses
// (copy_half_row) and the lane's rows are derived again at each use (lane_id()). The consumers fence the async proxy after their
// wait before wgmma reads the stage (cp.async writes through the generic proxy).
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
  static constexpr int kPairsPerWarp = 16;
  // Tile rows a pair copies: 2 at kBlockN = 128 (d <= 128), 1 at the 64-token tiles of d = 256.
  static constexpr int kPasses = Traits::kBlockN / (kWarps * kPairsPerWarp);
  static constexpr int kRowsPerWarp = kPasses * kPairsPerWarp;
  static_assert(kPasses == 1 || kPasses == 2, "a warp's lanes look up its rows: at most 32 rows a warp");
  static_assert(kPasses * kWarps * kPairsPerWarp == Traits::kBlockN, "the pairs cover the tile's rows");

  // This lane's half (chunks 2m + half of every segment) of tile row `row` into K (row-major (N, d)) or V^T
  // ((d, N)) of `stage`, at 32-bit shared addresses (with CuTe's 64-bit swizzled pointers ptxas spilled in
  // 24 registers). Within one 128-byte segment of a row the 128-byte swizzle permutes the eight chunks by
  // XOR with the row's swizzle phase, so chunk k of a segment lies at the address of chunk 0 XOR 16 k (the
  // stage buffers are 1024-byte aligned): one layout evaluation per segment, the rest immediates.
  // fpv2_hopper_layout_check checks both facts on the layouts of every built head dim.
  template <bool kTransposed>
  __device__ __forceinline__ static void copy_half_row(Element* smem_tile, int stage, int row, int half,
                                                       Element const* src, bool valid) {
    using Layout = cute::conditional_t<kTransposed, typename Traits::SmemLayoutVt, typename Traits::SmemLayoutK>;
    const uint32_t tile_address = cute::cast_smem_ptr_to_uint(smem_tile);
    src += half * kElementsPerChunk;
    CUTE_UNROLL
    for (int s = 0; s < kSegmentsPerRow; ++s) {
      const int col = s * kElementsPerSegment;
      const int first = kTransposed ? smem_offset<Layout>(col, row, stage) : smem_offset<Layout>(row, col, stage);
      const uint32_t address = (tile_address + uint32_t(first) * uint32_t(sizeof(Element))) ^ uint32_t(16 * half);
      CUTE_UNROLL
      for (int m = 0; m < kChunksPerSegment / 2; ++m) {
        cp_async_16_zfill(address ^ uint32_t(32 * m), src + col + 2 * m * kElementsPerChunk, valid);
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
    auto pair = []() { return lane_id() >> 1; };
    auto half = []() { return lane_id() & 1; };
    auto first_row = [&]() { return warp_rows() + pair(); };  // pass j copies row first_row() + 16 j
    auto lookup_row = [&]() { return kPasses == 2 ? warp_rows() + lane_id() : first_row(); };

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
      if constexpr (kPasses == 1) return looked_up;
      return __shfl_sync(0xffffffffu, looked_up, pass * kPairsPerWarp + pair());
    };
    auto copy_tile = [&](auto transposed, int stage, Element const* base, int64_t token_stride, int looked_up) {
      Element* smem_tile = decltype(transposed)::value ? smem.v : smem.k;
      CUTE_UNROLL
      for (int pass = 0; pass < kPasses; ++pass) {
        const int cache_row = source_row(looked_up, pass);
        const bool valid = cache_row >= 0;
        // A zero-size copy reads nothing: the cache base stands in for rows past the request.
        const int64_t offset = valid ? int64_t(cache_row) * token_stride + head_offset : 0;
        copy_half_row<decltype(transposed)::value>(smem_tile, stage, first_row() + pass * kPairsPerWarp, half(),
                                                   base + offset, valid);
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
        // Pooled rows are contiguous: each pass forms its own row, no page table and no shuffle.
        const int64_t tile_base = int64_t(pooled_base) + int64_t(schedule.pooled_tile(c)) * Traits::kBlockN;
        pipeline_k.producer_wait_empty(state);
        CUTE_UNROLL
        for (int pass = 0; pass < kPasses; ++pass) {
          const int row = first_row() + pass * kPairsPerWarp;
          const bool valid = tile_base + row < params.pooled_rows;
          const int64_t offset = valid ? (tile_base + row) * params.cache_cols + head_offset : 0;
          copy_half_row<false>(smem.k, state.stage, row, half(), params.pooled_k + offset, valid);
        }
        pipeline_k.producer_commit_cp_async(state);
        pipeline_v.producer_wait_empty(state);
        CUTE_UNROLL
        for (int pass = 0; pass < kPasses; ++pass) {
          const int row = first_row() + pass * kPairsPerWarp;
          const bool valid = tile_base + row < params.pooled_rows;
          const int64_t offset = valid ? (tile_base + row) * params.cache_cols + head_offset : 0;
          copy_half_row<true>(smem.v, state.stage, row, half(), params.pooled_v + offset, valid);
        }
        pipeline_v.producer_commit_cp_async(state);
        state.advance();
      }
    }
  }
};

}  // namespace fpv2::hopper
