// Checked text-to-number conversion for everything read from the environment, files or the
// command line: the whole text must be one integer inside [lo, hi], else nullopt.
#pragma once

#include <charconv>
#include <cstdint>
#include <optional>
#include <string_view>
#include <system_error>

namespace csa::parse {

template <typename Int>
std::optional<Int> integer(std::string_view text, Int lo, Int hi) {
  if (!text.empty() && text.front() == '+') text.remove_prefix(1);  // from_chars rejects '+'
  Int value{};
  const char* end = text.data() + text.size();
  const auto [ptr, ec] = std::from_chars(text.data(), end, value);
  if (text.empty() || ec != std::errc() || ptr != end || value < lo || value > hi)
    return std::nullopt;
  return value;
}

// 90 for "sm_90", "sm_90a" and "sm_90f"; nullopt for anything else (at most four digits).
inline std::optional<int> compute_capability(std::string_view arch) {
  if (arch.size() < 4 || arch.substr(0, 3) != "sm_") return std::nullopt;
  arch.remove_prefix(3);
  if (arch.back() == 'a' || arch.back() == 'f') arch.remove_suffix(1);
  if (arch.empty() || arch.front() < '0' || arch.front() > '9') return std::nullopt;
  return integer<int>(arch, 0, 9999);
}

}  // namespace csa::parse
