// The prefill entry points: validation, kernel availability and the launch of the Hopper kernel (when the
// library is built with it, FPV2_HAVE_HOPPER_KERNEL).
#include "abi/errors.hpp"
#include "validate/struct_checks.hpp"

#if FPV2_HAVE_HOPPER_KERNEL
#include <cuda_runtime_api.h>

#include "hopper/launch_prefill.hpp"
#endif

extern "C" {

FPV2_API int32_t fpv2_validate_prefill(const fpv2_prefill_args_t* args) {
  return fpv2::detail::guarded("fpv2_validate_prefill", [&] { return fpv2::detail::validate_prefill_args(args); });
}

FPV2_API int32_t fpv2_hopper_kernel_available(void) {
#if FPV2_HAVE_HOPPER_KERNEL
  return 1;
#else
  return 0;  // built with FPV2_BUILD_HOPPER_KERNEL=OFF: only the toolchain probe is compiled
#endif
}

FPV2_API int32_t fpv2_prefill(const fpv2_prefill_args_t* args) {
  return fpv2::detail::guarded("fpv2_prefill", [&] {
    FPV2_RETURN_IF_ERROR(fpv2::detail::validate_prefill_args(args));
#if FPV2_HAVE_HOPPER_KERNEL
    return fpv2::hopper::launch_prefill(*args, static_cast<cudaStream_t>(args->stream));
#else
    return fpv2::detail::fail(
        FPV2_ERROR_NOT_BUILT,
        "fpv2_prefill: the Hopper attention kernel is not part of this build of libfpv2_kernel (it validates "
        "arguments only); the arguments are valid, but nothing was computed. Use the reference (PyTorch) or the "
        "portable (Triton) backend.");
#endif
  });
}

FPV2_API int32_t fpv2_prefill_workspace_size(const fpv2_prefill_args_t* args, uint64_t* bytes) {
  return fpv2::detail::guarded("fpv2_prefill_workspace_size", [&] {
    if (bytes == nullptr) {
      return fpv2::detail::fail(FPV2_ERROR_INVALID_ARGUMENT, "fpv2_prefill_workspace_size: bytes is NULL");
    }
    *bytes = 0;
    FPV2_RETURN_IF_ERROR(fpv2::detail::validate_prefill_args(args));
#if FPV2_HAVE_HOPPER_KERNEL
    return fpv2::hopper::prefill_workspace_size(*args, bytes);
#else
    return FPV2_OK;  // nothing is launched by this build, so nothing needs a workspace
#endif
  });
}

}  // extern "C"
