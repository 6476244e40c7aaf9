// The E4M3 copies of a SparseCase's bf16 pooled statistics (fpv2.h, ABI 1.2), built on the device the way
// the Python quantizer builds them: per (request, KV head) scales max|x| / 448, request b's blocks at rows /
// columns e4m3_offsets[b] (multiples of 16) + J, the V^T columns in FPV2_E4M3_SLOT order, zeros elsewhere.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "device_fill.cuh"

namespace fpv2::native_test {

// One block of 256 threads per (request, KV head): the two maxima, then the scaled copies.
__global__ void quantize_pooled_e4m3(const __nv_bfloat16* pooled_k, const __nv_bfloat16* pooled_v,
                                     const int32_t* block_offsets, const int32_t* e4m3_offsets, int num_kv_heads,
                                     int head_dim, int64_t rows, __nv_fp8_e4m3* k8, __nv_fp8_e4m3* vt8,
                                     float* scales) {
  const int b = blockIdx.x / num_kv_heads, h = blockIdx.x % num_kv_heads;
  const int first = block_offsets[b], blocks = block_offsets[b + 1] - first, base = e4m3_offsets[b];
  const int64_t row_elems = int64_t(num_kv_heads) * head_dim;
  __shared__ float amax[2][256];
  float mk = 0.0f, mv = 0.0f;
  for (int e = threadIdx.x; e < blocks * head_dim; e += blockDim.x) {
    const int64_t at = (first + e / head_dim) * row_elems + int64_t(h) * head_dim + e % head_dim;
    mk = fmaxf(mk, fabsf(__bfloat162float(pooled_k[at])));
    mv = fmaxf(mv, fabsf(__bfloat162float(pooled_v[at])));
  }
  amax[0][threadIdx.x] = mk;
  amax[1][threadIdx.x] = mv;
  __syncthreads();
  for (int s = blockDim.x / 2; s > 0; s /= 2) {
    if (threadIdx.x < s) {
      amax[0][threadIdx.x] = fmaxf(amax[0][threadIdx.x], amax[0][threadIdx.x + s]);
      amax[1][threadIdx.x] = fmaxf(amax[1][threadIdx.x], amax[1][threadIdx.x + s]);
    }
    __syncthreads();
  }
  const float k_scale = amax[0][0] > 0.0f ? amax[0][0] / 448.0f : 1.0f;
  const float v_scale = amax[1][0] > 0.0f ? amax[1][0] / 448.0f : 1.0f;
  if (threadIdx.x == 0) {
    scales[(int64_t(b) * num_kv_heads + h) * 2] = k_scale;
    scales[(int64_t(b) * num_kv_heads + h) * 2 + 1] = v_scale;
  }
  for (int e = threadIdx.x; e < blocks * head_dim; e += blockDim.x) {
    const int J = e / head_dim, c = e % head_dim;
    const int64_t at = (first + J) * row_elems + int64_t(h) * head_dim + c;
    k8[(base + J) * row_elems + int64_t(h) * head_dim + c] =
        __nv_fp8_e4m3(fminf(fmaxf(__bfloat162float(pooled_k[at]) / k_scale, -448.0f), 448.0f));
    vt8[(int64_t(h) * head_dim + c) * rows + base + FPV2_E4M3_SLOT(J)] =
        __nv_fp8_e4m3(fminf(fmaxf(__bfloat162float(pooled_v[at]) / v_scale, -448.0f), 448.0f));
  }
}

class PooledE4M3Case {
 public:
  PooledE4M3Case() = default;

  // Builds the copies of the requests' pooled rows (block_offsets on the host and the device; pooled_rows:
  // the rows of the bf16 tensors, which the copies must cover).
  void build(const __nv_bfloat16* pooled_k, const __nv_bfloat16* pooled_v, const std::vector<int32_t>& block_offsets,
             const int32_t* block_offsets_dev, int64_t pooled_rows, int num_kv_heads, int head_dim) {
    const int B = int(block_offsets.size()) - 1;
    offsets_.assign(1, 0);
    for (int b = 0; b < B; ++b) {
      const int blocks = block_offsets[b + 1] - block_offsets[b];
      offsets_.push_back(offsets_.back() + (blocks + 15) / 16 * 16);
    }
    rows_ = std::max<int64_t>(offsets_.back(), (pooled_rows + 15) / 16 * 16);
    const int64_t elems = rows_ * num_kv_heads * head_dim;
    k8_ = DeviceBuffer<__nv_fp8_e4m3>(elems);
    vt8_ = DeviceBuffer<__nv_fp8_e4m3>(elems);
    offsets_dev_ = DeviceBuffer<int32_t>(B + 1);
    scales_ = DeviceBuffer<float>(int64_t(B) * num_kv_heads * 2);
    offsets_dev_.upload(offsets_);
    FPV2_TEST_CUDA(cudaMemset(k8_.get(), 0, elems));
    FPV2_TEST_CUDA(cudaMemset(vt8_.get(), 0, elems));
    quantize_pooled_e4m3<<<B * num_kv_heads, 256>>>(pooled_k, pooled_v, block_offsets_dev, offsets_dev_.get(),
                                                     num_kv_heads, head_dim, rows_, k8_.get(), vt8_.get(),
                                                     scales_.get());
    FPV2_TEST_CUDA(cudaGetLastError());
    FPV2_TEST_CUDA(cudaDeviceSynchronize());
    const int64_t hkv = num_kv_heads, d = head_dim;
    k_desc_ = make_tensor_desc(k8_.get(), FPV2_DTYPE_E4M3, {rows_, hkv, d}, {hkv * d, d, 1});
    vt_desc_ = make_tensor_desc(vt8_.get(), FPV2_DTYPE_E4M3, {hkv, d, rows_}, {d * rows_, rows_, 1});
    offsets_desc_ = make_tensor_desc(offsets_dev_.get(), FPV2_DTYPE_I32, {B + 1}, {1});
    scales_desc_ = make_tensor_desc(scales_.get(), FPV2_DTYPE_F32, {B, hkv, 2}, {hkv * 2, 2, 1});
  }

  // Adds the copies to a plan.
  void attach(fpv2_correction_plan_t& plan) const {
    plan.pooled_k_e4m3 = k_desc_;
    plan.pooled_vt_e4m3 = vt_desc_;
    plan.e4m3_offsets = offsets_desc_;
    plan.e4m3_scales = scales_desc_;
  }

 private:
  int64_t rows_ = 0;
  std::vector<int32_t> offsets_;
  DeviceBuffer<__nv_fp8_e4m3> k8_, vt8_;
  DeviceBuffer<int32_t> offsets_dev_;
  DeviceBuffer<float> scales_;
  fpv2_tensor_t k_desc_{}, vt_desc_{}, offsets_desc_{}, scales_desc_{};
};

}  // namespace fpv2::native_test
