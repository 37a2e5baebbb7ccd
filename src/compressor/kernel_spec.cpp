#include "compressor/kernel_spec.hpp"

#include <fmt/format.h>

#include "compressor/kernel_sources.hpp"
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
  return fmt::format("ratio={} coff={} head_dim={} {} {}{}", c.ratio, c.coff, c.head_dim,
                     dtype_name(c.dtype), layout_name(c.layout),
                     c.strided && c.layout == Layout::kThd ? " strided" : "");
}

std::string prewarm_spec(const Config& c) {
  std::string spec = fmt::format("ratio={},coff={},head_dim={}", c.ratio, c.coff, c.head_dim);
  if (c.dtype != DType::kBf16) spec += fmt::format(" --dtype {}", dtype_name(c.dtype));
  if (c.layout != Layout::kThd) spec += fmt::format(" --layout {}", layout_name(c.layout));
  if (c.strided && c.layout == Layout::kThd) spec += " --strided";
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

std::string io_policy(const Config& c, int kernel_layout) {
  return fmt::format("csa_kernel::Io<{},{},{}>", static_cast<int>(c.dtype), kernel_layout,
                     static_cast<int>(csa_kernel::kEpilogueIdentity));
}

namespace {

// "4,2,128" for labels, prefixed by the I/O policy for name expressions.
std::string io_label(const Config& c, int kernel_layout) {
  return fmt::format("{}-{}", dtype_name(c.dtype), kernel_layout_name(kernel_layout));
}

}  // namespace

ModuleSpec make_module_spec(const Config& c, int kernel_layout, Family family,
                            const schedule::ShortWindowSchedule& s, const std::string& arch,
                            const CompileOptions& options) {
  const std::string io = io_policy(c, kernel_layout);
  ModuleSpec spec;
  auto& req = spec.request;
  req.arch = arch;
  req.options = base_options(options);
  std::string label;
  if (family == Family::kReference) {
    req.source = "#include \"reference.cuh\"\n";
    const std::string args = fmt::format("<{},{},{},{}>", io, c.ratio, c.coff, c.head_dim);
    req.name_expressions = {
        "csa_kernel::reference_forward" + args, "csa_kernel::reference_backward_rows" + args,
        "csa_kernel::reference_backward_zeros" + args, "csa_kernel::reference_grad_ape" + args};
    label = fmt::format("reference-r{}-c{}-d{}-{}-{}", c.ratio, c.coff, c.head_dim,
                        io_label(c, kernel_layout), arch);
  } else {
    req.source = "#include \"short_window.cuh\"\n#include \"ape_reduce.cuh\"\n";
    const std::string shape = fmt::format("{},{},{},{}", io, c.ratio, c.coff, c.head_dim);
    req.name_expressions = {
        fmt::format("csa_kernel::short_window_forward<{},{},{}>", shape, s.forward_vec,
                    s.forward_narrow_threads),
        fmt::format("csa_kernel::short_window_backward<{},{},{},{},true,{}>", shape, s.backward_vec,
                    s.backward_tx, s.backward_ty, s.backward_min_ctas),
        fmt::format("csa_kernel::short_window_backward<{},{},{},{},false,{}>", shape,
                    s.backward_vec, s.backward_tx, s.backward_ty, s.backward_min_ctas),
        fmt::format("csa_kernel::ape_reduce<{}>", s.reduce_lanes),
        fmt::format("csa_kernel::short_window_forward<{},{},{}>", shape, s.forward_wide_vec,
                    s.forward_threads)};
    label = fmt::format("short-r{}-c{}-d{}-{}-{}", c.ratio, c.coff, c.head_dim,
                        io_label(c, kernel_layout), arch);
  }
  req.source_name = label + ".cu";
  spec.key = cache::make_key(label, req, kernel_sources_hash());
  return spec;
}

ModuleSpec make_long_window_spec(const Config& c, int kernel_layout,
                                 const std::vector<schedule::LongWindowSchedule>& forward,
                                 const std::vector<schedule::LongWindowSchedule>& backward,
                                 const std::string& arch, const CompileOptions& options,
                                 LongWindowSlots* slots) {
  ModuleSpec spec;
  auto& req = spec.request;
  req.arch = arch;
  req.options = base_options(options);
  req.source =
      "#include \"long_window.cuh\"\n#include \"lane_window_forward.cuh\"\n"
      "#include \"lane_window_backward.cuh\"\n#include \"ape_reduce.cuh\"\n";
  const std::string shape =
      fmt::format("{},{},{},{}", io_policy(c, kernel_layout), c.ratio, c.coff, c.head_dim);
  LongWindowSlots s;
  s.forward_begin = 0;
  for (const auto& f : forward) {
    req.name_expressions.push_back(
        fmt::format("{}<{},{}>", f.kernel_prefix(Direction::kForward), shape, f.template_args()));
  }
  s.backward_begin = static_cast<int>(req.name_expressions.size());
  for (const auto& b : backward) {
    req.name_expressions.push_back(
        fmt::format("{}<{},{}>", b.kernel_prefix(Direction::kBackward), shape, b.template_args()));
  }
  s.ape_reduce = static_cast<int>(req.name_expressions.size());
  req.name_expressions.push_back(fmt::format("csa_kernel::ape_reduce<{}>", kApeReduceLanes));
  if ((static_cast<long long>(c.ratio) * c.coff * c.head_dim) % 4 == 0) {
    s.ape_reduce_quads = static_cast<int>(req.name_expressions.size());
    for (int lanes : kApeReduceQuadLanes)
      req.name_expressions.push_back(fmt::format("csa_kernel::ape_reduce_quads<{}>", lanes));
  }
  if (slots != nullptr) *slots = s;
  const std::string label = fmt::format("long-r{}-c{}-d{}-{}-{}", c.ratio, c.coff, c.head_dim,
                                        io_label(c, kernel_layout), arch);
  req.source_name = label + ".cu";
  spec.key = cache::make_key(label, req, kernel_sources_hash());
  return spec;
}

ModuleSpec make_utility_spec(const std::string& arch, const CompileOptions& options) {
  ModuleSpec spec;
  auto& req = spec.request;
  req.arch = arch;
  req.options = base_options(options);
  req.source = "#include \"ape_reduce.cuh\"\n";
  req.name_expressions = {"csa_kernel::check_offsets"};
  const std::string label = "utility-" + arch;
  req.source_name = label + ".cu";
  spec.key = cache::make_key(label, req, kernel_sources_hash());
  return spec;
}

}  // namespace csa::compressor
