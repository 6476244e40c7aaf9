// A 16-byte cp.async from global memory into a 32-bit shared-memory address, zero-filling when `valid` is
// false (a zero-size source reads nothing, so any valid address stands in as `src`), 16- and 8-byte shared
// loads from such an address, and the element offsets of the swizzled shared-memory layouts as plain
// integers. The gather producer (kv_gather_producer.hpp) and the correction's tables (correction_mask.hpp)
// form their addresses from these in 32-bit arithmetic: CuTe's swizzled smem pointers are 64-bit generic
// pointers, which cost ptxas pairs of registers per chunk in the producer's 24 and spilled the consumers.
#pragma once

#include <cstdint>

#include <cute/pointer_flagged.hpp>
#include <cute/tensor.hpp>

namespace fpv2::hopper {

__device__ __forceinline__ void cp_async_16_zfill(uint32_t smem_address, void const* src, bool valid) {
  asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" ::"r"(smem_address), "l"(src),
               "r"(valid ? 16u : 0u)
               : "memory");
}

// 16 bytes from a 32-bit shared-memory address (one LDS.128; a generic pointer into the swizzled layouts
// compiles to 64-bit address arithmetic and generic loads). Volatile: kept after the barrier that publishes them.
__device__ __forceinline__ uint4 ld_shared_16(uint32_t smem_address) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(smem_address));
  return v;
}

// 8 bytes from a 32-bit shared-memory address (one LDS.64).
__device__ __forceinline__ uint2 ld_shared_8(uint32_t smem_address) {
  uint2 v;
  asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];\n" : "=r"(v.x), "=r"(v.y) : "r"(smem_address));
  return v;
}

// The lane index and the warp's index within its warpgroup, read with volatile instructions so that the
// compiler re-reads them at each use instead of keeping them (and what is derived from them) live in
// registers: the gather producer runs in 24 registers.
__device__ __forceinline__ int lane_id() {
  int lane;
  asm volatile("mov.u32 %0, %%laneid;\n" : "=r"(lane));
  return lane;
}

__device__ __forceinline__ int warp_in_warpgroup() {
  int thread;
  asm volatile("mov.u32 %0, %%tid.x;\n" : "=r"(thread));
  return (thread / 32) % 4;
}

// Element offset of `coord` in a buffer with the swizzled shared-memory layout SmemLayout (a GMMA swizzle
// atom tiled over the buffer): the swizzle acts on address bits, so the offset is exact for buffers whose
// base is aligned to the swizzle's period (1024 bytes for the 128-byte swizzle: PrefillSharedStorage). The
// host layout check compares it with CuTe's swizzled pointers.
template <class SmemLayout, class... Coords>
CUTE_HOST_DEVICE int smem_offset(Coords... coords) {
  return int(cute::as_position_independent_swizzle_layout(SmemLayout{})(coords...));
}

}  // namespace fpv2::hopper
