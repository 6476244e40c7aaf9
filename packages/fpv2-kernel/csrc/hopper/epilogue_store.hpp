// Writes a consumer warpgroup's normalised output rows and their log-sum-exp, un-packing PackGQA rows.
//
// Packed row r goes to token q_start + r / g, query head h * g + r % g of out (total_q, Hq, d) and
// lse (total_q, Hq) (packed_row.hpp); rows past the request are dropped. A thread holds pairs of adjacent
// columns (bf16x2 words); the quad of threads sharing a row holds each 8-column group as 4 words, one per
// thread. A 4 x 4 transpose within the quad (two butterfly rounds of shuffles) gives each thread whole
// groups, stored 16 bytes at a time: a quarter of the store instructions of the word-per-thread stores, whose
// queue stalled the epilogue (ncu 2026-12-01, planted 128K: ~4.5% of the kernel's stall samples in the
// epilogue's stores, throttled). An output whose pointer or strides are not 16-byte multiples keeps the
// word stores.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>

#include <cute/tensor.hpp>

#include "hopper/fragment_layouts.hpp"
#include "hopper/packed_row.hpp"

namespace fpv2::hopper {

template <class Traits>
struct EpilogueStore {
  template <class Params, class Geometry>
  __device__ __forceinline__ static __nv_bfloat16* output_row(Params const& params, Geometry const& tile, int packed) {
    const PackedRow where = PackedRow::at(params, tile, packed);
    return reinterpret_cast<__nv_bfloat16*>(params.out) + where.offset(params.out_token_stride, params.out_head_stride);
  }

  // Word w of a thread's row (columns 8 w + 2 (lane % 4) + {0, 1}, i.e. part lane % 4 of column group w)
  // moves to the quad's thread w % 4: after the transpose thread t holds the groups b + t, b = 0, 4, 8, ...,
  // whole. The shuffles run in every lane (rows past the request included) so that the full-warp masks hold;
  // only the stores are predicated.
  template <int kWords, class Params, class Geometry, class OutRowsCols, class CoordsRowsCols>
  __device__ __forceinline__ static void store_quad_transposed(Params const& params, Geometry const& tile,
                                                               OutRowsCols const& out_rc,
                                                               CoordsRowsCols const& coords_rc) {
    using namespace cute;
    constexpr int kRows = decltype(size<0>(out_rc))::value;
    const int quad_lane = int(threadIdx.x) % 4;
    const bool odd = (quad_lane & 1) != 0;
    const bool upper = (quad_lane & 2) != 0;
    CUTE_UNROLL
    for (int i = 0; i < kRows; ++i) {
      const int packed = tile.row_begin + int(get<0>(coords_rc(i, 0)));
      const bool in_request = packed < tile.num_rows;
      // Group b + t starts at column 8 (b + t); coords_rc(i, 0) is column 2 t of group 0.
      __nv_bfloat16* group0 = nullptr;
      if (in_request) {
        group0 = output_row(params, tile, packed) + (int(get<1>(coords_rc(i, 0))) - 2 * quad_lane) + 8 * quad_lane;
      }
      // One block of 4 words at a time (4 live registers): lanes t and t ^ 2 swap the words w with (w & 2) !=
      // (t & 2), then lanes t and t ^ 1 those with (w & 1) != (t & 1).
      CUTE_UNROLL
      for (int b = 0; b < kWords; b += 4) {
        uint32_t word[4];
        CUTE_UNROLL
        for (int w = 0; w < 4; ++w) {
          const __nv_bfloat162 pair = __floats2bfloat162_rn(out_rc(i, 2 * (b + w)), out_rc(i, 2 * (b + w) + 1));
          word[w] = reinterpret_cast<uint32_t const&>(pair);
        }
        exchange(word[0], word[2], upper, 2);
        exchange(word[1], word[3], upper, 2);
        exchange(word[0], word[1], odd, 1);
        exchange(word[2], word[3], odd, 1);
        if (in_request) {
          *reinterpret_cast<uint4*>(group0 + 8 * b) = make_uint4(word[0], word[1], word[2], word[3]);
        }
      }
    }
  }

