#include "csa/testing/device.hpp"

#include "common/error.hpp"
#include "driver/loader.hpp"

namespace csa::device {

namespace {

// NOTE: the helpers' own driver table (loaded once, on first use), apart from any Runtime's:
// they serve tests and tools, not the library.
driver::Driver& drv() {
  static driver::Loader loader;
  return loader.get();
}

CUstream raw(Stream s) {
  return reinterpret_cast<CUstream>(s);
}

}  // namespace

void make_current(int device) {
  driver::Driver& d = drv();
  int count = 0;
  d.check(d.api().cuDeviceGetCount(&count), "cuDeviceGetCount");
  if (device < 0 || device >= count)
    fail(Status::kInvalidArgument, "device {} does not exist ({} CUDA devices)", device, count);
  CUdevice dev = 0;
  d.check(d.api().cuDeviceGet(&dev, device), "cuDeviceGet");
  // NOTE: the primary context is retained once per call and never released here: it is
  // shared with the CUDA runtime and frameworks in the same process.
  CUcontext ctx = nullptr;
  d.check(d.api().cuDevicePrimaryCtxRetain(&ctx, dev), "cuDevicePrimaryCtxRetain");
  d.check(d.api().cuCtxSetCurrent(ctx), "cuCtxSetCurrent");
}

DeviceInfo current_device() {
  driver::Driver& d = drv();
  CUcontext ctx = nullptr;
  d.check(d.api().cuCtxGetCurrent(&ctx), "cuCtxGetCurrent");
  if (ctx == nullptr) fail(Status::kInvalidArgument, "the calling thread has no current context");
  CUdevice dev = 0;
  d.check(d.api().cuCtxGetDevice(&dev), "cuCtxGetDevice");
  DeviceInfo info;
  info.ordinal = static_cast<int>(dev);
  char name[256] = {};
  d.check(d.api().cuDeviceGetName(name, sizeof name - 1, dev), "cuDeviceGetName");
  info.name = name;
  int l2 = 0;
  const auto attribute = [&](int* value, CUdevice_attribute a) {
    d.check(d.api().cuDeviceGetAttribute(value, a, dev), "cuDeviceGetAttribute");
  };
  attribute(&info.cc_major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR);
  attribute(&info.cc_minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR);
  attribute(&info.sm_count, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT);
  attribute(&l2, CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE);
  info.l2_bytes = l2;
  std::size_t mem = 0;
  d.check(d.api().cuDeviceTotalMem(&mem, dev), "cuDeviceTotalMem");
  info.memory_bytes = static_cast<std::int64_t>(mem);
  return info;
}

Buffer::Buffer(std::size_t bytes) : bytes_(bytes) {
  if (bytes == 0) return;
  driver::Driver& d = drv();
  CUdeviceptr p = 0;
  d.check(d.api().cuMemAlloc(&p, bytes), "cuMemAlloc");
  ptr_ = reinterpret_cast<void*>(static_cast<std::uintptr_t>(p));
}

Buffer::~Buffer() {
  if (ptr_ != nullptr) drv().api().cuMemFree(reinterpret_cast<CUdeviceptr>(ptr_));
}

Buffer::Buffer(Buffer&& other) noexcept : ptr_(other.ptr_), bytes_(other.bytes_) {
  other.ptr_ = nullptr;
  other.bytes_ = 0;
}

Buffer& Buffer::operator=(Buffer&& other) noexcept {
  if (this != &other) {
    if (ptr_ != nullptr) drv().api().cuMemFree(reinterpret_cast<CUdeviceptr>(ptr_));
    ptr_ = other.ptr_;
    bytes_ = other.bytes_;
    other.ptr_ = nullptr;
    other.bytes_ = 0;
  }
  return *this;
}

void Buffer::upload(const void* host, std::size_t bytes, std::size_t offset) {
  if (bytes == 0) return;
  if (offset + bytes > bytes_)
    fail(Status::kInvalidArgument, "upload of {} bytes at {} exceeds the {}-byte buffer", bytes,
         offset, bytes_);
  driver::Driver& d = drv();
  d.check(d.api().cuMemcpyHtoD(reinterpret_cast<CUdeviceptr>(ptr_) + offset, host, bytes),
          "cuMemcpyHtoD");
}

void Buffer::download(void* host, std::size_t bytes, std::size_t offset) const {
  if (bytes == 0) return;
  if (offset + bytes > bytes_)
    fail(Status::kInvalidArgument, "download of {} bytes at {} exceeds the {}-byte buffer", bytes,
         offset, bytes_);
  driver::Driver& d = drv();
  d.check(d.api().cuMemcpyDtoH(host, reinterpret_cast<CUdeviceptr>(ptr_) + offset, bytes),
          "cuMemcpyDtoH");
}

void Buffer::fill(std::uint8_t byte) {
  if (bytes_ == 0) return;
  memset_async(ptr_, byte, bytes_, nullptr);
  synchronize(nullptr);
}

StreamHandle::StreamHandle() {
  driver::Driver& d = drv();
  CUstream s = nullptr;
  d.check(d.api().cuStreamCreate(&s, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
  stream_ = reinterpret_cast<Stream>(s);
}

StreamHandle::~StreamHandle() {
  if (stream_ != nullptr) drv().api().cuStreamDestroy(raw(stream_));
}

void StreamHandle::synchronize() {
  device::synchronize(stream_);
}

Event::Event() {
  driver::Driver& d = drv();
  CUevent e = nullptr;
  d.check(d.api().cuEventCreate(&e, CU_EVENT_DEFAULT), "cuEventCreate");
  event_ = e;
}

Event::~Event() {
  if (event_ != nullptr) drv().api().cuEventDestroy(event_);
}

void Event::record(Stream stream) {
  driver::Driver& d = drv();
  d.check(d.api().cuEventRecord(event_, raw(stream)), "cuEventRecord");
}

void Event::synchronize() {
  driver::Driver& d = drv();
  d.check(d.api().cuEventSynchronize(event_), "cuEventSynchronize");
}

float Event::milliseconds_since(const Event& start) const {
  driver::Driver& d = drv();
  float ms = 0.0f;
  d.check(d.api().cuEventElapsedTime(&ms, start.event_, event_), "cuEventElapsedTime");
  return ms;
}

Graph::Graph(Stream stream, const std::function<void()>& record) {
  driver::Driver& d = drv();
  d.check(d.api().cuStreamBeginCapture(raw(stream), CU_STREAM_CAPTURE_MODE_THREAD_LOCAL),
          "cuStreamBeginCapture");
  try {
    record();
  } catch (...) {
    CUgraph broken = nullptr;
    d.api().cuStreamEndCapture(raw(stream), &broken);
    if (broken != nullptr) d.api().cuGraphDestroy(broken);
    throw;
  }
  d.check(d.api().cuStreamEndCapture(raw(stream), &graph_), "cuStreamEndCapture");
  d.check(d.api().cuGraphInstantiateWithFlags(&exec_, graph_, 0), "cuGraphInstantiateWithFlags");
}

Graph::~Graph() {
  driver::Driver& d = drv();
  if (exec_ != nullptr) d.api().cuGraphExecDestroy(exec_);
  if (graph_ != nullptr) d.api().cuGraphDestroy(graph_);
}

void Graph::launch(Stream stream) {
  driver::Driver& d = drv();
  d.check(d.api().cuGraphLaunch(exec_, raw(stream)), "cuGraphLaunch");
}

Module::Module(const std::vector<char>& cubin) {
  driver::Driver& d = drv();
  d.check(
      d.api().cuLibraryLoadData(&library_, cubin.data(), nullptr, nullptr, 0, nullptr, nullptr, 0),
      "cuLibraryLoadData");
}

Module::~Module() {
  if (library_ != nullptr) drv().api().cuLibraryUnload(library_);
}

void Module::launch(const std::string& name, unsigned grid, unsigned block, void** args,
                    Stream stream) {
  driver::Driver& d = drv();
  CUkernel kernel = nullptr;
  d.check(d.api().cuLibraryGetKernel(&kernel, library_, name.c_str()), "cuLibraryGetKernel");
  CUfunction function = nullptr;
  d.check(d.api().cuKernelGetFunction(&function, kernel), "cuKernelGetFunction");
  CUlaunchConfig config = {};
  config.gridDimX = grid;
  config.gridDimY = 1;
  config.gridDimZ = 1;
  config.blockDimX = block;
  config.blockDimY = 1;
  config.blockDimZ = 1;
  config.hStream = raw(stream);
  d.check(d.api().cuLaunchKernelEx(&config, function, args, nullptr), "cuLaunchKernelEx");
}

void copy_async(void* dst, const void* src, std::size_t bytes, Stream stream) {
  driver::Driver& d = drv();
  d.check(d.api().cuMemcpyDtoDAsync(reinterpret_cast<CUdeviceptr>(dst),
                                    reinterpret_cast<CUdeviceptr>(src), bytes, raw(stream)),
          "cuMemcpyDtoDAsync");
}

void memset_async(void* dst, std::uint8_t byte, std::size_t bytes, Stream stream) {
  driver::Driver& d = drv();
  d.check(d.api().cuMemsetD8Async(reinterpret_cast<CUdeviceptr>(dst), byte, bytes, raw(stream)),
          "cuMemsetD8Async");
}

void synchronize(Stream stream) {
  driver::Driver& d = drv();
  d.check(d.api().cuStreamSynchronize(raw(stream)), "cuStreamSynchronize");
}

}  // namespace csa::device
