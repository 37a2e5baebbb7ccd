#include "common/env.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>

#include "common/parse.hpp"

namespace csa::env {

std::optional<bool> parse_flag(const std::string& text) {
  std::string lower = text;
  std::transform(lower.begin(), lower.end(), lower.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  if (lower == "1" || lower == "true" || lower == "yes" || lower == "on") return true;
  if (lower == "0" || lower == "false" || lower == "no" || lower == "off") return false;
  return std::nullopt;
}

bool flag(const char* name, bool fallback, std::vector<std::string>& warnings) {
  const auto v = get(name);
  if (!v) return fallback;
  if (const auto parsed = parse_flag(*v)) return *parsed;
  warnings.push_back(fmt::format(
      "{}='{}' is not a boolean (1/0, true/false, yes/no, on/off); keeping the default ({})", name,
      *v, fallback ? "on" : "off"));
  return fallback;
}

std::int64_t integer(const char* name, std::int64_t lo, std::int64_t hi, std::int64_t fallback,
                     std::vector<std::string>& warnings) {
  const auto v = get(name);
  if (!v) return fallback;
  if (const auto parsed = parse::integer<std::int64_t>(*v, lo, hi)) return *parsed;
  warnings.push_back(fmt::format("{}='{}' is not an integer in [{}, {}]; keeping the default ({})",
                                 name, *v, lo, hi, fallback));
  return fallback;
}

}  // namespace csa::env
