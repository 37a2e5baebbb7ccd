// A fake driver table for the launch-path tests (no GPU): entry points that count what they
// are asked, a Runtime built around them, call arguments with aligned fake pointers, and the
// test fixture that resets the counters.
#pragma once

#include <gtest/gtest.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "api/runtime_impl.hpp"

namespace csa::test {

// NOTE: the fake entry points are plain functions (the driver ABI), so their state is global;
// every test resets it through the FakeDriver fixture.
struct FakeState {
  std::atomic<bool> capturing{false};
  std::atomic<int> library_loads{0};
  std::atomic<int> refused_loads{0};  // images that are not ELF cubins
  std::atomic<int> launches{0};
  std::atomic<int> allocations{0};  // on callers' streams
  std::atomic<int> memsets{0};      // on callers' streams
  // The runtime's own stream (claim words for captured calls): slabs allocated and zeroed on
  // it, and whether every stream it created was destroyed.
  std::atomic<int> slab_allocations{0};
  std::atomic<int> slab_memsets{0};
  std::atomic<int> own_streams_open{0};
  std::atomic<int> attribute_queries{0};
  std::atomic<int> context_id_queries{0};
  std::atomic<int> current_device{0};  // device 0: sm_90, 132 SMs; device 1: sm_80, 108 SMs
  std::mutex mutex;
  std::vector<unsigned> last_grid;           // x, y, block x, block y of the last launch
  std::vector<std::vector<unsigned>> grids;  // every launch's, in order
  bool last_programmatic = false;            // the last launch asked for programmatic serialization
  std::vector<std::string> kernel_names;     // lowered names, by handle (0x3000 + 16 * index)
  std::vector<std::string> launched;         // every launch's kernel name, in order
  // Every grad_ape reduction launch's ApeReduceParams::dependents_first, with its grid.
  std::vector<int> reduce_dependents_first;
  std::vector<std::vector<unsigned>> reduce_grids;
  // Every launch of a kernel taking BackwardParams (a backward, tail_row_stats): its
  // row_stats and workspace pointers and whether it asked for programmatic serialization.
  struct BackwardLaunch {
    std::string kernel;
    std::uintptr_t row_stats = 0;
    std::uintptr_t workspace = 0;
    bool programmatic = false;
  };
  std::vector<BackwardLaunch> backward_launches;
};
FakeState& state();

// The fake entry points as a driver table.
driver::Api fake_api();

// A Runtime's parts around the fake driver; the kernels are really compiled (NVRTC needs no
// GPU) and kept in memory.
struct FakeRuntime : Runtime::Impl {
  explicit FakeRuntime(bool jit = true) : FakeRuntime(options(jit)) {}
  explicit FakeRuntime(RuntimeOptions o)
      : Runtime::Impl(std::move(o), std::make_unique<driver::Driver>(fake_api())) {}
  static RuntimeOptions options(bool jit) {
    RuntimeOptions o;
    o.disk_cache = false;
    o.jit_enabled = jit;
    o.log_level = "off";
    return o;
  }
};

// Aligned, never dereferenced (the fake launch does not run kernels).
template <typename T>
T* fake_ptr(std::uintptr_t address) {
  return reinterpret_cast<T*>(address);
}

ForwardArgs forward_args(const Config& c);
// With config.tail, also its tensors (and the pooled rows where the call keeps them).
BackwardArgs backward_args(const Config& c, std::uint32_t flags = 0);

class FakeDriver : public ::testing::Test {
 protected:
  void SetUp() override {
    state().capturing = false;
    state().library_loads = 0;
    state().refused_loads = 0;
    state().launches = 0;
    state().allocations = 0;
    state().memsets = 0;
    state().slab_allocations = 0;
    state().slab_memsets = 0;
    state().own_streams_open = 0;
    state().attribute_queries = 0;
    state().context_id_queries = 0;
    state().current_device = 0;
    std::lock_guard<std::mutex> lock(state().mutex);
    state().grids.clear();
    state().launched.clear();
    state().reduce_dependents_first.clear();
    state().reduce_grids.clear();
    state().backward_launches.clear();
  }
};

// A short-window and a long-window configuration, and a caller's stream.
inline const Config kShort{4, 64, 2};
inline const Config kLong{128, 64, 1};
inline auto* const kStream = reinterpret_cast<CUstream>(0x5000);

}  // namespace csa::test
