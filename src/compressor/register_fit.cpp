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

std::string expression_at(const Residency& r, int ctas, int form = 0) {
  if (r.forms <= 1) return fmt::format("{}{}>", r.prefix, ctas);
  return fmt::format("{}{},{}>", r.prefix, ctas, form);
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

std::optional<std::vector<int>> first_rung(const ResidencyTable& residency,
                                           const std::vector<std::string>& lowered,
                                           const std::vector<nvrtc::KernelResources>& report,
                                           const std::string& arch) {
  if (lowered.size() != residency.size()) return std::nullopt;
  std::vector<int> pinned(residency.size(), 0);
  bool any = false;
  for (std::size_t i = 0; i < residency.size(); ++i) {
    const auto& r = residency[i];
    if (!r || r->min_ctas != 0) continue;  // a residency the schedule named stays
    const nvrtc::KernelResources* k = kernel_named(report, lowered[i]);
    if (k == nullptr || k->registers < 0) return std::nullopt;
    if (local_memory_bytes(*k) == 0) continue;
    pinned[i] = register_bound_ctas(k->registers, r->threads, max_threads_per_sm(arch));
    any = true;
  }
  if (!any) return std::nullopt;
  return pinned;
}

std::vector<std::string> rung_names(const std::vector<std::string>& names,
                                    const ResidencyTable& residency,
                                    const std::vector<int>& pinned) {
  std::vector<std::string> out = names;
  for (std::size_t i = 0; i < out.size() && i < pinned.size() && i < residency.size(); ++i) {
    if (pinned[i] > 0 && residency[i]) out[i] = expression_at(*residency[i], pinned[i]);
  }
  return out;
}

std::optional<std::vector<std::string>> form_names(const std::vector<std::string>& names,
                                                   const ResidencyTable& residency,
                                                   const std::vector<int>& ctas,
                                                   const std::vector<long long>& bytes, int form) {
  if (residency.size() != names.size() || ctas.size() != names.size() ||
      bytes.size() != names.size() || form < 1)
    return std::nullopt;
  std::vector<std::string> out = names;
  bool any = false;
  for (std::size_t i = 0; i < names.size(); ++i) {
    const auto& r = residency[i];
    if (!r || form >= r->forms || bytes[i] <= 0) continue;
    out[i] = expression_at(*r, ctas[i], form);
    any = true;
  }
  if (!any) return std::nullopt;
  return out;
}

std::optional<std::vector<std::string>> fitted_names(
    const std::vector<std::string>& names, const ResidencyTable& residency,
    const std::vector<std::string>& lowered, const std::vector<nvrtc::KernelResources>& report,
    const std::string& arch) {
  if (residency.size() != names.size()) return std::nullopt;
  const auto pinned = first_rung(residency, lowered, report, arch);
  if (!pinned) return std::nullopt;
  return rung_names(names, residency, *pinned);
}

nvrtc::CompileResult compile_fitted(const nvrtc::Compiler& compiler,
                                    const nvrtc::CompileRequest& request,
                                    const ResidencyTable& residency) {
  nvrtc::CompileResult first = compiler.compile(request);
  const std::size_t slots = request.name_expressions.size();
  if (residency.empty() || residency.size() != slots) return first;
  // Per slot, the name with the least local memory so far (the first compile's on a tie) and
  // its residency.
  std::vector<std::string> best = request.name_expressions;
  const auto first_report = nvrtc::parse_ptxas_report(first.log);
  std::vector<long long> best_bytes = local_bytes(first.lowered_names, first_report);
  std::vector<int> best_ctas(slots, 0);
  for (std::size_t i = 0; i < slots; ++i) best_ctas[i] = residency[i] ? residency[i]->min_ctas : 0;
  double seconds = first.seconds;
  std::optional<nvrtc::CompileResult> last;
  std::vector<std::string> last_names;
  // Compiles `names` (each slot at residency `ctas`) and keeps each slot's name where it has
  // less local memory than the best so far.
  auto compile_and_keep = [&](std::vector<std::string> names, const std::vector<int>& ctas) {
    nvrtc::CompileResult result = compile_names(compiler, request, names);
    seconds += result.seconds;
    const auto bytes = local_bytes(result.lowered_names, nvrtc::parse_ptxas_report(result.log));
    for (std::size_t i = 0; i < slots; ++i) {
      if (bytes[i] >= 0 && bytes[i] < best_bytes[i]) {
        best[i] = names[i];
        best_bytes[i] = bytes[i];
        best_ctas[i] = ctas[i];
      }
    }
    last = std::move(result);
    last_names = std::move(names);
  };

  // The next rung of each slot in `rung` (> 0) that still uses local memory: one CTA fewer,
  // none below one. NOTE: a rung that spills more than the one above does not stop the climb:
  // ptxas's allocation is not monotonic in the budget (a 64-register kernel that spills at four
  // CTAs named may need none at three).
  auto one_cta_fewer = [&](std::vector<int>& rung) {
    for (std::size_t i = 0; i < slots; ++i) {
      int& next = rung[i];
      if (next > 0) next = best_bytes[i] > 0 && next > 1 ? next - 1 : 0;
    }
  };
  // Each slot's residency: `rung`'s where it names one (> 0), else its best so far.
  auto rung_ctas = [&](const std::vector<int>& rung) {
    std::vector<int> ctas = best_ctas;
    for (std::size_t i = 0; i < slots; ++i)
      if (rung[i] > 0) ctas[i] = rung[i];
    return ctas;
  };

  if (auto pinned = first_rung(residency, first.lowered_names, first_report, request.arch)) {
    for (int rung = 0; rung < kMaxRungs; ++rung) {
      if (std::none_of(pinned->begin(), pinned->end(), [](int ctas) { return ctas > 0; })) break;
      compile_and_keep(rung_names(best, residency, *pinned), rung_ctas(*pinned));
      one_cta_fewer(*pinned);
    }
  }
  int forms = 1;
  for (const auto& r : residency)
    if (r) forms = std::max(forms, r->forms);
  for (int form = 1; form < forms; ++form) {
    if (auto formed = form_names(best, residency, best_ctas, best_bytes, form)) {
      compile_and_keep(std::move(*formed), best_ctas);
    }
  }
  // A residency the schedule named gives way last, only where every form still uses local
  // memory there: one CTA fewer at a time (a larger register budget), each rung in the default
  // form and then the others while some remains, down to one CTA or none used.
  std::vector<int> give_way(slots, 0);
  for (std::size_t i = 0; i < slots; ++i) {
    const auto& r = residency[i];
    if (r && r->min_ctas > 1 && best_ctas[i] == r->min_ctas && best_bytes[i] > 0)
      give_way[i] = r->min_ctas - 1;
  }
  while (std::any_of(give_way.begin(), give_way.end(), [](int ctas) { return ctas > 0; })) {
    const std::vector<int> ctas = rung_ctas(give_way);
    compile_and_keep(rung_names(best, residency, give_way), ctas);
    for (int form = 1; form < forms; ++form) {
      std::vector<long long> left(slots, 0);  // local memory of the slots giving way
      for (std::size_t i = 0; i < slots; ++i)
        if (give_way[i] > 0) left[i] = best_bytes[i];
      if (auto formed = form_names(best, residency, ctas, left, form))
        compile_and_keep(std::move(*formed), ctas);
    }
    one_cta_fewer(give_way);
  }
  if (!last) return first;
  // The module of each kernel's best name: the last compile or the first where it is one, else
  // one more.
  nvrtc::CompileResult out;
  if (best == last_names) {
    out = std::move(*last);
  } else if (best == request.name_expressions) {
    out = std::move(first);
  } else {
    out = compile_names(compiler, request, best);
    seconds += out.seconds;
  }
  out.seconds = seconds;
  return out;
}

}  // namespace csa::compressor
