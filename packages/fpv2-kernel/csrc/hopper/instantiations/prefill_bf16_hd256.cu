// Instantiation: causal prefill (dense, block-sparse, corrected), bf16, head dim 256, any page size; KV tiles
// of 64 tokens (half an index block, prefill_kv_tile(256)) in two K/V stages (prefill_stages(256),
// prefill_traits.hpp). The FP8 pooled products are not built here (the launcher refuses the E4M3 copies).
#include "hopper/prefill_launch.hpp"

namespace fpv2::hopper {

template int32_t run_prefill<256>(const PrefillPlan& plan, cudaStream_t stream);

}  // namespace fpv2::hopper
