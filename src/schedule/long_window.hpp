// Launch schedules of the long-window family: the compile-time shape of one kernel (vector
// width, columns per CTA, threads, reduction order, exp form) and the launch-only row split.
#pragma once

#include <cstdint>
#include <string>

#include "csa/csa.hpp"

namespace csa::schedule {

struct LongWindowSchedule {
  // Compile-time (part of the kernel's name expression, hence of the cache key).
  // Form: "lanes" (default) holds each lane's window slots in registers and merges softmax
  // partials across lanes; "staged" stages the window in shared memory and may keep the serial
  // order (bitwise contract) at a measured cost.
  bool staged = false;
  int vec = 2;            // bf16 columns per global access
  int cols = 32;          // head_dim columns per CTA (the CTA grid splits columns)
  int threads = 256;      // threads per CTA: (cols / vec) column lanes x window lanes
  bool serial = false;    // sums in slot order, bitwise to the fp32 reference (staged form, or
                          // the lanes form's forward)
  bool fast_exp = false;  // ex2.approx instead of expf (tolerance contract only)
  // Lanes-form backward: rows of the window ring in shared memory (cp.async, STAGES - 1 rows
  // ahead of the row computed); 1 loads each row straight into registers. Needs head_dim % 8.
  int stages = 1;
  // Backward grad_ape: false, one partial per row group summed in a fixed order by a second
  // kernel (bitwise run to run); true, fp32 atomics into grad_ape from the backward kernel
  // itself (lanes form only). Compile-time: an atomic bucket also compiles its fixed-order
  // twin, which calls in deterministic mode take.
  bool atomic_ape = false;
  // Backward of a tail with the norm and without the Hadamard transform (lanes form): true, the
  // row-stats form (kernels/tail_row_stats.cuh first writes each row's norm scalars, then every
  // thread runs the tail's backward of its own columns); false, every CTA runs each of its rows'
  // whole tail (kernels/long_window_tail.cuh). Dropped by fit_long_window where it does not apply.
  bool row_stats = false;
  // Forward of a tail (lanes form): who runs the tail over a row whose columns span CTAs.
  //   kLastSlice: the row's last column slice to arrive, from the fp32 pooled row in global
  //               memory (kernels/long_window_tail.cuh);
  //   kRowKernel: the pooling's column slices write the fp32 pooled rows only, then
  //               kernels/tail_rows_forward.cuh runs the tail over each row whole;
  //   kCluster:   the row's slices are one thread-block cluster (sm_90 and newer, at most
  //               kTailClusterMaxSlices slices) and the first runs the tail from the others'
  //               shared memory. Dropped by fit_long_window where it does not apply.
  enum class TailForward { kLastSlice, kRowKernel, kCluster };
  TailForward tail_forward = TailForward::kLastSlice;
  // Launch-only (editing it never invalidates a cubin).
  int rows_per_cta = 0;  // backward rows per CTA; 0: as many row groups as fill one wave
  // Set by fit_long_window: the lanes form's template arguments differ per direction.
  Direction kernel_direction = Direction::kForward;

  std::string describe() const;  // every field, for logs and `csa schedule`
  int window_lanes() const { return threads / (cols / vec); }  // lanes form
  // CTAs a row's head_dim columns span (the forward's slices, the cluster form's size).
  int column_slices(int head_dim) const { return (head_dim + cols - 1) / cols; }
  // Lanes form: window values a thread holds (its slots of a `window`-slot window, x vec).
  int window_values(int window) const {
    return (window + window_lanes() - 1) / window_lanes() * vec;
  }
  // Whether `o` compiles to the same kernel: equal compile-time fields of its form.
  bool same_kernel(const LongWindowSchedule& o) const;
  bool bitwise() const { return serial && !fast_exp; }
  // The same kernel with grad_ape in the fixed order: what deterministic calls of an atomic
  // bucket launch (compiled beside it).
  LongWindowSchedule fixed_order_twin() const {
    LongWindowSchedule twin = *this;
    twin.atomic_ape = false;
    return twin;
  }
  bool operator==(const LongWindowSchedule& o) const { return describe() == o.describe(); }
  bool row_kernel() const { return tail_forward == TailForward::kRowKernel; }
  bool cluster() const { return tail_forward == TailForward::kCluster; }
};

// Dynamic shared memory of one CTA (must match LongWindow::kBytes in long_window.cuh); 0 for
// the lanes form, whose shared memory is static.
int long_window_shared_bytes(const Config& config, const LongWindowSchedule& s);

// Shared memory one CTA may use on `arch` ("sm_90"), with the opt-in attribute set.
int shared_limit_for_arch(const std::string& arch);

// The schedule made valid for one configuration and arch: vec reduced until it divides
// head_dim, cols reduced to head_dim's power-of-two ceiling and until the window fits
// shared memory. Deterministic, so prewarm and calls agree.
LongWindowSchedule fit_long_window(const Config& config, LongWindowSchedule s,
                                   const std::string& arch, Direction direction);

// The schedule field's name of a tail forward form ("last_slice", "row_kernel", "cluster").
const char* tail_forward_name(LongWindowSchedule::TailForward form) noexcept;

// Row groups and rows per CTA of a backward launch: one full wave unless rows_per_cta is set.
struct LongWindowGrid {
  int row_groups = 1;
  int rows_per_cta = 1;
  int column_slices = 1;
};
LongWindowGrid long_window_backward_grid(const Config& config, const LongWindowSchedule& s,
                                         std::int64_t rows, int sm_count, int resident_per_sm);

// Whether a lane-window forward grid of `ctas` CTAs prefetches its windows before the
// programmatic wait: at most kForwardPrefetchEarlyWaves full waves of resident CTAs.
inline constexpr int kForwardPrefetchEarlyWaves = 3;
bool forward_prefetches_early(std::int64_t ctas, int sm_count, int resident_per_sm);

}  // namespace csa::schedule
