// Which KV tiles one query tile visits, in the order the producer loads them and the consumers read them:
//   1. its kept KV tiles, last first: every visible tile (dense), or the tiles of the tile's CSR segment
//      (sparse);
//   2. then, with the mean correction, ceil(n_pooled_eligible / kBlockN) tiles of kBlockN pooled rows:
//      pooled rows c * kBlockN .. c * kBlockN + kBlockN - 1 of the request, i.e. every block that may be
//      eligible (J < n_pooled_eligible, TileGeometry).
// Producer and consumers build the same schedule from the same parameters, so they agree on the number and
// order of pipeline stages without talking to each other.
//
// The CSR segment of (request b, KV head h, tile t) is s = Hkv * tile_offsets[b] + h * ntiles_b + t with
// ntiles_b = tile_offsets[b + 1] - tile_offsets[b] (fpv2.h); its ids are ascending, so walking the segment
// backwards visits the diagonal band (the masked blocks) first, as the dense schedule does.
//
// kTilesPerBlock KV tiles make one index block (2 at d = 256: 64-token tiles of 128-token blocks). Kept block
// J is then tiles kTilesPerBlock J .. kTilesPerBlock J + kTilesPerBlock - 1, visited last first; the tiles of
// the segment's last block that lie past every row (n >= n_block_max: the upper half of a diagonal block)
// are left out, but one tile of every kept block is always visited.
//
// Split-KV (kSplitKv, params.num_splits = S, split_kv.hpp): split k of S visits the contiguous part
// [k T / S, (k + 1) T / S) of the T = kept + pooled tiles above, so that the S CTAs of a query tile share its
// work; kept_first and pooled_first say where the part starts (0 without a split).
#pragma once

#include <cstdint>

namespace fpv2::hopper {

template <int kTilesPerBlock = 1, bool kSplitKv = false>
struct BlockSchedule {
  static_assert(kTilesPerBlock >= 1, "a block is at least one KV tile");
  int32_t const* kept;   // the segment's first id (sparse) or nullptr (dense)
  int num_kept_blocks;   // sparse: the segment's length; dense: num_kept
  int num_kept;          // KV tiles to visit
  int n_block_max;       // dense: tiles 0 .. n_block_max - 1
  int num_correction;    // pooled tiles after the kept tiles (0 without the correction)
  int skipped;           // sparse, kTilesPerBlock > 1: tiles of the last kept block past n_block_max
  int kept_first;        // split-KV: the first kept tile of this split (0 without a split)
  int pooled_first;      // split-KV: the first pooled tile of this split (0 without a split)

  // Host-callable with host arrays, for the native schedule checks (fpv2_hopper_layout_check).
  template <class Params, class Geometry>
  __host__ __device__ __forceinline__ static BlockSchedule make(Params const& params, Geometry const& tile, int pooled_tile) {
    BlockSchedule s;
    s.n_block_max = tile.n_block_max;
    s.skipped = 0;
    s.kept_first = 0;
    s.pooled_first = 0;
    if (params.index_offsets == nullptr) {
      s.kept = nullptr;
      s.num_kept = tile.n_block_max;
      s.num_kept_blocks = s.num_kept;
    } else {
      const int tile_begin = params.index_tile_offsets[tile.request];
      const int num_tiles = params.index_tile_offsets[tile.request + 1] - tile_begin;
      if (tile.m_block < num_tiles) {
        const int64_t segment = int64_t(params.num_kv_heads) * tile_begin + int64_t(tile.kv_head) * num_tiles +
                                tile.m_block;
        const int begin = params.index_offsets[segment];
        s.kept = params.index_blocks + begin;
        s.num_kept_blocks = params.index_offsets[segment + 1] - begin;
      } else {
        // An index built for other tiles (the Python contract checks this): visit nothing rather than read
        // past the segment table.
        s.kept = params.index_blocks;
        s.num_kept_blocks = 0;
      }
      s.num_kept = s.num_kept_blocks;
      if constexpr (kTilesPerBlock > 1) {
        if (s.num_kept_blocks > 0) {
          const int past = (s.kept[s.num_kept_blocks - 1] + 1) * kTilesPerBlock - tile.n_block_max;
          s.skipped = past <= 0 ? 0 : (past < kTilesPerBlock ? past : kTilesPerBlock - 1);
        }
        s.num_kept = s.num_kept_blocks * kTilesPerBlock - s.skipped;
      }
    }
    s.num_correction = params.has_correction ? (tile.n_pooled_eligible + pooled_tile - 1) / pooled_tile : 0;
    if constexpr (kSplitKv) {
      const int total = s.num_kept + s.num_correction;
      const int begin = int(int64_t(total) * tile.split / params.num_splits);
      const int end = int(int64_t(total) * (tile.split + 1) / params.num_splits);
      const int kept_end = end < s.num_kept ? end : s.num_kept;
      s.kept_first = begin < s.num_kept ? begin : s.num_kept;
      s.pooled_first = begin > s.num_kept ? begin - s.num_kept : 0;
      s.num_correction = end > s.num_kept ? end - s.num_kept - s.pooled_first : 0;
      s.num_kept = kept_end - s.kept_first;
    }
    return s;
  }

  // The i-th KV tile to visit, i < num_kept.
  __host__ __device__ __forceinline__ int block(int i) const {
    if constexpr (kSplitKv) i += kept_first;
    if constexpr (kTilesPerBlock == 1) {
      return kept ? kept[num_kept_blocks - 1 - i] : n_block_max - 1 - i;
    } else {
      if (!kept) return n_block_max - 1 - i;
      const int e = i + skipped;
      return kept[num_kept_blocks - 1 - e / kTilesPerBlock] * kTilesPerBlock + (kTilesPerBlock - 1 - e % kTilesPerBlock);
    }
  }

  // The request's pooled tile of the c-th pooled stage, c < num_correction.
  __host__ __device__ __forceinline__ int pooled_tile(int c) const { return first_pooled_tile() + c; }
  // The request's first pooled tile of this split (0 without split-KV).
  __host__ __device__ __forceinline__ int first_pooled_tile() const { return kSplitKv ? pooled_first : 0; }

  __host__ __device__ __forceinline__ int num_stages() const { return num_kept + num_correction; }
};

// The schedule of the instantiation `Traits`.
template <class Traits>
using BlockScheduleFor = BlockSchedule<Traits::kTilesPerBlock, Traits::kSplitKv>;

}  // namespace fpv2::hopper
