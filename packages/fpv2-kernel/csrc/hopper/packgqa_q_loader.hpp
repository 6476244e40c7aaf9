// Loads the PackGQA query rows of one consumer warpgroup into the swizzled shared-memory Q tile.
//
// Packed row r of the tile's KV head h is query token q_start + r / g, query head h * g + r % g
// (ALGORITHM.md section 2): rows of one position are consecutive heads, so a tile is not a TMA box of
// the (total_q, Hq, d) tensor for every g; it is gathered with 16-byte cp.async instead. Each consumer
// warpgroup loads (and later stores) only its own 64 rows, so no other warpgroup waits on it. Rows past
// the request are zero-filled and never stored.
#pragma once

#include <cstdint>

#include <cute/arch/copy_sm80.hpp>
#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "hopper/packed_row.hpp"
#include "hopper/tile_geometry.hpp"

namespace fpv2::hopper {

template <class Traits>
struct PackGqaQueryLoader {
  using Element = typename Traits::Element;
  static constexpr int kElementsPerChunk = 16 / int(sizeof(Element));            // 8 bf16 = 16 bytes
  static constexpr int kChunksPerRow = Traits::kHeadDim / kElementsPerChunk;      // 16 for d = 128, 8 for 64
  static constexpr int kRowsPerPass = Traits::kThreadsPerWarpGroup / kChunksPerRow;  // 8 for d = 128, 16 for 64
  static constexpr int kPasses = Traits::kRowsPerConsumer / kRowsPerPass;         // 8 for d = 128, 4 for 64
  static_assert(Traits::kThreadsPerWarpGroup % kChunksPerRow == 0, "a pass covers whole rows");
  static_assert(Traits::kRowsPerConsumer % kRowsPerPass == 0, "the passes cover the warpgroup's rows");

  // Issues the copies of warpgroup `wg` (thread `t` of 128) as one cp.async group, without waiting: a
  // persistent CTA issues the next tile's rows before the current tile's epilogue (consumer_mainloop.hpp).
  template <class SmemQ, class Params, class Geometry>
  __device__ __forceinline__ static void issue(SmemQ& sQ, Params const& params, Geometry const& tile, int wg, int t) {
    const int chunk = t % kChunksPerRow;
    CUTE_UNROLL
    for (int pass = 0; pass < kPasses; ++pass) {
      const int row = wg * Traits::kRowsPerConsumer + pass * kRowsPerPass + t / kChunksPerRow;
      const int packed = tile.row_begin + row;
      const bool inside = packed < tile.num_rows;
      Element const* src = params.q;  // any valid address: a zero-size cp.async reads nothing
      if (inside) {
        src = params.q + PackedRow::at(params, tile, packed).offset(params.q_token_stride, params.q_head_stride) +
              chunk * kElementsPerChunk;
      }
      Element* dst = &sQ(row, chunk * kElementsPerChunk);
      cute::SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<cute::uint128_t>::copy(
          *reinterpret_cast<cute::uint128_t const*>(src), *reinterpret_cast<cute::uint128_t*>(dst), inside);
    }
    cute::cp_async_fence();
  }

  // Waits for the thread's issued rows and makes them visible to wgmma. The caller still synchronises the
  // warpgroup before its first wgmma reads the tile.
  __device__ __forceinline__ static void wait() {
    cute::cp_async_wait<0>();
    // cp.async writes through the generic proxy; wgmma reads through the async proxy.
    cutlass::arch::fence_view_async_shared();
  }
};

}  // namespace fpv2::hopper
