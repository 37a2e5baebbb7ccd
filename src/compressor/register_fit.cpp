#include "compressor/register_fit.hpp"

#include <fmt/format.h>

#include <algorithm>

#include "common/error.hpp"
#include "common/parse.hpp"

namespace csa::compressor {

namespace {

constexpr int kRegistersPerSm = 65536;
constexpr int kMaxCtasPerSm = 32;

bool uses_local_memory(const nvrtc::KernelResources& k) {
  return k.stack_bytes > 0 || k.spill_store_bytes > 0 || k.spill_load_bytes > 0;
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

// Local memory bytes (spill traffic and stack) of each slot's kernel; -1 where not reported.
std::vector<long long> local_bytes(const nvrtc::CompileResult& result) {
  const auto report = nvrtc::parse_ptxas_report(result.log);
  std::vector<long long> out;
  out.reserve(result.lowered_names.size());
  for (const auto& name : result.lowered_names) {
    const auto it = std::find_if(report.begin(), report.end(),
                                 [&](const nvrtc::KernelResources& k) { return k.name == name; });
    out.push_back(it == report.end() ? -1
                                     : static_cast<long long>(it->spill_store_bytes) +
                                           it->spill_load_bytes + it->stack_bytes);
  }
  return out;
}

}  // namespace

int register_bound_ctas(int registers, int threads, int max_threads_per_sm) {
  const int warps = (std::max(threads, 1) + 31) / 32;
  const int per_warp = (std::max(registers, 1) * 32 + 255) / 256 * 256;
  const int ctas = std::min({kRegistersPerSm / (per_warp * warps),
                             max_threads_per_sm / std::max(threads, 1), kMaxCtasPerSm});
  return std::max(ctas, 1);
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
  auto resources = [&](std::size_t i) -> const nvrtc::KernelResources* {
    const auto it =
        std::find_if(report.begin(), report.end(),
                     [&](const nvrtc::KernelResources& k) { return k.name == lowered[i]; });
    return it == report.end() || it->registers < 0 ? nullptr : &*it;
  };
  std::vector<std::string> out = names;
  bool changed = false;
  for (std::size_t i = 0; i < names.size(); ++i) {
    const auto& r = residency[i];
    if (!r || r->min_ctas != 0) continue;  // a residency the schedule named stays
    const nvrtc::KernelResources* k = resources(i);
    if (k == nullptr) return std::nullopt;
    if (!uses_local_memory(*k)) continue;
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
  const auto fitted = fitted_names(request.name_expressions, residency, first.lowered_names,
                                   nvrtc::parse_ptxas_report(first.log), request.arch);
  if (!fitted) return first;
  nvrtc::CompileResult second = compile_names(compiler, request, *fitted);
  // A fitted kernel is kept only where it uses less local memory than the kernel it replaces.
  const auto before = local_bytes(first);
  const auto after = local_bytes(second);
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
