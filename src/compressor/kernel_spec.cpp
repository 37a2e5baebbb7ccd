#include "compressor/kernel_spec.hpp"

#include <fmt/format.h>

#include "compressor/kernel_sources.hpp"

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
  return fmt::format("ratio={} coff={} head_dim={}", c.ratio, c.coff, c.head_dim);
}

std::string prewarm_spec(const Config& c) {
  return fmt::format("{},{},{}", c.ratio, c.coff, c.head_dim);
}

ModuleSpec make_module_spec(const Config& c, Family family, const schedule::ShortWindowSchedule& s,
                            const std::string& arch, const CompileOptions& options) {
  ModuleSpec spec;
  auto& req = spec.request;
  req.arch = arch;
  req.options = base_options(options);
  std::string label;
  if (family == Family::kReference) {
    req.source = "#include \"reference.cuh\"\n";
    const std::string args = fmt::format("<{},{},{}>", c.ratio, c.coff, c.head_dim);
    req.name_expressions = {
        "csa_kernel::reference_forward" + args, "csa_kernel::reference_backward_rows" + args,
        "csa_kernel::reference_backward_zeros" + args, "csa_kernel::reference_grad_ape" + args};
    label = fmt::format("reference-r{}-c{}-d{}-{}", c.ratio, c.coff, c.head_dim, arch);
  } else {
    req.source = "#include \"short_window.cuh\"\n#include \"ape_reduce.cuh\"\n";
    const std::string shape = fmt::format("{},{},{}", c.ratio, c.coff, c.head_dim);
    req.name_expressions = {fmt::format("csa_kernel::short_window_forward<{},{},{}>", shape,
                                        s.forward_vec, s.forward_narrow_threads),
                            fmt::format("csa_kernel::short_window_backward<{},{},{},{},true>",
                                        shape, s.backward_vec, s.backward_tx, s.backward_ty),
                            fmt::format("csa_kernel::short_window_backward<{},{},{},{},false>",
                                        shape, s.backward_vec, s.backward_tx, s.backward_ty),
                            fmt::format("csa_kernel::ape_reduce<{}>", s.reduce_lanes),
                            fmt::format("csa_kernel::short_window_forward<{},{},{}>", shape,
                                        s.forward_wide_vec, s.forward_threads)};
    label = fmt::format("short-r{}-c{}-d{}-{}", c.ratio, c.coff, c.head_dim, arch);
  }
  req.source_name = label + ".cu";
  spec.key = cache::make_key(label, req, kernel_sources_hash());
  return spec;
}

ModuleSpec make_long_window_spec(const Config& c,
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
  const std::string shape = fmt::format("{},{},{}", c.ratio, c.coff, c.head_dim);
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
  const std::string label = fmt::format("long-r{}-c{}-d{}-{}", c.ratio, c.coff, c.head_dim, arch);
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
