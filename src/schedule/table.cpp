#include "schedule/table.hpp"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <limits>
#include <optional>
#include <set>

#include "common/error.hpp"
#include "common/parse.hpp"
#include "embedded_schedules.hpp"  // generated from schedules/ at build time

namespace csa::schedule {

namespace {

using nlohmann::json;

constexpr std::array<DType, 3> kDTypes = {DType::kBf16, DType::kF16, DType::kF32};
constexpr std::array<Layout, 2> kLayouts = {Layout::kThd, Layout::kSbhd};

// Where in the document a value sits, for error messages: "entries[2].buckets[0].vec".
class Path {
 public:
  Path(const std::string& source, std::string where) : source_(source), where_(std::move(where)) {}
  Path operator/(const std::string& field) const {
    return Path(source_, where_.empty() ? field : where_ + "." + field);
  }
  Path operator[](std::size_t index) const {
    return Path(source_, fmt::format("{}[{}]", where_, index));
  }
  template <typename... Args>
  [[noreturn]] void fail(fmt::format_string<Args...> format, Args&&... args) const {
    csa::fail(Status::kInvalidArgument, "schedule table {}: {}: {}", source_,
              where_.empty() ? "(top level)" : where_,
              fmt::format(format, std::forward<Args>(args)...));
  }

