// An alternative cp.async gather of K/V for pages that are not a multiple of 128 (selected with
// FPV2_HOPPER_GATHER=shared; the default is kv_gather_producer.hpp). Each producer thread looks up one
// token's cache row (one page-table read per thread and tile, all in flight together) and publishes it in
// a double-buffered shared array; after one named barrier of the producer warpgroup, d / 8 consecutive
// threads copy the d / 8 16-byte chunks of one row, so a warp reads whole rows per instruction (two at
// d = 128, four at d = 64).
//
// Measured on the H200 (NOTES.md, 2026-12-01), page size 1: 540 ms dense at 128K (row per thread: 633),
// but 33.1 ms at 32K (row: 25.9) and no faster sparse: each tile's page reads wait at the barrier, with
// nothing prefetched. Kept for A/B runs.
// Pooled tiles have no page table and are copied coalesced directly.
#pragma once

#include <cstdint>

#include <cute/arch/copy_sm80.hpp>
#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "hopper/block_schedule.hpp"
#include "hopper/kv_pipeline.hpp"
#include "hopper/named_barriers.hpp"

namespace fpv2::hopper {

template <class Traits>
struct KvSharedRowsGatherProducer {
  using Element = typename Traits::Element;
  static constexpr int kElementsPerChunk = 16 / int(sizeof(Element));                  // 8 bf16 = 16 bytes
  static constexpr int kChunksPerRow = Traits::kHeadDim / kElementsPerChunk;            // 16 for d = 128, 8 for 64
  static constexpr int kRowsPerPass = Traits::kThreadsPerWarpGroup / kChunksPerRow;     // 8 for d = 128, 16 for 64
  static constexpr int kPasses = Traits::kBlockN / kRowsPerPass;                         // 16 for d = 128, 8 for 64
  static_assert(Traits::kThreadsPerWarpGroup % kChunksPerRow == 0, "a pass covers whole rows");
  static_assert(Traits::kBlockN % kRowsPerPass == 0, "the passes cover the tile's rows");

  // The thread's chunk of every kRowsPerPass-th row of a tile, into K (row-major (N, d)) or V^T ((d, N)) of
  // `stage`. element_offset(row) is the row's first element (chunk 0) in `base`, or -1 for a row past the
  // end (zero-filled: a zero-size cp.async reads nothing, so `base` stands in as its source).
  template <bool kTransposed, class Smem, class RowOffset>
  __device__ __forceinline__ static void copy_tile(Smem& smem_tile, int stage, int thread, Element const* base,
                                                   RowOffset const& element_offset) {
    const int chunk = thread % kChunksPerRow;
    const int first_row = thread / kChunksPerRow;
#pragma unroll 1  // the producer has 24 registers: unrolling spills
    for (int pass = 0; pass < kPasses; ++pass) {
      const int row = first_row + pass * kRowsPerPass;
      const int64_t offset = element_offset(row);
      const bool valid = offset >= 0;
      Element const* src = base + (valid ? offset + chunk * kElementsPerChunk : 0);
      Element* dst = kTransposed ? &smem_tile(chunk * kElementsPerChunk, row, stage)
                                 : &smem_tile(row, chunk * kElementsPerChunk, stage);
      cute::SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<cute::uint128_t>::copy(
          *reinterpret_cast<cute::uint128_t const*>(src), *reinterpret_cast<cute::uint128_t*>(dst), valid);
    }
  }

  template <class Params, class Geometry, class Storage>
  __device__ static void run(Params const& params, Geometry const& tile, Storage& smem, int thread,
                             typename KvPipeline<Traits::kStages>::State& state, int& round) {
    using namespace cute;
    using Pipeline = KvPipeline<Traits::kStages>;
    Tensor sK = make_tensor(make_smem_ptr(smem.k), typename Traits::SmemLayoutK{});    // (N, d, stages)
    Tensor sVt = make_tensor(make_smem_ptr(smem.v), typename Traits::SmemLayoutVt{});  // (d, N, stages)

    int32_t const* pages = params.page_table + int64_t(tile.request) * params.page_table_stride;
    const int page_size = params.page_size;
    const int head_offset = tile.kv_head * Traits::kHeadDim;

    const BlockScheduleFor<Traits> schedule = BlockScheduleFor<Traits>::make(params, tile, Traits::kBlockN);
    Pipeline pipeline_k(smem.pipeline_k);
    Pipeline pipeline_v(smem.pipeline_v);
    CUTE_NO_UNROLL
    for (int i = 0; i < schedule.num_kept; ++i) {
      // Each thread looks up one token's cache row (one page-table read per thread and tile, all in flight
      // together) and publishes it; the copies then read the rows they need from shared memory. Two
      // buffers: a buffer is rewritten only after every thread has passed the next tile's barrier.
      int32_t* rows = smem.gather_rows[round & 1];  // alternates over the kept tiles of every query tile
      ++round;
      const int token = schedule.block(i) * Traits::kBlockN + thread;
      if (Traits::kBlockN == Traits::kThreadsPerWarpGroup || thread < Traits::kBlockN) {  // 64-token tiles: half
        rows[thread] = token < tile.seqlen_k ? pages[token / page_size] * page_size + token % page_size : -1;
      }
      cutlass::arch::NamedBarrier::sync(Traits::kThreadsPerWarpGroup, barrier_id(ProducerBarrier::kGatherRows));
      pipeline_k.producer_wait_empty(state);
      copy_tile<false>(sK, state.stage, thread, params.k_cache, [&](int row) -> int64_t {
        const int cache_row = rows[row];
        return cache_row < 0 ? -1 : int64_t(cache_row) * params.k_token_stride + head_offset;
      });
      pipeline_k.producer_commit_cp_async(state);
      pipeline_v.producer_wait_empty(state);
      copy_tile<true>(sVt, state.stage, thread, params.v_cache, [&](int row) -> int64_t {
        const int cache_row = rows[row];
        return cache_row < 0 ? -1 : int64_t(cache_row) * params.v_token_stride + head_offset;
      });
      pipeline_v.producer_commit_cp_async(state);
      state.advance();
    }

    if (schedule.num_correction > 0) {
      const int pooled_base = params.pooled_block_offsets[tile.request];
      CUTE_NO_UNROLL
      for (int c = 0; c < schedule.num_correction; ++c) {
        const int first = pooled_base + schedule.pooled_tile(c) * Traits::kBlockN;
        auto pooled_offset = [&](int row) -> int64_t {
          const int pooled_row = first + row;
          return pooled_row < params.pooled_rows ? int64_t(pooled_row) * params.cache_cols + head_offset : -1;
        };
        pipeline_k.producer_wait_empty(state);
        copy_tile<false>(sK, state.stage, thread, params.pooled_k, pooled_offset);
        pipeline_k.producer_commit_cp_async(state);
        pipeline_v.producer_wait_empty(state);
        copy_tile<true>(sVt, state.stage, thread, params.pooled_v, pooled_offset);
        pipeline_v.producer_commit_cp_async(state);
        state.advance();
      }
    }
  }
};

}  // namespace fpv2::hopper
