// Compile-time shape of the scoring kernel: one warpgroup scores a 128-row query tile against 64 pooled
// keys per step with one wgmma, keys as the M side (A) and the tile's rows as N (B), so that each key's
// reduction over rows stays inside a quad of lanes (fragment_layouts.hpp: a thread holds 2 keys x 32 rows).
#pragma once

#include <cute/arch/mma_sm90_gmma.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cute/tensor.hpp>

namespace fpv2::index {

// One accumulator and two key buffers, three CTAs per SM: measured faster than two accumulators with the
// product of step n+1 under step n's exponentials at two CTAs per SM (benchmarks/NOTES.md, 2026-12-04).
// kGroups = 2 (opt-in, FPV2_SCORE_WARPGROUPS=2): two warpgroups split the tile's rows (64 each) and share each
// step's keys; each keeps its keys' energies over its own rows, and the selection adds the two halves. The
// layout the mean correction's pooled-value product needs (a d x 64 accumulator a warpgroup), two CTAs per SM.
template <class Element_, int kHeadDim_, int kGroups_ = 1>
struct ScoreTraits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kGroups = kGroups_;
  static_assert(kGroups == 1 || kGroups == 2, "one or two warpgroups");
  static constexpr int kCtasPerSm = kGroups == 1 ? 3 : 2;
  static constexpr int kTileRows = 128;  // packed query rows of a tile (FPV2_KERNEL_TILE_SIZE)
  static constexpr int kGroupRows = kTileRows / kGroups;  // rows of one warpgroup
  static constexpr int kStepKeys = 64;   // pooled keys per step (the wgmma's M)
  static constexpr int kThreads = 128 * kGroups;
  // Key buffers: the keys of step n+1 load while step n is reduced.
  static constexpr int kStages = 2;
  // Largest key-block count of a request: the tile's energies live in shared memory (64 KB).
  static constexpr int kMaxBlocks = 16384;
  static_assert(kHeadDim == 64 || kHeadDim == 128, "head dims 64 and 128");

  using MmaAtom = decltype(cute::SM90::GMMA::ss_op_selector<Element, Element, float,
                                                            cute::Shape<cute::Int<kStepKeys>, cute::Int<kGroupRows>,
                                                                        cute::Int<kHeadDim>>,
                                                            cute::GMMA::Major::K, cute::GMMA::Major::K>());
  // The warpgroups side by side along N (the rows): warpgroup w multiplies the keys by rows 64w .. 64w + 63.
  using TiledMma = decltype(cute::make_tiled_mma(
      MmaAtom{}, cute::Layout<cute::Shape<cute::_1, cute::Int<kGroups>, cute::_1>>{}));
  static_assert(cute::size(TiledMma{}) == kThreads, "each warpgroup issues its rows' product");

  // 128-byte swizzle atoms (8 rows x 64 elements): d = 64 is one atom wide, d = 128 two.
  using SmemLayoutAtom = cute::GMMA::Layout_K_SW128_Atom<Element>;
  using SmemLayoutQ = decltype(cute::tile_to_shape(SmemLayoutAtom{},
                                                   cute::Shape<cute::Int<kTileRows>, cute::Int<kHeadDim>>{}));
  using SmemLayoutKeys = decltype(cute::tile_to_shape(
      SmemLayoutAtom{}, cute::Shape<cute::Int<kStepKeys>, cute::Int<kHeadDim>, cute::Int<kStages>>{}));
};

// Shared memory of one CTA; the tile's log2 energies (one float per scored block) follow it.
template <class Traits>
struct ScoreSharedStorage {
  using Element = typename Traits::Element;
  alignas(1024) Element q[cute::cosize_v<typename Traits::SmemLayoutQ>];
  alignas(1024) Element keys[cute::cosize_v<typename Traits::SmemLayoutKeys>];
  float warp_max[Traits::kThreads / 32];
  int32_t warp_count[Traits::kThreads / 32];
  int32_t tile[6];  // the CTA's request lookup (score_tile.hpp)
};

}  // namespace fpv2::index
