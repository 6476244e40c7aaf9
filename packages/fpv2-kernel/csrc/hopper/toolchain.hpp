// What the sm_90a toolchain probe (toolchain_check.cu) was compiled with.
#pragma once

namespace fpv2::hopper {

// A static string naming the nvcc and CUTLASS versions the CUDA translation unit saw and the
// SM90 GMMA atom it instantiated, e.g. "nvcc 13.0.88, CUTLASS 4.2.0, ...".
const char* toolchain_summary() noexcept;

}  // namespace fpv2::hopper
