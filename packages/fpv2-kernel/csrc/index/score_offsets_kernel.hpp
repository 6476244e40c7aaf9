// The index's prefix sums after scoring, in one CTA: offsets = [0, cumsum(counts)] (the CSR offsets) and
// tile_offsets = [0, cumsum(tiles of each request)]. 1024 threads take 4096 counts per step (cub's block
// scan), the carry kept by every thread.
#pragma once

#include <cstdint>

#include <cub/block/block_scan.cuh>

#include "index/score_params.hpp"

namespace fpv2::index {

inline constexpr int kScanThreads = 1024;
inline constexpr int kScanItems = 4;

template <class Element>
__global__ void __launch_bounds__(kScanThreads) score_offsets_kernel(ScoreParams<Element> p, int tile_rows) {
  using Scan = cub::BlockScan<int32_t, kScanThreads>;
  __shared__ typename Scan::TempStorage scan_storage;
  __shared__ int32_t step_total;

  int32_t carry = 0;
  for (int64_t base = 0; base < p.num_segments; base += int64_t(kScanThreads) * kScanItems) {
    int32_t items[kScanItems];
    const int64_t first = base + int64_t(threadIdx.x) * kScanItems;
    for (int k = 0; k < kScanItems; ++k) items[k] = first + k < p.num_segments ? p.counts[first + k] : 0;
    int32_t total;
    Scan(scan_storage).InclusiveSum(items, items, total);
    for (int k = 0; k < kScanItems; ++k) {
      if (first + k < p.num_segments) p.offsets[first + k + 1] = carry + items[k];
    }
    if (threadIdx.x == 0) step_total = total;
    __syncthreads();  // the scan storage is reused, and every thread reads the step's total
    carry += step_total;
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    p.offsets[0] = 0;
    p.tile_offsets[0] = 0;
    int32_t tiles = 0;
    for (int b = 0; b < p.num_requests; ++b) {
      const int32_t q_len = p.cu_seqlens_q[b + 1] - p.cu_seqlens_q[b];
      tiles += (q_len * p.group + tile_rows - 1) / tile_rows;
      p.tile_offsets[b + 1] = int32_t(tiles);
    }
  }
}

}  // namespace fpv2::index
