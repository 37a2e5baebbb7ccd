// Host cost of the driver calls on the launch path, measured on the device (not a test):
// median nanoseconds per call over many calls. Guides what the hot path may afford.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "api/runtime_impl.hpp"
#include "csa/device.hpp"

namespace {

double median_ns(int reps, int calls, const std::function<void()>& fn) {
  std::vector<double> samples;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < calls; ++i) fn();
    const auto t1 = std::chrono::steady_clock::now();
    samples.push_back(std::chrono::duration<double, std::nano>(t1 - t0).count() / calls);
  }
  std::sort(samples.begin(), samples.end());
  return samples[samples.size() / 2];
}

}  // namespace

int main() {
  csa::Runtime rt;
  if (!rt.driver_info().available) {
    std::printf("no driver\n");
    return 0;
  }
  csa::device::make_current(rt, 0);
  csa::device::StreamHandle stream(rt);
  auto& d = rt.impl().loader.get();
  const auto& api = d.api();
  auto s = reinterpret_cast<CUstream>(stream.get());
  CUcontext ctx = nullptr;
  CUdevice dev = 0;
  unsigned long long id = 0;
  CUstreamCaptureStatus status{};
  const csa::Config config{4, 128, 2};
  rt.prewarm(config, 0);
  auto report = [](const char* what, double ns) { std::printf("%-28s %8.0f ns\n", what, ns); };
  report("cuCtxGetCurrent", median_ns(9, 1000, [&] { api.cuCtxGetCurrent(&ctx); }));
  report("cuCtxGetDevice", median_ns(9, 1000, [&] { api.cuCtxGetDevice(&dev); }));
  report("cuCtxGetId", median_ns(9, 1000, [&] { api.cuCtxGetId(ctx, &id); }));
  report("cuStreamGetId", median_ns(9, 1000, [&] { api.cuStreamGetId(s, &id); }));
  report("cuStreamIsCapturing", median_ns(9, 1000, [&] { api.cuStreamIsCapturing(s, &status); }));
  // Raw launches of an empty kernel: through the CUkernel handle and through the per-context
  // CUfunction, the floor of any launch path.
  csa::nvrtc::Compiler compiler({});
  csa::nvrtc::CompileRequest req;
  req.source = "extern \"C\" __global__ void empty_kernel(int) {}\n";
  req.source_name = "empty.cu";
  req.name_expressions = {"empty_kernel"};
  req.arch = rt.impl().service.device_traits(0).arch;
  const auto compiled = compiler.compile(req);
  CUlibrary lib = nullptr;
  CUkernel kernel = nullptr;
  CUfunction function = nullptr;
  d.check(
      api.cuLibraryLoadData(&lib, compiled.cubin.data(), nullptr, nullptr, 0, nullptr, nullptr, 0),
      "load");
  d.check(api.cuLibraryGetKernel(&kernel, lib, compiled.lowered_names[0].c_str()), "get kernel");
  d.check(api.cuKernelGetFunction(&function, kernel), "get function");
  int arg = 0;
  void* args[] = {&arg};
  CUlaunchConfig cfg{};
  cfg.gridDimX = cfg.gridDimY = cfg.gridDimZ = 1;
  cfg.blockDimX = 32;
  cfg.blockDimY = cfg.blockDimZ = 1;
  cfg.hStream = s;
  report("cuLaunchKernelEx CUkernel", median_ns(25, 20, [&] {
           api.cuLaunchKernelEx(&cfg, reinterpret_cast<CUfunction>(kernel), args, nullptr);
         }));
  stream.synchronize();
  report("cuLaunchKernelEx CUfunction",
         median_ns(25, 20, [&] { api.cuLaunchKernelEx(&cfg, function, args, nullptr); }));
  stream.synchronize();
  csa::device::Buffer buf(rt, 1 << 20);
  report("cuMemsetD32Async 16KB", median_ns(9, 20, [&] {
           api.cuMemsetD32Async(reinterpret_cast<CUdeviceptr>(buf.get()), 0, 4096, s);
         }));
  stream.synchronize();
  // A real launch through the library (forward, total_comp = 0 rows would skip the launch).
  std::vector<std::int32_t> cu = {0, 64}, cuc = {0, 16};
  csa::device::Buffer kv(rt, 64 * 256 * 2), ape(rt, 4 * 256 * 4), out(rt, 16 * 128 * 2),
      offs(rt, 16);
  offs.upload(cu.data(), 8);
  offs.upload(cuc.data(), 8, 8);
  csa::ForwardArgs f;
  f.kv = kv.get();
  f.score = kv.get();
  f.ape = ape.as<float>();
  f.cu_seqlens = offs.as<std::int32_t>();
  f.cu_seqlens_comp = offs.as<std::int32_t>() + 2;
  f.out = out.get();
  f.total_tokens = 64;
  f.num_segments = 1;
  f.total_comp = 16;
  f.config = config;
  rt.forward(f, stream.get());
  stream.synchronize();
  report("csa forward (one launch)", median_ns(25, 20, [&] { rt.forward(f, stream.get()); }));
  stream.synchronize();
  csa::device::Buffer grads(rt, 2 * 64 * 256 * 2 + 4 * 256 * 4);
  csa::BackwardArgs b;
  b.kv = kv.get();
  b.score = kv.get();
  b.ape = ape.as<float>();
  b.cu_seqlens = f.cu_seqlens;
  b.cu_seqlens_comp = f.cu_seqlens_comp;
  b.grad_out = out.get();
  b.grad_kv = grads.get();
  b.grad_score = static_cast<char*>(grads.get()) + 64 * 256 * 2;
  b.grad_ape = reinterpret_cast<float*>(static_cast<char*>(grads.get()) + 2 * 64 * 256 * 2);
  b.total_tokens = 64;
  b.num_segments = 1;
  b.total_comp = 16;
  b.config = config;
  rt.backward(b, stream.get());
  stream.synchronize();
  report("csa backward (fixed order)", median_ns(25, 20, [&] { rt.backward(b, stream.get()); }));
  stream.synchronize();
  // The same calls, each issued to an idle stream (synchronised first, outside the timing).
  auto idle = [&](const char* what, const std::function<void()>& fn) {
    std::vector<double> t;
    for (int i = 0; i < 101; ++i) {
      stream.synchronize();
      const auto t0 = std::chrono::steady_clock::now();
      fn();
      t.push_back(
          std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count());
    }
    std::sort(t.begin(), t.end());
    report(what, t[t.size() / 2]);
  };
  idle("idle: cuLaunchKernelEx", [&] { api.cuLaunchKernelEx(&cfg, function, args, nullptr); });
  idle("idle: 2x cuLaunchKernelEx", [&] {
    api.cuLaunchKernelEx(&cfg, function, args, nullptr);
    api.cuLaunchKernelEx(&cfg, function, args, nullptr);
  });
  idle("idle: csa forward", [&] { rt.forward(f, stream.get()); });
  idle("idle: csa backward fixed", [&] { rt.backward(b, stream.get()); });
  b.config = {4, 512, 2};
  rt.prewarm(b.config, 0);
  csa::device::Buffer big(rt, 3 * 64 * 1024 * 2 + 4 * 1024 * 4 + 16 * 512 * 2);
  b.kv = b.score = big.get();
  b.grad_kv = b.grad_score = big.get();
  b.grad_out = big.get();
  b.grad_ape = reinterpret_cast<float*>(static_cast<char*>(big.get()) + 3 * 64 * 1024 * 2);
  b.ape = b.grad_ape;
  rt.backward(b, stream.get());
  idle("idle: csa backward atomic", [&] { rt.backward(b, stream.get()); });
  b.flags = csa::kDeterministic;
  rt.backward(b, stream.get());
  idle("idle: csa backward det", [&] { rt.backward(b, stream.get()); });
  stream.synchronize();
  return 0;
}
