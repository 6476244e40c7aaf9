// Host-only checks of the prefill kernel's register and shared-memory index algebra (no GPU needed).
//
// The kernel relies on facts that CuTe layouts imply but that a typo would silently break:
//   1. the fp32 S accumulator of a consumer thread, regrouped as the RS A operand
//      (accumulator_as_operand_a), holds exactly the (row, kv) entries the PV wgmma expects in each A
//      register; otherwise P would be multiplied with the wrong V rows;
//   2. S and O rows of a thread coincide (the softmax rescales O rows with S-row statistics), each thread's
//      rows lie in its consumer warpgroup's 64-row half, the epilogue's pairs (j, j + 1) are adjacent
//      columns of one row, and the quad of threads sharing a row holds each 8-column group as its 4 words
//      (the 16-byte stores' transpose);
//   3. 16-byte chunks (8 bf16) of Q and K rows and of V^T columns stay contiguous and 16-byte aligned in the
//      swizzled shared-memory layouts (cp.async of Q, the K/V gather and the V tail clearing write such chunks),
//      the 32-bit offsets of smem_offset() (the lane-pair gather's destinations) are the addresses of CuTe's
//      swizzled pointers into a 1024-byte aligned buffer, in every stage, and chunk k of a 64-element
//      segment is chunk 0 XOR 8 k elements (the gather's per-chunk addresses);
//   4. TileGeometry's block range against brute force over every row and column: n_block_max is exact, no
//      block below n_block_masked hides a column from any row, and the tail-block test matches; the
//      correction's eligible index blocks (n_pooled_eligible) are fully visible, for 128-token tiles and for
//      the 64-token tiles of d = 256;
//   5. BlockSchedule over random CSR segments: with 64-token tiles (two per index block, d = 256) it visits
//      exactly the visible tiles of the kept blocks, each once, in descending order, and every kept block at
//      least once; with 128-token tiles, the kept blocks themselves; split-KV's parts cover that schedule
//      and its pooled tiles exactly once, in order, balanced to one stage;
//   6. the default schedule (schedule_default.hpp) on the calls it was measured on and the ones it leaves out.
// Checks 1-3 run for the traits of every built head dim (kPrefillHeadDims), which also prints the shared
// memory each instantiation asks for. Prints the layouts it used and exits 1 if any check failed.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <initializer_list>
#include <random>
#include <vector>

#include <cute/tensor.hpp>

#include "fpv2/fpv2.h"

#include "hopper/prefill_traits.hpp"
#include "hopper/fragment_layouts.hpp"
#include "hopper/pooled_e4m3_operands.hpp"
#include "hopper/prefill_instances.hpp"
#include "hopper/shared_copy.hpp"
#include "hopper/shared_storage.hpp"
#include "hopper/persistent_order.hpp"
#include "hopper/schedule_default.hpp"
#include "hopper/block_schedule.hpp"
#include "hopper/split_kv.hpp"
#include "hopper/tile_geometry.hpp"
#include "hopper/work_order.hpp"
#include "index/score_traits.hpp"

using namespace cute;

