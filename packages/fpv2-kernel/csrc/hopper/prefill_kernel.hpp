// The sm_90a causal prefill kernel (dense, block-sparse over a CSR index, with the mean correction): warp
// roles, register reallocation and the shared-memory pipeline set-up around the producer (kv_producer.hpp)
// and the consumers (consumer_mainloop.hpp); both walk the tile's BlockSchedule (block_schedule.hpp).
//
// Grid: one CTA per (query tile of the longest request, KV head, request), 1-D; block: 384 threads (producer
// warpgroup + two consumer warpgroups); one CTA per SM (prefill_smem_bytes(): 211 KB at d = 64, 227 KB at
// d = 128, 226 KB at d = 256, with the correction's table of pending shifts). Slots past a request's last tile exit at once.
//
// K/V reach shared memory by TMA when page_size is a multiple of the KV tile (kv_producer.hpp, one elected
// thread), else by a cp.async gather of the whole producer warpgroup (kv_gather_producer.hpp).
//
// Persistent mode (opt-in, FPV2_HOPPER_PERSISTENT=1; TMA path only): one CTA per SM walks the tiles in the
// snake order of persistent_order.hpp, so the producer fills the next tile's stages (its schedule and page
// reads included) while the consumers finish the current one, and the consumers issue the next tile's Q
// rows under the current tile's last PV product. With the overlapped consumers (the default) or without
// (OVERLAP=0). Measured (2026-12-01, sixth session): -20% on tiles of one kept block, but slower on the
// random-CSR and dense timings and on the planted pipeline, so it stays off (benchmarks/NOTES.md). Those builds'
// loops had lost the uniform datapath (uniform_tile below); with it back (2026-12-02) the snake order still
// loses on the planted pipeline (128K +8%). FPV2_HOPPER_PERSISTENT=dynamic takes the tiles from the dynamic
// tile queue (tile_queue.hpp) instead: 12-21% faster on light tiles, a tie on the planted pipeline, opt-in.
//
// Overlapped consumers (the default; FPV2_HOPPER_OVERLAP=0 turns them off; consumer_mainloop.hpp): a third
// instantiation, one CTA per tile.
//
// Head dim 256 walks KV tiles of 64 tokens, two per index block (prefill_kv_tile, BlockSchedule): Q and two
// stages of 128-token tiles would exceed one CTA's shared memory, and a 128-token tile's scores would not fit
// in the consumers' registers beside O's 128 accumulators. The correction's pooled tiles are then 64 pooled
// rows each; the FP8 pooled products are built for 128-token tiles only.
//
// Split-KV (Traits::kSplitKv, split_kv.hpp): for calls with fewer CTAs than SMs, params.num_splits CTAs per
// tile each walk one contiguous part of its schedule and store normalised fp32 rows and their lse; the
// launcher then merges them (split_combine.hpp). Its own instantiation of the overlapped consumers.
//
// Kept-block work order (work_order.hpp, opt-in: FPV2_HOPPER_WORK_ORDER): tile slot i computes the i-th
// tile by decreasing kept-block work, so the heaviest tiles start first (tile_order.hpp).
//
// Not yet here: FP8 attention (the correction's pooled products already run in FP8 with the E4M3 copies of the
// pooled statistics: kPooledE4M3, overlapped consumers only). Head dims 64, 128 and 256 are instantiated
// (prefill_instances.hpp), each with the K/V stages of prefill_stages().
#pragma once

#include <cstdint>

#include <cute/arch/cluster_sm90.hpp>
#include <cute/arch/copy_sm90_desc.hpp>
#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/cutlass.h>

#include "hopper/consumer_mainloop.hpp"
#include "hopper/prefill_params.hpp"
#include "hopper/kv_gather_producer.hpp"
#include "hopper/kv_pipeline.hpp"
#include "hopper/kv_producer.hpp"
#include "hopper/persistent_order.hpp"
#include "hopper/tile_queue.hpp"
#include "hopper/shared_storage.hpp"
#include "hopper/tile_geometry.hpp"
#include "hopper/tile_order.hpp"

// wgmma and setmaxnreg exist only for the architecture-specific target sm_90a.
#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#error "fpv2: the Hopper prefill kernel needs -gencode=arch=compute_90a,code=sm_90a"
#endif

