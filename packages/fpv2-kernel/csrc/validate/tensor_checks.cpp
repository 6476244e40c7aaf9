// Metadata checks on one fpv2_tensor_t.
#include "validate/tensor_checks.hpp"

#include <vector>

#include "abi/errors.hpp"

namespace fpv2::detail {
namespace {

std::string join(const int64_t* values, int32_t n) {
  std::string out = "(";
  for (int32_t i = 0; i < n; ++i) {
    if (i > 0) out += ", ";
    out += std::to_string(values[i]);
  }
  if (n == 1) out += ",";
  out += ")";
  return out;
}

std::string dtype_list(std::initializer_list<int32_t> dtypes) {
  std::string out;
  for (int32_t d : dtypes) {
    if (!out.empty()) out += " or ";
    out += dtype_name(d);
  }
  return out;
}

bool known_dtype(int32_t dtype) { return dtype >= FPV2_DTYPE_F16 && dtype <= FPV2_DTYPE_I64; }

}  // namespace

std::string dtype_name(int32_t dtype) {
  switch (dtype) {
    case FPV2_DTYPE_F16:
      return "f16";
    case FPV2_DTYPE_BF16:
      return "bf16";
    case FPV2_DTYPE_F32:
      return "f32";
    case FPV2_DTYPE_E4M3:
      return "float8_e4m3fn";
    case FPV2_DTYPE_I32:
      return "int32";
    case FPV2_DTYPE_I64:
      return "int64";
    case FPV2_DTYPE_INVALID:
      return "invalid (code 0)";
    default:
      return "code " + std::to_string(dtype);
  }
}

std::string describe(const fpv2_tensor_t& t) {
  if (is_absent(t)) return "absent (data NULL, ndim 0)";
  if (t.ndim < 0 || t.ndim > FPV2_MAX_NDIM) {
    return format("ndim %d, dtype %s", t.ndim, dtype_name(t.dtype).c_str());
  }
  return "shape " + join(t.shape, t.ndim) + ", strides " + join(t.strides, t.ndim) + ", dtype " +
         dtype_name(t.dtype);
}

bool is_absent(const fpv2_tensor_t& t) { return t.data == nullptr && t.ndim == 0; }

int64_t numel(const fpv2_tensor_t& t) {
  int64_t n = 1;
  for (int32_t i = 0; i < t.ndim; ++i) n *= t.shape[i];
  return n;
}

int32_t check_header(const fpv2_tensor_t& t, const char* name) {
  if (t.ndim < 0 || t.ndim > FPV2_MAX_NDIM) {
    return fail(FPV2_ERROR_INVALID_ARGUMENT,
                format("%s has ndim=%d; expected 0..%d", name, t.ndim, FPV2_MAX_NDIM));
  }
  if (!known_dtype(t.dtype)) {
    return fail(FPV2_ERROR_INVALID_ARGUMENT,
                format("%s has dtype code %d, which is not an fpv2_dtype_t (valid codes %d..%d: f16, bf16, f32, "
                       "float8_e4m3fn, int32, int64); %s",
                       name, t.dtype, FPV2_DTYPE_F16, FPV2_DTYPE_I64, describe(t).c_str()));
  }
  bool empty = false;
  int64_t count = 1;
  bool overflow = false;
  for (int32_t i = 0; i < t.ndim; ++i) {
    if (t.shape[i] < 0) {
      return fail(FPV2_ERROR_INVALID_ARGUMENT,
                  format("%s has negative size %lld in dimension %d; %s", name, static_cast<long long>(t.shape[i]),
                         i, describe(t).c_str()));
    }
    if (t.strides[i] < 0) {
      return fail(FPV2_ERROR_INVALID_ARGUMENT,
                  format("%s has negative stride %lld in dimension %d (not supported); %s", name,
                         static_cast<long long>(t.strides[i]), i, describe(t).c_str()));
    }
    empty = empty || t.shape[i] == 0;
    overflow = overflow || __builtin_mul_overflow(count, t.shape[i], &count);
  }
  if (overflow && !empty) {
    return fail(FPV2_ERROR_INVALID_ARGUMENT,
                format("%s has more elements than fit in int64; %s", name, describe(t).c_str()));
  }
  if (t.data == nullptr && !empty) {
    return fail(FPV2_ERROR_INVALID_ARGUMENT,
                format("%s has data == NULL but %lld elements; %s", name, static_cast<long long>(count),
                       describe(t).c_str()));
  }
  return FPV2_OK;
}

int32_t check_dtype(const fpv2_tensor_t& t, const char* name, std::initializer_list<int32_t> allowed) {
  for (int32_t d : allowed) {
    if (t.dtype == d) return FPV2_OK;
  }
  return fail(FPV2_ERROR_INVALID_ARGUMENT, format("%s must have dtype %s; got %s", name, dtype_list(allowed).c_str(),
                             describe(t).c_str()));
}

int32_t check_present(const fpv2_tensor_t& t, const char* name, int32_t ndim) {
  if (is_absent(t)) {
    return fail(FPV2_ERROR_INVALID_ARGUMENT,
                format("%s is required but absent (data NULL, ndim 0); expected a rank-%d tensor", name, ndim));
  }
  FPV2_RETURN_IF_ERROR(check_header(t, name));
  if (t.ndim != ndim) {
    return fail(FPV2_ERROR_INVALID_ARGUMENT, format("%s must have rank %d; got %s", name, ndim, describe(t).c_str()));
  }
  return FPV2_OK;
}

int32_t check_required(const fpv2_tensor_t& t, const char* name, std::initializer_list<int32_t> allowed,
                       int32_t ndim) {
  FPV2_RETURN_IF_ERROR(check_present(t, name, ndim));
  return check_dtype(t, name, allowed);
}

int32_t check_shape(const fpv2_tensor_t& t, const char* name, std::initializer_list<int64_t> expected,
                    const char* symbolic) {
  bool ok = static_cast<int32_t>(expected.size()) == t.ndim;
  std::vector<int64_t> want(expected);
  for (int32_t i = 0; ok && i < t.ndim; ++i) {
    ok = want[static_cast<size_t>(i)] == kAnySize || want[static_cast<size_t>(i)] == t.shape[i];
  }
  if (ok) return FPV2_OK;
  std::string concrete = "(";
  for (size_t i = 0; i < want.size(); ++i) {
    if (i > 0) concrete += ", ";
    concrete += want[i] == kAnySize ? std::string("*") : std::to_string(want[i]);
  }
  concrete += want.size() == 1 ? ",)" : ")";
  return fail(FPV2_ERROR_INVALID_ARGUMENT,
              format("%s must have shape %s = %s; got %s", name, symbolic, concrete.c_str(), describe(t).c_str()));
}

int32_t check_contiguous(const fpv2_tensor_t& t, const char* name) {
  if (numel(t) == 0) return FPV2_OK;
  int64_t expected = 1;
  for (int32_t i = t.ndim - 1; i >= 0; --i) {
    if (t.shape[i] != 1 && t.strides[i] != expected) {
      return fail(FPV2_ERROR_INVALID_ARGUMENT,
                  format("%s must be contiguous (row-major); dimension %d has stride %lld, expected %lld; %s", name,
                         i, static_cast<long long>(t.strides[i]), static_cast<long long>(expected),
                         describe(t).c_str()));
    }
    expected *= t.shape[i];
  }
  return FPV2_OK;
}

int32_t check_inner_stride(const fpv2_tensor_t& t, const char* name) {
  if (t.ndim == 0 || numel(t) == 0 || t.strides[t.ndim - 1] == 1) return FPV2_OK;
  return fail(FPV2_ERROR_INVALID_ARGUMENT,
              format("%s must have unit stride in its last dimension; got %s", name, describe(t).c_str()));
}

}  // namespace fpv2::detail
