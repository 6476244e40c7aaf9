// Validation of the size-prefixed ABI structs (metadata only: no device memory is read).
#pragma once

#include <cstdint>

#include "abi/errors.hpp"
#include "fpv2/fpv2.h"

namespace fpv2::detail {

// A struct pointer is non-NULL and its struct_size covers this library's version of the struct.
// A larger struct_size (a caller built against a newer minor version) is accepted: the fields
// this version knows are a prefix of it and the unknown tail is ignored.
// `min_size` is the size of the oldest layout of the same major version that the library still reads
// (the correction plan accepts its ABI 1.1 size; its later fields then count as absent).
template <class Struct>
int32_t check_struct(const Struct* p, const char* type_name, const char* role, size_t min_size = sizeof(Struct)) {
  if (p == nullptr) {
    return fail(FPV2_ERROR_INVALID_ARGUMENT, format("%s is NULL; expected a pointer to a %s", role, type_name));
  }
  if (p->struct_size < min_size) {
    return fail(FPV2_ERROR_INVALID_ARGUMENT,
                format("%s.struct_size=%u is smaller than this library's %s (%zu bytes, ABI %d.%d); set struct_size "
                       "= sizeof(%s) from an fpv2.h of ABI major version %d",
                       type_name, p->struct_size, type_name, sizeof(Struct), FPV2_ABI_VERSION_MAJOR,
                       FPV2_ABI_VERSION_MINOR, type_name, FPV2_ABI_VERSION_MAJOR));
  }
  return FPV2_OK;
}

// Ceiling division of non-negative values.
constexpr int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The paged batch on its own.
int32_t validate_batch(const fpv2_paged_batch_t* batch);

// A block index against an already validated batch.
int32_t validate_index(const fpv2_block_index_t* index, const fpv2_paged_batch_t& batch);

// The correction plan's struct check (the ABI 1.1 size is accepted).
int32_t check_plan_struct(const fpv2_correction_plan_t* plan, const char* role);

// Whether the plan carries the ABI 1.2 E4M3 copies of the pooled statistics (a struct of the 1.1 size has
// none; its tail is not read).
bool plan_has_e4m3(const fpv2_correction_plan_t& plan);

// Whether the plan carries the ABI 1.5 key spread of the second-order mass shift (a struct of an older size
// has none; its tail is not read).
bool plan_has_key_spread(const fpv2_correction_plan_t& plan);

// A correction plan against an already validated batch.
int32_t validate_plan(const fpv2_correction_plan_t* plan, const fpv2_paged_batch_t& batch);

// All prefill arguments: the structs, the tensors and their consistency.
int32_t validate_prefill_args(const fpv2_prefill_args_t* args);

// One block-scoring call's arguments (fpv2_score_blocks).
int32_t validate_score_args(const fpv2_score_args_t* args);

}  // namespace fpv2::detail