 private:
  const std::string& source_;
  std::string where_;
};

void reject_unknown(const json& object, const Path& path,
                    std::initializer_list<const char*> known) {
  if (!object.is_object()) path.fail("must be an object");
  for (auto it = object.begin(); it != object.end(); ++it) {
    if (std::none_of(known.begin(), known.end(), [&](const char* k) { return it.key() == k; }))
      (path / it.key()).fail("unknown field");
  }
}

const json& member(const json& object, const char* name, const Path& path) {
  if (!object.is_object()) path.fail("must be an object");
  auto it = object.find(name);
  if (it == object.end()) (path / name).fail("missing");
  return *it;
}

// An integer of the document inside [lo, hi]: 4.0, 1e3 and values beyond int64 are refused,
// never rounded or wrapped.
std::int64_t checked_int(const json& v, const Path& path, std::int64_t lo, std::int64_t hi) {
  if (!v.is_number_integer()) path.fail("must be an integer");
  if (v.is_number_unsigned() &&
      v.get<std::uint64_t>() > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()))
    path.fail("{} is outside [{}, {}]", v.get<std::uint64_t>(), lo, hi);
  const auto x = v.get<std::int64_t>();
  if (x < lo || x > hi) path.fail("{} is outside [{}, {}]", x, lo, hi);
  return x;
}

std::int64_t get_int(const json& object, const char* name, const Path& path, std::int64_t lo,
                     std::int64_t hi) {
  return checked_int(member(object, name, path), path / name, lo, hi);
}

bool get_bool(const json& object, const char* name, const Path& path) {
  const json& v = member(object, name, path);
  if (!v.is_boolean()) (path / name).fail("must be true or false");
  return v.get<bool>();
}

std::pair<int, int> get_range(const json& object, const char* name, const Path& path, int lo,
                              int hi) {
  const json& v = member(object, name, path);
  if (!v.is_array() || v.size() != 2) (path / name).fail("must be [min, max] (integers)");
  const auto a = static_cast<int>(checked_int(v[0], (path / name)[0], lo, hi));
  const auto b = static_cast<int>(checked_int(v[1], (path / name)[1], lo, hi));
  if (a > b) (path / name).fail("[{}, {}]: min is above max", a, b);
  return {a, b};
}

bool is_power_of_two(std::int64_t x) {
  return x > 0 && (x & (x - 1)) == 0;
}

int arch_number(const std::string& arch, const Path& path) {
  const auto cc = parse::compute_capability(arch);
  if (!cc || *cc < 80 || arch.back() == 'a' || arch.back() == 'f')
    (path / "arch").fail("'{}' is not an arch such as sm_90 (sm_80 or newer)", arch);
  return *cc;
}

Bucket parse_bucket(const json& b, const Path& path, Direction direction) {
  if (direction == Direction::kBackward) {
    reject_unknown(b, path,
                   {"max_rows", "form", "vec", "cols", "threads", "serial", "fast_exp", "stages",
                    "rows_per_cta", "grad_ape", "tail_backward"});
  } else {
    reject_unknown(
        b, path,
        {"max_rows", "form", "vec", "cols", "threads", "serial", "fast_exp", "tail_forward"});
  }
  Bucket out;
  const json& max_rows = member(b, "max_rows", path);
  if (max_rows.is_null()) {
    out.max_rows = -1;
  } else {
    out.max_rows = get_int(b, "max_rows", path, 0, std::int64_t{1} << 31);
  }
  auto& s = out.schedule;
  if (b.contains("form")) {
    if (b["form"] == "staged") {
      s.staged = true;
    } else if (b["form"] != "lanes") {
      (path / "form").fail("must be \"lanes\" or \"staged\"");
    }
  }
  s.vec = static_cast<int>(get_int(b, "vec", path, 1, 8));
  if (!is_power_of_two(s.vec)) (path / "vec").fail("must be 1, 2, 4 or 8");
  s.cols = static_cast<int>(get_int(b, "cols", path, 1, 256));
  if (!is_power_of_two(s.cols) || s.cols < s.vec)
    (path / "cols").fail("must be a power of two >= vec ({})", s.vec);
  s.threads = static_cast<int>(get_int(b, "threads", path, 32, 1024));
  if (!is_power_of_two(s.threads) || s.threads < s.cols)
    (path / "threads").fail("must be a power of two in [max(32, cols), 1024]");
  s.serial = get_bool(b, "serial", path);
  s.fast_exp = get_bool(b, "fast_exp", path);
  if (s.serial && !s.staged && direction == Direction::kBackward)
    (path / "serial").fail("the serial backward needs \"form\": \"staged\"");
  if (s.serial && !s.staged && s.fast_exp)
    (path / "fast_exp").fail("the serial order of the lanes form is exact: fast_exp must be false");
  if (direction == Direction::kBackward && b.contains("stages")) {
    s.stages = static_cast<int>(get_int(b, "stages", path, 1, 4));
    if (s.staged && s.stages != 1)
      (path / "stages").fail("the staged form has no ring: stages must be 1");
  }
  if (direction == Direction::kBackward && b.contains("rows_per_cta"))
    s.rows_per_cta = static_cast<int>(get_int(b, "rows_per_cta", path, 0, 1 << 20));
  if (direction == Direction::kBackward && b.contains("grad_ape")) {
    const json& form = b["grad_ape"];
    if (form == "atomic") {
      s.atomic_ape = true;
    } else if (form != "fixed_order") {
      (path / "grad_ape").fail("must be \"fixed_order\" or \"atomic\"");
    }
    if (s.atomic_ape && s.staged)
      (path / "grad_ape").fail("the staged form has no atomic grad_ape: must be \"fixed_order\"");
  }
  if (direction == Direction::kBackward && b.contains("tail_backward")) {
    const json& form = b["tail_backward"];
    if (form == "row_stats") {
      s.row_stats = true;
    } else if (form != "whole_rows") {
      (path / "tail_backward").fail("must be \"whole_rows\" or \"row_stats\"");
    }
    if (s.row_stats && s.staged)
      (path / "tail_backward").fail("the staged form runs no tail: must be \"whole_rows\"");
  }
  if (direction == Direction::kForward && b.contains("tail_forward")) {
    const json& form = b["tail_forward"];
    if (form == "row_kernel") {
      s.tail_forward = LongWindowSchedule::TailForward::kRowKernel;
    } else if (form == "cluster") {
      s.tail_forward = LongWindowSchedule::TailForward::kCluster;
    } else if (form != "last_slice") {
      (path / "tail_forward").fail("must be \"last_slice\", \"row_kernel\" or \"cluster\"");
    }
    if (s.tail_forward != LongWindowSchedule::TailForward::kLastSlice && s.staged)
      (path / "tail_forward").fail("the staged form runs no tail: must be \"last_slice\"");
  }
  return out;
}

// An optional field naming one of `values` (by `name_of`); absent: nullopt.
template <class T, std::size_t N>
std::optional<T> optional_name(const json& object, const char* field, const Path& path,
                               const std::array<T, N>& values, const char* (*name_of)(T) noexcept) {
  if (!object.contains(field)) return std::nullopt;
  const json& v = object[field];
  for (const T value : values)
    if (v.is_string() && v == name_of(value)) return value;
  std::string names;
  for (const T value : values)
    names += fmt::format("{}\"{}\"", names.empty() ? "" : ", ", name_of(value));
  (path / field).fail("must be one of {}", names);
}

// A tail as csa::tail_name prints it, stages in its order ("norm+rope64+hadamard"), or "any".
std::string tail_key(const json& v, const Path& path) {
  const auto fail = [&] {
    path.fail(
        "must name a tail as csa prints it (\"norm\" or \"norm-bf16\", \"rope<N>\" or "
        "\"rope<N>-half\", \"hadamard\", joined by '+' in that order) or \"{}\"",
        TableEntry::kAnyTail);
  };
  if (!v.is_string()) fail();
  const std::string text = v.get<std::string>();
  if (text == TableEntry::kAnyTail) return text;
  TailShape tail;
  std::size_t at = 0;
  while (at <= text.size() && text.size() <= 64) {
    const std::size_t end = std::min(text.find('+', at), text.size());
    const std::string stage = text.substr(at, end - at);
    if (stage == "norm" || stage == "norm-bf16") {
      tail.norm = true;
      tail.norm_weight_dtype = stage == "norm" ? DType::kF32 : DType::kBf16;
    } else if (stage == "hadamard") {
      tail.hadamard = true;
    } else if (stage.rfind("rope", 0) == 0) {
      std::string digits = stage.substr(4);
      if (digits.size() > 5 && digits.compare(digits.size() - 5, 5, "-half") == 0) {
        tail.rope_interleaved = false;
        digits.resize(digits.size() - 5);
      }
      if (digits.empty() || digits.size() > 4 ||
          !std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; }))
        fail();
      tail.rope_dim = std::stoi(digits);
      if (tail.rope_dim <= 0 || tail.rope_dim % 2 != 0) fail();
    } else {
      fail();
    }
    at = end + 1;
  }
  // Canonical form only (no repeats, stages in order), so that a key is matched or refused.
  if (!tail.any() || tail_name(tail) != text) fail();
  return text;
}

