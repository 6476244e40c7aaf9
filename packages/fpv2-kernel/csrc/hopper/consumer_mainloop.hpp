// The consumer side of the prefill kernel: one call per consumer warpgroup thread (256 threads, two
// warpgroups, 64 query rows each).
//
// Per tile: gather the warpgroup's PackGQA Q rows (cp.async), then for every KV tile of the BlockSchedule:
//   S = Q K^T          SS wgmma, fp32 accumulators; K stage released as soon as the product is done;
//   mask               kept blocks: only in the diagonal band (n >= n_block_masked), by replacement with
//                      -inf; pooled tiles of the correction: the log|B_J| shift on eligible columns, -inf
//                      elsewhere (correction_mask.hpp, from a per-tile table of the pending blocks' shifts);
//   online softmax     exp2 with the log2(e)-folded scale, O rescaled in registers;
//   P -> bf16          in registers, regrouped as the A operand (no shared-memory round trip);
//   O += P V           RS wgmma; V stage released after the product.
// The kept blocks are split into a masked loop and an unmasked loop so that the steady state carries no
// mask; in sparse mode the next block id is read one iteration ahead.
//
// Overlapped schedule (kOverlap, the default; FPV2_HOPPER_OVERLAP=0 turns it off): the PV product of KV tile n-1 is issued right
// after the QK product of tile n and stays in flight while the softmax of tile n runs, so the tensor cores
// are busy during the exp2 work; the output is rescaled once that PV product is waited for. P of tile n-1
// stays in registers for one iteration (K and V stages are released one tile apart).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/detail/helper_macros.hpp>
#include <cutlass/numeric_conversion.h>

#include "hopper/block_schedule.hpp"
#include "hopper/causal_mask.hpp"
#include "hopper/correction_mask.hpp"
#include "hopper/epilogue_store.hpp"
#include "hopper/fragment_layouts.hpp"
#include "hopper/kv_pipeline.hpp"
#include "hopper/named_barriers.hpp"
#include "hopper/online_softmax.hpp"
#include "hopper/packgqa_q_loader.hpp"
#include "hopper/pooled_e4m3_operands.hpp"
#include "hopper/value_tail_guard.hpp"
#include "hopper/warpgroup_gemm.hpp"

namespace fpv2::hopper {

template <class Traits>
struct ConsumerMainloop {
  using Element = typename Traits::Element;
  using TileS = cute::Shape<cute::Int<Traits::kBlockM>, cute::Int<Traits::kBlockN>>;
  using TileO = cute::Shape<cute::Int<Traits::kBlockM>, cute::Int<Traits::kHeadDim>>;

  // Visits the tile's schedule in order: the masked kept blocks (mode 1), the unmasked ones (mode 0), then
  // the pooled tiles (mode 2), each with visit(n, Int<mode>), from kept position `i` and pooled tile `c` on.
  // Forced inline like run(): as a call, the accumulators the visitor updates would go to local memory.
  // kMarkFirstPooled: a pooled tile that directly follows the kept blocks is visited as mode 3 (the FP8
  // correction changes operand types there).
  template <bool kMarkFirstPooled = false, class Geometry, class Visit>
  __device__ __forceinline__ static void walk_schedule_from(BlockScheduleFor<Traits> const& schedule, Geometry const& tile,
                                                            int i, int c, Visit&& visit) {
    const int num_kept = schedule.num_kept;
    int n_next = i < num_kept ? schedule.block(i) : 0;
    CUTE_NO_UNROLL
    for (; i < num_kept && n_next >= tile.n_block_masked; ++i) {
      const int n = n_next;
      n_next = i + 1 < num_kept ? schedule.block(i + 1) : 0;
      visit(n, cute::Int<1>{});
    }
    CUTE_NO_UNROLL
    for (; i < num_kept; ++i) {
      const int n = n_next;
      n_next = i + 1 < num_kept ? schedule.block(i + 1) : 0;
      visit(n, cute::Int<0>{});
    }
    if constexpr (kMarkFirstPooled) {
      if (c == 0 && num_kept > 0 && schedule.num_correction > 0) {
        visit(schedule.pooled_tile(0), cute::Int<3>{});
        c = 1;
      }
    }
    CUTE_NO_UNROLL
    for (; c < schedule.num_correction; ++c) {
      visit(schedule.pooled_tile(c), cute::Int<2>{});
    }
  }

