// Online softmax over KV blocks, in registers, in base 2 with the log2(e)-folded scale.
//
// For each of its rows a thread keeps the running maximum m of the raw scores seen so far and a partial
// running sum l of exp2(s * c - m * c), c = softmax_scale * log2(e), over ITS columns; the 4 threads of a
// quad share a row, so the maximum is reduced across the quad at every block (all must shift by the same
// value) while the sum is reduced once at the end. A block whose scores for a row are all masked leaves
// m = -inf; the shift then uses 0 instead of -inf so that no -inf - -inf = NaN appears, and every
// probability of that row is exp2(-inf) = 0.
#pragma once

#include <cmath>

#include <cute/tensor.hpp>

namespace fpv2::hopper {

// 2^x on the multi-function unit (ex2.approx, flush-to-zero): 2^-inf = +0.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// 2^a and 2^b by one ex2.approx.f16x2 (two values per multi-function-unit op): the inputs rounded to fp16
// (11 bits; at |x| <= 16 an error below 0.6% in the result), 2^x below 2^-24 flushed to 0. For the pooled
// tiles of the mean correction, whose terms tolerate far coarser values (e4m3 P measured harmless).
__device__ __forceinline__ void fast_exp2_pair(float a, float b, float& ra, float& rb) {
  uint32_t h;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(h) : "f"(b), "f"(a));  // a in the low half
  asm("ex2.approx.f16x2 %0, %0;" : "+r"(h));
  asm("{\n  .reg .f16 lo, hi;\n  mov.b32 {lo, hi}, %2;\n  cvt.f32.f16 %0, lo;\n  cvt.f32.f16 %1, hi;\n}"
      : "=f"(ra), "=f"(rb)
      : "r"(h));
}

__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}

__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

template <int kRows>
struct OnlineSoftmax {
  float row_max[kRows];
  float row_sum[kRows];
  float scale_log2;

  __device__ __forceinline__ explicit OnlineSoftmax(float softmax_scale_log2) : scale_log2(softmax_scale_log2) {
    CUTE_UNROLL
    for (int i = 0; i < kRows; ++i) {
      row_max[i] = -INFINITY;
      row_sum[i] = 0.0f;
    }
  }

  // Folds one block of scores (rows x cols view, masked scores already -inf) into the running state:
  // the scores become unnormalised probabilities in place and the output rows are rescaled.
  template <class ScoresRowsCols, class OutRowsCols>
  __device__ __forceinline__ void step(ScoresRowsCols& s, OutRowsCols& o) {
    float factors[kRows];
    rescale_scores(s, factors);
    rescale_output(o, factors);
  }

  // The first half of step(): updates the running maximum and sum from one block of scores, turns the scores
  // into unnormalised probabilities and returns each row's factor for the output. Split from the output
  // rescale so that the overlapped schedule can run it while the previous block's PV product is in flight.
  // kHalfExp: the probabilities by fast_exp2_pair (pooled tiles, FPV2_HOPPER_POOLED_HALF_EXP=1).
  template <bool kHalfExp = false, class ScoresRowsCols>
  __device__ __forceinline__ void rescale_scores(ScoresRowsCols& s, float (&factors)[kRows]) {
    static_assert(decltype(cute::size<0>(s))::value == kRows, "one running state per row of the scores");
    CUTE_UNROLL
    for (int i = 0; i < kRows; ++i) {
      float block_max = row_max[i];
      CUTE_UNROLL
      for (int j = 0; j < cute::size<1>(s); ++j) {
        block_max = fmaxf(block_max, s(i, j));
      }
      block_max = quad_max(block_max);
      const float shift = block_max == -INFINITY ? 0.0f : block_max * scale_log2;
      // exp2(-inf) = 0 on the first visible block: the (zero) output and sum are simply replaced.
      const float correction = fast_exp2(row_max[i] * scale_log2 - shift);
      row_max[i] = block_max;
      float block_sum = 0.0f;
      if constexpr (kHalfExp) {
        static_assert(decltype(cute::size<1>(s))::value % 2 == 0, "columns in pairs");
        CUTE_UNROLL
        for (int j = 0; j < cute::size<1>(s); j += 2) {
          float p0, p1;
          fast_exp2_pair(fmaf(s(i, j), scale_log2, -shift), fmaf(s(i, j + 1), scale_log2, -shift), p0, p1);
          s(i, j) = p0;
          s(i, j + 1) = p1;
          block_sum += p0 + p1;
        }
      } else {
        CUTE_UNROLL
        for (int j = 0; j < cute::size<1>(s); ++j) {
          const float p = fast_exp2(fmaf(s(i, j), scale_log2, -shift));
          s(i, j) = p;
          block_sum += p;
        }
      }
      row_sum[i] = fmaf(row_sum[i], correction, block_sum);
      factors[i] = correction;
    }
  }

  // The second half of step(): the output rows times their factors.
  template <class OutRowsCols>
  __device__ __forceinline__ void rescale_output(OutRowsCols& o, float const (&factors)[kRows]) {
    static_assert(decltype(cute::size<0>(o))::value == kRows, "scores and output share the thread's rows");
    CUTE_UNROLL
    for (int i = 0; i < kRows; ++i) {
      CUTE_UNROLL
      for (int j = 0; j < cute::size<1>(o); ++j) {
        o(i, j) *= factors[i];
      }
    }
  }

  // Normalises the output rows and returns each row's natural-log log-sum-exp of the scaled scores:
  // lse = m * softmax_scale + ln(l) = (m * c + log2(l)) * ln(2). A row that saw no column (only rows past
  // the end of the request, which are never stored) gets output 0 and lse -inf.
  template <class OutRowsCols>
  __device__ __forceinline__ void finalize(OutRowsCols& o, float (&lse)[kRows]) {
    constexpr float kLn2 = 0.693147180559945309f;
    CUTE_UNROLL
    for (int i = 0; i < kRows; ++i) {
      const float total = quad_sum(row_sum[i]);
      const bool any = total > 0.0f;
      const float inverse = any ? 1.0f / total : 0.0f;
      lse[i] = any ? (row_max[i] * scale_log2 + log2f(total)) * kLn2 : -INFINITY;
      CUTE_UNROLL
      for (int j = 0; j < cute::size<1>(o); ++j) {
        o(i, j) *= inverse;
      }
    }
  }
};

}  // namespace fpv2::hopper
