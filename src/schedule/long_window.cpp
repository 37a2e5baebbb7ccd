#include "schedule/long_window.hpp"

#include "common/error.hpp"
#include "common/parse.hpp"
#include "csa_params.h"

#include <fmt/format.h>

#include <algorithm>

namespace csa::schedule {

std::string LongWindowSchedule::describe() const {
  return fmt::format(
      "form={} vec={} cols={} threads={} serial={} fast_exp={} stages={} rows_per_cta={} "
      "grad_ape={}{}{}",
      staged ? "staged" : "lanes", vec, cols, threads, serial ? 1 : 0, fast_exp ? 1 : 0, stages,
      rows_per_cta, atomic_ape ? "atomic" : "fixed_order",
      row_stats ? " tail_backward=row_stats" : "",
      tail_forward == TailForward::kLastSlice
          ? std::string()
          : fmt::format(" tail_forward={}", tail_forward_name(tail_forward)));
}

const char* tail_forward_name(LongWindowSchedule::TailForward form) noexcept {
  switch (form) {
    case LongWindowSchedule::TailForward::kRowKernel:
      return "row_kernel";
    case LongWindowSchedule::TailForward::kCluster:
      return "cluster";
    case LongWindowSchedule::TailForward::kLastSlice:
      break;
  }
  return "last_slice";
}

bool LongWindowSchedule::same_kernel(const LongWindowSchedule& o) const {
  if (staged != o.staged || vec != o.vec || cols != o.cols || threads != o.threads ||
      fast_exp != o.fast_exp)
    return false;
  // The lanes-form backward compiles its ring stages and grad_ape mode; the other forms the
  // serial order.
  if (!staged && kernel_direction == Direction::kBackward)
    return stages == o.stages && atomic_ape == o.atomic_ape && row_stats == o.row_stats;
  return serial == o.serial && tail_forward == o.tail_forward;
}

int long_window_shared_bytes(const Config& c, const LongWindowSchedule& s) {
  const int win = c.coff * c.ratio;
  const int element = static_cast<int>(c.dtype);
  if (!s.staged) {
    if (s.stages <= 1) return 0;
    const int stage_elems =
        csa_kernel::lane_ring_stage_elements(element, win, s.window_lanes(), s.cols);
    // LaneRing::APE_FLOATS: with 64 registers a thread (above 256 threads, at most 8 window
    // values a thread), each thread's ape values (C slots x vec).
    const int values = s.window_values(win);
    const int ape_floats =
        csa_kernel::lane_ring_tight_registers(s.threads, values) ? values * s.threads : 0;
    return s.stages * stage_elems * csa_kernel::element_bytes(element) + ape_floats * 4;
  }
  return csa_kernel::staged_window_bytes(element, win, s.threads / s.cols, s.cols);
}

int shared_limit_for_arch(const std::string& arch) {
  const int cc = parse::compute_capability(arch).value_or(0);
  // Opt-in shared memory per block (CUDA programming guide, compute capabilities table).
  if (cc == 80 || cc == 87) return 163 * 1024;
  if (cc == 90 || cc == 100 || cc == 103) return 227 * 1024;
  return 99 * 1024;  // sm_86, sm_89, sm_110, sm_120, sm_121 and anything unknown
}

LongWindowSchedule fit_long_window(const Config& c, LongWindowSchedule s, const std::string& arch,
                                   Direction direction) {
  s.kernel_direction = direction;
  // A tail runs in the lanes form (kernels/long_window_tail.cuh).
  if (c.tail.any()) s.staged = false;
  // The tail's forms: the row-stats backward of a tail with the norm and without the Hadamard
  // transform, the row-kernel and cluster forwards of any tail (the cluster's size below).
  if (direction == Direction::kForward || !c.tail.norm || c.tail.hadamard) s.row_stats = false;
  if (direction == Direction::kBackward || !c.tail.any())
    s.tail_forward = LongWindowSchedule::TailForward::kLastSlice;
  while (s.vec > 1 && c.head_dim % s.vec != 0) s.vec /= 2;
  int ceiling = 1;
  while (ceiling < c.head_dim) ceiling *= 2;
  s.cols = std::max(std::min(s.cols, ceiling), s.vec);
  if (s.staged) {
    const int limit = shared_limit_for_arch(arch);
    while (s.cols > s.vec && long_window_shared_bytes(c, s) > limit) s.cols /= 2;
    while (s.cols > 1 && long_window_shared_bytes(c, s) > limit) {
      s.cols /= 2;
      s.vec = std::min(s.vec, s.cols);
    }
    s.threads = std::max(s.threads, s.cols);
    return s;
  }
  // Lanes form: at least vec window lanes (they finish the columns), at most 16 (backward:
  // window, kv, ape and grad_ape per value) or 32 (forward) window values per thread in
  // registers, and static shared memory (12 B
  // forward, 24 B backward per thread and column, plus the serial forward's window of e)
  // within 48 KB.
  if (direction == Direction::kBackward) s.serial = false;
  if (direction == Direction::kForward) s.atomic_ape = false;
  if (direction == Direction::kForward) s.stages = 1;
  if (s.serial) s.fast_exp = false;
  const int win = c.coff * c.ratio;
  // per column: the serial forward's window of e, padded by 4 floats (kSerialPad)
  const int window_bytes = s.serial ? (win + 4) * 4 : 0;
  const int per_thread_values = direction == Direction::kForward ? 32 : 16;
  const int smem_per_value = direction == Direction::kForward ? 12 : 24;
  auto tx = [&] { return s.cols / s.vec; };
  auto values = [&] { return s.window_values(win); };
  s.threads = std::max(s.threads, tx() * s.vec);
  auto smem_ok = [&](int threads, int vec) {
    return threads * vec * smem_per_value + window_bytes * s.cols <= 48 * 1024;
  };
  while (s.cols > s.vec && !smem_ok(tx() * s.vec, s.vec)) s.cols /= 2;
  while (!smem_ok(s.threads, s.vec) && s.threads > tx() * s.vec) s.threads /= 2;
  while (values() > per_thread_values) {
    // At most 512 threads: 128 registers per thread (1024 would allow only 64).
    if (s.threads < 512 && smem_ok(s.threads * 2, s.vec)) {
      s.threads *= 2;  // more window lanes
    } else if (tx() > 1) {
      s.cols /= 2;  // fewer column lanes, so more window lanes
    } else if (s.vec > 1) {
      s.vec /= 2;
      s.cols /= 2;
    } else {
      break;  // one column, 512 lanes: at most one value per thread for ratio <= 256
    }
  }
  // The ring copies 16-byte chunks (8 columns of bf16/fp16, 4 of fp32); its static shared
  // memory (24 B per thread and column, above) and the ring share the arch's limit.
  const int chunk = csa_kernel::chunk_elements(static_cast<int>(c.dtype));
  if (c.head_dim % chunk != 0 || s.cols < chunk) s.stages = 1;
  // The ring kernels of 64 registers a thread have none left for the row-stats form.
  if (s.stages > 1 && csa_kernel::lane_ring_tight_registers(s.threads, values()))
    s.row_stats = false;
  // The tail's static shared memory: its rows (at most 8 floats a thread; twice with the
  // Hadamard transform's two exchange buffers), the row sums and, backward, the pooled row's
  // gradient (none in the row-stats and row-kernel forms).
  const bool whole_rows = c.tail.any() && !s.row_stats && !s.row_kernel();
  const int row_floats = c.tail.hadamard ? 16 : 8;
  const int tail_bytes = whole_rows ? s.threads * row_floats * 4 + c.head_dim * 4 + 256 : 0;
  const int static_bytes = s.threads * s.vec * smem_per_value + tail_bytes;
  while (s.stages > 1 &&
         static_bytes + long_window_shared_bytes(c, s) > shared_limit_for_arch(arch))
    --s.stages;
  if (whole_rows && csa_kernel::long_tail_vec(c.head_dim, s.threads) == 0) {
    fail(Status::kUnsupported,
         "the tail's long-window {} schedule ({}) has {} threads, too few for head_dim {} "
         "(whole rows of at most 8 columns a thread)",
         direction == Direction::kForward ? "forward" : "backward", s.describe(), s.threads,
         c.head_dim);
  }
  // The cluster form: a cluster of 2 to kTailClusterMaxSlices column slices, sm_90 and newer.
  const int slices = s.column_slices(c.head_dim);
  if (s.cluster() && (parse::compute_capability(arch).value_or(0) < 90 || slices < 2 ||
                      slices > csa_kernel::kTailClusterMaxSlices))
    s.tail_forward = LongWindowSchedule::TailForward::kLastSlice;
  return s;
}

LongWindowGrid long_window_backward_grid(const Config& c, const LongWindowSchedule& s,
                                         std::int64_t rows, int sm_count, int resident_per_sm) {
  LongWindowGrid g;
  g.column_slices = s.column_slices(c.head_dim);
  std::int64_t per_cta = s.rows_per_cta;
  if (per_cta <= 0) {
    const std::int64_t wave = static_cast<std::int64_t>(sm_count) * std::max(resident_per_sm, 1);
    const std::int64_t groups = std::max<std::int64_t>(1, wave / g.column_slices);
    per_cta = std::max<std::int64_t>(1, (rows + groups - 1) / groups);
  }
  // Each row group writes one grad_ape partial: at most 2^26 partial floats (256 MB).
  const std::int64_t ape_elems = static_cast<std::int64_t>(c.ratio) * c.coff * c.head_dim;
  const std::int64_t max_groups = std::max<std::int64_t>(1, (std::int64_t{1} << 26) / ape_elems);
  per_cta = std::max<std::int64_t>(per_cta, (rows + max_groups - 1) / max_groups);
  g.rows_per_cta = static_cast<int>(std::min<std::int64_t>(per_cta, 1 << 30));
  g.row_groups = static_cast<int>(std::max<std::int64_t>(1, (rows + per_cta - 1) / per_cta));
  return g;
}

bool forward_prefetches_early(std::int64_t ctas, int sm_count, int resident_per_sm) {
  const std::int64_t wave = static_cast<std::int64_t>(sm_count) * std::max(resident_per_sm, 1);
  return ctas <= kForwardPrefetchEarlyWaves * wave;
}

}  // namespace csa::schedule
