// One cache entry = one self-validating file: magic, header JSON (key record, lowered names,
// ptxas log), cubin, and an XXH3-64 checksum of everything before it.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "cache/key.hpp"

namespace csa::cache {

struct CubinEntry {
  std::vector<char> cubin;
  std::vector<std::string> lowered_names;
  std::string log;
};

std::vector<char> encode_entry(const CacheKey& key, const CubinEntry& entry);
// nullopt (with `why`) when the bytes are truncated, corrupt, or belong to another key.
std::optional<CubinEntry> decode_entry(const std::vector<char>& bytes, const CacheKey& key,
                                       std::string* why);

}  // namespace csa::cache
