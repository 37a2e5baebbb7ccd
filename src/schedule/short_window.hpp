// Launch schedules of the short-window family: the compile-time shape (vector widths, block
// shape) chosen per configuration, and the run-time grid chosen per call from the row count.
#pragma once

#include <cstdint>
#include <limits>
#include <optional>
#include <string>

#include "csa/csa.hpp"

namespace csa::schedule {

// The whole window lives in registers up to this ratio (local memory on sm_80..sm_100: the
// compile tests and tests/local_memory.txt).
inline constexpr int kShortWindowMaxRatio = 16;
// The fewest output elements of a tail's backward call that take its resident kernel.
inline constexpr std::int64_t kTailResidentMinElements = std::int64_t{1} << 20;
// forward_wide_min_elements of a schedule with no wide forward: every call runs the narrow
// one, and the module holds no wide kernel.
inline constexpr std::int64_t kNoWideForward = std::numeric_limits<std::int64_t>::max();

struct ShortWindowSchedule {
  // Small calls (total_comp * head_dim < forward_wide_min_elements) run the narrow forward:
  // more threads in flight, in small CTAs. Large calls run the wide one: wider vectors, fewer
  // threads, less per-row overhead.
  int forward_vec = 2;               // bf16 columns per thread (1 for odd head_dim)
  int forward_narrow_threads = 128;  // threads per CTA of the narrow forward
  int forward_wide_vec = 2;
  int forward_threads = 256;  // threads per CTA of the wide forward, one (row, vector) each
  std::int64_t forward_wide_min_elements = 600000;
  int forward_wide_min_ctas = 0;  // CTAs per SM the wide forward must fit (0: ptxas's choice)
                                  // (fp16 at windows of 5..8 slots: 3)
  int backward_vec = 2;
  int backward_tx = 64;       // threads along column vectors
  int backward_ty = 4;        // row lanes per CTA (folded in fixed order for grad_ape)
  int backward_min_ctas = 0;  // CTAs per SM the backward's registers must fit (0: ptxas's choice)
  // Large backward calls (total_comp * head_dim >= backward_resident_min_elements) of the
  // kernels backward_resident_ctas_for() names run a second backward kernel whose registers
  // must fit backward_resident_ctas CTAs per SM (0: no second kernel). Where the default
  // kernel needs more registers than that, the DRAM-bound large calls measured faster with the
  // residency and the small ones slower (docs/performance.md).
  int backward_resident_ctas = 0;
  std::int64_t backward_resident_min_elements = std::int64_t{1}
                                                << 19;  // a tail's: 2^20 (kTailResidentMinElements)
  int reduce_lanes = 8;  // fixed-order grad_ape reduction: lanes per column (see the rule)
  bool fixed_order_default = true;  // grad_ape without atomics even when not asked for
  // A default (not deterministic) backward that fixed_order_default gives two launches (rows,
  // then the reduction) takes the atomic form in one launch instead, with claim words: half
  // the host time outside capture, and faster in a replayed graph too since the claimant
  // zeroes grad_ape at its start. Under capture only where a
  // CTA has at least captured_one_launch_min rows x window slots of work (0: always; an
  // override for measuring), and where the Runtime has claim words left for graphs; else the
  // fixed order.
  bool one_launch = true;
  int captured_one_launch_min = 0;
  // A tail with the norm and without the Hadamard transform: the block shape and grad_ape rule
  // of its backward's row-stats form (where the caller keeps the pooled rows), the plain
  // configuration's; row_stats_tx 0: the schedule has none (row_stats_backward).
  int row_stats_vec = 0;
  int row_stats_tx = 0;
  int row_stats_ty = 0;
  int row_stats_min_ctas = 0;
  int row_stats_reduce_lanes = 8;
  bool row_stats_fixed_order_default = false;
  bool row_stats_one_launch = true;

  std::string describe() const;
  bool operator==(const ShortWindowSchedule& o) const;
};

// Which forward kernel a call with `total_comp` rows runs, and its launch shape.
struct ForwardChoice {
  bool wide = false;
  int vec = 1;
  int threads = 256;
};
// Whether `s` has a row-stats backward, and that backward as a schedule of its own (its
// backward fields the row_stats_ ones, no resident kernel).
inline bool has_row_stats_backward(const ShortWindowSchedule& s) {
  return s.row_stats_tx > 0;
}
ShortWindowSchedule row_stats_backward(const ShortWindowSchedule& s);

// Whether calls of `s` may take the wide forward (a module holds it only then).
inline bool has_wide_forward(const ShortWindowSchedule& s) {
  return s.forward_wide_min_elements != kNoWideForward;
}

ForwardChoice forward_choice(const ShortWindowSchedule& s, const Config& config,
                             std::int64_t total_comp);
// The narrow (wide = false) or wide forward kernel of a module. With a tail (config.tail) the
// vector width is tail_vec's and the CTA holds whole rows in whole warps.
ForwardChoice forward_kernel(const ShortWindowSchedule& s, const Config& config, bool wide);

// The vector width of a tail kernel nearest `preferred` (1, 2, 4 or 8; the narrower first)
// whose rows are held by whole warps or a power of two of threads up to a warp
// (csa_kernel::tail_row_threads_ok of head_dim / vec); 0: no width serves head_dim.
int tail_vec(int preferred, int head_dim);

// The residency target of the second backward kernel of the module of `config` for
// `kernel_layout` (csa_kernel::LayoutKind); 0: that module has none. Packed bf16 without a tail
// has none: its default kernel already fits three CTAs per SM (80 registers) where the rule
// asks for them (the tail's takes 104-124); fp32 has none, nor a tail on row-strided THD rows:
// their resident kernels measured slower.
int backward_resident_ctas_for(const ShortWindowSchedule& s, const Config& config,
                               int kernel_layout);

// Whether a backward call with `total_comp` rows takes the second (resident) kernel of a
// module that has one.
bool backward_takes_resident(const ShortWindowSchedule& s, const Config& config,
                             std::int64_t total_comp);

// `override_spec`:
// "fv=4,fnt=128,fwv=4,fwmin=600000,fwctas=0,ft=256,bv=2,tx=64,ty=4,bmin=0,bres=3,bresmin=524288,fixed=1,
// one=1,cap=128,rl=16" fields
// replace the rule's choice (CSA_SHORT_WINDOW_SCHEDULE; for tuning). Throws Error(kInvalidArgument)
// on a bad field.
ShortWindowSchedule select_short_window(const Config& config,
                                        const std::optional<std::string>& override_spec = {});

struct BackwardGrid {
  int grid_x = 1;
  int grid_y = 1;  // row groups
  int rows_per_cta = 1;
};

// Limits of one multiprocessor, for occupancy.
struct SmLimits {
  int registers = 65536;
  int threads = 2048;
  int ctas = 32;
  int shared_bytes = 233472;
};

// CTAs of `threads` threads using `registers` per thread and `shared_bytes` that fit on one SM.
int resident_ctas(const SmLimits& sm, int threads, int registers, int shared_bytes);

// One full wave of `resident_per_sm` CTAs per SM; each CTA loops over its rows.
BackwardGrid backward_grid(const ShortWindowSchedule& s, const Config& config,
                           std::int64_t total_comp, int sm_count, int resident_per_sm);

}  // namespace csa::schedule
