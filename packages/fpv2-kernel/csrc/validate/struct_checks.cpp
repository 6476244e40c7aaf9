// Validation of the paged batch, block index and correction plan structs.
#include "validate/struct_checks.hpp"

#include "validate/tensor_checks.hpp"

namespace fpv2::detail {
namespace {

constexpr const char* kBatch = "fpv2_paged_batch_t";
constexpr const char* kIndex = "fpv2_block_index_t";
constexpr const char* kPlan = "fpv2_correction_plan_t";

bool is_power_of_two(int64_t v) { return v > 0 && (v & (v - 1)) == 0; }

long long ll(int64_t v) { return static_cast<long long>(v); }

}  // namespace

int32_t validate_batch(const fpv2_paged_batch_t* batch) {
  FPV2_RETURN_IF_ERROR(check_struct(batch, kBatch, "batch"));
  const fpv2_paged_batch_t& b = *batch;
  if (b.num_requests < 1) {
    return fail(FPV2_ERROR_INVALID_ARGUMENT,
                format("fpv2_paged_batch_t.num_requests=%d; expected >= 1 (an empty batch has nothing to do)",
                       b.num_requests));
  }
  if (b.page_size <= 0) {
    return fail(FPV2_ERROR_INVALID_ARGUMENT,
                format("fpv2_paged_batch_t.page_size=%d; expected > 0 tokens per page", b.page_size));
  }
  if (b.num_pages <= 0) {
    return fail(FPV2_ERROR_INVALID_ARGUMENT,
                format("fpv2_paged_batch_t.num_pages=%d; expected > 0 pages in the KV cache", b.num_pages));
  }
  const int64_t num_requests = b.num_requests;
  FPV2_RETURN_IF_ERROR(check_required(b.cu_seqlens_q, "fpv2_paged_batch_t.cu_seqlens_q", {FPV2_DTYPE_I32}, 1));
  FPV2_RETURN_IF_ERROR(check_shape(b.cu_seqlens_q, "fpv2_paged_batch_t.cu_seqlens_q", {num_requests + 1}, "(B+1,)"));
  FPV2_RETURN_IF_ERROR(check_contiguous(b.cu_seqlens_q, "fpv2_paged_batch_t.cu_seqlens_q"));
  FPV2_RETURN_IF_ERROR(check_required(b.seqlens_k, "fpv2_paged_batch_t.seqlens_k", {FPV2_DTYPE_I32}, 1));
  FPV2_RETURN_IF_ERROR(check_shape(b.seqlens_k, "fpv2_paged_batch_t.seqlens_k", {num_requests}, "(B,)"));
  FPV2_RETURN_IF_ERROR(check_contiguous(b.seqlens_k, "fpv2_paged_batch_t.seqlens_k"));
  FPV2_RETURN_IF_ERROR(check_required(b.page_table, "fpv2_paged_batch_t.page_table", {FPV2_DTYPE_I32}, 2));
  FPV2_RETURN_IF_ERROR(
      check_shape(b.page_table, "fpv2_paged_batch_t.page_table", {num_requests, kAnySize}, "(B, max_pages)"));
  if (numel(b.page_table) > 0 && b.page_table.strides[1] != 1) {
    return fail(FPV2_ERROR_INVALID_ARGUMENT,
                format("fpv2_paged_batch_t.page_table rows must be contiguous (stride 1 along pages); got %s",
                       describe(b.page_table).c_str()));
  }
  // Host scalars: only relations every valid batch satisfies are checked here.
  if (b.total_q < 0 || b.max_seqlen_q < 0 || b.max_seqlen_k < 0) {
    return fail(FPV2_ERROR_INVALID_ARGUMENT,
                format("fpv2_paged_batch_t lengths must be >= 0; got total_q=%lld, max_seqlen_q=%d, max_seqlen_k=%d",
                       ll(b.total_q), b.max_seqlen_q, b.max_seqlen_k));
  }
  if (b.max_seqlen_q > b.total_q || b.total_q > num_requests * b.max_seqlen_q) {
    return fail(FPV2_ERROR_INVALID_ARGUMENT,
                format("fpv2_paged_batch_t.total_q=%lld is inconsistent with max_seqlen_q=%d and num_requests=%d; "
                       "expected max_seqlen_q <= total_q <= num_requests * max_seqlen_q",
                       ll(b.total_q), b.max_seqlen_q, b.num_requests));
  }
  if (b.max_seqlen_k < b.max_seqlen_q) {
    return fail(FPV2_ERROR_INVALID_ARGUMENT,
                format("fpv2_paged_batch_t.max_seqlen_k=%d < max_seqlen_q=%d; seqlens_k counts the whole KV (prefix + "
                       "new tokens) and is >= the query length of every request",
                       b.max_seqlen_k, b.max_seqlen_q));
  }
  const int64_t pages_needed = ceil_div(b.max_seqlen_k, b.page_size);
  if (b.page_table.shape[1] < pages_needed) {
    return fail(FPV2_ERROR_INVALID_ARGUMENT,
                format("fpv2_paged_batch_t.page_table is too short: max_seqlen_k=%d at page_size=%d needs %lld pages "
                       "per request; got %s",
                       b.max_seqlen_k, b.page_size, ll(pages_needed), describe(b.page_table).c_str()));
  }
  return FPV2_OK;
}

int32_t validate_index(const fpv2_block_index_t* index, const fpv2_paged_batch_t& batch) {
  FPV2_RETURN_IF_ERROR(check_struct(index, kIndex, "index"));
  const fpv2_block_index_t& x = *index;
  if (x.num_kv_heads < 1) {
    return fail(FPV2_ERROR_INVALID_ARGUMENT,
                format("fpv2_block_index_t.num_kv_heads=%d; expected >= 1", x.num_kv_heads));
  }
  if (x.group < 1) {
    return fail(FPV2_ERROR_INVALID_ARGUMENT,
                format("fpv2_block_index_t.group=%d; expected the GQA group size Hq / Hkv >= 1", x.group));
  }
  if (x.tile_size != FPV2_KERNEL_TILE_SIZE) {
    return fail(FPV2_ERROR_INVALID_ARGUMENT,
                format("fpv2_block_index_t.tile_size=%d differs from the kernel's query tile of %d packed rows; the "
                       "index must be built with the kernel's tile size (tile_size=%d)",
                       x.tile_size, FPV2_KERNEL_TILE_SIZE, FPV2_KERNEL_TILE_SIZE));
  }
  if (!is_power_of_two(x.block_size)) {
    return fail(FPV2_ERROR_INVALID_ARGUMENT,
                format("fpv2_block_index_t.block_size=%d; expected a power of two (tokens per key block)",
                       x.block_size));
  }
  if (x.num_segments < 0) {
    return fail(FPV2_ERROR_INVALID_ARGUMENT,
                format("fpv2_block_index_t.num_segments=%lld; expected >= 0", ll(x.num_segments)));
  }
  // S = Hkv * sum_b ceil(q_len_b * g / T), and sum_b ceil(x_b) lies in
  // [ceil(sum_b x_b), floor((sum_b x_b * T + B * (T - 1)) / T)]: checkable from total_q alone.
  const int64_t num_requests = batch.num_requests;
  const __int128 rows = static_cast<__int128>(batch.total_q) * x.group;
  const __int128 tile = x.tile_size;
  const __int128 tiles_lo = (rows + tile - 1) / tile;
  const __int128 tiles_hi = (rows + static_cast<__int128>(num_requests) * (tile - 1)) / tile;
  const __int128 heads = x.num_kv_heads;
  if (x.num_segments % x.num_kv_heads != 0 || x.num_segments < tiles_lo * heads ||
      x.num_segments > tiles_hi * heads) {
    return fail(FPV2_ERROR_INVALID_ARGUMENT,
                format("fpv2_block_index_t.num_segments=%lld does not fit the batch: expected num_kv_heads (%d) * "
                       "tiles with %lld <= tiles <= %lld for total_q=%lld, num_requests=%d, group=%d, tile_size=%d",
                       ll(x.num_segments), x.num_kv_heads, ll(static_cast<int64_t>(tiles_lo)),
                       ll(static_cast<int64_t>(tiles_hi)), ll(batch.total_q), batch.num_requests, x.group,
                       x.tile_size));
  }
  FPV2_RETURN_IF_ERROR(check_required(x.offsets, "fpv2_block_index_t.offsets", {FPV2_DTYPE_I32}, 1));
  FPV2_RETURN_IF_ERROR(check_shape(x.offsets, "fpv2_block_index_t.offsets", {x.num_segments + 1}, "(S+1,)"));
  FPV2_RETURN_IF_ERROR(check_contiguous(x.offsets, "fpv2_block_index_t.offsets"));
  FPV2_RETURN_IF_ERROR(check_required(x.blocks, "fpv2_block_index_t.blocks", {FPV2_DTYPE_I32}, 1));
  FPV2_RETURN_IF_ERROR(check_contiguous(x.blocks, "fpv2_block_index_t.blocks"));
  FPV2_RETURN_IF_ERROR(check_required(x.tile_offsets, "fpv2_block_index_t.tile_offsets", {FPV2_DTYPE_I32}, 1));
  FPV2_RETURN_IF_ERROR(
      check_shape(x.tile_offsets, "fpv2_block_index_t.tile_offsets", {num_requests + 1}, "(B+1,)"));
  FPV2_RETURN_IF_ERROR(check_contiguous(x.tile_offsets, "fpv2_block_index_t.tile_offsets"));

  // A segment keeps at most the blocks visible to it, never more than ceil(max_seqlen_k / block_size).
  const __int128 max_nnz = static_cast<__int128>(x.num_segments) * ceil_div(batch.max_seqlen_k, x.block_size);
  if (x.blocks.shape[0] > max_nnz) {
    return fail(FPV2_ERROR_INVALID_ARGUMENT,
                format("fpv2_block_index_t.blocks holds %lld ids, more than num_segments=%lld segments can keep "
                       "(%lld blocks each for max_seqlen_k=%d at block_size=%d); got %s",
                       ll(x.blocks.shape[0]), ll(x.num_segments), ll(ceil_div(batch.max_seqlen_k, x.block_size)),
                       batch.max_seqlen_k, x.block_size, describe(x.blocks).c_str()));
  }
  return FPV2_OK;
}

int32_t check_plan_struct(const fpv2_correction_plan_t* plan, const char* role) {
  return check_struct(plan, kPlan, role, FPV2_CORRECTION_PLAN_SIZE_V1_1);
}

bool plan_has_e4m3(const fpv2_correction_plan_t& plan) {
  if (plan.struct_size < FPV2_CORRECTION_PLAN_SIZE_V1_2) return false;
  return !is_absent(plan.pooled_k_e4m3) || !is_absent(plan.pooled_vt_e4m3) || !is_absent(plan.e4m3_offsets) ||
         !is_absent(plan.e4m3_scales);
}

bool plan_has_key_spread(const fpv2_correction_plan_t& plan) {
  if (plan.struct_size < sizeof(fpv2_correction_plan_t)) return false;
  return !is_absent(plan.key_variance) || !is_absent(plan.key_radius);
}

namespace {

// The key spread of the second-order mass shift (fpv2.h, ABI 1.5): both tensors, one F32 value per pooled row
// and KV head.
int32_t validate_plan_key_spread(const fpv2_correction_plan_t& p) {
  if (is_absent(p.key_variance) || is_absent(p.key_radius)) {
    return fail(FPV2_ERROR_INVALID_ARGUMENT,
                format("fpv2_correction_plan_t: key_variance and key_radius come together (both present or both "
                       "absent); got key_variance %s, key_radius %s",
                       describe(p.key_variance).c_str(), describe(p.key_radius).c_str()));
  }
  const int64_t total_blocks = p.pooled_k.shape[0], hkv = p.pooled_k.shape[1];
  for (const fpv2_tensor_t* t : {&p.key_variance, &p.key_radius}) {
    const char* name =
        t == &p.key_variance ? "fpv2_correction_plan_t.key_variance" : "fpv2_correction_plan_t.key_radius";
    FPV2_RETURN_IF_ERROR(check_required(*t, name, {FPV2_DTYPE_F32}, 2));
    FPV2_RETURN_IF_ERROR(check_shape(*t, name, {total_blocks, hkv}, "pooled_k's (total_blocks, Hkv)"));
    FPV2_RETURN_IF_ERROR(check_contiguous(*t, name));
  }
  return FPV2_OK;
}

// The E4M3 copies (fpv2.h, ABI 1.2): all four tensors, shapes consistent with the F32/BF16 statistics.
int32_t validate_plan_e4m3(const fpv2_correction_plan_t& p, const fpv2_paged_batch_t& batch) {
  const fpv2_tensor_t* parts[] = {&p.pooled_k_e4m3, &p.pooled_vt_e4m3, &p.e4m3_offsets, &p.e4m3_scales};
  for (const fpv2_tensor_t* t : parts) {
    if (is_absent(*t)) {
      return fail(FPV2_ERROR_INVALID_ARGUMENT,
                  format("fpv2_correction_plan_t: the E4M3 copies come together (pooled_k_e4m3, pooled_vt_e4m3, "
                         "e4m3_offsets, e4m3_scales all present or all absent); got pooled_k_e4m3 %s, "
                         "pooled_vt_e4m3 %s, e4m3_offsets %s, e4m3_scales %s",
                         describe(p.pooled_k_e4m3).c_str(), describe(p.pooled_vt_e4m3).c_str(),
                         describe(p.e4m3_offsets).c_str(), describe(p.e4m3_scales).c_str()));
    }
  }
  const int64_t hkv = p.pooled_k.shape[1], d = p.pooled_k.shape[2];
  FPV2_RETURN_IF_ERROR(check_required(p.pooled_k_e4m3, "fpv2_correction_plan_t.pooled_k_e4m3", {FPV2_DTYPE_E4M3}, 3));
  FPV2_RETURN_IF_ERROR(check_contiguous(p.pooled_k_e4m3, "fpv2_correction_plan_t.pooled_k_e4m3"));
  const int64_t rows = p.pooled_k_e4m3.shape[0];
  FPV2_RETURN_IF_ERROR(check_shape(p.pooled_k_e4m3, "fpv2_correction_plan_t.pooled_k_e4m3", {rows, hkv, d},
                                   "(rows, Hkv, d) with pooled_k's Hkv and d"));
  if (rows % 16 != 0 || rows < p.pooled_k.shape[0]) {
    return fail(FPV2_ERROR_INVALID_ARGUMENT,
                format("fpv2_correction_plan_t.pooled_k_e4m3: rows must be a multiple of 16 and at least "
                       "total_blocks=%lld; got %s",
                       ll(p.pooled_k.shape[0]), describe(p.pooled_k_e4m3).c_str()));
  }
  FPV2_RETURN_IF_ERROR(
      check_required(p.pooled_vt_e4m3, "fpv2_correction_plan_t.pooled_vt_e4m3", {FPV2_DTYPE_E4M3}, 3));
  FPV2_RETURN_IF_ERROR(check_shape(p.pooled_vt_e4m3, "fpv2_correction_plan_t.pooled_vt_e4m3", {hkv, d, rows},
                                   "(Hkv, d, rows) with pooled_k_e4m3's rows"));
  FPV2_RETURN_IF_ERROR(check_contiguous(p.pooled_vt_e4m3, "fpv2_correction_plan_t.pooled_vt_e4m3"));
  FPV2_RETURN_IF_ERROR(check_required(p.e4m3_offsets, "fpv2_correction_plan_t.e4m3_offsets", {FPV2_DTYPE_I32}, 1));
  FPV2_RETURN_IF_ERROR(check_shape(p.e4m3_offsets, "fpv2_correction_plan_t.e4m3_offsets",
                                   {static_cast<int64_t>(batch.num_requests) + 1}, "(B+1,)"));
  FPV2_RETURN_IF_ERROR(check_contiguous(p.e4m3_offsets, "fpv2_correction_plan_t.e4m3_offsets"));
  FPV2_RETURN_IF_ERROR(check_required(p.e4m3_scales, "fpv2_correction_plan_t.e4m3_scales", {FPV2_DTYPE_F32}, 3));
  FPV2_RETURN_IF_ERROR(check_shape(p.e4m3_scales, "fpv2_correction_plan_t.e4m3_scales",
                                   {static_cast<int64_t>(batch.num_requests), hkv, 2}, "(B, Hkv, 2)"));
  FPV2_RETURN_IF_ERROR(check_contiguous(p.e4m3_scales, "fpv2_correction_plan_t.e4m3_scales"));
  return FPV2_OK;
}

}  // namespace

int32_t validate_plan(const fpv2_correction_plan_t* plan, const fpv2_paged_batch_t& batch) {
  FPV2_RETURN_IF_ERROR(check_plan_struct(plan, "correction"));
  const fpv2_correction_plan_t& p = *plan;
  if (p.chunk_size != FPV2_CORRECTION_CHUNK) {
    return fail(FPV2_ERROR_INVALID_ARGUMENT,
                format("fpv2_correction_plan_t.chunk_size=%d; expected %d (one 64-bit todo word per chunk)",
                       p.chunk_size, FPV2_CORRECTION_CHUNK));
  }
  if (!is_power_of_two(p.block_size)) {
    return fail(FPV2_ERROR_INVALID_ARGUMENT,
                format("fpv2_correction_plan_t.block_size=%d; expected a power of two", p.block_size));
  }
  FPV2_RETURN_IF_ERROR(
      check_required(p.pooled_k, "fpv2_correction_plan_t.pooled_k", {FPV2_DTYPE_F32, FPV2_DTYPE_BF16}, 3));
  FPV2_RETURN_IF_ERROR(check_contiguous(p.pooled_k, "fpv2_correction_plan_t.pooled_k"));
  const int64_t total_blocks = p.pooled_k.shape[0];
  FPV2_RETURN_IF_ERROR(check_required(p.pooled_v, "fpv2_correction_plan_t.pooled_v", {p.pooled_k.dtype}, 3));
  FPV2_RETURN_IF_ERROR(check_shape(p.pooled_v, "fpv2_correction_plan_t.pooled_v",
                                   {total_blocks, p.pooled_k.shape[1], p.pooled_k.shape[2]},
                                   "pooled_k's (total_blocks, Hkv, d)"));
  FPV2_RETURN_IF_ERROR(check_contiguous(p.pooled_v, "fpv2_correction_plan_t.pooled_v"));
  FPV2_RETURN_IF_ERROR(
      check_required(p.block_lengths, "fpv2_correction_plan_t.block_lengths", {FPV2_DTYPE_I32}, 1));
  FPV2_RETURN_IF_ERROR(
      check_shape(p.block_lengths, "fpv2_correction_plan_t.block_lengths", {total_blocks}, "(total_blocks,)"));
  FPV2_RETURN_IF_ERROR(check_contiguous(p.block_lengths, "fpv2_correction_plan_t.block_lengths"));
  FPV2_RETURN_IF_ERROR(
      check_required(p.block_offsets, "fpv2_correction_plan_t.block_offsets", {FPV2_DTYPE_I32}, 1));
  FPV2_RETURN_IF_ERROR(check_shape(p.block_offsets, "fpv2_correction_plan_t.block_offsets",
                                   {static_cast<int64_t>(batch.num_requests) + 1}, "(B+1,)"));
  FPV2_RETURN_IF_ERROR(check_contiguous(p.block_offsets, "fpv2_correction_plan_t.block_offsets"));
  // The longest request alone owns ceil(max_seqlen_k / block_size) pooled rows.
  const int64_t longest = ceil_div(batch.max_seqlen_k, p.block_size);
  if (total_blocks < longest) {
    return fail(FPV2_ERROR_INVALID_ARGUMENT,
                format("fpv2_correction_plan_t.pooled_k has %lld blocks, fewer than the %lld blocks of the longest "
                       "request (max_seqlen_k=%d, block_size=%d); got %s",
                       ll(total_blocks), ll(longest), batch.max_seqlen_k, p.block_size,
                       describe(p.pooled_k).c_str()));
  }
  if (is_absent(p.todo_offsets) != is_absent(p.todo_masks)) {
    return fail(FPV2_ERROR_INVALID_ARGUMENT,
                format("fpv2_correction_plan_t.todo_offsets and todo_masks come together (both present or both "
                       "absent); got todo_offsets %s, todo_masks %s",
                       describe(p.todo_offsets).c_str(), describe(p.todo_masks).c_str()));
  }
  if (!is_absent(p.todo_offsets)) {
    FPV2_RETURN_IF_ERROR(
        check_required(p.todo_offsets, "fpv2_correction_plan_t.todo_offsets", {FPV2_DTYPE_I32}, 1));
    FPV2_RETURN_IF_ERROR(check_contiguous(p.todo_offsets, "fpv2_correction_plan_t.todo_offsets"));
    if (p.todo_offsets.shape[0] < 1) {
      return fail(FPV2_ERROR_INVALID_ARGUMENT,
                  format("fpv2_correction_plan_t.todo_offsets must hold S+1 >= 1 offsets; got %s",
                         describe(p.todo_offsets).c_str()));
    }
    FPV2_RETURN_IF_ERROR(check_required(p.todo_masks, "fpv2_correction_plan_t.todo_masks", {FPV2_DTYPE_I64}, 1));
    FPV2_RETURN_IF_ERROR(check_contiguous(p.todo_masks, "fpv2_correction_plan_t.todo_masks"));
  }
  if (plan_has_e4m3(p)) {
    FPV2_RETURN_IF_ERROR(validate_plan_e4m3(p, batch));
  }
  if (plan_has_key_spread(p)) {
    FPV2_RETURN_IF_ERROR(validate_plan_key_spread(p));
  }
  return FPV2_OK;
}

}  // namespace fpv2::detail

extern "C" {

FPV2_API int32_t fpv2_validate_paged_batch(const fpv2_paged_batch_t* batch) {
  return fpv2::detail::guarded("fpv2_validate_paged_batch", [&] { return fpv2::detail::validate_batch(batch); });
}

FPV2_API int32_t fpv2_validate_block_index(const fpv2_block_index_t* index, const fpv2_paged_batch_t* batch) {
  return fpv2::detail::guarded("fpv2_validate_block_index", [&] {
    FPV2_RETURN_IF_ERROR(fpv2::detail::validate_batch(batch));
    return fpv2::detail::validate_index(index, *batch);
  });
}

FPV2_API int32_t fpv2_validate_correction_plan(const fpv2_correction_plan_t* plan, const fpv2_paged_batch_t* batch) {
  return fpv2::detail::guarded("fpv2_validate_correction_plan", [&] {
    FPV2_RETURN_IF_ERROR(fpv2::detail::validate_batch(batch));
    return fpv2::detail::validate_plan(plan, *batch);
  });
}

}  // extern "C"
