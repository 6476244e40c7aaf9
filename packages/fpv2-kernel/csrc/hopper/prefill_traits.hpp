// Compile-time configuration of the sm_90a causal prefill kernel: tile shapes, warp roles,
// register budgets, the two warpgroup MMAs and the shared-memory layouts they read.
//
// One CTA computes one PackGQA query tile: kBlockM = 128 packed rows of one KV head (FPV2_KERNEL_TILE_SIZE)
// against the request's visible KV blocks of kBlockSize = 128 tokens (the index's and the correction's
// block), loaded and multiplied as KV tiles of kBlockN tokens: the whole block (kBlockN = 128) at d <= 128,
// half a block (kBlockN = 64) at d = 256, where a 128-token tile's scores would not fit in the consumers'
// registers beside the 128 fp32 accumulators of O, nor two stages of it in shared memory. Three warpgroups:
//   WG0      producer: one elected thread issues the TMA loads of K and V tiles from the paged cache (or, for
//            pages that are not a multiple of kBlockN, the whole warpgroup gathers them with cp.async);
//   WG1, WG2 consumers: each owns 64 of the 128 query rows (QK^T SS wgmma, online softmax, PV RS wgmma).
// prefill_kernel.hpp describes the schedules (overlapped consumers, persistent CTAs) built on these.
//
// Head dims: the layouts, MMAs and copies below are written for any multiple of 64 up to 256; the compiled
// ones are listed in prefill_instances.hpp, each with the stage count of prefill_stages().
#pragma once

#include <cute/arch/mma_sm90.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cute/tensor.hpp>
#include <type_traits>

#include <cutlass/bfloat16.h>
#include <cutlass/float8.h>

#include "fpv2/fpv2.h"
#include "hopper/prefill_plan.hpp"

namespace fpv2::hopper {

// K/V pipeline stages of the instantiation for `head_dim`, from the shared-memory budget. One CTA runs per
// SM (its 384 threads take the whole register file), so the storage may use the opt-in limit of 227 KB
// (232448 bytes); prefill_launch.hpp asserts it. PrefillSharedStorage holds, besides the stages, the Q tile
// (128 x d bf16), the correction's per-tile table of max_correction_blocks(d) float shifts (prefill_plan.hpp:
// 64 KB, 32 KB at d = 256), the shared-rows gather's row table (2 x kBlockN words), the barriers, the
// rounding of the 1024-byte aligned struct and 1 KB of slack to align its base. A stage is one K and one V
// tile of kBlockN x d bf16: 64 KB at d = 128 and at d = 256 (64-token tiles), 32 KB at d = 64.
//   d = 128: 32 KB of Q + 64 KB + 2 stages = 227 KB, the limit; a third stage never fits.
//   d = 64:  16 KB of Q + 64 KB + 4 stages = 211 KB; a fifth stage does not fit. Four stages keep the
//            d = 128 instantiation's 128 KB of K/V in flight, three tiles ahead of the consumers (each tile
//            half as long as at d = 128).
//   d = 256: 64 KB of Q + 32 KB + 2 stages = 226 KB; with the 64 KB table of the other head dims it would
//            not fit, hence the smaller table (requests up to 2^20 tokens with the correction).
//   other:   0 (none chosen).
constexpr int prefill_stages(int head_dim) {
  return head_dim == 64 ? 4 : (head_dim == 128 || head_dim == 256 ? 2 : 0);
}

// kSplitKv_: the split-KV instantiation (split_kv.hpp), launched only for calls that split; the others
// compile without its schedule ranges and partial-row epilogue.
template <int kHeadDim_, int kStages_ = 2, bool kSplitKv_ = false>
struct PrefillTraits {
  static constexpr bool kSplitKv = kSplitKv_;
  using Element = cutlass::bfloat16_t;
  using Accum = float;

  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = 128;  // packed query rows per tile (PackGQA)
  static constexpr int kBlockSize = 128;  // KV tokens per block of the index and of the correction's pooling
  static constexpr int kBlockN = prefill_kv_tile(kHeadDim_);  // KV tokens per tile; the paged TMA path needs
                                                              // page_size % kBlockN == 0
  static constexpr int kTilesPerBlock = kBlockSize / kBlockN;
  static constexpr int kStages = kStages_;
  static_assert(kBlockM == FPV2_KERNEL_TILE_SIZE, "the query tile must be the index's tile (ALGORITHM.md section 2)");
  static_assert(kBlockSize % kBlockN == 0, "a block is a whole number of KV tiles");
  static_assert(kHeadDim % 64 == 0 && kHeadDim <= 256, "head dims are multiples of the 64-element swizzle atom");
  static_assert(kStages >= 2, "one stage would serialise the producer and the consumers");

