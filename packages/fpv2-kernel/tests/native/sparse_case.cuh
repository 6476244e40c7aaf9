// The block-sparse side of a native test problem: a random CSR block index over a PagedCase (the diagonal
// band of every tile always kept, other visible blocks kept with a given probability, as the index stage's
// forced blocks guarantee) and, for the mean correction, the bf16 pooled K/V of every 128-token block with
// its length and per-request offsets. Spare pooled rows after the last request hold NaN, so a kernel that
// lets a row outside the request's eligible range reach its softmax or PV product fails.
#pragma once

#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

#include <cuda_bf16.h>

#include "device_fill.cuh"
#include "paged_case.cuh"
#include "pooled_e4m3_case.cuh"

namespace fpv2::native_test {

inline constexpr int kSparseBlock = 128;  // KV tokens per block = the kernel's query tile rows

// Mean of each block's valid tokens, per KV head: pooled[(block_offsets[b] + J) * row_elems + c] for the
// cache's (slots, row_elems) view, one thread per (pooled row, column).
__global__ void pool_blocks_bf16(const __nv_bfloat16* cache, const int32_t* page_table, int64_t page_table_stride,
                                 int32_t page_size, int64_t row_elems, const int32_t* pooled_request,
                                 const int32_t* pooled_block, const int32_t* seqlens_k, int64_t num_pooled,
                                 __nv_bfloat16* pooled) {
  const int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (idx >= num_pooled * row_elems) return;
  const int64_t row = idx / row_elems;
  const int64_t col = idx % row_elems;
  const int b = pooled_request[row];
  const int J = pooled_block[row];
  const int end = min(seqlens_k[b], (J + 1) * kSparseBlock);
  float sum = 0.0f;
  for (int j = J * kSparseBlock; j < end; ++j) {
    const int page = page_table[b * page_table_stride + j / page_size];
    sum += __bfloat162float(cache[(int64_t(page) * page_size + j % page_size) * row_elems + col]);
  }
  pooled[idx] = __float2bfloat16(sum / float(end - J * kSparseBlock));
}

class SparseCase {
 public:
  static constexpr int kSparePooledRows = 5;

  // keep: probability of keeping a visible block below the tile's diagonal band.
  SparseCase(const PagedCase& c, double keep, bool correction, uint64_t seed) : correction_(correction) {
    const CaseSpec& sp = c.spec();
    const int B = c.num_requests();
    const int Hkv = sp.num_kv_heads;
    const int g = sp.group;
    std::mt19937_64 rng(seed * 0x9e3779b97f4a7c15ull + 3);
    std::uniform_real_distribution<double> u(0.0, 1.0);
    tile_offsets_.assign(1, 0);
    offsets_.assign(1, 0);
    std::vector<int32_t> q_lens(B);
    for (int b = 0; b < B; ++b) {
      q_lens[b] = sp.q_lens[b];
      tile_offsets_.push_back(tile_offsets_.back() + (q_lens[b] * g + kSparseBlock - 1) / kSparseBlock);
    }
    for (int b = 0; b < B; ++b) {
      const int prefix = c.seqlens_k()[b] - q_lens[b];
      const int rows = q_lens[b] * g;
      const int tiles = tile_offsets_[b + 1] - tile_offsets_[b];
      for (int h = 0; h < Hkv; ++h) {
        for (int t = 0; t < tiles; ++t) {
          const int p_first = t * kSparseBlock / g;
          const int p_last = (std::min(t * kSparseBlock + kSparseBlock, rows) - 1) / g;
          const int n_max = (prefix + p_last) / kSparseBlock + 1;
          const int n_masked = (prefix + p_first) / kSparseBlock;
          for (int n = 0; n < n_max; ++n) {
            if (n >= n_masked || u(rng) < keep) blocks_.push_back(n);
          }
          offsets_.push_back(static_cast<int32_t>(blocks_.size()));
          visible_ += n_max;
        }
      }
    }
    offsets_dev_ = DeviceBuffer<int32_t>(int64_t(offsets_.size()));
    blocks_dev_ = DeviceBuffer<int32_t>(std::max<int64_t>(int64_t(blocks_.size()), 1));
    tile_offsets_dev_ = DeviceBuffer<int32_t>(int64_t(tile_offsets_.size()));
    offsets_dev_.upload(offsets_);
    if (!blocks_.empty()) blocks_dev_.upload(blocks_);
    tile_offsets_dev_.upload(tile_offsets_);

    index_ = fpv2_block_index_t{};
    index_.struct_size = sizeof(fpv2_block_index_t);
    index_.num_kv_heads = Hkv;
    index_.group = g;
    index_.tile_size = FPV2_KERNEL_TILE_SIZE;
    index_.block_size = kSparseBlock;
    index_.offsets = make_tensor_desc(offsets_dev_.get(), FPV2_DTYPE_I32, {int64_t(offsets_.size())}, {1});
    index_.blocks = make_tensor_desc(blocks_dev_.get(), FPV2_DTYPE_I32, {int64_t(blocks_.size())}, {1});
    index_.tile_offsets = make_tensor_desc(tile_offsets_dev_.get(), FPV2_DTYPE_I32, {B + 1}, {1});
    index_.num_segments = int64_t(offsets_.size()) - 1;

    if (!correction_) return;
    block_offsets_.assign(1, 0);
    std::vector<int32_t> pooled_request, pooled_block;
    for (int b = 0; b < B; ++b) {
      const int blocks = (c.seqlens_k()[b] + kSparseBlock - 1) / kSparseBlock;
      for (int J = 0; J < blocks; ++J) {
        pooled_request.push_back(b);
        pooled_block.push_back(J);
        block_lengths_.push_back(std::min(kSparseBlock, c.seqlens_k()[b] - J * kSparseBlock));
      }
      block_offsets_.push_back(block_offsets_.back() + blocks);
    }
    const int64_t used = block_offsets_.back();
    pooled_rows_ = used + kSparePooledRows;
    for (int i = 0; i < kSparePooledRows; ++i) block_lengths_.push_back(kSparseBlock);
    const int64_t row_elems = c.cache_row_elems();
    pooled_k_ = DeviceBuffer<__nv_bfloat16>(pooled_rows_ * row_elems);
    pooled_v_ = DeviceBuffer<__nv_bfloat16>(pooled_rows_ * row_elems);
    poison_bf16<<<fill_blocks(pooled_k_.count()), 256>>>(pooled_k_.get(), pooled_k_.count());
    poison_bf16<<<fill_blocks(pooled_v_.count()), 256>>>(pooled_v_.get(), pooled_v_.count());
    DeviceBuffer<int32_t> req_dev(used), blk_dev(used);
    req_dev.upload(pooled_request);
    blk_dev.upload(pooled_block);
    const unsigned grid = unsigned((used * row_elems + 255) / 256);
    for (int which = 0; which < 2; ++which) {
      pool_blocks_bf16<<<grid, 256>>>(which ? c.v_cache() : c.k_cache(), c.page_table_dev(), c.max_pages(),
                                      sp.page_size, row_elems, req_dev.get(), blk_dev.get(), c.seqlens_k_dev(), used,
                                      which ? pooled_v_.get() : pooled_k_.get());
    }
    FPV2_TEST_CUDA(cudaGetLastError());
    FPV2_TEST_CUDA(cudaDeviceSynchronize());
    block_lengths_dev_ = DeviceBuffer<int32_t>(pooled_rows_);
    block_offsets_dev_ = DeviceBuffer<int32_t>(B + 1);
    block_lengths_dev_.upload(block_lengths_);
    block_offsets_dev_.upload(block_offsets_);

    plan_ = fpv2_correction_plan_t{};
    plan_.struct_size = sizeof(fpv2_correction_plan_t);
    plan_.chunk_size = FPV2_CORRECTION_CHUNK;
    plan_.block_size = kSparseBlock;
    const int64_t d = sp.head_dim;
    plan_.pooled_k = make_tensor_desc(pooled_k_.get(), FPV2_DTYPE_BF16, {pooled_rows_, Hkv, d}, {Hkv * d, d, 1});
    plan_.pooled_v = make_tensor_desc(pooled_v_.get(), FPV2_DTYPE_BF16, {pooled_rows_, Hkv, d}, {Hkv * d, d, 1});
    plan_.block_lengths = make_tensor_desc(block_lengths_dev_.get(), FPV2_DTYPE_I32, {pooled_rows_}, {1});
    plan_.block_offsets = make_tensor_desc(block_offsets_dev_.get(), FPV2_DTYPE_I32, {B + 1}, {1});
  }

