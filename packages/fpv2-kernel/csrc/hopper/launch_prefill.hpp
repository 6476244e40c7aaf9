// Entry point of the Hopper prefill kernel for the C ABI layer.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "fpv2/fpv2.h"

namespace fpv2::hopper {

// Runs causal (bottom-right) paged prefill attention for `args` on `stream`, asynchronously: dense without
// args.index, block-sparse over the CSR index with it, plus the mean correction with args.correction.
//
// Precondition: `args` passed fpv2::detail::validate_prefill_args (fpv2_prefill validates first).
// Serves: bf16 q/k/v/out, the head dims of kPrefillHeadDims (prefill_instances.hpp: 64, 128 and 256), any
// page size (TMA tiles when page_size is a multiple of the KV tile, prefill_kv_tile(d): 128, or 64 at
// d = 256; a cp.async gather otherwise), block_size 128, bf16 pooled statistics (the todo masks, if given,
// are not read: the kernel derives the same bits; the E4M3 copies at d <= 128 only), requests of at most
// max_correction_blocks(d) blocks with the correction, caches whose pages stack into one row-major
// (num_pages * page_size, Hkv * d) matrix, 16-byte aligned q/k/v and 4-byte aligned out, on a compute
// capability 9.0 device. Anything else is refused with FPV2_ERROR_UNSUPPORTED (or
// FPV2_ERROR_INVALID_ARGUMENT for misaligned data) and a message naming the argument (for a head dim
// without an instantiation, the head dim and the built ones); nothing is launched then. Returns an
// fpv2_status_t and sets the thread's last error.
int32_t launch_prefill(const fpv2_prefill_args_t& args, cudaStream_t stream);

// The workspace bytes launch_prefill would use for `args` (split-KV's partial rows, split_kv.hpp: 0 when
// the call does not split), with the same checks; the splits chosen as if the workspace were unbounded.
int32_t prefill_workspace_size(const fpv2_prefill_args_t& args, uint64_t* bytes);

}  // namespace fpv2::hopper