  // One butterfly exchange: the lane with `high` set gives `lo` and takes its partner's `hi` into it; the other
  // gives `hi` and takes the partner's `lo` into `hi`.
  __device__ __forceinline__ static void exchange(uint32_t& lo, uint32_t& hi, bool high, int lane_mask) {
    const uint32_t received = __shfl_xor_sync(0xffffffffu, high ? lo : hi, lane_mask);
    if (high) {
      lo = received;
    } else {
      hi = received;
    }
  }

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

    constexpr int kWords = decltype(size<1>(out_rc))::value / 2;  // bf16x2 words per thread and row
    const bool vector_stores =
        ((reinterpret_cast<uintptr_t>(params.out) |
          uintptr_t(params.out_token_stride | params.out_head_stride) * sizeof(__nv_bfloat16)) & 15) == 0;
    if (kWords % 4 == 0 && vector_stores) {
      store_quad_transposed<kWords>(params, tile, out_rc, coords_rc);
    } else {
      CUTE_UNROLL
      for (int i = 0; i < kRows; ++i) {
        const int packed = tile.row_begin + int(get<0>(coords_rc(i, 0)));
        if (packed >= tile.num_rows) continue;
        auto* row = output_row(params, tile, packed);
        CUTE_UNROLL
        for (int j = 0; j < size<1>(out_rc); j += 2) {
          // Values j and j + 1 of a thread's row are columns 2 (lane % 4) + {0, 1} + 8 k: adjacent.
          const int col = int(get<1>(coords_rc(i, j)));
          *reinterpret_cast<__nv_bfloat162*>(row + col) = __floats2bfloat162_rn(out_rc(i, j), out_rc(i, j + 1));
        }
      }
    }
    CUTE_UNROLL
    for (int i = 0; i < kRows; ++i) {
      const int packed = tile.row_begin + int(get<0>(coords_rc(i, 0)));
      if (packed < tile.num_rows && params.lse != nullptr && get<1>(coords_rc(i, 0)) == 0) {
        const PackedRow where = PackedRow::at(params, tile, packed);
        params.lse[where.offset(params.lse_token_stride, params.lse_head_stride)] = lse[i];
      }
    }
  }

  // Split-KV (split_kv.hpp): the split's normalised fp32 rows and their lse (-inf for a row that saw no key
  // in this split) into the workspace, row token * Hq + head of split tile.split; split_combine.hpp merges
  // the splits. Pairs of adjacent columns, 8-byte stores (the partial rows are a small call's traffic).
  template <class Params, class Geometry, class OutFragment, class ThrMma, int kRows>
  __device__ __forceinline__ static void store_partial(Params const& params, Geometry const& tile,
                                                       OutFragment const& tOrO, ThrMma const& thr_mma_pv,
                                                       float const (&lse)[kRows]) {
    using namespace cute;
    Tensor coords = thr_mma_pv.partition_C(
        make_identity_tensor(Shape<Int<Traits::kBlockM>, Int<Traits::kHeadDim>>{}));
    Tensor coords_rc = make_tensor(coords.data(), accumulator_rows_cols(coords.layout()));
    Tensor out_rc = make_tensor(tOrO.data(), accumulator_rows_cols(tOrO.layout()));
    const int64_t split_rows = params.total_q * params.num_q_heads;
    CUTE_UNROLL
    for (int i = 0; i < kRows; ++i) {
      const int packed = tile.row_begin + int(get<0>(coords_rc(i, 0)));
      if (packed >= tile.num_rows) continue;
      const PackedRow where = PackedRow::at(params, tile, packed);
      const int64_t row = int64_t(tile.split) * split_rows + where.token * params.num_q_heads + where.head;
      float* base = params.split_out + row * Traits::kHeadDim;
      CUTE_UNROLL
      for (int j = 0; j < size<1>(out_rc); j += 2) {
        *reinterpret_cast<float2*>(base + int(get<1>(coords_rc(i, j)))) = make_float2(out_rc(i, j), out_rc(i, j + 1));
      }
      if (get<1>(coords_rc(i, 0)) == 0) params.split_lse[row] = lse[i];
    }
  }
};

}  // namespace fpv2::hopper
