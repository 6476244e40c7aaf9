// Compile-time shape of the scoring kernel: one warpgroup scores a 128-row query tile against 64 pooled
// keys per step with one wgmma, keys as the M side (A) and the tile's rows as N (B), so that each key's
// reduction over rows stays inside a quad of lanes (fragment_layouts.hpp: a thread holds 2 keys x 32 rows).
#pragma once

#include <cstdint>

#include <cute/arch/mma_sm90_gmma.hpp>
#include <cute/atom/copy_traits_sm90_tma.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cute/tensor.hpp>

namespace fpv2::index {

// One accumulator and two key buffers, three CTAs per SM: measured faster than two accumulators with the
// product of step n+1 under step n's exponentials at two CTAs per SM (benchmarks/NOTES.md, 2026-12-04).
template <class Element_, int kHeadDim_>
struct ScoreTraits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kCtasPerSm = 3;
  static constexpr int kTileRows = 128;  // packed query rows of a tile (FPV2_KERNEL_TILE_SIZE)
  static constexpr int kStepKeys = 64;   // pooled keys per step (the wgmma's M)
  static constexpr int kThreads = 128;   // one warpgroup
  // Key buffers: the keys of step n+1 load while step n is reduced.
  static constexpr int kStages = 2;
  // Largest key-block count of a request: the tile's energies live in shared memory (64 KB).
  static constexpr int kMaxBlocks = 16384;
  static_assert(kHeadDim == 64 || kHeadDim == 128, "head dims 64 and 128");

  using MmaAtom = decltype(cute::SM90::GMMA::ss_op_selector<Element, Element, float,
                                                            cute::Shape<cute::Int<kStepKeys>, cute::Int<kTileRows>,
                                                                        cute::Int<kHeadDim>>,
                                                            cute::GMMA::Major::K, cute::GMMA::Major::K>());
  using TiledMma = decltype(cute::make_tiled_mma(MmaAtom{}));
  static_assert(cute::size(TiledMma{}) == kThreads, "one warpgroup issues the product");

  // 128-byte swizzle atoms (8 rows x 64 elements): d = 64 is one atom wide, d = 128 two.
  using SmemLayoutAtom = cute::GMMA::Layout_K_SW128_Atom<Element>;
  using SmemLayoutQ = decltype(cute::tile_to_shape(SmemLayoutAtom{},
                                                   cute::Shape<cute::Int<kTileRows>, cute::Int<kHeadDim>>{}));
  using SmemLayoutKeys = decltype(cute::tile_to_shape(
      SmemLayoutAtom{}, cute::Shape<cute::Int<kStepKeys>, cute::Int<kHeadDim>, cute::Int<kStages>>{}));

  // A step's keys by TMA: the pooled keys (total_blocks, Hkv, d) as a (total_blocks, Hkv * d) row-major matrix,
  // one (64, d) box per step at row block_base + 64 n and column block `head`, into one stage of the buffer.
  using TileKeys = cute::Shape<cute::Int<kStepKeys>, cute::Int<kHeadDim>>;
  using SmemLayoutKeysStage = decltype(cute::tile_to_shape(SmemLayoutAtom{}, TileKeys{}));
  static constexpr uint32_t kStepKeyBytes = uint32_t(kStepKeys * kHeadDim * sizeof(Element));
  using TmaKeys = decltype(cute::make_tma_copy(
      cute::SM90_TMA_LOAD{},
      cute::make_tensor(cute::make_gmem_ptr(static_cast<Element const*>(nullptr)),
                        cute::Shape<int32_t, int32_t>{}, cute::Stride<int64_t, cute::_1>{}),
      SmemLayoutKeysStage{}, TileKeys{}, cute::_1{}));
};

// Shared memory of one CTA; the tile's log2 energies (one float per scored block) follow it.
template <class Traits>
struct ScoreSharedStorage {
  using Element = typename Traits::Element;
  alignas(1024) Element q[cute::cosize_v<typename Traits::SmemLayoutQ>];
  alignas(1024) Element keys[cute::cosize_v<typename Traits::SmemLayoutKeys>];
  alignas(8) uint64_t key_full[Traits::kStages];  // one TMA transaction barrier a key buffer
  float warp_max[Traits::kThreads / 32];
  int32_t warp_count[Traits::kThreads / 32];
  int32_t tile[6];  // the CTA's request lookup (score_tile.hpp)
};

}  // namespace fpv2::index
