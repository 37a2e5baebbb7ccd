// csa_launch_bench: the host's cost of a warm call and the device's cost of replaying a graph of
// calls, on one GPU. Separate from `csa bench` because its baseline needs what the public API
// does not expose: the driver table and the very kernels and argument blocks a call launches.
//
// Per configuration (short-window 4,2,128 at 1x8192; long-window 128,1,512 at 1x4096):
//   raw      cuLaunchKernelEx of the kernels and argument blocks a plan call launches, read back
//            from a captured graph (the backward's grad_ape workspace re-pointed at a buffer
//            of the same size): the floor of any launch path;
//   plan     csa::Plan::forward / backward;
//   runtime  csa::Runtime::forward / backward (record looked up by configuration).
// queued: wall clock of 50 calls back to back on one stream, per call, median of 31 rounds.
// idle:   one call issued to an idle stream, median of 201.
// The paths (and an empty kernel's raw launch, the platform's floor) take turns in each round.
// Driver queries: ns per call of each query a warm backward makes besides its launches.
// Graph: the forward and backward kernel times (a graph of 20 back-to-back calls, per call)
// against a graph holding one forward + backward, replayed 20 times back to back, per replay.
#include <dlfcn.h>
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstring>
#include <fstream>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <vector>

#include "api/runtime_impl.hpp"
#include "bench_data.hpp"
#include "csa/testing/device.hpp"
#include "csa_params.h"
#include "nvrtc/compiler.hpp"
#include "timing.hpp"

namespace {

using csa::tools::median;

// Graph inspection entry points: the library itself has no use for them.
struct GraphInspection {
  PFN_cuGraphGetNodes_v10000 get_nodes = nullptr;
  PFN_cuGraphNodeGetType_v10000 node_type = nullptr;
  PFN_cuGraphKernelNodeGetParams_v12000 kernel_params = nullptr;
  PFN_cuFuncGetParamInfo_v12040 param_info = nullptr;

