// The launch path against an injected fake driver table (no GPU): capture guards for cold and
// warm configurations, the prepared-record cache (one module load per configuration), launch
// counts per call, and many threads calling at once.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <mutex>
#include <string>
#include <thread>

#include "api/runtime_impl.hpp"
#include "csa_params.h"
#include "schedule/short_window.hpp"
#include "schedule/table.hpp"

namespace csa::test {
namespace {

// NOTE: the fake entry points are plain functions (the driver ABI), so their state is global;
// every test resets it through FakeDriverTest.
struct FakeState {
  std::atomic<bool> capturing{false};
  std::atomic<int> library_loads{0};
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
};
FakeState& state() {
  static FakeState s;
  return s;
}

CUresult CUDAAPI fake_ctx_get_current(CUcontext* ctx) {
  *ctx = reinterpret_cast<CUcontext>(static_cast<std::uintptr_t>(0x1000 + state().current_device));
  return CUDA_SUCCESS;
}
CUresult CUDAAPI fake_ctx_get_device(CUdevice* dev) {
  *dev = state().current_device;
  return CUDA_SUCCESS;
}
CUresult CUDAAPI fake_device_get_count(int* n) {
  *n = 2;
  return CUDA_SUCCESS;
}
CUresult CUDAAPI fake_device_get(CUdevice* dev, int ordinal) {
  *dev = ordinal;
  return CUDA_SUCCESS;
}
CUresult CUDAAPI fake_device_get_attribute(int* value, CUdevice_attribute attr, CUdevice dev) {
  switch (attr) {
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR:
      *value = dev == 0 ? 9 : 8;
      break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR:
      *value = 0;
      break;
    case CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT:
      *value = dev == 0 ? 132 : 108;
      break;
    case CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_MULTIPROCESSOR:
      *value = 65536;
      break;
    case CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR:
      *value = 2048;
      break;
    case CU_DEVICE_ATTRIBUTE_MAX_BLOCKS_PER_MULTIPROCESSOR:
      *value = 32;
      break;
    case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR:
      *value = 233472;
      break;
    default:
      *value = 0;
  }
  return CUDA_SUCCESS;
}
CUresult CUDAAPI fake_stream_is_capturing(CUstream, CUstreamCaptureStatus* status) {
  *status = state().capturing ? CU_STREAM_CAPTURE_STATUS_ACTIVE : CU_STREAM_CAPTURE_STATUS_NONE;
  return CUDA_SUCCESS;
}
CUresult CUDAAPI fake_library_load_data(CUlibrary* lib, const void*, CUjit_option*, void**,
                                        unsigned, CUlibraryOption*, void**, unsigned) {
  ++state().library_loads;
  *lib = reinterpret_cast<CUlibrary>(0x2000);
  return CUDA_SUCCESS;
}
CUresult CUDAAPI fake_library_unload(CUlibrary) {
  return CUDA_SUCCESS;
}
CUresult CUDAAPI fake_library_get_kernel(CUkernel* kernel, CUlibrary, const char* name) {
  std::lock_guard<std::mutex> lock(state().mutex);
  auto& names = state().kernel_names;
  auto it = std::find(names.begin(), names.end(), name);
  if (it == names.end()) it = names.insert(names.end(), name);
  *kernel =
      reinterpret_cast<CUkernel>(0x3000 + 16 * static_cast<std::uintptr_t>(it - names.begin()));
  return CUDA_SUCCESS;
}
CUresult CUDAAPI fake_kernel_get_attribute(int* value, CUfunction_attribute attr, CUkernel,
                                           CUdevice) {
  ++state().attribute_queries;
  *value = attr == CU_FUNC_ATTRIBUTE_NUM_REGS ? 64 : 0;
  return CUDA_SUCCESS;
}
CUresult CUDAAPI fake_kernel_set_attribute(CUfunction_attribute, int, CUkernel, CUdevice) {
  return CUDA_SUCCESS;
}
CUresult CUDAAPI fake_launch(const CUlaunchConfig* config, CUfunction f, void** params, void**) {
  ++state().launches;
  std::lock_guard<std::mutex> lock(state().mutex);
  const auto index = (reinterpret_cast<std::uintptr_t>(f) - 0x3000) / 16;
  state().launched.push_back(index < state().kernel_names.size() ? state().kernel_names[index]
                                                                 : "?");
  state().last_grid = {config->gridDimX, config->gridDimY, config->blockDimX, config->blockDimY};
  state().grids.push_back(state().last_grid);
  // Every kernel takes one by-value parameter struct.
  if (state().launched.back().find("ape_reduce") != std::string::npos) {
    const auto* reduce = static_cast<const csa_kernel::ApeReduceParams*>(params[0]);
    state().reduce_dependents_first.push_back(reduce->dependents_first);
    state().reduce_grids.push_back(state().last_grid);
  }
  state().last_programmatic =
      config->numAttrs == 1 &&
      config->attrs[0].id == CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION &&
      config->attrs[0].value.programmaticStreamSerializationAllowed == 1;
  return CUDA_SUCCESS;
}
CUresult CUDAAPI fake_get_id(unsigned long long* id) {
  *id = 7;
  return CUDA_SUCCESS;
}
CUresult CUDAAPI fake_ctx_get_id(CUcontext ctx, unsigned long long* id) {
  ++state().context_id_queries;
  *id = reinterpret_cast<std::uintptr_t>(ctx);
  return CUDA_SUCCESS;
}
// A stream's id: its handle for the handles tests create; the special handles get one id,
// whatever the context (the worst case for the workspace key).
CUresult CUDAAPI fake_stream_get_id(CUstream stream, unsigned long long* id) {
  const auto handle = reinterpret_cast<std::uintptr_t>(stream);
  if (handle <= 2) return fake_get_id(id);
  *id = handle;
  return CUDA_SUCCESS;
}
auto* const kOwnStream = reinterpret_cast<CUstream>(0x7000);
CUresult CUDAAPI fake_stream_create(CUstream* stream, unsigned) {
  ++state().own_streams_open;
  *stream = kOwnStream;
  return CUDA_SUCCESS;
}
CUresult CUDAAPI fake_stream_destroy(CUstream) {
  --state().own_streams_open;
  return CUDA_SUCCESS;
}
CUresult CUDAAPI fake_stream_synchronize(CUstream) {
  return CUDA_SUCCESS;
}
CUresult CUDAAPI fake_mem_alloc_async(CUdeviceptr* ptr, std::size_t, CUstream stream) {
  ++(stream == kOwnStream ? state().slab_allocations : state().allocations);
  *ptr = 0x40000;
  return CUDA_SUCCESS;
}
CUresult CUDAAPI fake_mem_free_async(CUdeviceptr, CUstream) {
  return CUDA_SUCCESS;
}
CUresult CUDAAPI fake_mem_free(CUdeviceptr) {
  return CUDA_SUCCESS;
}
CUresult CUDAAPI fake_memset(CUdeviceptr, unsigned, std::size_t, CUstream stream) {
  ++(stream == kOwnStream ? state().slab_memsets : state().memsets);
  return CUDA_SUCCESS;
}
CUresult CUDAAPI fake_error_name(CUresult, const char** s) {
  *s = "CUDA_ERROR_FAKE";
  return CUDA_SUCCESS;
}

driver::Api fake_api() {
  driver::Api api;
  api.cuCtxGetCurrent = fake_ctx_get_current;
  api.cuCtxGetDevice = fake_ctx_get_device;
  api.cuDeviceGetCount = fake_device_get_count;
  api.cuDeviceGet = fake_device_get;
  api.cuDeviceGetAttribute = fake_device_get_attribute;
  api.cuStreamIsCapturing = fake_stream_is_capturing;
  api.cuLibraryLoadData = fake_library_load_data;
  api.cuLibraryUnload = fake_library_unload;
  api.cuLibraryGetKernel = fake_library_get_kernel;
  api.cuKernelGetAttribute = fake_kernel_get_attribute;
  api.cuKernelSetAttribute = fake_kernel_set_attribute;
  api.cuLaunchKernelEx = fake_launch;
  api.cuCtxGetId = fake_ctx_get_id;
  api.cuStreamGetId = fake_stream_get_id;
  api.cuStreamCreate = fake_stream_create;
  api.cuStreamDestroy = fake_stream_destroy;
  api.cuStreamSynchronize = fake_stream_synchronize;
  api.cuMemAllocAsync = fake_mem_alloc_async;
  api.cuMemFreeAsync = fake_mem_free_async;
  api.cuMemFree = fake_mem_free;
  api.cuMemsetD32Async = fake_memset;
  api.cuGetErrorName = fake_error_name;
  api.cuGetErrorString = fake_error_name;
  return api;
}

// A Runtime's parts around the fake driver; the kernels are really compiled (NVRTC needs no
// GPU) and kept in memory.
struct FakeRuntime : Runtime::Impl {
  explicit FakeRuntime(bool jit = true)
      : Runtime::Impl(options(jit), std::make_unique<driver::Driver>(fake_api())) {}
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

ForwardArgs forward_args(const Config& c) {
  ForwardArgs a;
  a.kv = fake_ptr<void>(0x100000);
  a.score = fake_ptr<void>(0x200000);
  a.ape = fake_ptr<float>(0x300000);
  a.cu_seqlens = fake_ptr<std::int32_t>(0x400000);
  a.cu_seqlens_comp = fake_ptr<std::int32_t>(0x500000);
  a.out = fake_ptr<void>(0x600000);
  a.total_tokens = 8192;
  a.num_segments = 1;
  a.total_comp = 8192 / c.ratio;
  a.config = c;
  return a;
}

BackwardArgs backward_args(const Config& c, std::uint32_t flags = 0) {
  const ForwardArgs f = forward_args(c);
  BackwardArgs a;
  a.kv = f.kv;
  a.score = f.score;
  a.ape = f.ape;
  a.cu_seqlens = f.cu_seqlens;
  a.cu_seqlens_comp = f.cu_seqlens_comp;
  a.grad_out = fake_ptr<void>(0x700000);
  a.grad_kv = fake_ptr<void>(0x800000);
  a.grad_score = fake_ptr<void>(0x900000);
  a.grad_ape = fake_ptr<float>(0xa00000);
  a.total_tokens = f.total_tokens;
  a.num_segments = 1;
  a.total_comp = f.total_comp;
  a.config = c;
  a.flags = flags;
  return a;
}

class FakeDriver : public ::testing::Test {
 protected:
  void SetUp() override {
    state().capturing = false;
    state().library_loads = 0;
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
  }
};

const Config kShort{4, 64, 2};
const Config kLong{128, 64, 1};
auto* const kStream = reinterpret_cast<CUstream>(0x5000);

TEST_F(FakeDriver, ColdConfigurationUnderCaptureRaisesAndTheNextCallWorks) {
  FakeRuntime rt;
  for (const Config& c : {kShort, kLong}) {
    SetUp();
    state().capturing = true;
    try {
      rt.service.forward(forward_args(c), kStream, Family::kAuto);
      FAIL() << "a cold configuration was prepared under capture";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), Status::kCaptureUnsafe);
      const std::string what = e.what();
      EXPECT_NE(what.find("prewarm"), std::string::npos) << what;
      EXPECT_NE(what.find("head_dim=64"), std::string::npos) << what;
    }
    EXPECT_EQ(state().library_loads, 0) << "a module was loaded under capture";
    EXPECT_EQ(state().launches, 0);
    state().capturing = false;
    rt.service.forward(forward_args(c), kStream, Family::kAuto);
    EXPECT_EQ(state().library_loads, 1);
    EXPECT_EQ(state().launches, 1);
  }
}

TEST_F(FakeDriver, WarmConfigurationLaunchesUnderCaptureWithoutPreparingAgain) {
  FakeRuntime rt;
  for (const Config& c : {kShort, kLong}) {
    SetUp();
    rt.service.prewarm(c, 0, Family::kAuto);
    EXPECT_EQ(state().library_loads, 1);
    state().capturing = true;
    for (int i = 0; i < 3; ++i) rt.service.forward(forward_args(c), kStream, Family::kAuto);
    EXPECT_EQ(state().launches, 3);
    // Backward: kernel + fixed-order grad_ape reduction; the workspace comes from the graph.
    rt.service.backward(backward_args(c), kStream, Family::kAuto);
    EXPECT_EQ(state().launches, 5);
    EXPECT_EQ(state().allocations, 1) << "graph-owned grad_ape workspace";
    EXPECT_EQ(state().library_loads, 1) << "a warm call prepared again";
  }
}

TEST_F(FakeDriver, BackwardWorkspaceIsKeptPerStreamAndContext) {
  for (const Config& c : {kShort, kLong}) {
    SetUp();
    FakeRuntime rt;
    rt.service.prewarm(c, 0, Family::kAuto);
    rt.service.prewarm(c, 1, Family::kAuto);
    auto* const other = reinterpret_cast<CUstream>(0x6000);
    // Application streams: one workspace each, found again by the stream's id alone.
    for (int i = 0; i < 3; ++i) rt.service.backward(backward_args(c), kStream, Family::kAuto);
    EXPECT_EQ(state().allocations, 1);
    rt.service.backward(backward_args(c), other, Family::kAuto);
    EXPECT_EQ(state().allocations, 2);
    // Only the first atomic call's slab of claim words for captured calls asked for one.
    EXPECT_EQ(state().context_id_queries, state().slab_allocations.load())
        << "an application stream needs no context id";
    // The NULL stream exists once per context: one workspace per context.
    for (int i = 0; i < 2; ++i) rt.service.backward(backward_args(c), nullptr, Family::kAuto);
    EXPECT_EQ(state().allocations, 3);
    state().current_device = 1;
    rt.service.backward(backward_args(c), nullptr, Family::kAuto);
    EXPECT_EQ(state().allocations, 4) << "device 1's NULL stream shared device 0's workspace";
    EXPECT_EQ(state().context_id_queries, 3 + state().slab_allocations);
  }
}

// The claim words of one captured call, rounded up: a slab serves this many calls.
constexpr int kCapturedCallsPerSlab = (64 << 10) / 256;

// coff * head_dim >= 512: the default backward sums grad_ape with atomics.
// The atomic backward of `wide` (its default): one launch eagerly, the kernel and the
// fixed-order reduction when deterministic. Captured, with `captured_claim_words` one launch
// with claim words of the call's own, as long as there are some, else (and when no claim words
// are left) a memset of grad_ape and the launch.
void expect_atomic_backward_in_one_launch(const Config& wide, bool captured_claim_words) {
  FakeRuntime rt;
  rt.service.prewarm(wide, 0, Family::kAuto);
  // Overwriting: the kernel zeroes grad_ape itself, with the stream's claim words, allocated
  // and zeroed once; then one launch a call. The first call also sets aside a slab of claim
  // words for captured calls, zeroed on the runtime's own stream, which it destroys.
  for (int i = 0; i < 3; ++i) rt.service.backward(backward_args(wide), kStream, Family::kAuto);
  EXPECT_EQ(state().launches, 3);
  EXPECT_EQ(state().allocations, 1);
  EXPECT_EQ(state().memsets, 1) << "the claim words are zeroed when allocated, not per call";
  EXPECT_EQ(state().slab_allocations, 1);
  EXPECT_EQ(state().slab_memsets, 1);
  EXPECT_EQ(state().own_streams_open, 0);
  // Accumulating: straight into grad_ape, no workspace.
  rt.service.backward(backward_args(wide, kAccumulateGradApe), kStream, Family::kAuto);
  EXPECT_EQ(state().launches, 4);
  EXPECT_EQ(state().memsets, 1);
  // Deterministic: the kernel and the fixed-order reduction, partials in their own workspace.
  rt.service.backward(backward_args(wide, kDeterministic), kStream, Family::kAuto);
  EXPECT_EQ(state().launches, 6);
  EXPECT_EQ(state().allocations, 2) << "the partials shared the claim words";
  // Another stream: its own claim words.
  rt.service.backward(backward_args(wide), reinterpret_cast<CUstream>(0x6000), Family::kAuto);
  EXPECT_EQ(state().launches, 7);
  EXPECT_EQ(state().allocations, 3);
  EXPECT_EQ(state().memsets, 2);
  // Under capture: one launch with the call's own claim words, as many calls as the slab
  // serves (or a memset of grad_ape before each); then a memset of grad_ape and the launch.
  state().capturing = true;
  for (int i = 0; i < kCapturedCallsPerSlab; ++i)
    rt.service.backward(backward_args(wide), kStream, Family::kAuto);
  EXPECT_EQ(state().launches, 7 + kCapturedCallsPerSlab);
  const int captured_memsets = captured_claim_words ? 0 : kCapturedCallsPerSlab;
  EXPECT_EQ(state().memsets, 2 + captured_memsets);
  rt.service.backward(backward_args(wide), kStream, Family::kAuto);
  EXPECT_EQ(state().launches, 8 + kCapturedCallsPerSlab);
  EXPECT_EQ(state().memsets, 3 + captured_memsets) << "no claim words were left";
  EXPECT_EQ(state().allocations, 3);
  EXPECT_EQ(state().slab_allocations, 1) << "a slab was allocated under capture";
  // The next eager call sets aside another slab (where captured calls took some), and captured
  // calls take one launch again.
  state().capturing = false;
  rt.service.backward(backward_args(wide), kStream, Family::kAuto);
  EXPECT_EQ(state().slab_allocations, captured_claim_words ? 2 : 1);
  state().capturing = true;
  rt.service.backward(backward_args(wide), kStream, Family::kAuto);
  EXPECT_EQ(state().launches, 10 + kCapturedCallsPerSlab);
  EXPECT_EQ(state().memsets, 3 + captured_memsets + (captured_claim_words ? 0 : 1));
  EXPECT_EQ(state().own_streams_open, 0);
}

TEST_F(FakeDriver, ShortWindowAtomicBackwardIsOneLaunch) {
  expect_atomic_backward_in_one_launch({2, 512, 2}, /*captured_claim_words=*/true);
}

// 64 rows of 128,2,512: a bucket the shipped sm_90 table sums atomically.
TEST_F(FakeDriver, LongWindowAtomicBackwardIsOneLaunch) {
  const Config c{128, 512, 2};
  ASSERT_TRUE(schedule::ScheduleSet::embedded()
                  .select(c, Direction::kBackward, 64, "sm_90")
                  .schedule.atomic_ape);
  // 64 rows: 4 rows a CTA here (32 column slices, 16 row groups): claim words under capture.
  expect_atomic_backward_in_one_launch(c, /*captured_claim_words=*/true);
  // The atomic kernel (last template argument true) by default, accumulating and under
  // capture; its fixed-order twin and the reduction for the deterministic call.
  const std::string atomic = "ELb1ELb1EEEv", fixed = "ELb1ELb0EEEv";
  std::lock_guard<std::mutex> lock(state().mutex);
  const auto& l = state().launched;
  ASSERT_EQ(l.size(), 10u + kCapturedCallsPerSlab);
  for (std::size_t i = 0; i < l.size(); ++i) {
    if (i == 4 || i == 5) continue;
    EXPECT_NE(l[i].find("lane_window_backward"), std::string::npos) << l[i];
    EXPECT_NE(l[i].find(atomic), std::string::npos) << "launch " << i << ": " << l[i];
  }
  EXPECT_NE(l[4].find("lane_window_backward"), std::string::npos) << l[4];
  EXPECT_NE(l[4].find(fixed), std::string::npos) << l[4];
  EXPECT_NE(l[5].find("ape_reduce"), std::string::npos) << l[5];
}

// Prewarm (and a plan's prepare) on the current context's device sets aside claim words, so
// that a graph captured before any eager backward launches the atomic backward alone.
TEST_F(FakeDriver, PrewarmSetsAsideClaimWordsForCapturedCalls) {
  const Config wide{2, 512, 2};
  {
    FakeRuntime rt;
    state().current_device = 1;
    rt.service.prewarm(wide, 0, Family::kAuto);
    EXPECT_EQ(state().slab_allocations, 0) << "device 0 is not the current context's";
    state().current_device = 0;
    rt.service.prewarm(wide, 0, Family::kAuto);
    EXPECT_EQ(state().slab_allocations, 1);
    EXPECT_EQ(state().slab_memsets, 1);
    rt.service.prewarm(wide, 0, Family::kAuto);
    EXPECT_EQ(state().slab_allocations, 1) << "a slab with room was replaced";
    state().capturing = true;
    rt.service.backward(backward_args(wide), kStream, Family::kAuto);
    EXPECT_EQ(state().launches, 1);
    EXPECT_EQ(state().memsets, 0) << "the captured call had no claim words";
  }
  SetUp();
  FakeRuntime rt;
  const auto plan = rt.service.record(wide, Family::kAuto, 0);
  EXPECT_EQ(state().slab_allocations, 1);
  state().capturing = true;
  rt.service.backward_with(*plan, backward_args(wide), kStream);
  EXPECT_EQ(state().launches, 1);
  EXPECT_EQ(state().memsets, 0);
}

// Captured, the long-window atomic backward takes claim words only from
// kCapturedClaimWordsMinRows rows a CTA on; with fewer, a memset of grad_ape goes first.
TEST_F(FakeDriver, LongWindowCapturedBackwardTakesClaimWordsFromFourRowsACta) {
  const Config c{128, 512, 2};
  FakeRuntime rt;
  rt.service.prewarm(c, 0, Family::kAuto);
  rt.service.backward(backward_args(c), kStream, Family::kAuto);  // eager: sets aside a slab
  ASSERT_EQ(state().slab_allocations, 1);
  const int memsets = state().memsets;
  state().capturing = true;
  for (const std::int64_t rows : {32, 64}) {
    BackwardArgs a = backward_args(c);
    a.total_tokens = rows * c.ratio;
    a.total_comp = rows;
    ASSERT_TRUE(schedule::ScheduleSet::embedded()
                    .select(c, Direction::kBackward, rows, "sm_90")
                    .schedule.atomic_ape);
    const int before = state().memsets;
    rt.service.backward(a, kStream, Family::kAuto);
    // 32 column slices over one wave of 528 CTAs here: 16 row groups.
    const bool claim_words = (rows + 15) / 16 >= schedule::kCapturedClaimWordsMinRows;
    EXPECT_EQ(state().memsets - before, claim_words ? 0 : 1) << rows << " rows";
  }
  EXPECT_EQ(state().memsets, memsets + 1);
}

// coff * head_dim < 512: the fixed order by default, yet one launch (one_launch): the atomic
// kernel with claim words, the stream's or, captured, the call's own where a CTA has at least
// captured_one_launch_min rows x slots of work. Deterministic calls, captured calls with less
// work, and calls captured when no claim words are left run the fixed-order kernel and the
// reduction.
TEST_F(FakeDriver, NarrowShortWindowBackwardTakesOneLaunchWithClaimWords) {
  const auto s = schedule::select_short_window(kShort);
  ASSERT_TRUE(s.fixed_order_default);
  FakeRuntime rt;
  rt.service.prewarm(kShort, 0, Family::kAuto);
  // 2048 rows: 8 rows a CTA (one wave of 4 CTAs per SM at 64 registers), 64 rows x slots;
  // 16384 rows: 32 rows a CTA, 256.
  BackwardArgs many = backward_args(kShort);
  many.total_tokens = std::int64_t{16384} * kShort.ratio;
  many.total_comp = 16384;
  ASSERT_EQ(s.captured_one_launch_min, 128);
  for (int i = 0; i < 2; ++i) rt.service.backward(backward_args(kShort), kStream, Family::kAuto);
  EXPECT_EQ(state().launches, 2);
  EXPECT_EQ(state().memsets, 1) << "the claim words are zeroed once, when allocated";
  rt.service.backward(backward_args(kShort, kDeterministic), kStream, Family::kAuto);
  EXPECT_EQ(state().launches, 4);
  state().capturing = true;
  rt.service.backward(backward_args(kShort), kStream, Family::kAuto);
  EXPECT_EQ(state().launches, 6) << "too little work a CTA for one launch under capture";
  for (int i = 0; i < kCapturedCallsPerSlab; ++i) rt.service.backward(many, kStream, Family::kAuto);
  EXPECT_EQ(state().launches, 6 + kCapturedCallsPerSlab);
  rt.service.backward(many, kStream, Family::kAuto);
  EXPECT_EQ(state().launches, 8 + kCapturedCallsPerSlab) << "no claim words were left";
  EXPECT_EQ(state().memsets, 1) << "the captured fixed order needs no memset of grad_ape";
  // The kernel's last template argument is FIXED_ORDER.
  const std::string atomic = "ELb0EEEv", fixed = "ELb1EEEv";
  std::lock_guard<std::mutex> lock(state().mutex);
  const auto& l = state().launched;
  ASSERT_EQ(l.size(), 8u + kCapturedCallsPerSlab);
  for (std::size_t i = 0; i < l.size(); ++i) {
    const bool fixed_order = i == 2 || i == 4 || i + 2 == l.size();
    const bool reduction = i == 3 || i == 5 || i + 1 == l.size();
    if (reduction) {
      EXPECT_NE(l[i].find("ape_reduce"), std::string::npos) << l[i];
      continue;
    }
    EXPECT_NE(l[i].find("short_window_backward"), std::string::npos) << l[i];
    EXPECT_NE(l[i].find(fixed_order ? fixed : atomic), std::string::npos) << i << ": " << l[i];
  }
}

// The grad_ape reduction lets the next kernel in before its programmatic wait only on a grid
// of one wave (132 SMs here, a CTA counted at half an SM's threads at most).
TEST_F(FakeDriver, ReductionLetsTheNextKernelInEarlyOnlyOnOneWave) {
  FakeRuntime rt;
  struct Case {
    Config config;
    std::int64_t rows;
    int one_wave;  // -1: whatever the grid says
  };
  // 4,2,64: 512 elements, 16 CTAs; 16,2,512: 16384 elements in 512 CTAs of 512 threads.
  for (const Case& k : {Case{kShort, 2048, 1}, Case{{16, 512, 2}, 512, 0},
                        Case{{128, 512, 2}, 32, -1}, Case{{128, 512, 1}, 1024, -1}}) {
    BackwardArgs a = backward_args(k.config, kDeterministic);
    a.total_tokens = k.rows * k.config.ratio;
    a.total_comp = k.rows;
    rt.service.backward(a, kStream, Family::kAuto);
    std::lock_guard<std::mutex> lock(state().mutex);
    ASSERT_FALSE(state().reduce_grids.empty());
    const auto& grid = state().reduce_grids.back();
    const unsigned threads = grid[2] * grid[3];
    const int expected = grid[0] <= 132u * std::max(1u, 1024u / threads) ? 1 : 0;
    SCOPED_TRACE("ratio " + std::to_string(k.config.ratio) + ", head_dim " +
                 std::to_string(k.config.head_dim) + ", grid " + std::to_string(grid[0]) + " x " +
                 std::to_string(threads) + " threads");
    EXPECT_EQ(state().reduce_dependents_first.back(), expected);
    if (k.one_wave >= 0) {
      EXPECT_EQ(expected, k.one_wave);
    }
  }
}

TEST_F(FakeDriver, JitDisabledTurnsAColdKeyIntoAnError) {
  FakeRuntime rt(/*jit=*/false);
  try {
    rt.service.forward(forward_args(kShort), kStream, Family::kAuto);
    FAIL() << "compiled with JIT disabled";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Status::kJitDisabled);
  }
  EXPECT_EQ(state().launches, 0);
}