  // The same walk with its first KV tile peeled off and given to first(n, Int<mode>): a visitor whose state
  // carries from one tile to the next (the overlapped schedule's pending PV product) then starts every
  // tile after the first in the same state, with no runtime flag that ptxas would have to correlate.
  // Returns whether any tile was visited.
  template <bool kMarkFirstPooled = false, class Geometry, class First, class Visit>
  __device__ __forceinline__ static bool walk_schedule_peeled(BlockScheduleFor<Traits> const& schedule, Geometry const& tile,
                                                              First&& first, Visit&& visit) {
    if (schedule.num_kept > 0) {
      const int n = schedule.block(0);
      if (n >= tile.n_block_masked) {
        first(n, cute::Int<1>{});
      } else {
        first(n, cute::Int<0>{});
      }
      walk_schedule_from<kMarkFirstPooled>(schedule, tile, 1, 0, visit);
      return true;
    }
    if (schedule.num_correction > 0) {
      first(schedule.pooled_tile(0), cute::Int<2>{});
      walk_schedule_from<kMarkFirstPooled>(schedule, tile, 0, 1, visit);
      return true;
    }
    return false;
  }

  // Always inlined into the kernel: left to the inliner, a small change elsewhere in the kernel (one more
  // branch in the tile order) made it a call whose output accumulators ptxas put in local memory.
  // kPooledE4M3: the pooled tiles of the correction are the E4M3 copies, multiplied on FP8 tensor cores
  // (pooled_e4m3_operands.hpp); overlapped schedule only (the launcher refuses the other combinations).
  // Persistent CTAs: `q_issued` says the tile's Q rows were issued by the previous call; with `has_next`,
  // this call issues the Q rows of the CTA's next tile `next_tile` once its last QK product is done (under
  // its last PV product in the overlapped schedule), so that their loads overlap this tile's end.
  // kSecondOrder: the pooled tiles also get the second-order mass shift (correction_mask.hpp; the launcher
  // sends plans with a key spread only there).
  template <bool kOverlap, bool kPooledE4M3 = false, bool kSecondOrder = false, class Params, class Geometry,
            class Storage>
  __device__ __forceinline__ static void run(Params const& params, Geometry const& tile, Storage& smem,
                                             int consumer_thread, typename KvPipeline<Traits::kStages>::State& state,
                                             bool q_issued = false, bool has_next = false,
                                             Geometry const& next_tile = Geometry{}) {
    using namespace cute;
    using Pipeline = KvPipeline<Traits::kStages>;
    const int wg = consumer_thread / Traits::kThreadsPerWarpGroup;
    const int thread_in_wg = consumer_thread % Traits::kThreadsPerWarpGroup;

    typename Traits::TiledMmaQK mma_qk;
    typename Traits::TiledMmaPV mma_pv;
    auto thr_qk = mma_qk.get_thread_slice(consumer_thread);
    auto thr_pv = mma_pv.get_thread_slice(consumer_thread);
    // Operand descriptors depend only on the warpgroup: slice at its first thread.
    auto wg_qk = mma_qk.get_thread_slice(wg * Traits::kThreadsPerWarpGroup);
    auto wg_pv = mma_pv.get_thread_slice(wg * Traits::kThreadsPerWarpGroup);

    Tensor sQ = make_tensor(make_smem_ptr(smem.q), typename Traits::SmemLayoutQ{});    // (M, d)
    Tensor sK = make_tensor(make_smem_ptr(smem.k), typename Traits::SmemLayoutK{});    // (N, d, stages)
    Tensor sVt = make_tensor(make_smem_ptr(smem.v), typename Traits::SmemLayoutVt{});  // (d, N, stages)
    Tensor tSrQ = wg_qk.partition_fragment_A(sQ);   // (MMA, MMA_M, MMA_K) descriptors
    Tensor tSrK = wg_qk.partition_fragment_B(sK);   // (MMA, MMA_N, MMA_K, stages)
    Tensor tOrV = wg_pv.partition_fragment_B(sVt);  // (MMA, MMA_N, MMA_K, stages)

    Tensor tSrS = partition_fragment_C(mma_qk, TileS{});  // fp32 scores of the thread
    Tensor tOrO = partition_fragment_C(mma_pv, TileO{});  // fp32 output accumulators
    Tensor tSrS_rc = make_tensor(tSrS.data(), accumulator_rows_cols(tSrS.layout()));
    Tensor tOrO_rc = make_tensor(tOrO.data(), accumulator_rows_cols(tOrO.layout()));
    Tensor tScS = thr_qk.partition_C(make_identity_tensor(TileS{}));  // (row, col) of each score
    Tensor tScS_rc = make_tensor(tScS.data(), accumulator_rows_cols(tScS.layout()));
    constexpr int kRows = decltype(size<0>(tSrS_rc))::value;
    static_assert(kRows == decltype(size<0>(tOrO_rc))::value, "S and O rows of a thread coincide");
    constexpr int kScores = decltype(size(tSrS))::value;
    using PFragmentLayout = decltype(accumulator_as_operand_a(tSrS.layout()));
    static_assert(decltype(size(PFragmentLayout{}))::value == kScores, "P reuses every score register");
    static_assert(decltype(size<2>(PFragmentLayout{}))::value == decltype(size<2>(tOrV))::value,
                  "P has one A fragment per k-block of the PV product");

    // Q: this warpgroup's 64 packed rows, visible to all its threads before the first wgmma. The schedule's
    // global loads are issued before the wait, so that their latency overlaps the Q rows'.
    if (!q_issued) PackGqaQueryLoader<Traits>::issue(sQ, params, tile, wg, thread_in_wg);
    const BlockScheduleFor<Traits> schedule = BlockScheduleFor<Traits>::make(params, tile, Traits::kBlockN);
    const int pooled_base = params.has_correction ? params.pooled_block_offsets[tile.request] : 0;
    PackGqaQueryLoader<Traits>::wait();
    cutlass::arch::NamedBarrier::sync(Traits::kThreadsPerWarpGroup,
                                      barrier_id(ConsumerBarrier::kQueryReadyWarpGroup1) + wg);

    clear(tOrO);
    float e4m3_row_factor[kRows];  // FP8 pooled products: each row's Q scale times the pooled-K scale
    OnlineSoftmax<kRows> softmax(params.softmax_scale_log2);
    const CausalMask<kRows, Traits::kBlockN> mask(tScS_rc, tile, params.group);
    Pipeline pipeline_k(smem.pipeline_k);
    Pipeline pipeline_v(smem.pipeline_v);
    const float log2_to_raw = CorrectionMask<Traits>::log2_to_raw(params);
    // The overlapped consumers (one CTA per tile) on the TMA path leave the table to the producer's idle
    // warps (CorrectionMask::build_by_producer, prefill_kernel.hpp) and wait for it at the first pooled tile.
    // Persistent CTAs build it here: the producer runs a tile ahead and would overwrite a table in use.
    const bool table_by_producer = kOverlap && params.gather == 0 && !params.persistent;
    if (schedule.num_correction > 0 && !table_by_producer) {
      // Uniform over the CTA's consumers (the same schedule everywhere), so the barriers inside match. A
      // persistent CTA first waits until both warpgroups are done with the previous tile's table.
      if (params.persistent) {
        cutlass::arch::NamedBarrier::sync(Traits::kNumConsumerThreads, barrier_id(ConsumerBarrier::kPendingShifts));
      }
      CorrectionMask<Traits>::template build<kSecondOrder>(smem.pending_shifts, params, schedule, pooled_base,
                                                           tile.kv_head, tile.n_pooled_eligible, log2_to_raw,
                                                           consumer_thread);
    }
    // The second-order shift's row coefficients, computed at the first pooled tile (Q is still in shared
    // memory there: the next tile's rows are issued after the last QK product).
    static_assert(!kSecondOrder || kOverlap, "the second-order shift is built into the overlapped schedule");
    RowSpreadFactors<kRows> spread;
    auto compute_spread_factors = [&]() CUTLASS_LAMBDA_FUNC_INLINE {
      if constexpr (kSecondOrder) {
        CorrectionMask<Traits>::row_spread_factors(smem.q, tScS_rc, 1.0f / params.inverse_softmax_scale, spread);
      }
    };
    auto apply_pooled = [&](int n) CUTLASS_LAMBDA_FUNC_INLINE {
      if constexpr (kSecondOrder) {
        CorrectionMask<Traits>::apply_second_order(tSrS_rc, tScS_rc, smem.pending_shifts, n, spread);
      } else {
        CorrectionMask<Traits>::apply(tSrS_rc, tScS_rc, smem.pending_shifts, n);
      }
    };

    // One KV tile of the schedule: kMode 0 = kept block, unmasked; 1 = kept block in the diagonal band;
    // 2 = pooled tile `n` of the mean correction.
    // Pingpong: warpgroup w issues its QK product only on its turn (barrier kTurnWarpGroup1 + w, completed
    // by the other warpgroup's arrival) and hands the turn over right after issuing, so one warpgroup's
    // softmax runs under the other's products. The first turn is warpgroup 0's without a wait and the last
    // hand-over of warpgroup 1 is skipped, so every barrier sees as many arrivals as waits.
    const int num_stages = schedule.num_stages();
    int stage_index = 0;
    auto process_tile = [&](int n, auto mode) CUTLASS_LAMBDA_FUNC_INLINE {
      constexpr int kMode = decltype(mode)::value;
      pipeline_k.consumer_wait(state);
      if (params.gather) {
        cutlass::arch::fence_view_async_shared();  // gathered by cp.async (generic proxy), read by wgmma
      }
      if (params.pingpong && !(wg == 0 && stage_index == 0)) {
        cutlass::arch::NamedBarrier::sync(Traits::kNumConsumerThreads,
                                          barrier_id(ConsumerBarrier::kTurnWarpGroup1) + wg);
      }
      warpgroup_gemm_issue</*kZeroInit=*/true>(mma_qk, tSrQ, tSrK(_, _, _, state.stage), tSrS);
      if (params.pingpong && !(wg == 1 && stage_index == num_stages - 1)) {
        cutlass::arch::NamedBarrier::arrive(Traits::kNumConsumerThreads,
                                            barrier_id(ConsumerBarrier::kTurnWarpGroup1) + (1 - wg));
      }
      warpgroup_gemm_wait(mma_qk, tSrQ, tSrS);
      pipeline_k.consumer_release(state);
      if constexpr (kMode == 1) {
        mask.apply(tSrS_rc, tScS_rc, n);
      } else if constexpr (kMode == 2) {
        apply_pooled(n);
      }
      softmax.step(tSrS_rc, tOrO_rc);

      // P in bf16, same register order, viewed as the RS A operand.
      cutlass::NumericArrayConverter<Element, float, kScores> to_bf16;
      auto p_values = to_bf16(*reinterpret_cast<cutlass::Array<float, kScores> const*>(tSrS.data()));
      Tensor tOrP = make_tensor(make_rmem_ptr<Element>(p_values.data()), PFragmentLayout{});

      pipeline_v.consumer_wait(state);
      if (params.gather) {
        cutlass::arch::fence_view_async_shared();
      }
      if constexpr (kMode == 1) {
        if (tile.is_partial_tail_block(n)) {
          ValueTailGuard<Traits>::clear(sVt, state.stage, tile.seqlen_k - n * Traits::kBlockN, consumer_thread);
        }
      } else if constexpr (kMode == 2) {
        // Rows past the eligible range (the next request's pooled rows, or spare rows of the tensor) carry
        // zero probability but are not guaranteed finite: clear them in the last pooled tile.
        const int eligible_rows = tile.n_pooled_eligible - n * Traits::kBlockN;
        if (eligible_rows < Traits::kBlockN) {
          ValueTailGuard<Traits>::clear(sVt, state.stage, eligible_rows, consumer_thread);
        }
      }
      warpgroup_gemm</*kZeroInit=*/false>(mma_pv, tOrP, tOrV(_, _, _, state.stage), tOrO);
      pipeline_v.consumer_release(state);
      state.advance();
      ++stage_index;
    };

    auto issue_next_query = [&]() CUTLASS_LAMBDA_FUNC_INLINE {
      if (has_next) PackGqaQueryLoader<Traits>::issue(sQ, params, next_tile, wg, thread_in_wg);
    };
    if constexpr (!kOverlap) {
      walk_schedule_from(schedule, tile, 0, 0, process_tile);
      issue_next_query();  // every QK product of the tile is done
    } else {
      // V rows of tile n that must be zeroed before its PV product (kBlockN: none), as process_tile does.
      auto valid_value_rows = [&](int n, auto mode) {
        constexpr int kMode = decltype(mode)::value;
        if constexpr (kMode == 1) {
          return tile.is_partial_tail_block(n) ? tile.seqlen_k - n * Traits::kBlockN : Traits::kBlockN;
        } else if constexpr (kMode >= 2 && !kPooledE4M3) {
          const int eligible_rows = tile.n_pooled_eligible - n * Traits::kBlockN;
          return eligible_rows < Traits::kBlockN ? eligible_rows : Traits::kBlockN;
        } else {
          // Kept blocks, and the E4M3 pooled tiles: every row there is finite (the copies hold zeros
          // between requests, TMA fills zeros past the tensor), so probability 0 contributes 0.
          return Traits::kBlockN;
        }
      };
      cutlass::Array<Element, kScores> p_pending;  // P of the tile whose PV product is next
      Tensor tOrP = make_tensor(make_rmem_ptr<Element>(p_pending.data()), PFragmentLayout{});
      auto v_state = state;  // the V stage of that tile (K runs one tile ahead)
      int pending_rows = Traits::kBlockN;
      auto issue_pending_pv = [&]() CUTLASS_LAMBDA_FUNC_INLINE {
        pipeline_v.consumer_wait(v_state);
        if (params.gather) {
          cutlass::arch::fence_view_async_shared();
        }
        if (pending_rows < Traits::kBlockN) {
          ValueTailGuard<Traits>::clear(sVt, v_state.stage, pending_rows, consumer_thread);
        }
        warpgroup_gemm_issue</*kZeroInit=*/false>(mma_pv, tOrP, tOrV(_, _, _, v_state.stage), tOrO);
      };
      auto retire_pending_pv = [&]() CUTLASS_LAMBDA_FUNC_INLINE {
        warpgroup_wait<0>();
        warpgroup_fence_operand(tOrO);
        warpgroup_fence_operand(tOrP);
        pipeline_v.consumer_release(v_state);
        v_state.advance();
      };
      // QK of tile n (issued by the caller) is done: release its K stage, mask its scores.
      auto finish_scores = [&](int n, auto mode) CUTLASS_LAMBDA_FUNC_INLINE {
        constexpr int kMode = decltype(mode)::value;
        warpgroup_fence_operand(tSrS);
        pipeline_k.consumer_release(state);
        state.advance();
        if constexpr (kMode == 1) {
          mask.apply(tSrS_rc, tScS_rc, n);
        } else if constexpr (kMode >= 2 && kPooledE4M3) {
          if constexpr (kSecondOrder) {
            CorrectionMask<Traits>::apply_scaled_second_order(tSrS_rc, tScS_rc, smem.pending_shifts, n,
                                                              e4m3_row_factor, spread);
          } else {
            CorrectionMask<Traits>::apply_scaled(tSrS_rc, tScS_rc, smem.pending_shifts, n, e4m3_row_factor);
          }
        } else if constexpr (kMode >= 2) {
          apply_pooled(n);
        }
      };
      auto issue_scores = [&]() CUTLASS_LAMBDA_FUNC_INLINE {
        pipeline_k.consumer_wait(state);
        if (params.gather) {
          cutlass::arch::fence_view_async_shared();
        }
        warpgroup_gemm_issue</*kZeroInit=*/true>(mma_qk, tSrQ, tSrK(_, _, _, state.stage), tSrS);
      };
      auto keep_probabilities = [&](int n, auto mode) CUTLASS_LAMBDA_FUNC_INLINE {
        cutlass::NumericArrayConverter<Element, float, kScores> to_bf16;
        p_pending = to_bf16(*reinterpret_cast<cutlass::Array<float, kScores> const*>(tSrS.data()));
        pending_rows = valid_value_rows(n, mode);
      };
      // The FP8 pooled products (kPooledE4M3): Q in e4m3 registers from the first pooled tile on, P of a
      // pooled tile in e4m3 registers, pooled K / V^T tiles in the first half of their stages.
      using ElementE4M3 = typename Traits::ElementE4M3;
      typename Traits::TiledMmaQKE4M3 mma_qk8;
      typename Traits::TiledMmaPVE4M3 mma_pv8;
      auto wg_qk8 = mma_qk8.get_thread_slice(wg * Traits::kThreadsPerWarpGroup);
      auto wg_pv8 = mma_pv8.get_thread_slice(wg * Traits::kThreadsPerWarpGroup);
      Tensor tSrQ8 = make_tensor<ElementE4M3>(partition_shape_A(mma_qk8, TileO{}));  // (MMA, MMA_M, MMA_K)
      cutlass::Array<ElementE4M3, kScores> p8_pending;
      Tensor tOrP8 = make_tensor(make_rmem_ptr<ElementE4M3>(p8_pending.data()),
                                 make_layout(partition_shape_A(mma_pv8, TileS{})));
      static_assert(!kPooledE4M3 || kRows == 2, "a consumer thread holds two rows of the 64-row wgmma tile");
      float e4m3_v_scale = 1.0f;
      auto e4m3_v_scale_of_tile = [&]() {
        return params.e4m3_scales[(int64_t(tile.request) * params.num_kv_heads + tile.kv_head) * 2 + 1];
      };
      auto pooled_k_descriptors = [&](int stage) {
        Tensor s8 = make_tensor(make_smem_ptr(reinterpret_cast<ElementE4M3*>(smem.k) + 2 * Traits::kTileBytesE4M3 * stage),
                                typename Traits::SmemLayoutKE4M3Stage{});
        return wg_qk8.partition_fragment_B(s8);
      };
      auto pooled_vt_descriptors = [&](int stage) {
        Tensor s8 = make_tensor(make_smem_ptr(reinterpret_cast<ElementE4M3*>(smem.v) + 2 * Traits::kTileBytesE4M3 * stage),
                                typename Traits::SmemLayoutVtE4M3Stage{});
        return wg_pv8.partition_fragment_B(s8);
      };
      // Q -> e4m3 A fragment with per-row scales, and the scales of the tile's KV head.
      auto build_query_e4m3 = [&]() CUTLASS_LAMBDA_FUNC_INLINE {
        const float* scales = params.e4m3_scales + (int64_t(tile.request) * params.num_kv_heads + tile.kv_head) * 2;
        const float k_scale = scales[0];
        e4m3_v_scale = scales[1];
        Tensor cQ = mma_qk8.get_thread_slice(consumer_thread).partition_A(make_identity_tensor(TileO{}));
        constexpr int kQValues = decltype(size(tSrQ8))::value;
        static_assert(decltype(size(cQ))::value == kQValues, "one coordinate per Q value");
        cutlass::Array<float, kQValues> q;
        float amax[2] = {0.0f, 0.0f};
        CUTE_UNROLL
        for (int v = 0; v < kQValues; ++v) {
          q[v] = float(sQ(get<0>(cQ(v)), get<1>(cQ(v))));
          amax[e4m3_a_row(v)] = fmaxf(amax[e4m3_a_row(v)], fabsf(q[v]));
        }
        float inverse[2];
        CUTE_UNROLL
        for (int r = 0; r < 2; ++r) {
          const float row_max = quad_max(amax[r]);
          inverse[r] = row_max > 0.0f ? kE4M3Max / row_max : 0.0f;
          e4m3_row_factor[r] = row_max / kE4M3Max * k_scale;
        }
        CUTE_UNROLL
        for (int v = 0; v < kQValues; ++v) q[v] *= inverse[e4m3_a_row(v)];
        cutlass::NumericArrayConverter<ElementE4M3, float, kQValues> to_e4m3;
        *reinterpret_cast<cutlass::Array<ElementE4M3, kQValues>*>(tSrQ8.data()) = to_e4m3(q);
      };
      auto issue_scores_e4m3 = [&]() CUTLASS_LAMBDA_FUNC_INLINE {
        pipeline_k.consumer_wait(state);
        warpgroup_gemm_issue</*kZeroInit=*/true>(mma_qk8, tSrQ8, pooled_k_descriptors(state.stage), tSrS);
      };
      auto keep_probabilities_e4m3 = [&]() CUTLASS_LAMBDA_FUNC_INLINE {
        cutlass::Array<float, kScores> ordered;
        CUTE_UNROLL
        for (int v = 0; v < kScores; ++v) ordered[v] = tSrS(e4m3_p_source(v)) * kE4M3ProbabilityScale;
        cutlass::NumericArrayConverter<ElementE4M3, float, kScores> to_e4m3;
        p8_pending = to_e4m3(ordered);
      };
      auto issue_pending_pv_e4m3 = [&]() CUTLASS_LAMBDA_FUNC_INLINE {
        pipeline_v.consumer_wait(v_state);
        warpgroup_gemm_issue</*kZeroInit=*/false>(mma_pv8, tOrP8, pooled_vt_descriptors(v_state.stage), tOrO);
      };
      auto retire_pending_pv_e4m3 = [&]() CUTLASS_LAMBDA_FUNC_INLINE {
        warpgroup_wait<0>();
        warpgroup_fence_operand(tOrO);
        warpgroup_fence_operand(tOrP8);
        pipeline_v.consumer_release(v_state);
        v_state.advance();
      };

      // Lambdas forced inline: left to the inliner, the unmasked-block instance became a call (a 1168-byte
      // stack frame). With kPooledE4M3, mode 3 (the first pooled tile after kept blocks) has a bf16 pending PV
      // product, and O moves to the e4m3 products' scale (2^8 / v_scale) there.
      auto await_shift_table = [&]() CUTLASS_LAMBDA_FUNC_INLINE {
        if (table_by_producer) CorrectionMask<Traits>::await_built();
      };
      // Mode 3 is the first pooled tile after kept blocks (a first tile of mode 2 is the first pooled one too).
      const bool visited = walk_schedule_peeled</*kMarkFirstPooled=*/true>(
          schedule, tile,
          [&](int n, auto mode) CUTLASS_LAMBDA_FUNC_INLINE {
            constexpr bool kPooled8 = kPooledE4M3 && decltype(mode)::value >= 2;
            // The spread factors read Q from shared memory: under the bf16 QK product, before the e4m3 one
            // (whose Q operand takes registers while it runs).
            if constexpr (kPooled8) compute_spread_factors();
            if constexpr (kPooled8) {
              build_query_e4m3();
              issue_scores_e4m3();
            } else {
              issue_scores();
            }
            if constexpr (decltype(mode)::value >= 2 && !kPooled8) compute_spread_factors();
            if constexpr (decltype(mode)::value >= 2) await_shift_table();
            warpgroup_wait<0>();
            finish_scores(n, mode);
            float factors[kRows];
            softmax.rescale_scores(tSrS_rc, factors);  // O is still zero: nothing to rescale
            if constexpr (kPooled8) {
              keep_probabilities_e4m3();
            } else {
              keep_probabilities(n, mode);
            }
          },
          [&](int n, auto mode) CUTLASS_LAMBDA_FUNC_INLINE {
            constexpr int kMode = decltype(mode)::value;
            constexpr bool kPooled8 = kPooledE4M3 && kMode >= 2;
            constexpr bool kPending8 = kPooledE4M3 && kMode == 2;  // the previous tile was pooled too
            if constexpr (kPooledE4M3 && kMode == 3) {
              // The first pooled tile after the kept blocks: the last kept PV product runs alone (its P and
              // the e4m3 Q being built would not fit in registers together), O moves to the e4m3 scale.
              issue_pending_pv();
              retire_pending_pv();
              const float to_e4m3_scale = kE4M3ProbabilityScale / e4m3_v_scale_of_tile();
              CUTE_UNROLL
              for (int i = 0; i < size(tOrO); ++i) tOrO(i) *= to_e4m3_scale;
              compute_spread_factors();
              build_query_e4m3();
              issue_scores_e4m3();
              await_shift_table();
              warpgroup_wait<0>();
              finish_scores(n, mode);
              float factors[kRows];
              softmax.rescale_scores(tSrS_rc, factors);
              softmax.rescale_output(tOrO_rc, factors);
              keep_probabilities_e4m3();
              return;
            }
            if constexpr (kPooled8) {
              issue_scores_e4m3();
            } else {
              issue_scores();
            }
            if constexpr (kPending8) {
              issue_pending_pv_e4m3();
            } else {
              issue_pending_pv();
            }
            if constexpr (kMode == 3) compute_spread_factors();  // bf16 here (e4m3 returned above): under both
            if constexpr (kMode == 3) await_shift_table();
            warpgroup_wait<1>();  // the QK batch (issued first) is done, the PV batch may still run
            finish_scores(n, mode);
            float factors[kRows];
            if constexpr (kMode >= 2 && !kPooledE4M3) {
              if (params.pooled_half_exp) {
                softmax.template rescale_scores<true>(tSrS_rc, factors);
              } else {
                softmax.rescale_scores(tSrS_rc, factors);
              }
            } else {
              softmax.rescale_scores(tSrS_rc, factors);
            }
            if constexpr (kPending8) {
              retire_pending_pv_e4m3();
            } else {
              retire_pending_pv();
            }
            softmax.rescale_output(tOrO_rc, factors);
            if constexpr (kPooled8) {
              keep_probabilities_e4m3();
            } else {
              keep_probabilities(n, mode);
            }
          });
      if (visited) {
        if (kPooledE4M3 && schedule.num_correction > 0) {
          issue_pending_pv_e4m3();
          retire_pending_pv_e4m3();
          // Back from the e4m3 products' scale.
          const float from_e4m3_scale = e4m3_v_scale / kE4M3ProbabilityScale;
          CUTE_UNROLL
          for (int i = 0; i < size(tOrO); ++i) tOrO(i) *= from_e4m3_scale;
        } else {
          issue_pending_pv();
          issue_next_query();  // every QK product of the tile is done; issued under the last PV product
          retire_pending_pv();
        }
      } else {
        issue_next_query();
      }
    }

    float lse[kRows];
    softmax.finalize(tOrO_rc, lse);
    if constexpr (Traits::kSplitKv) {
      EpilogueStore<Traits>::store_partial(params, tile, tOrO, thr_pv, lse);
    } else {
      EpilogueStore<Traits>::store(params, tile, tOrO, thr_pv, lse);
    }
  }
};

}  // namespace fpv2::hopper