namespace {

int g_failures = 0;

void expect(bool ok, const char* what, long a = 0, long b = 0, long c = 0) {
  if (!ok) {
    if (g_failures < 20) std::printf("  FAIL: %s (%ld, %ld, %ld)\n", what, a, b, c);
    ++g_failures;
  }
}

template <class Traits>
void check_p_operand() {
  using TileS = Shape<Int<Traits::kBlockM>, Int<Traits::kBlockN>>;
  typename Traits::TiledMmaQK mma_qk;
  typename Traits::TiledMmaPV mma_pv;
  for (int t = 0; t < Traits::kNumConsumerThreads; ++t) {
    Tensor acc = mma_qk.get_thread_slice(t).partition_C(make_identity_tensor(TileS{}));
    Tensor as_a = make_tensor(acc.data(), fpv2::hopper::accumulator_as_operand_a(acc.layout()));
    Tensor want = mma_pv.get_thread_slice(t).partition_A(make_identity_tensor(TileS{}));  // (m, kv) of A
    if (t == 0) {
      std::printf("S accumulator layout : ");
      print(acc.layout());
      std::printf("\nP as A operand layout: ");
      print(as_a.layout());
      std::printf("\nPV A partition layout: ");
      print(want.layout());
      std::printf("\n");
    }
    static_assert(decltype(size<0>(as_a))::value == decltype(size<0>(want))::value, "A values per k-block");
    static_assert(decltype(size<1>(as_a))::value == decltype(size<1>(want))::value, "A M tiles");
    static_assert(decltype(size<2>(as_a))::value == decltype(size<2>(want))::value, "A k-blocks");
    for (int v = 0; v < size<0>(want); ++v) {
      for (int m = 0; m < size<1>(want); ++m) {
        for (int k = 0; k < size<2>(want); ++k) {
          const auto got = as_a(v, m, k);
          const auto exp = want(v, m, k);
          expect(get<0>(got) == get<0>(exp) && get<1>(got) == get<1>(exp),
                 "P register holds the (row, kv) the PV A operand expects: thread, value, k-block", t, v, k);
        }
      }
    }
  }
}

// The FP8 pooled products (pooled_e4m3_operands.hpp): the e4m3 A fragments of Q and P against CuTe's
// 8-bit RS layouts, the slot order of the pooled V^T tile against FPV2_E4M3_SLOT, and the S / O
// accumulators of the FP8 MMAs against the bf16 ones whose registers they share.
template <class Traits>
void check_e4m3_operands() {
  using TileS = Shape<Int<Traits::kBlockM>, Int<Traits::kBlockN>>;
  using TileO = Shape<Int<Traits::kBlockM>, Int<Traits::kHeadDim>>;
  typename Traits::TiledMmaQK mma_qk;
  typename Traits::TiledMmaPV mma_pv;
  typename Traits::TiledMmaQKE4M3 mma_qk8;
  typename Traits::TiledMmaPVE4M3 mma_pv8;
  for (int slot = 0; slot < 64; ++slot) {
    const int block = fpv2::hopper::e4m3_slot_block(slot);
    expect(FPV2_E4M3_SLOT(block) == slot, "FPV2_E4M3_SLOT inverts e4m3_slot_block: slot, block", slot, block);
    expect(block / 16 == slot / 16, "the slot order stays inside its group of 16: slot, block", slot, block);
  }
  for (int t = 0; t < Traits::kNumConsumerThreads; ++t) {
    Tensor s = mma_qk.get_thread_slice(t).partition_C(make_identity_tensor(TileS{}));
    Tensor s8 = mma_qk8.get_thread_slice(t).partition_C(make_identity_tensor(TileS{}));
    Tensor o = mma_pv.get_thread_slice(t).partition_C(make_identity_tensor(TileO{}));
    Tensor o8 = mma_pv8.get_thread_slice(t).partition_C(make_identity_tensor(TileO{}));
    static_assert(decltype(size(s))::value == decltype(size(s8))::value, "S fragments of equal size");
    static_assert(decltype(size(o))::value == decltype(size(o8))::value, "O fragments of equal size");
    for (int v = 0; v < size(s); ++v) {
      expect(s(v) == s8(v), "the FP8 QK accumulator is the bf16 one: thread, value", t, v);
    }
    for (int v = 0; v < size(o); ++v) {
      expect(o(v) == o8(v), "the FP8 PV accumulator is the bf16 one: thread, value", t, v);
    }
    // P: A value v of the PV product (row m, slot k) comes from S value e4m3_p_source(v), which must be
    // row m and the column of the block that slot k holds.
    Tensor p_want = mma_pv8.get_thread_slice(t).partition_A(make_identity_tensor(TileS{}));
    static_assert(decltype(size(p_want))::value == decltype(size(s))::value, "P reuses every score register");
    expect(size(make_layout(partition_shape_A(mma_pv8, TileS{}))) == size(p_want), "P fragment shape", t);
    for (int v = 0; v < size(p_want); ++v) {
      const auto src = s(fpv2::hopper::e4m3_p_source(v));
      const int m = get<0>(p_want(v)), k = get<1>(p_want(v));
      expect(int(get<0>(src)) == m && int(get<1>(src)) == fpv2::hopper::e4m3_slot_block(k),
             "e4m3 P slot holds its block's score: thread, value, slot", t, v, k);
    }
    // Q: value v's row is the thread's S row e4m3_a_row(v) (the row scales are per S row).
    Tensor q_want = mma_qk8.get_thread_slice(t).partition_A(make_identity_tensor(TileO{}));
    Tensor s_rc = make_tensor(s.data(), fpv2::hopper::accumulator_rows_cols(s.layout()));
    static_assert(decltype(size<0>(s_rc))::value == 2, "two rows per thread");
    for (int v = 0; v < size(q_want); ++v) {
      expect(int(get<0>(q_want(v))) == int(get<0>(s_rc(fpv2::hopper::e4m3_a_row(v), 0))),
             "e4m3 Q value's row is the S row of its scale: thread, value", t, v);
    }
    if (t == 0) {
      std::printf("e4m3 P A partition layout: ");
      print(p_want.layout());
      std::printf("\ne4m3 Q A partition layout: ");
      print(q_want.layout());
      std::printf("\n");
    }
  }
}

template <class Traits>
void check_rows() {
  using TileS = Shape<Int<Traits::kBlockM>, Int<Traits::kBlockN>>;
  using TileO = Shape<Int<Traits::kBlockM>, Int<Traits::kHeadDim>>;
  typename Traits::TiledMmaQK mma_qk;
  typename Traits::TiledMmaPV mma_pv;
  for (int t = 0; t < Traits::kNumConsumerThreads; ++t) {
    Tensor s = mma_qk.get_thread_slice(t).partition_C(make_identity_tensor(TileS{}));
    Tensor o = mma_pv.get_thread_slice(t).partition_C(make_identity_tensor(TileO{}));
    Tensor s_rc = make_tensor(s.data(), fpv2::hopper::accumulator_rows_cols(s.layout()));
    Tensor o_rc = make_tensor(o.data(), fpv2::hopper::accumulator_rows_cols(o.layout()));
    const int wg = t / Traits::kThreadsPerWarpGroup;
    for (int i = 0; i < size<0>(s_rc); ++i) {
      const int row = get<0>(s_rc(i, 0));
      expect(row == int(get<0>(o_rc(i, 0))), "S row i equals O row i: thread, i", t, i);
      expect(row / Traits::kRowsPerConsumer == wg, "row lies in the warpgroup's half: thread, row", t, row);
      for (int j = 0; j < size<1>(s_rc); ++j) {
        expect(int(get<0>(s_rc(i, j))) == row, "S row fixed along the thread's columns: thread, i, j", t, i, j);
      }
      for (int j = 0; j < size<1>(o_rc); ++j) {
        expect(int(get<0>(o_rc(i, j))) == row, "O row fixed along the thread's columns: thread, i, j", t, i, j);
      }
      for (int j = 0; j + 1 < size<1>(o_rc); j += 2) {
        const int col = get<1>(o_rc(i, j));
        expect(col % 2 == 0 && int(get<1>(o_rc(i, j + 1))) == col + 1,
               "epilogue pair (j, j+1) is an aligned column pair: thread, j, col", t, j, col);
        // The 16-byte stores' quad transpose (epilogue_store.hpp): word j / 2 of the thread is part t % 4 of
        // 8-column group j / 2, and the quad's four threads hold the same row.
        expect(col == 8 * (j / 2) + 2 * (t % 4), "epilogue word j/2 is part t%4 of column group j/2: thread, j, col",
               t, j, col);
      }
      for (int partner = (t & ~3); partner < (t & ~3) + 4; ++partner) {
        Tensor p = mma_pv.get_thread_slice(partner).partition_C(make_identity_tensor(TileO{}));
        Tensor p_rc = make_tensor(p.data(), fpv2::hopper::accumulator_rows_cols(p.layout()));
        expect(int(get<0>(p_rc(i, 0))) == row, "the quad's threads share row i: thread, partner, i", t, partner, i);
      }
      // The lse is written by the thread whose first column is 0: exactly one thread per row.
    }
  }
  // Exactly one thread holds column 0 of each row.
  int owners[Traits::kBlockM] = {};
  for (int t = 0; t < Traits::kNumConsumerThreads; ++t) {
    Tensor o = mma_pv.get_thread_slice(t).partition_C(make_identity_tensor(TileO{}));
    Tensor o_rc = make_tensor(o.data(), fpv2::hopper::accumulator_rows_cols(o.layout()));
    for (int i = 0; i < size<0>(o_rc); ++i) {
      if (get<1>(o_rc(i, 0)) == 0) ++owners[int(get<0>(o_rc(i, 0)))];
    }
  }
  for (int r = 0; r < Traits::kBlockM; ++r) {
    expect(owners[r] == 1, "one lse writer per row: row, writers", r, owners[r]);
  }
}

template <class SmemLayout, class Index>
void check_chunks(const char* name, SmemLayout layout, Index index, int outer, int inner) {
  // index(a, chunk_start + e) must be offset(a, chunk_start) + e, with a 16-byte aligned chunk start.
  for (int a = 0; a < outer; ++a) {
    for (int c = 0; c < inner; c += 8) {
      const long base = index(layout, a, c);
      expect(base % 8 == 0, name, a, c, base);
      for (int e = 1; e < 8; ++e) expect(index(layout, a, c + e) == base + e, name, a, c, e);
    }
  }
}

// smem_offset<Layout>(coord) against the element offset of &tensor(coord) for a tensor of CuTe's swizzled
// shared-memory pointers at a 1024-byte aligned (never dereferenced) base: the swizzle acts on address bits.
template <class SmemLayout, class Coord>
void expect_offset_matches_pointer(const char* name, Coord const& coord, long a, long b, long c) {
  using Element = cutlass::bfloat16_t;  // the kernel's element type
  Element* const base = reinterpret_cast<Element*>(uintptr_t(1) << 20);
  Tensor t = make_tensor(make_smem_ptr(base), SmemLayout{});
  const long pointer_offset = long(raw_pointer_cast(&t(coord)) - base);
  expect(fpv2::hopper::smem_offset<SmemLayout>(coord) == pointer_offset, name, a, b, c);
}

template <class Traits>
void check_smem_chunks() {
  using LayoutQ = typename Traits::SmemLayoutQ;
  using LayoutK = typename Traits::SmemLayoutK;
  using LayoutVt = typename Traits::SmemLayoutVt;
  std::printf("SmemLayoutQ : ");
  print(LayoutQ{});
  std::printf("\nSmemLayoutVt: ");
  print(LayoutVt{});
  std::printf("\n");
  // The chunks are checked on the element offsets the hardware sees (the swizzle of address bits, in
  // elements), i.e. smem_offset, which is itself checked against CuTe's swizzled pointers below.
  check_chunks("Q chunk (row, col) contiguous and aligned", LayoutQ{},
               [](auto const&, int row, int col) { return long(fpv2::hopper::smem_offset<LayoutQ>(row, col)); },
               Traits::kBlockM, Traits::kHeadDim);
  // Stage s of K and of V^T is the s-th dense tile: TMA boxes and wgmma descriptors address it from a
  // 1024-byte aligned base (the 128-byte swizzle repeats every 8 rows of 128 bytes).
  constexpr long kTileElems = long(Traits::kBlockN) * Traits::kHeadDim;
  for (int stage = 0; stage < Traits::kStages; ++stage) {
    const long k_base = fpv2::hopper::smem_offset<LayoutK>(0, 0, stage);
    const long v_base = fpv2::hopper::smem_offset<LayoutVt>(0, 0, stage);
    expect(k_base == stage * kTileElems && (k_base * 2) % 1024 == 0, "K stage base: stage, offset", stage, k_base);
    expect(v_base == stage * kTileElems && (v_base * 2) % 1024 == 0, "V^T stage base: stage, offset", stage, v_base);
  }
  for (int stage = 0; stage < Traits::kStages; ++stage) {
    // The cp.async gather producers write K rows and V^T columns in such chunks, into every stage.
    check_chunks("K chunk (row, col..col+7) contiguous and aligned", LayoutK{},
                 [stage](auto const&, int row, int col) {
                   return long(fpv2::hopper::smem_offset<LayoutK>(row, col, stage));
                 },
                 Traits::kBlockN, Traits::kHeadDim);
    check_chunks("V^T chunk (col..col+7, kv) contiguous and aligned", LayoutVt{},
                 [stage](auto const&, int kv, int col) {
                   return long(fpv2::hopper::smem_offset<LayoutVt>(col, kv, stage));
                 },
                 Traits::kBlockN, Traits::kHeadDim);
    // The lane-pair gather (kv_gather_producer.hpp) addresses chunk k of a 64-element segment as chunk 0 XOR 16 k
    // bytes (8 k elements).
    for (int row = 0; row < Traits::kBlockN; ++row) {
      for (int col = 0; col < Traits::kHeadDim; col += 8) {
        const int first = col - col % 64, k = (col % 64) / 8;
        expect(fpv2::hopper::smem_offset<LayoutK>(row, col, stage) ==
                   (fpv2::hopper::smem_offset<LayoutK>(row, first, stage) ^ (8 * k)),
               "K chunk k of a segment = chunk 0 XOR 8 k: row, col, stage", row, col, stage);
        expect(fpv2::hopper::smem_offset<LayoutVt>(col, row, stage) ==
                   (fpv2::hopper::smem_offset<LayoutVt>(first, row, stage) ^ (8 * k)),
               "V^T chunk k of a segment = chunk 0 XOR 8 k: kv, col, stage", row, col, stage);
      }
    }
    for (int row = 0; row < Traits::kBlockN; ++row) {
      for (int col = 0; col < Traits::kHeadDim; ++col) {
        expect_offset_matches_pointer<LayoutK>("K smem_offset = swizzled pointer: row, col, stage",
                                               make_coord(row, col, stage), row, col, stage);
        expect_offset_matches_pointer<LayoutVt>("V^T smem_offset = swizzled pointer: kv, col, stage",
                                                make_coord(col, row, stage), row, col, stage);
      }
    }
  }
  for (int row = 0; row < Traits::kBlockM; ++row) {
    for (int col = 0; col < Traits::kHeadDim; ++col) {
      expect_offset_matches_pointer<LayoutQ>("Q smem_offset = swizzled pointer: row, col", make_coord(row, col), row,
                                             col, 0);
    }
  }
}

template <class Traits>
void check_geometry() {
  using Geometry = fpv2::hopper::TileGeometry<Traits::kBlockM, Traits::kBlockN, Traits::kBlockSize>;
  constexpr int N = Traits::kBlockN;
  constexpr int kBlock = Traits::kBlockSize;
  std::mt19937 rng(1234);
  const int groups[] = {1, 2, 3, 4, 5, 6, 8, 16};
  int tiles = 0;
  for (int trial = 0; trial < 400; ++trial) {
    const int group = groups[rng() % 8];
    const int q_len = 1 + int(rng() % 700);
    const int prefix = (trial % 3 == 0) ? 0 : int(rng() % 900);
    const int32_t cu[2] = {17, 17 + q_len};
    const int32_t seqlens_k[1] = {prefix + q_len};
    const int num_rows = q_len * group;
    const int num_tiles = (num_rows + Traits::kBlockM - 1) / Traits::kBlockM;
    for (int m = 0; m <= num_tiles; ++m) {
      const Geometry g = Geometry::load(0, 0, m, group, cu, seqlens_k);
      if (m == num_tiles) {
        expect(!g.valid(), "slot past the last tile is invalid: q_len, group, m", q_len, group, m);
        continue;
      }
      ++tiles;
      expect(g.valid(), "tile is valid: q_len, group, m", q_len, group, m);
      int max_limit = -1, min_limit = 1 << 30;
      for (int r = m * Traits::kBlockM; r < std::min((m + 1) * Traits::kBlockM, num_rows); ++r) {
        const int limit = prefix + r / group;  // the definition: position r / g sees 0 .. prefix + r / g
        expect(g.column_limit(r, group) == limit, "column limit of a valid row: r, group, prefix", r, group, prefix);
        max_limit = std::max(max_limit, limit);
        min_limit = std::min(min_limit, limit);
      }
      expect(g.n_block_max == max_limit / N + 1, "n_block_max exact: q_len, group, m", q_len, group, m);
      expect(g.n_block_masked * N - 1 <= min_limit, "blocks below n_block_masked fully visible: q_len, group, m",
             q_len, group, m);
      expect(g.n_block_masked <= g.n_block_max - 1, "at least the last block is masked: q_len, group, m", q_len,
             group, m);
      // The correction's eligible blocks: the reference's count (first row's limit / block), fully visible.
      expect(g.n_pooled_eligible == (prefix + (m * Traits::kBlockM) / group) / kBlock,
             "n_pooled_eligible = first row's limit / block: q_len, group, m", q_len, group, m);
      expect(g.n_pooled_eligible * kBlock - 1 <= min_limit, "eligible blocks fully visible: q_len, group, m", q_len,
             group, m);
      expect(g.n_pooled_eligible * (kBlock / N) <= g.n_block_masked, "eligible blocks lie below the masked band",
             q_len, group, m);
      // Rows past the request (zero-filled) never see a column at or past seqlen_k.
      expect(g.column_limit(num_rows + 5, group) <= seqlens_k[0] - 1, "padding rows clamp: q_len, group, m", q_len,
             group, m);
      const int tail = (seqlens_k[0] - 1) / N;
      for (int n = 0; n < g.n_block_max; ++n) {
        const bool partial = (seqlens_k[0] % N) != 0 && n == tail;
        expect(g.is_partial_tail_block(n) == partial, "tail block test: seqlen_k, n", seqlens_k[0], n);
        if (partial) {
          expect(n >= g.n_block_masked, "the tail block is in the masked band: seqlen_k, n", seqlens_k[0], n);
        }
      }
    }
  }
  std::printf("geometry: %d tiles checked\n", tiles);
}

// The few fields of the kernel parameters that BlockSchedule::make reads.
struct ScheduleParams {
  const int32_t* index_offsets;
  const int32_t* index_blocks;
  const int32_t* index_tile_offsets;
  int num_kv_heads;
  int has_correction;
  int num_splits;
};

// BlockSchedule against the set it must visit: random ascending CSR segments of visible blocks (the
// diagonal block always kept, as the index forces it), one request, one KV head.
template <class Traits>
void check_schedule() {
  using Geometry = fpv2::hopper::TileGeometry<Traits::kBlockM, Traits::kBlockN, Traits::kBlockSize>;
  using Schedule = fpv2::hopper::BlockScheduleFor<Traits>;
  using SplitSchedule = fpv2::hopper::BlockSchedule<Traits::kTilesPerBlock, /*kSplitKv=*/true>;
  constexpr int kTiles = Traits::kTilesPerBlock;
  std::mt19937 rng(99 + Traits::kHeadDim);
  int visited = 0;
  for (int trial = 0; trial < 300; ++trial) {
    const int group = 1 << (rng() % 4);
    const int q_len = 1 + int(rng() % 900);
    const int prefix = (trial % 3 == 0) ? 0 : int(rng() % 700);
    const int32_t cu[2] = {0, q_len};
    const int32_t seqlens_k[1] = {prefix + q_len};
    const int num_tiles = (q_len * group + Traits::kBlockM - 1) / Traits::kBlockM;
    std::vector<int32_t> offsets{0}, blocks;
    for (int m = 0; m < num_tiles; ++m) {
      const Geometry g = Geometry::load(0, 0, m, group, cu, seqlens_k);
      const int last_block = (g.n_block_max - 1) / kTiles;  // the diagonal index block
      for (int j = 0; j < last_block; ++j) {
        if (rng() % 3 == 0) blocks.push_back(j);
      }
      blocks.push_back(last_block);
      offsets.push_back(int32_t(blocks.size()));
    }
    const int32_t tile_offsets[2] = {0, num_tiles};
    const ScheduleParams params{offsets.data(), blocks.data(), tile_offsets, 1, 1, 1};
    for (int m = 0; m < num_tiles; ++m) {
      const Geometry g = Geometry::load(0, 0, m, group, cu, seqlens_k);
      const Schedule s = Schedule::make(params, g, Traits::kBlockN);
      std::vector<int> expected;
      for (int k = offsets[m + 1] - 1; k >= offsets[m]; --k) {
        for (int t = kTiles - 1; t >= 0; --t) {
          const int n = blocks[k] * kTiles + t;
          if (n < g.n_block_max) expected.push_back(n);
        }
      }
      expect(s.num_kept == int(expected.size()), "schedule length: tile, kept tiles, expected", m, s.num_kept,
             long(expected.size()));
      expect(s.num_kept_blocks == offsets[m + 1] - offsets[m], "schedule's kept block count: tile", m);
      for (int i = 0; i < std::min(s.num_kept, int(expected.size())); ++i) {
        expect(s.block(i) == expected[i], "schedule's i-th tile: i, got, expected", i, s.block(i), expected[i]);
      }
      expect(s.num_correction == (g.n_pooled_eligible + Traits::kBlockN - 1) / Traits::kBlockN,
             "pooled tiles cover the eligible blocks: tile", m);
      visited += s.num_kept;
      // Split-KV: the splits' parts, in split order, are the whole schedule (kept tiles, then pooled ones),
      // each stage exactly once, and no part is more than one stage longer than another.
      for (int splits : {2, 3, 5, 16}) {
        ScheduleParams split_params = params;
        split_params.num_splits = splits;
        std::vector<int> kept_seen, pooled_seen;
        int shortest = 1 << 30, longest = 0;
        for (int k = 0; k < splits; ++k) {
          Geometry part_tile = g;
          part_tile.split = k;
          const SplitSchedule part = SplitSchedule::make(split_params, part_tile, Traits::kBlockN);
          for (int i = 0; i < part.num_kept; ++i) kept_seen.push_back(part.block(i));
          for (int c = 0; c < part.num_correction; ++c) pooled_seen.push_back(part.pooled_tile(c));
          shortest = std::min(shortest, part.num_stages());
          longest = std::max(longest, part.num_stages());
        }
        expect(kept_seen == expected, "the splits' kept tiles are the schedule's: tile, splits", m, splits);
        expect(int(pooled_seen.size()) == s.num_correction, "the splits' pooled tiles: tile, splits, count", m,
               splits, long(pooled_seen.size()));
        for (int c = 0; c < int(pooled_seen.size()); ++c) {
          expect(pooled_seen[c] == c, "the splits' pooled tiles in order: tile, splits, c", m, splits, c);
        }
        expect(longest - shortest <= 1, "balanced splits: tile, splits, spread", m, splits, longest - shortest);
      }
    }
  }
  std::printf("schedule: %d KV tiles of %d tokens checked\n", visited, Traits::kBlockN);
}

// Split-KV's automatic count and workspace (split_kv.hpp): none once the CTAs fill the SMs, the most splits
// that still fit one wave otherwise, at most one per 8 KV blocks and kMaxKvSplits; the workspace holds the partial
// rows and lse of every split, both 256-byte aligned.
void check_split_kv_rules() {
  using namespace fpv2::hopper;
  expect(auto_kv_splits(132, 132, 1 << 20) == 1 && auto_kv_splits(4000, 132, 1 << 20) == 1, "no split at >= SMs");
  expect(auto_kv_splits(28, 132, 8192) == 4, "28 CTAs on 132 SMs: 4 splits, one wave", auto_kv_splits(28, 132, 8192));
  expect(auto_kv_splits(128, 132, 1 << 20) == 1, "128 CTAs: a second wave would not pay", auto_kv_splits(128, 132, 1 << 20));
  expect(auto_kv_splits(66, 132, 1 << 20) == 2, "66 CTAs: 2 splits", auto_kv_splits(66, 132, 1 << 20));
  expect(auto_kv_splits(28, 132, 2048) == 2, "2048 keys: 16 blocks, at most 2 splits", auto_kv_splits(28, 132, 2048));
  expect(auto_kv_splits(28, 132, 500) == 1, "short requests: no split", auto_kv_splits(28, 132, 500));
  expect(auto_kv_splits(1, 132, 1 << 20) == kMaxKvSplits, "capped at kMaxKvSplits", auto_kv_splits(1, 132, 1 << 20));
  expect(split_workspace_bytes(100, 32, 128, 1) == 0, "one split needs no workspace");
  const uint64_t out = split_out_bytes(100, 32, 128, 3);
  expect(out == align_workspace(3ull * 100 * 32 * 128 * 4) && out % kWorkspaceAlignment == 0, "partial rows' bytes");
  expect(split_workspace_bytes(100, 32, 128, 3) == out + align_workspace(3ull * 100 * 32 * 4), "workspace bytes");
  std::printf("split-KV rules: checked\n");
}

// The persistent CTAs' snake order: every tile exactly once over all CTAs and waves, and, for tiles of
// decreasing work (tile i costs num_tiles - i), per-CTA sums within 2 x ctas of each other: a pair of waves
// gives every CTA the same sum, only an unpaired last wave differs. A plain stride k * ctas + cta covers the
// tiles too but spreads by (ctas - 1) per wave (32520 at 32768 tiles on 132 CTAs; the snake: 32).
void check_persistent_order() {
  const int cases[][2] = {{1, 132}, {131, 132}, {132, 132}, {133, 132}, {397, 132}, {8192, 132}, {32768, 132},
                          {1000, 7}, {5, 1}};
  for (const auto& c : cases) {
    const int num_tiles = c[0], ctas = c[1];
    std::vector<int> seen(num_tiles, 0);
    std::vector<long> work(ctas, 0);
    for (int cta = 0; cta < ctas; ++cta) {
      for (int k = 0; k * ctas < num_tiles; ++k) {
        const int index = fpv2::hopper::persistent_tile_index(k, cta, ctas);
        expect(index >= k * ctas && index < (k + 1) * ctas, "tile index inside its wave: tiles, ctas, k", num_tiles,
               ctas, k);
        if (index >= num_tiles) continue;
        ++seen[index];
        work[cta] += num_tiles - index;
      }
    }
    for (int i = 0; i < num_tiles; ++i) {
      expect(seen[i] == 1, "every tile exactly once: tiles, ctas, tile", num_tiles, ctas, i);
    }
    const long spread = *std::max_element(work.begin(), work.end()) - *std::min_element(work.begin(), work.end());
    expect(spread <= 2L * ctas, "per-CTA work within 2 x ctas: tiles, ctas, spread", num_tiles, ctas, spread);
  }
}

// The work order's host-visible rules (work_order.hpp): buckets monotone in the work, two per octave, 0 only
// for no work, capped; bucket bases count the heavier buckets; the workspace's parts aligned and disjoint.
// (Its kernels are checked on the device: the grid under FPV2_HOPPER_WORK_ORDER=1 poisons every output, so a
// tile left out or computed twice fails there.)
void check_work_order_rules() {
  using namespace fpv2::hopper;
  expect(work_bucket(0) == 0 && work_bucket(-3) == 0, "no work: bucket 0");
  expect(work_bucket(1) == 1 && work_bucket(2) == 3 && work_bucket(3) == 4, "buckets of 1, 2, 3", work_bucket(1),
         work_bucket(2), work_bucket(3));
  expect(work_bucket(16) == 9 && work_bucket(23) == 9 && work_bucket(24) == 10 && work_bucket(31) == 10,
         "two buckets per octave: 16..23, 24..31", work_bucket(16), work_bucket(24), work_bucket(31));
  int previous = 0;
  for (int stages = 1; stages <= 1 << 17; ++stages) {
    const int b = work_bucket(stages);
    expect(b >= previous && b >= 1 && b < kWorkBuckets, "monotone, inside the buckets: stages, bucket", stages, b);
    previous = b;
  }
  expect(work_bucket(1 << 15) == kWorkBuckets - 1 && work_bucket(1 << 30) == kWorkBuckets - 1, "capped");
  int32_t counts[kWorkBuckets] = {};
  counts[0] = 5;
  counts[3] = 7;
  counts[9] = 11;
  counts[kWorkBuckets - 1] = 2;
  expect(work_bucket_base(counts, kWorkBuckets - 1) == 0, "the heaviest bucket starts the order");
  expect(work_bucket_base(counts, 9) == 2 && work_bucket_base(counts, 3) == 13 && work_bucket_base(counts, 0) == 20,
         "bases: heavier buckets first", work_bucket_base(counts, 9), work_bucket_base(counts, 3),
         work_bucket_base(counts, 0));
  for (int64_t tiles : {int64_t(1), int64_t(255), int64_t(8192), int64_t(131072)}) {
    const uint64_t keys = work_order_keys_offset(), perm = work_order_permutation_offset(tiles);
    const uint64_t bytes = work_order_workspace_bytes(tiles);
    expect(keys >= 2u * kWorkBuckets * 4u && keys % kWorkspaceAlignment == 0, "counters before the keys", long(tiles));
    expect(perm >= keys + uint64_t(tiles) && perm % kWorkspaceAlignment == 0, "keys before the permutation",
           long(tiles));
    expect(bytes >= perm + 4u * uint64_t(tiles), "the permutation inside the workspace", long(tiles), long(bytes));
  }
  expect(work_order_workspace_bytes(0) == 0, "no tiles, no workspace");
  std::printf("work order rules: checked\n");
}

// The index scoring kernel's copies (csrc/index/score_select_kernel.hpp): a thread copies one 16-byte chunk of
// rows r0, r0 + R, ... (R = 128 threads / chunks per row) into the swizzled key buffers and Q tile, addressed as
// its first chunk's offset plus pass * (offset of row R) plus buffer * (offset of buffer 1). That holds only while
// a pass covers whole swizzle atoms: compared here with CuTe's offset of every (thread, pass, buffer).
template <int kHeadDim>
void check_score_copies() {
  using Traits = fpv2::index::ScoreTraits<cutlass::bfloat16_t, kHeadDim>;
  using Keys = typename Traits::SmemLayoutKeys;
  using Q = typename Traits::SmemLayoutQ;
  constexpr int kChunks = kHeadDim * 2 / 16;
  constexpr int kRows = Traits::kThreads / kChunks;
  const int key_pass = fpv2::hopper::smem_offset<Keys>(kRows, 0, 0) - fpv2::hopper::smem_offset<Keys>(0, 0, 0);
  const int key_stage = fpv2::hopper::smem_offset<Keys>(0, 0, 1) - fpv2::hopper::smem_offset<Keys>(0, 0, 0);
  const int q_pass = fpv2::hopper::smem_offset<Q>(kRows, 0) - fpv2::hopper::smem_offset<Q>(0, 0);
  for (int t = 0; t < Traits::kThreads; ++t) {
    const int chunk = t % kChunks, row0 = t / kChunks;
    const int key_base = fpv2::hopper::smem_offset<Keys>(row0, chunk * 8, 0);
    for (int pass = 0; pass < Traits::kStepKeys / kRows; ++pass) {
      for (int stage = 0; stage < Traits::kStages; ++stage) {
        const int want = fpv2::hopper::smem_offset<Keys>(row0 + pass * kRows, chunk * 8, stage);
        expect(want == key_base + pass * key_pass + stage * key_stage, "score key copy offset", t, pass, stage);
      }
    }
    const int q_base = fpv2::hopper::smem_offset<Q>(row0, chunk * 8);
    for (int pass = 0; pass < Traits::kTileRows / kRows; ++pass) {
      const int want = fpv2::hopper::smem_offset<Q>(row0 + pass * kRows, chunk * 8);
      expect(want == q_base + pass * q_pass, "score query copy offset", t, pass);
    }
  }
}

using Check = void (*)();
struct NamedCheck {
  const char* name;
  Check run;
};

int run_checks(const char* title, std::initializer_list<NamedCheck> checks) {
  std::printf("%s\n", title);
  int failed = 0;
  for (const NamedCheck& c : checks) {
    const int before = g_failures;
    c.run();
    const bool ok = g_failures == before;
    failed += ok ? 0 : 1;
    std::printf("%s %s\n", ok ? "PASS" : "FAIL", c.name);
  }
  return failed;
}

// The register and shared-memory checks of the instantiation for head dim kHeadDim.
template <int kHeadDim>
int check_head_dim() {
  using Traits = fpv2::hopper::PrefillTraitsFor<kHeadDim>;
  char title[160];
  std::snprintf(title, sizeof(title), "--- d=%d: tile %dx%d, %d K/V stages, %zu bytes of shared memory", kHeadDim,
                Traits::kBlockM, Traits::kBlockN, Traits::kStages, fpv2::hopper::prefill_smem_bytes<Traits>());
  if constexpr (Traits::kPooledE4M3Built) {
    return run_checks(title, {{"P registers as PV A operand", check_p_operand<Traits>},
                              {"S/O rows and epilogue pairs", check_rows<Traits>},
                              {"FP8 pooled operands (Q, P, V^T slots)", check_e4m3_operands<Traits>},
                              {"shared-memory 16-byte chunks", check_smem_chunks<Traits>}});
  } else {  // no FP8 correction at this tile (the launcher refuses the E4M3 copies)
    return run_checks(title, {{"P registers as PV A operand", check_p_operand<Traits>},
                              {"S/O rows and epilogue pairs", check_rows<Traits>},
                              {"shared-memory 16-byte chunks", check_smem_chunks<Traits>}});
  }
}

// Every built head dim must have its case here.
int check_built_head_dim(int head_dim) {
  switch (head_dim) {
    case 64:
      return check_head_dim<64>();
    case 128:
      return check_head_dim<128>();
    case 256:
      return check_head_dim<256>();
    default:
      std::printf("FAIL d=%d is built (kPrefillHeadDims) but has no layout check\n", head_dim);
      return 1;
  }
}

}  // namespace