TEST_F(FakeDriver, LongWindowGridCoversEveryRowAndColumnSlice) {
  FakeRuntime rt;
  rt.service.forward(forward_args(kLong), kStream, Family::kAuto);
  std::lock_guard<std::mutex> lock(state().mutex);
  ASSERT_EQ(state().last_grid.size(), 4u);
  // One flat dimension: every output row times every column slice.
  constexpr unsigned kRows = 8192u / 128u;
  EXPECT_EQ(state().last_grid[1], 1u);
  ASSERT_EQ(state().last_grid[0] % kRows, 0u);
  const unsigned slices = state().last_grid[0] / kRows;
  const unsigned cols = slices * state().last_grid[2];  // slices x column lanes
  EXPECT_GE(cols * 2, 64u);  // vec 1 or 2 columns per lane cover head_dim 64
}

// The grad_ape reduction after a long-window backward: the 16-byte kernel (256 threads, 1 or 2
// lanes) up to 16 row groups, the scalar one (32 x 8) beyond; either covers every element.
TEST_F(FakeDriver, LongWindowReductionFitsTheRowGroups) {
  FakeRuntime rt;
  bool scalar = false, quads = false;
  for (const auto& [c, rows] : std::vector<std::pair<Config, std::int64_t>>{
           {{128, 512, 2}, 8}, {{128, 512, 2}, 32}, {{128, 128, 1}, 1024}}) {
    const std::int64_t elements = static_cast<std::int64_t>(c.ratio) * c.coff * c.head_dim;
    BackwardArgs a = backward_args(c, kDeterministic);  // the fixed order, whatever the default
    a.total_tokens = rows * c.ratio;
    a.total_comp = rows;
    rt.service.backward(a, kStream, Family::kAuto);
    std::lock_guard<std::mutex> lock(state().mutex);
    ASSERT_GE(state().grids.size(), 2u);
    const auto& kernel = state().grids[state().grids.size() - 2];
    const auto& reduce = state().grids.back();
    const unsigned groups = kernel[0];
    SCOPED_TRACE("rows " + std::to_string(rows) + ", groups " + std::to_string(groups));
    if (groups <= 16) {
      quads = true;
      EXPECT_EQ(reduce[2] * reduce[3], 256u);
      EXPECT_EQ(reduce[3], groups <= 8 ? 1u : 2u);
      EXPECT_GE(static_cast<std::int64_t>(reduce[0]) * reduce[2] * 4, elements);
    } else {
      scalar = true;
      EXPECT_EQ(reduce[2], 32u);
      EXPECT_EQ(reduce[3], static_cast<unsigned>(compressor::kApeReduceLanes));
      EXPECT_GE(static_cast<std::int64_t>(reduce[0]) * 32, elements);
    }
  }
  EXPECT_TRUE(scalar && quads) << "both kernels should have been chosen once";
}