TableEntry parse_entry(const json& e, const Path& path) {
  reject_unknown(
      e, path,
      {"family", "direction", "coff", "head_dim", "ratio", "dtype", "layout", "tail", "buckets"});
  const json& family = member(e, "family", path);
  if (!family.is_string() || family.get<std::string>() != "long_window")
    (path / "family").fail("must be \"long_window\" (the only table-driven family)");
  TableEntry out;
  const json& dir = member(e, "direction", path);
  if (dir == "forward") {
    out.direction = Direction::kForward;
  } else if (dir == "backward") {
    out.direction = Direction::kBackward;
  } else {
    (path / "direction").fail("must be \"forward\" or \"backward\"");
  }
  out.coff = static_cast<int>(get_int(e, "coff", path, 1, 2));
  std::tie(out.head_dim_min, out.head_dim_max) = get_range(e, "head_dim", path, 1, 4096);
  std::tie(out.ratio_min, out.ratio_max) = get_range(e, "ratio", path, 1, 256);
  out.dtype = optional_name(e, "dtype", path, kDTypes, dtype_name);
  out.layout = optional_name(e, "layout", path, kLayouts, layout_name);
  if (e.contains("tail")) out.tail = tail_key(e["tail"], path / "tail");
  const json& buckets = member(e, "buckets", path);
  if (!buckets.is_array() || buckets.empty()) (path / "buckets").fail("must be a non-empty array");
  for (std::size_t i = 0; i < buckets.size(); ++i) {
    const Path bp = (path / "buckets")[i];
    out.buckets.push_back(parse_bucket(buckets[i], bp, out.direction));
    const bool last = i + 1 == buckets.size();
    const auto max_rows = out.buckets.back().max_rows;
    if (last != (max_rows < 0))
      (bp / "max_rows")
          .fail(last ? "the last bucket must be unbounded (null)"
                     : "only the last bucket may be unbounded (null)");
    if (i > 0 && !last && max_rows <= out.buckets[i - 1].max_rows)
      (bp / "max_rows").fail("must increase from bucket to bucket");
  }
  return out;
}

RoutingRule parse_routing(const json& r, const Path& path) {
  reject_unknown(r, path, {"coff", "head_dim", "long_window_min_ratio"});
  RoutingRule out;
  out.coff = static_cast<int>(get_int(r, "coff", path, 1, 2));
  std::tie(out.head_dim_min, out.head_dim_max) = get_range(r, "head_dim", path, 1, 4096);
  // The short-window family serves ratios up to 16 only.
  out.long_window_min_ratio = static_cast<int>(get_int(r, "long_window_min_ratio", path, 1, 17));
  return out;
}

