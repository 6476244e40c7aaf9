// The tile schedule the launcher picks for a block-sparse call when neither FPV2_HOPPER_PERSISTENT nor
// FPV2_HOPPER_WORK_ORDER is set: one CTA per tile in the decoded order (tile_order.hpp), one CTA per tile in
// the kept-block work order (work_order.hpp), or persistent CTAs fed by the dynamic tile queue (tile_queue.hpp)
// in the work order.
//
// Why the order: a tile's work is its kept blocks, and the index's dense tail (SelectionConfig.dense_tail_tiles,
// 1 by default) makes the last query tile of every request and KV head keep its whole span: after a 112K prefix
// ~1,000 blocks against a mean of ~27. The decoded order starts those tiles wherever their KV head sits, and the
// last ones run alone at the end. benchmarks/tile_schedule_model.py replays one CTA per tile as a list schedule:
// the decoded order's makespan is 1.5-2.8x the ideal for chunks after cached prefixes, 1.05-1.15x for fresh
// calls, the work order's 1.00-1.13x where no single tile is longer than the ideal. ncu (16K chunk after 112K,
// locked clocks): one CTA per tile kept the SMs active 60.6% of the elapsed cycles, the queue in the work order
// 98.1%, at the same active cycles. Without a dense tail (a chunk-aware pipeline's middle chunks) the order has
// nothing to place and costs 0.6-1.9% on chunks; the queue still takes 4.3% off fresh 128K.
//
// Measured (33rd session, H100, planted workload, page 1 through the tile pages, d = 128, 32 / 8 heads, mean
// correction, the attention launch alone with the settings alternating in one process, outputs bit-identical;
// benchmarks/results/2026-12-06-h100-default-schedule/), against one CTA per tile in the decoded order:
// - chunks after a cached prefix, the work order with one CTA per tile: 16K after 112K -34.2% (-38.8%
//   uncorrected), 8K after 120K / 56K / 24K / 8K -33.3 / -35.7 / -31.9 / -20.5%, 4K after 124K -18.6%, 2K after
//   126K (512 tiles) -10.2%, 4 x (8K after 56K) -15.7%, 32K after 96K -20.0%. The queue on top helps the larger
//   ones by 0-2 points and costs the smaller ones up to 14 (2K: +3.6%), so the order runs alone.
// - fresh calls, the queue in the work order: 24K -3.6%, 32K -7.8%, 64K -4.3%, 128K -5.5%, 4 x 32K -0.8%,
//   4 x 128K -1.6%; but 16K +0.9%, 8K +1.4 to +2.3%, 4 x 8K +2.6% (the order alone the same or worse). Hence a
//   threshold on the longest request's tiles, not the call's: 6,144 (24K tokens at 32 / 8 heads).
// Not measured (left to the decoded order): head dims 64 and 256 (the d = 256 queue instantiation spills), dense
// mode (every tile's work is its causal span: no heavy tail), the FP8 pooled products and the second-order shift
// (built for one CTA per tile only), pingpong or FPV2_HOPPER_OVERLAP=0, and the gather path (pages the TMA cannot
// read).
#pragma once

#include <cstdint>

#include "hopper/prefill_plan.hpp"

namespace fpv2::hopper {

// Query tiles of the longest request (over its KV heads) from which a call runs the tile queue in the work order.
inline constexpr int64_t kDefaultTileQueueMinRequestTiles = 6144;

enum class DefaultSchedule { kDecodedOrder, kWorkOrder, kTileQueueInWorkOrder };

// Whether `plan` is a configuration the measurements above cover.
inline bool default_schedule_covers(const PrefillPlan& plan) {
  return plan.head_dim == 128 && plan.index_offsets != nullptr && plan.overlap != 0 && plan.pingpong == 0 &&
         plan.pooled_k_e4m3 == nullptr && plan.key_variance == nullptr &&
         plan.page_size % prefill_kv_tile(plan.head_dim) == 0;
}

// The schedule for `plan` (both switches unset, no KV split): `request_tiles` are the longest request's query
// tiles over its KV heads, `num_tiles` the call's, `sms` the device's.
inline DefaultSchedule default_schedule(const PrefillPlan& plan, int64_t request_tiles, int64_t num_tiles, int sms) {
  if (!default_schedule_covers(plan)) return DefaultSchedule::kDecodedOrder;
  if (request_tiles >= kDefaultTileQueueMinRequestTiles) return DefaultSchedule::kTileQueueInWorkOrder;
  if (plan.max_seqlen_k > plan.max_seqlen_q && num_tiles > sms) return DefaultSchedule::kWorkOrder;
  return DefaultSchedule::kDecodedOrder;
}

}  // namespace fpv2::hopper
