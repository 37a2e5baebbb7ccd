#include "compressor/kernel_spec.hpp"

#include <fmt/format.h>

#include <algorithm>

#include "compressor/grad_ape_policy.hpp"
#include "compressor/kernel_sources.hpp"
#include "compressor/kernel_templates.hpp"
#include "csa_params.h"

namespace csa::compressor {

namespace {

std::vector<std::string> base_options(const CompileOptions& options) {
  // --fmad=false: no contraction anywhere; the kernels pin their roundings explicitly too.
  std::vector<std::string> out = {"-std=c++17", "--fmad=false"};
  if (options.ptxas_verbose) out.emplace_back("--ptxas-options=-v");
  if (options.line_info) out.emplace_back("-lineinfo");
  return out;
}

}  // namespace

std::string config_label(const Config& c) {
  return fmt::format("ratio={} coff={} head_dim={} {} {}{}{}", c.ratio, c.coff, c.head_dim,
                     dtype_name(c.dtype), layout_name(c.layout),
                     c.strided && c.layout == Layout::kThd ? " strided" : "",
                     c.tail.any() ? " tail=" + tail_name(c.tail) : "");
}

std::string prewarm_spec(const Config& c) {
  std::string spec = fmt::format("ratio={},coff={},head_dim={}", c.ratio, c.coff, c.head_dim);
  if (c.dtype != DType::kBf16) spec += fmt::format(" --dtype {}", dtype_name(c.dtype));
  if (c.layout != Layout::kThd) spec += fmt::format(" --layout {}", layout_name(c.layout));
  if (c.strided && c.layout == Layout::kThd) spec += " --strided";
  const TailShape& t = c.tail;
  if (t.norm) {
    spec += " --norm";
    if (t.norm_weight_dtype == DType::kBf16) spec += " --norm-weight bf16";
  }
  if (t.rope()) spec += fmt::format(" --rope-dim {}", t.rope_dim);
  if (t.rope() && !t.rope_interleaved) spec += " --rope-half-split";
  if (t.hadamard) spec += " --hadamard";
  return spec;
}

const char* kernel_layout_name(int kernel_layout) {
  switch (kernel_layout) {
    case csa_kernel::kLayoutThdPacked:
      return "thd";
    case csa_kernel::kLayoutThdStrided:
      return "thd-strided";
    case csa_kernel::kLayoutSbhd:
      return "sbhd";
    default:
      return "?";
  }
}

std::vector<int> kernel_layouts(const Config& c) {
  if (c.layout == Layout::kSbhd) return {csa_kernel::kLayoutSbhd};
  if (c.strided) return {csa_kernel::kLayoutThdPacked, csa_kernel::kLayoutThdStrided};
  return {csa_kernel::kLayoutThdPacked};
}

int epilogue_code(const TailShape& t) {
  if (!t.any()) return csa_kernel::kEpilogueIdentity;
  return csa_kernel::tail_epilogue(t.norm, t.norm_weight_dtype == DType::kF32, t.rope_dim,
                                   t.rope_interleaved, t.hadamard);
}

namespace {

// The I/O policy with the epilogue `epilogue` (the tail's code, in one of its forms).
std::string io_policy_with(const Config& c, int kernel_layout, int epilogue) {
  return fmt::format("csa_kernel::Io<{},{},{}>", static_cast<int>(c.dtype), kernel_layout,
                     epilogue);
}

}  // namespace

std::string io_policy(const Config& c, int kernel_layout) {
  return io_policy_with(c, kernel_layout, epilogue_code(c.tail));
}

namespace {

// "bf16-thd" for module labels.
std::string io_label(const Config& c, int kernel_layout) {
  return fmt::format("{}-{}", dtype_name(c.dtype), kernel_layout_name(kernel_layout));
}

namespace kt = kernel_templates;

// "csa_kernel::Io<..>,4,2,128": the arguments every shaped kernel template begins with (with
// the epilogue `epilogue`, else the call's own).
std::string shape_args(const Config& c, int kernel_layout, int epilogue) {
  return fmt::format("{},{},{},{}", io_policy_with(c, kernel_layout, epilogue), c.ratio, c.coff,
                     c.head_dim);
}
std::string shape_args(const Config& c, int kernel_layout) {
  return shape_args(c, kernel_layout, epilogue_code(c.tail));
}
// The same with the I/O policy of the tail's row-stats and row-kernel forms.
std::string row_stats_shape_args(const Config& c, int kernel_layout) {
  return shape_args(c, kernel_layout, csa_kernel::tail_row_stats_code(epilogue_code(c.tail)));
}
std::string row_kernel_shape_args(const Config& c, int kernel_layout) {
  return shape_args(c, kernel_layout, csa_kernel::tail_row_kernel_code(epilogue_code(c.tail)));
}
std::string cluster_shape_args(const Config& c, int kernel_layout) {
  return shape_args(c, kernel_layout, csa_kernel::tail_cluster_code(epilogue_code(c.tail)));
}
// The I/O policy's arguments of a lanes-form forward of a tail form.
std::string forward_shape_args(const Config& c, int kernel_layout,
                               const schedule::LongWindowSchedule& s) {
  if (s.row_kernel()) return row_kernel_shape_args(c, kernel_layout);
  if (s.cluster()) return cluster_shape_args(c, kernel_layout);
  return shape_args(c, kernel_layout);
}

ModuleSpec finish(ModuleSpec spec, const ModuleBuilder& module, const std::string& label,
                  const std::string& arch, const CompileOptions& options) {
  auto& req = spec.request;
  req.arch = arch;
  req.options = base_options(options);
  req.source = module.source();
  req.name_expressions = module.names();
  req.source_name = label + ".cu";
  spec.residency = module.residency();
  spec.key = cache::make_key(label, req, kernel_sources_hash(),
                             spec.residency.empty() ? 0 : kRegisterFitVersion);
  return spec;
}

// The kernel of a long-window schedule: the staged form's, or the lanes form's of its direction
// (in the tail's row-stats, row-kernel or cluster form, with that form's I/O policy).
int add_long_window_kernel(ModuleBuilder& m, const Config& c, int kernel_layout,
                           const schedule::LongWindowSchedule& s, Direction direction) {
  if (s.staged) {
    const auto& t =
        direction == Direction::kForward ? kt::kLongWindowForward : kt::kLongWindowBackward;
    return m.add(t, s.vec, s.cols, s.threads, s.serial, s.fast_exp);
  }
  if (direction == Direction::kBackward) {
    return m.add_in_shape(
        s.row_stats ? row_stats_shape_args(c, kernel_layout) : shape_args(c, kernel_layout),
        kt::kLaneWindowBackward, s.vec, s.cols / s.vec, s.window_lanes(), s.stages, s.fast_exp,
        s.atomic_ape);
  }
  return m.add_in_shape(forward_shape_args(c, kernel_layout, s), kt::kLaneWindowForward, s.vec,
                        s.cols / s.vec, s.window_lanes(), s.serial, s.fast_exp);
}

}  // namespace

ModuleSpec make_module_spec(const Config& c, int kernel_layout, Family family,
                            const schedule::ShortWindowSchedule& s, const std::string& arch,
                            const CompileOptions& options) {
  ModuleSpec spec;
  ModuleBuilder m(shape_args(c, kernel_layout));
  const char* kind = "short";
  if (family == Family::kReference) {
    kind = "reference";
    auto& slots = spec.slots.reference;
    slots.forward = m.add(kt::kReferenceForward);
    slots.backward_rows = m.add(kt::kReferenceBackwardRows);
    slots.backward_zeros = m.add(kt::kReferenceBackwardZeros);
    slots.grad_ape = m.add(kt::kReferenceGradApe);
  } else {
    auto& slots = spec.slots.short_window;
    // The short-window kernels, each with its residency (the CTAs per SM its registers fit).
    auto forward = [&](int vec, int threads, int ctas) {
      return m.add_resident(kt::kShortWindowForward, threads, ctas, vec, threads);
    };
    auto backward = [&](bool fixed_order, int ctas) {
      return m.add_resident(kt::kShortWindowBackward, s.backward_tx * s.backward_ty, ctas,
                            s.backward_vec, s.backward_tx, s.backward_ty, fixed_order);
    };
    if (c.tail.any()) {
      // The fused tail: its forward kernels and its backward in the grad_ape forms its schedule
      // takes (the backward shape holds whole rows: select_short_window).
      const auto narrow = schedule::forward_kernel(s, c, false);
      const auto wide = schedule::forward_kernel(s, c, true);
      slots.forward = forward(narrow.vec, narrow.threads, 0);
      if (schedule::has_wide_forward(s)) {
        slots.forward_wide = forward(wide.vec, wide.threads, s.forward_wide_min_ctas);
      }
      slots.backward_fixed = backward(true, s.backward_min_ctas);
      if (short_window_grad_ape(s).atomic) {
        slots.backward_atomic = backward(false, s.backward_min_ctas);
      }
      if (const int resident = schedule::backward_resident_ctas_for(s, c, kernel_layout)) {
        slots.backward_fixed_resident = backward(true, resident);
        if (slots.backward_atomic >= 0) {
          slots.backward_atomic_resident = backward(false, resident);
        }
      }
      slots.ape_reduce = m.add(kt::kApeReduce, s.reduce_lanes);
      if (schedule::has_row_stats_backward(s)) {
        // The row-stats form: its first kernel, then the backward on the plain block shape with
        // the row-stats I/O policy (and the reduction of its rule's lanes).
        const auto rs = schedule::row_stats_backward(s);
        slots.row_stats = m.add(kt::kTailRowStats, kRowStatsThreads);
        m.set_shape(row_stats_shape_args(c, kernel_layout));
        auto row_stats_backward = [&](bool fixed_order) {
          return m.add_resident(kt::kShortWindowBackward, rs.backward_tx * rs.backward_ty,
                                rs.backward_min_ctas, rs.backward_vec, rs.backward_tx,
                                rs.backward_ty, fixed_order);
        };
        slots.backward_row_stats_fixed = row_stats_backward(true);
        slots.backward_row_stats_atomic = row_stats_backward(false);
        m.set_shape(shape_args(c, kernel_layout));
        slots.row_stats_ape_reduce = m.add(kt::kApeReduce, rs.reduce_lanes);
      }
      const std::string label =
          fmt::format("short-r{}-c{}-d{}-{}-{}-{}", c.ratio, c.coff, c.head_dim,
                      io_label(c, kernel_layout), tail_name(c.tail), arch);
      return finish(std::move(spec), m, label, arch, options);
    }
    slots.forward = forward(s.forward_vec, s.forward_narrow_threads, 0);
    slots.backward_fixed = backward(true, s.backward_min_ctas);
    slots.backward_atomic = backward(false, s.backward_min_ctas);
    slots.ape_reduce = m.add(kt::kApeReduce, s.reduce_lanes);
    if (schedule::has_wide_forward(s)) {
      slots.forward_wide = forward(s.forward_wide_vec, s.forward_threads, s.forward_wide_min_ctas);
    }
    if (const int resident = schedule::backward_resident_ctas_for(s, c, kernel_layout)) {
      slots.backward_fixed_resident = backward(true, resident);
      slots.backward_atomic_resident = backward(false, resident);
    }
  }
  const std::string label = fmt::format("{}-r{}-c{}-d{}-{}-{}", kind, c.ratio, c.coff, c.head_dim,
                                        io_label(c, kernel_layout), arch);
  return finish(std::move(spec), m, label, arch, options);
}

ModuleSpec make_long_window_spec(const Config& c, int kernel_layout,
                                 const std::vector<schedule::LongWindowSchedule>& forward,
                                 const std::vector<schedule::LongWindowSchedule>& backward,
                                 const std::string& arch, const CompileOptions& options) {
  ModuleSpec spec;
  ModuleBuilder m(shape_args(c, kernel_layout));
  for (const auto& f : forward) add_long_window_kernel(m, c, kernel_layout, f, Direction::kForward);
  for (const auto& b : backward)
    add_long_window_kernel(m, c, kernel_layout, b, Direction::kBackward);
  auto& slots = spec.slots.long_window;
  if (std::any_of(backward.begin(), backward.end(),
                  [](const schedule::LongWindowSchedule& b) { return b.row_stats; })) {
    slots.row_stats =
        m.add_in_shape(row_stats_shape_args(c, kernel_layout), kt::kTailRowStats, kRowStatsThreads);
  }
  if (std::any_of(forward.begin(), forward.end(),
                  [](const schedule::LongWindowSchedule& f) { return f.row_kernel(); })) {
    slots.rows_forward = m.add_in_shape(row_kernel_shape_args(c, kernel_layout),
                                        kt::kTailRowsForward, kTailRowsThreads);
  }
  slots.ape_reduce = m.add(kt::kApeReduce, kApeReduceLanes);
  // The tail's reduction also writes grad_w: the scalar one (backward_long).
  if (!c.tail.any() && (static_cast<long long>(c.ratio) * c.coff * c.head_dim) % 4 == 0) {
    for (std::size_t i = 0; i < kApeReduceQuadLanes.size(); ++i)
      slots.ape_reduce_quads[i] = m.add(kt::kApeReduceQuads, kApeReduceQuadLanes[i]);
  }
  const std::string label =
      fmt::format("long-r{}-c{}-d{}-{}-{}{}", c.ratio, c.coff, c.head_dim,
                  io_label(c, kernel_layout), c.tail.any() ? tail_name(c.tail) + "-" : "", arch);
  return finish(std::move(spec), m, label, arch, options);
}

int long_window_slot(const ModuleSpec& spec, const Config& c, int kernel_layout,
                     const schedule::LongWindowSchedule& s, Direction direction) {
  ModuleBuilder one(shape_args(c, kernel_layout));
  add_long_window_kernel(one, c, kernel_layout, s, direction);
  const auto& names = spec.request.name_expressions;
  const auto it = std::find(names.begin(), names.end(), one.names().front());
  return it == names.end() ? -1 : static_cast<int>(it - names.begin());
}

ModuleSpec make_utility_spec(const std::string& arch, const CompileOptions& options) {
  ModuleBuilder m;
  m.add(kt::kCheckOffsets);
  return finish(ModuleSpec{}, m, "utility-" + arch, arch, options);
}

}  // namespace csa::compressor
