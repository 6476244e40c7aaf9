// Instantiation: dense causal prefill, bf16, head dim 128, paged KV through TMA (page_size % 128 == 0).
#include "hopper/dense_prefill_launch.hpp"

namespace fpv2::hopper {

template int32_t run_dense_prefill<128>(const DensePrefillPlan& plan, cudaStream_t stream);

}  // namespace fpv2::hopper
