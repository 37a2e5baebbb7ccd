#include "csa/device.hpp"

#include <map>
#include <mutex>

#include "api/runtime_impl.hpp"
#include "common/error.hpp"

namespace csa::device {

namespace {

driver::Driver& driver_of(Runtime& runtime) {
  return runtime.impl().loader.get();
}

CUstream raw(Stream s) {
  return reinterpret_cast<CUstream>(s);
}

}  // namespace

void make_current(Runtime& runtime, int device) {
  driver::Driver& d = driver_of(runtime);
  runtime.impl().service.device_traits(device);  // validates the ordinal
  CUdevice dev = 0;
  d.check(d.api().cuDeviceGet(&dev, device), "cuDeviceGet");
  // NOTE: the primary context is retained once per device and never released here: it is
  // shared with the CUDA runtime and frameworks in the same process.
  CUcontext ctx = nullptr;
  d.check(d.api().cuDevicePrimaryCtxRetain(&ctx, dev), "cuDevicePrimaryCtxRetain");
  d.check(d.api().cuCtxSetCurrent(ctx), "cuCtxSetCurrent");
}

void ensure_current(Runtime& runtime, int device) {
  driver::Driver& d = driver_of(runtime);
  CUcontext ctx = nullptr;
  d.check(d.api().cuCtxGetCurrent(&ctx), "cuCtxGetCurrent");
  if (ctx != nullptr) {
    CUdevice current = 0;
    d.check(d.api().cuCtxGetDevice(&current), "cuCtxGetDevice");
    if (current == device) return;
  }
  make_current(runtime, device);
}

DeviceInfo current_device(Runtime& runtime) {
  const int ordinal = runtime.impl().service.current_device();
  for (const auto& info : runtime.driver_info().devices) {
    if (info.ordinal == ordinal) return info;
  }
  fail(Status::kInternal, "current device {} not listed by the driver", ordinal);
}

Buffer::Buffer(Runtime& runtime, std::size_t bytes) : runtime_(&runtime), bytes_(bytes) {
  if (bytes == 0) return;
  driver::Driver& d = driver_of(runtime);
  CUdeviceptr p = 0;
  d.check(d.api().cuMemAlloc(&p, bytes), "cuMemAlloc");
  ptr_ = reinterpret_cast<void*>(static_cast<std::uintptr_t>(p));
}

Buffer::~Buffer() {
  if (ptr_ != nullptr) driver_of(*runtime_).api().cuMemFree(reinterpret_cast<CUdeviceptr>(ptr_));
}

Buffer::Buffer(Buffer&& other) noexcept
    : runtime_(other.runtime_), ptr_(other.ptr_), bytes_(other.bytes_) {
  other.ptr_ = nullptr;
  other.bytes_ = 0;
}

Buffer& Buffer::operator=(Buffer&& other) noexcept {
  if (this != &other) {
    if (ptr_ != nullptr) driver_of(*runtime_).api().cuMemFree(reinterpret_cast<CUdeviceptr>(ptr_));
    runtime_ = other.runtime_;
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
  driver::Driver& d = driver_of(*runtime_);
  d.check(d.api().cuMemcpyHtoD(reinterpret_cast<CUdeviceptr>(ptr_) + offset, host, bytes),
          "cuMemcpyHtoD");
}

void Buffer::download(void* host, std::size_t bytes, std::size_t offset) const {
  if (bytes == 0) return;
  if (offset + bytes > bytes_)
    fail(Status::kInvalidArgument, "download of {} bytes at {} exceeds the {}-byte buffer", bytes,
         offset, bytes_);
  driver::Driver& d = driver_of(*runtime_);
  d.check(d.api().cuMemcpyDtoH(host, reinterpret_cast<CUdeviceptr>(ptr_) + offset, bytes),
          "cuMemcpyDtoH");
}

void Buffer::fill(std::uint8_t byte) {
  if (bytes_ == 0) return;
  memset_async(*runtime_, ptr_, byte, bytes_, nullptr);
  synchronize(*runtime_, nullptr);
}

StreamHandle::StreamHandle(Runtime& runtime) : runtime_(&runtime) {
  driver::Driver& d = driver_of(runtime);
  CUstream s = nullptr;
  d.check(d.api().cuStreamCreate(&s, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
  stream_ = reinterpret_cast<Stream>(s);
}

StreamHandle::~StreamHandle() {
  if (stream_ != nullptr) driver_of(*runtime_).api().cuStreamDestroy(raw(stream_));
}

void StreamHandle::synchronize() {
  device::synchronize(*runtime_, stream_);
}

Event::Event(Runtime& runtime) : runtime_(&runtime) {
  driver::Driver& d = driver_of(runtime);
  CUevent e = nullptr;
  d.check(d.api().cuEventCreate(&e, CU_EVENT_DEFAULT), "cuEventCreate");
  event_ = e;
}

Event::~Event() {
  if (event_ != nullptr) driver_of(*runtime_).api().cuEventDestroy(event_);
}

void Event::record(Stream stream) {
  driver::Driver& d = driver_of(*runtime_);
  d.check(d.api().cuEventRecord(event_, raw(stream)), "cuEventRecord");
}

void Event::synchronize() {
  driver::Driver& d = driver_of(*runtime_);
  d.check(d.api().cuEventSynchronize(event_), "cuEventSynchronize");
}

float Event::milliseconds_since(const Event& start) const {
  driver::Driver& d = driver_of(*runtime_);
  float ms = 0.0f;
  d.check(d.api().cuEventElapsedTime(&ms, start.event_, event_), "cuEventElapsedTime");
  return ms;
}

Graph::Graph(Runtime& runtime, Stream stream, const std::function<void()>& record)
    : runtime_(&runtime) {
  driver::Driver& d = driver_of(runtime);
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
  driver::Driver& d = driver_of(*runtime_);
  if (exec_ != nullptr) d.api().cuGraphExecDestroy(exec_);
  if (graph_ != nullptr) d.api().cuGraphDestroy(graph_);
}

void Graph::launch(Stream stream) {
  driver::Driver& d = driver_of(*runtime_);
  d.check(d.api().cuGraphLaunch(exec_, raw(stream)), "cuGraphLaunch");
}

void copy_async(Runtime& runtime, void* dst, const void* src, std::size_t bytes, Stream stream) {
  driver::Driver& d = driver_of(runtime);
  d.check(d.api().cuMemcpyDtoDAsync(reinterpret_cast<CUdeviceptr>(dst),
                                    reinterpret_cast<CUdeviceptr>(src), bytes, raw(stream)),
          "cuMemcpyDtoDAsync");
}

void memset_async(Runtime& runtime, void* dst, std::uint8_t byte, std::size_t bytes,
                  Stream stream) {
  driver::Driver& d = driver_of(runtime);
  d.check(d.api().cuMemsetD8Async(reinterpret_cast<CUdeviceptr>(dst), byte, bytes, raw(stream)),
          "cuMemsetD8Async");
}

void synchronize(Runtime& runtime, Stream stream) {
  driver::Driver& d = driver_of(runtime);
  d.check(d.api().cuStreamSynchronize(raw(stream)), "cuStreamSynchronize");
}

}  // namespace csa::device
