#include "cache/entry.hpp"

#include <cstdint>
#include <cstring>
#include <nlohmann/json.hpp>

#define XXH_INLINE_ALL
#include <xxhash.h>

namespace csa::cache {

namespace {

constexpr char kMagic[8] = {'C', 'S', 'A', 'C', 'U', 'B', '0', '1'};

template <typename T>
void put(std::vector<char>& out, T value) {
  const char* p = reinterpret_cast<const char*>(&value);
  out.insert(out.end(), p, p + sizeof(T));
}

template <typename T>
bool take(const std::vector<char>& in, std::size_t& pos, T& value) {
  if (in.size() - pos < sizeof(T)) return false;
  std::memcpy(&value, in.data() + pos, sizeof(T));
  pos += sizeof(T);
  return true;
}

}  // namespace

std::vector<char> encode_entry(const CacheKey& key, const CubinEntry& entry) {
  const nlohmann::json header = {{"hash", key.hash},
                                 {"record", key.record},
                                 {"lowered_names", entry.lowered_names},
                                 {"log", entry.log},
                                 {"cubin_bytes", entry.cubin.size()}};
  const std::string text = header.dump();
  std::vector<char> out(kMagic, kMagic + sizeof kMagic);
  put<std::uint32_t>(out, static_cast<std::uint32_t>(text.size()));
  out.insert(out.end(), text.begin(), text.end());
  put<std::uint64_t>(out, entry.cubin.size());
  out.insert(out.end(), entry.cubin.begin(), entry.cubin.end());
  put<std::uint64_t>(out, XXH3_64bits(out.data(), out.size()));
  return out;
}

std::optional<CubinEntry> decode_entry(const std::vector<char>& bytes, const CacheKey& key,
                                       std::string* why) {
  auto reject = [&](const char* reason) -> std::optional<CubinEntry> {
    if (why != nullptr) *why = reason;
    return std::nullopt;
  };
  if (bytes.size() < sizeof kMagic + 4 + 8 + 8) return reject("truncated (shorter than a header)");
  if (std::memcmp(bytes.data(), kMagic, sizeof kMagic) != 0)
    return reject("bad magic or format version");
  std::uint64_t stored_sum = 0;
  std::memcpy(&stored_sum, bytes.data() + bytes.size() - 8, 8);
  if (XXH3_64bits(bytes.data(), bytes.size() - 8) != stored_sum)
    return reject("checksum mismatch (truncated or corrupt)");
  std::size_t pos = sizeof kMagic;
  std::uint32_t header_size = 0;
  if (!take(bytes, pos, header_size) || bytes.size() - pos < header_size)
    return reject("truncated header");
  nlohmann::json header =
      nlohmann::json::parse(bytes.begin() + static_cast<std::ptrdiff_t>(pos),
                            bytes.begin() + static_cast<std::ptrdiff_t>(pos + header_size), nullptr,
                            /*allow_exceptions=*/false);
  pos += header_size;
  if (header.is_discarded() || !header.is_object()) return reject("unreadable header");
  if (header.value("hash", "") != key.hash || header.value("record", "") != key.record) {
    return reject("entry belongs to another key");
  }
  std::uint64_t cubin_size = 0;
  if (!take(bytes, pos, cubin_size) || bytes.size() - pos - 8 != cubin_size)
    return reject("cubin size mismatch");
  CubinEntry entry;
  entry.cubin.assign(bytes.begin() + static_cast<std::ptrdiff_t>(pos),
                     bytes.begin() + static_cast<std::ptrdiff_t>(pos + cubin_size));
  try {
    entry.lowered_names = header.at("lowered_names").get<std::vector<std::string>>();
    entry.log = header.value("log", "");
  } catch (const nlohmann::json::exception&) {
    return reject("malformed header fields");
  }
  return entry;
}

}  // namespace csa::cache