  GraphInspection() {
    void* lib = ::dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (lib == nullptr) throw std::runtime_error("libcuda.so.1 is not loaded");
    auto get_proc =
        reinterpret_cast<PFN_cuGetProcAddress_v12000>(::dlsym(lib, "cuGetProcAddress_v2"));
    if (get_proc == nullptr) throw std::runtime_error("cuGetProcAddress_v2 not found");
    auto resolve = [&](const char* name, int version, void** fn) {
      CUdriverProcAddressQueryResult found{};
      if (get_proc(name, fn, version, CU_GET_PROC_ADDRESS_DEFAULT, &found) != CUDA_SUCCESS ||
          *fn == nullptr)
        throw std::runtime_error(fmt::format("driver entry point {} not found", name));
    };
    resolve("cuGraphGetNodes", 10000, reinterpret_cast<void**>(&get_nodes));
    resolve("cuGraphNodeGetType", 10000, reinterpret_cast<void**>(&node_type));
    resolve("cuGraphKernelNodeGetParams", 12000, reinterpret_cast<void**>(&kernel_params));
    resolve("cuFuncGetParamInfo", 12040, reinterpret_cast<void**>(&param_info));
  }
};

// One kernel launch replayed without the library: function, shape and a copy of its argument
// block.
struct RawLaunch {
  CUfunction function = nullptr;
  CUlaunchConfig config{};
  CUlaunchAttribute attribute{};  // programmatic serialization, as the library launches
  std::vector<unsigned char> params;
  void* args[1] = {nullptr};
};

class RawCalls {
 public:
  // Captures `call` on `stream` and keeps its kernel launches, in order; `programmatic`: launch
  // them with programmatic stream serialization, as the library does on this device.
  RawCalls(csa::Runtime& rt, CUstream stream, bool programmatic, const std::function<void()>& call)
      : rt_(rt) {
    const auto& d = csa::RuntimeAccess::of(rt).loader.get();
    const auto& api = d.api();
    GraphInspection gi;
    d.check(api.cuStreamBeginCapture(stream, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL), "begin capture");
    call();
    CUgraph graph = nullptr;
    d.check(api.cuStreamEndCapture(stream, &graph), "end capture");
    std::size_t count = 0;
    d.check(gi.get_nodes(graph, nullptr, &count), "cuGraphGetNodes");
    std::vector<CUgraphNode> nodes(count);
    d.check(gi.get_nodes(graph, nodes.data(), &count), "cuGraphGetNodes");
    for (CUgraphNode node : nodes) {
      CUgraphNodeType type{};
      d.check(gi.node_type(node, &type), "cuGraphNodeGetType");
      if (type != CU_GRAPH_NODE_TYPE_KERNEL) continue;
      CUDA_KERNEL_NODE_PARAMS_v2 p{};
      d.check(gi.kernel_params(node, &p), "cuGraphKernelNodeGetParams");
      RawLaunch l;
      l.function = p.func != nullptr ? p.func : reinterpret_cast<CUfunction>(p.kern);
      std::size_t offset = 0, size = 0;
      d.check(gi.param_info(l.function, 0, &offset, &size), "cuFuncGetParamInfo");
      const auto* bytes = static_cast<const unsigned char*>(p.kernelParams[0]);
      l.params.assign(bytes, bytes + size);
      l.config.gridDimX = p.gridDimX;
      l.config.gridDimY = p.gridDimY;
      l.config.gridDimZ = p.gridDimZ;
      l.config.blockDimX = p.blockDimX;
      l.config.blockDimY = p.blockDimY;
      l.config.blockDimZ = p.blockDimZ;
      l.config.sharedMemBytes = p.sharedMemBytes;
      l.config.hStream = stream;
      launches_.push_back(std::move(l));
    }
    d.check(api.cuGraphDestroy(graph), "graph destroy");
    // The backward kernel comes before its grad_ape reduction.
    std::stable_sort(
        launches_.begin(), launches_.end(),
        [](const RawLaunch& a, const RawLaunch& b) { return a.params.size() > b.params.size(); });
    repoint_workspace();
    for (auto& l : launches_) {
      l.args[0] = l.params.data();
      if (programmatic) {
        l.attribute.id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        l.attribute.value.programmaticStreamSerializationAllowed = 1;
        l.config.attrs = &l.attribute;
        l.config.numAttrs = 1;
      }
    }
  }

  void launch() {
    const auto& d = csa::RuntimeAccess::of(rt_).loader.get();
    for (auto& l : launches_)
      d.check(d.api().cuLaunchKernelEx(&l.config, l.function, l.args, nullptr), "raw launch");
  }
  std::size_t size() const { return launches_.size(); }

 private:
  // Under capture the workspace is graph-owned memory, invalid outside the graph: give the raw
  // launches a buffer of the size the reduction reads.
  void repoint_workspace() {
    csa_kernel::ApeReduceParams* reduce = nullptr;
    csa_kernel::BackwardParams* backward = nullptr;
    for (auto& l : launches_) {
      if (l.params.size() == sizeof(csa_kernel::ApeReduceParams))
        reduce = reinterpret_cast<csa_kernel::ApeReduceParams*>(l.params.data());
      if (l.params.size() == sizeof(csa_kernel::BackwardParams))
        backward = reinterpret_cast<csa_kernel::BackwardParams*>(l.params.data());
    }
    if (reduce == nullptr || backward == nullptr) return;
    workspace_.emplace_back(static_cast<std::size_t>(reduce->elements) *
                            static_cast<std::size_t>(reduce->groups) * sizeof(float));
    reduce->workspace = workspace_.back().as<float>();
    backward->workspace = workspace_.back().as<float>();
  }

