// One cache entry = one self-validating file: magic, header JSON (key record, lowered names,
// ptxas log), cubin, and an XXH3-64 checksum of everything before it. The decoder trusts
// nothing it reads: every size is bounds-checked before it is used, every header field's type
// is checked, and an entry must name one kernel per name expression of its key.
#pragma once

#include <cstddef>
#include <optional>
#include <string>
#include <vector>

#include "cache/key.hpp"

namespace csa::cache {

// No entry file is read beyond this size (a cubin of every kernel of a configuration is a few
// MB at most).
inline constexpr std::size_t kMaxEntryBytes = std::size_t{64} << 20;
inline constexpr std::size_t kEntryMagicBytes = 8;
const char* entry_magic();  // kEntryMagicBytes bytes, no terminator

struct CubinEntry {
  std::vector<char> cubin;
  std::vector<std::string> lowered_names;
  std::string log;
};

std::vector<char> encode_entry(const CacheKey& key, const CubinEntry& entry);
// nullopt (with `why`) when the bytes are truncated, corrupt, malformed, belong to another
// key, or do not hold exactly `kernels` lowered names.
std::optional<CubinEntry> decode_entry(const std::vector<char>& bytes, const CacheKey& key,
                                       std::size_t kernels, std::string* why);

}  // namespace csa::cache
