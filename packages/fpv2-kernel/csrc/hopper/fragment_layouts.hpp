// Views of a wgmma accumulator fragment held in registers.
//
// A 64xN fp32 wgmma accumulator gives each thread the values ((2, 2, N/8), MMA_M, MMA_N): value (c, r, j)
// is row lane/4 + 8 r (plus 16 per warp) and column 2 (lane % 4) + c + 8 j of the 64xN block. Two views
// are needed:
//   * rows x columns, for the softmax: ((2, MMA_M), (2, N/8, MMA_N)), the thread's 2 rows by its columns;
//   * the A operand of a 16-bit register-sourced wgmma (RS): the 64x16 A fragment of k-block kk holds
//     columns 16 kk .. 16 kk + 15, i.e. accumulator values j in {2 kk, 2 kk + 1}, so the same registers are
//     regrouped as ((2, 2, 2), MMA_M, N/16 * MMA_N). No data moves: P is converted to bf16 in place order.
#pragma once

#include <cute/tensor.hpp>

namespace fpv2::hopper {

template <class AccLayout>
CUTE_HOST_DEVICE constexpr auto accumulator_rows_cols(AccLayout acc) {
  using namespace cute;
  static_assert(rank(AccLayout{}) == 3 && rank<0>(AccLayout{}) == 3, "expected a ((2,2,V),M,N) wgmma fragment");
  static_assert(size<0, 0>(AccLayout{}) == 2 && size<0, 1>(AccLayout{}) == 2, "expected a ((2,2,V),M,N) fragment");
  auto rows = make_layout(get<0, 1>(acc), get<1>(acc));
  auto cols = make_layout(get<0, 0>(acc), get<0, 2>(acc), get<2>(acc));
  return make_layout(rows, cols);
}

template <class AccLayout>
CUTE_HOST_DEVICE constexpr auto accumulator_as_operand_a(AccLayout acc) {
  using namespace cute;
  static_assert(rank(AccLayout{}) == 3 && rank<0>(AccLayout{}) == 3, "expected a ((2,2,V),M,N) wgmma fragment");
  static_assert(size<0, 2>(AccLayout{}) % 2 == 0, "an A k-block of 16 columns takes two 8-column groups");
  // Split the column-group mode V into ((2 groups of one k-block, V/2 k-blocks)); the by-mode divide keeps
  // rank 1, so the two parts are sub-modes 0 and 1 of mode 0.
  auto groups = logical_divide(get<0, 2>(acc), Tile<_2>{});
  auto one_k_block = make_layout(get<0, 0>(acc), get<0, 1>(acc), get<0, 0>(groups));
  auto k_blocks = coalesce(make_layout(get<0, 1>(groups), get<2>(acc)));
  return make_layout(one_k_block, get<1>(acc), k_blocks);
}

}  // namespace fpv2::hopper