json range_json(int lo, int hi) {
  return json::array({lo, hi});
}

}  // namespace

bool TableEntry::matches(const Config& c, Direction d) const {
  return direction == d && coff == c.coff && head_dim_min <= c.head_dim &&
         c.head_dim <= head_dim_max && ratio_min <= c.ratio && c.ratio <= ratio_max &&
         (!dtype || *dtype == c.dtype) && (!layout || *layout == c.layout) &&
         (!tail || (c.tail.any() && (*tail == kAnyTail || *tail == tail_name(c.tail))));
}

ScheduleTable parse_schedule_table(std::string_view json_text, const std::string& source) {
  const Path top(source, "");
  json doc;
  try {
    doc = json::parse(json_text.begin(), json_text.end());
  } catch (const json::exception& e) {  // syntax errors, and numbers such as 1e999
    top.fail("not valid JSON ({})", e.what());
  }
  if (!doc.is_object()) top.fail("must be a JSON object");
  reject_unknown(doc, top, {"schema_version", "arch", "origin", "routing", "entries"});
  const auto version = get_int(doc, "schema_version", top, 0, 1 << 20);
  if (version != kScheduleSchemaVersion)
    (top / "schema_version")
        .fail("{} is not supported (this build reads {})", version, kScheduleSchemaVersion);
  ScheduleTable t;
  t.source = source;
  const json& arch = member(doc, "arch", top);
  if (!arch.is_string()) (top / "arch").fail("must be a string such as \"sm_90\"");
  t.arch = arch.get<std::string>();
  arch_number(t.arch, top);
  if (doc.contains("origin")) {
    if (!doc["origin"].is_string()) (top / "origin").fail("must be a string");
    t.origin = doc["origin"].get<std::string>();
  }
  if (doc.contains("routing")) {
    const json& routing = doc["routing"];
    if (!routing.is_array()) (top / "routing").fail("must be an array");
    for (std::size_t i = 0; i < routing.size(); ++i)
      t.routing.push_back(parse_routing(routing[i], (top / "routing")[i]));
  }
  const json& entries = member(doc, "entries", top);
  if (!entries.is_array()) (top / "entries").fail("must be an array");
  for (std::size_t i = 0; i < entries.size(); ++i)
    t.entries.push_back(parse_entry(entries[i], (top / "entries")[i]));
  return t;
}

std::string to_json(const ScheduleTable& t) {
  json doc;
  doc["schema_version"] = kScheduleSchemaVersion;
  doc["arch"] = t.arch;
  doc["origin"] = t.origin;
  doc["routing"] = json::array();
  for (const auto& r : t.routing) {
    doc["routing"].push_back({{"coff", r.coff},
                              {"head_dim", range_json(r.head_dim_min, r.head_dim_max)},
                              {"long_window_min_ratio", r.long_window_min_ratio}});
  }
  doc["entries"] = json::array();
  for (const auto& e : t.entries) {
    json je;
    je["family"] = "long_window";
    je["direction"] = e.direction == Direction::kForward ? "forward" : "backward";
    je["coff"] = e.coff;
    je["head_dim"] = range_json(e.head_dim_min, e.head_dim_max);
    je["ratio"] = range_json(e.ratio_min, e.ratio_max);
    if (e.dtype) je["dtype"] = dtype_name(*e.dtype);
    if (e.layout) je["layout"] = layout_name(*e.layout);
    if (e.tail) je["tail"] = *e.tail;
    je["buckets"] = json::array();
    for (const auto& b : e.buckets) {
      json jb;
      jb["max_rows"] = b.max_rows < 0 ? json(nullptr) : json(b.max_rows);
      jb["form"] = b.schedule.staged ? "staged" : "lanes";
      jb["vec"] = b.schedule.vec;
      jb["cols"] = b.schedule.cols;
      jb["threads"] = b.schedule.threads;
      jb["serial"] = b.schedule.serial;
      jb["fast_exp"] = b.schedule.fast_exp;
      if (e.direction == Direction::kBackward) {
        jb["stages"] = b.schedule.stages;
        jb["rows_per_cta"] = b.schedule.rows_per_cta;
        jb["grad_ape"] = b.schedule.atomic_ape ? "atomic" : "fixed_order";
        if (b.schedule.row_stats) jb["tail_backward"] = "row_stats";
      } else if (b.schedule.tail_forward != LongWindowSchedule::TailForward::kLastSlice) {
        jb["tail_forward"] = tail_forward_name(b.schedule.tail_forward);
      }
      je["buckets"].push_back(jb);
    }
    doc["entries"].push_back(je);
  }
  return doc.dump(2) + "\n";
}

