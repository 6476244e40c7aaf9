// Clears the V rows of the request's partial last KV block before the PV product.
//
// The TMA copies whole 128-token tiles out of a page, so in the block holding the request's last token the
// rows past seqlen_k are whatever the cache page holds (stale tokens of an earlier request, or NaN). Their
// probabilities are exactly 0, but 0 * NaN = NaN in the tensor cores, so the rows are zeroed in shared
// memory. Both consumer warpgroups read the stage, so each clears half and they meet at a named barrier.
// Only the one tail block of a tile pays for this.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "hopper/named_barriers.hpp"

namespace fpv2::hopper {

template <class Traits>
struct ValueTailGuard {
  static constexpr int kElementsPerChunk = 16 / int(sizeof(typename Traits::Element));
  static constexpr int kChunksPerRow = Traits::kHeadDim / kElementsPerChunk;

  // sVt: (d, kv, stage) MN-major; along d, 8 consecutive elements are one 16-byte chunk even when swizzled.
  template <class SmemVt>
  __device__ __forceinline__ static void clear(SmemVt& sVt, int stage, int valid_rows, int consumer_thread) {
    const int chunks = (Traits::kBlockN - valid_rows) * kChunksPerRow;
    for (int i = consumer_thread; i < chunks; i += Traits::kNumConsumerThreads) {
      const int kv = valid_rows + i / kChunksPerRow;
      const int col = (i % kChunksPerRow) * kElementsPerChunk;
      *reinterpret_cast<uint4*>(&sVt(col, kv, stage)) = make_uint4(0u, 0u, 0u, 0u);
    }
    // Plain stores, read next by wgmma (async proxy) and later overwritten by TMA (async proxy).
    cutlass::arch::fence_view_async_shared();
    cutlass::arch::NamedBarrier::sync(Traits::kNumConsumerThreads, barrier_id(ConsumerBarrier::kValueTailCleared));
  }
};

}  // namespace fpv2::hopper
