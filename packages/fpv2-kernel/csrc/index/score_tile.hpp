// Which (request, tile) a scoring CTA serves, and that tile's geometry: its packed rows, the blocks it sees,
// scores and is forced to keep. The same integer rules as fpv2.index's Triton pass (_tile_geometry), with
// every row scored (no probe stride) and 128-row tiles.
#pragma once

#include <cstdint>

namespace fpv2::index {

struct ScoreTile {
  int request;
  int tile;          // within the request
  int tiles;         // of the request
  int tile_begin;    // first tile of the request in the batch
  int q_start;
  int q_len;
  int kv_len;
  int block_base;    // first pooled row of the request
};

// Warp 0 finds the request holding global tile `unit` (tiles counted over the batch in request order):
// 32 requests per step, their tile counts summed by shuffles. Every thread of the CTA returns the result
// (through `slots`, six ints of shared memory).
template <class Params>
__device__ __forceinline__ ScoreTile find_tile(Params const& p, int64_t unit, int tile_rows, int32_t* slots) {
  const int lane = threadIdx.x % 32;
  // Every thread has read the previous lookup's slots: two lookups can follow each other with no other barrier
  // (a dense tile, which has no steps, then the next request; compute-sanitizer racecheck found it).
  __syncthreads();
  if (threadIdx.x < 32) {
    int64_t before = 0;  // tiles of the requests before this step's
    for (int b0 = 0; b0 < p.num_requests; b0 += 32) {
      const int b = b0 + lane;
      int tiles = 0, lo = 0, hi = 0;
      if (b < p.num_requests) {
        lo = p.cu_seqlens_q[b];
        hi = p.cu_seqlens_q[b + 1];
        tiles = int((int64_t(hi - lo) * p.group + tile_rows - 1) / tile_rows);
      }
      int inclusive = tiles;
      for (int offset = 1; offset < 32; offset *= 2) {
        const int other = __shfl_up_sync(0xffffffffu, inclusive, offset);
        if (lane >= offset) inclusive += other;
      }
      const bool holds = b < p.num_requests && before + inclusive > unit && before + inclusive - tiles <= unit;
      const unsigned found = __ballot_sync(0xffffffffu, holds);
      if (found != 0) {
        if (lane == __ffs(found) - 1) {
          const int begin = int(before + inclusive - tiles);
          slots[0] = b;
          slots[1] = int(unit - begin);
          slots[2] = tiles;
          slots[3] = begin;
          slots[4] = lo;
          slots[5] = hi - lo;
        }
        break;
      }
      before += __shfl_sync(0xffffffffu, inclusive, 31);
    }
  }
  __syncthreads();
  ScoreTile t;
  t.request = slots[0];
  t.tile = slots[1];
  t.tiles = slots[2];
  t.tile_begin = slots[3];
  t.q_start = slots[4];
  t.q_len = slots[5];
  t.kv_len = p.seqlens_k[t.request];
  t.block_base = p.block_offsets[t.request];
  return t;
}

struct ScoreGeometry {
  int row_begin;       // first packed row of the tile
  int num_rows;        // rows of the tile inside the request (<= 128)
  int prefix;          // kv_len - q_len: position of query 0
  int num_visible;     // blocks any row sees
  int num_candidates;  // blocks scored (0 for dense tiles)
  int num_full;        // leading candidates every row sees, in whole steps (scored without masks)
  int first_diagonal;  // first block of the tile's diagonal band (always kept)
  int window_lo;       // window blocks [window_lo, window_hi] (empty when window_hi < 0)
  int window_hi;
  bool dense;
};

template <class Params>
__device__ __forceinline__ ScoreGeometry tile_geometry(Params const& p, ScoreTile const& t, int tile_rows,
                                                       int step_keys) {
  ScoreGeometry g;
  const int64_t packed = int64_t(t.q_len) * p.group;
  g.row_begin = t.tile * tile_rows;
  const int row_end = int(packed < g.row_begin + tile_rows ? packed : g.row_begin + tile_rows);
  g.num_rows = row_end - g.row_begin;
  g.prefix = t.kv_len - t.q_len;
  const int first = g.prefix + g.row_begin / p.group;
  const int last = g.prefix + (row_end - 1) / p.group;
  g.num_visible = last / p.block_size + 1;
  const int num_scored = (last + 1) / p.block_size;
  g.first_diagonal = first / p.block_size;
  g.dense = t.tile >= t.tiles - p.dense_tail_tiles || t.kv_len < p.min_sparse_kv_len;
  g.num_candidates = g.dense ? 0 : num_scored;
  int full = 0;
  if (g.num_rows == tile_rows) {
    full = first / p.block_size + 1;
    full = full < g.num_candidates ? full : g.num_candidates;
  }
  g.num_full = full / step_keys * step_keys;
  const bool has_window = p.window_tokens > 0 && first > 0;
  const int lo = first - p.window_tokens;
  g.window_lo = (lo > 0 ? lo : 0) / p.block_size;
  g.window_hi = has_window ? (first - 1 > 0 ? first - 1 : 0) / p.block_size : -1;
  return g;
}

}  // namespace fpv2::index
