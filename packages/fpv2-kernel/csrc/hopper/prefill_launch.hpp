// Host side of one instantiation of the prefill kernel: TMA descriptors over the paged cache,
// kernel parameters, grid, shared-memory opt-in and the launch. Included by the instantiation files only
// (it pulls in CuTe and the kernel).
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>

#include <cuda_runtime_api.h>

#include <cute/tensor.hpp>

#include "abi/errors.hpp"
#include "hopper/prefill_instances.hpp"
#include "hopper/prefill_kernel.hpp"
#include "hopper/prefill_params.hpp"
#include "hopper/prefill_plan.hpp"
#include "hopper/prefill_traits.hpp"
#include "hopper/shared_storage.hpp"
#include "hopper/split_combine.hpp"
#include "hopper/split_kv.hpp"
#include "hopper/tensor_map_driver.hpp"
#include "hopper/work_order.hpp"

namespace fpv2::hopper {

// The opt-in limit of dynamic shared memory per block on sm_90 (cudaDevAttrMaxSharedMemoryPerBlockOptin).
inline constexpr std::size_t kMaxDynamicSharedMemory = 227 * 1024;

// The kept-block work order of `params`' tiles (work_order.hpp) into `workspace` (work_order_workspace_bytes,
// checked by the launcher); on success params.tile_order points at it.
template <class Traits, class Params>
int32_t launch_work_order(Params& params, int num_tiles, void* workspace, cudaStream_t stream) {
  using Geometry = TileGeometry<Traits::kBlockM, Traits::kBlockN, Traits::kBlockSize>;
  char* base = static_cast<char*>(workspace);
  int32_t* counts = reinterpret_cast<int32_t*>(base);
  uint8_t* keys = reinterpret_cast<uint8_t*>(base + work_order_keys_offset());
  int32_t* permutation = reinterpret_cast<int32_t*>(base + work_order_permutation_offset(num_tiles));
  cudaError_t err = cudaMemsetAsync(counts, 0, 2 * kWorkBuckets * sizeof(int32_t), stream);
  const unsigned blocks = static_cast<unsigned>((num_tiles + kWorkOrderThreads - 1) / kWorkOrderThreads);
  params.tile_order = nullptr;  // the keys are computed in the decoded order
  if (err == cudaSuccess) {
    work_keys_kernel<Traits, Geometry, BlockScheduleFor<Traits>><<<blocks, kWorkOrderThreads, 0, stream>>>(
        params, num_tiles, keys, counts);
    err = cudaGetLastError();
  }
  if (err == cudaSuccess) {
    work_scatter_kernel<kWorkOrderThreads><<<blocks, kWorkOrderThreads, 0, stream>>>(
        num_tiles, keys, counts, counts + kWorkBuckets, permutation);
    err = cudaGetLastError();
  }
  if (err != cudaSuccess) {
    return fpv2::detail::fail(FPV2_ERROR_CUDA,
                              fpv2::detail::format("fpv2 Hopper prefill: the work order of %d tiles failed to launch: %s",
                                                   num_tiles, cudaGetErrorString(err)));
  }
  params.tile_order = permutation;
  return FPV2_OK;
}

// The launch of one instantiation's traits: PrefillTraitsFor<d>, or SplitKvTraitsFor<d> for calls that
// split (run_prefill below).
template <class Traits>
int32_t launch_with(const PrefillPlan& plan, cudaStream_t stream) {
  using namespace cute;
  constexpr int kHeadDim = Traits::kHeadDim;
  using Params = PrefillParams<Traits>;
  using Element = typename Traits::Element;
  static_assert(prefill_smem_bytes<Traits>() <= kMaxDynamicSharedMemory,
                "the K/V stages of prefill_stages() exceed the 227 KB of shared memory of one CTA");

  if (plan.head_dim != kHeadDim) {
    return fpv2::detail::fail(FPV2_ERROR_INTERNAL,
                              fpv2::detail::format("fpv2 Hopper prefill: plan for d=%d sent to the d=%d "
                                                   "instantiation",
                                                   plan.head_dim, kHeadDim));
  }
  const int64_t packed_rows = int64_t(plan.max_seqlen_q) * plan.group;
  const int64_t num_m_blocks = (packed_rows + Traits::kBlockM - 1) / Traits::kBlockM;
  if (num_m_blocks == 0) {
    return FPV2_OK;  // no query in the batch: nothing to compute
  }
  FPV2_RETURN_IF_ERROR(check_tensor_map_entry_point("fpv2 Hopper prefill", "the TMA loads of the KV cache"));

  Tensor k_rows = make_tensor(make_gmem_ptr(static_cast<Element const*>(plan.k_cache)),
                              make_shape(plan.cache_rows, plan.cache_cols), make_stride(plan.k_token_stride, _1{}));
  Tensor v_cols = make_tensor(make_gmem_ptr(static_cast<Element const*>(plan.v_cache)),
                              make_shape(plan.cache_cols, plan.cache_rows), make_stride(_1{}, plan.v_token_stride));
  // The pooled statistics are read like the cache: (total_blocks, Hkv * d) rows, contiguous. Without the
  // correction the descriptors are built over the cache and never used.
  const bool has_correction = plan.pooled_k != nullptr;
  const bool pooled_e4m3 = has_correction && plan.pooled_k_e4m3 != nullptr;
  // Persistent CTAs (opt-in) serve the TMA path; pages that need the cp.async gather run one CTA per tile.
  const bool persistent = plan.persistent != 0 && plan.page_size % Traits::kBlockN == 0;
  // The dynamic tile queue (tile_queue.hpp) is built for the overlapped consumers (the launcher checks).
  const bool dynamic_tiles = persistent && plan.persistent == 2;
  // With the E4M3 copies the bf16 descriptors are not used either (pooled_k may then be float32).
  const bool pooled_bf16 = has_correction && !pooled_e4m3;
  const int32_t pooled_rows = pooled_bf16 ? plan.pooled_rows : plan.cache_rows;
  const int64_t pooled_stride = pooled_bf16 ? int64_t(plan.cache_cols) : plan.k_token_stride;
  Tensor pooled_k_rows = make_tensor(
      make_gmem_ptr(static_cast<Element const*>(pooled_bf16 ? plan.pooled_k : plan.k_cache)),
      make_shape(pooled_rows, plan.cache_cols), make_stride(pooled_stride, _1{}));
  Tensor pooled_v_cols = make_tensor(
      make_gmem_ptr(static_cast<Element const*>(pooled_bf16 ? plan.pooled_v : plan.v_cache)),
      make_shape(plan.cache_cols, pooled_rows),
      make_stride(_1{}, pooled_bf16 ? int64_t(plan.cache_cols) : plan.v_token_stride));
  // The E4M3 copies, (rows, Hkv * d) and (Hkv * d, rows) row-major; without them, descriptors over the K
  // cache's bytes that are never used.
  using ElementE4M3 = typename Traits::ElementE4M3;
  const int32_t e4m3_rows = pooled_e4m3 ? plan.pooled_e4m3_rows : 128;
  const void* e4m3_k = pooled_e4m3 ? plan.pooled_k_e4m3 : plan.k_cache;
  const void* e4m3_vt = pooled_e4m3 ? plan.pooled_vt_e4m3 : plan.k_cache;
  Tensor e4m3_k_rows = make_tensor(make_gmem_ptr(static_cast<ElementE4M3 const*>(e4m3_k)),
                                   make_shape(e4m3_rows, plan.cache_cols),
                                   make_stride(int64_t(plan.cache_cols), _1{}));
  Tensor e4m3_vt_rows = make_tensor(make_gmem_ptr(static_cast<ElementE4M3 const*>(e4m3_vt)),
                                    make_shape(plan.cache_cols, e4m3_rows),
                                    make_stride(int64_t(e4m3_rows), _1{}));
  constexpr float kLog2e = 1.4426950408889634f;
  Params params{
      make_tma_copy(SM90_TMA_LOAD{}, k_rows, typename Traits::SmemLayoutKStage{}, typename Params::TileK{}, _1{}),
      make_tma_copy(SM90_TMA_LOAD{}, v_cols, typename Traits::SmemLayoutVtStage{}, typename Params::TileVt{}, _1{}),
      plan.cache_rows,
      plan.cache_cols,
      static_cast<Element const*>(plan.q),
      plan.q_token_stride,
      plan.q_head_stride,
      static_cast<Element*>(plan.out),
      plan.out_token_stride,
      plan.out_head_stride,
      plan.lse,
      plan.lse_token_stride,
      plan.lse_head_stride,
      plan.cu_seqlens_q,
      plan.seqlens_k,
      plan.page_table,
      plan.page_table_stride,
      plan.page_size / Traits::kBlockN,  // 0 in gather mode (unused there)
      plan.group,
      plan.num_kv_heads,
      plan.num_requests,
      static_cast<int32_t>(num_m_blocks),
      plan.softmax_scale * kLog2e,
      plan.index_offsets,
      plan.index_blocks,
      plan.index_tile_offsets,
      make_tma_copy(SM90_TMA_LOAD{}, pooled_k_rows, typename Traits::SmemLayoutKStage{}, typename Params::TileK{},
                    _1{}),
      make_tma_copy(SM90_TMA_LOAD{}, pooled_v_cols, typename Traits::SmemLayoutVtStage{}, typename Params::TileVt{},
                    _1{}),
      pooled_rows,
      plan.pooled_block_offsets,
      plan.block_lengths,
      1.0f / plan.softmax_scale,
      has_correction ? 1 : 0,
      plan.page_size % Traits::kBlockN != 0 ? 1 : 0,
      plan.page_size,
      static_cast<Element const*>(plan.k_cache),
      static_cast<Element const*>(plan.v_cache),
      plan.k_token_stride,
      plan.v_token_stride,
      static_cast<Element const*>(plan.pooled_k),
      static_cast<Element const*>(plan.pooled_v),
      plan.pingpong,
      persistent ? 1 : 0,
      plan.request_major,
      make_tma_copy(SM90_TMA_LOAD{}, e4m3_k_rows, typename Traits::SmemLayoutKE4M3Stage{}, typename Params::TileK{},
                    _1{}),
      make_tma_copy(SM90_TMA_LOAD{}, e4m3_vt_rows, typename Traits::SmemLayoutVtE4M3Stage{},
                    typename Params::TileVt{}, _1{}),
      pooled_e4m3 ? 1 : 0,
      e4m3_rows,
      plan.e4m3_offsets,
      plan.e4m3_scales,
      plan.pooled_half_exp,
      plan.head_major,
      cutlass::FastDivmod(plan.group),
      cutlass::FastDivmod(static_cast<int>(num_m_blocks)),
      cutlass::FastDivmod(plan.num_kv_heads),
      plan.num_splits,
      plan.num_kv_heads * plan.group,
      plan.total_q,
      static_cast<float*>(plan.num_splits > 1 ? plan.workspace : nullptr),
      plan.num_splits > 1
          ? reinterpret_cast<float*>(static_cast<char*>(plan.workspace) +
                                     split_out_bytes(plan.total_q, int64_t(plan.num_kv_heads) * plan.group, kHeadDim,
                                                     plan.num_splits))
          : nullptr,
      nullptr,  // tile_order: set below when the launcher chose the work order
      nullptr,  // tile_counter: set below for the dynamic tile queue
      plan.key_variance,
      plan.key_radius,
  };

  // The launcher sends the E4M3 copies only with the overlapped consumers, and only to the instantiations
  // of 128-token tiles (launch_prefill.cu); the others do not build that variant.
  // The split-KV traits build one kernel: the overlapped consumers, one CTA per tile (choose_kv_splits
  // sends nothing else there).
  auto kernel = prefill_kernel<Traits, false, true>;
  if constexpr (!Traits::kSplitKv) {
    kernel = persistent     ? (plan.overlap ? prefill_kernel<Traits, true, true> : prefill_kernel<Traits, true, false>)
             : plan.overlap ? prefill_kernel<Traits, false, true>
                            : prefill_kernel<Traits, false, false>;
    if (dynamic_tiles) kernel = prefill_kernel<Traits, true, true, false, true>;
  } else if (persistent || !plan.overlap || pooled_e4m3 || plan.num_splits <= 1) {
    return fpv2::detail::fail(FPV2_ERROR_INTERNAL,
                              "fpv2 Hopper prefill: a call the split-KV instantiation does not build was sent to it");
  }
  const bool second_order = plan.key_variance != nullptr;
  if (second_order) {
    if (persistent || !plan.overlap) {
      return fpv2::detail::fail(FPV2_ERROR_INTERNAL,
                                "fpv2 Hopper prefill: a key spread was sent to a kernel variant that does not build "
                                "the second-order shift");
    }
    kernel = prefill_kernel<Traits, false, true, false, false, true>;
  }
  if constexpr (Traits::kPooledE4M3Built && !Traits::kSplitKv) {
    if (pooled_e4m3) {
      kernel = second_order ? prefill_kernel<Traits, false, true, true, false, true>
                            : prefill_kernel<Traits, false, true, true>;
    }
  } else if (pooled_e4m3) {
    return fpv2::detail::fail(FPV2_ERROR_INTERNAL,
                              fpv2::detail::format("fpv2 Hopper prefill: E4M3 pooled copies sent to the d=%d "
                                                   "instantiation, which does not build the FP8 correction",
                                                   kHeadDim));
  }
  const int smem_bytes = static_cast<int>(prefill_smem_bytes<Traits>());
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
  if (err != cudaSuccess) {
    return fpv2::detail::fail(FPV2_ERROR_CUDA,
                              fpv2::detail::format("fpv2 Hopper prefill: cudaFuncSetAttribute(max dynamic "
                                                   "shared memory = %d bytes) failed: %s",
                                                   smem_bytes, cudaGetErrorString(err)));
  }
  const int64_t num_ctas = num_m_blocks * plan.num_kv_heads * plan.num_requests;
  if (num_ctas > std::numeric_limits<int32_t>::max()) {
    return fpv2::detail::fail(FPV2_ERROR_UNSUPPORTED,
                              fpv2::detail::format("fpv2 Hopper prefill: %lld query tiles x %d KV heads x %d "
                                                   "requests exceed the 1-D grid (2^31 - 1 CTAs)",
                                                   static_cast<long long>(num_m_blocks), plan.num_kv_heads,
                                                   plan.num_requests));
  }
  int64_t grid_ctas = num_ctas * plan.num_splits;  // the launcher chose the splits (split_kv.hpp)
  if (grid_ctas > std::numeric_limits<int32_t>::max()) {
    return fpv2::detail::fail(FPV2_ERROR_UNSUPPORTED,
                              fpv2::detail::format("fpv2 Hopper prefill: %lld CTAs x %d KV splits exceed the 1-D grid",
                                                   static_cast<long long>(num_ctas), plan.num_splits));
  }
  // Workspace: the tile queue's counter first (when used), then the work order's permutation.
  char* order_workspace = static_cast<char*>(plan.workspace);
  if (dynamic_tiles) {
    params.tile_counter = reinterpret_cast<int32_t*>(plan.workspace);
    order_workspace += tile_queue_workspace_bytes();
    err = cudaMemsetAsync(params.tile_counter, 0, sizeof(int32_t), stream);
    if (err != cudaSuccess) {
      return fpv2::detail::fail(FPV2_ERROR_CUDA,
                                fpv2::detail::format("fpv2 Hopper prefill: clearing the tile queue's counter "
                                                     "failed: %s",
                                                     cudaGetErrorString(err)));
    }
  }
  if constexpr (!Traits::kSplitKv) {  // a call that splits runs in one wave: nothing to order
    if (plan.work_order) {
      FPV2_RETURN_IF_ERROR(launch_work_order<Traits>(params, static_cast<int>(num_ctas), order_workspace, stream));
    }
  }
  if (persistent) {
    const int64_t sms = plan.sm_count;
    grid_ctas = num_ctas < sms ? num_ctas : sms;  // one CTA per SM (the kernel's shared memory allows one)
  }
  const dim3 grid(static_cast<unsigned>(grid_ctas));
  kernel<<<grid, Traits::kNumThreads, smem_bytes, stream>>>(params);
  err = cudaGetLastError();
  if (err != cudaSuccess) {
    return fpv2::detail::fail(FPV2_ERROR_CUDA,
                              fpv2::detail::format("fpv2 Hopper prefill: launch of %u CTAs x %d threads with "
                                                   "%d bytes of shared memory failed: %s",
                                                   grid.x, Traits::kNumThreads, smem_bytes, cudaGetErrorString(err)));
  }
  if constexpr (Traits::kSplitKv) {
    SplitCombineArgs combine{params.split_out,
                             params.split_lse,
                             plan.num_splits,
                             plan.total_q * params.num_q_heads,
                             params.num_q_heads,
                             reinterpret_cast<__nv_bfloat16*>(plan.out),
                             plan.out_token_stride,
                             plan.out_head_stride,
                             plan.lse,
                             plan.lse_token_stride,
                             plan.lse_head_stride};
    err = launch_split_combine<kHeadDim>(combine, stream);
    if (err != cudaSuccess) {
      return fpv2::detail::fail(FPV2_ERROR_CUDA,
                                fpv2::detail::format("fpv2 Hopper prefill: launch of the split-KV combine "
                                                     "(%d splits) failed: %s",
                                                     plan.num_splits, cudaGetErrorString(err)));
    }
  }
  return FPV2_OK;
}

template <int kHeadDim>
int32_t run_prefill(const PrefillPlan& plan, cudaStream_t stream) {
  if (plan.num_splits > 1) return launch_with<SplitKvTraitsFor<kHeadDim>>(plan, stream);
  return launch_with<PrefillTraitsFor<kHeadDim>>(plan, stream);
}

}  // namespace fpv2::hopper
