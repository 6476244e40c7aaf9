// Named hardware barriers (ids counted after CUTLASS's reserved ones).
#pragma once

#include <cstdint>

namespace fpv2::hopper {

enum class ConsumerBarrier : uint32_t {
  kQueryReadyWarpGroup1 = 0,  // + consumer warpgroup index: that warpgroup's Q rows are in shared memory
  kQueryReadyWarpGroup2 = 1,
  kValueTailCleared = 2,      // both consumer warpgroups cleared their share of the stale V rows
  kPendingLengths = 3,            // the correction's table of pending block lengths is filled / complete
  kTurnWarpGroup1 = 5,            // + consumer warpgroup index: that warpgroup may issue its QK product
  kTurnWarpGroup2 = 6,            //   (pingpong schedule, FPV2_HOPPER_PINGPONG=1)
};

// Named barriers among the producer warpgroup's threads (cp.async gather), after the consumer ones.
enum class ProducerBarrier : uint32_t {
  kGatherRows = 4,  // every producer thread published its token's cache row for the tile
};

__device__ __forceinline__ constexpr uint32_t barrier_id(ConsumerBarrier b) { return static_cast<uint32_t>(b); }
__device__ __forceinline__ constexpr uint32_t barrier_id(ProducerBarrier b) { return static_cast<uint32_t>(b); }

}  // namespace fpv2::hopper
