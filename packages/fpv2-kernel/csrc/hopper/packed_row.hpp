// Where packed row `packed` of a PackGQA query tile lives in the (tokens, Hq, ...) query, output and lse
// tensors: token q_start + packed / g, query head kv_head * g + packed % g (ALGORITHM.md section 2).
//
// The division is by the launcher's precomputed divisor (PrefillParams::group_divmod): as a division by the
// runtime g, the Q gather's address chain was its hottest code in the profile of tiles with one kept block
// (ncu, 32K: ~25% of the stall samples at the cp.async and the division lines).
#pragma once

#include <cstdint>

namespace fpv2::hopper {

struct PackedRow {
  int64_t token;
  int head;

  template <class Params, class Geometry>
  __device__ __forceinline__ static PackedRow at(Params const& params, Geometry const& tile, int packed) {
    int position, head_in_group;
    params.group_divmod(position, head_in_group, packed);
    return {int64_t(tile.q_start + position), tile.kv_head * params.group + head_in_group};
  }

  __device__ __forceinline__ int64_t offset(int64_t token_stride, int64_t head_stride) const {
    return token * token_stride + int64_t(head) * head_stride;
  }
};

}  // namespace fpv2::hopper
