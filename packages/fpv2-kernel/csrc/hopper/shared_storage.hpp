// Shared-memory plan of one CTA of the prefill kernel.
//
// Every tile buffer starts on a 1024-byte boundary: the 128-byte swizzle repeats every 8 rows of 128 bytes,
// and the hardware (TMA writes, wgmma reads) swizzles on absolute shared-memory address bits, while the
// threads that write Q (cp.async) or clear V rows compute the swizzle from the offset inside the buffer.
// The two agree only when each buffer is 1024-byte aligned; the kernel aligns the dynamic base as well.
#pragma once

#include <cstddef>

#include <cute/tensor.hpp>

#include "hopper/correction_mask.hpp"
#include "hopper/kv_pipeline.hpp"
#include "hopper/tile_queue.hpp"

namespace fpv2::hopper {

inline constexpr int kSmemTileAlignment = 1024;

template <class Traits>
struct PrefillSharedStorage {
  using Element = typename Traits::Element;
  alignas(kSmemTileAlignment) Element q[cute::cosize_v<typename Traits::SmemLayoutQ>];
  alignas(kSmemTileAlignment) Element k[cute::cosize_v<typename Traits::SmemLayoutK>];
  alignas(kSmemTileAlignment) Element v[cute::cosize_v<typename Traits::SmemLayoutVt>];
  KvPipelineStorage<Traits::kStages> pipeline_k;
  KvPipelineStorage<Traits::kStages> pipeline_v;
  PendingShiftsFor<Traits> pending_shifts;  // mean correction only
  TileQueueStorage tile_queue;              // dynamic persistent scheduler only
};

// Dynamic shared memory to request: the storage plus the slack used to align its base.
template <class Traits>
constexpr std::size_t prefill_smem_bytes() {
  return sizeof(PrefillSharedStorage<Traits>) + kSmemTileAlignment;
}

}  // namespace fpv2::hopper
