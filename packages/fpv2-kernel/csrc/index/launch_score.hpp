// Host side of the index stage's scoring: validated fpv2_score_args_t -> the two kernel launches.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "fpv2/fpv2.h"

namespace fpv2::index {

// Enqueues the scoring/selection kernel and the prefix sums on `stream` (args already validated).
int32_t launch_score(const fpv2_score_args_t& args, cudaStream_t stream);

}  // namespace fpv2::index
