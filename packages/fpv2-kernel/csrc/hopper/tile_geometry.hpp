// Geometry of one PackGQA query tile: which request, KV head and packed rows it covers, and which KV
// blocks it must visit (the block iteration of the dense causal schedule).
//
// Packed row r of KV head h is query position r / g of query head h * g + r % g (ALGORITHM.md section 2).
// Causal alignment is bottom-right: position p sits at absolute KV position prefix + p, prefix =
// seqlens_k[b] - q_len_b, and sees KV tokens 0 .. prefix + p. For the tile rows [row_begin, row_last]:
//   n_block_max       = (prefix + p_last) / kBlockN + 1   blocks 0 .. n_block_max - 1 are visible to some row;
//   n_block_masked    = (prefix + p_first) / kBlockN      blocks >= this one hold a column hidden from some
//                                                         row (the diagonal band) and are masked; blocks
//                                                         below it are fully visible to every row.
// The kernel walks the blocks backwards, n_block_max - 1 down to 0, so the masked blocks come first.
// Columns >= seqlens_k[b] lie above prefix + p_last and are therefore always in the masked band.
// The "blocks" here are the kernel's KV tiles of kBlockN tokens. The index and the correction count in blocks
// of kBlockSize >= kBlockN tokens (128; at d = 256 a tile is half a block):
//   n_pooled_eligible = (prefix + p_first) / kBlockSize   index blocks fully visible to every row of the tile,
//                                                         the ones the correction may stand in for
//                                                         (n_block_masked when kBlockSize == kBlockN).
#pragma once

#include <cstdint>

namespace fpv2::hopper {

template <int kBlockM, int kBlockN, int kBlockSize = kBlockN>
struct TileGeometry {
  static_assert(kBlockSize % kBlockN == 0, "an index block is a whole number of KV tiles");
  __host__ __device__ __forceinline__ static int smaller(int a, int b) { return a < b ? a : b; }

  int request;
  int kv_head;
  int m_block;
  int q_start;    // first token of the request in the packed query tensor
  int q_len;      // queries of the request
  int seqlen_k;   // KV tokens of the request, prefix included
  int prefix;     // seqlen_k - q_len
  int num_rows;   // q_len * group packed rows of this KV head
  int row_begin;  // first packed row of the tile
  int n_block_max;
  int n_block_masked;
  int n_pooled_eligible;
  int split;      // split-KV: which part of the tile's KV tiles this CTA visits (0 without a split)

  // Reads the request's lengths (every thread reads the same few words: they stay in L1). Host-callable
  // with host arrays, for the native geometry checks.
  __host__ __device__ __forceinline__ static TileGeometry load(int request, int kv_head, int m_block, int group,
                                                       int32_t const* cu_seqlens_q, int32_t const* seqlens_k) {
    TileGeometry t;
    t.request = request;
    t.kv_head = kv_head;
    t.m_block = m_block;
    t.q_start = cu_seqlens_q[request];
    t.q_len = cu_seqlens_q[request + 1] - t.q_start;
    t.seqlen_k = seqlens_k[request];
    t.prefix = t.seqlen_k - t.q_len;
    t.num_rows = t.q_len * group;
    t.row_begin = m_block * kBlockM;
    t.split = 0;
    if (t.row_begin < t.num_rows) {
      const int row_last = smaller(t.row_begin + kBlockM, t.num_rows) - 1;
      const int p_first = t.row_begin / group;
      const int p_last = row_last / group;
      t.n_block_max = (t.prefix + p_last) / kBlockN + 1;
      t.n_block_masked = (t.prefix + p_first) / kBlockN;
      t.n_pooled_eligible = (t.prefix + p_first) / kBlockSize;
    } else {
      t.n_block_max = 0;
      t.n_block_masked = 0;
      t.n_pooled_eligible = 0;
    }
    return t;
  }

  // False for the grid slots past the request's last tile (the grid is sized for the longest request).
  __host__ __device__ __forceinline__ bool valid() const { return row_begin < num_rows && n_block_max > 0; }

  // Last KV column packed row `row` may see, clamped to the request's KV length so that rows past the
  // end of the request (zero-filled, never stored) never look at cache slots beyond seqlen_k.
  __host__ __device__ __forceinline__ int column_limit(int row, int group) const {
    return smaller(prefix + row / group, seqlen_k - 1);
  }

  // The block holding the request's last KV token when it is partial: its V rows past seqlen_k are stale
  // cache contents (possibly NaN) and must not reach the PV product, even with zero probabilities.
  __host__ __device__ __forceinline__ bool is_partial_tail_block(int n_block) const {
    return (seqlen_k % kBlockN) != 0 && n_block == (seqlen_k - 1) / kBlockN;
  }
};

}  // namespace fpv2::hopper
