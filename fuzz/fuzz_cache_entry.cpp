// libFuzzer: the cache-entry decoder and the trust checks behind it. The input's last 8 bytes
// are replaced by the XXH3 checksum of the rest, so that mutations reach the header, the
// sizes and the names instead of dying at the checksum. The entry is then read through the
// real path, a file in a cache directory, by DiskCache::load: it must come back valid for its
// key or be discarded, never crash, hang or read out of bounds.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <vector>

#include "cache/disk_cache.hpp"
#include "cache/entry.hpp"
#include "nvrtc/compiler.hpp"

#define XXH_INLINE_ALL
#include <xxhash.h>

namespace {

// The key of the seed corpus's entries: fixed text, so that the seeds stay valid whatever
// the library and NVRTC versions (the decoder compares these two fields only).
const csa::cache::CacheKey& fuzz_key() {
  static const csa::cache::CacheKey key{"fuzz-r4-c2-d128-sm_90", "{\"fuzz\":1}",
                                        "00112233445566778899aabbccddeeff"};
  return key;
}

struct Directory {
  Directory() {
    char tmpl[] = "/tmp/csa-fuzz-entry-XXXXXX";
    path = ::mkdtemp(tmpl);
  }
  ~Directory() { std::filesystem::remove_all(path); }
  std::filesystem::path path;
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  std::vector<char> bytes(reinterpret_cast<const char*>(data),
                          reinterpret_cast<const char*>(data) + size);
  if (bytes.size() >= 8) {
    const std::uint64_t sum = XXH3_64bits(bytes.data(), bytes.size() - 8);
    std::memcpy(bytes.data() + bytes.size() - 8, &sum, 8);
  }
  const auto& key = fuzz_key();
  std::string why;
  const auto entry = csa::cache::decode_entry(bytes, key, 2, &why);
  if (entry && (entry->lowered_names.size() != 2 || entry->cubin.empty())) std::abort();
  if (entry) csa::nvrtc::parse_ptxas_report(entry->log);

  static Directory dir;
  static auto logger = csa::make_logger("off");
  const std::filesystem::path file = dir.path / csa::cache::entry_file_name(key);
  {
    std::ofstream out(file, std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  }
  csa::cache::DiskCacheOptions options;
  options.directory = dir.path.string();
  csa::cache::DiskCache cache(options, *logger);
  const auto hit = cache.load(key, 2);
  if (hit.has_value() != entry.has_value()) std::abort();
  if (hit && hit->entry.cubin != entry->cubin) std::abort();
  return 0;
}
