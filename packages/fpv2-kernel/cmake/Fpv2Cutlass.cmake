# Locate the CUTLASS/CuTe headers: -DFPV2_CUTLASS_DIR=<dir holding cute/ and cutlass/>, or else the
# `source/include` folder of the nvidia-cutlass wheel installed for the building Python. No copy of
# CUTLASS is vendored in this repository.
#
# fpv2_find_cutlass(<include-dir-var> <version-var>)

set(FPV2_CUTLASS_EXPECTED_VERSION "4.2" CACHE STRING "CUTLASS major.minor the kernels are written for")

function(fpv2_find_cutlass out_dir out_version)
  if(FPV2_CUTLASS_DIR)
    set(dir "${FPV2_CUTLASS_DIR}")
    set(origin "FPV2_CUTLASS_DIR")
  else()
    if(NOT Python_EXECUTABLE)
      find_package(Python 3.10 COMPONENTS Interpreter REQUIRED)
    endif()
    execute_process(
      COMMAND "${Python_EXECUTABLE}" "${CMAKE_CURRENT_FUNCTION_LIST_DIR}/find_cutlass_include.py"
      OUTPUT_VARIABLE dir
      ERROR_VARIABLE err
      RESULT_VARIABLE rc
      OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_STRIP_TRAILING_WHITESPACE)
    if(NOT rc EQUAL 0)
      message(FATAL_ERROR
        "fpv2-kernel: cannot find the CUTLASS headers: ${err}\n"
        "Install them with `pip install nvidia-cutlass==4.2.0.0` (a build requirement of fpv2-kernel), "
        "or pass -DFPV2_CUTLASS_DIR=<CUTLASS include dir>, or build with FPV2_BUILD_NATIVE=OFF.")
    endif()
    set(origin "the nvidia-cutlass wheel of ${Python_EXECUTABLE}")
  endif()
  if(NOT EXISTS "${dir}/cute/tensor.hpp" OR NOT EXISTS "${dir}/cutlass/version.h")
    message(FATAL_ERROR
      "fpv2-kernel: ${dir} (from ${origin}) is not a CUTLASS include directory: "
      "expected cute/tensor.hpp and cutlass/version.h in it")
  endif()
  file(STRINGS "${dir}/cutlass/version.h" lines REGEX "^#define CUTLASS_(MAJOR|MINOR|PATCH) ")
  foreach(part MAJOR MINOR PATCH)
    string(REGEX MATCH "CUTLASS_${part} ([0-9]+)" _ "${lines}")
    set(${part} "${CMAKE_MATCH_1}")
  endforeach()
  set(version "${MAJOR}.${MINOR}.${PATCH}")
  if(NOT "${MAJOR}.${MINOR}" VERSION_EQUAL FPV2_CUTLASS_EXPECTED_VERSION)
    message(WARNING
      "fpv2-kernel: CUTLASS ${version} found in ${dir}; the kernels are written and tested against "
      "${FPV2_CUTLASS_EXPECTED_VERSION}.x (nvidia-cutlass==4.2.0.0)")
  endif()
  message(STATUS "fpv2-kernel: CUTLASS ${version} headers from ${origin}: ${dir}")
  set(${out_dir} "${dir}" PARENT_SCOPE)
  set(${out_version} "${version}" PARENT_SCOPE)
endfunction()
