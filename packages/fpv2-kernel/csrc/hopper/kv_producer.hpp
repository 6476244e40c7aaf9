// The producer of the prefill kernel: one thread issues the TMA loads of the K and V tiles of the tile's
// BlockSchedule, in the order the consumers read them: the kept KV blocks (last first), then the tiles of
// bf16 pooled K/V rows of the mean correction.
//
// Block n of request b lives in page page_table[b][n / blocks_per_page] at row block n % blocks_per_page of
// that page (page_size is a multiple of the kBlockN-token tile, so a tile never straddles two pages); in the
// (num_pages * page_size, Hkv * d) view of the cache that is row block page * blocks_per_page +
// n % blocks_per_page. The next block's page id is read while the current tile is waiting for a free stage.
// Pooled tile c of request b is rows pooled_block_offsets[b] + kBlockN c .. + kBlockN - 1 of the (total_blocks, Hkv * d)
// view of the pooled tensors; rows past the tensor are zero-filled by TMA, rows of the next request are
// loaded but masked by the consumers. K and V have one pipeline each, with the same number of stages, so
// one state indexes both.
#pragma once

#include <cstdint>

#include <cute/arch/copy_sm90_desc.hpp>
#include <cute/tensor.hpp>

#include "hopper/block_schedule.hpp"
#include "hopper/kv_pipeline.hpp"

