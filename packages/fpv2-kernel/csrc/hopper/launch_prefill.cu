// Host launcher of the Hopper prefill kernel: refuses, with a message, every configuration the
// compiled instantiations cannot serve, turns the ABI arguments into a PrefillPlan and dispatches
// on the head dim. Host code only: the kernel and CuTe live in the instantiation files.
#include "hopper/launch_prefill.hpp"

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <string>
#include <limits>

#include "abi/device_guard.hpp"
#include "abi/errors.hpp"
#include "hopper/prefill_instances.hpp"
#include "hopper/prefill_plan.hpp"
#include "hopper/schedule_default.hpp"
#include "hopper/split_kv.hpp"
#include "hopper/tile_queue.hpp"
#include "hopper/work_order.hpp"
#include "validate/struct_checks.hpp"
#include "validate/tensor_checks.hpp"

namespace fpv2::hopper {
namespace {

using fpv2::detail::DeviceGuard;
using fpv2::detail::check_hopper_device;

using fpv2::detail::describe;
using fpv2::detail::dtype_name;
using fpv2::detail::fail;
using fpv2::detail::format;
using fpv2::detail::is_absent;

constexpr int kKvTile = 128;         // tokens per TMA tile of K and V
constexpr int64_t kChunkElems = 8;   // 16 bytes of bf16: cp.async and TMA granularity

long long ll(int64_t v) { return static_cast<long long>(v); }

bool aligned(const void* p, uintptr_t bytes) { return (reinterpret_cast<uintptr_t>(p) % bytes) == 0; }

// The cache must be the stack of its pages: (num_pages, page_size, Hkv, d) with page stride =
// page_size * token stride and head stride = d, so that it reads as one (num_pages * page_size, Hkv * d)
// matrix with row stride = token stride (the TMA view).
int32_t check_cache_view(const fpv2_tensor_t& cache, const char* name, int64_t page_size, int64_t num_kv_heads,
                         int64_t head_dim) {
  const int64_t token_stride = cache.strides[1];
  if (cache.strides[2] != head_dim || cache.strides[0] != page_size * token_stride ||
      token_stride < num_kv_heads * head_dim) {
    return fail(FPV2_ERROR_UNSUPPORTED,
                format("%s: the Hopper kernel reads the cache as one (num_pages * page_size, Hkv * d) "
                       "row-major matrix, which needs head stride d=%lld, token stride >= Hkv * d = %lld and page "
                       "stride = page_size * token stride = %lld; got %s",
                       name, ll(head_dim), ll(num_kv_heads * head_dim), ll(page_size * token_stride),
                       describe(cache).c_str()));
  }
  if (!aligned(cache.data, 16) || token_stride % kChunkElems != 0) {
    return fail(FPV2_ERROR_INVALID_ARGUMENT,
                format("%s: TMA needs a 16-byte aligned base and a token stride that is a multiple of 16 bytes "
                       "(%lld bf16); got data=%p, %s",
                       name, ll(kChunkElems), cache.data, describe(cache).c_str()));
  }
  const int64_t rows = int64_t(cache.shape[0]) * page_size;
  if (rows > std::numeric_limits<int32_t>::max() || token_stride * 2 >= (int64_t(1) << 40)) {
    return fail(FPV2_ERROR_UNSUPPORTED,
                format("%s: num_pages * page_size = %lld rows (at most 2^31 - 1) and a token stride of %lld bytes "
                       "(below 2^40) are the TMA view's limits; got %s",
                       name, ll(rows), ll(token_stride * 2), describe(cache).c_str()));
  }
  return FPV2_OK;
}

// The correction's pooled K/V are read by TMA as bf16 (total_blocks, Hkv * d) rows; the todo masks, when
// given, are not read: the kernel derives the same bits from the block index (fpv2.h).
int32_t check_pooled_statistics(const fpv2_correction_plan_t& plan, const fpv2_paged_batch_t& batch, int64_t head_dim) {
  if (fpv2::detail::plan_has_e4m3(plan) && prefill_kv_tile(static_cast<int>(head_dim)) != kKvTile) {
    return fail(FPV2_ERROR_UNSUPPORTED,
                format("fpv2_correction_plan_t.pooled_k_e4m3: the Hopper kernel's FP8 correction is built for "
                       "128-token KV tiles, not for the %d-token tiles of head dim d=%lld: pass the bf16 pooled "
                       "statistics without the E4M3 copies",
                       prefill_kv_tile(static_cast<int>(head_dim)), ll(head_dim)));
  }
  if (fpv2::detail::plan_has_e4m3(plan)) {
    // The FP8 correction reads only the E4M3 copies (by TMA): pooled_k/pooled_v may stay float32.
    for (const fpv2_tensor_t* t : {&plan.pooled_k_e4m3, &plan.pooled_vt_e4m3}) {
      const char* name = t == &plan.pooled_k_e4m3 ? "fpv2_correction_plan_t.pooled_k_e4m3"
                                                  : "fpv2_correction_plan_t.pooled_vt_e4m3";
      if (!aligned(t->data, 16)) {
        return fail(FPV2_ERROR_INVALID_ARGUMENT, format("%s: TMA needs a 16-byte aligned base; got data=%p (%s)",
                                                        name, t->data, describe(*t).c_str()));
      }
    }
    if (plan.pooled_k_e4m3.shape[0] > std::numeric_limits<int32_t>::max()) {
      return fail(FPV2_ERROR_UNSUPPORTED, format("fpv2_correction_plan_t.pooled_k_e4m3: more than 2^31 - 1 rows (%s)",
                                                 describe(plan.pooled_k_e4m3).c_str()));
    }
    if (batch.page_size % kKvTile != 0) {
      return fail(FPV2_ERROR_UNSUPPORTED,
                  format("fpv2_correction_plan_t.pooled_k_e4m3: the Hopper kernel's FP8 correction runs on the TMA "
                         "path only (page_size a multiple of %d); got page_size=%d: pass the bf16 pooled "
                         "statistics without the E4M3 copies",
                         kKvTile, batch.page_size));
    }
  }
  const bool reads_bf16 = !fpv2::detail::plan_has_e4m3(plan);
  for (const fpv2_tensor_t* t : {&plan.pooled_k, &plan.pooled_v}) {
    if (!reads_bf16) continue;
    const char* name = t == &plan.pooled_k ? "fpv2_correction_plan_t.pooled_k" : "fpv2_correction_plan_t.pooled_v";
    if (t->dtype != FPV2_DTYPE_BF16) {
      return fail(FPV2_ERROR_UNSUPPORTED,
                  format("%s: the Hopper kernel loads the pooled statistics as bf16 tiles; got dtype %s "
                         "(convert the float32 statistics to bfloat16 first) (%s)",
                         name, dtype_name(t->dtype).c_str(), describe(*t).c_str()));
    }
    if (!aligned(t->data, 16)) {
      return fail(FPV2_ERROR_INVALID_ARGUMENT,
                  format("%s: TMA needs a 16-byte aligned base; got data=%p (%s)", name, t->data, describe(*t).c_str()));
    }
    if (t->shape[0] > std::numeric_limits<int32_t>::max()) {
      return fail(FPV2_ERROR_UNSUPPORTED, format("%s: more than 2^31 - 1 pooled rows (%s)", name, describe(*t).c_str()));
    }
  }
  if (plan.block_size != kKvTile) {
    return fail(FPV2_ERROR_UNSUPPORTED,
                format("fpv2_correction_plan_t.block_size=%d: the Hopper kernel pools 128-token blocks", plan.block_size));
  }
  const bool second_order = fpv2::detail::plan_has_key_spread(plan);
  const int max_blocks = second_order ? max_second_order_blocks(static_cast<int>(head_dim))
                                      : max_correction_blocks(static_cast<int>(head_dim));
  if (int64_t(batch.max_seqlen_k) > int64_t(max_blocks) * kKvTile) {
    return fail(FPV2_ERROR_UNSUPPORTED,
                format("fpv2_paged_batch_t.max_seqlen_k=%d: the Hopper kernel's %s marks at most %d blocks (%lld "
                       "tokens) per request at head dim d=%lld%s",
                       batch.max_seqlen_k, second_order ? "second-order mass shift" : "mean correction", max_blocks,
                       ll(int64_t(max_blocks) * kKvTile), ll(head_dim),
                       second_order ? " (its key spread takes half the shift table): drop key_variance / key_radius "
                                      "for the mean correction"
                                    : ""));
  }
  return FPV2_OK;
}

// FPV2_HOPPER_GATHER names the cp.async gather layout for pages that are not a multiple of 128; one is built,
// "quads" (four lanes per token row). The layouts "row", "shared", "warp" and "pairs" were measured slower than
// it on the H200 and removed (benchmarks/NOTES.md, 2026-12-03): naming one is refused, not silently run as
// "quads".
int32_t check_gather_layout_from_environment() {
  const char* value = std::getenv("FPV2_HOPPER_GATHER");
  if (value == nullptr || *value == '\0' || std::strcmp(value, "quads") == 0) return FPV2_OK;
  const bool removed = std::strcmp(value, "row") == 0 || std::strcmp(value, "shared") == 0 ||
                       std::strcmp(value, "warp") == 0 || std::strcmp(value, "pairs") == 0;
  return fail(FPV2_ERROR_INVALID_ARGUMENT,
              format("environment FPV2_HOPPER_GATHER=%s: expected \"quads\" (the only gather layout%s)", value,
                     removed ? "; \"row\", \"shared\", \"warp\" and \"pairs\" measured slower and were removed"
                             : ""));
}

// An on/off kernel variant from the environment (FPV2_HOPPER_PINGPONG, FPV2_HOPPER_PERSISTENT,
// FPV2_HOPPER_OVERLAP, FPV2_HOPPER_REQUEST_MAJOR): unset or "" is `default_on`, "0" is off, "1" is on; kept
// for A/B runs on the device (measured: NOTES.md, 2026-12-01).
int32_t switch_from_environment(const char* name, int32_t default_on, int32_t* on) {
  const char* value = std::getenv(name);
  if (value == nullptr || *value == '\0') {
    *on = default_on;
    return FPV2_OK;
  }
  if (std::strcmp(value, "0") == 0) {
    *on = 0;
    return FPV2_OK;
  }
  if (std::strcmp(value, "1") == 0) {
    *on = 1;
    return FPV2_OK;
  }
  return fail(FPV2_ERROR_INVALID_ARGUMENT,
              format("environment %s=%s: expected 0 or 1 (unset: %d)", name, value, default_on));
}

// FPV2_HOPPER_PERSISTENT: "0" one CTA per tile, "1" persistent CTAs in the static snake order
// (persistent_order.hpp), "dynamic" persistent CTAs fed by the tile queue (tile_queue.hpp); unset or "" is 0
// until choose_default_schedule applies schedule_default.hpp's rule.
int32_t persistent_from_environment(int32_t* persistent) {
  const char* value = std::getenv("FPV2_HOPPER_PERSISTENT");
  const std::string setting = value != nullptr ? value : "";
  if (setting == "" || setting == "0") {
    *persistent = 0;
  } else if (setting == "1") {
    *persistent = 1;
  } else if (setting == "dynamic") {
    *persistent = 2;
  } else {
    return fail(FPV2_ERROR_INVALID_ARGUMENT,
                format("environment FPV2_HOPPER_PERSISTENT=%s: expected 0, 1 or dynamic (unset: the tile queue for "
                       "long block-sparse requests, else one CTA per tile)",
                       value));
  }
  return FPV2_OK;
}


}  // namespace

namespace {

// FPV2_HOPPER_SPLITS: unset or "" chooses the split-KV count automatically (split_kv.hpp), N in 1 ..
// kMaxKvSplits forces N (1: no split) for tests and A/B runs.
int32_t splits_from_environment(int32_t* forced) {
  const char* value = std::getenv("FPV2_HOPPER_SPLITS");
  *forced = 0;
  if (value == nullptr || *value == '\0') return FPV2_OK;
  char* end = nullptr;
  const long n = std::strtol(value, &end, 10);
  if (end == value || *end != '\0' || n < 1 || n > kMaxKvSplits) {
    return fail(FPV2_ERROR_INVALID_ARGUMENT,
                format("environment FPV2_HOPPER_SPLITS=%s: expected an integer in 1..%d (unset: automatic)", value,
                       kMaxKvSplits));
  }
  *forced = static_cast<int32_t>(n);
  return FPV2_OK;
}

// Query tiles x KV heads x requests of the plan: one CTA each without split-KV (the grid of prefill_launch.hpp).
int64_t plan_query_tiles(const PrefillPlan& plan) {
  return (int64_t(plan.max_seqlen_q) * plan.group + FPV2_KERNEL_TILE_SIZE - 1) / FPV2_KERNEL_TILE_SIZE *
         plan.num_kv_heads * plan.num_requests;
}

int32_t sm_count(int device, int* sms) {
  const cudaError_t err = cudaDeviceGetAttribute(sms, cudaDevAttrMultiProcessorCount, device);
  if (err != cudaSuccess) {
    return fail(FPV2_ERROR_CUDA, format("fpv2 Hopper prefill: cannot query the SM count: %s", cudaGetErrorString(err)));
  }
  return FPV2_OK;
}

// Whether the call runs persistent CTAs: asked for, on the TMA path (pages that need the gather run one CTA
// per tile; prefill_launch.hpp applies the same rule).
bool runs_persistent(const PrefillPlan& plan) {
  return plan.persistent != 0 && plan.page_size % prefill_kv_tile(plan.head_dim) == 0;
}

// Whether the caller's workspace holds `need` bytes at kWorkspaceAlignment (what an automatic choice needs to
// switch itself on; forced ones are refused with a message instead).
bool workspace_holds(const PrefillPlan& plan, uint64_t need) {
  return plan.workspace != nullptr && plan.workspace_bytes >= need &&
         reinterpret_cast<uintptr_t>(plan.workspace) % kWorkspaceAlignment == 0;
}

// The refusal of a workspace that is not kWorkspaceAlignment-aligned, naming what needs it; FPV2_OK if aligned.
int32_t check_workspace_alignment(const PrefillPlan& plan, const char* user) {
  if (reinterpret_cast<uintptr_t>(plan.workspace) % kWorkspaceAlignment == 0) return FPV2_OK;
  return fail(FPV2_ERROR_INVALID_ARGUMENT,
              format("fpv2_prefill_args_t.workspace=%p: %s needs a %llu-byte aligned workspace", plan.workspace,
                     user, static_cast<unsigned long long>(kWorkspaceAlignment)));
}

// Sets plan.num_splits (split_kv.hpp). Splits serve the overlapped consumers, one CTA per tile, with bf16
// pooled statistics (not the persistent CTAs, FPV2_HOPPER_OVERLAP=0 or the FP8 correction); automatic ones need the workspace they fill (else none: the
// same result from one CTA per tile), forced ones are refused without it. `sizing`: choose as if the
// workspace were unbounded (fpv2_prefill_workspace_size).
int32_t choose_kv_splits(PrefillPlan& plan, bool sizing = false) {
  int32_t forced = 0;
  FPV2_RETURN_IF_ERROR(splits_from_environment(&forced));
  plan.num_splits = 1;
  // The split-KV instantiation is the overlapped consumers' (the default), one CTA per tile.
  if (runs_persistent(plan) || !plan.overlap || plan.pooled_k_e4m3 != nullptr || forced == 1) return FPV2_OK;
  const int64_t num_ctas = plan_query_tiles(plan);
  int splits = forced;
  if (splits == 0) splits = auto_kv_splits(num_ctas, plan.sm_count, plan.max_seqlen_k);
  if (splits <= 1) return FPV2_OK;
  const int64_t num_q_heads = int64_t(plan.num_kv_heads) * plan.group;
  const uint64_t need = split_workspace_bytes(plan.total_q, num_q_heads, plan.head_dim, splits);
  if (sizing) {
    plan.num_splits = splits;
    return FPV2_OK;
  }
  if (plan.workspace_bytes < need || plan.workspace == nullptr) {
    if (forced == 0) return FPV2_OK;
    return fail(FPV2_ERROR_WORKSPACE_TOO_SMALL,
                format("environment FPV2_HOPPER_SPLITS=%d: %d KV splits need %llu bytes of workspace "
                       "(fpv2_prefill_workspace_size); got fpv2_prefill_args_t.workspace_bytes=%llu",
                       splits, splits, static_cast<unsigned long long>(need),
                       static_cast<unsigned long long>(plan.workspace_bytes)));
  }
  FPV2_RETURN_IF_ERROR(check_workspace_alignment(plan, "split-KV"));
  plan.num_splits = splits;
  return FPV2_OK;
}

// Workspace of the dynamic tile queue's counter (tile_queue.hpp): persistent CTAs (TMA path) with
// FPV2_HOPPER_PERSISTENT=dynamic; it comes first in the workspace, before the work order's.
uint64_t tile_queue_bytes(const PrefillPlan& plan) {
  return plan.persistent == 2 && runs_persistent(plan) ? tile_queue_workspace_bytes() : 0;
}

// Refuses a dynamic tile queue without its workspace (after choose_work_order, whose bytes follow it).
int32_t check_tile_queue_workspace(const PrefillPlan& plan) {
  const uint64_t queue = tile_queue_bytes(plan);
  if (queue == 0) return FPV2_OK;
  const uint64_t need = queue + (plan.work_order ? work_order_workspace_bytes(plan_query_tiles(plan)) : 0);
  if (plan.workspace == nullptr || plan.workspace_bytes < need) {
    return fail(FPV2_ERROR_WORKSPACE_TOO_SMALL,
                format("environment FPV2_HOPPER_PERSISTENT=dynamic: the tile queue needs %llu bytes of workspace "
                       "(fpv2_prefill_workspace_size); got fpv2_prefill_args_t.workspace_bytes=%llu",
                       static_cast<unsigned long long>(need), static_cast<unsigned long long>(plan.workspace_bytes)));
  }
  return check_workspace_alignment(plan, "the tile queue");
}

// Sets plan.work_order (work_order.hpp) for a call that does not split, after choose_kv_splits.
// FPV2_HOPPER_WORK_ORDER: "0" off; unset or "" off here, then choose_default_schedule may switch it on
// (schedule_default.hpp: chunks after cached prefixes, long requests; the 2026-12-02 kernel measured it 3-11%
// slower on uneven fresh batches, NOTES.md); "1" forces it, "auto" applies the automatic rule: on for more tiles than SMs in a batch whose requests
// may differ in work (several requests whose query lengths differ or that have cached prefixes: the
// decoded order then puts a heavy request's tiles wherever the request sits in the batch); off at B = 1 and
// for equal fresh requests, where the decoded order already starts each request's longest tiles first.
// "auto" needs the workspace (else off: the same result in the decoded order); "1" is refused without it.
// `sizing`: as if the workspace were unbounded.
int32_t choose_work_order(PrefillPlan& plan, bool sizing = false) {
  plan.work_order = 0;
  const char* value = std::getenv("FPV2_HOPPER_WORK_ORDER");
  const std::string setting = value != nullptr ? value : "";
  if (setting != "" && setting != "0" && setting != "1" && setting != "auto") {
    return fail(FPV2_ERROR_INVALID_ARGUMENT,
                format("environment FPV2_HOPPER_WORK_ORDER=%s: expected 0, 1 or auto (unset: the default "
                       "schedule, schedule_default.hpp)",
                       value));
  }
  const bool forced = setting == "1";
  if (plan.num_splits > 1 || (!forced && setting != "auto")) return FPV2_OK;
  const int64_t num_tiles = plan_query_tiles(plan);
  if (!forced) {
    const bool uneven = plan.num_requests > 1 && (plan.total_q != int64_t(plan.num_requests) * plan.max_seqlen_q ||
                                                 plan.max_seqlen_k > plan.max_seqlen_q);
    if (!uneven) return FPV2_OK;
    if (num_tiles <= plan.sm_count) return FPV2_OK;  // one wave: the order cannot change when a tile starts
  }
  const uint64_t need = tile_queue_bytes(plan) + work_order_workspace_bytes(num_tiles);
  if (sizing) {
    plan.work_order = 1;
    return FPV2_OK;
  }
  if (!forced) {
    if (workspace_holds(plan, need)) plan.work_order = 1;
    return FPV2_OK;
  }
  if (plan.workspace == nullptr || plan.workspace_bytes < need) {
    return fail(FPV2_ERROR_WORKSPACE_TOO_SMALL,
                format("environment FPV2_HOPPER_WORK_ORDER=1: the work order of %lld tiles needs %llu bytes of "
                       "workspace (fpv2_prefill_workspace_size); got fpv2_prefill_args_t.workspace_bytes=%llu",
                       ll(num_tiles), static_cast<unsigned long long>(need),
                       static_cast<unsigned long long>(plan.workspace_bytes)));
  }
  FPV2_RETURN_IF_ERROR(check_workspace_alignment(plan, "the work order"));
  plan.work_order = 1;
  return FPV2_OK;
}

// FPV2_HOPPER_PERSISTENT and FPV2_HOPPER_WORK_ORDER both unset (or ""): schedule_default.hpp's choice, when the
// workspace holds what it needs (`sizing`: as if it did), else the decoded order (the same result). Runs after
// choose_kv_splits and choose_work_order; a call that splits keeps its split.
int32_t choose_default_schedule(PrefillPlan& plan, bool sizing = false) {
  for (const char* name : {"FPV2_HOPPER_PERSISTENT", "FPV2_HOPPER_WORK_ORDER"}) {
    const char* value = std::getenv(name);
    if (value != nullptr && *value != '\0') return FPV2_OK;
  }
  if (plan.num_splits > 1) return FPV2_OK;
  const int64_t num_tiles = plan_query_tiles(plan);
  const DefaultSchedule schedule = default_schedule(plan, num_tiles / plan.num_requests, num_tiles, plan.sm_count);
  if (schedule == DefaultSchedule::kDecodedOrder) return FPV2_OK;
  const bool queue = schedule == DefaultSchedule::kTileQueueInWorkOrder;
  const uint64_t need = (queue ? tile_queue_workspace_bytes() : 0) + work_order_workspace_bytes(num_tiles);
  if (!sizing && !workspace_holds(plan, need)) return FPV2_OK;
  plan.work_order = 1;
  if (queue) plan.persistent = 2;
  return FPV2_OK;
}

// Checks `args` against what the kernel serves and fills `plan` (without the splits); `guard` selects the
// call's device.
int32_t plan_prefill(const fpv2_prefill_args_t& args, DeviceGuard& guard, PrefillPlan& plan) {
  if (args.batch == nullptr) {
    return fail(FPV2_ERROR_INVALID_ARGUMENT, "fpv2_prefill_args_t.batch is NULL (validate the arguments first)");
  }
  const fpv2_paged_batch_t& batch = *args.batch;
  if (args.index != nullptr && args.index->block_size != kKvTile) {
    return fail(FPV2_ERROR_UNSUPPORTED,
                format("fpv2_block_index_t.block_size=%d: the Hopper kernel visits 128-token KV blocks and needs "
                       "block_size 128",
                       args.index->block_size));
  }
  const fpv2_tensor_t& q = args.q;
  if (q.dtype != FPV2_DTYPE_BF16) {
    return fail(FPV2_ERROR_UNSUPPORTED,
                format("fpv2_prefill_args_t.q: the Hopper kernel of this build takes bf16 only (f16 and "
                       "float8_e4m3fn come later); got dtype %s (%s)",
                       dtype_name(q.dtype).c_str(), describe(q).c_str()));
  }
  const int64_t head_dim = q.shape[2];
  if (!prefill_head_dim_built(static_cast<int>(head_dim))) {
    return fail(FPV2_ERROR_UNSUPPORTED,
                format("fpv2_prefill_args_t.q: head dim d=%lld has no compiled Hopper instantiation in this "
                       "build (built: d=%s); got %s",
                       ll(head_dim), prefill_head_dims_text().c_str(), describe(q).c_str()));
  }
  if (args.correction != nullptr) {
    FPV2_RETURN_IF_ERROR(check_pooled_statistics(*args.correction, batch, head_dim));
  }
  const int64_t num_q_heads = q.shape[1];
  const int64_t num_kv_heads = args.k_cache.shape[2];
  const int64_t group = num_q_heads / num_kv_heads;
  FPV2_RETURN_IF_ERROR(
      check_cache_view(args.k_cache, "fpv2_prefill_args_t.k_cache", batch.page_size, num_kv_heads, head_dim));
  FPV2_RETURN_IF_ERROR(
      check_cache_view(args.v_cache, "fpv2_prefill_args_t.v_cache", batch.page_size, num_kv_heads, head_dim));
  if (!aligned(q.data, 16) || q.strides[0] % kChunkElems != 0 || q.strides[1] % kChunkElems != 0) {
    return fail(FPV2_ERROR_INVALID_ARGUMENT,
                format("fpv2_prefill_args_t.q: the kernel gathers 16-byte chunks of query rows and needs a 16-byte "
                       "aligned base and token/head strides that are multiples of 8 elements; got data=%p, %s",
                       q.data, describe(q).c_str()));
  }
  const fpv2_tensor_t& out = args.out;
  if (!aligned(out.data, 4) || out.strides[0] % 2 != 0 || out.strides[1] % 2 != 0) {
    return fail(FPV2_ERROR_INVALID_ARGUMENT,
                format("fpv2_prefill_args_t.out: the kernel stores pairs of bf16 and needs a 4-byte aligned base and "
                       "even token/head strides; got data=%p, %s",
                       out.data, describe(out).c_str()));
  }
  if (int64_t(batch.max_seqlen_q) * group >= std::numeric_limits<int32_t>::max() - 128) {
    return fail(FPV2_ERROR_UNSUPPORTED,
                format("fpv2 Hopper prefill: max_seqlen_q * (Hq / Hkv) = %lld packed rows exceed the kernel's "
                       "32-bit row index",
                       ll(int64_t(batch.max_seqlen_q) * group)));
  }

  FPV2_RETURN_IF_ERROR(check_gather_layout_from_environment());
  int32_t pingpong = 0, persistent = 0, overlap = 0;
  FPV2_RETURN_IF_ERROR(switch_from_environment("FPV2_HOPPER_PINGPONG", 0, &pingpong));
  FPV2_RETURN_IF_ERROR(persistent_from_environment(&persistent));
  // Overlapped consumers by default (page 128, B=1: dense 32K -13%, sparse 32K -4% / 128K -10%, corrected
  // -1% / -3%; 4 x 128K -2 to -4%; NOTES.md). They are their own instantiations (one CTA per tile, or
  // persistent), without the pingpong turn barriers: asking for pingpong turns the default off, and asking
  // for both explicitly is refused rather than half-served.
  const char* overlap_setting = std::getenv("FPV2_HOPPER_OVERLAP");
  const bool overlap_explicit = overlap_setting != nullptr && *overlap_setting != '\0';
  FPV2_RETURN_IF_ERROR(switch_from_environment("FPV2_HOPPER_OVERLAP", !pingpong, &overlap));
  if (overlap_explicit && overlap && pingpong) {
    return fail(FPV2_ERROR_INVALID_ARGUMENT,
                "environment FPV2_HOPPER_OVERLAP=1 cannot be combined with FPV2_HOPPER_PINGPONG=1");
  }
  if (persistent == 2 && !overlap) {
    return fail(FPV2_ERROR_INVALID_ARGUMENT,
                "environment FPV2_HOPPER_PERSISTENT=dynamic: the tile queue is built for the overlapped consumers; "
                "unset FPV2_HOPPER_OVERLAP=0 / FPV2_HOPPER_PINGPONG=1, or use FPV2_HOPPER_PERSISTENT=1");
  }
  if (args.correction != nullptr && fpv2::detail::plan_has_e4m3(*args.correction) && (!overlap || persistent)) {
    return fail(FPV2_ERROR_UNSUPPORTED,
                "fpv2_correction_plan_t.pooled_k_e4m3: the FP8 correction is built into the overlapped consumers "
                "only; unset FPV2_HOPPER_OVERLAP=0 / FPV2_HOPPER_PERSISTENT / FPV2_HOPPER_PINGPONG=1, or pass "
                "the bf16 pooled statistics without the E4M3 copies");
  }
  if (args.correction != nullptr && fpv2::detail::plan_has_key_spread(*args.correction) && (!overlap || persistent)) {
    return fail(FPV2_ERROR_UNSUPPORTED,
                "fpv2_correction_plan_t.key_variance: the second-order mass shift is built into the overlapped "
                "consumers with one CTA per tile only; unset FPV2_HOPPER_OVERLAP=0 / FPV2_HOPPER_PERSISTENT / "
                "FPV2_HOPPER_PINGPONG=1, or drop the key spread (mean correction)");
  }
  // Request-major tile order by default: 4 x 128K dense 1269 -> 1027 ms, sparse + correction 59.2 -> 56.2 ms.
  int32_t request_major = 0;
  FPV2_RETURN_IF_ERROR(switch_from_environment("FPV2_HOPPER_REQUEST_MAJOR", 1, &request_major));
  int32_t pooled_half_exp = 0;
  FPV2_RETURN_IF_ERROR(switch_from_environment("FPV2_HOPPER_POOLED_HALF_EXP", 0, &pooled_half_exp));
  // Head-major tile order by default (2026-12-01, page 128, A/B pairs): sparse 128K on a random CSR 9.09 -> 8.61
  // and 9.39 -> 7.91 ms, corrected 12.49 -> 10.86 and 12.48 -> 10.86 ms; dense 128K 2-3% faster (B = 1 and
  // B = 4); the planted pipeline unchanged within noise (128K attention 11.56 / 11.71 -> 11.82 / 11.64 ms,
  // 4 x 128K 51.49 -> 50.83 ms). FPV2_HOPPER_HEAD_MAJOR=0 restores the order of FPV2_HOPPER_REQUEST_MAJOR.
  int32_t head_major = 0;
  FPV2_RETURN_IF_ERROR(switch_from_environment("FPV2_HOPPER_HEAD_MAJOR", 1, &head_major));

  FPV2_RETURN_IF_ERROR(guard.select(args.device, "fpv2 Hopper prefill"));
  FPV2_RETURN_IF_ERROR(check_hopper_device(guard.device(), "fpv2 Hopper prefill"));

  plan = PrefillPlan{};
  FPV2_RETURN_IF_ERROR(sm_count(guard.device(), &plan.sm_count));
  plan.num_splits = 1;
  plan.workspace = args.workspace;
  plan.workspace_bytes = args.workspace_bytes;
  plan.total_q = batch.total_q;
  plan.max_seqlen_k = batch.max_seqlen_k;
  plan.q = q.data;
  plan.q_token_stride = q.strides[0];
  plan.q_head_stride = q.strides[1];
  plan.out = const_cast<void*>(out.data);
  plan.out_token_stride = out.strides[0];
  plan.out_head_stride = out.strides[1];
  if (!is_absent(args.lse)) {
    plan.lse = static_cast<float*>(const_cast<void*>(args.lse.data));
    plan.lse_token_stride = args.lse.strides[0];
    plan.lse_head_stride = args.lse.strides[1];
  }
  plan.k_cache = args.k_cache.data;
  plan.v_cache = args.v_cache.data;
  plan.k_token_stride = args.k_cache.strides[1];
  plan.v_token_stride = args.v_cache.strides[1];
  plan.cache_rows = static_cast<int32_t>(int64_t(batch.num_pages) * batch.page_size);
  plan.cache_cols = static_cast<int32_t>(num_kv_heads * head_dim);
  plan.cu_seqlens_q = static_cast<const int32_t*>(batch.cu_seqlens_q.data);
  plan.seqlens_k = static_cast<const int32_t*>(batch.seqlens_k.data);
  plan.page_table = static_cast<const int32_t*>(batch.page_table.data);
  plan.page_table_stride = batch.page_table.strides[0];
  plan.page_size = batch.page_size;
  plan.num_requests = batch.num_requests;
  plan.num_kv_heads = static_cast<int32_t>(num_kv_heads);
  plan.group = static_cast<int32_t>(group);
  plan.head_dim = static_cast<int32_t>(head_dim);
  plan.max_seqlen_q = batch.max_seqlen_q;
  plan.softmax_scale =
      args.softmax_scale > 0.0f ? args.softmax_scale : 1.0f / std::sqrt(static_cast<float>(head_dim));

  plan.pingpong = pingpong;
  plan.persistent = persistent;
  plan.overlap = overlap;
  plan.request_major = request_major;
  plan.pooled_half_exp = pooled_half_exp;
  plan.head_major = head_major;
  if (args.index != nullptr) {
    plan.index_offsets = static_cast<const int32_t*>(args.index->offsets.data);
    plan.index_blocks = static_cast<const int32_t*>(args.index->blocks.data);
    plan.index_tile_offsets = static_cast<const int32_t*>(args.index->tile_offsets.data);
  }
  if (args.correction != nullptr) {
    const fpv2_correction_plan_t& c = *args.correction;
    plan.pooled_k = c.pooled_k.data;
    plan.pooled_v = c.pooled_v.data;
    plan.pooled_rows = static_cast<int32_t>(c.pooled_k.shape[0]);
    plan.pooled_block_offsets = static_cast<const int32_t*>(c.block_offsets.data);
    plan.block_lengths = static_cast<const int32_t*>(c.block_lengths.data);
    if (fpv2::detail::plan_has_e4m3(c)) {
      plan.pooled_k_e4m3 = c.pooled_k_e4m3.data;
      plan.pooled_vt_e4m3 = c.pooled_vt_e4m3.data;
      plan.pooled_e4m3_rows = static_cast<int32_t>(c.pooled_k_e4m3.shape[0]);
      plan.e4m3_offsets = static_cast<const int32_t*>(c.e4m3_offsets.data);
      plan.e4m3_scales = static_cast<const float*>(c.e4m3_scales.data);
    }
    if (fpv2::detail::plan_has_key_spread(c)) {
      plan.key_variance = static_cast<const float*>(c.key_variance.data);
      plan.key_radius = static_cast<const float*>(c.key_radius.data);
    }
  }

  return FPV2_OK;
}

}  // namespace

int32_t prefill_workspace_size(const fpv2_prefill_args_t& args, uint64_t* bytes) {
  if (bytes == nullptr) {
    return fail(FPV2_ERROR_INVALID_ARGUMENT, "fpv2_prefill_workspace_size: bytes is NULL");
  }
  *bytes = 0;
  DeviceGuard guard;
  PrefillPlan plan{};
  FPV2_RETURN_IF_ERROR(plan_prefill(args, guard, plan));
  FPV2_RETURN_IF_ERROR(choose_kv_splits(plan, /*sizing=*/true));
  FPV2_RETURN_IF_ERROR(choose_work_order(plan, /*sizing=*/true));
  FPV2_RETURN_IF_ERROR(choose_default_schedule(plan, /*sizing=*/true));
  *bytes = split_workspace_bytes(plan.total_q, int64_t(plan.num_kv_heads) * plan.group, plan.head_dim,
                                 plan.num_splits);
  if (plan.work_order) {
    *bytes = work_order_workspace_bytes(plan_query_tiles(plan));
  }
  *bytes += tile_queue_bytes(plan);  // persistent calls do not split
  return FPV2_OK;
}

int32_t launch_prefill(const fpv2_prefill_args_t& args, cudaStream_t stream) {
  DeviceGuard guard;
  PrefillPlan plan{};
  FPV2_RETURN_IF_ERROR(plan_prefill(args, guard, plan));
  FPV2_RETURN_IF_ERROR(choose_kv_splits(plan));
  FPV2_RETURN_IF_ERROR(choose_work_order(plan));
  FPV2_RETURN_IF_ERROR(choose_default_schedule(plan));
  FPV2_RETURN_IF_ERROR(check_tile_queue_workspace(plan));
  // One case per entry of kPrefillHeadDims (prefill_instances.hpp).
  switch (plan.head_dim) {
    case 64:
      return run_prefill<64>(plan, stream);
    case 128:
      return run_prefill<128>(plan, stream);
    case 256:
      return run_prefill<256>(plan, stream);
    default:
      return fail(FPV2_ERROR_INTERNAL, format("fpv2 Hopper prefill: head dim d=%d is listed as built (d=%s) but has "
                                              "no dispatch",
                                              plan.head_dim, prefill_head_dims_text().c_str()));
  }
}

}  // namespace fpv2::hopper
