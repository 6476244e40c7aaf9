// Validation of one prefill call: activations, cache, outputs, descales and the structs they use.
#include <cmath>

#include "validate/struct_checks.hpp"
#include "validate/tensor_checks.hpp"

namespace fpv2::detail {
namespace {

constexpr uint32_t kKnownFlags = FPV2_PREFILL_CAUSAL;

bool supported_head_dim(int64_t d) { return d == 64 || d == 128 || d == 256; }

long long ll(int64_t v) { return static_cast<long long>(v); }

// q: (total_q, Hq, d) in a kernel element type with a supported head dim.
int32_t check_query(const fpv2_tensor_t& q, const fpv2_paged_batch_t& batch) {
  const char* name = "fpv2_prefill_args_t.q";
  FPV2_RETURN_IF_ERROR(check_present(q, name, 3));
  if (q.dtype == FPV2_DTYPE_F32) {
    return fail(FPV2_ERROR_UNSUPPORTED,
                format("%s has dtype f32, which the Hopper kernel does not take (f16, bf16 or float8_e4m3fn); use "
                       "the reference backend for f32; got %s",
                       name, describe(q).c_str()));
  }
  FPV2_RETURN_IF_ERROR(check_dtype(q, name, {FPV2_DTYPE_F16, FPV2_DTYPE_BF16, FPV2_DTYPE_E4M3}));
  FPV2_RETURN_IF_ERROR(check_shape(q, name, {batch.total_q, kAnySize, kAnySize}, "(total_q, Hq, d)"));
  if (!supported_head_dim(q.shape[2])) {
    return fail(FPV2_ERROR_UNSUPPORTED,
                format("%s has head dim d=%lld; the kernel supports d in {64, 128, 256}; got %s", name,
                       ll(q.shape[2]), describe(q).c_str()));
  }
  return check_inner_stride(q, name);
}

// A rank-4 cache tensor in q's dtype.
int32_t check_cache_header(const fpv2_tensor_t& cache, const char* name, const fpv2_tensor_t& q) {
  FPV2_RETURN_IF_ERROR(check_present(cache, name, 4));
  if (cache.dtype != q.dtype) {
    return fail(FPV2_ERROR_INVALID_ARGUMENT, format("%s must have q's dtype %s; got %s", name,
                                                    dtype_name(q.dtype).c_str(), describe(cache).c_str()));
  }
  return FPV2_OK;
}

// k_cache / v_cache: (num_pages, page_size, Hkv, d) in q's dtype.
int32_t check_cache(const fpv2_tensor_t& cache, const char* name, const fpv2_tensor_t& q,
                    const fpv2_paged_batch_t& batch, int64_t num_kv_heads) {
  FPV2_RETURN_IF_ERROR(check_cache_header(cache, name, q));
  FPV2_RETURN_IF_ERROR(check_shape(cache, name, {batch.num_pages, batch.page_size, num_kv_heads, q.shape[2]},
                                   "(num_pages, page_size, Hkv, d)"));
  return check_inner_stride(cache, name);
}

// Descales are (B, Hkv) f32 when the inputs are float8_e4m3fn, and absent otherwise.
int32_t check_descale(const fpv2_tensor_t& scale, const char* name, bool fp8, const fpv2_paged_batch_t& batch,
                      int64_t num_kv_heads) {
  if (!fp8) {
    if (is_absent(scale)) return FPV2_OK;
    return fail(FPV2_ERROR_INVALID_ARGUMENT,
                format("%s is only meaningful for float8_e4m3fn inputs and must be absent otherwise; got %s", name,
                       describe(scale).c_str()));
  }
  if (is_absent(scale)) {
    return fail(FPV2_ERROR_INVALID_ARGUMENT,
                format("%s is required for float8_e4m3fn inputs: expected shape (B, Hkv) = (%d, %lld), dtype f32; "
                       "got absent",
                       name, batch.num_requests, ll(num_kv_heads)));
  }
  FPV2_RETURN_IF_ERROR(check_required(scale, name, {FPV2_DTYPE_F32}, 2));
  FPV2_RETURN_IF_ERROR(check_shape(scale, name, {batch.num_requests, num_kv_heads}, "(B, Hkv)"));
  return check_contiguous(scale, name);
}

}  // namespace

int32_t validate_prefill_args(const fpv2_prefill_args_t* args) {
  FPV2_RETURN_IF_ERROR(check_struct(args, "fpv2_prefill_args_t", "args"));
  const fpv2_prefill_args_t& a = *args;
  if ((a.flags & FPV2_PREFILL_CAUSAL) == 0) {
    return fail(FPV2_ERROR_INVALID_ARGUMENT,
                format("fpv2_prefill_args_t.flags=0x%x lacks FPV2_PREFILL_CAUSAL (0x%x); only causal prefill exists, "
                       "set the flag",
                       a.flags, FPV2_PREFILL_CAUSAL));
  }
  if ((a.flags & ~kKnownFlags) != 0) {
    return fail(FPV2_ERROR_UNSUPPORTED,
                format("fpv2_prefill_args_t.flags=0x%x has bits 0x%x unknown to this library (ABI %d.%d)", a.flags,
                       a.flags & ~kKnownFlags, FPV2_ABI_VERSION_MAJOR, FPV2_ABI_VERSION_MINOR));
  }
  FPV2_RETURN_IF_ERROR(validate_batch(a.batch));
  const fpv2_paged_batch_t& batch = *a.batch;

  FPV2_RETURN_IF_ERROR(check_query(a.q, batch));
  const int64_t num_q_heads = a.q.shape[1];
  const int64_t head_dim = a.q.shape[2];

  // Hkv comes from k_cache; check its rank first so that shape[2] is meaningful.
  FPV2_RETURN_IF_ERROR(check_cache_header(a.k_cache, "fpv2_prefill_args_t.k_cache", a.q));
  const int64_t num_kv_heads = a.k_cache.shape[2];
  if (num_kv_heads < 1 || num_q_heads % num_kv_heads != 0) {
    return fail(FPV2_ERROR_INVALID_ARGUMENT,
                format("Hq %% Hkv != 0: fpv2_prefill_args_t.q has Hq=%lld heads (%s) and k_cache has Hkv=%lld (%s); "
                       "grouped-query attention needs Hq to be a positive multiple of Hkv",
                       ll(num_q_heads), describe(a.q).c_str(), ll(num_kv_heads), describe(a.k_cache).c_str()));
  }
  FPV2_RETURN_IF_ERROR(check_cache(a.k_cache, "fpv2_prefill_args_t.k_cache", a.q, batch, num_kv_heads));
  FPV2_RETURN_IF_ERROR(check_cache(a.v_cache, "fpv2_prefill_args_t.v_cache", a.q, batch, num_kv_heads));

  const bool fp8 = a.q.dtype == FPV2_DTYPE_E4M3;
  const int32_t out_dtype = fp8 ? FPV2_DTYPE_BF16 : a.q.dtype;
  FPV2_RETURN_IF_ERROR(check_required(a.out, "fpv2_prefill_args_t.out", {out_dtype}, 3));
  FPV2_RETURN_IF_ERROR(
      check_shape(a.out, "fpv2_prefill_args_t.out", {batch.total_q, num_q_heads, head_dim}, "(total_q, Hq, d)"));
  FPV2_RETURN_IF_ERROR(check_inner_stride(a.out, "fpv2_prefill_args_t.out"));
  if (!is_absent(a.lse)) {
    FPV2_RETURN_IF_ERROR(check_required(a.lse, "fpv2_prefill_args_t.lse", {FPV2_DTYPE_F32}, 2));
    FPV2_RETURN_IF_ERROR(check_shape(a.lse, "fpv2_prefill_args_t.lse", {batch.total_q, num_q_heads}, "(total_q, Hq)"));
    FPV2_RETURN_IF_ERROR(check_inner_stride(a.lse, "fpv2_prefill_args_t.lse"));
  }
  FPV2_RETURN_IF_ERROR(check_descale(a.q_descale, "fpv2_prefill_args_t.q_descale", fp8, batch, num_kv_heads));
  FPV2_RETURN_IF_ERROR(check_descale(a.k_descale, "fpv2_prefill_args_t.k_descale", fp8, batch, num_kv_heads));
  FPV2_RETURN_IF_ERROR(check_descale(a.v_descale, "fpv2_prefill_args_t.v_descale", fp8, batch, num_kv_heads));

  const int64_t group = num_q_heads / num_kv_heads;
  if (a.index != nullptr) {
    // Compare with the inputs first: a mismatch is the likeliest root cause of the index's own inconsistencies.
    FPV2_RETURN_IF_ERROR(check_struct(a.index, "fpv2_block_index_t", "index"));
    if (a.index->num_kv_heads != num_kv_heads) {
      return fail(FPV2_ERROR_INVALID_ARGUMENT,
                  format("fpv2_block_index_t.num_kv_heads=%d differs from k_cache's Hkv=%lld (%s)",
                         a.index->num_kv_heads, ll(num_kv_heads), describe(a.k_cache).c_str()));
    }
    if (a.index->group != group) {
      return fail(FPV2_ERROR_INVALID_ARGUMENT,
                  format("fpv2_block_index_t.group=%d differs from the inputs' GQA group Hq / Hkv = %lld / %lld = "
                         "%lld; the index must be packed for the inputs' group",
                         a.index->group, ll(num_q_heads), ll(num_kv_heads), ll(group)));
    }
    FPV2_RETURN_IF_ERROR(validate_index(a.index, batch));
  }
  if (a.correction != nullptr) {
    if (a.index == nullptr) {
      return fail(FPV2_ERROR_INVALID_ARGUMENT,
                  "fpv2_prefill_args_t.correction is set but index is NULL: dense attention prunes no block, so "
                  "there is nothing to correct; pass the block index the plan was built for");
    }
    FPV2_RETURN_IF_ERROR(check_plan_struct(a.correction, "correction"));
    const fpv2_correction_plan_t& plan = *a.correction;
    if (plan.block_size != a.index->block_size) {
      return fail(FPV2_ERROR_INVALID_ARGUMENT,
                  format("fpv2_correction_plan_t.block_size=%d differs from fpv2_block_index_t.block_size=%d; the "
                         "statistics must be pooled over the index's blocks",
                         plan.block_size, a.index->block_size));
    }
    FPV2_RETURN_IF_ERROR(validate_plan(a.correction, batch));
    if (plan.pooled_k.shape[1] != num_kv_heads || plan.pooled_k.shape[2] != head_dim) {
      return fail(FPV2_ERROR_INVALID_ARGUMENT,
                  format("fpv2_correction_plan_t.pooled_k must have shape (total_blocks, Hkv, d) = (*, %lld, %lld); "
                         "got %s",
                         ll(num_kv_heads), ll(head_dim), describe(plan.pooled_k).c_str()));
    }
    if (!is_absent(plan.todo_offsets)) {
      FPV2_RETURN_IF_ERROR(check_shape(plan.todo_offsets, "fpv2_correction_plan_t.todo_offsets",
                                       {a.index->num_segments + 1}, "(S+1,) of the block index"));
    }
  }

  if (!std::isfinite(a.softmax_scale) || a.softmax_scale < 0.0f) {
    return fail(FPV2_ERROR_INVALID_ARGUMENT,
                format("fpv2_prefill_args_t.softmax_scale=%g; expected a finite value > 0, or 0 for 1/sqrt(d)",
                       static_cast<double>(a.softmax_scale)));
  }
  if (a.device < -1) {
    return fail(FPV2_ERROR_INVALID_ARGUMENT,
                format("fpv2_prefill_args_t.device=%d; expected a CUDA device ordinal >= 0, or -1 for the current "
                       "device",
                       a.device));
  }
  if (a.workspace == nullptr && a.workspace_bytes != 0) {
    return fail(FPV2_ERROR_INVALID_ARGUMENT,
                format("fpv2_prefill_args_t.workspace is NULL but workspace_bytes=%llu",
                       static_cast<unsigned long long>(a.workspace_bytes)));
  }
  return FPV2_OK;
}

}  // namespace fpv2::detail
