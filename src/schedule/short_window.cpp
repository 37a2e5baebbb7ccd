#include "schedule/short_window.hpp"

#include <algorithm>
#include <sstream>
#include <tuple>
#include <utility>

#include "common/error.hpp"
#include "common/parse.hpp"
#include "csa_params.h"

namespace csa::schedule {

std::string ShortWindowSchedule::describe() const {
  return fmt::format(
             "fv={},fnt={},fwv={},fwmin={},fwctas={},ft={},bv={},tx={},ty={},bmin={},bres={},"
             "bresmin={},"
             "lanes={},fixed={},one={},cap={}",
             forward_vec, forward_narrow_threads, forward_wide_vec, forward_wide_min_elements,
             forward_wide_min_ctas, forward_threads, backward_vec, backward_tx, backward_ty,
             backward_min_ctas, backward_resident_ctas, backward_resident_min_elements,
             reduce_lanes, fixed_order_default ? 1 : 0, one_launch ? 1 : 0,
             captured_one_launch_min) +
         (row_stats_tx > 0
              ? fmt::format(",rows=bv{}/tx{}/ty{}/bmin{}/lanes{}/fixed{}/one{}", row_stats_vec,
                            row_stats_tx, row_stats_ty, row_stats_min_ctas, row_stats_reduce_lanes,
                            row_stats_fixed_order_default ? 1 : 0, row_stats_one_launch ? 1 : 0)
              : std::string());
}

bool ShortWindowSchedule::operator==(const ShortWindowSchedule& o) const {
  return describe() == o.describe();
}

ShortWindowSchedule row_stats_backward(const ShortWindowSchedule& s) {
  ShortWindowSchedule r = s;
  r.backward_vec = s.row_stats_vec;
  r.backward_tx = s.row_stats_tx;
  r.backward_ty = s.row_stats_ty;
  r.backward_min_ctas = s.row_stats_min_ctas;
  r.backward_resident_ctas = 0;
  r.reduce_lanes = s.row_stats_reduce_lanes;
  r.fixed_order_default = s.row_stats_fixed_order_default;
  r.one_launch = s.row_stats_one_launch;
  return r;
}

namespace {

// Narrow column blocks with many row lanes measured faster (more rows in flight).
int backward_block_x(int ncv) {
  return std::min(ncv, 32);
}
int backward_block_y(int tx) {
  return std::max(1, 256 / tx);
}

void apply_override(ShortWindowSchedule& s, const Config& c, const std::string& spec) {
  std::istringstream in(spec);
  std::string item;
  while (std::getline(in, item, ',')) {
    const auto eq = item.find('=');
    if (eq == std::string::npos)
      fail(Status::kInvalidArgument, "schedule override '{}': expected key=value", item);
    const std::string key = item.substr(0, eq);
    const auto parsed = parse::integer<int>(std::string_view(item).substr(eq + 1), 0, 1 << 30);
    if (!parsed) {
      fail(Status::kInvalidArgument, "schedule override '{}': value is not an integer in [0, 2^30]",
           item);
    }
    const int value = *parsed;
    if (key == "fv")
      s.forward_vec = value;
    else if (key == "fnt")
      s.forward_narrow_threads = value;
    else if (key == "fwv")
      s.forward_wide_vec = value;
    else if (key == "fwmin")
      s.forward_wide_min_elements = value;
    else if (key == "fwctas")
      s.forward_wide_min_ctas = value;
    else if (key == "ft")
      s.forward_threads = value;
    else if (key == "bv")
      s.backward_vec = value;
    else if (key == "tx")
      s.backward_tx = value;
    else if (key == "ty")
      s.backward_ty = value;
    else if (key == "bmin")
      s.backward_min_ctas = value;
    else if (key == "bres")
      s.backward_resident_ctas = value;
    else if (key == "bresmin")
      s.backward_resident_min_elements = value;
    else if (key == "fixed")
      s.fixed_order_default = value != 0;
    else if (key == "one")
      s.one_launch = value != 0;
    else if (key == "cap")
      s.captured_one_launch_min = value;
    else if (key == "rl")
      s.reduce_lanes = value;
    else
      fail(Status::kInvalidArgument, "schedule override: unknown field '{}'", key);
  }
  auto vec_ok = [&](int v) {
    return (v == 1 || v == 2 || v == 4 || v == 8) && c.head_dim % v == 0;
  };
  if (!vec_ok(s.forward_vec) || !vec_ok(s.forward_wide_vec) || !vec_ok(s.backward_vec)) {
    fail(Status::kInvalidArgument,
         "schedule override: vector width must be 1, 2, 4 or 8 and divide head_dim {}", c.head_dim);
  }
  if (s.reduce_lanes != 1 && s.reduce_lanes != 2 && s.reduce_lanes != 4 && s.reduce_lanes != 8 &&
      s.reduce_lanes != 16 && s.reduce_lanes != 32) {
    fail(Status::kInvalidArgument,
         "schedule override: rl (reduction lanes) must be 1, 2, 4, 8, "
         "16 or 32, not {}",
         s.reduce_lanes);
  }
  // NOTE: each side is bounded before the product is taken (tx=65536,ty=65536 must not wrap).
  if (s.forward_threads < 32 || s.forward_threads > 1024 || s.forward_narrow_threads < 32 ||
      s.forward_narrow_threads > 1024 || s.backward_tx < 1 || s.backward_tx > 1024 ||
      s.backward_ty < 1 || s.backward_ty > 1024 || s.backward_tx * s.backward_ty > 1024) {
    fail(Status::kInvalidArgument, "schedule override: block shape out of range ({})",
         s.describe());
  }
}

// The tail's backward: whole rows in a CTA (one column block of head_dim / vec threads, the
// row lanes at most 8 so that each has a named barrier); grad_w is summed
// as grad_ape is, in the plain rule's form where the CTA has row lanes, else the fixed order.
// An override's bv and ty are kept (ty within 1..8); tx always follows the vector width.
template <class Named>
void apply_tail_backward(ShortWindowSchedule& s, const Config& c, const Named& named) {
  const bool named_ty = named("ty=");
  s.backward_vec = tail_vec(s.backward_vec, c.head_dim);
  if (s.backward_vec == 0)
    fail(Status::kUnsupported, "no tail kernel serves head_dim {}", c.head_dim);
  // Static shared memory per CTA (48 KB): with row lanes, the grad_ape and grad_w folds
  // (lanes x (window slots + 1) rows of head_dim floats), and the rows' exchange and operand
  // slots (4 floats a column a lane; the Hadamard transform's second exchange buffer, 5).
  const int exchange_and_operands = c.tail.hadamard ? 5 : 4;
  const auto shared_bytes = [&](int ty) {
    const std::int64_t row = std::int64_t{4} * c.head_dim * ty;
    return (ty > 1 ? row * (c.coff * c.ratio + 1) : 0) + exchange_and_operands * row + 1024;
  };
  // The row lanes of rows of `tx` threads: at most 8, 256 threads and the shared memory.
  const auto lanes = [&](int tx) {
    int ty = std::clamp(named_ty ? s.backward_ty : 256 / tx, 1, std::min(8, 1024 / tx));
    while (ty > 1 && shared_bytes(ty) > std::int64_t{48} * 1024) {
      if (named_ty) {
        fail(Status::kInvalidArgument,
             "schedule override: ty={} row lanes of the tail's backward need {} bytes of shared "
             "memory at ratio {}, coff {}, head_dim {} (at most 49152)",
             ty, shared_bytes(ty), c.ratio, c.coff, c.head_dim);
      }
      ty /= 2;
    }
    return ty;
  };
  s.backward_tx = c.head_dim / s.backward_vec;
  s.backward_ty = lanes(s.backward_tx);
  // A row that fills the CTA (head_dim 512 at 2 columns a thread) takes twice the columns a
  // thread where that gives two row lanes: they fold grad_ape and grad_w in the CTA before one
  // launch adds them, where one row a CTA takes the fixed order's second launch (measured
  // faster in every type and layout, docs/performance.md). Windows of up to 6 slots fit.
  if (s.backward_ty == 1 && !named("bv=")) {
    const int wider = 2 * s.backward_vec;
    const int wide_lanes = tail_vec(wider, c.head_dim) == wider ? lanes(c.head_dim / wider) : 1;
    if (wide_lanes > 1) {
      s.backward_vec = wider;
      s.backward_tx = c.head_dim / wider;
      s.backward_ty = wide_lanes;
    }
  }
  if (!named("bmin=")) s.backward_min_ctas = 0;
  // The resident kernel (the rule's windows of 5..8 slots, CTAs of at most 256 threads): from
  // 2^20 output elements, where it measured faster; below, the default kernel was.
  if (!named("bres=") && s.backward_tx * s.backward_ty > 256) s.backward_resident_ctas = 0;
  if (!named("bresmin=")) s.backward_resident_min_elements = kTailResidentMinElements;
  // One row lane (head_dim 512 and up): each CTA would add every grad_ape element alone, and
  // the one launch measured slower than the kernel and the reduction (docs/notes/dropped.md);
  // with row lanes it folds them first and the one launch pays. Its reduction reads one
  // partial per CTA (256 and more at 4096 tokens): 32 lanes a column issue them in one batch.
  if (s.backward_ty == 1) {
    if (!named("fixed=")) s.fixed_order_default = true;
    if (!named("one=")) s.one_launch = false;
    if (!named("rl=")) s.reduce_lanes = 32;
  }
}

// The tail's narrow forward (calls below forward_wide_min_elements): where a row spans two
// warps or more, 256 threads for windows of fewer than 8 slots, else the plain rule's threads;
// one row where that is more. One row a CTA from 8 slots measured faster alone but slower
// followed by the backward (docs/performance.md, the fused tail).
int tail_narrow_forward_threads(const ShortWindowSchedule& s, const Config& c) {
  const int vec = tail_vec(s.forward_vec, c.head_dim);
  const int row_threads = vec > 0 ? c.head_dim / vec : 0;
  if (row_threads < 64) return s.forward_narrow_threads;
  return std::max(row_threads, c.coff * c.ratio >= 8 ? s.forward_narrow_threads : 256);
}

}  // namespace

ShortWindowSchedule select_short_window(const Config& c,
                                        const std::optional<std::string>& override_spec) {
  ShortWindowSchedule s;
  const bool even = c.head_dim % 2 == 0;
  const int window = c.coff * c.ratio;
  s.forward_vec = even ? 2 : 1;
  s.forward_wide_vec = c.head_dim % 4 == 0 ? 4 : s.forward_vec;
  // Threads per CTA: 128 measured faster for the narrow forward and slower for the wide one,
  // which keeps 256.
  s.forward_narrow_threads = 128;
  s.forward_threads = 256;
  // Backward keeps e, kv and grad_ape partials per slot: narrow vectors for wide windows.
  s.backward_vec = (even && window <= 16) ? 2 : 1;
  // grad_ape: the fixed-order reduction (partials + one small kernel, bitwise deterministic)
  // measured faster for narrow rows (W < 512); fp32 atomics into a zeroed grad_ape
  // measured ~5% faster for wide ones (W = 1024).
  s.fixed_order_default = c.coff * c.head_dim < 512;
  // The fixed-order reduction reads one partial per row group (~50-200): 16 lanes per column
  // issue them in one batch of loads (8 lanes needed two); only ratio <= 2 with
  // coff * head_dim >= 1024 (deterministic) measured slower with 16, so it keeps 8.
  s.reduce_lanes = (c.ratio <= 2 && c.coff * c.head_dim >= 1024) ? 8 : 16;
  // Windows of 5..8 slots: the packed bf16 kernel fits three 256-thread CTAs per SM in 80
  // registers; the other layouts and types take 100-128 by default (two CTAs) and 80 with no
  // spill when asked for three (sm_80..sm_100).
  s.backward_resident_ctas = window >= 5 && window <= 8 ? 3 : 0;
  // The same target for the fp16 wide forward (large calls only), whose conversions otherwise
  // take 96-102 registers where bf16 takes 80; no spill (sm_80..sm_100).
  s.forward_wide_min_ctas = c.dtype == DType::kF16 && window >= 5 && window <= 8 ? 3 : 0;
  // Windows of more than 16 slots: the wide forward's window (four columns a thread) takes
  // every register (and spills in fp16 and fp32), and the narrow forward measured faster at
  // every call size in every type (docs/performance.md): no wide forward.
  if (window > 16) s.forward_wide_min_elements = kNoWideForward;
  if (override_spec) apply_override(s, c, *override_spec);
  if (!override_spec || override_spec->find("tx=") == std::string::npos) {
    s.backward_tx = backward_block_x(c.head_dim / s.backward_vec);
  }
  if (!override_spec || override_spec->find("ty=") == std::string::npos) {
    s.backward_ty = backward_block_y(s.backward_tx);
  }
  auto named = [&](const char* key) {
    return override_spec &&
           ("," + *override_spec).find(std::string(",") + key) != std::string::npos;
  };
  if (c.tail.norm && !c.tail.hadamard) {
    // The row-stats form holds the plain kernel's column blocks (before the tail's whole rows).
    s.row_stats_vec = s.backward_vec;
    s.row_stats_tx = s.backward_tx;
    s.row_stats_ty = s.backward_ty;
    // The resident kernel's residency where its rule names one (2-byte types): the tail's
    // columns take more registers than the plain ones. fp32 spills there.
    s.row_stats_min_ctas = s.backward_min_ctas > 0 || c.dtype == DType::kF32
                               ? s.backward_min_ctas
                               : s.backward_resident_ctas;
    s.row_stats_reduce_lanes = s.reduce_lanes;
    s.row_stats_fixed_order_default = s.fixed_order_default;
    s.row_stats_one_launch = s.one_launch;
  }
  if (c.tail.any()) {
    apply_tail_backward(s, c, named);
    if (!named("fnt=")) s.forward_narrow_threads = tail_narrow_forward_threads(s, c);
  }
  // An SM holds at most 2048 threads (and 32 CTAs). The rule's residency targets follow an
  // overridden block shape; a target the override names must fit it.
  const int backward_threads = s.backward_tx * s.backward_ty;
  if (!named("bres="))
    s.backward_resident_ctas = std::min(s.backward_resident_ctas, 2048 / backward_threads);
  if (!named("fwctas="))
    s.forward_wide_min_ctas = std::min(s.forward_wide_min_ctas, 2048 / s.forward_threads);
  for (const auto& [name, ctas, threads] :
       {std::tuple{"bmin", s.backward_min_ctas, backward_threads},
        std::tuple{"bres", s.backward_resident_ctas, backward_threads},
        std::tuple{"fwctas", s.forward_wide_min_ctas, s.forward_threads}}) {
    if (ctas > 32 || ctas * threads > 2048) {
      fail(Status::kInvalidArgument,
           "schedule override: {}={} CTAs of {} threads do not fit one SM (2048 threads)", name,
           ctas, threads);
    }
  }
  return s;
}

int backward_resident_ctas_for(const ShortWindowSchedule& s, const Config& c, int kernel_layout) {
  if (c.dtype == DType::kF32) return 0;
  if (!c.tail.any() && c.dtype == DType::kBf16 && kernel_layout == csa_kernel::kLayoutThdPacked)
    return 0;
  if (c.tail.any() && kernel_layout == csa_kernel::kLayoutThdStrided) return 0;
  return s.backward_resident_ctas;
}

bool backward_takes_resident(const ShortWindowSchedule& s, const Config& c,
                             std::int64_t total_comp) {
  return s.backward_resident_ctas > 0 &&
         total_comp * c.head_dim >= s.backward_resident_min_elements;
}

int resident_ctas(const SmLimits& sm, int threads, int registers, int shared_bytes) {
  const int warps = (threads + 31) / 32;
  // Registers are allocated per warp in units of 256 (8 per thread).
  const int regs_per_warp = ((std::max(registers, 1) * 32 + 255) / 256) * 256;
  int ctas = std::min(sm.ctas, sm.threads / (warps * 32));
  ctas = std::min(ctas, sm.registers / (regs_per_warp * warps));
  if (shared_bytes > 0) ctas = std::min(ctas, sm.shared_bytes / (shared_bytes + 1024));
  return std::max(ctas, 1);
}

int tail_vec(int preferred, int head_dim) {
  auto serves = [&](int v) {
    return head_dim % v == 0 && csa_kernel::tail_row_threads_ok(head_dim / v);
  };
  for (int v = preferred; v >= 1; v /= 2)
    if (serves(v)) return v;
  for (int v = preferred * 2; v <= 8; v *= 2)
    if (serves(v)) return v;
  return 0;
}

ForwardChoice forward_kernel(const ShortWindowSchedule& s, const Config& c, bool wide) {
  ForwardChoice f;
  f.wide = wide;
  f.vec = wide ? s.forward_wide_vec : s.forward_vec;
  f.threads = wide ? s.forward_threads : s.forward_narrow_threads;
  if (c.tail.any()) {
    f.vec = tail_vec(f.vec, c.head_dim);
    if (f.vec == 0) fail(Status::kUnsupported, "no tail kernel serves head_dim {}", c.head_dim);
    // Whole rows in whole warps: a multiple of the row's threads and of 32.
    const int unit = std::max(c.head_dim / f.vec, 32);
    f.threads = (f.threads + unit - 1) / unit * unit;
    if (f.threads > 1024) f.threads = unit;
  }
  return f;
}

ForwardChoice forward_choice(const ShortWindowSchedule& s, const Config& c,
                             std::int64_t total_comp) {
  return forward_kernel(s, c, total_comp * c.head_dim >= s.forward_wide_min_elements);
}

BackwardGrid backward_grid(const ShortWindowSchedule& s, const Config& c, std::int64_t total_comp,
                           int sm_count, int resident_per_sm) {
  BackwardGrid g;
  const int ncv = c.head_dim / s.backward_vec;
  g.grid_x = (ncv + s.backward_tx - 1) / s.backward_tx;
  // Exactly one wave: no tail of late CTAs, and few grad_ape partials.
  const std::int64_t wave = static_cast<std::int64_t>(sm_count) * std::max(resident_per_sm, 1);
  const std::int64_t target_y = std::max<std::int64_t>(1, wave / g.grid_x);
  std::int64_t rows = (total_comp + target_y - 1) / target_y;
  rows = std::max<std::int64_t>(rows, (total_comp + 65534) / 65535);  // gridDim.y limit
  rows = ((std::max<std::int64_t>(rows, 1) + s.backward_ty - 1) / s.backward_ty) * s.backward_ty;
  g.rows_per_cta = static_cast<int>(rows);
  g.grid_y = static_cast<int>(std::max<std::int64_t>(1, (total_comp + rows - 1) / rows));
  return g;
}

}  // namespace csa::schedule