TEST_F(FakeDriver, ShortWindowForwardGridCoversEveryRowVector) {
  FakeRuntime rt;
  const auto s = schedule::select_short_window(kShort);
  // A small call runs the narrow forward in its small CTAs; a large one the wide forward.
  for (const std::int64_t tokens : {std::int64_t{8192}, std::int64_t{65536}}) {
    ForwardArgs a = forward_args(kShort);
    a.total_tokens = tokens;
    a.total_comp = tokens / kShort.ratio;
    const auto choice = schedule::forward_choice(s, kShort, a.total_comp);
    EXPECT_EQ(choice.wide, tokens == 65536);
    rt.service.forward(a, kStream, Family::kAuto);
    std::lock_guard<std::mutex> lock(state().mutex);
    ASSERT_EQ(state().last_grid.size(), 4u);
    EXPECT_EQ(state().last_grid[2], static_cast<unsigned>(choice.threads));
    EXPECT_EQ(state().last_grid[1], 1u);
    const std::int64_t vectors = a.total_comp * kShort.head_dim / choice.vec;
    const std::int64_t threads = std::int64_t{state().last_grid[0]} * state().last_grid[2];
    EXPECT_GE(threads, vectors);
    EXPECT_LT(threads - vectors, choice.threads) << "one CTA too many";
  }
}

