// The tiles a persistent CTA walks: its k-th tile is in wave k of gridDim.x consecutive tiles, taken in
// alternating directions (boustrophedon), so that every CTA gets about the same work from tiles ordered by
// decreasing causal length. With a plain stride CTA 0 took the longest tile of every wave (dense 128K: 17%
// slower than one CTA per tile). Host-callable for the native order check (hopper_layout_check.cu).
#pragma once

namespace fpv2::hopper {

// Tile index of CTA `cta`'s k-th tile among `ctas` persistent CTAs; may be past the last tile in the last
// wave (the caller skips those).
__host__ __device__ __forceinline__ constexpr int persistent_tile_index(int k, int cta, int ctas) {
  return k * ctas + ((k & 1) ? ctas - 1 - cta : cta);
}

}  // namespace fpv2::hopper
