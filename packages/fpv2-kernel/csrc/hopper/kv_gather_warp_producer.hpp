// A cp.async gather of K/V for pages that are not a multiple of 128 in which every warp instruction reads
// whole cache rows (selected with FPV2_HOPPER_GATHER=warp; the default is kv_gather_producer.hpp).
//
// Warp w of the producer warpgroup owns rows 32 w .. 32 w + 31 of each KV tile. Lane l looks up the cache
// row of token 32 w + l once per tile (one coalesced page-table read per warp), one tile ahead so the read
// is in flight while the stage before is being filled. The copies then take 32 / (d / 8) rows per
// instruction: at d = 128 lanes 0-15 copy the sixteen 16-byte chunks of one row and lanes 16-31 those of the
// next (at d = 64, four rows of eight lanes each), and each lane gets its row's cache index from the owning
// lane by a warp shuffle.
//
// Measured on the H200 (benchmarks/NOTES.md, 2026-12-01), page size 1: with one row per thread
// (kv_gather_producer.hpp) every 16-byte copy is half of a 32-byte sector of a different line and the L2
// runs at 95% of its throughput (ncu, 32K dense: 25.8 ms; TMA at page 128: 14.2 ms). This layout takes
// the L2 down to 18% but its 32 shuffle + copy steps per tile make the producer latency-bound: 29.7 ms at
// 32K, while at 128K (where the row layout also misses in L2) it is 25% faster than the row layout
// (474 vs 633 ms dense, 16.5 vs 18.5 ms sparse). A layout with 4 lanes per row (whole sectors, 4 steps
// per tile) did not fit the producer's 24 registers (inlined it made ptxas copy the kernel parameters
// to the stack; not inlined it spilled 124 bytes).
//
// Rows past the request's length are zero-filled (a zero-size cp.async reads nothing). Each thread arrives
// on the stage's full barrier once its own copies have landed (128 arrivals per stage, as in the other
// gather layouts). The pooled tiles of the correction are contiguous rows: copied the same way, with no
// page table.
#pragma once

#include <cstdint>

#include <cute/arch/copy_sm80.hpp>
#include <cute/tensor.hpp>

#include "hopper/block_schedule.hpp"
#include "hopper/kv_pipeline.hpp"

namespace fpv2::hopper {

template <class Traits>
struct KvWarpGatherProducer {
  using Element = typename Traits::Element;
  static constexpr int kElementsPerChunk = 16 / int(sizeof(Element));        // 8 bf16 = 16 bytes
  static constexpr int kChunksPerRow = Traits::kHeadDim / kElementsPerChunk;  // 16 for d = 128, 8 for 64
  static constexpr int kRowsPerInstruction = 32 / kChunksPerRow;              // 2 for d = 128, 4 for 64
  static constexpr int kRowsPerWarp = 32;
  static_assert(32 % kChunksPerRow == 0, "a warp instruction covers whole rows");
  // One owning lane per token row of a tile: at 64-token tiles (d = 256) warps 2 and 3 own none and only
  // arrive on each stage.
  static_assert(Traits::kBlockN % kRowsPerWarp == 0 && Traits::kBlockN <= Traits::kThreadsPerWarpGroup,
                "whole warps own the token rows of a tile");
  static constexpr bool kEveryWarpOwnsRows = Traits::kBlockN == Traits::kThreadsPerWarpGroup;

