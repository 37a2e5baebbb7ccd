#include "cache/entry.hpp"

#include <cstdint>
#include <cstring>
#include <nlohmann/json.hpp>

#define XXH_INLINE_ALL
#include <xxhash.h>

namespace csa::cache {

namespace {

constexpr char kMagic[kEntryMagicBytes] = {'C', 'S', 'A', 'C', 'U', 'B', '0', '1'};
constexpr std::size_t kMaxNameBytes = 4096;

template <typename T>
void put(std::vector<char>& out, T value) {
  const char* p = reinterpret_cast<const char*>(&value);
  out.insert(out.end(), p, p + sizeof(T));
}

// Reads a T at `pos` of the first `end` bytes; false when fewer than sizeof(T) are left.
template <typename T>
bool take(const std::vector<char>& in, std::size_t end, std::size_t& pos, T& value) {
  if (pos > end || end - pos < sizeof(T)) return false;
  std::memcpy(&value, in.data() + pos, sizeof(T));
  pos += sizeof(T);
  return true;
}

bool string_field(const nlohmann::json& header, const char* name, const std::string& expected) {
  const auto it = header.find(name);
  return it != header.end() && it->is_string() && it->get_ref<const std::string&>() == expected;
}

}  // namespace

const char* entry_magic() {
  return kMagic;
}

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
                                       std::size_t kernels, std::string* why) {
  auto reject = [&](const char* reason) -> std::optional<CubinEntry> {
    if (why != nullptr) *why = reason;
    return std::nullopt;
  };
  constexpr std::size_t kSum = sizeof(std::uint64_t);
  if (bytes.size() < sizeof kMagic + sizeof(std::uint32_t) + sizeof(std::uint64_t) + kSum)
    return reject("truncated (shorter than a header)");
  if (bytes.size() > kMaxEntryBytes) return reject("larger than an entry may be");
  if (std::memcmp(bytes.data(), kMagic, sizeof kMagic) != 0)
    return reject("bad magic or format version");
  const std::size_t body = bytes.size() - kSum;  // everything the checksum covers
  std::uint64_t stored_sum = 0;
  std::memcpy(&stored_sum, bytes.data() + body, kSum);
  if (XXH3_64bits(bytes.data(), body) != stored_sum)
    return reject("checksum mismatch (truncated or corrupt)");
  std::size_t pos = sizeof kMagic;
  std::uint32_t header_size = 0;
  if (!take(bytes, body, pos, header_size) || body - pos < header_size)
    return reject("truncated header");
  const nlohmann::json header =
      nlohmann::json::parse(bytes.begin() + static_cast<std::ptrdiff_t>(pos),
                            bytes.begin() + static_cast<std::ptrdiff_t>(pos + header_size), nullptr,
                            /*allow_exceptions=*/false);
  pos += header_size;
  if (header.is_discarded() || !header.is_object()) return reject("unreadable header");
  if (!string_field(header, "hash", key.hash) || !string_field(header, "record", key.record))
    return reject("entry belongs to another key");
  std::uint64_t cubin_size = 0;
  if (!take(bytes, body, pos, cubin_size) || cubin_size != body - pos)
    return reject("cubin size mismatch");
  if (cubin_size == 0) return reject("empty cubin");
  const auto names = header.find("lowered_names");
  if (names == header.end() || !names->is_array()) return reject("malformed lowered_names");
  if (names->size() != kernels) return reject("kernel count differs from its key's");
  CubinEntry entry;
  for (const auto& name : *names) {
    if (!name.is_string()) return reject("malformed lowered_names");
    const auto& text = name.get_ref<const std::string&>();
    if (text.empty() || text.size() > kMaxNameBytes || text.find('\0') != std::string::npos)
      return reject("malformed lowered_names");
    entry.lowered_names.push_back(text);
  }
  if (const auto log = header.find("log"); log != header.end()) {
    if (!log->is_string()) return reject("malformed log");
    entry.log = log->get<std::string>();
  }
  entry.cubin.assign(bytes.begin() + static_cast<std::ptrdiff_t>(pos),
                     bytes.begin() + static_cast<std::ptrdiff_t>(body));
  return entry;
}

}  // namespace csa::cache
