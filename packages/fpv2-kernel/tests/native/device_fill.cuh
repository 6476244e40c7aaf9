// Deterministic device-side fills for the native tests (no curand on the build machines): a counter-based
// hash (splitmix64 finaliser) of (seed, index) gives uniform values; poison fills write NaN bit patterns.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>

namespace fpv2::native_test {

// bf16 and fp32 quiet-NaN bit patterns used as poison; a stray write is any other pattern.
inline constexpr uint16_t kBf16Poison = 0x7fc1;
inline constexpr uint32_t kF32Poison = 0x7fc00001u;

__host__ __device__ inline uint64_t mix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Uniform in [lo, hi) from (seed, index).
__device__ inline float hash_uniform(uint64_t seed, uint64_t index, float lo, float hi) {
  const uint32_t bits = static_cast<uint32_t>(mix64(seed * 0x100000001b3ull + index) >> 40);  // 24 bits
  return lo + (hi - lo) * (static_cast<float>(bits) * (1.0f / 16777216.0f));
}

__global__ void fill_uniform_bf16(__nv_bfloat16* p, int64_t n, uint64_t seed, float lo, float hi) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    p[i] = __float2bfloat16(hash_uniform(seed, uint64_t(i), lo, hi));
  }
}

// Cache rows (one token slot = row_elems values): random where slot_valid[slot] != 0, NaN poison elsewhere,
// so that any read of a slot past a request's length (or of an unused page) shows up as a NaN.
__global__ void fill_cache_bf16(__nv_bfloat16* cache, int64_t slots, int64_t row_elems, const uint8_t* slot_valid,
                                uint64_t seed) {
  const int64_t n = slots * row_elems;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t slot = i / row_elems;
    cache[i] = slot_valid[slot] ? __float2bfloat16(hash_uniform(seed, uint64_t(i), -1.0f, 1.0f))
                                : __ushort_as_bfloat16(kBf16Poison);
  }
}

__global__ void poison_bf16(__nv_bfloat16* p, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    p[i] = __ushort_as_bfloat16(kBf16Poison);
  }
}

__global__ void poison_f32(float* p, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    p[i] = __uint_as_float(kF32Poison);
  }
}

inline unsigned fill_blocks(int64_t n) {
  const int64_t blocks = (n + 255) / 256;
  return static_cast<unsigned>(blocks < 65536 ? (blocks > 0 ? blocks : 1) : 65536);
}

}  // namespace fpv2::native_test
