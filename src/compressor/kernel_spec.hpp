// What to compile for one configuration: the translation unit, the kernel name expressions
// and the options, and from them the cache key. Shared by calls and prewarm (one key function).
#pragma once

#include <array>
#include <string>

#include "cache/key.hpp"
#include "compressor/register_fit.hpp"
#include "csa/csa.hpp"
#include "csa_params.h"
#include "schedule/long_window.hpp"
#include "schedule/short_window.hpp"

namespace csa::compressor {

// Lanes per column of the long-window scalar grad_ape reduction kernel.
inline constexpr int kApeReduceLanes = 8;
// Lanes over the row groups of the 16-byte reduction, one kernel each: a call with at most 8
// groups per lane takes the fewest lanes that do it; more groups take the scalar kernel,
// which measured faster there (docs/notes/measurements.md).
inline constexpr std::array<int, 2> kApeReduceQuadLanes = {1, 2};

// The named kernel slots of a module (indices into its name expressions); -1: not in it.
struct ShortWindowSlots {
  int forward = -1;
  int forward_wide = -1;
  int backward_fixed = -1;   // grad_ape partials per row group, reduced by ape_reduce
  int backward_atomic = -1;  // grad_ape added atomically
  // The same two with the residency target of backward_resident_ctas_for (large calls), or -1.
  int backward_fixed_resident = -1;
  int backward_atomic_resident = -1;
  int ape_reduce = -1;
  // A tail with the norm and without the Hadamard transform: its backward's row-stats form
  // (the caller keeps the pooled rows), tail_row_stats and the backward in both grad_ape
  // forms on the plain kernel's schedule (KernelSpec's row_stats_schedule).
  int row_stats = -1;
  int backward_row_stats_fixed = -1;
  int backward_row_stats_atomic = -1;
  int row_stats_ape_reduce = -1;
};
// Threads per CTA of tail_row_stats (a warp per row).
inline constexpr int kRowStatsThreads = 256;
// Threads per CTA of tail_rows_forward (whole rows: csa_kernel::tail_rows_vec columns a thread).
inline constexpr int kTailRowsThreads = 256;
static_assert(csa_kernel::tail_rows_vec(csa_kernel::kTailMaxHeadDim, kTailRowsThreads) > 0,
              "tail_rows_forward holds the widest tail row");
struct ReferenceSlots {
  int forward = -1;
  int backward_rows = -1;
  int backward_zeros = -1;
  int grad_ape = -1;
};
// A long-window module holds one kernel per distinct bucket kernel of either direction (found
// by long_window_slot), the scalar grad_ape reduction and, where ratio * W % 4 == 0, the
// 16-byte one at each of kApeReduceQuadLanes.
struct LongWindowSlots {
  int ape_reduce = -1;
  // tail_row_stats, where a backward bucket takes the tail's row-stats form; tail_rows_forward,
  // where a forward bucket takes the row-kernel form.
  int row_stats = -1;
  int rows_forward = -1;
  std::array<int, kApeReduceQuadLanes.size()> ape_reduce_quads = {-1, -1};
};
struct KernelSlots {
  ShortWindowSlots short_window;
  ReferenceSlots reference;
  LongWindowSlots long_window;
};

struct CompileOptions {
  bool ptxas_verbose = true;
  bool line_info = false;
};

struct ModuleSpec {
  cache::CacheKey key;
  nvrtc::CompileRequest request;
  KernelSlots slots;
  ResidencyTable residency;  // register fitting's (compile_fitted): empty where none applies
};

// The kernels' layout policies prewarm and plans prepare for a configuration
// (csa_kernel::LayoutKind): THD packed (and THD strided with config.strided), or SBHD.
std::vector<int> kernel_layouts(const Config& config);
const char* kernel_layout_name(int kernel_layout);  // "thd", "thd-strided", "sbhd"
// The I/O policy argument of every kernel template: "csa_kernel::Io<dtype,layout,epilogue>".
std::string io_policy(const Config& config, int kernel_layout);
// The epilogue of a tail (csa_kernel::kEpilogueIdentity without one, else tail_epilogue's code).
int epilogue_code(const TailShape& tail);

// `family` must be resolved (not kAuto).
ModuleSpec make_module_spec(const Config& config, int kernel_layout, Family family,
                            const schedule::ShortWindowSchedule& schedule, const std::string& arch,
                            const CompileOptions& options);

// One module for every bucket kernel of a long-window configuration, so that prewarm leaves
// no cold bucket behind.
ModuleSpec make_long_window_spec(const Config& config, int kernel_layout,
                                 const std::vector<schedule::LongWindowSchedule>& forward,
                                 const std::vector<schedule::LongWindowSchedule>& backward,
                                 const std::string& arch, const CompileOptions& options);
// The slot of a long-window module (made by make_long_window_spec for the same configuration
// and kernel layout) holding the kernel of schedule `s`; -1 if it holds none.
int long_window_slot(const ModuleSpec& spec, const Config& config, int kernel_layout,
                     const schedule::LongWindowSchedule& s, Direction direction);

// The small per-arch module holding the device-side offset check.
ModuleSpec make_utility_spec(const std::string& arch, const CompileOptions& options);

std::string config_label(const Config& config);  // "ratio=4 coff=2 head_dim=128 bf16 thd"
// The arguments of `csa prewarm --config` for it: "ratio=4,coff=2,head_dim=128[ --dtype ..]".
std::string prewarm_spec(const Config& config);

}  // namespace csa::compressor
