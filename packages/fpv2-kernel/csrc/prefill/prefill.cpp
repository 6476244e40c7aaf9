// The prefill entry points: validation, kernel availability and the (not yet built) launch.
#include "abi/errors.hpp"
#include "validate/struct_checks.hpp"

extern "C" {

FPV2_API int32_t fpv2_validate_prefill(const fpv2_prefill_args_t* args) {
  return fpv2::detail::guarded("fpv2_validate_prefill", [&] { return fpv2::detail::validate_prefill_args(args); });
}

FPV2_API int32_t fpv2_hopper_kernel_available(void) {
  // The sm_90a attention kernel is not part of ABI 1.0 builds; only the toolchain probe is compiled.
  return 0;
}

FPV2_API int32_t fpv2_prefill(const fpv2_prefill_args_t* args) {
  return fpv2::detail::guarded("fpv2_prefill", [&] {
    FPV2_RETURN_IF_ERROR(fpv2::detail::validate_prefill_args(args));
    return fpv2::detail::fail(
        FPV2_ERROR_NOT_BUILT,
        "fpv2_prefill: the Hopper attention kernel is not part of this build of libfpv2_kernel (it validates "
        "arguments only); the arguments are valid, but nothing was computed. Use the reference (PyTorch) or the "
        "portable (Triton) backend.");
  });
}

}  // extern "C"
