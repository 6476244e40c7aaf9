// Status strings and the thread-local last-error message.
#include "abi/errors.hpp"

#include <cstdarg>
#include <cstdio>
#include <exception>
#include <vector>

namespace fpv2::detail {
namespace {

// One message per thread: an error raised on one thread is never reported on another.
thread_local std::string last_error;

}  // namespace

std::string format(const char* fmt, ...) {
  va_list args;
  va_start(args, fmt);
  va_list copy;
  va_copy(copy, args);
  const int needed = std::vsnprintf(nullptr, 0, fmt, copy);
  va_end(copy);
  std::string out;
  if (needed > 0) {
    std::vector<char> buffer(static_cast<size_t>(needed) + 1);
    std::vsnprintf(buffer.data(), buffer.size(), fmt, args);
    out.assign(buffer.data(), static_cast<size_t>(needed));
  }
  va_end(args);
  return out;
}

int32_t fail(int32_t status, const std::string& message) {
  last_error = message;
  return status;
}

void clear_last_error() { last_error.clear(); }

const char* last_error_message() noexcept { return last_error.c_str(); }

}  // namespace fpv2::detail

extern "C" {

FPV2_API const char* fpv2_status_string(int32_t status) {
  switch (status) {
    case FPV2_OK:
      return "FPV2_OK: success";
    case FPV2_ERROR_INVALID_ARGUMENT:
      return "FPV2_ERROR_INVALID_ARGUMENT: malformed or inconsistent arguments";
    case FPV2_ERROR_UNSUPPORTED:
      return "FPV2_ERROR_UNSUPPORTED: a configuration this library does not handle";
    case FPV2_ERROR_NOT_BUILT:
      return "FPV2_ERROR_NOT_BUILT: the requested kernel is not part of this build";
    case FPV2_ERROR_CUDA:
      return "FPV2_ERROR_CUDA: a CUDA call failed";
    case FPV2_ERROR_WORKSPACE_TOO_SMALL:
      return "FPV2_ERROR_WORKSPACE_TOO_SMALL: the workspace is smaller than the call needs";
    case FPV2_ERROR_INTERNAL:
      return "FPV2_ERROR_INTERNAL: internal error";
    default:
      return "unknown fpv2 status code";
  }
}

FPV2_API const char* fpv2_get_last_error(void) { return fpv2::detail::last_error_message(); }

}  // extern "C"
