// The mean correction on the consumer side (ALGORITHM.md section 6): which pooled rows of a pooled tile
// count, and the log|B_J| shift of their logits.
//
// Pooled row J of the request stands in for pruned block J when it is eligible: J < n_eligible (fully
// visible to the tile's first row: TileGeometry::n_pooled_eligible) and J is not among the tile's kept blocks. Its logit is
// q . kbar_J * scale + log|B_J|; in the kernel's raw-score units (scores are scaled inside the softmax) the
// shift is log|B_J| / scale. Other columns of the tile (kept blocks, the diagonal band, the next request's
// rows, TMA zero fill) are replaced by -inf, so they carry no probability.
//
// Once per tile the consumers write the shift of every pooled row the tile's pooled tiles cover into a
// shared-memory float table (coalesced reads of block_lengths, one lg2 per row), -inf for rows that are not
// eligible: rows past n_eligible, and the tile's kept blocks (from the CSR segment). A pooled tile then
// costs one 8-byte shared load per pair of a thread's columns and an add and a max per score: no
// per-column lg2 (a quarter-rate MUFU op that ptxas issued for every column even when predicated off; with
// the byte loads and selects around it, the mask was 43% of the correction's extra time at 128K, ncu
// 2026-12-01).
#pragma once

#include <cmath>
#include <cstdint>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "hopper/block_schedule.hpp"
#include "hopper/prefill_plan.hpp"
#include "hopper/named_barriers.hpp"

namespace fpv2::hopper {

template <int kRows>
struct PendingShiftsStorage {
  // Raw-score shift log|B_J| / scale of pooled row J when block J is eligible, -inf otherwise; rows up to
  // the end of the tile's last pooled tile are written.
  alignas(16) float shift[kRows];
};

// The table of the instantiation `Traits`: max_correction_blocks(d) rows.
template <class Traits>
using PendingShiftsFor = PendingShiftsStorage<max_correction_blocks(Traits::kHeadDim)>;

template <class Traits>
struct CorrectionMask {
  using Table = PendingShiftsFor<Traits>;
  static_assert(max_correction_blocks(Traits::kHeadDim) % Traits::kBlockN == 0, "pooled tiles never run past the table");

  // Consumer threads, once per tile, before the first pooled tile. Ends with a barrier of all consumer
  // threads. log2_to_raw = ln(2) / softmax_scale turns log2|B| into the raw-score shift.
  template <class Params>
  __device__ __forceinline__ static void build(Table& table, Params const& params,
                                               BlockScheduleFor<Traits> const& schedule, int pooled_base, int n_eligible,
                                               float log2_to_raw, int consumer_thread) {
    // The rows of this CTA's pooled tiles (all of them without split-KV).
    const int first_row = schedule.first_pooled_tile() * Traits::kBlockN;
    const int rows = (schedule.first_pooled_tile() + schedule.num_correction) * Traits::kBlockN;
    for (int j = first_row + consumer_thread; j < rows; j += Traits::kNumConsumerThreads) {
      float shift = -INFINITY;
      if (j < n_eligible) {
        const int length = params.block_lengths[pooled_base + j];
        // The plan checks 1 <= |B_J| <= block_size; clamp anyway so that a bad length cannot raise a
        // pooled term above its block's token count.
        if (length > 0) shift = __log2f(float(length < Traits::kBlockSize ? length : Traits::kBlockSize)) * log2_to_raw;
      }
      table.shift[j] = shift;
    }
    cutlass::arch::NamedBarrier::sync(Traits::kNumConsumerThreads, barrier_id(ConsumerBarrier::kPendingShifts));
    for (int i = consumer_thread; i < schedule.num_kept_blocks; i += Traits::kNumConsumerThreads) {
      const int j = schedule.kept[i];
      if (j >= 0 && j < n_eligible) {
        table.shift[j] = -INFINITY;
      }
    }
    cutlass::arch::NamedBarrier::sync(Traits::kNumConsumerThreads, barrier_id(ConsumerBarrier::kPendingShifts));
  }

  // On the TMA path of one CTA per tile the producer warpgroup's warps 1..3 (idle there: one thread of warp 0
  // issues the TMA copies) fill the table instead, while the consumers gather Q and run the kept blocks;
  // the consumers wait for it at their first pooled tile (await_built). kBuilders threads, builder index
  // 0..kBuilders-1. Row j is owned by builder j % kBuilders, which writes its shift and then, scanning the
  // tile's kept ids, its -inf: program order replaces build()'s barrier between the two passes. (With
  // split-KV, rows are counted from the split's first pooled row.)
  // ln(2) / softmax_scale: turns log2|B| into the raw-score shift.
  template <class Params>
  __device__ __forceinline__ static float log2_to_raw(Params const& params) {
    return 0.69314718055994531f * params.inverse_softmax_scale;
  }

