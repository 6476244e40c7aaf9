// Register operands of the mean correction's FP8 pooled products (the E4M3 copies of fpv2.h, ABI 1.2).
//
// Q: the warpgroup's bf16 Q tile (shared memory) becomes, once per tile at the first pooled tile, the e4m3
// A operand of S = Q Kbar^T in registers, each row scaled by 448 / max|q_row| (the 4 threads of a quad hold
// one row's values, so the row maximum is a quad reduction); the score of row r is then the e4m3 product
// times q_scale[r] * k_scale.
//
// P: the fp32 accumulator of S, after the softmax, is reused in place as the e4m3 A operand of O += P Vbar,
// times 2^8 (P <= 1; 2^8 keeps small probabilities above e4m3's subnormal range and 256 < 448). A thread's
// accumulator holds, per row and 32-column block, columns 2t, 2t + 1, 8 + 2t, 9 + 2t (+16) (t = lane % 4),
// while the 8-bit A operand wants k = 4t .. 4t + 3 (+16) of the same rows: the same number of values, so
// without any shuffle slot 4t + i takes column 2t + i (i < 2) or 8 + 2t + i - 2 (i >= 2). The pooled V^T tile
// is written in that slot order (FPV2_E4M3_SLOT), so slot s of P meets the V row of the block it holds.
// The index algebra is checked against CuTe's layouts on the host (tests/native/hopper_layout_check.cu).
#pragma once

namespace fpv2::hopper {

// Pooled block (within its group of 16) held by A slot `slot` of the e4m3 P operand.
__host__ __device__ constexpr int e4m3_slot_block(int slot) {
  return (slot & ~15) + ((slot & 3) < 2 ? 2 * ((slot & 15) >> 2) + (slot & 1) : 8 + 2 * ((slot & 15) >> 2) + (slot & 1));
}

// Index in the thread's fp32 S accumulator ((2, 2, N / 8) values: column pair, row, 8-column group) of the
// value that goes to index v of its e4m3 A fragment ((4, 2, 2) values per 32-column k-block: slot in the
// 4-group, row, upper 16 columns; then the k-block).
__host__ __device__ constexpr int e4m3_p_source(int v) {
  const int i = v % 4, r = (v / 4) % 2, h = (v / 8) % 2, kk = v / 16;
  return (i % 2) + 2 * r + 4 * (4 * kk + 2 * h + i / 2);
}

// Row (0: lane / 4, 1: lane / 4 + 8) of value v of a thread's e4m3 A fragment.
__host__ __device__ constexpr int e4m3_a_row(int v) { return (v / 4) % 2; }

// Largest finite e4m3 value; the scale that maps a row maximum onto it.
inline constexpr float kE4M3Max = 448.0f;
// P is converted as P x 2^8; O is scaled by 2^8 / v_scale before the pooled products and back after them.
inline constexpr float kE4M3ProbabilityScale = 256.0f;

}  // namespace fpv2::hopper
