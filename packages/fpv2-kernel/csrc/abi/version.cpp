// ABI version and build description.
#include <string>

#include "abi/errors.hpp"
#include "hopper/toolchain.hpp"

#if FPV2_HAVE_HOPPER_KERNEL
#include "hopper/prefill_instances.hpp"
#endif

#ifndef FPV2_BUILD_CUDA_ARCHS
#define FPV2_BUILD_CUDA_ARCHS "unknown"
#endif
#ifndef FPV2_BUILD_PACKAGE_VERSION
#define FPV2_BUILD_PACKAGE_VERSION "unknown"
#endif

namespace {

std::string make_build_info() {
  std::string info = "libfpv2_kernel (fpv2-kernel " FPV2_BUILD_PACKAGE_VERSION "), ABI ";
  info += std::to_string(FPV2_ABI_VERSION_MAJOR) + "." + std::to_string(FPV2_ABI_VERSION_MINOR);
  info += "; CUDA archs: " FPV2_BUILD_CUDA_ARCHS "; ";
  info += fpv2::hopper::toolchain_summary();
#if FPV2_HAVE_HOPPER_KERNEL
  // "head dims 64, 128": the binding reads the built head dims from this phrase (hopper_head_dims()).
  info += "; Hopper attention kernel: built (sm_90a; bf16, head dims " + fpv2::hopper::prefill_head_dims_text() +
          "; any page size; dense, block-sparse and mean correction)";
#else
  info += "; Hopper attention kernel: not built (this library validates arguments only)";
#endif
  return info;
}

}  // namespace

extern "C" {

FPV2_API void fpv2_get_abi_version(int32_t* major, int32_t* minor) {
  if (major != nullptr) *major = FPV2_ABI_VERSION_MAJOR;
  if (minor != nullptr) *minor = FPV2_ABI_VERSION_MINOR;
}

FPV2_API const char* fpv2_get_build_info(void) {
  try {
    // Built once; function-local statics are initialised thread-safely.
    static const std::string info = make_build_info();
    return info.c_str();
  } catch (...) {
    return "libfpv2_kernel (build info unavailable)";
  }
}

}  // extern "C"