  csa::Runtime& rt_;
  std::vector<RawLaunch> launches_;
  std::vector<csa::device::Buffer> workspace_;
};

using Clock = std::chrono::steady_clock;

struct Path {
  std::string name;
  std::function<void()> call;
  std::size_t launches = 0;  // raw paths: driver launches per call
};

struct HostTimes {
  double queued_us = 0.0;
  double idle_us = 0.0;
};

// Per path: wall-clock microseconds per call of 50 calls queued back to back (median of 31
// rounds), and of one call issued to an idle stream (median of 201). The paths take turns in
// every round, so a drift of the host's speed during the run biases none of them.
std::vector<HostTimes> time_paths(csa::Stream stream, const std::vector<Path>& paths) {
  const std::size_t n = paths.size();
  std::vector<std::vector<double>> queued(n), idle(n);
  for (const auto& p : paths)
    for (int i = 0; i < 20; ++i) p.call();  // warm
  for (int round = 0; round < 31; ++round) {
    for (std::size_t i = 0; i < n; ++i) {
      csa::device::synchronize(stream);
      const auto t0 = Clock::now();
      for (int c = 0; c < 50; ++c) paths[i].call();
      queued[i].push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count() /
                          50);
    }
  }
  for (int round = 0; round < 201; ++round) {
    for (std::size_t i = 0; i < n; ++i) {
      csa::device::synchronize(stream);
      const auto t0 = Clock::now();
      paths[i].call();
      idle[i].push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
    }
  }
  csa::device::synchronize(stream);
  std::vector<HostTimes> out(n);
  for (std::size_t i = 0; i < n; ++i) out[i] = {median(queued[i]), median(idle[i])};
  return out;
}

nlohmann::json bench_config(csa::Runtime& rt, csa::Stream stream, const csa::Config& c,
                            const char* pack, const Path& empty_kernel) {
  const csa::tools::DeviceInputs prob(csa::tools::make_inputs(c, csa::tools::parse_pack(pack), 77));
  const csa::Plan plan(rt, c, 0);
  const csa::ForwardArgs f = prob.forward();
  const csa::BackwardArgs b = prob.backward();
  auto s = reinterpret_cast<CUstream>(stream);
  const bool programmatic =
      csa::RuntimeAccess::of(rt)
          .service.record(c, csa_kernel::kLayoutThdPacked, csa::Family::kAuto, 0)
          ->programmatic;
  RawCalls raw_forward(rt, s, programmatic, [&] { plan.forward(f, stream); });
  RawCalls raw_backward(rt, s, programmatic, [&] { plan.backward(b, stream); });
  const std::vector<Path> paths = {
      empty_kernel,
      {"raw forward", [&] { raw_forward.launch(); }, raw_forward.size()},
      {"plan forward", [&] { plan.forward(f, stream); }},
      {"runtime forward", [&] { rt.forward(f, stream); }},
      {"raw backward", [&] { raw_backward.launch(); }, raw_backward.size()},
      {"plan backward", [&] { plan.backward(b, stream); }},
      {"runtime backward", [&] { rt.backward(b, stream); }}};
  const std::string label = fmt::format("{},{},{},{}", c.ratio, c.coff, c.head_dim, pack);
  const auto times = time_paths(stream, paths);
  nlohmann::json rows = nlohmann::json::array();
  for (std::size_t i = 0; i < paths.size(); ++i) {
    fmt::print("{:<20} {:<18} {:>10.2f} {:>10.2f} {:>9}\n", label, paths[i].name,
               times[i].queued_us, times[i].idle_us,
               paths[i].launches > 0 ? std::to_string(paths[i].launches) : "");
    rows.push_back({{"shape", label},
                    {"path", paths[i].name},
                    {"queued_us", times[i].queued_us},
                    {"idle_us", times[i].idle_us}});
  }
  // The plan's margin over the raw launches of the same kernels (target: <= 1 us).
  for (const char* dir : {"forward", "backward"}) {
    const auto find = [&](const std::string& name) {
      for (std::size_t i = 0; i < paths.size(); ++i)
        if (paths[i].name == name) return times[i];
      return HostTimes{};
    };
    const HostTimes raw = find(std::string("raw ") + dir);
    const HostTimes plan_t = find(std::string("plan ") + dir);
    fmt::print("{:<20} plan - raw {:<8} {:>+10.2f} {:>+10.2f}\n", label, dir,
               plan_t.queued_us - raw.queued_us, plan_t.idle_us - raw.idle_us);
  }
  return rows;
}

