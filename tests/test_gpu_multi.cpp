// One process on two GPUs: forward and backward of several configurations alternating between
// devices and streams from several threads, plans and CUDA graphs on each device, every result
// bitwise equal to the one-GPU run; each device has records of its own; a plan used on the
// wrong device is refused. Skipped with fewer than two GPUs.
#include <atomic>
#include <thread>

#include "csa_params.h"
#include "api/runtime_impl.hpp"
#include "gpu_fixture.hpp"

namespace csa::test {
namespace {

const std::vector<Config> kConfigs = {{4, 128, 2}, {128, 512, 1}, {2, 65, 1}, {16, 64, 2}};

struct Outputs {
  std::vector<std::uint16_t> out, grad_kv, grad_score;
  std::vector<float> grad_ape;
  bool operator==(const Outputs& o) const {
    return out == o.out && grad_kv == o.grad_kv && grad_score == o.grad_score &&
           std::memcmp(grad_ape.data(), o.grad_ape.data(), grad_ape.size() * 4) == 0;
  }
};

// One problem's buffers on one device, run on one stream (deterministic backward: every
// output bitwise reproducible).
struct OnDevice {
  OnDevice(const Problem& p, int device) : ordinal(device), data(upload(p, device)) {}
  static tools::DeviceInputs upload(const Problem& p, int device) {
    device::make_current(device);
    return tools::DeviceInputs(host_inputs(p));
  }
  Outputs run(Runtime& rt, Stream stream) {
    data.out.fill(0xff);
    data.grad_kv.fill(0xff);
    data.grad_score.fill(0xff);
    rt.forward(data.forward(), stream);
    rt.backward(data.backward(kDeterministic), stream);
    device::synchronize(stream);
    return download();
  }
  Outputs download() const {
    Outputs o{
        tools::DeviceInputs::download16(data.out), tools::DeviceInputs::download16(data.grad_kv),
        tools::DeviceInputs::download16(data.grad_score), std::vector<float>(data.in.ape.size())};
    data.grad_ape.download(o.grad_ape.data(), data.grad_ape.size());
    return o;
  }
  int ordinal;
  tools::DeviceInputs data;
};

class MultiGpu : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!g_skip.empty()) GTEST_SKIP() << g_skip;
    const auto devices = g_runtime->driver_info().devices.size();
    if (devices < 2) GTEST_SKIP() << "needs two GPUs (this machine has " << devices << ")";
    for (const Config& c : kConfigs) {
      problems.push_back(make_problem(c, {1023, 0, 2048, 509, 3}, kExtraTokens, kExtraRows,
                                      base_seed() + static_cast<std::uint64_t>(c.ratio)));
    }
    // The one-GPU run: device 0, the legacy stream, one thread.
    for (const Problem& p : problems) {
      OnDevice d(p, 0);
      expected.push_back(d.run(*g_runtime, nullptr));
    }
  }
  std::vector<Problem> problems;
  std::vector<Outputs> expected;
};

TEST_F(MultiGpu, ThreadsAlternatingDevicesAndStreamsMatchTheOneGpuRun) {
  constexpr int kThreads = 4;
  constexpr int kRounds = 6;
  std::atomic<int> mismatches{0};
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      try {
        // Each thread: its own buffers and stream on both devices.
        std::vector<std::unique_ptr<OnDevice>> data[2];
        std::unique_ptr<device::StreamHandle> streams[2];
        for (int d = 0; d < 2; ++d) {
          for (const Problem& p : problems) data[d].push_back(std::make_unique<OnDevice>(p, d));
          device::make_current(d);
          streams[d] = std::make_unique<device::StreamHandle>();
        }
        for (int r = 0; r < kRounds; ++r) {
          const int d = (t + r) % 2;
          device::make_current(d);
          for (std::size_t i = 0; i < problems.size(); ++i) {
            if (!(data[d][i]->run(*g_runtime, streams[d]->get()) == expected[i])) ++mismatches;
          }
        }
      } catch (const std::exception& e) {
        ADD_FAILURE() << "thread " << t << ": " << e.what();
        ++failures;
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(mismatches.load(), 0) << "a result on device 1 or from a thread differs from the "
                                     "one-GPU run; seed "
                                  << base_seed();
}

TEST_F(MultiGpu, PlansAndGraphsOnEachDeviceReplayTheOneGpuResults) {
  for (int d = 0; d < 2; ++d) {
    for (std::size_t i = 0; i < problems.size(); ++i) {
      OnDevice data(problems[i], d);
      const Plan plan(*g_runtime, problems[i].config, d);
      device::make_current(d);
      device::StreamHandle stream;
      device::Graph graph(stream.get(), [&] {
        plan.forward(data.data.forward(), stream.get());
        plan.backward(data.data.backward(kDeterministic), stream.get());
      });
      data.data.out.fill(0xff);
      data.data.grad_kv.fill(0xff);
      data.data.grad_score.fill(0xff);
      graph.launch(stream.get());
      stream.synchronize();
      EXPECT_TRUE(data.download() == expected[i])
          << "device " << d << ", " << problems[i].describe();
    }
  }
}

TEST_F(MultiGpu, EachDeviceHasItsOwnRecordsAndAPlanIsBoundToItsDevice) {
  auto& service = RuntimeAccess::of(*g_runtime).service;
  for (const Config& c : kConfigs) {
    const auto on0 = service.record(c, csa_kernel::kLayoutThdPacked, Family::kAuto, 0);
    const auto on1 = service.record(c, csa_kernel::kLayoutThdPacked, Family::kAuto, 1);
    EXPECT_NE(on0.get(), on1.get());
    EXPECT_EQ(on0->device.ordinal, 0);
    EXPECT_EQ(on1->device.ordinal, 1);
    EXPECT_EQ(on0->key, on1->key) << "one cubin (a context-independent library) serves both";
  }
  OnDevice data(problems[0], 0);
  const Plan plan(*g_runtime, problems[0].config, 1);
  device::make_current(0);
  try {
    plan.forward(data.data.forward(), nullptr);
    FAIL() << "a plan of device 1 ran on device 0";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Status::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("prepared for device 1"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace csa::test
