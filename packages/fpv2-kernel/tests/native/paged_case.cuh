// One test problem for the native Hopper tests: a varlen batch over a paged bf16 KV cache with a shuffled
// page table, its device buffers (filled on the device) and the fpv2_prefill_args_t that describes it.
//
// Unused cache slots (past each request's length in its last page, and the spare pages nobody owns) hold
// NaN, and so do the outputs before the run (with guard rows after them), so a read of a stale slot or a
// missing or stray write shows up.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include "device_fill.cuh"
#include "fpv2/fpv2.h"

#define FPV2_TEST_CUDA(expr)                                                                             \
  do {                                                                                                   \
    const cudaError_t fpv2_err_ = (expr);                                                                \
    if (fpv2_err_ != cudaSuccess) {                                                                      \
      std::fprintf(stderr, "CUDA error %s at %s:%d: %s\n", cudaGetErrorName(fpv2_err_), __FILE__, __LINE__, \
                   cudaGetErrorString(fpv2_err_));                                                       \
      std::exit(2);                                                                                      \
    }                                                                                                    \
  } while (0)

namespace fpv2::native_test {

template <class T>
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(int64_t count) : count_(count) {
    FPV2_TEST_CUDA(cudaMalloc(&ptr_, sizeof(T) * static_cast<size_t>(std::max<int64_t>(count, 1))));
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& o) noexcept : ptr_(o.ptr_), count_(o.count_) { o.ptr_ = nullptr; }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    std::swap(ptr_, o.ptr_);
    std::swap(count_, o.count_);
    return *this;
  }
  ~DeviceBuffer() {
    if (ptr_ != nullptr) cudaFree(ptr_);
  }
  T* get() const { return ptr_; }
  int64_t count() const { return count_; }
  void upload(const std::vector<T>& host) {
    FPV2_TEST_CUDA(cudaMemcpy(ptr_, host.data(), sizeof(T) * host.size(), cudaMemcpyHostToDevice));
  }

 private:
  T* ptr_ = nullptr;
  int64_t count_ = 0;
};

struct CaseSpec {
  std::string name;
  int num_kv_heads = 2;
  int group = 1;
  int page_size = 128;
  int head_dim = 128;
  std::vector<int> q_lens;
  std::vector<int> prefixes;
  float softmax_scale = 0.0f;  // 0: 1/sqrt(d)
  int token_pad = 0;           // extra elements in the token stride of q and out (multiple of 8)
  int spare_pages = 3;         // pages owned by nobody (NaN)
  float q_range = 3.0f;        // q uniform in [-q_range, q_range): peaky enough that masking errors show
  uint64_t seed = 1;
};

inline fpv2_tensor_t make_tensor_desc(const void* data, int32_t dtype, std::vector<int64_t> shape,
                                      std::vector<int64_t> strides) {
  fpv2_tensor_t t{};
  t.data = data;
  t.dtype = dtype;
  t.ndim = static_cast<int32_t>(shape.size());
  for (size_t i = 0; i < shape.size(); ++i) {
    t.shape[i] = shape[i];
    t.strides[i] = strides[i];
  }
  return t;
}

class PagedCase {
 public:
  static constexpr int64_t kGuardTokens = 3;

