// The index stage's scoring and selection on Hopper: persistent CTAs of one warpgroup, each walking (query
// tile, KV head) segments, heaviest first.
//
// Pass 1 walks the tile's candidate pooled keys 64 at a time. Step n's product S = K_n Q^T (64 keys x 128
// rows, fp32) is one wgmma; the keys of step n+1 arrive by one TMA transaction (issued by thread 0, completing
// on the buffer's mbarrier) in the other of two buffers while step n is reduced; the query rows are gathered by
// cp.async once a tile. Three CTAs share an SM, so one's exponentials run under another's product. A key's
// log2 energy L_J = log2(sum_r 2^s_rJ) goes to shared memory (reduce_shifted: the logits exponentiated as they
// are) and, where a warp's sum overflows or underflows, L_J = o_J + log2(sum_r 2^(s_rJ - o_J)) with o_J the
// key's maximum over the rows that see it (reduce); the running maximum over the tile's keys is kept in
// registers. Only the last step of a tile masks, and per logit only for a key some row does not see or a tile
// of fewer than 128 rows.
//
// Pass 2 thresholds the energies (2^(L_J - max L) >= alpha), adds the forced blocks and writes one keep
// word per 32 blocks with a warp ballot, and the segment's count. No energies leave the SM.
#pragma once

#include <cmath>
#include <cstdint>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "hopper/fragment_layouts.hpp"
#include "hopper/online_softmax.hpp"
#include "hopper/shared_copy.hpp"
#include "hopper/warpgroup_gemm.hpp"
#include "index/score_params.hpp"
#include "index/score_tile.hpp"
#include "index/score_traits.hpp"

