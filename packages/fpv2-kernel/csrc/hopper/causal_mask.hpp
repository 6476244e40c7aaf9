// Bottom-right causal masking of the score tile, applied only in the diagonal band of KV blocks.
//
// Each consumer thread holds kRows rows of S (2 for a 64-row wgmma). The last visible column of each row
// is fixed for the whole tile, so it is computed once (TileGeometry::column_limit, which also clamps to
// the request's KV length); a masked block then costs one compare and select per score. Masked scores
// are REPLACED by -inf (not offset), so stale or NaN keys past seqlen_k cannot leak into the softmax.
#pragma once

#include <cmath>

#include <cute/tensor.hpp>

namespace fpv2::hopper {

template <int kRows, int kBlockN>
struct CausalMask {
  int limit[kRows];

  // coords_rc: identity coordinates (row, col) of the thread's scores in the tile, rows x cols view.
  template <class CoordsRowsCols, class Geometry>
  __device__ __forceinline__ CausalMask(CoordsRowsCols const& coords_rc, Geometry const& tile, int group) {
    static_assert(decltype(cute::size<0>(coords_rc))::value == kRows, "one limit per thread row");
    CUTE_UNROLL
    for (int i = 0; i < kRows; ++i) {
      limit[i] = tile.column_limit(tile.row_begin + int(cute::get<0>(coords_rc(i, 0))), group);
    }
  }

  template <class ScoresRowsCols, class CoordsRowsCols>
  __device__ __forceinline__ void apply(ScoresRowsCols& scores_rc, CoordsRowsCols const& coords_rc,
                                        int n_block) const {
    const int col0 = n_block * kBlockN;
    CUTE_UNROLL
    for (int i = 0; i < kRows; ++i) {
      CUTE_UNROLL
      for (int j = 0; j < cute::size<1>(scores_rc); ++j) {
        if (col0 + int(cute::get<1>(coords_rc(i, j))) > limit[i]) {
          scores_rc(i, j) = -INFINITY;
        }
      }
    }
  }
};

}  // namespace fpv2::hopper
