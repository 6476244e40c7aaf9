// Validation of one block-scoring call (fpv2_score_args_t): tensors, their consistency and the
// configurations the kernel serves.
#include <cmath>

#include "validate/struct_checks.hpp"
#include "validate/tensor_checks.hpp"

namespace fpv2::detail {
namespace {

constexpr int32_t kMaxScoreBlocks = 16384;  // the tile's energies live in 64 KB of shared memory

long long ll(int64_t v) { return static_cast<long long>(v); }

int32_t check_int_vector(const fpv2_tensor_t& t, const char* name, int64_t length, const char* symbolic) {
  FPV2_RETURN_IF_ERROR(check_required(t, name, {FPV2_DTYPE_I32}, 1));
  FPV2_RETURN_IF_ERROR(check_shape(t, name, {length}, symbolic));
  return check_contiguous(t, name);
}

}  // namespace

int32_t validate_score_args(const fpv2_score_args_t* args) {
  FPV2_RETURN_IF_ERROR(check_struct(args, "fpv2_score_args_t", "args"));
  const fpv2_score_args_t& a = *args;
  if (a.num_requests < 1) {
    return fail(FPV2_ERROR_INVALID_ARGUMENT,
                format("fpv2_score_args_t.num_requests must be >= 1; got %d", a.num_requests));
  }
  const char* qn = "fpv2_score_args_t.q";
  FPV2_RETURN_IF_ERROR(check_present(a.q, qn, 3));
  if (a.q.dtype != FPV2_DTYPE_BF16 && a.q.dtype != FPV2_DTYPE_F16) {
    FPV2_RETURN_IF_ERROR(check_header(a.q, qn));
    return fail(FPV2_ERROR_UNSUPPORTED, format("%s must be bf16 or f16 for the scoring kernel (use the Triton "
                                               "pass for other dtypes); got %s",
                                               qn, describe(a.q).c_str()));
  }
  FPV2_RETURN_IF_ERROR(check_inner_stride(a.q, qn));
  const int64_t d = a.q.shape[2];
  if (d != 64 && d != 128) {
    return fail(FPV2_ERROR_UNSUPPORTED,
                format("%s has head dim d=%lld; the scoring kernel supports d in {64, 128}; got %s", qn, ll(d),
                       describe(a.q).c_str()));
  }
  const char* kn = "fpv2_score_args_t.keys";
  FPV2_RETURN_IF_ERROR(check_present(a.keys, kn, 3));
  if (a.keys.dtype != a.q.dtype) {
    return fail(FPV2_ERROR_INVALID_ARGUMENT, format("%s must have q's dtype %s; got %s", kn,
                                                    dtype_name(a.q.dtype).c_str(), describe(a.keys).c_str()));
  }
  FPV2_RETURN_IF_ERROR(check_shape(a.keys, kn, {kAnySize, kAnySize, d}, "(total_blocks, Hkv, d)"));
  FPV2_RETURN_IF_ERROR(check_contiguous(a.keys, kn));
  const int64_t heads = a.keys.shape[1];
  if (heads < 1 || a.q.shape[1] % heads != 0 || a.group != a.q.shape[1] / heads) {
    return fail(FPV2_ERROR_INVALID_ARGUMENT,
                format("fpv2_score_args_t.group=%d must equal Hq / Hkv = %lld / %lld (q and keys' head counts)",
                       a.group, ll(a.q.shape[1]), ll(heads)));
  }
  if (a.tile_size != FPV2_KERNEL_TILE_SIZE) {
    return fail(FPV2_ERROR_UNSUPPORTED, format("fpv2_score_args_t.tile_size=%d; the scoring kernel takes %d-row tiles",
                                               a.tile_size, FPV2_KERNEL_TILE_SIZE));
  }
  if (a.block_size < 1 || (a.block_size & (a.block_size - 1)) != 0) {
    return fail(FPV2_ERROR_INVALID_ARGUMENT,
                format("fpv2_score_args_t.block_size must be a power of two; got %d", a.block_size));
  }
  if (a.max_blocks < 0 || a.max_blocks > kMaxScoreBlocks) {
    return fail(a.max_blocks < 0 ? FPV2_ERROR_INVALID_ARGUMENT : FPV2_ERROR_UNSUPPORTED,
                format("fpv2_score_args_t.max_blocks=%d; the scoring kernel takes 0 .. %d key blocks per request",
                       a.max_blocks, kMaxScoreBlocks));
  }
  if (a.num_tiles < 0) {
    return fail(FPV2_ERROR_INVALID_ARGUMENT, format("fpv2_score_args_t.num_tiles must be >= 0; got %lld",
                                                    ll(a.num_tiles)));
  }
  if (!std::isfinite(a.alpha) || a.alpha < 0.0f) {
    return fail(FPV2_ERROR_INVALID_ARGUMENT,
                format("fpv2_score_args_t.alpha must be finite and >= 0; got %g", double(a.alpha)));
  }
  if (a.sink_blocks < 0 || a.window_tokens < 0 || a.dense_tail_tiles < 0 || a.min_sparse_kv_len < 0) {
    return fail(FPV2_ERROR_INVALID_ARGUMENT,
                format("fpv2_score_args_t: sink_blocks=%d, window_tokens=%d, dense_tail_tiles=%d and "
                       "min_sparse_kv_len=%d must be >= 0",
                       a.sink_blocks, a.window_tokens, a.dense_tail_tiles, a.min_sparse_kv_len));
  }
  const int64_t b = a.num_requests;
  const int64_t segments = heads * a.num_tiles;
  FPV2_RETURN_IF_ERROR(check_int_vector(a.cu_seqlens_q, "fpv2_score_args_t.cu_seqlens_q", b + 1, "(B+1,)"));
  FPV2_RETURN_IF_ERROR(check_int_vector(a.seqlens_k, "fpv2_score_args_t.seqlens_k", b, "(B,)"));
  FPV2_RETURN_IF_ERROR(check_int_vector(a.block_offsets, "fpv2_score_args_t.block_offsets", b + 1, "(B+1,)"));
  FPV2_RETURN_IF_ERROR(check_int_vector(a.tile_offsets, "fpv2_score_args_t.tile_offsets", b + 1, "(B+1,)"));
  FPV2_RETURN_IF_ERROR(check_int_vector(a.offsets, "fpv2_score_args_t.offsets", segments + 1, "(Hkv * num_tiles + 1,)"));
  FPV2_RETURN_IF_ERROR(check_int_vector(a.counts, "fpv2_score_args_t.counts", segments, "(Hkv * num_tiles,)"));
  const char* bn = "fpv2_score_args_t.keep_bits";
  FPV2_RETURN_IF_ERROR(check_required(a.keep_bits, bn, {FPV2_DTYPE_I32}, 2));
  const int64_t words = ceil_div(a.max_blocks, 64) * 2;
  FPV2_RETURN_IF_ERROR(check_shape(a.keep_bits, bn, {segments, kAnySize}, "(Hkv * num_tiles, words)"));
  if (a.keep_bits.shape[1] < words) {
    return fail(FPV2_ERROR_INVALID_ARGUMENT,
                format("%s holds %lld words per segment; max_blocks=%d needs %lld; got %s", bn,
                       ll(a.keep_bits.shape[1]), a.max_blocks, ll(words), describe(a.keep_bits).c_str()));
  }
  return check_inner_stride(a.keep_bits, bn);
}

}  // namespace fpv2::detail