  static constexpr int kBuilders = Traits::kThreadsPerWarpGroup - 32;
  static constexpr int kBuiltArrivals = kBuilders + Traits::kNumConsumerThreads;

  template <class Params>
  __device__ __forceinline__ static void build_by_producer(Table& table, Params const& params,
                                                           BlockScheduleFor<Traits> const& schedule, int pooled_base,
                                                           int n_eligible, float log2_to_raw, int builder) {
    const int first_row = schedule.first_pooled_tile() * Traits::kBlockN;
    const int rows = (schedule.first_pooled_tile() + schedule.num_correction) * Traits::kBlockN;
    for (int j = first_row + builder; j < rows; j += kBuilders) {
      float shift = -INFINITY;
      if (j < n_eligible) {
        const int length = params.block_lengths[pooled_base + j];
        if (length > 0) shift = __log2f(float(length < Traits::kBlockSize ? length : Traits::kBlockSize)) * log2_to_raw;
      }
      table.shift[j] = shift;
    }
    for (int i = 0; i < schedule.num_kept_blocks; ++i) {
      const int j = schedule.kept[i];
      const bool owned = Traits::kSplitKv ? j >= first_row && j < rows && (j - first_row) % kBuilders == builder
                                          : j >= 0 && j % kBuilders == builder;
      if (owned && j < n_eligible) {
        table.shift[j] = -INFINITY;
      }
    }
    cutlass::arch::NamedBarrier::arrive(kBuiltArrivals, barrier_id(ConsumerBarrier::kPendingShiftsBuilt));
  }

  // Consumers, once per tile, before reading the table that build_by_producer fills.
  __device__ __forceinline__ static void await_built() {
    cutlass::arch::NamedBarrier::sync(kBuiltArrivals, barrier_id(ConsumerBarrier::kPendingShiftsBuilt));
  }

  // Adds the shift of each eligible column of pooled tile `pooled_tile` and turns the others into -inf:
  // x + -inf = -inf, and the max with -inf maps the NaN that a masked row of garbage could produce to -inf
  // too (fmaxf returns the other operand of a NaN), with no per-column predicate.
  // scores_rc / coords_rc: the thread's (rows x cols) view of S and of its (row, col) coordinates.
  template <class ScoresRowsCols, class CoordsRowsCols>
  __device__ __forceinline__ static void apply(ScoresRowsCols& scores_rc, CoordsRowsCols const& coords_rc,
                                               Table const& table, int pooled_tile) {
    using namespace cute;
    static_assert(decltype(size<1>(scores_rc))::value % 2 == 0, "a thread's columns come in adjacent pairs");
    float const* tile_shift = table.shift + pooled_tile * Traits::kBlockN;
    CUTE_UNROLL
    for (int j = 0; j < size<1>(scores_rc); j += 2) {
      // Values j and j + 1 of a thread's row are columns 2 (lane % 4) + {0, 1} + 8 k: adjacent, the first even.
      const float2 shift = *reinterpret_cast<float2 const*>(tile_shift + int(get<1>(coords_rc(0, j))));
      CUTE_UNROLL
      for (int i = 0; i < size<0>(scores_rc); ++i) {
        scores_rc(i, j) = fmaxf(scores_rc(i, j) + shift.x, -INFINITY);
        scores_rc(i, j + 1) = fmaxf(scores_rc(i, j + 1) + shift.y, -INFINITY);
      }
    }
  }

  // apply() for the FP8 pooled products: the raw score of row i is its e4m3 product times row_factor[i]
  // (the row's Q scale times the KV head's pooled-K scale), folded into the shift's add as one FMA.
  template <class ScoresRowsCols, class CoordsRowsCols, int kRows>
  __device__ __forceinline__ static void apply_scaled(ScoresRowsCols& scores_rc, CoordsRowsCols const& coords_rc,
                                                      Table const& table, int pooled_tile,
                                                      float const (&row_factor)[kRows]) {
    using namespace cute;
    static_assert(decltype(size<0>(scores_rc))::value == kRows, "one factor per row of the thread");
    float const* tile_shift = table.shift + pooled_tile * Traits::kBlockN;
    CUTE_UNROLL
    for (int j = 0; j < size<1>(scores_rc); j += 2) {
      const float2 shift = *reinterpret_cast<float2 const*>(tile_shift + int(get<1>(coords_rc(0, j))));
      CUTE_UNROLL
      for (int i = 0; i < kRows; ++i) {
        scores_rc(i, j) = fmaxf(fmaf(scores_rc(i, j), row_factor[i], shift.x), -INFINITY);
        scores_rc(i, j + 1) = fmaxf(fmaf(scores_rc(i, j + 1), row_factor[i], shift.y), -INFINITY);
      }
    }
  }
};

}  // namespace fpv2::hopper
