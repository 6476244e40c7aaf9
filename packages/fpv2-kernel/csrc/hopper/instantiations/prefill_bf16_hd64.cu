// Instantiation: causal prefill (dense, block-sparse, corrected), bf16, head dim 64, any page size; four K/V
// stages (prefill_stages(64), prefill_traits.hpp).
#include "hopper/prefill_launch.hpp"

namespace fpv2::hopper {

template int32_t run_prefill<64>(const PrefillPlan& plan, cudaStream_t stream);

}  // namespace fpv2::hopper
