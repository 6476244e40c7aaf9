// Status codes and the thread-local last-error message shared by every entry point.
#pragma once

#include <cstdint>
#include <exception>
#include <string>

#include "fpv2/fpv2.h"

namespace fpv2::detail {

// printf-style formatting into a std::string (messages are built only on error paths).
std::string format(const char* fmt, ...) __attribute__((format(printf, 1, 2)));

// Record `message` as this thread's last error and return `status`.
int32_t fail(int32_t status, const std::string& message);

// This thread's last error ("" after a successful call).
const char* last_error_message() noexcept;

// Forget this thread's last error (the call in progress succeeded so far).
void clear_last_error();

// Run one public entry point: clear the last error, run `body`, and turn any C++ exception into
// FPV2_ERROR_INTERNAL so that no exception ever crosses the C boundary.
template <class Body>
int32_t guarded(const char* function, Body&& body) noexcept {
  try {
    clear_last_error();
    return body();
  } catch (const std::exception& e) {
    try {
      return fail(FPV2_ERROR_INTERNAL, std::string(function) + ": internal error: " + e.what());
    } catch (...) {
      return FPV2_ERROR_INTERNAL;
    }
  } catch (...) {
    try {
      return fail(FPV2_ERROR_INTERNAL, std::string(function) + ": internal error (unknown exception)");
    } catch (...) {
      return FPV2_ERROR_INTERNAL;
    }
  }
}

}  // namespace fpv2::detail

// Propagate a non-OK status from a check to the caller.
#define FPV2_RETURN_IF_ERROR(expr)                \
  do {                                            \
    const int32_t fpv2_status_ = (expr);          \
    if (fpv2_status_ != FPV2_OK) {                \
      return fpv2_status_;                        \
    }                                             \
  } while (0)