namespace fpv2::index {

// log2(x) by lg2.approx (relative error ~2^-22); log2(0) = -inf.
__device__ __forceinline__ float fast_log2(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// m[0] = max(m[0 .. 2 kWidth - 1]) by halving steps of independent pairs (compile-time indices: the
// values stay in registers).
template <int kWidth>
__device__ __forceinline__ void fold_max(float* m) {
  if constexpr (kWidth >= 1) {
    CUTE_UNROLL
    for (int j = 0; j < kWidth; ++j) m[j] = fmaxf(m[j], m[j + kWidth]);
    fold_max<kWidth / 2>(m);
  }
}

template <class Traits>
struct ScoreSelect {
  using Element = typename Traits::Element;
  static constexpr int kChunks = Traits::kHeadDim * int(sizeof(Element)) / 16;  // 16-byte chunks per row
  static constexpr int kRowsPerPass = Traits::kThreads / kChunks;
  static constexpr int kChunkElements = 16 / int(sizeof(Element));
  static_assert(kRowsPerPass % 8 == 0, "a pass covers whole 8-row swizzle atoms");

  // The tile's packed rows: row r is position r / g of query head h g + r % g (PackGQA). A thread copies one
  // 16-byte chunk of rows r0, r0 + kRowsPerPass, ...: one division for r0, then the position and head advance
  // by fixed steps; the shared-memory destinations are fixed offsets apart (whole swizzle atoms per pass).
  template <class SmemQ>
  __device__ static void issue_query(SmemQ& sQ, ScoreParams<Element> const& p, ScoreTile const& t,
                                     ScoreGeometry const& g, int head) {
    using Layout = typename Traits::SmemLayoutQ;
    const int chunk = threadIdx.x % kChunks;
    const int row0 = threadIdx.x / kChunks;
    const int pass_bytes =
        (hopper::smem_offset<Layout>(kRowsPerPass, 0) - hopper::smem_offset<Layout>(0, 0)) * int(sizeof(Element));
    const uint32_t dst = uint32_t(cute::cast_smem_ptr_to_uint(&sQ(0, 0))) +
                         uint32_t(hopper::smem_offset<Layout>(row0, chunk * kChunkElements)) * uint32_t(sizeof(Element));
    const int packed0 = g.row_begin + row0;
    int position = packed0 / p.group;
    int member = packed0 - position * p.group;
    const int position_step = kRowsPerPass / p.group;
    const int member_step = kRowsPerPass - position_step * p.group;
    Element const* base = p.q + int64_t(head) * p.group * p.q_head_stride + chunk * kChunkElements;
    CUTE_UNROLL
    for (int pass = 0; pass < Traits::kTileRows / kRowsPerPass; ++pass) {
      const bool inside = row0 + pass * kRowsPerPass < g.num_rows;
      Element const* src =
          base + int64_t(t.q_start + position) * p.q_token_stride + int64_t(member) * p.q_head_stride;
      hopper::cp_async_16_zfill(dst + uint32_t(pass * pass_bytes), inside ? src : p.q, inside);
      position += position_step;
      member += member_step;
      if (member >= p.group) {
        member -= p.group;
        ++position;
      }
    }
  }

  // The first of the tile's rows that sees block `block` (0: all do; kTileRows: none).
  __device__ __forceinline__ static int first_seeing_row(ScoreParams<Element> const& p, ScoreGeometry const& g,
                                                         int block) {
    // Row r sees block J when J * Bk <= prefix + (row_begin + r) / g, i.e. (J * Bk - prefix) * g <= row.
    const int64_t ahead = int64_t(block) * p.block_size - g.prefix;
    const int64_t first_row = ahead > 0 ? ahead * p.group - g.row_begin : 0;
    return first_row > Traits::kTileRows ? Traits::kTileRows : int(first_row);
  }

  // The key blocks a thread holds in a step and whether each is a candidate. kMasked (a tile's last step): keys
  // past the candidates are not, and the logits of rows that do not see a key become -inf; only a key some row
  // does not see (at most the one block whose first token falls inside the tile's positions) or a tile of fewer
  // than 128 rows has any. The logits of keys past the candidates are left as they are: their energies are
  // never stored.
  template <bool kMasked, class AccRowsCols, class CoordRowsCols, int kKeys>
  __device__ __forceinline__ static void step_keys(AccRowsCols& s, CoordRowsCols const& coord, int first_key,
                                                   ScoreGeometry const& g, ScoreParams<Element> const& p,
                                                   int (&block)[kKeys], bool (&key_ok)[kKeys]) {
    using namespace cute;
    constexpr int kCols = decltype(size<1>(s))::value;
    CUTE_UNROLL
    for (int i = 0; i < kKeys; ++i) {
      block[i] = first_key + int(get<0>(coord(i, 0)));
      key_ok[i] = true;
      if constexpr (kMasked) {
        key_ok[i] = block[i] < g.num_candidates;
        const int min_row = first_seeing_row(p, g, block[i]);
        if (min_row > 0 || g.num_rows < Traits::kTileRows) {
          CUTE_UNROLL
          for (int j = 0; j < kCols; ++j) {
            const int row = int(get<1>(coord(i, j)));
            if (row < min_row || row >= g.num_rows) s(i, j) = -INFINITY;
          }
        }
      }
    }
  }

  // One step's energies from its accumulator (keys x rows view): stored for the tile's candidates, folded
  // into the running maximum. kMasked: the logits of rows that do not see a key, and keys past the
  // candidates, are left out.
  template <bool kMasked, class AccRowsCols, class CoordRowsCols>
  __device__ __forceinline__ static void reduce(AccRowsCols& s, CoordRowsCols const& coord, int first_key,
                                                ScoreGeometry const& g, ScoreParams<Element> const& p,
                                                float* energies, float& running_max) {
    using namespace cute;
    constexpr int kKeys = decltype(size<0>(s))::value;  // keys a thread holds (2)
    constexpr int kCols = decltype(size<1>(s))::value;  // rows of each (32)
    // The thread's keys side by side at every stage (independent chains: the warp's instruction stream has
    // twice the parallelism of one key after the other).
    int block[kKeys];
    bool key_ok[kKeys];
    step_keys<kMasked>(s, coord, first_key, g, p, block, key_ok);
    // Maximum over the thread's rows as a tree of independent pairs, then over the quad.
    float m[kKeys][kCols / 2];
    CUTE_UNROLL
    for (int j = 0; j < kCols / 2; ++j) {
      CUTE_UNROLL
      for (int i = 0; i < kKeys; ++i) m[i][j] = fmaxf(s(i, j), s(i, j + kCols / 2));
    }
    float offset[kKeys];
    CUTE_UNROLL
    for (int i = 0; i < kKeys; ++i) {
      fold_max<kCols / 4>(m[i]);
      const float key_max = hopper::quad_max(m[i][0]);
      offset[i] = key_max == -INFINITY ? 0.0f : key_max;
    }
    // Sums of 2^(s - max), four partial sums per key.
    float sums[kKeys][4];
    CUTE_UNROLL
    for (int i = 0; i < kKeys; ++i) sums[i][0] = sums[i][1] = sums[i][2] = sums[i][3] = 0.0f;
    CUTE_UNROLL
    for (int j = 0; j < kCols; ++j) {
      CUTE_UNROLL
      for (int i = 0; i < kKeys; ++i) {
        const float x = s(i, j) - offset[i];
        sums[i][j % 4] += hopper::fast_exp2(x);
      }
    }
    CUTE_UNROLL
    for (int i = 0; i < kKeys; ++i) {
      const float total = hopper::quad_sum((sums[i][0] + sums[i][1]) + (sums[i][2] + sums[i][3]));
      const float energy = offset[i] + fast_log2(total);  // -inf when no row sees the key
      if (key_ok[i]) {
        if (threadIdx.x % 4 == 0) energies[block[i]] = energy;
        running_max = fmaxf(running_max, energy);
      }
    }
  }

  // A step's energies with no offset per key instead of the key's own maximum over the rows (no maximum tree
  // before the exponentials): 2^s, s already in log2 units. Exact where no 2^s overflows (s >= 128) and the
  // key's sum is not below 1e-30 (every logit of the key below about -100); a warp that meets either redoes the
  // step with each key's own maximum (returns false: the caller calls reduce). Measured 3.3-4.8% off the kernel
  // against a cheap running-maximum offset, at bf16 and fp16, d = 64 and 128, with the same index
  // (benchmarks/NOTES.md, thirtieth and thirty-first sessions).
  // kMasked: keys past the candidates are skipped, and only a key that some row does not see (at most the one
  // block whose first token falls inside the tile's positions) or a tile of fewer than 128 rows masks per logit.
  template <bool kMasked, class AccRowsCols, class CoordRowsCols>
  __device__ __forceinline__ static bool reduce_shifted(AccRowsCols& s, CoordRowsCols const& coord, int first_key,
                                                        ScoreGeometry const& g, ScoreParams<Element> const& p,
                                                        float* energies, float& running_max) {
    using namespace cute;
    constexpr int kKeys = decltype(size<0>(s))::value;
    constexpr int kCols = decltype(size<1>(s))::value;
    int block[kKeys];
    bool key_ok[kKeys];
    step_keys<kMasked>(s, coord, first_key, g, p, block, key_ok);
    float sums[kKeys][4];
    CUTE_UNROLL
    for (int i = 0; i < kKeys; ++i) sums[i][0] = sums[i][1] = sums[i][2] = sums[i][3] = 0.0f;
    CUTE_UNROLL
    for (int j = 0; j < kCols; ++j) {
      CUTE_UNROLL
      for (int i = 0; i < kKeys; ++i) sums[i][j % 4] += hopper::fast_exp2(s(i, j));
    }
    float total[kKeys];
    bool redo = false;
    CUTE_UNROLL
    for (int i = 0; i < kKeys; ++i) {
      total[i] = hopper::quad_sum((sums[i][0] + sums[i][1]) + (sums[i][2] + sums[i][3]));
      // An overflow (inf) or an underflow (every logit of the key below about -100): the exact offsets instead.
      redo |= key_ok[i] && !(total[i] <= 3.0e38f && total[i] >= 1.0e-30f);
    }
    if (__any_sync(0xffffffffu, redo)) return false;
    CUTE_UNROLL
    for (int i = 0; i < kKeys; ++i) {
      if (key_ok[i]) {
        const float energy = fast_log2(total[i]);
        if (threadIdx.x % 4 == 0) energies[block[i]] = energy;
        running_max = fmaxf(running_max, energy);
      }
    }
    return true;
  }

  // One tile's geometry and where its keys start, for the walk and for the prefetch of its first loads.
  struct Work {
    ScoreTile tile;
    ScoreGeometry geometry;
    int head;
    int steps;
    int64_t segment;
  };

  // The segment `work` of the heaviest-first order (the last tiles of the batch, the most keys, first); the
  // request lookup is redone only when the walk leaves the cached request (uniform over the CTA).
  __device__ static Work locate(ScoreParams<Element> const& p, int64_t work, ScoreTile& cached, int32_t* slots) {
    Work w;
    const int64_t unit = p.num_tiles - 1 - work / p.num_kv_heads;
    w.head = int(work % p.num_kv_heads);
    if (unit < cached.tile_begin || unit >= int64_t(cached.tile_begin) + cached.tiles) {
      cached = find_tile(p, unit, Traits::kTileRows, slots);
    }
    w.tile = cached;
    w.tile.tile = int(unit - cached.tile_begin);
    w.geometry = tile_geometry(p, w.tile, Traits::kTileRows, Traits::kStepKeys);
    w.steps = (w.geometry.num_candidates + Traits::kStepKeys - 1) / Traits::kStepKeys;
    w.segment = int64_t(p.num_kv_heads) * w.tile.tile_begin + int64_t(w.head) * w.tile.tiles + w.tile.tile;
    return w;
  }

  // Keys of step `step` of `w` into buffer `stage` by one TMA transaction (one thread): rows past the
  // candidates are whatever follows them in the keys (their energies are never stored), rows past the keys'
  // end zeros.
  template <class KeysTma, class KeysDst>
  __device__ static void issue_keys_tma(typename Traits::TmaKeys const& tma, KeysTma const& m_keys, KeysDst& t_keys,
                                        uint64_t* full, Work const& w, int step, int stage) {
    using namespace cute;
    if (threadIdx.x == 0) {
      const int row0 = w.tile.block_base + step * Traits::kStepKeys;
      Tensor g_keys = local_tile(domain_offset(make_coord(row0, _0{}), m_keys), typename Traits::TileKeys{},
                                 make_coord(_0{}, w.head));  // (64, d)
      Tensor t_src = group_modes<0, 3>(tma.get_slice(_0{}).partition_S(g_keys));  // (TMA)
      cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(&full[stage], Traits::kStepKeyBytes);
      copy(tma.with(full[stage]), t_src, t_keys(_, stage));
    }
  }

  template <class SmemQ, class KeysTma, class KeysDst>
  __device__ static void issue_first_loads(SmemQ& sQ, typename Traits::TmaKeys const& tma, KeysTma const& m_keys,
                                           KeysDst& t_keys, uint64_t* full, ScoreParams<Element> const& p,
                                           Work const& w) {
    issue_query(sQ, p, w.tile, w.geometry, w.head);
    cute::cp_async_fence();
    issue_keys_tma(tma, m_keys, t_keys, full, w, 0, 0);
  }

  // Persistent CTAs: CTA c takes segments c, c + gridDim.x, ... As soon as a tile's last product is done, the
  // next tile is located and its query rows and first keys are issued, so that they load under the last
  // step's exponentials and the selection.
  __device__ static void run(ScoreParams<Element> const& p, typename Traits::TmaKeys const& tma, char* smem_base) {
    using namespace cute;
    auto& smem = *reinterpret_cast<ScoreSharedStorage<Traits>*>(smem_base);
    float* energies = reinterpret_cast<float*>(smem_base + sizeof(ScoreSharedStorage<Traits>));

    typename Traits::TiledMma mma;
    auto thr = mma.get_thread_slice(threadIdx.x);
    auto wg = mma.get_thread_slice(0);  // descriptors depend on the warpgroup only
    Tensor sQ = make_tensor(make_smem_ptr(smem.q), typename Traits::SmemLayoutQ{});
    Tensor sK = make_tensor(make_smem_ptr(smem.keys), typename Traits::SmemLayoutKeys{});
    Tensor m_keys = tma.get_tma_tensor(make_shape(p.key_rows, int32_t(p.key_block_stride)));       // (rows, Hkv * d)
    Tensor t_keys = group_modes<0, 3>(tma.get_slice(_0{}).partition_D(sK));       // (TMA, stages)
    uint64_t* full = smem.key_full;
    if (threadIdx.x == 0) {
      for (int s = 0; s < Traits::kStages; ++s) cutlass::arch::ClusterTransactionBarrier::init(&full[s], 1);
      cutlass::arch::fence_barrier_init();
    }
    __syncthreads();
    uint32_t phases = 0;  // bit s: the parity of buffer s's next completion
    Tensor tSrK = wg.partition_fragment_A(sK);  // (MMA, MMA_M, MMA_K, stages)
    Tensor tSrQ = wg.partition_fragment_B(sQ);  // (MMA, MMA_N, MMA_K)
    using TileS = Shape<Int<Traits::kStepKeys>, Int<Traits::kTileRows>>;
    Tensor acc = partition_fragment_C(mma, TileS{});
    Tensor acc_rc = make_tensor(acc.data(), hopper::accumulator_rows_cols(acc.layout()));
    Tensor cS = thr.partition_C(make_identity_tensor(TileS{}));
    Tensor cS_rc = make_tensor(cS.data(), hopper::accumulator_rows_cols(cS.layout()));

    ScoreTile cached{};
    cached.tiles = 0;  // nothing cached: every unit lies outside
    int64_t work = blockIdx.x;
    if (work >= p.num_segments) return;
    Work w = locate(p, work, cached, smem.tile);
    if (w.steps > 0) issue_first_loads(sQ, tma, m_keys, t_keys, full, p, w);
    while (true) {
      const ScoreGeometry& g = w.geometry;
      const int64_t next_work = work + gridDim.x;
      const bool has_next = next_work < p.num_segments;
      Work next{};
      // Locates the next tile and issues its first loads: once this tile no longer reads Q or the keys.
      auto prefetch_next = [&]() CUTLASS_LAMBDA_FUNC_INLINE {
        if (has_next) {
          next = locate(p, next_work, cached, smem.tile);
          if (next.steps > 0) issue_first_loads(sQ, tma, m_keys, t_keys, full, p, next);
        }
      };
      float running_max = -INFINITY;
      if (w.steps == 0) {
        prefetch_next();
      } else {
        // Step n: keys n landed (the buffer's mbarrier; in a tile's first step also the query rows' cp.async),
        // then the CTA barrier, which also means every warp has waited for product n-1, so the other buffer
        // may be refilled; product n; keys n+1 into the other buffer; wait for the product; reduce it. After
        // the last product, the next tile's first loads.
        for (int n = 0; n < w.steps; ++n) {
          const int stage = n % 2;
          if (n == 0) {
            cute::cp_async_wait<0>();  // the query rows
            cutlass::arch::fence_view_async_shared();
          }
          cutlass::arch::ClusterTransactionBarrier::wait(&full[stage], (phases >> stage) & 1u);
          phases ^= 1u << stage;
          __syncthreads();
          auto keys_now = tSrK(_, _, _, n % 2);
          hopper::warpgroup_gemm_issue<true>(mma, keys_now, tSrQ, acc);
          const bool last = n + 1 == w.steps;
          if (!last) issue_keys_tma(tma, m_keys, t_keys, full, w, n + 1, (n + 1) % 2);
          warpgroup_wait<0>();
          warpgroup_fence_operand(acc_rc);
          if (last) {
            __syncthreads();  // every warp is past the last product: Q and both key buffers are free
            prefetch_next();
          }
          const int first_key = n * Traits::kStepKeys;
          // No offsets first; the exact ones only where a warp met an overflow or underflow (reduce_shifted).
          if (first_key + Traits::kStepKeys <= g.num_full) {
            if (!reduce_shifted<false>(acc_rc, cS_rc, first_key, g, p, energies, running_max)) {
              reduce<false>(acc_rc, cS_rc, first_key, g, p, energies, running_max);
            }
          } else if (!reduce_shifted<true>(acc_rc, cS_rc, first_key, g, p, energies, running_max)) {
            reduce<true>(acc_rc, cS_rc, first_key, g, p, energies, running_max);
          }
        }
      }
      select(p, smem, energies, w, running_max);
      if (!has_next) break;
      work = next_work;
      w = next;
    }
  }

  // Pass 2: the tile's peak energy, then one ballot per 32 blocks, and the segment's count.
  __device__ static void select(ScoreParams<Element> const& p, ScoreSharedStorage<Traits>& smem,
                                float const* energies, Work const& w, float running_max) {
    const ScoreGeometry& g = w.geometry;
    const int lane = threadIdx.x % 32;
    const int warp = threadIdx.x / 32;
    float peak = running_max;
    for (int offset = 16; offset >= 1; offset /= 2) peak = fmaxf(peak, __shfl_xor_sync(0xffffffffu, peak, offset));
    if (lane == 0) smem.warp_max[warp] = peak;
    __syncthreads();  // also publishes the energies
    peak = fmaxf(fmaxf(smem.warp_max[0], smem.warp_max[1]), fmaxf(smem.warp_max[2], smem.warp_max[3]));
    // E_J >= alpha max E, never when nothing was scored.
    const float threshold = peak == -INFINITY ? INFINITY : p.alpha;
    const float peak_offset = peak == -INFINITY ? 0.0f : peak;
    const int num_words = (g.num_visible + 63) / 64 * 2;
    uint32_t* bits_row = p.keep_bits + w.segment * p.bits_stride;
    int count = 0;
    for (int word = warp; word < num_words; word += Traits::kThreads / 32) {
      const int block = word * 32 + lane;
      const bool scored = block < g.num_candidates;
      const float energy = scored ? energies[block] : -INFINITY;
      bool keep = scored && hopper::fast_exp2(energy - peak_offset) >= threshold;
      const bool forced = block < p.sink_blocks || (block >= g.window_lo && block <= g.window_hi) ||
                          block >= g.first_diagonal;
      keep = (keep || forced || g.dense) && block < g.num_visible;
      const uint32_t bits = __ballot_sync(0xffffffffu, keep);
      if (lane == 0) bits_row[word] = bits;
      count += __popc(bits);
    }
    if (lane == 0) smem.warp_count[warp] = count;
    __syncthreads();  // also: every thread is done with warp_max and the energies before the next tile
    if (threadIdx.x == 0) {
      p.counts[w.segment] = smem.warp_count[0] + smem.warp_count[1] + smem.warp_count[2] + smem.warp_count[3];
    }
  }
};

template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads, Traits::kCtasPerSm) score_select_kernel(ScoreParams<typename Traits::Element> p, __grid_constant__ const typename Traits::TmaKeys tma) {
  extern __shared__ char smem_raw[];
  // The swizzled buffers need 1024-byte aligned addresses (the hardware swizzles on address bits).
  char* base = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  ScoreSelect<Traits>::run(p, tma, base);
}

}  // namespace fpv2::index
