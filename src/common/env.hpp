// Environment lookups. Read once, when a Runtime is built; never on the launch path.
#pragma once

#include <cstdlib>
#include <optional>
#include <string>

namespace csa::env {

inline std::optional<std::string> get(const char* name) {
  const char* v = std::getenv(name);  // NOLINT(concurrency-mt-unsafe): read at construction only
  if (v == nullptr || *v == '\0') return std::nullopt;
  return std::string(v);
}

// "1", "true", "on", "yes" are true; "0", "false", "off", "no" false; anything else: fallback.
inline bool flag(const char* name, bool fallback) {
  const auto v = get(name);
  if (!v) return fallback;
  if (*v == "1" || *v == "true" || *v == "on" || *v == "yes") return true;
  if (*v == "0" || *v == "false" || *v == "off" || *v == "no") return false;
  return fallback;
}

}  // namespace csa::env
