// Metadata checks on one fpv2_tensor_t (rank, dtype, shape, strides, data pointer).
//
// Every check names the tensor (e.g. "fpv2_prefill_args_t.q"), describes what it found
// (shape, strides, dtype) and what was expected, records that as the thread's last error and
// returns a status. None of them reads the memory the tensor points to.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>

#include "fpv2/fpv2.h"

namespace fpv2::detail {

// Sentinel in an expected shape: any size matches.
constexpr int64_t kAnySize = -1;

// Short dtype name ("bf16", "float8_e4m3fn", "int32", ...; "code N" for unknown codes).
std::string dtype_name(int32_t dtype);

// "shape (a, b), strides (x, y), dtype bf16" (only the first ndim entries are shown).
std::string describe(const fpv2_tensor_t& t);

// An optional tensor is absent when data == NULL and ndim == 0.
bool is_absent(const fpv2_tensor_t& t);

// Number of elements; call after check_header (which rules out negative sizes and overflow).
int64_t numel(const fpv2_tensor_t& t);

// Rank within 0..FPV2_MAX_NDIM, a known dtype code, non-negative sizes and strides, an element
// count that fits int64, and a non-NULL data pointer unless the tensor has no elements.
int32_t check_header(const fpv2_tensor_t& t, const char* name);

// The dtype is one of `allowed` (an unknown code is reported by check_header, not here).
int32_t check_dtype(const fpv2_tensor_t& t, const char* name, std::initializer_list<int32_t> allowed);

// A required tensor of any dtype: present, a valid header and rank `ndim`.
int32_t check_present(const fpv2_tensor_t& t, const char* name, int32_t ndim);

// A required tensor: present, a valid header, rank `ndim` and one of `allowed` dtypes.
int32_t check_required(const fpv2_tensor_t& t, const char* name, std::initializer_list<int32_t> allowed,
                       int32_t ndim);

// The shape equals `expected` (kAnySize entries match anything); `symbolic` names the expected
// shape for the message, e.g. "(B+1,)".
int32_t check_shape(const fpv2_tensor_t& t, const char* name, std::initializer_list<int64_t> expected,
                    const char* symbolic);

// Row-major contiguous (strides of size-1 dimensions are ignored, as torch does).
int32_t check_contiguous(const fpv2_tensor_t& t, const char* name);

// Unit stride along the last dimension (the kernels load rows as vectors).
int32_t check_inner_stride(const fpv2_tensor_t& t, const char* name);

}  // namespace fpv2::detail
