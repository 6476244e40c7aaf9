// Launches of the index stage's scoring kernel: one instantiation per (element type, head dim).
#include "index/launch_score.hpp"

#include <algorithm>

#include <cutlass/numeric_types.h>

#include "abi/device_guard.hpp"
#include "abi/errors.hpp"
#include "hopper/tensor_map_driver.hpp"
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
  p.key_rows = int32_t(a.keys.shape[0]);
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

// Prepares `kernel` for a launch with `smem` bytes of dynamic shared memory on `device` and returns how many of
// its CTAs an SM holds then (the persistent grid's width). The shared-memory attribute is set to the most any call
// can ask for (`max_smem`, the same value from every thread: no call lowers it under another), once per device
// and thread with the occupancy query; both are remembered for the last (kernel, smem, device).
template <class Kernel>
int32_t prepare_launch(Kernel kernel, int threads, size_t smem, size_t max_smem, int device, int* ctas) {
  struct Entry {
    const void* kernel;
    size_t smem;
    int device;
    int ctas;
  };
  static thread_local Entry last{nullptr, 0, -1, 0};
  const void* key = reinterpret_cast<const void*>(kernel);
  if (last.kernel == key && last.smem == smem && last.device == device) {
    *ctas = last.ctas;
    return FPV2_OK;
  }
  cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(max_smem));
  if (e != cudaSuccess) return cuda_failure(e, "cudaFuncSetAttribute");
  int blocks = 0;
  e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, threads, smem);
  if (e != cudaSuccess) return cuda_failure(e, "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
  *ctas = blocks > 0 ? blocks : 1;
  last = Entry{key, smem, device, *ctas};
  return FPV2_OK;
}

template <class Element, int kHeadDim>
int32_t launch_for(const fpv2_score_args_t& args, cudaStream_t stream, int device, int sm_count) {
  using Traits = ScoreTraits<Element, kHeadDim>;
  const ScoreParams<Element> p = make_params<Element>(args);
  if (p.num_segments > 0) {
    // The storage, the tile's energies (one float per key block of the longest request) and the alignment slack.
    auto smem_for = [](size_t blocks) { return sizeof(ScoreSharedStorage<Traits>) + blocks * sizeof(float) + 1024; };
    const size_t smem = smem_for(size_t(args.max_blocks > 0 ? args.max_blocks : 1));
    int ctas_per_sm = 0;
    FPV2_RETURN_IF_ERROR(prepare_launch(score_select_kernel<Traits>, Traits::kThreads, smem,
                                        smem_for(Traits::kMaxBlocks), device, &ctas_per_sm));
    const int64_t ctas = std::min<int64_t>(p.num_segments, int64_t(ctas_per_sm) * sm_count);
    FPV2_RETURN_IF_ERROR(hopper::check_tensor_map_entry_point("fpv2_score_blocks", "the TMA loads of the keys"));
    using namespace cute;
    Tensor key_matrix = make_tensor(make_gmem_ptr(p.keys), make_shape(p.key_rows, int32_t(p.key_block_stride)),
                                    make_stride(p.key_block_stride, _1{}));
    const typename Traits::TmaKeys tma_keys = make_tma_copy(
        SM90_TMA_LOAD{}, key_matrix, typename Traits::SmemLayoutKeysStage{}, typename Traits::TileKeys{}, _1{});
    score_select_kernel<Traits><<<dim3(unsigned(ctas)), dim3(Traits::kThreads), smem, stream>>>(p, tma_keys);
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
  const int device = guard.device();
  FPV2_RETURN_IF_ERROR(detail::check_hopper_device(device, "fpv2_score_blocks"));
  int sm_count = 0;
  const cudaError_t e = cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, device);
  if (e != cudaSuccess) return cuda_failure(e, "cudaDeviceGetAttribute(multiprocessors)");
  const bool bf16 = args.q.dtype == FPV2_DTYPE_BF16;
  const int64_t d = args.q.shape[2];
  if (bf16) {
    return d == 64 ? launch_for<cutlass::bfloat16_t, 64>(args, stream, device, sm_count)
                   : launch_for<cutlass::bfloat16_t, 128>(args, stream, device, sm_count);
  }
  return d == 64 ? launch_for<cutlass::half_t, 64>(args, stream, device, sm_count)
                 : launch_for<cutlass::half_t, 128>(args, stream, device, sm_count);
}

}  // namespace fpv2::index
