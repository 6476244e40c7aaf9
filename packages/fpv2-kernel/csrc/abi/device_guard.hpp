// The device a launch runs on: made current for the call (the caller's device restored afterwards), and
// checked to be the one architecture the kernels are built for (sm_90a).
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "abi/errors.hpp"

namespace fpv2::detail {

class DeviceGuard {
 public:
  DeviceGuard() = default;
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;
  ~DeviceGuard() {
    if (restore_ >= 0) cudaSetDevice(restore_);
  }

  // `device` < 0 keeps the current device; `who` names the caller in messages.
  int32_t select(int32_t device, const char* who) {
    int current = 0;
    cudaError_t err = cudaGetDevice(&current);
    if (err != cudaSuccess) {
      return fail(FPV2_ERROR_CUDA, format("%s: cudaGetDevice failed: %s", who, cudaGetErrorString(err)));
    }
    if (device >= 0 && device != current) {
      err = cudaSetDevice(device);
      if (err != cudaSuccess) {
        return fail(FPV2_ERROR_CUDA, format("%s: device=%d: cudaSetDevice failed: %s", who, device,
                                            cudaGetErrorString(err)));
      }
      restore_ = current;
      current = device;
    }
    device_ = current;
    return FPV2_OK;
  }

  int device() const { return device_; }

 private:
  int restore_ = -1;
  int device_ = 0;
};

// FPV2_ERROR_UNSUPPORTED unless `device` is compute capability 9.0 (`who` names the caller in the message).
inline int32_t check_hopper_device(int device, const char* who) {
  int major = 0, minor = 0;
  cudaError_t err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
  if (err != cudaSuccess) {
    return fail(FPV2_ERROR_CUDA, format("%s: cannot query device %d: %s", who, device, cudaGetErrorString(err)));
  }
  if (major != 9 || minor != 0) {
    return fail(FPV2_ERROR_UNSUPPORTED,
                format("%s: device %d has compute capability %d.%d; the kernel is built for sm_90a (H100/H200) "
                       "only; use the portable (Triton) backend elsewhere",
                       who, device, major, minor));
  }
  return FPV2_OK;
}

}  // namespace fpv2::detail
