// The index stage's scoring entry point: validation and the launch of the Hopper scoring kernel (when the
// library is built with the Hopper code, FPV2_HAVE_HOPPER_KERNEL).
#include "abi/errors.hpp"
#include "validate/struct_checks.hpp"

#if FPV2_HAVE_HOPPER_KERNEL
#include "index/launch_score.hpp"
#endif

extern "C" {

FPV2_API int32_t fpv2_validate_score_blocks(const fpv2_score_args_t* args) {
  return fpv2::detail::guarded("fpv2_validate_score_blocks",
                               [&] { return fpv2::detail::validate_score_args(args); });
}

FPV2_API int32_t fpv2_score_blocks(const fpv2_score_args_t* args) {
  return fpv2::detail::guarded("fpv2_score_blocks", [&] {
    FPV2_RETURN_IF_ERROR(fpv2::detail::validate_score_args(args));
#if FPV2_HAVE_HOPPER_KERNEL
    return fpv2::index::launch_score(*args, static_cast<cudaStream_t>(args->stream));
#else
    return fpv2::detail::fail(FPV2_ERROR_NOT_BUILT,
                              "fpv2_score_blocks: the Hopper scoring kernel is not part of this build of "
                              "libfpv2_kernel; the arguments are valid, but nothing was computed. Use fpv2.index's "
                              "Triton pass.");
#endif
  });
}

}  // extern "C"
