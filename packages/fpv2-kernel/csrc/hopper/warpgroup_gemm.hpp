// One warpgroup matrix product C (+)= A B over all k-blocks of the operands, issued as a single wgmma
// batch and waited for before returning (warpgroup_gemm), or issued and waited for in two steps so that
// the consumers' turn barrier of the pingpong schedule can sit between them.
//
// A is either shared-memory descriptors (SS) or bf16 registers (RS); B is always descriptors. The fences
// keep the compiler from moving register reads/writes of the operands across the asynchronous wgmma.
// Waiting right away (warpgroup_wait<0>) is the simple schedule of this first step; the intra-warpgroup
// overlap of QK(n) / PV(n+1) / softmax(n) will keep one batch in flight instead.
#pragma once

#include <cute/arch/mma_sm90_gmma.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cute/tensor.hpp>

namespace fpv2::hopper {

// Issues the batch (operand fences, wgmma.fence, the k-blocks, commit) without waiting for it.
template <bool kZeroInit, class TiledMma, class FragA, class FragB, class FragC>
__device__ __forceinline__ void warpgroup_gemm_issue(TiledMma& mma, FragA& a, FragB const& b, FragC& c) {
  using namespace cute;
  constexpr bool kRegisterA = !is_base_of<GMMA::DescriptorIterator, typename TiledMma::FrgTypeA>::value;
  if constexpr (kRegisterA) {
    warpgroup_fence_operand(a);
  }
  warpgroup_fence_operand(c);
  warpgroup_arrive();
  mma.accumulate_ = kZeroInit ? GMMA::ScaleOut::Zero : GMMA::ScaleOut::One;
  CUTE_UNROLL
  for (int k = 0; k < size<2>(a); ++k) {
    gemm(mma, a(_, _, k), b(_, _, k), c);
    mma.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
}

// Waits for every issued batch of the warpgroup and fences the operands again.
template <class TiledMma, class FragA, class FragC>
__device__ __forceinline__ void warpgroup_gemm_wait(TiledMma const&, FragA& a, FragC& c) {
  using namespace cute;
  constexpr bool kRegisterA = !is_base_of<GMMA::DescriptorIterator, typename TiledMma::FrgTypeA>::value;
  warpgroup_wait<0>();
  warpgroup_fence_operand(c);
  if constexpr (kRegisterA) {
    warpgroup_fence_operand(a);
  }
}

template <bool kZeroInit, class TiledMma, class FragA, class FragB, class FragC>
__device__ __forceinline__ void warpgroup_gemm(TiledMma& mma, FragA& a, FragB const& b, FragC& c) {
  warpgroup_gemm_issue<kZeroInit>(mma, a, b, c);
  warpgroup_gemm_wait(mma, a, c);
}

}  // namespace fpv2::hopper
