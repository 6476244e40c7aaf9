// Launches of the index stage's scoring kernel: one instantiation per (element type, head dim).
#include "index/launch_score.hpp"

#include <atomic>

#include <cutlass/numeric_types.h>

#include "abi/device_guard.hpp"
#include "abi/errors.hpp"
#include "index/score_offsets_kernel.hpp"
#include "index/score_select_kernel.hpp"

namespace fpv2::index {
namespace {

template <class Element>
ScoreParams<Element> make_params(const fpv2_score_args_t& a) {
  ScoreParams<Element> p{};
  p.q = static_cast<Element const*>(a.q.data);
  p.q_token_stride = a.q.strides[0];
  p.q_head_stride = a.q.strides[1];
  p.keys = static_cast<Element const*>(a.keys.data);
  p.key_block_stride = a.keys.shape[1] * a.keys.shape[2];
  p.cu_seqlens_q = static_cast<int32_t const*>(a.cu_seqlens_q.data);
  p.seqlens_k = static_cast<int32_t const*>(a.seqlens_k.data);
  p.block_offsets = static_cast<int32_t const*>(a.block_offsets.data);
  p.tile_offsets = static_cast<int32_t*>(const_cast<void*>(a.tile_offsets.data));
  p.offsets = static_cast<int32_t*>(const_cast<void*>(a.offsets.data));
  p.counts = static_cast<int32_t*>(const_cast<void*>(a.counts.data));
  p.keep_bits = static_cast<uint32_t*>(const_cast<void*>(a.keep_bits.data));
  p.bits_stride = a.keep_bits.strides[0];
  p.num_requests = a.num_requests;
  p.num_kv_heads = int32_t(a.keys.shape[1]);
  p.group = a.group;
  p.block_size = a.block_size;
  p.num_tiles = a.num_tiles;
  p.num_segments = a.num_tiles * a.keys.shape[1];
  p.alpha = a.alpha;
  p.sink_blocks = a.sink_blocks;
  p.window_tokens = a.window_tokens;
  p.dense_tail_tiles = a.dense_tail_tiles;
  p.min_sparse_kv_len = a.min_sparse_kv_len;
  return p;
}

int32_t cuda_failure(cudaError_t error, const char* what) {
  return detail::fail(FPV2_ERROR_CUDA, detail::format("fpv2_score_blocks: %s failed: %s (%s)", what,
                                                      cudaGetErrorName(error), cudaGetErrorString(error)));
}

template <class Element, int kHeadDim>
int32_t launch_for(const fpv2_score_args_t& args, cudaStream_t stream) {
  using Traits = ScoreTraits<Element, kHeadDim>;
  const ScoreParams<Element> p = make_params<Element>(args);
  if (p.num_segments > 0) {
    const size_t energies = size_t(args.max_blocks > 0 ? args.max_blocks : 1) * sizeof(float);
    const size_t smem = sizeof(ScoreSharedStorage<Traits>) + energies + 1024;
    // The attribute is per function and process-wide: raise it only when a call needs more than before.
    static std::atomic<size_t> granted{0};
    if (smem > granted.load(std::memory_order_relaxed)) {
      cudaError_t e = cudaFuncSetAttribute(score_select_kernel<Traits>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           int(smem));
      if (e != cudaSuccess) return cuda_failure(e, "cudaFuncSetAttribute");
      granted.store(smem, std::memory_order_relaxed);
    }
    const int64_t ctas = p.num_segments;
    score_select_kernel<Traits><<<dim3(unsigned(ctas)), dim3(Traits::kThreads), smem, stream>>>(p);
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return cuda_failure(e, "the scoring kernel's launch");
  }
  score_offsets_kernel<Element><<<1, kScanThreads, 0, stream>>>(p, Traits::kTileRows);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return cuda_failure(e, "the prefix-sum kernel's launch");
  return FPV2_OK;
}

}  // namespace

int32_t launch_score(const fpv2_score_args_t& args, cudaStream_t stream) {
  detail::DeviceGuard guard;
  FPV2_RETURN_IF_ERROR(guard.select(args.device, "fpv2_score_blocks"));
  FPV2_RETURN_IF_ERROR(detail::check_hopper_device(guard.device(), "fpv2_score_blocks"));
  const bool bf16 = args.q.dtype == FPV2_DTYPE_BF16;
  const int64_t d = args.q.shape[2];
  if (bf16) {
    return d == 64 ? launch_for<cutlass::bfloat16_t, 64>(args, stream)
                   : launch_for<cutlass::bfloat16_t, 128>(args, stream);
  }
  return d == 64 ? launch_for<cutlass::half_t, 64>(args, stream)
                 : launch_for<cutlass::half_t, 128>(args, stream);
}

}  // namespace fpv2::index