// The default schedule's rule (schedule_default.hpp) on the calls it was measured on, at 32 / 8 heads on a
// 132-SM device: fresh requests of at least 24K run the tile queue in the work order, chunks after a cached
// prefix the work order alone once they fill the SMs, the rest (and every configuration not measured) the
// decoded order.
void check_default_schedule() {
  using namespace fpv2::hopper;
  static const int32_t some_index[1] = {0};
  const int sms = 132;
  auto plan_of = [](int32_t seqlen_q, int32_t seqlen_k) {
    PrefillPlan plan{};
    plan.head_dim = 128;
    plan.page_size = 128;
    plan.overlap = 1;
    plan.index_offsets = some_index;
    plan.max_seqlen_q = seqlen_q;
    plan.max_seqlen_k = seqlen_k;
    return plan;
  };
  // Tiles of one request at 32 query / 8 KV heads: 128 packed rows of 4 heads a tile.
  auto schedule_of = [&](PrefillPlan const& plan, int batch) {
    const int64_t request_tiles = (int64_t(plan.max_seqlen_q) * 4 + 127) / 128 * 8;
    return int(default_schedule(plan, request_tiles, request_tiles * batch, sms));
  };
  const int decoded = int(DefaultSchedule::kDecodedOrder), ordered = int(DefaultSchedule::kWorkOrder);
  const int queued = int(DefaultSchedule::kTileQueueInWorkOrder);
  for (int32_t seqlen : {24576, 32768, 131072}) {
    expect(schedule_of(plan_of(seqlen, seqlen), 1) == queued, "fresh >= 24K: the queue in the work order", seqlen);
    expect(schedule_of(plan_of(seqlen, seqlen), 4) == queued, "4 fresh requests >= 24K: the queue", seqlen);
  }
  expect(schedule_of(plan_of(24576 - 32, 24576 - 32), 1) == decoded, "one tile per KV head short of 6144");
  for (int32_t seqlen : {8192, 16384}) {
    expect(schedule_of(plan_of(seqlen, seqlen), 1) == decoded, "fresh 8K and 16K: decoded", seqlen);
    expect(schedule_of(plan_of(seqlen, seqlen), 4) == decoded, "4 fresh 8K and 16K: decoded", seqlen);
  }
  for (int32_t chunk : {2048, 4096, 8192, 16384}) {
    expect(schedule_of(plan_of(chunk, 131072), 1) == ordered, "a chunk after a prefix: the work order", chunk);
    expect(schedule_of(plan_of(chunk, 2 * chunk), 4) == ordered, "4 chunks after prefixes: the work order", chunk);
  }
  expect(schedule_of(plan_of(32768, 131072), 1) == queued, "a 32K chunk after a prefix: the queue");
  expect(schedule_of(plan_of(512, 131072), 1) == decoded, "128 tiles, one wave: decoded");
  expect(schedule_of(plan_of(1024, 131072), 1) == ordered, "256 tiles: the work order");
  // Configurations the measurements leave out keep the decoded order, however long the call.
  static const float some_variance[1] = {0.f};
  for (int variant = 0; variant < 7; ++variant) {
    for (int32_t seqlen_k : {131072, 262144}) {
      PrefillPlan plan = plan_of(131072, seqlen_k);
      if (variant == 0) plan.head_dim = 64;
      if (variant == 1) plan.head_dim = 256;
      if (variant == 2) plan.index_offsets = nullptr;  // dense mode
      if (variant == 3) plan.page_size = 16;            // the cp.async gather
      if (variant == 4) plan.pingpong = 1;
      if (variant == 5) plan.overlap = 0;
      if (variant == 6) plan.key_variance = some_variance;  // the second-order shift
      expect(schedule_of(plan, 1) == decoded, "not measured: decoded (variant, seqlen_k)", variant, seqlen_k);
    }
  }
  PrefillPlan e4m3 = plan_of(131072, 131072);
  e4m3.pooled_k_e4m3 = some_index;
  expect(schedule_of(e4m3, 1) == decoded, "FP8 pooled products: decoded");
}

