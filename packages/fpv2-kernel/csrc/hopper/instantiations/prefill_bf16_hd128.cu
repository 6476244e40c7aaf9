// Instantiation: causal prefill (dense, block-sparse, corrected), bf16, head dim 128, any page size; two K/V
// stages (prefill_stages(128), prefill_traits.hpp).
#include "hopper/prefill_launch.hpp"

namespace fpv2::hopper {

template int32_t run_prefill<128>(const PrefillPlan& plan, cudaStream_t stream);

}  // namespace fpv2::hopper
