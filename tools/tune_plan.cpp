#include "tune_plan.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <map>
#include <sstream>

namespace csa::tools {

namespace {

// Each name once, the first kept: names spell every schedule field.
std::vector<Candidate> first_of_each_name(const std::vector<Candidate>& candidates) {
  std::vector<Candidate> unique;
  for (const auto& c : candidates)
    if (std::none_of(unique.begin(), unique.end(),
                     [&](const Candidate& u) { return u.name == c.name; }))
      unique.push_back(c);
  return unique;
}

// `tail_form`: a tail's form other than the default, as the schedule names it: the backward's
// "row_stats", the forward's "row_kernel" or "cluster" ("": the default).
Candidate lanes(int vec, int cols, int threads, bool serial, bool fast_exp, Direction d,
                int stages = 1, bool atomic_ape = false, const std::string& tail_form = "") {
  Candidate c;
  std::string form_suffix = tail_form.empty() ? "" : " " + tail_form;
  std::replace(form_suffix.begin(), form_suffix.end(), '_', '-');
  c.name = fmt::format("lanes-{} v{} c{} t{}{}{}{}",
                       serial ? "serial" : (fast_exp ? "chunked-fast" : "chunked"), vec, cols,
                       threads, stages > 1 ? fmt::format(" s{}", stages) : "",
                       atomic_ape ? " atomic" : "", form_suffix);
  c.bucket = {{"form", "lanes"},    {"vec", vec},       {"cols", cols},
              {"threads", threads}, {"serial", serial}, {"fast_exp", fast_exp}};
  if (d == Direction::kBackward) {
    c.bucket["stages"] = stages;
    c.bucket["rows_per_cta"] = 0;
    c.bucket["grad_ape"] = atomic_ape ? "atomic" : "fixed_order";
    if (!tail_form.empty()) c.bucket["tail_backward"] = tail_form;
  } else if (!tail_form.empty()) {
    c.bucket["tail_forward"] = tail_form;
  }
  c.bitwise = serial && !fast_exp;
  return c;
}

}  // namespace

std::vector<Candidate> tune_candidates(const Config& config, Direction direction) {
  std::vector<Candidate> out;
  const int wide = config.head_dim % 4 == 0 ? 4 : (config.head_dim % 2 == 0 ? 2 : 1);
  const int narrow = config.head_dim % 2 == 0 ? 2 : 1;
  if (direction == Direction::kForward) {
    for (int cols : {16, 32, 64, 128})
      for (int threads : {256, 512})
        out.push_back(lanes(narrow, cols, threads, false, true, direction));
    out.push_back(lanes(wide, 128, 512, false, true, direction));
    out.push_back(lanes(narrow, 32, 256, false, false, direction));
    // Serial (bitwise) candidates for the small outputs that keep the serial order: at 32 and
    // 64 rows of head_dim 128 a sweep of 32 shapes had its fastest among these (scalar columns
    // with 512 threads at coff 1 and at 32 rows of coff 2, 64 vector columns at 64 rows).
    for (const auto& [vec, cols, threads] : std::vector<std::array<int, 3>>{{narrow, 32, 512},
                                                                            {narrow, 16, 256},
                                                                            {narrow, 64, 512},
                                                                            {1, 16, 256},
                                                                            {1, 16, 512},
                                                                            {1, 32, 512}})
      out.push_back(lanes(vec, cols, threads, true, false, direction));
    // A tail: each candidate also in the row-kernel form and, where the loader keeps it (sm_90
    // and newer, 2 to 8 column slices; elsewhere it fits to the default and runs once), in the
    // cluster form.
    if (config.tail.any()) {
      const std::size_t last_slice = out.size();
      for (const char* form : {"row_kernel", "cluster"})
        for (std::size_t i = 0; i < last_slice; ++i) {
          const nlohmann::json& b = out[i].bucket;
          out.push_back(lanes(b["vec"].get<int>(), b["cols"].get<int>(), b["threads"].get<int>(),
                              b["serial"].get<bool>(), b["fast_exp"].get<bool>(), direction, 1,
                              false, form));
        }
    }
  } else {
    // The shared-memory ring (stages 2 and 3) needs head_dim % 8 == 0; a third stage is tried
    // at 512 threads, which leave an SM's shared memory to one or two CTAs.
    const int max_stages = config.head_dim % 8 == 0 ? 3 : 1;
    // Each chunked-fast kernel is timed with both grad_ape forms (fixed order, atomics).
    for (bool atomic_ape : {false, true}) {
      for (int stages = 1; stages <= max_stages; ++stages)
        for (int vec : {1, narrow})
          for (int cols : {16, 32, 64})
            for (int threads : {256, 512}) {
              if (stages == 3 && threads < 512) continue;
              out.push_back(lanes(vec, cols, threads, false, true, direction, stages, atomic_ape));
            }
    }
    out.push_back(lanes(1, 16, 256, false, false, direction));
    // A tail with the norm and without the Hadamard transform: each chunked-fast kernel also in
    // the tail backward's row-stats form.
    if (config.tail.norm && !config.tail.hadamard) {
      const std::size_t whole_rows = out.size();
      for (std::size_t i = 0; i < whole_rows; ++i) {
        const nlohmann::json& b = out[i].bucket;
        if (!b["fast_exp"].get<bool>()) continue;
        out.push_back(lanes(b["vec"].get<int>(), b["cols"].get<int>(), b["threads"].get<int>(),
                            false, true, direction, b["stages"].get<int>(),
                            b["grad_ape"] == "atomic", "row_stats"));
      }
    }
  }
  // Odd or narrow head_dims make some vector widths coincide: keep each schedule once.
  return first_of_each_name(out);
}

std::vector<Candidate> as_fitted(const std::vector<Candidate>& candidates,
                                 const std::vector<std::string>& fitted, Direction direction) {
  std::vector<Candidate> out;
  for (std::size_t i = 0; i < candidates.size() && i < fitted.size(); ++i) {
    std::map<std::string, std::string> field;
    std::istringstream in(fitted[i]);
    std::string item;
    while (in >> item) {
      const auto eq = item.find('=');
      if (eq != std::string::npos) field[item.substr(0, eq)] = item.substr(eq + 1);
    }
    const auto number = [&](const char* key, int fallback) {
      const auto it = field.find(key);
      return it == field.end() ? fallback : std::stoi(it->second);
    };
    const nlohmann::json& b = candidates[i].bucket;
    const auto tail_form = [&] {
      const auto it =
          field.find(direction == Direction::kBackward ? "tail_backward" : "tail_forward");
      return it == field.end() ? std::string() : it->second;
    };
    const auto atomic_ape = [&] {
      const auto it = field.find("grad_ape");
      return it == field.end() ? b.value("grad_ape", "fixed_order") == "atomic"
                               : it->second == "atomic";
    };
    Candidate c = candidates[i];
    if (b.value("form", "lanes") == "lanes") {
      c = lanes(number("vec", b["vec"].get<int>()), number("cols", b["cols"].get<int>()),
                number("threads", b["threads"].get<int>()),
                number("serial", b["serial"].get<bool>() ? 1 : 0) != 0,
                number("fast_exp", b["fast_exp"].get<bool>() ? 1 : 0) != 0, direction,
                number("stages", b.value("stages", 1)), atomic_ape(), tail_form());
    }
    out.push_back(c);
  }
  return first_of_each_name(out);
}

std::vector<int> choose(const std::vector<Candidate>& candidates,
                        const std::vector<Measurement>& measurements, double bitwise_margin) {
  std::vector<int> chosen;
  for (const auto& m : measurements) {
    int best = -1;
    int best_bitwise = -1;
    for (std::size_t i = 0; i < m.micros.size() && i < candidates.size(); ++i) {
      if (m.micros[i] < 0) continue;
      const int idx = static_cast<int>(i);
      if (best < 0 || m.micros[i] < m.micros[static_cast<std::size_t>(best)]) best = idx;
      if (candidates[i].bitwise &&
          (best_bitwise < 0 || m.micros[i] < m.micros[static_cast<std::size_t>(best_bitwise)]))
        best_bitwise = idx;
    }
    if (best_bitwise >= 0 && m.micros[static_cast<std::size_t>(best_bitwise)] <=
                                 m.micros[static_cast<std::size_t>(best)] * bitwise_margin)
      best = best_bitwise;
    chosen.push_back(best);
  }
  return chosen;
}

nlohmann::json make_buckets(const std::vector<Candidate>& candidates,
                            const std::vector<Measurement>& measurements,
                            const std::vector<int>& chosen) {
  nlohmann::json buckets = nlohmann::json::array();
  // Drop measurements where nothing passed; the neighbours' choices cover their rows.
  std::vector<std::pair<std::int64_t, int>> points;
  for (std::size_t i = 0; i < measurements.size(); ++i)
    if (chosen[i] >= 0) points.emplace_back(measurements[i].rows, chosen[i]);
  for (std::size_t i = 0; i < points.size(); ++i) {
    const bool last = i + 1 == points.size();
    if (!last && points[i + 1].second == points[i].second) continue;  // merge with the next
    nlohmann::json b = candidates[static_cast<std::size_t>(points[i].second)].bucket;
    if (last) {
      b["max_rows"] = nullptr;
    } else {
      const double a = static_cast<double>(std::max<std::int64_t>(points[i].first, 1));
      const double c = static_cast<double>(points[i + 1].first);
      b["max_rows"] =
          std::max<std::int64_t>(points[i].first, static_cast<std::int64_t>(std::sqrt(a * c)));
    }
    buckets.push_back(b);
  }
  return buckets;
}

std::int64_t bitwise_row_limit(const Config& config) {
  return (kBitwiseOutputElements - 1) / config.head_dim;
}

nlohmann::json bitwise_buckets(const std::vector<Candidate>& candidates,
                               const std::vector<Measurement>& measurements,
                               std::int64_t max_rows) {
  // The fastest bitwise candidate per measured row count up to max_rows (at least the
  // smallest measured one, which may lie above it).
  std::vector<Measurement> small;
  std::vector<int> chosen;
  for (const auto& m : measurements) {
    if (!small.empty() && m.rows > max_rows) break;
    int best = -1;
    for (std::size_t i = 0; i < m.micros.size() && i < candidates.size(); ++i)
      if (candidates[i].bitwise && m.micros[i] > 0 &&
          (best < 0 || m.micros[i] < m.micros[static_cast<std::size_t>(best)]))
        best = static_cast<int>(i);
    small.push_back(m);
    chosen.push_back(best);
  }
  nlohmann::json out = nlohmann::json::array();
  if (std::none_of(chosen.begin(), chosen.end(), [](int c) { return c >= 0; })) return out;
  out = make_buckets(candidates, small, chosen);
  // Boundaries between measured counts stay; the last bucket ends at max_rows, and any
  // boundary past it (a measured count above max_rows) is cut back to it.
  nlohmann::json capped = nlohmann::json::array();
  for (auto b : out) {
    const bool last = b["max_rows"].is_null() || b["max_rows"].get<std::int64_t>() >= max_rows;
    if (last) b["max_rows"] = max_rows;
    capped.push_back(b);
    if (last) break;
  }
  return capped;
}

nlohmann::json with_bitwise_small_rows(const nlohmann::json& buckets, const nlohmann::json& bitwise,
                                       std::int64_t max_rows) {
  nlohmann::json out = bitwise;
  for (const auto& b : buckets) {
    if (!b["max_rows"].is_null() && b["max_rows"].get<std::int64_t>() <= max_rows) continue;
    out.push_back(b);
  }
  return out;
}

nlohmann::json make_entry(const Config& config, Direction direction, nlohmann::json buckets) {
  nlohmann::json entry = {{"family", "long_window"},
                          {"direction", direction == Direction::kForward ? "forward" : "backward"},
                          {"coff", config.coff},
                          {"head_dim", {config.head_dim, config.head_dim}},
                          {"ratio", {config.ratio, config.ratio}}};
  // Unkeyed entries serve every element type and layout (they were measured on bf16 THD); a
  // measurement of another one is keyed on it, so it serves those calls only. A tail's
  // measurement is keyed on the tail: it serves calls with that tail only.
  if (config.dtype != DType::kBf16) entry["dtype"] = dtype_name(config.dtype);
  if (config.layout != Layout::kThd) entry["layout"] = layout_name(config.layout);
  if (config.tail.any()) entry["tail"] = tail_name(config.tail);
  entry["buckets"] = std::move(buckets);
  return entry;
}

nlohmann::json merge_entries(nlohmann::json base, const std::vector<nlohmann::json>& entries,
                             const Config& measured, const std::string& origin) {
  auto key = [](const nlohmann::json& x, const char* k) {
    return x.contains(k) ? x[k] : nlohmann::json(nullptr);
  };
  // The dtype / layout keys an entry names, and whether they admit the measured call.
  auto keys = [](const nlohmann::json& x) {
    return static_cast<int>(x.contains("dtype")) + static_cast<int>(x.contains("layout"));
  };
  auto serves_measured = [&](const nlohmann::json& x) {
    return (!x.contains("dtype") || x["dtype"] == dtype_name(measured.dtype)) &&
           (!x.contains("layout") || x["layout"] == layout_name(measured.layout));
  };
  nlohmann::json merged = nlohmann::json::array();
  for (const auto& e : entries) merged.push_back(e);
  for (const auto& old : base["entries"]) {
    // NOTE: a base entry with as many keys that also serves the measured call would outrank
    // (or shadow) the tuned entry there; one with fewer keys still serves the other calls.
    const bool replaced = std::any_of(entries.begin(), entries.end(), [&](const auto& e) {
      return e["direction"] == old["direction"] && e["coff"] == old["coff"] &&
             e["head_dim"] == old["head_dim"] && e["ratio"] == old["ratio"] &&
             key(e, "tail") == key(old, "tail") && serves_measured(old) && keys(old) >= keys(e);
    });
    if (!replaced) merged.push_back(old);
  }
  base["entries"] = merged;
  base["origin"] = origin;
  return base;
}

}  // namespace csa::tools
