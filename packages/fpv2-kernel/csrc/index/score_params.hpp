// Arguments of the index stage's scoring kernel on the device (built from fpv2_score_args_t by
// launch_score.cu): raw pointers, element strides and the selection rule's scalars.
#pragma once

#include <cstdint>

namespace fpv2::index {

template <class Element>
struct ScoreParams {
  Element const* q;           // (total_q, Hq, d)
  int64_t q_token_stride;
  int64_t q_head_stride;
  Element const* keys;        // (total_blocks, Hkv, d) contiguous, prescaled to log2 logit units
  int64_t key_block_stride;   // Hkv * d, also the columns of the keys' TMA view
  int32_t key_rows;           // total_blocks (the keys' TMA extent)
  int32_t const* cu_seqlens_q;
  int32_t const* seqlens_k;
  int32_t const* block_offsets;
  int32_t* tile_offsets;      // (B+1,) output
  int32_t* offsets;           // (S+1,) output
  int32_t* counts;            // (S,) output
  uint32_t* keep_bits;        // (S, words) output
  int64_t bits_stride;        // words per segment row
  int32_t num_requests;
  int32_t num_kv_heads;
  int32_t group;
  int32_t block_size;
  int64_t num_tiles;          // query tiles of the batch; one CTA per (tile, KV head)
  int64_t num_segments;
  float alpha;
  int32_t sink_blocks;
  int32_t window_tokens;
  int32_t dense_tail_tiles;
  int32_t min_sparse_kv_len;
};

}  // namespace fpv2::index