int main() {
  std::printf("fpv2 Hopper prefill: host layout and geometry checks (built head dims: %s)\n",
              fpv2::hopper::prefill_head_dims_text().c_str());
  int failed = 0;
  for (int d : fpv2::hopper::kPrefillHeadDims) failed += check_built_head_dim(d);
  // The tile geometry and the schedule depend on the head dim only through the KV tile: 128 tokens (d <= 128)
  // or 64 (d = 256, two tiles per index block).
  using WholeBlockTiles = fpv2::hopper::PrefillTraitsFor<128>;
  using HalfBlockTiles = fpv2::hopper::PrefillTraitsFor<256>;
  static_assert(WholeBlockTiles::kTilesPerBlock == 1 && HalfBlockTiles::kTilesPerBlock == 2, "the two tilings");
  failed += run_checks("--- tile geometry and schedule",
                       {{"tile geometry vs brute force, 128-token tiles", check_geometry<WholeBlockTiles>},
                        {"tile geometry vs brute force, 64-token tiles", check_geometry<HalfBlockTiles>},
                        {"block schedule, 128-token tiles", check_schedule<WholeBlockTiles>},
                        {"block schedule, 64-token tiles", check_schedule<HalfBlockTiles>},
                        {"persistent tile order", check_persistent_order},
                        {"split-KV count and workspace", check_split_kv_rules},
                        {"work order buckets and workspace", check_work_order_rules},
                        {"default schedule", check_default_schedule}});
  failed += run_checks("--- index scoring kernel",
                       {{"key and query copy offsets, d=64", check_score_copies<64>},
                        {"key and query copy offsets, d=128", check_score_copies<128>}});
  std::printf("layout check: %s (%d failed check(s))\n", failed ? "FAIL" : "PASS", failed);
  return failed ? 1 : 0;
}
