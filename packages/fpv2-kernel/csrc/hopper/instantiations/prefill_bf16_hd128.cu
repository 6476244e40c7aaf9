// Instantiation: causal prefill (dense, block-sparse, corrected), bf16, head dim 128, any page size.
#include "hopper/prefill_launch.hpp"

namespace fpv2::hopper {

template int32_t run_prefill<128>(const PrefillPlan& plan, cudaStream_t stream);

}  // namespace fpv2::hopper
