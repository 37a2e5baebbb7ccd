// Environment lookups. Read once, when a Runtime is built; never on the launch path. Nothing
// read here is trusted: a value that is not of the documented form is reported in `warnings`
// and the default is kept.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

namespace csa::env {

inline std::optional<std::string> get(const char* name) {
  const char* v = std::getenv(name);  // NOLINT(concurrency-mt-unsafe): read at construction only
  if (v == nullptr || *v == '\0') return std::nullopt;
  return std::string(v);
}

// The one spelling set of boolean variables, any letter case: 1, true, yes, on / 0, false,
// no, off. std::nullopt for anything else.
std::optional<bool> parse_flag(const std::string& text);

// A boolean variable; unset: `fallback`; not of the spelling set: a warning and `fallback`.
bool flag(const char* name, bool fallback, std::vector<std::string>& warnings);

// An integer variable inside [lo, hi]; unset: `fallback`; anything else: a warning and
// `fallback`.
std::int64_t integer(const char* name, std::int64_t lo, std::int64_t hi, std::int64_t fallback,
                     std::vector<std::string>& warnings);

}  // namespace csa::env