  // Warp roles.
  static constexpr int kThreadsPerWarpGroup = 128;
  static constexpr int kNumConsumerWarpGroups = 2;
  static constexpr int kNumConsumerThreads = kNumConsumerWarpGroups * kThreadsPerWarpGroup;
  static constexpr int kNumThreads = kThreadsPerWarpGroup + kNumConsumerThreads;  // 384
  static constexpr int kRowsPerConsumer = kBlockM / kNumConsumerWarpGroups;      // 64 = one wgmma M
  static_assert(kRowsPerConsumer == 64, "each consumer warpgroup issues 64-row wgmma");

  // setmaxnreg budgets. With __launch_bounds__(384, 1) the kernel starts at 65536 / 384 = 168 registers a
  // thread, and the warpgroups can only trade among themselves what the CTA got at launch (3 x 168 a
  // thread of a warpgroup): a consumer's setmaxnreg.inc waits for registers the producer's .dec gave back,
  // so a budget over the launch allocation hangs the CTA. The producer keeps 32 (at 24 the cp.async gather
  // producer spilled 12-40 bytes, ptxas 2026-12-01) and each consumer thread 232, enough for its d / 2 O
  // accumulators (64 at d = 128, 32 at d = 64, 128 at d = 256), kBlockN / 2 S accumulators (64, or 32 at
  // d = 256) and the kBlockN / 4 registers of P without spilling: 32 + 2 * 232 = 496 <= 504.
  // At d = 256 (O alone is 128 registers) the consumers take 240 and the producer 24 (24 + 2 * 240 = 504):
  // the overlapped consumers' spills drop from 136 to 64 bytes and the corrected 128K timing by 2.4% (dense
  // 1% slower; NOTES.md, 2026-12-01, eighth session).
  static constexpr int kLaunchRegisters = 168;
  static constexpr int kProducerRegisters = kHeadDim_ == 256 ? 24 : 32;
  static constexpr int kConsumerRegisters = kHeadDim_ == 256 ? 240 : 232;
  static_assert(kProducerRegisters + kNumConsumerWarpGroups * kConsumerRegisters <=
                    (kNumConsumerWarpGroups + 1) * kLaunchRegisters,
                "setmaxnreg can only redistribute the registers the CTA was launched with");
  static_assert(kProducerRegisters % 8 == 0 && kConsumerRegisters % 8 == 0, "setmaxnreg takes multiples of 8");

  // S = Q K^T: A (Q) and B (K) from shared memory, both K-major (head dim contiguous).
  using MmaAtomQK = decltype(cute::SM90::GMMA::ss_op_selector<Element, Element, Accum,
                                                              cute::Shape<cute::_64, cute::Int<kBlockN>,
                                                                          cute::Int<kHeadDim>>,
                                                              cute::GMMA::Major::K, cute::GMMA::Major::K>());
  // O += P V: A (P) from registers, B (V^T viewed as (d, kv)) from shared memory, MN-major because V rows
  // keep the head dim contiguous, as in the cache.
  using MmaAtomPV = decltype(cute::SM90::GMMA::rs_op_selector<Element, Element, Accum,
                                                              cute::Shape<cute::_64, cute::Int<kHeadDim>,
                                                                          cute::Int<kBlockN>>,
                                                              cute::GMMA::Major::K, cute::GMMA::Major::MN>());
  // The two consumer warpgroups tile M: warpgroup w computes rows [64 w, 64 w + 64) of the tile.
  using ConsumerAtomLayout = cute::Layout<cute::Shape<cute::Int<kNumConsumerWarpGroups>, cute::_1, cute::_1>>;
  using TiledMmaQK = decltype(cute::make_tiled_mma(MmaAtomQK{}, ConsumerAtomLayout{}));
  using TiledMmaPV = decltype(cute::make_tiled_mma(MmaAtomPV{}, ConsumerAtomLayout{}));
  static_assert(cute::size(TiledMmaQK{}) == kNumConsumerThreads && cute::size(TiledMmaPV{}) == kNumConsumerThreads,
                "both MMAs are issued by the two consumer warpgroups");

