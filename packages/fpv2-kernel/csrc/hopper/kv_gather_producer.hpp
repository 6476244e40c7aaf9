// The producer of the prefill kernel for page sizes that are not a multiple of the kBlockN-token tile (1, 16,
// 64, ...): the 128 threads of the producer warpgroup gather the K and V rows of each KV tile of the
// BlockSchedule with 16-byte cp.async, one token row per thread (one page-table read per thread and
// tile), in the order the consumers read them.
//
// Measured on the H200 (benchmarks/NOTES.md), at page size 1: dense 128K 642 ms (TMA at page 128:
// 250 ms): a warp's 16-byte pieces come from 32 different rows. The coalesced alternative (16 threads
// per row, each looking up its own rows' pages) was 2x slower still: 16 serial page-table reads per
// thread and tile. Next: one lookup per thread shared through shared memory, then coalesced copies.
//
// Row r of KV block n is token t = 128 n + r, at slot t % page_size of page page_table[b][t / page_size],
// i.e. row page * page_size + t % page_size of the (num_pages * page_size, Hkv * d) view of the cache
// (the same view the TMA path uses). Rows past the request's length are zero-filled (a zero-size cp.async
// reads nothing), so stale or NaN cache slots never reach shared memory. The pooled tiles of the mean
// correction are gathered the same way from the (total_blocks, Hkv * d) pooled tensors.
//
// Each thread issues its copies of a K (then V) tile into a stage, then arrives on that stage's full
// barrier when they have landed (cp.async.mbarrier.arrive.noinc; the barrier expects 128 arrivals in this
// mode). The warpgroup runs in 24 registers (the consumers need the rest): cache rows are 32-bit, each
// source address is formed just before its copies and the destinations are 32-bit shared addresses
// (copy_row), which leaves ptxas nothing to spill here. The consumers fence the async proxy after their
// wait before wgmma reads the stage (cp.async writes through the generic proxy). The next tile's page id
// is read before waiting for a free stage.
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
  // One thread per token row of a 128-token tile; at 64-token tiles (d = 256) two threads share a row, each
  // copying half of its 128-byte segments, so that every producer thread still arrives on each stage.
  static constexpr int kThreadsPerRow = Traits::kThreadsPerWarpGroup / Traits::kBlockN;           // 1, or 2 at d = 256
  static constexpr int kSegmentsPerThread = kSegmentsPerRow / kThreadsPerRow;
  static_assert(Traits::kThreadsPerWarpGroup % Traits::kBlockN == 0, "whole threads per token row of a tile");
  static_assert(kSegmentsPerRow % kThreadsPerRow == 0, "the threads of a row share its segments evenly");

  // One 16-byte copy per chunk of the thread's row: into K (row-major (N, d)) or V^T ((d, N)) of `stage`, at
  // 32-bit shared addresses (with CuTe's 64-bit swizzled pointers ptxas spilled in 24 registers: 4 bytes at
  // d = 128, 20 at d = 64). Within one 128-byte segment of a row the 128-byte swizzle permutes the eight
  // chunks by XOR with the row's swizzle phase, so chunk k of a segment lies at the address of chunk 0 XOR
  // 16 k (the stage buffers are 1024-byte aligned): one layout evaluation per segment, the rest immediates.
  // fpv2_hopper_layout_check checks both facts on the layouts of every built head dim.
  // `part` (0 .. kThreadsPerRow - 1): which of the row's kThreadsPerRow shares of segments this thread copies.
  template <bool kTransposed>
  __device__ __forceinline__ static void copy_row(Element* smem_tile, int stage, int row, int part, Element const* src,
                                                  bool valid) {
    using Layout = cute::conditional_t<kTransposed, typename Traits::SmemLayoutVt, typename Traits::SmemLayoutK>;
    const uint32_t tile_address = cute::cast_smem_ptr_to_uint(smem_tile);
    CUTE_UNROLL
    for (int s = 0; s < kSegmentsPerThread; ++s) {
      const int col = (part * kSegmentsPerThread + s) * kElementsPerSegment;
      const int first = kTransposed ? smem_offset<Layout>(col, row, stage) : smem_offset<Layout>(row, col, stage);
      const uint32_t address = tile_address + uint32_t(first) * uint32_t(sizeof(Element));
      CUTE_UNROLL
      for (int k = 0; k < kChunksPerSegment; ++k) {
        cp_async_16_zfill(address ^ uint32_t(16 * k), src + col + k * kElementsPerChunk, valid);
      }
    }
  }

  template <class Params, class Geometry, class Storage>
  __device__ static void run(Params const& params, Geometry const& tile, Storage& smem, int thread,
                             typename KvPipeline<Traits::kStages>::State& state) {
    using namespace cute;
    using Pipeline = KvPipeline<Traits::kStages>;
    const int row = kThreadsPerRow == 1 ? thread : thread % Traits::kBlockN;  // the token row of the tile
    const int part = kThreadsPerRow == 1 ? 0 : thread / Traits::kBlockN;

    int32_t const* pages = params.page_table + int64_t(tile.request) * params.page_table_stride;
    const int page_size = params.page_size;
    const int64_t head_offset = int64_t(tile.kv_head) * Traits::kHeadDim;
    // Cache row of this thread's token in block n, or -1 past the request's KV length (32 bits: the launcher
    // refuses caches of 2^31 rows or more; the producer runs in 24 registers).
    auto cache_row_of = [&](int n_block) -> int {
      const int token = n_block * Traits::kBlockN + row;
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
      const bool valid = cache_row >= 0;
      const int64_t row_k = valid ? int64_t(cache_row) * params.k_token_stride + head_offset : 0;
      const int64_t row_v = valid ? int64_t(cache_row) * params.v_token_stride + head_offset : 0;
      // A zero-size copy reads nothing: the cache base stands in for rows past the request.
      pipeline_k.producer_wait_empty(state);
      copy_row<false>(smem.k, state.stage, row, part, params.k_cache + row_k, valid);
      pipeline_k.producer_commit_cp_async(state);
      pipeline_v.producer_wait_empty(state);
      copy_row<true>(smem.v, state.stage, row, part, params.v_cache + row_v, valid);
      pipeline_v.producer_commit_cp_async(state);
      state.advance();
      cache_row = next_row;
    }

    if (schedule.num_correction > 0) {
      const int pooled_base = params.pooled_block_offsets[tile.request];
      CUTE_NO_UNROLL
      for (int c = 0; c < schedule.num_correction; ++c) {
        const int64_t pooled_row = int64_t(pooled_base) + int64_t(schedule.pooled_tile(c)) * Traits::kBlockN + row;
        const bool valid = pooled_row < params.pooled_rows;
        const int64_t offset = valid ? pooled_row * params.cache_cols + head_offset : 0;
        pipeline_k.producer_wait_empty(state);
        copy_row<false>(smem.k, state.stage, row, part, params.pooled_k + offset, valid);
        pipeline_k.producer_commit_cp_async(state);
        pipeline_v.producer_wait_empty(state);
        copy_row<true>(smem.v, state.stage, row, part, params.pooled_v + offset, valid);
        pipeline_v.producer_commit_cp_async(state);
        state.advance();
      }
    }
  }
};

}  // namespace fpv2::hopper
