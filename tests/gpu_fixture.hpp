// The GPU test fixture shared by the GPU test files: one Runtime for the process (skipped with
// the reason when there is no driver or device), packs, and a problem on the device whose
// output buffers are poisoned before every run.
#pragma once

#include <gtest/gtest.h>

#include <future>

#include "bench_data.hpp"
#include "csa/testing/device.hpp"
#include "test_util.hpp"

namespace csa::test {

inline Runtime* g_runtime = nullptr;
inline std::string g_skip;

// The current device's arch as the schedule tables name it ("sm_90").
inline std::string device_arch() {
  const DeviceInfo d = device::current_device();
  return "sm_" + std::to_string(d.cc_major) + std::to_string(d.cc_minor);
}

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

// The test problem as the benchmark's host inputs (same tensors and capacities), so that the
// device buffers and the call arguments over them come from one place (tools/bench_data).
inline tools::HostInputs host_inputs(const Problem& p) {
  tools::HostInputs h;
  h.config = p.config;
  h.cu = p.cu;
  h.cuc = p.cuc;
  h.total_tokens = p.total_tokens;
  h.total_comp = p.total_comp;
  h.kv = p.kv;
  h.score = p.score;
  h.grad_out = p.grad_out;
  h.ape = p.ape;
  return h;
}

// A problem on the device. Output buffers are poisoned before each run.
struct DeviceProblem {
  explicit DeviceProblem(const Problem& p) : device(host_inputs(p)) {}

  ForwardArgs forward_args() const { return device.forward(); }
  BackwardArgs backward_args(std::uint32_t flags) const { return device.backward(flags); }

  std::vector<std::uint16_t> forward(Family family) {
    device.out.fill(0xff);
    g_runtime->forward(forward_args(), nullptr, family);
    device::synchronize(nullptr);
    return tools::DeviceInputs::download16(device.out);
  }

  struct Grads {
    std::vector<std::uint16_t> kv, score;
    std::vector<float> ape;
  };
  // `poison`: byte written to grad_kv / grad_score first; `ape_preset`: grad_ape before the call.
  Grads backward(Family family, std::uint32_t flags, std::uint8_t poison,
                 const std::vector<float>& ape_preset) {
    device.grad_kv.fill(poison);
    device.grad_score.fill(poison);
    device.grad_ape.upload(ape_preset.data(), device.grad_ape.size());
    g_runtime->backward(backward_args(flags), nullptr, family);
    device::synchronize(nullptr);
    Grads g;
    g.kv = tools::DeviceInputs::download16(device.grad_kv);
    g.score = tools::DeviceInputs::download16(device.grad_score);
    g.ape.resize(device.in.ape.size());
    device.grad_ape.download(g.ape.data(), device.grad_ape.size());
    return g;
  }

  tools::DeviceInputs device;  // the host inputs, uploaded; outputs allocated
};

inline std::vector<float> nan_ape(const Problem& p) {
  return std::vector<float>(p.ape.size(), std::nanf(""));
}

// out restricted to its distinct rows. Padding rows all repeat block 0 from token 0 (checked
// bitwise), so a difference there would otherwise be counted once per padding row by the
// tolerance contract: the first padding row stands for them all, and none is kept when valid
// row 0 is that same window (the first segment starts at token 0 and has a row; then the
// padding rows are checked bitwise equal to row 0).
inline std::vector<std::uint16_t> distinct_out_rows(const std::vector<std::uint16_t>& out,
                                                    const Problem& p) {
  const auto d = static_cast<std::size_t>(p.config.head_dim);
  const auto valid = static_cast<std::size_t>(p.cuc.back());
  const auto total = static_cast<std::size_t>(p.total_comp);
  const bool row0_is_padding_window = p.cu[0] == 0 && p.cuc.size() > 1 && p.cuc[1] > 0;
  const std::size_t model = row0_is_padding_window ? 0 : valid;
  for (std::size_t row = valid; row < total; ++row) {
    EXPECT_TRUE(
        std::equal(out.begin() + row * d, out.begin() + (row + 1) * d, out.begin() + model * d))
        << "padding row " << row << " differs from row " << model;
  }
  const std::size_t rows = row0_is_padding_window ? valid : std::min(total, valid + 1);
  return std::vector<std::uint16_t>(out.begin(), out.begin() + rows * d);
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
    device::make_current(0);
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
