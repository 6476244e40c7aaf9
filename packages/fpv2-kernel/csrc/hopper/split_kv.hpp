// Split-KV: when a call has too few query tiles to fill the GPU (a short chunk after a long cached prefix, a
// small batch of short requests), each tile's KV tiles are shared by several CTAs (BlockSchedule's split
// ranges) that write normalised fp32 partial rows and their lse to the caller's workspace; a second kernel
// merges them (split_combine.hpp). Free of CuTe and CUDA headers: the launcher, the workspace query and
// the native tests use it.
//
// How many: with C CTAs for the call's tiles and M SMs (one CTA per SM), floor(M / C) splits, the most that
// still run in one wave (ceil(M / C) measured slower: at C = 128 its second wave made a 512-query chunk after
// a 128K prefix 8-12% slower, NOTES.md), none when C > M / 2, at most kMaxKvSplits, and at most one split per
// kMinBlocksPerSplit KV blocks of the longest request (a split must have enough tiles to hide its pipeline's
// start and its extra epilogue).
// FPV2_HOPPER_SPLITS=N forces N (1 turns splitting off) for tests and A/B runs.
#pragma once

#include <cstdint>

namespace fpv2::hopper {

inline constexpr int kMaxKvSplits = 16;
inline constexpr int kMinBlocksPerSplit = 8;
inline constexpr uint64_t kWorkspaceAlignment = 256;

inline constexpr uint64_t align_workspace(uint64_t bytes) {
  return (bytes + kWorkspaceAlignment - 1) / kWorkspaceAlignment * kWorkspaceAlignment;
}

// Bytes of the partial outputs (fp32 rows) of `splits` splits; the partial lse follow at that offset.
inline constexpr uint64_t split_out_bytes(int64_t total_q, int64_t num_q_heads, int64_t head_dim, int splits) {
  return align_workspace(uint64_t(splits) * uint64_t(total_q) * uint64_t(num_q_heads) * uint64_t(head_dim) * 4u);
}

// Workspace bytes of `splits` splits (0 for one: no split, no workspace).
inline constexpr uint64_t split_workspace_bytes(int64_t total_q, int64_t num_q_heads, int64_t head_dim, int splits) {
  if (splits <= 1) return 0;
  return split_out_bytes(total_q, num_q_heads, head_dim, splits) +
         align_workspace(uint64_t(splits) * uint64_t(total_q) * uint64_t(num_q_heads) * 4u);
}

// The automatic split count for `num_ctas` CTAs (query tiles x KV heads x requests) on `sms` SMs, requests of
// at most `max_seqlen_k` KV tokens (128-token blocks).
inline constexpr int auto_kv_splits(int64_t num_ctas, int sms, int64_t max_seqlen_k) {
  if (num_ctas <= 0 || num_ctas >= sms) return 1;
  const int64_t by_sms = sms / num_ctas;
  const int64_t by_blocks = ((max_seqlen_k + 127) / 128) / kMinBlocksPerSplit;
  int64_t splits = by_sms < by_blocks ? by_sms : by_blocks;
  if (splits > kMaxKvSplits) splits = kMaxKvSplits;
  return splits < 1 ? 1 : int(splits);
}

}  // namespace fpv2::hopper