namespace fpv2::hopper {

// kSecondOrder: the correction's second-order mass shift (correction_mask.hpp), a variant of its own so that the
// mean correction's registers stay as they were (with a runtime switch, the default kernel's spills grew 28 ->
// 144 bytes at d = 128); built for the overlapped consumers with one CTA per tile only.
template <class Traits, bool kPersistent, bool kOverlap, bool kPooledE4M3 = false, bool kDynamicTiles = false,
          bool kSecondOrder = false>
__global__ void __launch_bounds__(Traits::kNumThreads, 1)
    prefill_kernel(__grid_constant__ const PrefillParams<Traits> params) {
  static_assert(!kPooledE4M3 || Traits::kPooledE4M3Built, "the FP8 pooled products need 128-token KV tiles");
  static_assert(!kSecondOrder || (!kPersistent && kOverlap), "the second-order shift: one CTA per tile, overlapped");
  static_assert(!kDynamicTiles || (kPersistent && kOverlap && !kPooledE4M3),
                "the dynamic tile queue is built for persistent CTAs with the overlapped consumers");
  static_assert(!Traits::kSplitKv || (!kPersistent && kOverlap && !kPooledE4M3),
                "split-KV is built into the overlapped consumers, one CTA per tile, bf16 pooled products");
  using Storage = PrefillSharedStorage<Traits>;
  using Geometry = TileGeometry<Traits::kBlockM, Traits::kBlockN, Traits::kBlockSize>;
  using Pipeline = KvPipeline<Traits::kStages>;

  extern __shared__ char smem_raw[];
  const uintptr_t base = reinterpret_cast<uintptr_t>(smem_raw);
  Storage& smem = *reinterpret_cast<Storage*>((base + kSmemTileAlignment - 1) & ~uintptr_t(kSmemTileAlignment - 1));

  // Work tiles in a 1-D order (tile_order.hpp: head-major by default, optionally through the kept-block
  // work order of work_order.hpp). One CTA per tile, or (kPersistent) one CTA per SM walking the snake order.
  const int heads_x_requests = params.num_kv_heads * params.num_requests;
  auto tile_at = [&](int index) { return fpv2::hopper::tile_at<Geometry>(params, index); };
  // Persistent CTAs: the CTA's k-th tile is in the snake order of persistent_order.hpp; producer and consumers
  // walk its valid tiles (uniform over the CTA) with this one function, so they agree on every tile.
  // next_valid(k, tile): the first k' >= k whose tile is valid (written to `tile`), or -1.
  const int num_tiles = params.num_m_blocks * heads_x_requests;
  auto next_valid = [&](int k, Geometry& tile) {
    for (; k * int(gridDim.x) < num_tiles; ++k) {
      const int index = persistent_tile_index(k, int(blockIdx.x), int(gridDim.x));
      if (index >= num_tiles) continue;
      tile = tile_at(index);
      if (tile.valid()) return k;
    }
    return -1;
  };
  // The k-th tile decoded straight-line from lane 0's k (whole warps only; every lane finds the same k). A tile
  // that comes out of next_valid's loop is not provably warp-uniform to ptxas, and everything derived from it
  // (the schedule, the stage barriers' addresses, the wgmma descriptors) then moved to vector registers: the
  // persistent consumers' kept-block step took 747 instructions (48 R2UR) against 712 (16) for one CTA per
  // tile, the size of their dense-mode loss; decoded this way, 711 (tools/sass_loop_census.py, 2026-12-02).
  auto uniform_tile = [&](int k) {
    return tile_at(persistent_tile_index(__shfl_sync(0xffffffffu, k, 0), int(blockIdx.x), int(gridDim.x)));
  };
  // One CTA per tile: the CTA's tile, or with split-KV (Traits::kSplitKv, split_kv.hpp) split
  // blockIdx.x % num_splits of tile blockIdx.x / num_splits (the splits of a tile run side by side and share
  // its Q rows in L2).
  auto cta_tile = [&]() {
    if constexpr (Traits::kSplitKv) {
      Geometry tile = tile_at(int(blockIdx.x) / params.num_splits);
      tile.split = int(blockIdx.x) % params.num_splits;
      return tile;
    }
    return tile_at(int(blockIdx.x));
  };
  if constexpr (!kPersistent) {
    if (!cta_tile().valid()) {
      return;  // uniform over the CTA, before any barrier
    }
  }

  const int warp = cutlass::canonical_warp_idx_sync();
  if (warp == 0 && cute::elect_one_sync()) {
    cute::prefetch_tma_descriptor(params.tma_k.get_tma_descriptor());
    cute::prefetch_tma_descriptor(params.tma_v.get_tma_descriptor());
    if (params.has_correction && params.pooled_e4m3) {
      cute::prefetch_tma_descriptor(params.tma_pooled_k_e4m3.get_tma_descriptor());
      cute::prefetch_tma_descriptor(params.tma_pooled_vt_e4m3.get_tma_descriptor());
    } else if (params.has_correction) {  // else the first pooled copy fetches its descriptor on the critical path
      cute::prefetch_tma_descriptor(params.tma_pooled_k.get_tma_descriptor());
      cute::prefetch_tma_descriptor(params.tma_pooled_v.get_tma_descriptor());
    }
    // A stage fills with one TMA arrival, or with one cp.async arrival per producer thread (gather); one
    // arrival per consumer warp releases it (KvPipeline::consumer_release).
    const uint32_t producer_arrivals = params.gather ? Traits::kThreadsPerWarpGroup : 1;
    Pipeline::init(smem.pipeline_k, producer_arrivals, Traits::kNumConsumerThreads / 32);
    Pipeline::init(smem.pipeline_v, producer_arrivals, Traits::kNumConsumerThreads / 32);
    if constexpr (kDynamicTiles) TileQueue::init(smem.tile_queue, Traits::kNumConsumerThreads / 32);
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();

  // Each warpgroup's role is one branch, with its setmaxnreg first, as ptxas needs to honour it. The
  // pipeline positions carry over from tile to tile, so producer and consumers stay in step.
  if (warp < Traits::kThreadsPerWarpGroup / 32) {
    cutlass::arch::warpgroup_reg_dealloc<Traits::kProducerRegisters>();
    auto state = Pipeline::producer_start();
    auto produce = [&](Geometry const& tile) {
      if constexpr (kPersistent) {  // the launcher sends only the TMA path here (fewer producer spills)
        if (warp == 0 && cute::elect_one_sync()) KvProducer<Traits>::run(params, tile, smem, state);
        return;
      }
      if (params.gather) {
        KvGatherProducer<Traits>::run(params, tile, smem, state);
      } else if (warp == 0) {
        if (cute::elect_one_sync()) KvProducer<Traits>::run(params, tile, smem, state);
      } else if (kOverlap && params.has_correction) {
        // Warps 1..3 are idle on the TMA path: they fill the correction's table for the overlapped
        // consumers (consumer_mainloop.hpp waits for it at the first pooled tile).
        const BlockScheduleFor<Traits> schedule = BlockScheduleFor<Traits>::make(params, tile, Traits::kBlockN);
        if (schedule.num_correction > 0) {
          CorrectionMask<Traits>::template build_by_producer<kSecondOrder>(
              smem.pending_shifts, params, schedule, params.pooled_block_offsets[tile.request], tile.kv_head,
              tile.n_pooled_eligible, CorrectionMask<Traits>::log2_to_raw(params), int(threadIdx.x) - 32);
        }
      }
    };
    if constexpr (kDynamicTiles) {
      // Warp 0 claims and publishes the CTA's tiles (tile_queue.hpp), each one tile ahead of its loads.
      if (warp == 0) {
        auto claim_valid = [&](int index) {
          while (index < num_tiles && !tile_at(index).valid()) index = TileQueue::claim(params.tile_counter);
          return index;
        };
        int index = claim_valid(int(blockIdx.x));
        TileQueue::push(smem.tile_queue, 0, index);
        for (int w = 0; index < num_tiles; ++w) {
          const int next = claim_valid(TileQueue::claim(params.tile_counter));
          TileQueue::push(smem.tile_queue, w + 1, next);
          produce(tile_at(__shfl_sync(0xffffffffu, index, 0)));
          index = next;
        }
      }
    } else if constexpr (kPersistent) {
      Geometry found;
      for (int k = next_valid(0, found); k >= 0; k = next_valid(k + 1, found)) produce(uniform_tile(k));
    } else {
      produce(cta_tile());
    }
  } else {
    cutlass::arch::warpgroup_reg_alloc<Traits::kConsumerRegisters>();
    auto state = Pipeline::consumer_start();
    const int consumer_thread = int(threadIdx.x) - Traits::kThreadsPerWarpGroup;
    if constexpr (kDynamicTiles) {
      // The tiles come from the producer's queue. Tile w + 1 is read as tile w starts: the producer published
      // it before loading tile w, so the read does not wait (read inside the mainloop, where the Q rows are
      // issued, it moved the loops' descriptors to vector registers: 748 instructions a step, not 716).
      int index = TileQueue::pop(smem.tile_queue, 0);
      bool q_issued = false;
      for (int w = 0; index < num_tiles; ++w) {
        const int next = TileQueue::pop(smem.tile_queue, w + 1);
        // Decoded from broadcasts, not from the loop-carried index: see uniform_tile.
        const Geometry tile = tile_at(__shfl_sync(0xffffffffu, index, 0));
        const bool has_next = next < num_tiles;
        ConsumerMainloop<Traits>::template run<kOverlap>(params, tile, smem, consumer_thread, state, q_issued,
                                                         has_next, tile_at(has_next ? next : 0));
        q_issued = has_next;
        index = next;
      }
    } else if constexpr (kPersistent) {
      // Each call is told the next valid tile, so that it issues that tile's Q rows under its last PV product.
      Geometry next;
      bool q_issued = false;
      for (int k = next_valid(0, next); k >= 0;) {
        const Geometry tile = uniform_tile(k);
        const int k_next = next_valid(k + 1, next);
        const bool has_next = k_next >= 0;
        ConsumerMainloop<Traits>::template run<kOverlap>(params, tile, smem, consumer_thread, state, q_issued,
                                                         has_next, next);
        q_issued = has_next;
        k = k_next;
      }
    } else {
      ConsumerMainloop<Traits>::template run<kOverlap, kPooledE4M3, kSecondOrder>(params, cta_tile(), smem,
                                                                                 consumer_thread, state);
    }
  }
}

}  // namespace fpv2::hopper