  SparseCase(const SparseCase&) = delete;
  SparseCase& operator=(const SparseCase&) = delete;

  // Adds the index (and the plan) to dense arguments; this object must outlive their use.
  void attach(fpv2_prefill_args_t& a) const {
    a.index = &index_;
    a.correction = correction_ ? &plan_ : nullptr;
  }

  // Hands the correction's pooled statistics over as E4M3 copies as well (the FP8 pooled products).
  void use_e4m3(int num_kv_heads, int head_dim) {
    e4m3_.build(pooled_k_.get(), pooled_v_.get(), block_offsets_, block_offsets_dev_.get(), pooled_rows_,
                num_kv_heads, head_dim);
    e4m3_.attach(plan_);
    uses_e4m3_ = true;
  }
  bool uses_e4m3() const { return uses_e4m3_; }

  double density() const { return visible_ ? double(blocks_.size()) / double(visible_) : 0.0; }
  bool correction() const { return correction_; }
  const int32_t* offsets_dev() const { return offsets_dev_.get(); }
  const int32_t* blocks_dev() const { return blocks_dev_.get(); }
  const int32_t* tile_offsets_dev() const { return tile_offsets_dev_.get(); }
  const __nv_bfloat16* pooled_k() const { return pooled_k_.get(); }
  const __nv_bfloat16* pooled_v() const { return pooled_v_.get(); }
  const int32_t* block_lengths_dev() const { return block_lengths_dev_.get(); }
  const int32_t* block_offsets_dev() const { return block_offsets_dev_.get(); }

 private:
  bool correction_;
  int64_t visible_ = 0;
  int64_t pooled_rows_ = 0;
  std::vector<int32_t> tile_offsets_, offsets_, blocks_, block_offsets_, block_lengths_;
  DeviceBuffer<int32_t> offsets_dev_, blocks_dev_, tile_offsets_dev_, block_lengths_dev_, block_offsets_dev_;
  DeviceBuffer<__nv_bfloat16> pooled_k_, pooled_v_;
  fpv2_block_index_t index_{};
  fpv2_correction_plan_t plan_{};
  PooledE4M3Case e4m3_;
  bool uses_e4m3_ = false;
};

}  // namespace fpv2::native_test
