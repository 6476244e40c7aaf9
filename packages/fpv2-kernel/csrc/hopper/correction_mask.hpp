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
//
// The second-order mass shift (fpv2.h ABI 1.5, a plan with a key spread) adds min(a_r var_J, b_r rad_J) to the
// logit of row r and pooled row J; in raw units a_r = scale |q_r|^2 / 2 and b_r = |q_r| (the natural-log
// shift divided by the scale). The table's upper half then holds (var_J, rad_J) as two halves per row, next
// to the shifts of its lower half: half the rows (max_second_order_blocks), no extra shared memory (the d =
// 128 instantiation has none left). Each consumer thread computes a_r, b_r of its two rows once per tile,
// from the Q tile, at the first pooled tile (RowSpreadFactors), so that they are not live in the kept-block
// loop. A pooled score then costs two more FMAs and a min.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include <cuda_fp16.h>
#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "hopper/block_schedule.hpp"
#include "hopper/prefill_plan.hpp"
#include "hopper/named_barriers.hpp"
#include "hopper/online_softmax.hpp"
#include "hopper/shared_copy.hpp"

namespace fpv2::hopper {

template <int kRows>
struct PendingShiftsStorage {
  // Raw-score shift log|B_J| / scale of pooled row J when block J is eligible, -inf otherwise; rows up to
  // the end of the tile's last pooled tile are written. With the second-order shift only rows below kRows / 2,
  // the upper half holding spread().
  alignas(16) float shift[kRows];

  // The second-order shift's (key variance, key radius) of pooled row J < kRows / 2, as halves.
  __device__ __forceinline__ __half2* spread() { return reinterpret_cast<__half2*>(shift + kRows / 2); }
  __device__ __forceinline__ __half2 const* spread() const {
    return reinterpret_cast<__half2 const*>(shift + kRows / 2);
  }
};

// The second-order shift's per-row coefficients of one consumer thread (raw-score units): the shift of row i
// and pooled row J is min(a[i] var_J, b[i] rad_J).
template <int kRows>
struct RowSpreadFactors {
  float a[kRows];  // softmax_scale |q|^2 / 2
  float b[kRows];  // |q|
};

// The table of the instantiation `Traits`: max_correction_blocks(d) rows.
template <class Traits>
using PendingShiftsFor = PendingShiftsStorage<max_correction_blocks(Traits::kHeadDim)>;

template <class Traits>
struct CorrectionMask {
  using Table = PendingShiftsFor<Traits>;
  static_assert(max_second_order_blocks(Traits::kHeadDim) % Traits::kBlockN == 0,
                "pooled tiles never run past the table, with or without the key spread");

  // The (variance, radius) entry of pooled row `row` (absolute) and KV head `kv_head`; zeros for rows that
  // carry no term. Clamped to [0, 65504], the largest finite half: a NaN becomes 0 and nothing becomes inf
  // (inf x 0 would be NaN).
  template <class Params>
  __device__ __forceinline__ static __half2 spread_entry(Params const& params, int row, int kv_head, bool eligible) {
    if (!eligible) return __floats2half2_rn(0.0f, 0.0f);
    const int64_t at = int64_t(row) * params.num_kv_heads + kv_head;
    const float variance = fminf(fmaxf(params.key_variance[at], 0.0f), 65504.0f);
    const float radius = fminf(fmaxf(params.key_radius[at], 0.0f), 65504.0f);
    return __floats2half2_rn(variance, radius);
  }

  // The shift of row j (0 .. rows) into the table, and with the second-order shift its spread entry.
  template <bool kSecondOrder, class Params>
  __device__ __forceinline__ static void write_row(Table& table, Params const& params, int pooled_base, int kv_head,
                                                   int n_eligible, float log2_to_raw, int j) {
    float shift = -INFINITY;
    if (j < n_eligible) {
      const int length = params.block_lengths[pooled_base + j];
      // The plan checks 1 <= |B_J| <= block_size; clamp anyway so that a bad length cannot raise a
      // pooled term above its block's token count.
      if (length > 0) shift = __log2f(float(length < Traits::kBlockSize ? length : Traits::kBlockSize)) * log2_to_raw;
    }
    table.shift[j] = shift;
    if constexpr (kSecondOrder) {
      table.spread()[j] = spread_entry(params, pooled_base + j, kv_head, j < n_eligible);
    }
  }