  explicit PagedCase(CaseSpec spec) : spec_(std::move(spec)) {
    const int B = static_cast<int>(spec_.q_lens.size());
    num_q_heads_ = spec_.num_kv_heads * spec_.group;
    const int64_t d = spec_.head_dim;
    cu_seqlens_.assign(1, 0);
    for (int b = 0; b < B; ++b) {
      cu_seqlens_.push_back(cu_seqlens_.back() + spec_.q_lens[b]);
      seqlens_k_.push_back(spec_.q_lens[b] + spec_.prefixes[b]);
      max_q_ = std::max(max_q_, spec_.q_lens[b]);
      max_k_ = std::max(max_k_, seqlens_k_.back());
    }
    total_q_ = cu_seqlens_.back();

    // Pages: each request owns ceil(seqlen_k / page_size) of a shuffled pool that also has spare pages.
    std::vector<int> pages_needed(B);
    int total_pages = 0;
    for (int b = 0; b < B; ++b) {
      pages_needed[b] = (seqlens_k_[b] + spec_.page_size - 1) / spec_.page_size;
      total_pages += pages_needed[b];
      max_pages_ = std::max(max_pages_, pages_needed[b]);
    }
    max_pages_ += 1;  // one unused column (-1), so the row stride differs from any request's page count
    num_pages_ = total_pages + spec_.spare_pages;
    std::vector<int> pool(num_pages_);
    std::iota(pool.begin(), pool.end(), 0);
    std::mt19937 rng(static_cast<uint32_t>(spec_.seed * 7919u + 17u));
    std::shuffle(pool.begin(), pool.end(), rng);
    page_table_.assign(static_cast<size_t>(B) * max_pages_, -1);
    std::vector<uint8_t> slot_valid(static_cast<size_t>(num_pages_) * spec_.page_size, 0);
    int next = 0;
    for (int b = 0; b < B; ++b) {
      for (int p = 0; p < pages_needed[b]; ++p) {
        const int page = pool[next++];
        page_table_[static_cast<size_t>(b) * max_pages_ + p] = page;
        for (int s = 0; s < spec_.page_size; ++s) {
          if (p * spec_.page_size + s < seqlens_k_[b]) slot_valid[static_cast<size_t>(page) * spec_.page_size + s] = 1;
        }
      }
    }

    q_token_stride_ = num_q_heads_ * d + spec_.token_pad;
    out_token_stride_ = num_q_heads_ * d + spec_.token_pad;
    cache_row_elems_ = int64_t(spec_.num_kv_heads) * d;
    const int64_t cache_elems = int64_t(num_pages_) * spec_.page_size * cache_row_elems_;

    q_ = DeviceBuffer<__nv_bfloat16>(int64_t(total_q_) * q_token_stride_);
    k_ = DeviceBuffer<__nv_bfloat16>(cache_elems);
    v_ = DeviceBuffer<__nv_bfloat16>(cache_elems);
    out_ = DeviceBuffer<__nv_bfloat16>((int64_t(total_q_) + kGuardTokens) * out_token_stride_);
    lse_ = DeviceBuffer<float>((int64_t(total_q_) + kGuardTokens) * num_q_heads_);
    cu_dev_ = DeviceBuffer<int32_t>(B + 1);
    seqlens_k_dev_ = DeviceBuffer<int32_t>(B);
    page_table_dev_ = DeviceBuffer<int32_t>(int64_t(B) * max_pages_);
    cu_dev_.upload(cu_seqlens_);
    seqlens_k_dev_.upload(seqlens_k_);
    page_table_dev_.upload(page_table_);
    DeviceBuffer<uint8_t> valid_dev(int64_t(slot_valid.size()));
    valid_dev.upload(slot_valid);

    fill_uniform_bf16<<<fill_blocks(q_.count()), 256>>>(q_.get(), q_.count(), spec_.seed * 3 + 0, -spec_.q_range,
                                                        spec_.q_range);
    fill_cache_bf16<<<fill_blocks(cache_elems), 256>>>(k_.get(), int64_t(num_pages_) * spec_.page_size,
                                                      cache_row_elems_, valid_dev.get(), spec_.seed * 3 + 1);
    fill_cache_bf16<<<fill_blocks(cache_elems), 256>>>(v_.get(), int64_t(num_pages_) * spec_.page_size,
                                                      cache_row_elems_, valid_dev.get(), spec_.seed * 3 + 2);
    FPV2_TEST_CUDA(cudaGetLastError());
    poison_outputs();
    FPV2_TEST_CUDA(cudaDeviceSynchronize());

    batch_ = fpv2_paged_batch_t{};
    batch_.struct_size = sizeof(fpv2_paged_batch_t);
    batch_.num_requests = B;
    batch_.cu_seqlens_q = make_tensor_desc(cu_dev_.get(), FPV2_DTYPE_I32, {B + 1}, {1});
    batch_.seqlens_k = make_tensor_desc(seqlens_k_dev_.get(), FPV2_DTYPE_I32, {B}, {1});
    batch_.page_table = make_tensor_desc(page_table_dev_.get(), FPV2_DTYPE_I32, {B, max_pages_}, {max_pages_, 1});
    batch_.page_size = spec_.page_size;
    batch_.num_pages = num_pages_;
    batch_.total_q = total_q_;
    batch_.max_seqlen_q = max_q_;
    batch_.max_seqlen_k = max_k_;
  }

  PagedCase(const PagedCase&) = delete;
  PagedCase& operator=(const PagedCase&) = delete;

