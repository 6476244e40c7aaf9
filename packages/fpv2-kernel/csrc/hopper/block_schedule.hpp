// Which KV tiles one query tile visits, in the order the producer loads them and the consumers read them:
//   1. its kept KV blocks, last first: every visible block (dense), or the tile's CSR segment (sparse);
//   2. then, with the mean correction, ceil(n_block_masked / 128) tiles of 128 pooled rows: pooled rows
//      c * 128 .. c * 128 + 127 of the request, i.e. every block that may be eligible (J < n_block_masked).
// Producer and consumers build the same schedule from the same parameters, so they agree on the number and
// order of pipeline stages without talking to each other.
//
// The CSR segment of (request b, KV head h, tile t) is s = Hkv * tile_offsets[b] + h * ntiles_b + t with
// ntiles_b = tile_offsets[b + 1] - tile_offsets[b] (fpv2.h); its ids are ascending, so walking the segment
// backwards visits the diagonal band (the masked blocks) first, as the dense schedule does.
#pragma once

#include <cstdint>

namespace fpv2::hopper {

struct BlockSchedule {
  int32_t const* kept;   // the segment's first id (sparse) or nullptr (dense)
  int num_kept;          // KV blocks to visit
  int n_block_max;       // dense: blocks 0 .. n_block_max - 1
  int num_correction;    // pooled tiles after the kept blocks (0 without the correction)

  template <class Params, class Geometry>
  __device__ __forceinline__ static BlockSchedule make(Params const& params, Geometry const& tile, int pooled_tile) {
    BlockSchedule s;
    s.n_block_max = tile.n_block_max;
    if (params.index_offsets == nullptr) {
      s.kept = nullptr;
      s.num_kept = tile.n_block_max;
    } else {
      const int tile_begin = params.index_tile_offsets[tile.request];
      const int num_tiles = params.index_tile_offsets[tile.request + 1] - tile_begin;
      if (tile.m_block < num_tiles) {
        const int64_t segment = int64_t(params.num_kv_heads) * tile_begin + int64_t(tile.kv_head) * num_tiles +
                                tile.m_block;
        const int begin = params.index_offsets[segment];
        s.kept = params.index_blocks + begin;
        s.num_kept = params.index_offsets[segment + 1] - begin;
      } else {
        // An index built for other tiles (the Python contract checks this): visit nothing rather than read
        // past the segment table.
        s.kept = params.index_blocks;
        s.num_kept = 0;
      }
    }
    s.num_correction = params.has_correction ? (tile.n_block_masked + pooled_tile - 1) / pooled_tile : 0;
    return s;
  }

  // The i-th KV block to visit, i < num_kept.
  __device__ __forceinline__ int block(int i) const { return kept ? kept[num_kept - 1 - i] : n_block_max - 1 - i; }

  __device__ __forceinline__ int num_stages() const { return num_kept + num_correction; }
};

}  // namespace fpv2::hopper