  // Consumer threads, once per tile, before the first pooled tile. Ends with a barrier of all consumer
  // threads. log2_to_raw = ln(2) / softmax_scale turns log2|B| into the raw-score shift.
  template <bool kSecondOrder, class Params>
  __device__ __forceinline__ static void build(Table& table, Params const& params,
                                               BlockScheduleFor<Traits> const& schedule, int pooled_base, int kv_head,
                                               int n_eligible, float log2_to_raw, int consumer_thread) {
    // The rows of this CTA's pooled tiles (all of them without split-KV).
    const int first_row = schedule.first_pooled_tile() * Traits::kBlockN;
    const int rows = (schedule.first_pooled_tile() + schedule.num_correction) * Traits::kBlockN;
    for (int j = first_row + consumer_thread; j < rows; j += Traits::kNumConsumerThreads) {
      write_row<kSecondOrder>(table, params, pooled_base, kv_head, n_eligible, log2_to_raw, j);
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

  template <bool kSecondOrder, class Params>
  __device__ __forceinline__ static void build_by_producer(Table& table, Params const& params,
                                                           BlockScheduleFor<Traits> const& schedule, int pooled_base,
                                                           int kv_head, int n_eligible, float log2_to_raw, int builder) {
    const int first_row = schedule.first_pooled_tile() * Traits::kBlockN;
    const int rows = (schedule.first_pooled_tile() + schedule.num_correction) * Traits::kBlockN;
    for (int j = first_row + builder; j < rows; j += kBuilders) {
      write_row<kSecondOrder>(table, params, pooled_base, kv_head, n_eligible, log2_to_raw, j);
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

  // The second-order coefficients of the thread's rows, from the tile's bf16 Q rows in shared memory: the 4
  // threads of a quad hold the same rows (lane / 4, + 8), so each sums the squares of a quarter of the row
  // (8-element runs: one 16-byte chunk of the 128-byte swizzle each, read by one LDS.128 from a 32-bit
  // address) and a quad reduction completes |q|^2. Two partial sums per row halve the FMA chain. Warp-uniform.
  template <class CoordsRowsCols, int kRows>
  __device__ __forceinline__ static void row_spread_factors(typename Traits::Element const* smem_q,
                                                            CoordsRowsCols const& coords_rc, float softmax_scale,
                                                            RowSpreadFactors<kRows>& factors) {
    using namespace cute;
    static_assert(std::is_same_v<typename Traits::Element, cutlass::bfloat16_t>, "bf16 Q: a word holds two");
    const uint32_t q_base = cast_smem_ptr_to_uint(smem_q);
    const int quad_lane = int(threadIdx.x) % 4;
    CUTE_UNROLL
    for (int i = 0; i < kRows; ++i) {
      const int row = int(get<0>(coords_rc(i, 0)));
      float low = 0.0f, high = 0.0f;
      CUTE_UNROLL
      for (int m = 0; m < Traits::kHeadDim / 32; ++m) {
        const int offset = smem_offset<typename Traits::SmemLayoutQ>(row, 8 * (quad_lane + 4 * m));
        const uint4 chunk = ld_shared_16(q_base + uint32_t(offset) * uint32_t(sizeof(typename Traits::Element)));
        const uint32_t words[4] = {chunk.x, chunk.y, chunk.z, chunk.w};
        CUTE_UNROLL
        for (int w = 0; w < 4; ++w) {
          // bf16 -> fp32 is the upper half of the float: the low element shifted up, the high one masked.
          const float x0 = __uint_as_float(words[w] << 16), x1 = __uint_as_float(words[w] & 0xffff0000u);
          low = fmaf(x0, x0, low);
          high = fmaf(x1, x1, high);
        }
      }
      const float sum = quad_sum(low + high);
      factors.a[i] = 0.5f * softmax_scale * sum;
      factors.b[i] = sqrtf(sum);
    }
  }

  // Adds the shift of each eligible column of pooled tile `pooled_tile` and turns the others into -inf:
  // x + -inf = -inf, and the max with -inf maps the NaN that a masked row of garbage could produce to -inf
  // too (fmaxf returns the other operand of a NaN), with no per-column predicate.
  // scores_rc / coords_rc: the thread's (rows x cols) view of S and of its (row, col) coordinates.
  template <class ScoresRowsCols, class CoordsRowsCols>
  __device__ __forceinline__ static void apply(ScoresRowsCols& scores_rc, CoordsRowsCols const& coords_rc,
                                               Table const& table, int pooled_tile) {
    shift_scores</*kScaled=*/false, /*kSecondOrder=*/false>(scores_rc, coords_rc, table, pooled_tile, nullptr,
                                                            nullptr);
  }

  // apply() for the FP8 pooled products: the raw score of row i is its e4m3 product times row_factor[i]
  // (the row's Q scale times the KV head's pooled-K scale), folded into the shift's add as one FMA.
  template <class ScoresRowsCols, class CoordsRowsCols, int kRows>
  __device__ __forceinline__ static void apply_scaled(ScoresRowsCols& scores_rc, CoordsRowsCols const& coords_rc,
                                                      Table const& table, int pooled_tile,
                                                      float const (&row_factor)[kRows]) {
    shift_scores</*kScaled=*/true, /*kSecondOrder=*/false>(scores_rc, coords_rc, table, pooled_tile, row_factor,
                                                           nullptr);
  }

  // apply() plus the second-order shift of `spread`'s rows: with base = score + log|B_J| / scale, the score
  // becomes min(base + a var, base + b rad) (-inf stays -inf: the spread of a column without a term is zero).
  template <class ScoresRowsCols, class CoordsRowsCols, int kRows>
  __device__ __forceinline__ static void apply_second_order(ScoresRowsCols& scores_rc, CoordsRowsCols const& coords_rc,
                                                            Table const& table, int pooled_tile,
                                                            RowSpreadFactors<kRows> const& spread) {
    shift_scores<false, true>(scores_rc, coords_rc, table, pooled_tile, nullptr, &spread);
  }

  // apply_scaled() plus the second-order shift.
  template <class ScoresRowsCols, class CoordsRowsCols, int kRows>
  __device__ __forceinline__ static void apply_scaled_second_order(ScoresRowsCols& scores_rc,
                                                                   CoordsRowsCols const& coords_rc, Table const& table,
                                                                   int pooled_tile, float const (&row_factor)[kRows],
                                                                   RowSpreadFactors<kRows> const& spread) {
    shift_scores<true, true>(scores_rc, coords_rc, table, pooled_tile, row_factor, &spread);
  }

 private:
  template <bool kScaled, bool kSecondOrder, class ScoresRowsCols, class CoordsRowsCols, class RowFactor, class Spread>
  __device__ __forceinline__ static void shift_scores(ScoresRowsCols& scores_rc, CoordsRowsCols const& coords_rc,
                                                      Table const& table, int pooled_tile, RowFactor const& row_factor,
                                                      Spread const& spread) {
    using namespace cute;
    static_assert(decltype(size<1>(scores_rc))::value % 2 == 0, "a thread's columns come in adjacent pairs");
    constexpr int kRows = decltype(size<0>(scores_rc))::value;
    // 32-bit shared addresses (LDS.64) rather than generic pointers (64-bit arithmetic, generic loads).
    const uint32_t tile_shift = cute::cast_smem_ptr_to_uint(table.shift + pooled_tile * Traits::kBlockN);
    const uint32_t tile_spread = cute::cast_smem_ptr_to_uint(table.spread() + pooled_tile * Traits::kBlockN);
    CUTE_UNROLL
    for (int j = 0; j < size<1>(scores_rc); j += 2) {
      // Values j and j + 1 of a thread's row are columns 2 (lane % 4) + {0, 1} + 8 k: adjacent, the first even.
      const int col = int(get<1>(coords_rc(0, j)));
      const uint2 shift_bits = ld_shared_8(tile_shift + uint32_t(col) * uint32_t(sizeof(float)));
      const float2 shift = make_float2(__uint_as_float(shift_bits.x), __uint_as_float(shift_bits.y));
      float2 spread0 = make_float2(0.0f, 0.0f), spread1 = make_float2(0.0f, 0.0f);
      if constexpr (kSecondOrder) {
        // Both columns' (variance, radius) in one 8-byte load.
        const uint2 raw = ld_shared_8(tile_spread + uint32_t(col) * uint32_t(sizeof(__half2)));
        spread0 = __half22float2(*reinterpret_cast<__half2 const*>(&raw.x));
        spread1 = __half22float2(*reinterpret_cast<__half2 const*>(&raw.y));
      }
      CUTE_UNROLL
      for (int i = 0; i < kRows; ++i) {
        float base0, base1;
        if constexpr (kScaled) {
          base0 = fmaf(scores_rc(i, j), row_factor[i], shift.x);
          base1 = fmaf(scores_rc(i, j + 1), row_factor[i], shift.y);
        } else {
          base0 = scores_rc(i, j) + shift.x;
          base1 = scores_rc(i, j + 1) + shift.y;
        }
        if constexpr (kSecondOrder) {
          base0 = fminf(fmaf(spread->a[i], spread0.x, base0), fmaf(spread->b[i], spread0.y, base0));
          base1 = fminf(fmaf(spread->a[i], spread1.x, base1), fmaf(spread->b[i], spread1.y, base1));
        }
        scores_rc(i, j) = fmaxf(base0, -INFINITY);
        scores_rc(i, j + 1) = fmaxf(base1, -INFINITY);
      }
    }
  }
};

}  // namespace fpv2::hopper