  // The warp's 32 rows of a tile into K (row-major (N, d)) or V^T ((d, N)) of `stage`. `owned` is the source
  // row (in rows of `row_stride` elements from `base`) of the tile row this lane owns (lane l owns row
  // first_row + l), or -1 past the end; the shuffle moves 32 bits, the 64-bit offset is formed after it.
  template <bool kTransposed, class Smem>
  __device__ __forceinline__ static void copy_rows(Smem& smem_tile, int stage, int first_row, int lane,
                                                   Element const* base, int owned, int64_t row_stride) {
    const int chunk = lane % kChunksPerRow;
    const int sub_row = lane / kChunksPerRow;
#pragma unroll 1  // the producer has 24 registers: unrolling spills
    for (int r = 0; r < kRowsPerWarp; r += kRowsPerInstruction) {
      const int source_row = __shfl_sync(0xffffffffu, owned, r + sub_row);
      const bool valid = source_row >= 0;
      const int row = first_row + r + sub_row;
      Element const* src = base + (valid ? int64_t(source_row) * row_stride + chunk * kElementsPerChunk : 0);
      Element* dst = kTransposed ? &smem_tile(chunk * kElementsPerChunk, row, stage)
                                 : &smem_tile(row, chunk * kElementsPerChunk, stage);
      cute::SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<cute::uint128_t>::copy(
          *reinterpret_cast<cute::uint128_t const*>(src), *reinterpret_cast<cute::uint128_t*>(dst), valid);
    }
  }

  template <class Params, class Geometry, class Storage>
  __device__ static void run(Params const& params, Geometry const& tile, Storage& smem, int thread,
                             typename KvPipeline<Traits::kStages>::State& state) {
    using namespace cute;
    using Pipeline = KvPipeline<Traits::kStages>;
    Tensor sK = make_tensor(make_smem_ptr(smem.k), typename Traits::SmemLayoutK{});    // (N, d, stages)
    Tensor sVt = make_tensor(make_smem_ptr(smem.v), typename Traits::SmemLayoutVt{});  // (d, N, stages)

    const int lane = thread % 32;
    const int first_row = (thread / 32) * kRowsPerWarp;
    const bool owns_rows = kEveryWarpOwnsRows || first_row < Traits::kBlockN;  // uniform over the warp
    int32_t const* pages = params.page_table + int64_t(tile.request) * params.page_table_stride;
    const int page_size = params.page_size;
    const int head_offset = tile.kv_head * Traits::kHeadDim;
    // Cache row of the token this lane owns in block n, or -1 past the request's KV length (32 bits: the
    // launcher refuses caches of 2^31 rows or more).
    auto cache_row_of = [&](int n_block) -> int {
      const int token = n_block * Traits::kBlockN + first_row + lane;
      if (token >= tile.seqlen_k) return -1;
      return pages[token / page_size] * page_size + token % page_size;
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
      if (owns_rows) copy_rows<false>(sK, state.stage, first_row, lane, params.k_cache + head_offset, cache_row,
                       params.k_token_stride);
      pipeline_k.producer_commit_cp_async(state);
      pipeline_v.producer_wait_empty(state);
      if (owns_rows) copy_rows<true>(sVt, state.stage, first_row, lane, params.v_cache + head_offset, cache_row,
                      params.v_token_stride);
      pipeline_v.producer_commit_cp_async(state);
      state.advance();
      cache_row = next_row;
    }

    if (schedule.num_correction > 0) {
      const int pooled_base = params.pooled_block_offsets[tile.request];
      CUTE_NO_UNROLL
      for (int c = 0; c < schedule.num_correction; ++c) {
        const int pooled_row = pooled_base + schedule.pooled_tile(c) * Traits::kBlockN + first_row + lane;
        const int owned = pooled_row < params.pooled_rows ? pooled_row : -1;
        pipeline_k.producer_wait_empty(state);
        if (owns_rows) copy_rows<false>(sK, state.stage, first_row, lane, params.pooled_k + head_offset, owned, params.cache_cols);
        pipeline_k.producer_commit_cp_async(state);
        pipeline_v.producer_wait_empty(state);
        if (owns_rows) copy_rows<true>(sVt, state.stage, first_row, lane, params.pooled_v + head_offset, owned, params.cache_cols);
        pipeline_v.producer_commit_cp_async(state);
        state.advance();
      }
    }
  }
};

}  // namespace fpv2::hopper
