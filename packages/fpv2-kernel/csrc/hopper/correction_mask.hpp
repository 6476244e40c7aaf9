// The mean correction on the consumer side (ALGORITHM.md section 6): which pooled rows of a pooled tile
// count, and the log|B_J| shift of their logits.
//
// Pooled row J of the request stands in for pruned block J when it is eligible: J < n_block_masked (fully
// visible to the tile's first row) and J is not among the tile's kept blocks. Its logit is
// q . kbar_J * scale + log|B_J|; in the kernel's raw-score units (scores are scaled inside the softmax) the
// shift is log|B_J| / scale. Other columns of the tile (kept blocks, the diagonal band, the next request's
// rows, TMA zero fill) are replaced by -inf, so they carry no probability.
//
// Once per tile the consumers copy |B_J| of every block below n_block_masked into a shared-memory byte
// table (coalesced reads of block_lengths) and zero the entries of the tile's kept blocks (from the CSR
// segment): a non-zero entry is a todo bit of the plan, with its length. Each pooled tile then costs one
// shared byte load and one lg2 per column, instead of global loads in the softmax's critical path.
#pragma once

#include <cmath>
#include <cstdint>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "hopper/block_schedule.hpp"
#include "hopper/prefill_plan.hpp"
#include "hopper/named_barriers.hpp"

namespace fpv2::hopper {

struct PendingLengthsStorage {
  uint8_t length[kMaxCorrectionBlocks];  // |B_J| (<= 128) of an eligible pruned block, 0 otherwise
};

template <class Traits>
struct CorrectionMask {
  static_assert(Traits::kBlockN <= 255, "block lengths are stored in one byte");

  // Consumer threads, once per tile, before the first pooled tile. Ends with a barrier of all consumer
  // threads.
  template <class Params>
  __device__ __forceinline__ static void build(PendingLengthsStorage& table, Params const& params,
                                               BlockSchedule const& schedule, int pooled_base, int n_block_masked,
                                               int consumer_thread) {
    for (int j = consumer_thread; j < n_block_masked; j += Traits::kNumConsumerThreads) {
      const int length = params.block_lengths[pooled_base + j];
      table.length[j] = static_cast<uint8_t>(length < 0 ? 0 : (length > Traits::kBlockN ? Traits::kBlockN : length));
    }
    cutlass::arch::NamedBarrier::sync(Traits::kNumConsumerThreads, barrier_id(ConsumerBarrier::kPendingLengths));
    for (int i = consumer_thread; i < schedule.num_kept; i += Traits::kNumConsumerThreads) {
      const int j = schedule.kept[i];
      if (j >= 0 && j < n_block_masked) {
        table.length[j] = 0;
      }
    }
    cutlass::arch::NamedBarrier::sync(Traits::kNumConsumerThreads, barrier_id(ConsumerBarrier::kPendingLengths));
  }

  // Adds the shift of each eligible column of pooled tile `pooled_tile` and replaces the others by -inf.
  // scores_rc / coords_rc: the thread's (rows x cols) view of S and of its (row, col) coordinates;
  // log2_to_raw = ln(2) / softmax_scale turns log2|B| into the raw-score shift.
  template <class ScoresRowsCols, class CoordsRowsCols>
  __device__ __forceinline__ static void apply(ScoresRowsCols& scores_rc, CoordsRowsCols const& coords_rc,
                                               PendingLengthsStorage const& table, float log2_to_raw,
                                               int n_block_masked, int pooled_tile) {
    using namespace cute;
    const int first = pooled_tile * Traits::kBlockN;
    const float full_shift = __log2f(float(Traits::kBlockN)) * log2_to_raw;
    CUTE_UNROLL
    for (int j = 0; j < size<1>(scores_rc); ++j) {
      const int block = first + int(get<1>(coords_rc(0, j)));
      const int length = block < n_block_masked ? int(table.length[block]) : 0;
      // Eligible blocks are full in practice (a shorter block is a request's last one, the diagonal block of
      // the tiles that see it whole): skip the lg2 for them, the same value bit for bit.
      const float shift = length == Traits::kBlockN ? full_shift : __log2f(float(length)) * log2_to_raw;
      CUTE_UNROLL
      for (int i = 0; i < size<0>(scores_rc); ++i) {
        scores_rc(i, j) = length == 0 ? -INFINITY : scores_rc(i, j) + shift;
      }
    }
  }
};

}  // namespace fpv2::hopper
