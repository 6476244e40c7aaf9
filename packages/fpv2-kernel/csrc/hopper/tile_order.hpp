// Which query tile the CTA (or a persistent CTA's k-th slot) computes: a 1-D index over
// (request, KV head, query tile), decoded in the order the launcher chose.
//
// Query tiles come in decreasing order within a (request, KV head), so that the tiles taken first have the
// longest causal rows. Head-major (params.head_major, the default; FPV2_HOPPER_HEAD_MAJOR=0 turns it off):
// request slowest, then the KV head, the query tile fastest, so the CTAs resident together are consecutive
// query tiles of one KV head and share its kept blocks (the index's columns are per KV head) in L2. With the
// KV head fastest the sparse kernel read most of its K/V from DRAM (ncu 2026-12-01, random CSR at 128K:
// 30.5 GB, 15% L2 hits). Without head-major: request-major (params.request_major: request slowest, then the
// query tile, KV head fastest) or (KV head, request) fastest; at B = 1 the two are the same.
//
// Work order (params.tile_order, work_order.hpp): the index is first looked up in a permutation of the
// tiles by decreasing kept-block work, built on the device before the launch, so that the heaviest tiles
// start first and the light ones fill the last wave.
#pragma once

#include <cstdint>

namespace fpv2::hopper {

template <class Geometry, class Params>
__device__ __forceinline__ Geometry tile_at(Params const& params, int index) {
  if (params.tile_order != nullptr) index = params.tile_order[index];
  if (params.head_major) {
    int rest, m_from_last, request, kv_head;
    params.m_blocks_divmod(rest, m_from_last, index);
    params.kv_heads_divmod(request, kv_head, rest);
    return Geometry::load(request, kv_head, params.num_m_blocks - 1 - m_from_last, params.group,
                          params.cu_seqlens_q, params.seqlens_k);
  }
  // Digits of the index, fastest first: the KV head, then `middle`, then `outer`; the flag (0 or 1) only
  // swaps which of the two is the request.
  const int rm = params.request_major;
  const int period = params.num_kv_heads * (rm * params.num_m_blocks + (1 - rm) * params.num_requests);
  const int outer = index / period, inner = index % period;
  const int middle = inner / params.num_kv_heads;
  const int request = rm * outer + (1 - rm) * middle;
  const int m_from_last = rm * middle + (1 - rm) * outer;
  return Geometry::load(request, inner % params.num_kv_heads, params.num_m_blocks - 1 - m_from_last, params.group,
                        params.cu_seqlens_q, params.seqlens_k);
}

}  // namespace fpv2::hopper
