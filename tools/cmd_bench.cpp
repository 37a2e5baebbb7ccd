// `csa bench`: kernel time against the DRAM floor, per shape, on one device.
//
// Kernel time: device events around many back-to-back calls, median over repetitions, with the
// input sets rotated until the working set is several times the L2 (the DRAM-bound figure),
// and with one set reused (the L2-warm figure). Host time: wall clock per call through the C++
// API. The floor is bytes / copy bandwidth measured in the same run.
#include <fmt/format.h>
#include <stdlib.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>

#include "bench_data.hpp"
#include "layout_data.hpp"
#include "timing.hpp"
#include "commands.hpp"
#include "csa/testing/device.hpp"

namespace csa::tools {

namespace {

struct BenchOptions {
  std::vector<std::string> shapes;
  int device = 0;
  int reps = 15;
  std::uint64_t seed = 1234;
  std::string save_path;
  bool json = false;
  bool jit = true;
  std::vector<std::string> directions;  // empty: fwd, bwd and bwd-det
  DType dtype = DType::kBf16;
  Layout layout = Layout::kThd;
  std::int64_t stride = 0;   // rows of kv, score, grad_kv, grad_score this many elements apart
  TailShape tail;            // the fused tail of the forward
  bool keep_pooled = false;  // short-window tails: keep the pooled rows (the row-stats backward)
};

struct DeviceSet {
  device::Buffer kv, score, out, grad_out, grad_kv, grad_score, grad_ape;
  device::Buffer pooled;  // the long-window tail's pooled rows (fp32), else 16 bytes
};

struct Shape {
  Config config;
  Pack pack;
};

std::vector<Shape> default_shapes() {
  std::vector<Shape> out;
  for (int ratio : {4, 2})
    for (int d : {128, 512})
      for (const char* pack : {"1x4096", "1x8192", "3x8192"})
        out.push_back({{ratio, d, 2}, parse_pack(pack)});
  return out;
}

// "ratio=4,coff=2,head_dim=512,pack=1x4096" or "4,2,512,1x4096"; checked against the
// library's limits here, before anything is allocated.
Shape parse_shape(const std::string& text) {
  const auto fields = split(text, ',');
  const auto bad = [&] {
    return CLI::ValidationError("--shape", "'" + text +
                                               "' is not ratio=R,coff=C,head_dim=D,pack=PACK (or "
                                               "R,C,D,PACK)");
  };
  std::string config;
  std::string pack;
  if (text.find('=') == std::string::npos) {
    if (fields.size() != 4) throw bad();
    config = fields[0] + "," + fields[1] + "," + fields[2];
    pack = fields[3];
  } else {
    for (const auto& f : fields) {
      if (f.rfind("pack=", 0) == 0) {
        if (!pack.empty()) throw bad();
        pack = f.substr(5);
      } else {
        config += (config.empty() ? "" : ",") + f;
      }
    }
    if (pack.empty()) throw bad();
  }
  Shape shape{parse_config(config, "--shape"), parse_pack(pack)};
  std::int64_t tokens = 0;
  std::int64_t rows = 0;
  for (const auto len : shape.pack.seqlens) {
    tokens += len;
    rows += len / shape.config.ratio;
  }
  try {
    validate_shape(shape.config, tokens, static_cast<std::int32_t>(shape.pack.seqlens.size()),
                   rows);
  } catch (const Error& e) {
    throw CLI::ValidationError("--shape", "'" + text + "': " + e.what());
  }
  return shape;
}

double copy_bandwidth(Stream stream, int reps) {
  const std::size_t bytes = std::size_t{1} << 30;
  device::Buffer a(bytes), b(bytes);
  a.fill(0x3c);
  const double us = time_device(stream, reps, 4, [&](int i) {
    if (i % 2 == 0)
      device::copy_async(b.get(), a.get(), bytes, stream);
    else
      device::copy_async(a.get(), b.get(), bytes, stream);
  });
  return 2.0 * static_cast<double>(bytes) / (us * 1e-6);  // bytes read + written per second
}

// The shape's tensors as the call takes them (`o.dtype`, `o.layout`, kv/score rows `o.stride`
// elements apart).
LaidInputs laid_for(const HostInputs& in, const BenchOptions& o) {
  try {
    return lay_out(in, o.dtype, o.layout, o.stride);
  } catch (const std::invalid_argument& e) {
    throw CLI::ValidationError("--layout", e.what());
  }
}

nlohmann::json bench_shape(Runtime& rt, Stream stream, const Shape& shape, const BenchOptions& o,
                           double bandwidth, std::int64_t l2_bytes) {
  const HostInputs in = make_inputs(shape.config, shape.pack, o.seed);
  Config c = shape.config;
  c.dtype = o.dtype;
  c.layout = o.layout;
  c.tail = o.tail;
  const LaidInputs laid = laid_for(in, o);
  const bool sbhd = o.layout == Layout::kSbhd;
  const std::int64_t width = static_cast<std::int64_t>(c.coff) * c.head_dim;
  const auto esize = static_cast<std::size_t>(element_size(o.dtype));
  const std::size_t tok_bytes = laid.kv.size();
  const std::size_t comp_bytes = static_cast<std::size_t>(in.total_comp * c.head_dim) * esize;
  const std::size_t ape_bytes = static_cast<std::size_t>(c.ratio * width) * 4;
  // The long-window family's tail keeps the pooled rows (fp32) for its backward, and a
  // short-window tail with the norm where asked (--keep-pooled: the backward's row-stats form):
  // written by the forward, read by the backward, counted in both floors.
  const bool keeps_pooled = keeps_pooled_rows(c) || (o.keep_pooled && has_row_stats_backward(c));
  const std::size_t pooled_bytes =
      keeps_pooled ? static_cast<std::size_t>(in.total_comp * c.head_dim) * 4 : 0;
  const std::int64_t fwd_bytes =
      forward_bytes(in, static_cast<int>(esize)) + static_cast<std::int64_t>(pooled_bytes);
  const std::int64_t bwd_bytes = backward_bytes(in, static_cast<int>(esize)) +
                                 (c.tail.norm ? static_cast<std::int64_t>(pooled_bytes) : 0);
  const int sets = rotation_sets(fwd_bytes, l2_bytes);

  device::Buffer cu(in.cu.size() * 4), cuc(in.cuc.size() * 4), ape(ape_bytes);
  cu.upload(in.cu.data(), in.cu.size() * 4);
  cuc.upload(in.cuc.data(), in.cuc.size() * 4);
  ape.upload(in.ape.data(), ape_bytes);
  std::vector<DeviceSet> data;
  for (int s = 0; s < sets; ++s) {
    DeviceSet d{
        device::Buffer(tok_bytes),  device::Buffer(tok_bytes),
        device::Buffer(comp_bytes), device::Buffer(comp_bytes),
        device::Buffer(tok_bytes),  device::Buffer(tok_bytes),
        device::Buffer(ape_bytes),  device::Buffer(std::max<std::size_t>(pooled_bytes, 16))};
    d.kv.upload(laid.kv.data(), tok_bytes);
    d.score.upload(laid.score.data(), tok_bytes);
    d.grad_out.upload(laid.grad_out.data(), comp_bytes);
    data.push_back(std::move(d));
  }
  // The tail's tensors (L2-resident, not counted in the floor): an fp32 or bf16 weight near 1
  // and RoPE tables with a row for every block of the longest segment.
  const DeviceTail tail(c, make_tail_inputs(c, in, o.seed));
  device::Buffer grad_w(static_cast<std::size_t>(c.head_dim) * 4);
  const std::int64_t stride = o.stride;
  auto fwd_args = [&](int s) {
    ForwardArgs a;
    a.kv = data[s].kv.get();
    a.score = data[s].score.get();
    a.ape = ape.as<float>();
    a.cu_seqlens = sbhd ? nullptr : cu.as<std::int32_t>();
    a.cu_seqlens_comp = sbhd ? nullptr : cuc.as<std::int32_t>();
    a.out = data[s].out.get();
    a.total_tokens = in.total_tokens;
    a.num_segments = static_cast<std::int32_t>(in.cu.size() - 1);
    a.total_comp = in.total_comp;
    a.config = c;
    a.seq_len = laid.seq_len;
    a.kv_stride = a.score_stride = stride;
    a.tail = tail.tail();
    if (keeps_pooled) a.pooled = data[s].pooled.as<float>();
    return a;
  };
  auto bwd_args = [&](int s, std::uint32_t flags) {
    BackwardArgs a;
    a.kv = data[s].kv.get();
    a.score = data[s].score.get();
    a.ape = ape.as<float>();
    a.cu_seqlens = sbhd ? nullptr : cu.as<std::int32_t>();
    a.cu_seqlens_comp = sbhd ? nullptr : cuc.as<std::int32_t>();
    a.grad_out = data[s].grad_out.get();
    a.grad_kv = data[s].grad_kv.get();
    a.grad_score = data[s].grad_score.get();
    a.grad_ape = data[s].grad_ape.as<float>();
    a.total_tokens = in.total_tokens;
    a.num_segments = static_cast<std::int32_t>(in.cu.size() - 1);
    a.total_comp = in.total_comp;
    a.config = c;
    a.flags = flags;
    a.seq_len = laid.seq_len;
    a.kv_stride = a.score_stride = a.grad_kv_stride = a.grad_score_stride = stride;
    a.tail = tail.tail();
    if (c.tail.norm) a.grad_norm_weight = grad_w.as<float>();
    if (keeps_pooled && c.tail.norm) a.pooled = data[s].pooled.as<float>();
    return a;
  };
  const std::string label =
      fmt::format("{},pack={}{}", format_config(c), shape.pack.label,
                  stride != 0 ? fmt::format(",stride={}", stride) : std::string());
  const int calls = std::max(sets, 32);
  nlohmann::json rows = nlohmann::json::array();
  auto measure = [&](const std::string& dir, std::int64_t bytes, double slope, double offset_us,
                     const std::function<void(int)>& call) {
    if (!o.directions.empty() &&
        std::find(o.directions.begin(), o.directions.end(), dir) == o.directions.end())
      return;
    for (int s = 0; s < sets; ++s) call(s);  // warm: JIT, module load, first touch
    device::synchronize(stream);
    const double cold = time_graph(stream, o.reps, calls, [&](int i) { call(i % sets); });
    const double warm = time_graph(stream, o.reps, calls, [&](int) { call(0); });
    const double streamed = time_device(stream, o.reps, calls, [&](int i) { call(i % sets); });
    const double host = time_host(stream, 200, [&](int i) { call(i % sets); });
    const double floor_us = 1e6 * static_cast<double>(bytes) / bandwidth;
    const double target = slope * floor_us + offset_us;
    rows.push_back({{"shape", label},
                    {"dtype", dtype_name(c.dtype)},
                    {"layout", layout_name(c.layout)},
                    {"row_stride", stride},
                    {"direction", dir},
                    {"megabytes", static_cast<double>(bytes) / 1e6},
                    {"floor_us", floor_us},
                    {"kernel_us", cold},
                    {"ratio_to_floor", cold / floor_us},
                    {"l2_warm_us", warm},
                    {"stream_us", streamed},
                    {"host_us", host},
                    {"target_us", target},
                    {"meets_target", cold <= target},
                    {"input_sets", sets}});
  };
  measure("fwd", fwd_bytes, 1.4, 2.0, [&](int s) { rt.forward(fwd_args(s), stream); });
  if (keeps_pooled) {  // the backward's pooled rows: every set's, from its data
    for (int s = 0; s < sets; ++s) rt.forward(fwd_args(s), stream);
    device::synchronize(stream);
  }
  // Targets: 1.4 x floor + 2 us forward; backward 1.5 x floor + 3 us (short-window family) or
  // 1.6 x floor + 3 us (long-window).
  const double bwd_slope = c.ratio > 16 ? 1.6 : 1.5;
  measure("bwd", bwd_bytes, bwd_slope, 3.0, [&](int s) { rt.backward(bwd_args(s, 0), stream); });
  measure("bwd-det", bwd_bytes, bwd_slope, 3.0,
          [&](int s) { rt.backward(bwd_args(s, kDeterministic), stream); });
  return rows;
}

nlohmann::json bench_jit(const Config& config, int device) {
  char dir_template[] = "/tmp/csa-bench-jit-XXXXXX";
  const char* dir = ::mkdtemp(dir_template);
  if (dir == nullptr) throw Error(Status::kCacheError, "mkdtemp failed for the JIT benchmark");
  RuntimeOptions options = RuntimeOptions::from_environment();
  options.cache_dir = dir;
  options.disk_cache = true;
  options.jit_enabled = true;
  nlohmann::json out;
  {
    Runtime cold(options);
    const auto t0 = std::chrono::steady_clock::now();
    const PrewarmReport r = cold.prewarm(config, device);
    out["jit_seconds"] =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    out["compiled"] = r.compiled;
  }
  {
    Runtime warm(options);
    const auto t0 = std::chrono::steady_clock::now();
    const PrewarmReport r = warm.prewarm(config, device);
    out["cached_load_ms"] =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    out["cached_compiled"] = r.compiled;
  }
  std::filesystem::remove_all(dir);
  out["config"] = format_config(config);
  return out;
}

void run_bench(Runtime& rt, const BenchOptions& o) {
  std::vector<Shape> shapes;
  for (const auto& s : o.shapes) shapes.push_back(parse_shape(s));
  if (shapes.empty()) shapes = default_shapes();
  device::make_current(o.device);
  const DeviceInfo dev = device::current_device();
  device::StreamHandle stream;
  const double bandwidth = copy_bandwidth(stream.get(), o.reps);
  nlohmann::json report = {{"device", dev.name},       {"sm_count", dev.sm_count},
                           {"l2_bytes", dev.l2_bytes}, {"copy_bandwidth_tb_s", bandwidth / 1e12},
                           {"library", version()},     {"rows", nlohmann::json::array()}};
  // The table goes to stdout, unless --json asks for the JSON there (then nothing else).
  std::FILE* text = o.json ? stderr : stdout;
  fmt::print(text, "device: {} ({} SMs, L2 {:.0f} MB), copy bandwidth {:.2f} TB/s (read+write)\n",
             dev.name, dev.sm_count, static_cast<double>(dev.l2_bytes) / 1e6, bandwidth / 1e12);
  fmt::print(text,
             "kernel: CUDA-graph replay of back-to-back calls over input sets rotated past the L2 "
             "(median); L2warm: one set; stream: the same calls launched on a stream; host: wall "
             "clock of one call issued to an idle stream\n");
  fmt::print(text, "{:<56} {:<8} {:>8} {:>9} {:>10} {:>7} {:>9} {:>9} {:>8} {:>9} {}\n", "shape",
             "dir", "MB", "floor us", "kernel us", "ratio", "L2warm", "stream", "host us", "target",
             "ok");
  for (const auto& shape : shapes) {
    for (const auto& row : bench_shape(rt, stream.get(), shape, o, bandwidth, dev.l2_bytes)) {
      fmt::print(
          text,
          "{:<56} {:<8} {:>8.1f} {:>9.2f} {:>10.2f} {:>7.2f} {:>9.2f} {:>9.2f} {:>8.2f} {:>9.2f} "
          "{}\n",
          row["shape"].get<std::string>(), row["direction"].get<std::string>(),
          row["megabytes"].get<double>(), row["floor_us"].get<double>(),
          row["kernel_us"].get<double>(), row["ratio_to_floor"].get<double>(),
          row["l2_warm_us"].get<double>(), row["stream_us"].get<double>(),
          row["host_us"].get<double>(), row["target_us"].get<double>(),
          row["meets_target"].get<bool>() ? "yes" : "NO");
      report["rows"].push_back(row);
    }
  }
  if (o.jit) {
    const auto jit = bench_jit({4, 512, 2}, o.device);
    fmt::print(text, "JIT {}: compile {:.3f} s, cached load {:.2f} ms\n",
               jit["config"].get<std::string>(), jit["jit_seconds"].get<double>(),
               jit["cached_load_ms"].get<double>());
    report["jit"] = jit;
  }
  if (!o.save_path.empty()) {
    std::ofstream(o.save_path) << report.dump(2) << "\n";
    fmt::print(text, "wrote {}\n", o.save_path);
  }
  if (o.json) print_json(report);
}

}  // namespace

void add_bench_command(CLI::App& app, Runtime*& runtime) {
  auto opts = std::make_shared<BenchOptions>();
  auto* cmd = app.add_subcommand("bench", "kernel time vs the DRAM floor on a GPU");
  cmd->add_option("--shape,-s", opts->shapes,
                  "ratio=R,coff=C,head_dim=D,pack=PACK (or R,C,D,PACK), PACK being NxLEN or "
                  "LEN+LEN+..., repeatable (default: ratio 4 and 2, coff 2, head_dim 128 and 512, "
                  "packs 1x4096 1x8192 3x8192)");
  cmd->add_option("--device", opts->device, "device ordinal")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--reps", opts->reps, "timed repetitions per figure (median)")
      ->capture_default_str()
      ->check(CLI::Range(1, 1000));
  cmd->add_option("--seed", opts->seed, "input seed")->capture_default_str();
  cmd->add_flag("--json", opts->json, "print the results as one JSON object instead of the table");
  cmd->add_option("--save", opts->save_path, "also write the results as JSON to this file");
  cmd->add_flag("!--no-jit", opts->jit, "skip the JIT and cached-load timing");
  add_direction_option(cmd, opts->directions, kBenchDirections);
  add_io_options(cmd, opts->dtype, opts->layout);
  add_tail_options(cmd, opts->tail);
  cmd->add_flag("--keep-pooled", opts->keep_pooled,
                "short-window tails with the norm (no Hadamard): the forward keeps the fp32 pooled "
                "rows and the backward reads them (its row-stats form)");
  cmd->add_option("--stride", opts->stride,
                  "rows of kv, score, grad_kv and grad_score this many elements apart, as halves "
                  "of one fused projection's output are (default: dense)")
      ->check(CLI::NonNegativeNumber);
  cmd->callback([opts, &runtime] { run_bench(*runtime, *opts); });
}

}  // namespace csa::tools
