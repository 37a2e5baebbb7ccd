// Internal error helpers: every thrown csa::Error names what failed.
#pragma once

#include <fmt/format.h>

#include <string>

#include "csa/csa.hpp"

namespace csa {

template <typename... Args>
[[noreturn]] void fail(Status code, fmt::format_string<Args...> format, Args&&... args) {
  throw Error(code, fmt::format(format, std::forward<Args>(args)...));
}

}  // namespace csa
