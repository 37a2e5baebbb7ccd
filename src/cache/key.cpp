#include "cache/key.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <nlohmann/json.hpp>

#define XXH_INLINE_ALL
#include <xxhash.h>

namespace csa::cache {

namespace {
constexpr int kKeySchema = 1;
}

std::string hash128_hex(std::string_view data) {
  const XXH128_hash_t h = XXH3_128bits(data.data(), data.size());
  return fmt::format("{:016x}{:016x}", h.high64, h.low64);
}

CacheKey make_key(std::string label, const nvrtc::CompileRequest& request,
                  std::string_view sources_hash, int fit) {
  std::vector<std::string> options = request.options;
  std::sort(options.begin(), options.end());
  const auto [major, minor] = nvrtc::Compiler::version();
  nlohmann::json record = {
      {"schema", kKeySchema},
      {"library", CSA_VERSION_STRING},
      {"sources", std::string(sources_hash)},
      {"translation_unit", request.source},
      {"names", request.name_expressions},
      {"options", options},
      {"arch", request.arch},
      {"nvrtc", fmt::format("{}.{}", major, minor)},
  };
  if (fit != 0) record["fit"] = fit;
  CacheKey key;
  key.label = std::move(label);
  key.record = record.dump();
  key.hash = hash128_hex(key.record);
  return key;
}

}  // namespace csa::cache