  // The fills run on the legacy default stream and the kernel under test on a non-blocking stream, which
  // does not wait for it: without the synchronisation a late poison fill overwrote the kernel's lse
  // (seen on the H200 as poisoned lse rows of large cases, outputs correct).
  void poison_outputs() {
    poison_bf16<<<fill_blocks(out_.count()), 256>>>(out_.get(), out_.count());
    poison_f32<<<fill_blocks(lse_.count()), 256>>>(lse_.get(), lse_.count());
    FPV2_TEST_CUDA(cudaGetLastError());
    FPV2_TEST_CUDA(cudaDeviceSynchronize());
  }

  // The ABI arguments of one dense call. `batch_` lives in this object, so keep it alive while using them.
  fpv2_prefill_args_t args(cudaStream_t stream) const {
    const int64_t d = spec_.head_dim;
    const int64_t Hkv = spec_.num_kv_heads;
    fpv2_prefill_args_t a{};
    a.struct_size = sizeof(fpv2_prefill_args_t);
    a.flags = FPV2_PREFILL_CAUSAL;
    a.q = make_tensor_desc(q_.get(), FPV2_DTYPE_BF16, {total_q_, num_q_heads_, d}, {q_token_stride_, d, 1});
    const std::vector<int64_t> cache_shape = {num_pages_, spec_.page_size, Hkv, d};
    const std::vector<int64_t> cache_strides = {spec_.page_size * Hkv * d, Hkv * d, d, 1};
    a.k_cache = make_tensor_desc(k_.get(), FPV2_DTYPE_BF16, cache_shape, cache_strides);
    a.v_cache = make_tensor_desc(v_.get(), FPV2_DTYPE_BF16, cache_shape, cache_strides);
    a.out = make_tensor_desc(out_.get(), FPV2_DTYPE_BF16, {total_q_, num_q_heads_, d}, {out_token_stride_, d, 1});
    a.lse = make_tensor_desc(lse_.get(), FPV2_DTYPE_F32, {total_q_, num_q_heads_}, {num_q_heads_, 1});
    a.batch = &batch_;
    a.softmax_scale = spec_.softmax_scale;
    a.device = -1;
    a.stream = stream;
    return a;
  }

  const CaseSpec& spec() const { return spec_; }
  int num_requests() const { return static_cast<int>(spec_.q_lens.size()); }
  int num_q_heads() const { return num_q_heads_; }
  int64_t total_q() const { return total_q_; }
  int num_pages() const { return num_pages_; }
  int max_pages() const { return max_pages_; }
  int64_t q_token_stride() const { return q_token_stride_; }
  int64_t out_token_stride() const { return out_token_stride_; }
  int64_t cache_row_elems() const { return cache_row_elems_; }
  const std::vector<int32_t>& seqlens_k() const { return seqlens_k_; }
  const __nv_bfloat16* q() const { return q_.get(); }
  const __nv_bfloat16* k_cache() const { return k_.get(); }
  const __nv_bfloat16* v_cache() const { return v_.get(); }
  const __nv_bfloat16* out() const { return out_.get(); }
  const float* lse() const { return lse_.get(); }
  int64_t out_elems() const { return out_.count(); }
  int64_t lse_elems() const { return lse_.count(); }
  const int32_t* cu_seqlens_dev() const { return cu_dev_.get(); }
  const int32_t* seqlens_k_dev() const { return seqlens_k_dev_.get(); }
  const int32_t* page_table_dev() const { return page_table_dev_.get(); }

 private:
  CaseSpec spec_;
  int num_q_heads_ = 0;
  int64_t total_q_ = 0;
  int max_q_ = 0;
  int max_k_ = 0;
  int num_pages_ = 0;
  int max_pages_ = 0;
  int64_t q_token_stride_ = 0;
  int64_t out_token_stride_ = 0;
  int64_t cache_row_elems_ = 0;
  std::vector<int32_t> cu_seqlens_;
  std::vector<int32_t> seqlens_k_;
  std::vector<int32_t> page_table_;
  DeviceBuffer<__nv_bfloat16> q_, k_, v_, out_;
  DeviceBuffer<float> lse_;
  DeviceBuffer<int32_t> cu_dev_, seqlens_k_dev_, page_table_dev_;
  fpv2_paged_batch_t batch_{};
};

}  // namespace fpv2::native_test
