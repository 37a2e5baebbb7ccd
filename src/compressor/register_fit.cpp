#include "compressor/register_fit.hpp"

#include <fmt/format.h>

#include <algorithm>

#include "common/error.hpp"
#include "common/parse.hpp"
#include "schedule/short_window.hpp"

namespace csa::compressor {

namespace {

// The report's entry of kernel `name`, or null.
const nvrtc::KernelResources* kernel_named(const std::vector<nvrtc::KernelResources>& report,
                                           const std::string& name) {
  const auto it = std::find_if(report.begin(), report.end(),
                               [&](const nvrtc::KernelResources& k) { return k.name == name; });
  return it == report.end() ? nullptr : &*it;
}

long long local_memory_bytes(const nvrtc::KernelResources& k) {
  return static_cast<long long>(k.spill_store_bytes) + k.spill_load_bytes + k.stack_bytes;
}

std::string expression_at(const Residency& r, int ctas) {
  return fmt::format("{}{}>", r.prefix, ctas);
}

// `request` compiled with `names` (one per slot; a name two slots share compiled once), its
// lowered names in slot order.
nvrtc::CompileResult compile_names(const nvrtc::Compiler& compiler,
                                   const nvrtc::CompileRequest& request,
                                   const std::vector<std::string>& names) {
  nvrtc::CompileRequest again = request;
  again.name_expressions.clear();
  std::vector<std::size_t> index;  // per slot: its name in `again`
  index.reserve(names.size());
  for (const auto& name : names) {
    const auto it = std::find(again.name_expressions.begin(), again.name_expressions.end(), name);
    index.push_back(static_cast<std::size_t>(it - again.name_expressions.begin()));
    if (it == again.name_expressions.end()) again.name_expressions.push_back(name);
  }
  nvrtc::CompileResult result = compiler.compile(again);
  if (result.lowered_names.size() != again.name_expressions.size())
    fail(Status::kInternal, "register fitting of {}: NVRTC lowered {} of {} names",
         request.source_name, result.lowered_names.size(), again.name_expressions.size());
  std::vector<std::string> lowered;
  lowered.reserve(index.size());
  for (const std::size_t i : index) lowered.push_back(result.lowered_names[i]);
  result.lowered_names = std::move(lowered);
  return result;
}

// Local memory bytes (spill traffic and stack) of each slot's kernel in `report`; -1 where not
// reported.
std::vector<long long> local_bytes(const std::vector<std::string>& lowered,
                                   const std::vector<nvrtc::KernelResources>& report) {
  std::vector<long long> out;
  out.reserve(lowered.size());
  for (const auto& name : lowered) {
    const nvrtc::KernelResources* k = kernel_named(report, name);
    out.push_back(k == nullptr ? -1 : local_memory_bytes(*k));
  }
  return out;
}

}  // namespace

int register_bound_ctas(int registers, int threads, int max_threads_per_sm) {
  schedule::SmLimits sm;  // 64K registers, 32 CTAs: every arch csa serves
  sm.threads = max_threads_per_sm;
  return schedule::resident_ctas(sm, threads, registers, /*shared_bytes=*/0);
}

int max_threads_per_sm(const std::string& arch) {
  const int cc = parse::compute_capability(arch).value_or(0);
  return cc == 86 || cc == 89 || cc / 10 == 12 ? 1536 : 2048;
}

std::optional<std::vector<std::string>> fitted_names(
    const std::vector<std::string>& names, const ResidencyTable& residency,
    const std::vector<std::string>& lowered, const std::vector<nvrtc::KernelResources>& report,
    const std::string& arch) {
  if (residency.size() != names.size() || lowered.size() != names.size()) return std::nullopt;
  std::vector<std::string> out = names;
  bool changed = false;
  for (std::size_t i = 0; i < names.size(); ++i) {
    const auto& r = residency[i];
    if (!r || r->min_ctas != 0) continue;  // a residency the schedule named stays
    const nvrtc::KernelResources* k = kernel_named(report, lowered[i]);
    if (k == nullptr || k->registers < 0) return std::nullopt;
    if (local_memory_bytes(*k) == 0) continue;
    out[i] =
        expression_at(*r, register_bound_ctas(k->registers, r->threads, max_threads_per_sm(arch)));
    changed = true;
  }
  if (!changed) return std::nullopt;
  return out;
}

nvrtc::CompileResult compile_fitted(const nvrtc::Compiler& compiler,
                                    const nvrtc::CompileRequest& request,
                                    const ResidencyTable& residency) {
  nvrtc::CompileResult first = compiler.compile(request);
  if (residency.empty()) return first;
  const auto first_report = nvrtc::parse_ptxas_report(first.log);
  const auto fitted = fitted_names(request.name_expressions, residency, first.lowered_names,
                                   first_report, request.arch);
  if (!fitted) return first;
  nvrtc::CompileResult second = compile_names(compiler, request, *fitted);
  // A fitted kernel is kept only where it uses less local memory than the kernel it replaces.
  const auto before = local_bytes(first.lowered_names, first_report);
  const auto after = local_bytes(second.lowered_names, nvrtc::parse_ptxas_report(second.log));
  std::vector<std::string> kept = *fitted;
  bool reverted = false;
  bool any_kept = false;
  for (std::size_t i = 0; i < kept.size(); ++i) {
    if (kept[i] == request.name_expressions[i]) continue;
    if (after[i] >= 0 && after[i] < before[i]) {
      any_kept = true;
    } else {
      kept[i] = request.name_expressions[i];
      reverted = true;
    }
  }
  const double seconds = first.seconds + second.seconds;
  nvrtc::CompileResult out = !reverted  ? std::move(second)
                             : any_kept ? compile_names(compiler, request, kept)
                                        : std::move(first);
  out.seconds = seconds + (reverted && any_kept ? out.seconds : 0.0);
  return out;
}

}  // namespace csa::compressor
