// Writes a consumer warpgroup's normalised output rows and their log-sum-exp, un-packing PackGQA rows.
//
// Packed row r goes to token q_start + r / g, query head h * g + r % g of out (total_q, Hq, d) and
// lse (total_q, Hq) (packed_row.hpp); rows past the request are dropped. Each thread writes pairs of adjacent columns
// (bf16x2, 4 bytes); the quad of threads sharing a row covers 16 contiguous bytes. A shared-memory staged,
// 16-byte-per-thread store (or TMA store for g = 1) is a later optimisation; the output is 1/L of the
// attention traffic at long L.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>

#include <cute/tensor.hpp>

#include "hopper/fragment_layouts.hpp"
#include "hopper/packed_row.hpp"

namespace fpv2::hopper {

template <class Traits>
struct EpilogueStore {
  template <class Params, class Geometry, class OutFragment, class ThrMma, int kRows>
  __device__ __forceinline__ static void store(Params const& params, Geometry const& tile, OutFragment const& tOrO,
                                               ThrMma const& thr_mma_pv, float const (&lse)[kRows]) {
    using namespace cute;
    Tensor coords = thr_mma_pv.partition_C(
        make_identity_tensor(Shape<Int<Traits::kBlockM>, Int<Traits::kHeadDim>>{}));
    Tensor coords_rc = make_tensor(coords.data(), accumulator_rows_cols(coords.layout()));
    Tensor out_rc = make_tensor(tOrO.data(), accumulator_rows_cols(tOrO.layout()));
    static_assert(decltype(size<0>(out_rc))::value == kRows, "one lse per thread row");
    static_assert(decltype(size<1>(out_rc))::value % 2 == 0, "columns come in adjacent pairs");

    CUTE_UNROLL
    for (int i = 0; i < kRows; ++i) {
      const int packed = tile.row_begin + int(get<0>(coords_rc(i, 0)));
      if (packed >= tile.num_rows) continue;
      const PackedRow where = PackedRow::at(params, tile, packed);
      auto* row = reinterpret_cast<__nv_bfloat16*>(params.out) +
                  where.offset(params.out_token_stride, params.out_head_stride);
      CUTE_UNROLL
      for (int j = 0; j < size<1>(out_rc); j += 2) {
        // Values j and j + 1 of a thread's row are columns 2 (lane % 4) + {0, 1} + 8 k: adjacent.
        const int col = int(get<1>(coords_rc(i, j)));
        *reinterpret_cast<__nv_bfloat162*>(row + col) = __floats2bfloat162_rn(out_rc(i, j), out_rc(i, j + 1));
      }
      if (params.lse != nullptr && get<1>(coords_rc(i, 0)) == 0) {
        params.lse[where.offset(params.lse_token_stride, params.lse_head_stride)] = lse[i];
      }
    }
  }
};

}  // namespace fpv2::hopper