// The platform's floor: cuLaunchKernelEx of an empty kernel taking one int. The library
// handle stays loaded for the process.
Path empty_kernel_path(csa::Runtime& rt, csa::Stream stream) {
  const auto& d = csa::RuntimeAccess::of(rt).loader.get();
  csa::nvrtc::CompileRequest req;
  req.source = "extern \"C\" __global__ void empty_kernel(int) {}\n";
  req.source_name = "empty.cu";
  req.name_expressions = {"empty_kernel"};
  req.arch = csa::RuntimeAccess::of(rt).service.device_traits(0).arch;
  const auto compiled = csa::nvrtc::Compiler({}).compile(req);
  CUlibrary lib = nullptr;
  CUkernel kernel = nullptr;
  d.check(d.api().cuLibraryLoadData(&lib, compiled.cubin.data(), nullptr, nullptr, 0, nullptr,
                                    nullptr, 0),
          "load the empty kernel");
  d.check(d.api().cuLibraryGetKernel(&kernel, lib, compiled.lowered_names[0].c_str()),
          "get the empty kernel");
  auto config = std::make_shared<CUlaunchConfig>();
  config->gridDimX = config->gridDimY = config->gridDimZ = 1;
  config->blockDimX = 32;
  config->blockDimY = config->blockDimZ = 1;
  config->hStream = reinterpret_cast<CUstream>(stream);
  auto arg = std::make_shared<int>(0);
  return {"raw empty kernel",
          [&d, config, arg, kernel] {
            void* args[] = {arg.get()};
            d.check(d.api().cuLaunchKernelEx(config.get(), reinterpret_cast<CUfunction>(kernel),
                                             args, nullptr),
                    "empty launch");
          },
          1};
}

// The driver queries a warm backward call makes besides its launches (current context and
// device, capture status, the stream's and context's ids for the grad_ape workspace): ns per
// query, median of 31 rounds of 1000, to tell their share of the plan's margin over the raw
// launches.
nlohmann::json bench_driver_queries(csa::Runtime& rt, csa::Stream stream) {
  const auto& d = csa::RuntimeAccess::of(rt).loader.get();
  const auto& api = d.api();
  auto s = reinterpret_cast<CUstream>(stream);
  CUcontext ctx = nullptr;
  d.check(api.cuCtxGetCurrent(&ctx), "cuCtxGetCurrent");
  const std::vector<std::pair<const char*, std::function<void()>>> queries = {
      {"cuCtxGetCurrent",
       [&] {
         CUcontext c = nullptr;
         d.check(api.cuCtxGetCurrent(&c), "q");
       }},
      {"cuCtxGetDevice",
       [&] {
         CUdevice v = 0;
         d.check(api.cuCtxGetDevice(&v), "q");
       }},
      {"cuCtxGetId",
       [&] {
         unsigned long long id = 0;
         d.check(api.cuCtxGetId(ctx, &id), "q");
       }},
      {"cuStreamIsCapturing",
       [&] {
         CUstreamCaptureStatus st{};
         d.check(api.cuStreamIsCapturing(s, &st), "q");
       }},
      {"cuStreamGetId", [&] {
         unsigned long long id = 0;
         d.check(api.cuStreamGetId(s, &id), "q");
       }}};
  std::vector<std::vector<double>> ns(queries.size());
  for (int round = 0; round < 31; ++round)
    for (std::size_t i = 0; i < queries.size(); ++i) {
      const auto t0 = Clock::now();
      for (int c = 0; c < 1000; ++c) queries[i].second();
      ns[i].push_back(std::chrono::duration<double, std::nano>(Clock::now() - t0).count() / 1000);
    }
  nlohmann::json out = nlohmann::json::object();
  fmt::print("driver query ns per call (median of 31 x 1000):");
  for (std::size_t i = 0; i < queries.size(); ++i) {
    out[queries[i].first] = median(ns[i]);
    fmt::print(" {} {:.0f};", queries[i].first, median(ns[i]));
  }
  fmt::print("\n");
  return out;
}

