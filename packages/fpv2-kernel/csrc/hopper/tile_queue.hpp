// Dynamic tile scheduler of the persistent CTAs (FPV2_HOPPER_PERSISTENT=dynamic): a CTA takes its first tile
// from blockIdx.x and every later one from a global counter in the caller's workspace (zeroed before the
// launch), so that a CTA that drew light tiles takes more of them. The static snake order
// (persistent_order.hpp) fixes each CTA's tiles in advance; over a random CSR of ~5 kept blocks a tile the
// CTAs' sums of work spread by an estimated +-10% at 32K (the slowest CTA sets the kernel time): the size of
// the static persistent CTAs' loss against one CTA per tile at 3% density (2026-12-02 device run), while
// they win 18% where tiles hold one or two blocks.
//
// Inside the CTA the producer warp claims the indices and hands them to the consumers through a ring of
// kTileSlots shared-memory slots, each with a full barrier (one arrival: the producer's) and an empty one
// (one arrival per consumer warp). The producer publishes tile w + 1 before it loads tile w, so the
// consumers, who read it while their tile w ends (to issue its Q rows under the last PV product), never
// wait for it; it waits for a slot only when it runs kTileSlots - 1 tiles ahead. An index >= num_tiles
// ends the walk (every CTA's last claim).
//
// A first queue (sixth session, rejected: NOTES.md) published each index only after the previous tile's
// loads, over two slots, in a build whose persistent loops had lost the uniform datapath; this one publishes
// a tile ahead and decodes every tile from a broadcast index (uniform_tile, prefill_kernel.hpp).
#pragma once

#include <cstdint>

#include <cutlass/arch/barrier.h>
#include <cute/arch/cluster_sm90.hpp>

#include "hopper/split_kv.hpp"

namespace fpv2::hopper {

inline constexpr int kTileSlots = 4;

// Workspace of the counter (one int32, in its own aligned block).
inline constexpr uint64_t tile_queue_workspace_bytes() { return align_workspace(4u); }

struct TileQueueStorage {
  alignas(8) uint64_t full[kTileSlots];
  alignas(8) uint64_t empty[kTileSlots];
  int32_t index[kTileSlots];
};

#if defined(__CUDACC__)

class TileQueue {
 public:
  // One thread initialises; the caller fences (fence_barrier_init) and synchronises the CTA afterwards.
  __device__ static void init(TileQueueStorage& storage, uint32_t consumer_warps) {
    for (int s = 0; s < kTileSlots; ++s) {
      cutlass::arch::ClusterBarrier::init(&storage.full[s], 1);
      cutlass::arch::ClusterBarrier::init(&storage.empty[s], consumer_warps);
    }
  }

  // Producer warp (all lanes): the next tile index past the first wave; lane 0 claims, every lane gets it.
  __device__ static int claim(int32_t* counter) {
    int index = 0;
    if (cute::elect_one_sync()) index = int(gridDim.x) + atomicAdd(counter, 1);
    return __shfl_sync(0xffffffffu, index, 0);
  }

  // Producer warp (all lanes): publish the w-th tile index of this CTA (lane 0 writes, after the consumers
  // released the slot's previous use: parity 1 of a fresh barrier counts as completed).
  __device__ static void push(TileQueueStorage& storage, int w, int index) {
    const int slot = w % kTileSlots;
    if (cute::elect_one_sync()) {
      cutlass::arch::ClusterBarrier::wait(&storage.empty[slot], uint32_t(((w / kTileSlots) & 1) ^ 1));
      storage.index[slot] = index;
      cutlass::arch::ClusterBarrier::arrive(&storage.full[slot]);
    }
    __syncwarp();
  }

  // Consumer warp (all lanes): the w-th tile index of this CTA, read once per warp, broadcast from lane 0
  // (so that the tile decoded from it is provably warp-uniform: see uniform_tile in prefill_kernel.hpp).
  __device__ static int pop(TileQueueStorage& storage, int w) {
    const int slot = w % kTileSlots;
    cutlass::arch::ClusterBarrier::wait(&storage.full[slot], uint32_t((w / kTileSlots) & 1));
    const int index = storage.index[slot];
    __syncwarp();
    if (cute::elect_one_sync()) cutlass::arch::ClusterBarrier::arrive(&storage.empty[slot]);
    return __shfl_sync(0xffffffffu, index, 0);
  }
};

#endif  // __CUDACC__

}  // namespace fpv2::hopper
