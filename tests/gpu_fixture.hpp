// The GPU test fixture shared by the GPU test files: one Runtime for the process (skipped with
// the reason when there is no driver or device), packs, and a problem on the device whose
// output buffers are poisoned before every run.
#pragma once

#include <gtest/gtest.h>

#include <future>

#include "csa/device.hpp"
#include "test_util.hpp"

namespace csa::test {

inline Runtime* g_runtime = nullptr;
inline std::string g_skip;

struct Pack {
  const char* name;
  std::vector<std::int32_t> lens;
};

inline const std::vector<Pack>& packs() {
  static const std::vector<Pack> p = {{"single", {8192}},
                                      {"ragged", {1023, 2048, 509}},
                                      {"short", {3, 515, 1024, 129}},
                                      {"empty-segment", {64, 0, 253, 3}},
                                      {"all-tiny", {5, 6, 7}}};
  return p;
}

constexpr std::int64_t kExtraRows = 8;
constexpr std::int64_t kExtraTokens = 21;

// A problem on the device. Output buffers are poisoned before each run.
struct DeviceProblem {
  explicit DeviceProblem(const Problem& p)
      : host(p),
        kv(*g_runtime, bytes16(p.token_elems())),
        score(*g_runtime, bytes16(p.token_elems())),
        ape(*g_runtime, p.ape.size() * 4),
        cu(*g_runtime, p.cu.size() * 4),
        cuc(*g_runtime, p.cuc.size() * 4),
        out(*g_runtime, bytes16(p.comp_elems())),
        grad_out(*g_runtime, bytes16(p.comp_elems())),
        grad_kv(*g_runtime, bytes16(p.token_elems())),
        grad_score(*g_runtime, bytes16(p.token_elems())),
        grad_ape(*g_runtime, p.ape.size() * 4) {
    kv.upload(p.kv.data(), kv.size());
    score.upload(p.score.data(), score.size());
    ape.upload(p.ape.data(), ape.size());
    cu.upload(p.cu.data(), cu.size());
    cuc.upload(p.cuc.data(), cuc.size());
    grad_out.upload(p.grad_out.data(), grad_out.size());
  }
  static std::size_t bytes16(std::int64_t n) { return static_cast<std::size_t>(n) * 2; }

  ForwardArgs forward_args() const {
    ForwardArgs a;
    a.kv = kv.get();
    a.score = score.get();
    a.ape = ape.as<float>();
    a.cu_seqlens = cu.as<std::int32_t>();
    a.cu_seqlens_comp = cuc.as<std::int32_t>();
    a.out = out.get();
    a.total_tokens = host.total_tokens;
    a.num_segments = host.segments();
    a.total_comp = host.total_comp;
    a.config = host.config;
    return a;
  }
  BackwardArgs backward_args(std::uint32_t flags) const {
    BackwardArgs a;
    a.kv = kv.get();
    a.score = score.get();
    a.ape = ape.as<float>();
    a.cu_seqlens = cu.as<std::int32_t>();
    a.cu_seqlens_comp = cuc.as<std::int32_t>();
    a.grad_out = grad_out.get();
    a.grad_kv = grad_kv.get();
    a.grad_score = grad_score.get();
    a.grad_ape = grad_ape.as<float>();
    a.total_tokens = host.total_tokens;
    a.num_segments = host.segments();
    a.total_comp = host.total_comp;
    a.config = host.config;
    a.flags = flags;
    return a;
  }

  std::vector<std::uint16_t> forward(Family family) {
    out.fill(0xff);
    g_runtime->forward(forward_args(), nullptr, family);
    device::synchronize(*g_runtime, nullptr);
    std::vector<std::uint16_t> h(static_cast<std::size_t>(host.comp_elems()));
    out.download(h.data(), out.size());
    return h;
  }

  struct Grads {
    std::vector<std::uint16_t> kv, score;
    std::vector<float> ape;
  };
  // `poison`: byte written to grad_kv / grad_score first; `ape_preset`: grad_ape before the call.
  Grads backward(Family family, std::uint32_t flags, std::uint8_t poison,
                 const std::vector<float>& ape_preset) {
    grad_kv.fill(poison);
    grad_score.fill(poison);
    grad_ape.upload(ape_preset.data(), grad_ape.size());
    g_runtime->backward(backward_args(flags), nullptr, family);
    device::synchronize(*g_runtime, nullptr);
    Grads g;
    g.kv.resize(static_cast<std::size_t>(host.token_elems()));
    g.score.resize(g.kv.size());
    g.ape.resize(host.ape.size());
    grad_kv.download(g.kv.data(), grad_kv.size());
    grad_score.download(g.score.data(), grad_score.size());
    grad_ape.download(g.ape.data(), grad_ape.size());
    return g;
  }

  Problem host;
  device::Buffer kv, score, ape, cu, cuc, out, grad_out, grad_kv, grad_score, grad_ape;
};

inline std::vector<float> nan_ape(const Problem& p) {
  return std::vector<float>(p.ape.size(), std::nanf(""));
}

class GpuEnvironment : public ::testing::Environment {
 public:
  void SetUp() override {
    g_runtime = new Runtime(RuntimeOptions::from_environment());
    const DriverInfo info = g_runtime->driver_info();
    if (!info.available) {
      g_skip = "no usable CUDA driver: " + info.reason;
    } else if (info.devices.empty()) {
      g_skip = "the CUDA driver reports no device";
    }
  }
  void TearDown() override {
    delete g_runtime;
    g_runtime = nullptr;
  }
};

class Gpu : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!g_skip.empty()) GTEST_SKIP() << g_skip;
    device::make_current(*g_runtime, 0);
  }
};

// The CPU fp32 reference and the fp64 oracle of one problem, computed in the background while
// the GPU runs.
struct CpuReferences {
  struct Grads {
    std::vector<std::uint16_t> kv, score;
    std::vector<float> ape;
  };
  struct Oracle {
    std::vector<double> kv, score, ape;
  };
  std::future<std::vector<std::uint16_t>> forward;
  std::future<std::vector<double>> forward64;
  std::future<Grads> backward;
  std::future<Oracle> backward64;

  // `p` must outlive the futures.
  static CpuReferences start(const Problem& p) {
    CpuReferences r;
    const auto tokens = static_cast<std::size_t>(p.token_elems());
    r.forward = std::async(std::launch::async, [&p] {
      std::vector<std::uint16_t> out(static_cast<std::size_t>(p.comp_elems()));
      reference::forward_fp32(p.host(), out.data());
      return out;
    });
    r.forward64 = std::async(std::launch::async, [&p] {
      std::vector<double> out(static_cast<std::size_t>(p.comp_elems()));
      reference::forward_fp64(p.host(), out.data());
      return out;
    });
    r.backward = std::async(std::launch::async, [&p, tokens] {
      Grads g{std::vector<std::uint16_t>(tokens), std::vector<std::uint16_t>(tokens),
              std::vector<float>(p.ape.size())};
      reference::backward_fp32(p.host(), p.grad_out.data(), g.kv.data(), g.score.data(),
                               g.ape.data());
      return g;
    });
    r.backward64 = std::async(std::launch::async, [&p, tokens] {
      Oracle o{std::vector<double>(tokens), std::vector<double>(tokens),
               std::vector<double>(p.ape.size())};
      reference::backward_fp64(p.host(), p.grad_out.data(), o.kv.data(), o.score.data(),
                               o.ape.data());
      return o;
    });
    return r;
  }
};

}  // namespace csa::test
