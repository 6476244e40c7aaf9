// The kept-block work order (ALGORITHM.md section 5: work per tile is proportional to its kept-block count,
// so schedule the heaviest first): before the prefill launch, two small kernels sort the call's tiles by
// decreasing work into a permutation in the caller's workspace; the prefill kernel looks its tile up there
// (tile_order.hpp). One CTA per tile then runs as a longest-first list schedule (the hardware starts CTAs in
// index order as SMs free up), and persistent CTAs take the snake order over the sorted tiles.
//
// Work of a tile = the KV tiles of its BlockSchedule (kept + pooled), in half-octave buckets (work_bucket):
// the sort is by bucket only and keeps, within a bucket, the decoded order's runs (a CTA of the scatter
// kernel writes its 256 consecutive tiles of one bucket contiguously), so that tiles resident together
// still tend to be neighbours of one KV head and share its blocks in L2. Grid slots past a request's last
// tile go last (bucket 0).
//
//   work_keys_kernel     one thread per tile: its bucket, and the call's histogram (global atomics)
//   work_scatter_kernel  one thread per tile: its slot = the heavier buckets' total + its block's share
//                        (one atomic per bucket and block) + its rank in its warp (match.any)
//
// Host-callable parts (bucket, workspace layout) are checked natively (hopper_layout_check.cu).
#pragma once

#include <cstdint>

#include "hopper/split_kv.hpp"
#include "hopper/tile_order.hpp"

namespace fpv2::hopper {

inline constexpr int kWorkBuckets = 32;
inline constexpr int kWorkOrderThreads = 256;

// Bucket of a tile that visits `stages` KV tiles: 0 for none (or an invalid slot), else 1 + 2 e + h for
// 2^e <= stages < 2^(e+1), h the bit below the leading one (two buckets per octave), capped at
// kWorkBuckets - 1 (2^15 tiles and more). Monotone in `stages`.
__host__ __device__ constexpr int work_bucket(int stages) {
  if (stages <= 0) return 0;
  int e = 0;
  while ((stages >> (e + 1)) != 0) ++e;
  const int half = e > 0 ? (stages >> (e - 1)) & 1 : 0;
  const int bucket = 1 + 2 * e + half;
  return bucket < kWorkBuckets ? bucket : kWorkBuckets - 1;
}

// Workspace layout: the bucket counts and cursors (2 x kWorkBuckets int32, zeroed before the keys kernel),
// then one byte of bucket per tile, then the permutation (int32 per tile).
inline constexpr uint64_t work_order_counters_bytes() { return align_workspace(2u * kWorkBuckets * 4u); }
inline constexpr uint64_t work_order_keys_offset() { return work_order_counters_bytes(); }
inline constexpr uint64_t work_order_permutation_offset(int64_t num_tiles) {
  return work_order_keys_offset() + align_workspace(uint64_t(num_tiles));
}
inline constexpr uint64_t work_order_workspace_bytes(int64_t num_tiles) {
  return num_tiles <= 0 ? 0 : work_order_permutation_offset(num_tiles) + align_workspace(uint64_t(num_tiles) * 4u);
}

// First slot of bucket b in the permutation: the number of tiles in heavier buckets.
__host__ __device__ inline int work_bucket_base(int32_t const* counts, int bucket) {
  int base = 0;
  for (int heavier = kWorkBuckets - 1; heavier > bucket; --heavier) base += counts[heavier];
  return base;
}

#if defined(__CUDACC__)

// `params` decodes tile indices without a permutation (tile_order == nullptr).
template <class Traits, class Geometry, class Schedule, class Params>
__global__ void __launch_bounds__(kWorkOrderThreads)
    work_keys_kernel(__grid_constant__ const Params params, int num_tiles, uint8_t* keys, int32_t* counts) {
  __shared__ int histogram[kWorkBuckets];
  if (threadIdx.x < kWorkBuckets) histogram[threadIdx.x] = 0;
  __syncthreads();
  const int index = int(blockIdx.x) * kWorkOrderThreads + int(threadIdx.x);
  if (index < num_tiles) {
    const Geometry tile = tile_at<Geometry>(params, index);
    const int stages = tile.valid() ? Schedule::make(params, tile, Traits::kBlockN).num_stages() : 0;
    const int bucket = work_bucket(stages);
    keys[index] = uint8_t(bucket);
    atomicAdd(&histogram[bucket], 1);
  }
  __syncthreads();
  if (threadIdx.x < kWorkBuckets && histogram[threadIdx.x] != 0) {
    atomicAdd(&counts[threadIdx.x], histogram[threadIdx.x]);
  }
}

// A template (of its block size) so that every translation unit that includes it may instantiate it.
template <int kThreads>
__global__ void __launch_bounds__(kThreads)
    work_scatter_kernel(int num_tiles, uint8_t const* keys, int32_t const* counts, int32_t* cursors,
                        int32_t* permutation) {
  constexpr int kWarps = kThreads / 32;
  __shared__ int warp_offset[kWarps][kWorkBuckets];  // a warp's first slot in its block's share of a bucket
  __shared__ int block_slot[kWorkBuckets];           // the block's first slot of a bucket in the permutation
  for (int i = int(threadIdx.x); i < kWarps * kWorkBuckets; i += kThreads) (&warp_offset[0][0])[i] = 0;
  __syncthreads();
  const int lane = int(threadIdx.x) % 32, warp = int(threadIdx.x) / 32;
  const int index = int(blockIdx.x) * kThreads + int(threadIdx.x);
  const bool inside = index < num_tiles;
  const int key = inside ? int(keys[index]) : kWorkBuckets;  // the slots past the end match only each other
  const unsigned peers = __match_any_sync(0xffffffffu, key);
  const int rank = __popc(peers & ((1u << lane) - 1u));  // lanes of the same bucket before this one
  if (inside && lane == __ffs(peers) - 1) warp_offset[warp][key] = __popc(peers);
  __syncthreads();
  if (threadIdx.x < kWorkBuckets) {
    const int bucket = int(threadIdx.x);
    int total = 0;
    for (int w = 0; w < kWarps; ++w) {
      const int count = warp_offset[w][bucket];
      warp_offset[w][bucket] = total;
      total += count;
    }
    block_slot[bucket] = total == 0 ? 0 : work_bucket_base(counts, bucket) + atomicAdd(&cursors[bucket], total);
  }
  __syncthreads();
  if (inside) permutation[block_slot[key] + warp_offset[warp][key] + rank] = index;
}

#endif  // __CUDACC__

}  // namespace fpv2::hopper
