// What to compile for one configuration: the translation unit, the kernel name expressions
// and the options, and from them the cache key. Shared by calls and prewarm (one key function).
#pragma once

#include <string>

#include "cache/key.hpp"
#include "csa/csa.hpp"
#include "schedule/short_window.hpp"

namespace csa::compressor {

// Kernel slots of a short-window module, in name-expression order.
enum ShortWindowKernel : int {
  kSwForward = 0,
  kSwBackwardFixed,
  kSwBackwardAtomic,
  kSwApeReduce,
  kSwForwardWide,
  kSwCount
};
// Kernel slots of a reference module.
enum ReferenceKernel : int {
  kRefForward = 0,
  kRefBackwardRows,
  kRefBackwardZeros,
  kRefGradApe,
  kRefCount
};

struct CompileOptions {
  bool ptxas_verbose = true;
  bool line_info = false;
};

struct ModuleSpec {
  cache::CacheKey key;
  nvrtc::CompileRequest request;
};

// `family` must be resolved (not kAuto).
ModuleSpec make_module_spec(const Config& config, Family family,
                            const schedule::ShortWindowSchedule& schedule, const std::string& arch,
                            const CompileOptions& options);

// The small per-arch module holding the device-side offset check.
ModuleSpec make_utility_spec(const std::string& arch, const CompileOptions& options);

std::string config_label(const Config& config);  // "ratio=4 coff=2 head_dim=128"
std::string prewarm_spec(const Config& config);  // "4,2,128"

}  // namespace csa::compressor