nlohmann::json bench_graph(csa::Runtime& rt, csa::Stream stream, const csa::Config& c,
                           const char* pack) {
  const csa::tools::DeviceInputs prob(csa::tools::make_inputs(c, csa::tools::parse_pack(pack), 77));
  const csa::Plan plan(rt, c, 0);
  const csa::ForwardArgs f = prob.forward();
  const csa::BackwardArgs b = prob.backward();
  const int reps = 31, calls = 20;
  const double fwd =
      csa::tools::time_graph(stream, reps, calls, [&](int) { plan.forward(f, stream); });
  const double bwd =
      csa::tools::time_graph(stream, reps, calls, [&](int) { plan.backward(b, stream); });
  csa::device::Graph step(stream, [&] {
    plan.forward(f, stream);
    plan.backward(b, stream);
  });
  step.launch(stream);
  csa::device::synchronize(stream);
  const double replay =
      csa::tools::time_device(stream, reps, calls, [&](int) { step.launch(stream); });
  const double ratio = replay / (fwd + bwd);
  fmt::print(
      "graph {},{},{},{}: forward {:.2f} us + backward {:.2f} us = {:.2f} us; replay of "
      "forward + backward {:.2f} us per step; ratio {:.3f} (target <= 1.2: {})\n",
      c.ratio, c.coff, c.head_dim, pack, fwd, bwd, fwd + bwd, replay, ratio,
      ratio <= 1.2 ? "yes" : "NO");
  return {{"shape", fmt::format("{},{},{},{}", c.ratio, c.coff, c.head_dim, pack)},
          {"forward_us", fwd},
          {"backward_us", bwd},
          {"replay_us", replay},
          {"ratio", ratio}};
}

}  // namespace

int main(int argc, char** argv) try {
  csa::Runtime rt;
  if (!rt.driver_info().available || rt.driver_info().devices.empty()) {
    std::printf("csa_launch_bench: no GPU (%s)\n", rt.driver_info().reason.c_str());
    return 0;
  }
  csa::device::make_current(0);
  const csa::DeviceInfo dev = csa::device::current_device();
  csa::device::StreamHandle stream;
  fmt::print(
      "device: {} ({} SMs); programmatic dependent launch {}\n", dev.name, dev.sm_count,
      csa::RuntimeAccess::of(rt)
              .service.record({4, 128, 2}, csa_kernel::kLayoutThdPacked, csa::Family::kAuto, 0)
              ->programmatic
          ? "on (the raw launches ask for it too)"
          : "off");
  fmt::print(
      "host us per call: queued = 50 calls back to back on one stream, per call (median of "
      "31); idle = one call on an idle stream (median of 201); raw = cuLaunchKernelEx of "
      "the same kernels and argument blocks; the paths take turns in every round\n");
  fmt::print("{:<20} {:<18} {:>10} {:>10} {:>9}\n", "shape (r,c,d,pack)", "path", "queued", "idle",
             "launches");
  nlohmann::json report = {{"device", dev.name}};
  report["host"] = nlohmann::json::array();
  const Path empty = empty_kernel_path(rt, stream.get());
  for (const auto& [config, pack] :
       {std::pair{csa::Config{4, 128, 2}, "1x8192"}, std::pair{csa::Config{128, 512, 1}, "1x4096"}})
    for (auto& row : bench_config(rt, stream.get(), config, pack, empty))
      report["host"].push_back(row);
  report["driver_queries_ns"] = bench_driver_queries(rt, stream.get());
  report["graph"] = bench_graph(rt, stream.get(), {4, 128, 2}, "1x8192");
  if (argc > 1) {
    std::ofstream(argv[1]) << report.dump(2) << "\n";
    fmt::print("wrote {}\n", argv[1]);
  }
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "csa_launch_bench: %s\n", e.what());
  return 1;
}
