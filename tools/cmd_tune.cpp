// `csa tune`: measures candidate long-window schedules of one configuration (in the element type,
// layout and fused tail it names) on this GPU, each checked before it is timed (tune_check.hpp),
// picks one per measured row count (the fastest; the bitwise one when within 10 %; for forward
// outputs under 16K elements the fastest bitwise one at each measured row count there), and
// writes a schedule table: the table serving this device's arch with the tuned entries put first
// (keyed on the type and layout unless bf16 THD, and on the tail; replacing the entries that
// would outrank them on the measured calls).
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <thread>

#include "bench_data.hpp"
#include "contract.hpp"
#include "commands.hpp"
#include "csa/testing/device.hpp"
#include "layout_data.hpp"
#include "timing.hpp"
#include "tune_check.hpp"
#include "tune_plan.hpp"

namespace csa::tools {

namespace {

struct TuneOptions {
  Config config{128, 512, 1};
  std::vector<std::int64_t> rows = {32, 64, 256, 1024};
  int device = 0;
  int reps = 7;
  std::uint64_t seed = 4321;
  std::string out;
  std::vector<std::string> directions;  // empty: both
};

std::string candidate_table(const std::string& arch, const Config& c, Direction d,
                            const Candidate& candidate) {
  nlohmann::json bucket = candidate.bucket;
  bucket["max_rows"] = nullptr;
  nlohmann::json table = {{"schema_version", 1},
                          {"arch", arch},
                          {"origin", "csa tune candidate"},
                          {"routing",
                           {{{"coff", c.coff},
                             {"head_dim", {1, 4096}},
                             {"long_window_min_ratio", std::min(c.ratio, 17)}}}},
                          {"entries", {make_entry(c, d, nlohmann::json::array({bucket}))}}};
  return table.dump();
}

// A valid configuration; the schedule table serves the long-window family only, and a tail at a
// small ratio runs the short-window family's rules.
void check_tunable(const Config& c) {
  try {
    validate_shape(c, c.ratio, 1, 1);  // the configuration and its tail, before any device
  } catch (const Error& e) {
    throw CLI::ValidationError("configuration", e.what());
  }
  if (c.tail.any() && !keeps_pooled_rows(c))
    throw CLI::ValidationError(
        "--ratio", fmt::format("a tail at ratio {} runs the short-window family, whose schedules "
                               "are rules, not a table entry: tune a tail at a ratio above 16",
                               c.ratio));
}

void run_tune(Runtime& rt, const TuneOptions& o) {
  device::make_current(o.device);
  const DeviceInfo dev = device::current_device();
  const std::string arch = fmt::format("sm_{}{}", dev.cc_major, dev.cc_minor);
  device::StreamHandle stream;
  const Config& c = o.config;
  fmt::print("tuning ratio={} coff={} head_dim={} {} {}{} on {} ({}), rows {}\n", c.ratio, c.coff,
             c.head_dim, dtype_name(c.dtype), layout_name(c.layout),
             c.tail.any() ? " tail=" + tail_name(c.tail) : "", dev.name, arch,
             fmt::join(o.rows, ","));
  std::vector<std::int64_t> rows = o.rows;
  std::sort(rows.begin(), rows.end());
  std::vector<nlohmann::json> entries;
  nlohmann::json record = nlohmann::json::array();
  for (Direction dir : {Direction::kForward, Direction::kBackward}) {
    if (!wants(o.directions, dir == Direction::kForward ? "fwd" : "bwd"))
      continue;  // the table's entry of this direction stays as it is
    const char* dname = dir == Direction::kForward ? "forward" : "backward";
    // The candidates as the loader fits them (each measured once, under the name it runs),
    // then one Runtime per candidate (its own table), sharing the disk cache; compile in
    // parallel.
    std::vector<Candidate> candidates;
    {
      const auto all = tune_candidates(c, dir);
      std::vector<std::string> fitted;
      for (const auto& cand : all) {
        Runtime probe(rt.options());
        probe.set_schedule_table(candidate_table(arch, c, dir, cand), cand.name);
        fitted.push_back(probe.select_schedule(c, dir, 1, arch).schedule);
      }
      candidates = as_fitted(all, fitted, dir);
      if (candidates.size() < all.size())
        fmt::print("{}: {} of {} candidates run as another one once fitted; measured once\n", dname,
                   all.size() - candidates.size(), all.size());
    }
    std::vector<std::unique_ptr<Runtime>> runtimes;
    for (const auto& cand : candidates) {
      runtimes.push_back(std::make_unique<Runtime>(rt.options()));
      runtimes.back()->set_schedule_table(candidate_table(arch, c, dir, cand), cand.name);
    }
    std::vector<std::string> failed(candidates.size());
    {
      std::vector<std::thread> threads;
      for (std::size_t i = 0; i < candidates.size(); ++i)
        threads.emplace_back([&, i] {
          try {
            runtimes[i]->prewarm(c, o.device);
          } catch (const std::exception& e) {
            failed[i] = e.what();
          }
        });
      for (auto& t : threads) t.join();
    }
    std::vector<Measurement> measurements;
    for (std::int64_t r : rows) {
      Pack pack;
      pack.seqlens = {static_cast<std::int32_t>(r * c.ratio)};
      pack.label = fmt::format("1x{}", r * c.ratio);
      DeviceInputs p(make_inputs(c, pack, o.seed + static_cast<std::uint64_t>(r)));
      // Timed as csa bench times: over copies of the inputs rotated past the L2, so that every
      // row count is measured reading from DRAM (one L2-resident set favours other schedules).
      const int esize = element_size(c.dtype);
      const int sets = rotation_sets(
          (dir == Direction::kForward ? forward_bytes(p.in, esize) : backward_bytes(p.in, esize)) +
              tail_extra_bytes(c, p.in.total_comp, dir),
          dev.l2_bytes);
      std::vector<std::unique_ptr<DeviceInputs>> copies;
      for (int s = 1; s < sets; ++s) copies.push_back(std::make_unique<DeviceInputs>(p.in));
      auto set = [&](int i) -> const DeviceInputs& {
        return i % sets == 0 ? p : *copies[static_cast<std::size_t>(i % sets - 1)];
      };
      const auto gate = make_tune_check(rt, stream.get(), p, sets, o.seed + 7);
      gate->prepare(dir, set);
      auto call = [&](Runtime& cr, int i) {
        if (dir == Direction::kForward) {
          cr.forward(gate->forward(set(i), i % sets), stream.get());
        } else {
          cr.backward(gate->backward(set(i), i % sets), stream.get());
        }
      };
      Measurement m;
      m.rows = r;
      for (std::size_t i = 0; i < candidates.size(); ++i) {
        Runtime& cr = *runtimes[i];
        double us = -1.0;
        std::size_t differing = 0;  // elements differing from the reference (largest tensor)
        std::string why = failed[i];
        if (why.empty()) {
          try {
            const CheckResult checked =
                gate->run_and_check(dir, candidates[i].bitwise, [&] { call(cr, 0); });
            why = checked.failure;
            differing = checked.differing;
            if (why.empty())
              us =
                  time_graph(stream.get(), o.reps, std::max(sets, 32), [&](int n) { call(cr, n); });
          } catch (const std::exception& e) {
            why = e.what();
          }
        }
        m.micros.push_back(why.empty() ? us : -1.0);
        record.push_back({{"direction", dname},
                          {"rows", r},
                          {"candidate", candidates[i].name},
                          {"us", us},
                          {"differing", differing},
                          {"rejected", why}});
        fmt::print("{:<8} rows {:>6}  {:<34} {}\n", dname, r, candidates[i].name,
                   why.empty() ? fmt::format("{:9.2f} us  ({} differ)", us, differing)
                               : "rejected: " + why);
      }
      measurements.push_back(m);
    }
    const auto chosen = choose(candidates, measurements, 1.10);
    for (std::size_t k = 0; k < measurements.size(); ++k) {
      if (chosen[k] < 0) {
        fmt::print("{:<8} rows {:>6}: every candidate failed\n", dname, measurements[k].rows);
        continue;
      }
      // Margin: the runner-up's time over the winner's.
      double runner_up = -1.0;
      for (std::size_t i = 0; i < candidates.size(); ++i) {
        const double t = measurements[k].micros[i];
        if (static_cast<int>(i) != chosen[k] && t > 0 && (runner_up < 0 || t < runner_up))
          runner_up = t;
      }
      const double win = measurements[k].micros[static_cast<std::size_t>(chosen[k])];
      fmt::print("{:<8} rows {:>6}: {} ({:.2f} us; runner-up {:+.1f} %)\n", dname,
                 measurements[k].rows, candidates[static_cast<std::size_t>(chosen[k])].name, win,
                 runner_up > 0 ? 100.0 * (runner_up / win - 1.0) : 0.0);
    }
    nlohmann::json buckets = make_buckets(candidates, measurements, chosen);
    if (dir == Direction::kForward) {
      // Small outputs: the fastest bitwise candidate at each measured row count within them.
      const std::int64_t limit = bitwise_row_limit(c);
      const nlohmann::json bitwise = bitwise_buckets(candidates, measurements, limit);
      if (!bitwise.empty()) {
        buckets = with_bitwise_small_rows(buckets, bitwise, limit);
        for (const auto& b : bitwise)
          fmt::print(
              "forward  rows <= {}: lanes-serial v{} c{} t{} (outputs under {} elements "
              "stay bitwise)\n",
              b["max_rows"].get<std::int64_t>(), b["vec"].get<int>(), b["cols"].get<int>(),
              b["threads"].get<int>(), kBitwiseOutputElements);
      } else {
        fmt::print("forward: no bitwise candidate passed; small outputs are not kept bitwise\n");
      }
    }
    entries.push_back(make_entry(c, dir, std::move(buckets)));
  }
  const std::string base_text = rt.schedule_table_json(arch);
  nlohmann::json base = base_text.empty() ? nlohmann::json{{"schema_version", 1},
                                                           {"arch", arch},
                                                           {"entries", nlohmann::json::array()}}
                                          : nlohmann::json::parse(base_text);
  base["arch"] = arch;
  const nlohmann::json table = merge_entries(
      base, entries, c,
      fmt::format("csa tune ratio={} coff={} head_dim={} {} {}{} on {}, rows {}", c.ratio, c.coff,
                  c.head_dim, dtype_name(c.dtype), layout_name(c.layout),
                  c.tail.any() ? " tail=" + tail_name(c.tail) : "", dev.name,
                  fmt::join(rows, ",")));
  const std::string text = table.dump(2) + "\n";
  validate_schedule_table(text, "tuned table");
  const std::string out = o.out.empty() ? fmt::format("csa-tuned-{}.json", arch) : o.out;
  std::ofstream(out) << text;
  std::ofstream(out + ".record.json") << record.dump(2) << "\n";
  fmt::print("wrote {} (use it with CSA_SCHEDULE_FILE) and {}.record.json\n", out, out);
}

}  // namespace

void add_tune_command(CLI::App& app, Runtime*& runtime) {
  auto opts = std::make_shared<TuneOptions>();
  auto* cmd =
      app.add_subcommand("tune", "measure long-window schedules on this GPU and write a table");
  add_config_options(cmd, opts->config);
  add_io_options(cmd, opts->config.dtype, opts->config.layout);
  add_tail_options(cmd, opts->config.tail);
  cmd->add_option("--rows", opts->rows, "output row counts to measure, comma-separated")
      ->delimiter(',')
      ->capture_default_str()
      ->check(CLI::Range(std::int64_t{1}, std::int64_t{1} << 24));
  cmd->add_option("--device", opts->device, "device ordinal")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--reps", opts->reps, "timed repetitions per candidate (median)")
      ->capture_default_str()
      ->check(CLI::Range(1, 1000));
  cmd->add_option("--seed", opts->seed, "input seed")->capture_default_str();
  cmd->add_option("--out", opts->out, "output table (default: csa-tuned-<arch>.json)");
  add_direction_option(cmd, opts->directions, kDirections);
  cmd->callback([opts, &runtime] {
    check_tunable(opts->config);
    run_tune(*runtime, *opts);
  });
}

}  // namespace csa::tools