namespace fpv2::hopper {

template <class Traits>
struct KvProducer {
  template <class Params, class Geometry, class Storage>
  __device__ static void run(Params const& params, Geometry const& tile, Storage& smem,
                             typename KvPipeline<Traits::kStages>::State& state) {
    using namespace cute;
    using Pipeline = KvPipeline<Traits::kStages>;

    Tensor mK = params.tma_k.get_tma_tensor(make_shape(params.cache_rows, params.cache_cols));   // (rows, cols)
    Tensor mVt = params.tma_v.get_tma_tensor(make_shape(params.cache_cols, params.cache_rows));  // (cols, rows)
    Tensor gK = local_tile(mK, typename Params::TileK{}, make_coord(_, tile.kv_head));    // (N, d, row blocks)
    Tensor gVt = local_tile(mVt, typename Params::TileVt{}, make_coord(tile.kv_head, _));  // (d, N, row blocks)
    Tensor sK = make_tensor(make_smem_ptr(smem.k), typename Traits::SmemLayoutK{});      // (N, d, stages)
    Tensor sVt = make_tensor(make_smem_ptr(smem.v), typename Traits::SmemLayoutVt{});    // (d, N, stages)

    auto tma_k = params.tma_k.get_slice(_0{});
    auto tma_v = params.tma_v.get_slice(_0{});
    Tensor tKgK = group_modes<0, 3>(tma_k.partition_S(gK));    // (TMA, row blocks)
    Tensor tKsK = group_modes<0, 3>(tma_k.partition_D(sK));    // (TMA, stages)
    Tensor tVgVt = group_modes<0, 3>(tma_v.partition_S(gVt));  // (TMA, row blocks)
    Tensor tVsVt = group_modes<0, 3>(tma_v.partition_D(sVt));  // (TMA, stages)

    int32_t const* pages = params.page_table + int64_t(tile.request) * params.page_table_stride;
    const int blocks_per_page = params.blocks_per_page;
    auto row_block_of = [&](int n_block) {
      const int page = pages[n_block / blocks_per_page];
      return page * blocks_per_page + n_block % blocks_per_page;
    };

    const BlockScheduleFor<Traits> schedule = BlockScheduleFor<Traits>::make(params, tile, Traits::kBlockN);
    Pipeline pipeline_k(smem.pipeline_k);
    Pipeline pipeline_v(smem.pipeline_v);
    const int num_kept = schedule.num_kept;
    // Read before the kept blocks, so the first pooled copy does not wait for a global load.
    const int pooled_base = schedule.num_correction > 0 ? params.pooled_block_offsets[tile.request] : 0;
    int row_block = num_kept > 0 ? row_block_of(schedule.block(0)) : 0;
    CUTE_NO_UNROLL
    for (int i = 0; i < num_kept; ++i) {
      const int next_row_block = i + 1 < num_kept ? row_block_of(schedule.block(i + 1)) : 0;
      uint64_t& full_k = pipeline_k.producer_acquire(state, Traits::kTileBytesK);
      copy(params.tma_k.with(full_k), tKgK(_, row_block), tKsK(_, state.stage));
      uint64_t& full_v = pipeline_v.producer_acquire(state, Traits::kTileBytesV);
      copy(params.tma_v.with(full_v), tVgVt(_, row_block), tVsVt(_, state.stage));
      state.advance();
      row_block = next_row_block;
    }

    if (schedule.num_correction > 0 && params.pooled_e4m3) {
      // FP8 pooled products: the request's e4m3 rows start at e4m3_offsets[b]; each tile lands in the
      // first half of the stage (the consumers read it through the E4M3 layouts).
      using ElementE4M3 = typename Traits::ElementE4M3;
      const int base = params.e4m3_offsets[tile.request];
      Tensor mPK = domain_offset(make_coord(base, _0{}), params.tma_pooled_k_e4m3.get_tma_tensor(
                                                             make_shape(params.pooled_e4m3_rows, params.cache_cols)));
      Tensor mPVt = domain_offset(make_coord(_0{}, base), params.tma_pooled_vt_e4m3.get_tma_tensor(
                                                              make_shape(params.cache_cols, params.pooled_e4m3_rows)));
      Tensor gPK = local_tile(mPK, typename Params::TileK{}, make_coord(_, tile.kv_head));   // (N, d, tiles)
      Tensor gPVt = local_tile(mPVt, typename Params::TileVt{}, make_coord(tile.kv_head, _));  // (d, N, tiles)
      auto tma_pk = params.tma_pooled_k_e4m3.get_slice(_0{});
      auto tma_pv = params.tma_pooled_vt_e4m3.get_slice(_0{});
      Tensor tPKgPK = group_modes<0, 3>(tma_pk.partition_S(gPK));
      Tensor tPVgPVt = group_modes<0, 3>(tma_pv.partition_S(gPVt));
      CUTE_NO_UNROLL
      for (int c = 0; c < schedule.num_correction; ++c) {
        Tensor sK8 = make_tensor(make_smem_ptr(reinterpret_cast<ElementE4M3*>(smem.k) +
                                               2 * Traits::kTileBytesE4M3 * state.stage),
                                 typename Traits::SmemLayoutKE4M3Stage{});
        Tensor sVt8 = make_tensor(make_smem_ptr(reinterpret_cast<ElementE4M3*>(smem.v) +
                                                2 * Traits::kTileBytesE4M3 * state.stage),
                                  typename Traits::SmemLayoutVtE4M3Stage{});
        uint64_t& full_k = pipeline_k.producer_acquire(state, Traits::kTileBytesE4M3);
        copy(params.tma_pooled_k_e4m3.with(full_k), tPKgPK(_, schedule.pooled_tile(c)), group_modes<0, 3>(tma_pk.partition_D(sK8)));
        uint64_t& full_v = pipeline_v.producer_acquire(state, Traits::kTileBytesE4M3);
        copy(params.tma_pooled_vt_e4m3.with(full_v), tPVgPVt(_, schedule.pooled_tile(c)), group_modes<0, 3>(tma_pv.partition_D(sVt8)));
        state.advance();
      }
    } else if (schedule.num_correction > 0) {
      // The request's pooled rows start at pooled_block_offsets[b]: shift the coordinate origin there, then
      // tile by 128 rows like the cache.
      Tensor mPK = domain_offset(make_coord(pooled_base, _0{}),
                                 params.tma_pooled_k.get_tma_tensor(make_shape(params.pooled_rows, params.cache_cols)));
      Tensor mPVt = domain_offset(make_coord(_0{}, pooled_base), params.tma_pooled_v.get_tma_tensor(
                                                                    make_shape(params.cache_cols, params.pooled_rows)));
      Tensor gPK = local_tile(mPK, typename Params::TileK{}, make_coord(_, tile.kv_head));
      Tensor gPVt = local_tile(mPVt, typename Params::TileVt{}, make_coord(tile.kv_head, _));
      auto tma_pk = params.tma_pooled_k.get_slice(_0{});
      auto tma_pv = params.tma_pooled_v.get_slice(_0{});
      Tensor tPKgPK = group_modes<0, 3>(tma_pk.partition_S(gPK));
      Tensor tPKsK = group_modes<0, 3>(tma_pk.partition_D(sK));
      Tensor tPVgPVt = group_modes<0, 3>(tma_pv.partition_S(gPVt));
      Tensor tPVsVt = group_modes<0, 3>(tma_pv.partition_D(sVt));
      CUTE_NO_UNROLL
      for (int c = 0; c < schedule.num_correction; ++c) {
        uint64_t& full_k = pipeline_k.producer_acquire(state, Traits::kTileBytesK);
        copy(params.tma_pooled_k.with(full_k), tPKgPK(_, schedule.pooled_tile(c)), tPKsK(_, state.stage));
        uint64_t& full_v = pipeline_v.producer_acquire(state, Traits::kTileBytesV);
        copy(params.tma_pooled_v.with(full_v), tPVgPVt(_, schedule.pooled_tile(c)), tPVsVt(_, state.stage));
        state.advance();
      }
    }
  }
};

}  // namespace fpv2::hopper