  // Shared-memory layouts: 128-byte swizzle atoms (64 bf16), the widest the head dim allows, which is
  // also what the TMA box and the wgmma descriptors expect.
  using SmemLayoutAtomK = cute::GMMA::Layout_K_SW128_Atom<Element>;   // 8 rows x 64 elements
  using SmemLayoutAtomV = cute::GMMA::Layout_MN_SW128_Atom<Element>;  // 64 elements x 8 columns
  using SmemLayoutQ = decltype(cute::tile_to_shape(SmemLayoutAtomK{},
                                                   cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim>>{}));
  using SmemLayoutK = decltype(cute::tile_to_shape(
      SmemLayoutAtomK{}, cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDim>, cute::Int<kStages>>{}));
  // V^T as (d, kv, stage), MN-major: atoms are stacked along kv first (the canonical MN-major GMMA order).
  using SmemLayoutVt = decltype(cute::tile_to_shape(
      SmemLayoutAtomV{}, cute::Shape<cute::Int<kHeadDim>, cute::Int<kBlockN>, cute::Int<kStages>>{},
      cute::Step<cute::_2, cute::_1, cute::_3>{}));
  // One stage of each, for the TMA box.
  using SmemLayoutKStage = decltype(cute::take<0, 2>(SmemLayoutK{}));
  using SmemLayoutVtStage = decltype(cute::take<0, 2>(SmemLayoutVt{}));

  // The mean correction's FP8 pooled products (the E4M3 copies of the pooled statistics, fpv2.h ABI 1.2).
  // 8-bit wgmma reads both operands K-major: Q and P come from registers (RS), pooled K is (N, d) with d
  // contiguous and pooled V^T is (d, N) with the pooled keys contiguous. Each pooled tile fills the first
  // half of a bf16 stage (the stage buffers stay 1024-byte aligned).
  using ElementE4M3 = cutlass::float_e4m3_t;
  using MmaAtomQKE4M3 = decltype(cute::SM90::GMMA::rs_op_selector<
                                 ElementE4M3, ElementE4M3, Accum,
                                 cute::Shape<cute::_64, cute::Int<kBlockN>, cute::Int<kHeadDim>>>());
  using MmaAtomPVE4M3 = decltype(cute::SM90::GMMA::rs_op_selector<
                                 ElementE4M3, ElementE4M3, Accum,
                                 cute::Shape<cute::_64, cute::Int<kHeadDim>, cute::Int<kBlockN>>>());
  using TiledMmaQKE4M3 = decltype(cute::make_tiled_mma(MmaAtomQKE4M3{}, ConsumerAtomLayout{}));
  using TiledMmaPVE4M3 = decltype(cute::make_tiled_mma(MmaAtomPVE4M3{}, ConsumerAtomLayout{}));
  // The widest swizzle a row allows: d bytes for pooled K (64, 128 or more), kBlockN bytes (keys) for V^T.
  // Only kBlockN = 128 tiles are launched with the E4M3 copies (kPooledE4M3Built); the layouts of the other
  // tiles exist so that every instantiation compiles the same consumer code.
  using SmemLayoutAtomKE4M3 = std::conditional_t<kHeadDim % 128 == 0, cute::GMMA::Layout_K_SW128_Atom<ElementE4M3>,
                                                 cute::GMMA::Layout_K_SW64_Atom<ElementE4M3>>;
  using SmemLayoutKE4M3Stage = decltype(cute::tile_to_shape(SmemLayoutAtomKE4M3{},
                                                            cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDim>>{}));
  using SmemLayoutAtomVtE4M3 = std::conditional_t<kBlockN % 128 == 0, cute::GMMA::Layout_K_SW128_Atom<ElementE4M3>,
                                                  cute::GMMA::Layout_K_SW64_Atom<ElementE4M3>>;
  using SmemLayoutVtE4M3Stage = decltype(cute::tile_to_shape(SmemLayoutAtomVtE4M3{},
                                                             cute::Shape<cute::Int<kHeadDim>, cute::Int<kBlockN>>{}));
  static constexpr int kTileBytesE4M3 = kBlockN * kHeadDim;
  // The FP8 pooled products are built for 128-token tiles (a V^T row of pooled keys is one 128-byte swizzle
  // row); the launcher refuses the E4M3 copies at other tiles.
  static constexpr bool kPooledE4M3Built = kBlockN == 128;

  static constexpr int kTileBytesK = kBlockN * kHeadDim * int(sizeof(Element));
  static constexpr int kTileBytesV = kBlockN * kHeadDim * int(sizeof(Element));
  static_assert(cute::cosize_v<SmemLayoutKStage> * int(sizeof(Element)) == kTileBytesK, "K stage is one dense tile");
  static_assert(cute::cosize_v<SmemLayoutVtStage> * int(sizeof(Element)) == kTileBytesV, "V stage is one dense tile");
};

// The traits of the compiled instantiation for head dim kHeadDim.
template <int kHeadDim>
using PrefillTraitsFor = PrefillTraits<kHeadDim, prefill_stages(kHeadDim)>;

// The split-KV instantiation's traits for head dim kHeadDim.
template <int kHeadDim>
using SplitKvTraitsFor = PrefillTraits<kHeadDim, prefill_stages(kHeadDim), true>;

}  // namespace fpv2::hopper