TEST_F(FakeDriver, ManyThreadsShareOnePreparedRecordPerConfiguration) {
  FakeRuntime rt;
  constexpr int kThreads = 8;
  constexpr int kCalls = 50;
  std::vector<std::thread> threads;
  threads.reserve(kThreads);
  std::atomic<int> errors{0};
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      const Config c = t % 2 == 0 ? kShort : kLong;
      for (int i = 0; i < kCalls; ++i) {
        try {
          rt.service.forward(forward_args(c), kStream, Family::kAuto);
        } catch (const std::exception&) {
          ++errors;
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(errors, 0);
  EXPECT_EQ(state().launches, kThreads * kCalls);
  EXPECT_EQ(state().library_loads, 2) << "one module load per configuration";
}

// The plan API over the same service: prepared by the constructor, then calls that launch
// under capture without any preparation, and reject a call for another configuration.
TEST_F(FakeDriver, PlanPreparesOnceAndLaunchesUnderCapture) {
  FakeRuntime rt;
  for (const Config& c : {kShort, kLong}) {
    SetUp();
    auto record = rt.service.record(c, Family::kAuto, 0);
    EXPECT_EQ(state().library_loads, 1);
    const int queries = state().attribute_queries;
    state().capturing = true;
    for (int i = 0; i < 4; ++i) {
      rt.service.forward_with(*record, forward_args(c), kStream);
      rt.service.backward_with(*record, backward_args(c), kStream);
    }
    EXPECT_EQ(state().launches, 4 * 3);  // forward + backward kernel + grad_ape reduction
    EXPECT_EQ(state().attribute_queries, queries) << "a plan call prepared again";
    EXPECT_EQ(state().library_loads, 1);
    // The free-function path finds the same record: no new load, launches under capture.
    rt.service.forward(forward_args(c), kStream, Family::kAuto);
    EXPECT_EQ(state().library_loads, 1);
  }
}

TEST_F(FakeDriver, FastLaunchOffResolvesEveryCall) {
  ::setenv("CSA_FAST_LAUNCH", "0", 1);
  FakeRuntime rt;
  ::unsetenv("CSA_FAST_LAUNCH");
  rt.service.forward(forward_args(kShort), kStream, Family::kAuto);
  const int queries = state().attribute_queries;
  rt.service.forward(forward_args(kShort), kStream, Family::kAuto);
  EXPECT_GT(state().attribute_queries, queries) << "CSA_FAST_LAUNCH=0 reused a record";
  EXPECT_EQ(state().library_loads, 1) << "the module cache still serves the kernels";
  EXPECT_EQ(state().launches, 2);
}

// Two devices in one process (an sm_90 with 132 SMs and an sm_80 with 108): separate records,
// a module per arch, grids sized to each device, programmatic launch only where the arch has
// it, and a record used on the wrong device is rejected before any launch.
TEST_F(FakeDriver, TwoDevicesKeepSeparateRecords) {
  FakeRuntime rt;
  std::vector<unsigned> grid[2];
  bool programmatic[2] = {};
  for (int device : {0, 1}) {
    state().current_device = device;
    std::size_t first = 0;
    {
      std::lock_guard<std::mutex> lock(state().mutex);
      first = state().grids.size();
    }
    BackwardArgs b = backward_args(kShort);
    b.total_tokens = 65536;  // 16384 rows: many more than one wave of either device
    b.total_comp = 65536 / kShort.ratio;
    rt.service.backward(b, kStream, Family::kAuto);
    {
      std::lock_guard<std::mutex> lock(state().mutex);
      grid[device] = state().grids.at(first);  // the backward kernel (the reduction follows)
    }
    rt.service.forward(forward_args(kLong), kStream, Family::kAuto);
    std::lock_guard<std::mutex> lock(state().mutex);
    programmatic[device] = state().last_programmatic;
  }
  EXPECT_EQ(state().library_loads, 4) << "one module per configuration and arch";
  EXPECT_TRUE(programmatic[0]) << "sm_90 launches ask for programmatic serialization";
  EXPECT_FALSE(programmatic[1]) << "sm_80 has no programmatic dependent launch";
  ASSERT_EQ(grid[0].size(), 4u);
  ASSERT_EQ(grid[1].size(), 4u);
  EXPECT_NE(grid[0][0] * grid[0][1], grid[1][0] * grid[1][1])
      << "the backward grid is one wave of each device";
  const int launches = state().launches;
  auto record0 = rt.service.record(kShort, Family::kAuto, 0);
  state().current_device = 1;
  try {
    rt.service.forward_with(*record0, forward_args(kShort), kStream);
    FAIL() << "a record of device 0 launched on device 1";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Status::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("prepared for device 0"), std::string::npos) << e.what();
  }
  EXPECT_EQ(state().launches, launches);
}

TEST_F(FakeDriver, ProgrammaticLaunchCanBeTurnedOff) {
  ::setenv("CSA_PROGRAMMATIC_LAUNCH", "0", 1);
  FakeRuntime rt;
  ::unsetenv("CSA_PROGRAMMATIC_LAUNCH");
  rt.service.forward(forward_args(kShort), kStream, Family::kAuto);
  std::lock_guard<std::mutex> lock(state().mutex);
  EXPECT_FALSE(state().last_programmatic);
}

}  // namespace
}  // namespace csa::test