ScheduleSet ScheduleSet::embedded() {
  ScheduleSet set;
  for (const auto& file : embedded::kScheduleFiles)
    set.add(parse_schedule_table(file.content,
                                 std::string("embedded schedules/") + std::string(file.name)));
  return set;
}

void ScheduleSet::add(ScheduleTable table) {
  const int cc = arch_number(table.arch, Path(table.source, ""));
  tables_[cc] = std::move(table);
}

const ScheduleTable* ScheduleSet::table_for(const std::string& arch) const {
  if (tables_.empty()) return nullptr;
  // "sm_90a" serves as sm_90; anything unreadable as the oldest arch.
  const int cc = parse::compute_capability(arch).value_or(0);
  auto it = tables_.upper_bound(cc);  // first table newer than the arch
  if (it == tables_.begin()) return &it->second;
  return &std::prev(it)->second;
}

Family ScheduleSet::route(const Config& c, const std::string& arch) const {
  int min_ratio = 17;  // the short-window family serves ratio 1..16
  if (const ScheduleTable* t = table_for(arch)) {
    for (const auto& r : t->routing) {
      if (r.coff == c.coff && r.head_dim_min <= c.head_dim && c.head_dim <= r.head_dim_max) {
        min_ratio = r.long_window_min_ratio;
        break;
      }
    }
  }
  return c.ratio >= min_ratio ? Family::kLongWindow : Family::kShortWindow;
}

LongWindowSchedule default_long_window(const Config& c, Direction direction) {
  LongWindowSchedule s;
  s.vec = c.head_dim % 2 == 0 ? 2 : 1;
  s.cols = direction == Direction::kForward ? 64 : 16;
  s.threads = 256;
  s.serial = false;
  s.fast_exp = true;
  return s;
}

namespace {

// The matching entry naming the most of (dtype, layout), the first of those; -1: none.
int best_entry(const ScheduleTable& t, const Config& c, Direction direction) {
  int best = -1;
  for (std::size_t i = 0; i < t.entries.size(); ++i) {
    const TableEntry& e = t.entries[i];
    if (e.matches(c, direction) &&
        (best < 0 || e.specificity() > t.entries[static_cast<std::size_t>(best)].specificity()))
      best = static_cast<int>(i);
  }
  return best;
}

}  // namespace

Selection ScheduleSet::select(const Config& c, Direction direction, std::int64_t rows,
                              const std::string& arch) const {
  Selection sel;
  const ScheduleTable* t = table_for(arch);
  if (const int i = t != nullptr ? best_entry(*t, c, direction) : -1; i >= 0) {
    const TableEntry& e = t->entries[static_cast<std::size_t>(i)];
    sel.table_arch = t->arch;
    sel.entry = i;
    std::int64_t lo = 0;
    for (std::size_t b = 0; b < e.buckets.size(); ++b) {
      const Bucket& bucket = e.buckets[b];
      if (bucket.max_rows < 0 || rows <= bucket.max_rows) {
        sel.bucket = static_cast<int>(b);
        sel.rows_min = lo;
        sel.rows_max = bucket.max_rows;
        sel.schedule = fit_long_window(c, bucket.schedule, arch, direction);
        return sel;
      }
      lo = bucket.max_rows + 1;
    }
  }
  sel.schedule = fit_long_window(c, default_long_window(c, direction), arch, direction);
  return sel;
}

std::vector<LongWindowSchedule> ScheduleSet::kernels(const Config& c, Direction direction,
                                                     const std::string& arch) const {
  std::vector<LongWindowSchedule> out;
  auto add_unique = [&](const LongWindowSchedule& s) {
    if (std::none_of(out.begin(), out.end(), [&](const auto& o) { return o.same_kernel(s); }))
      out.push_back(s);
  };
  const Selection first = select(c, direction, 0, arch);
  if (first.entry < 0) {
    add_unique(first.schedule);
    return out;
  }
  const TableEntry& e = table_for(arch)->entries[static_cast<std::size_t>(first.entry)];
  for (const auto& b : e.buckets) {
    const LongWindowSchedule s = fit_long_window(c, b.schedule, arch, direction);
    add_unique(s);
    if (s.atomic_ape) add_unique(s.fixed_order_twin());
  }
  return out;
}

}  // namespace csa::schedule
