// Helpers shared by the tests of every module.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <utility>

#include "common/status.h"

namespace keel::testing {

// The value of a Result the test expects to succeed; prints the error and aborts otherwise, so
// a setup failure stops the test at once instead of cascading.
template <typename T>
T ValueOrDie(Result<T> result) {
  if (!result.ok()) {
    std::fprintf(stderr, "unexpected error: %s\n", result.status().ToString().c_str());
    std::abort();
  }
  return std::move(result).value();
}

}  // namespace keel::testing
