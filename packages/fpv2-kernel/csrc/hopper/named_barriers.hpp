// Named hardware barriers (ids counted after CUTLASS's reserved ones: cutlass::arch::NamedBarrier adds its 8
// reserved ids, so only 0..7 exist here; an id past 7 addresses no barrier and hangs the CTA).
#pragma once

#include <cstdint>

namespace fpv2::hopper {

enum class ConsumerBarrier : uint32_t {
  kQueryReadyWarpGroup1 = 0,  // + consumer warpgroup index: that warpgroup's Q rows are in shared memory
  kQueryReadyWarpGroup2 = 1,
  kValueTailCleared = 2,      // both consumer warpgroups cleared their share of the stale V rows
  kPendingShifts = 3,         // the correction's table of pending shifts is filled / complete
  kTurnWarpGroup1 = 5,            // + consumer warpgroup index: that warpgroup may issue its QK product
  kTurnWarpGroup2 = 6,            //   (pingpong schedule, FPV2_HOPPER_PINGPONG=1)
  kPendingShiftsBuilt = 7,        // the producer's idle warps filled the correction's table (TMA path)
};

__device__ __forceinline__ constexpr uint32_t barrier_id(ConsumerBarrier b) { return static_cast<uint32_t>(b); }

static_assert(static_cast<uint32_t>(ConsumerBarrier::kPendingShiftsBuilt) <= 7,
              "CUTLASS reserves 8 of the 16 hardware barriers: ids 0..7 are left");

}  // namespace fpv2::hopper
