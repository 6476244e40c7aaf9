// The mean correction on the consumer side (ALGORITHM.md section 6): which pooled rows of a pooled tile
// count, and the log|B_J| shift of their logits.
//
// Pooled row J of the request stands in for pruned block J when it is eligible: J < n_block_masked (fully
// visible to the tile's first row) and J is not among the tile's kept blocks. Its logit is
// q . kbar_J * scale + log|B_J|; in the kernel's raw-score units (scores are scaled inside the softmax) the
// shift is log|B_J| / scale. Other columns of the tile (kept blocks, the diagonal band, the next request's
// rows, TMA zero fill) are replaced by -inf, so they carry no probability.
//
// The kept blocks are marked once per tile in a shared-memory bitmap (one bit per block below
// n_block_masked, built by all consumer threads from the CSR segment); the todo bits of a pooled tile are
// then ~kept & eligible, the same bits the plan's todo masks hold, derived without a host pass.
#pragma once

#include <cmath>
#include <cstdint>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "hopper/block_schedule.hpp"
#include "hopper/dense_prefill_plan.hpp"
#include "hopper/named_barriers.hpp"

namespace fpv2::hopper {

struct KeptBitmapStorage {
  uint32_t words[kMaxCorrectionBlocks / 32];
};

template <class Traits>
struct CorrectionMask {
  // Consumer threads, once per tile, before the first pooled tile: bit J set <=> block J (< n_block_masked)
  // is kept. Ends with a barrier of all consumer threads.
  __device__ __forceinline__ static void build_kept_bitmap(KeptBitmapStorage& bitmap, BlockSchedule const& schedule,
                                                           int n_block_masked, int consumer_thread) {
    const int num_words = (n_block_masked + 31) / 32;
    for (int w = consumer_thread; w < num_words; w += Traits::kNumConsumerThreads) {
      bitmap.words[w] = 0u;
    }
    cutlass::arch::NamedBarrier::sync(Traits::kNumConsumerThreads, barrier_id(ConsumerBarrier::kKeptBitmap));
    for (int i = consumer_thread; i < schedule.num_kept; i += Traits::kNumConsumerThreads) {
      const int j = schedule.kept[i];
      if (j >= 0 && j < n_block_masked) {
        atomicOr(&bitmap.words[j >> 5], 1u << (j & 31));
      }
    }
    cutlass::arch::NamedBarrier::sync(Traits::kNumConsumerThreads, barrier_id(ConsumerBarrier::kKeptBitmap));
  }

  // Adds the shift of each eligible column of pooled tile `pooled_tile` and replaces the others by -inf.
  // scores_rc / coords_rc: the thread's (rows x cols) view of S and of its (row, col) coordinates.
  template <class ScoresRowsCols, class CoordsRowsCols, class Params>
  __device__ __forceinline__ static void apply(ScoresRowsCols& scores_rc, CoordsRowsCols const& coords_rc,
                                               KeptBitmapStorage const& bitmap, Params const& params,
                                               int pooled_base, int n_block_masked, int pooled_tile) {
    using namespace cute;
    const int first = pooled_tile * Traits::kBlockN;
    CUTE_UNROLL
    for (int j = 0; j < size<1>(scores_rc); ++j) {
      const int block = first + int(get<1>(coords_rc(0, j)));
      float shift = -INFINITY;
      if (block < n_block_masked && ((bitmap.words[block >> 5] >> (block & 31)) & 1u) == 0u) {
        const int length = params.block_lengths[pooled_base + block];
        if (length > 0) {
          shift = __logf(float(length)) * params.inverse_softmax_scale;
        }
      }
      CUTE_UNROLL
      for (int i = 0; i < size<0>(scores_rc); ++i) {
        scores_rc(i, j) = shift == -INFINITY ? -INFINITY : scores_rc(i, j) + shift;
      }
    }
  }
};

}  // namespace fpv2::hopper
