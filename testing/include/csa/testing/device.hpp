// Device utilities of csa's tests, benchmarks, tools and examples (the csa_testing target, not
// installed): a device buffer, a stream, events, graphs and copies over the driver, opened
// with dlopen as the library does, so that nothing links libcuda or the CUDA runtime.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "csa/csa.hpp"  // Stream, DeviceInfo, Error

struct CUevent_st;
struct CUgraph_st;
struct CUgraphExec_st;
struct CUlib_st;

namespace csa::device {

// Makes `device`'s primary context current on the calling thread (retained, never released).
void make_current(int device);

class Buffer {
 public:
  explicit Buffer(std::size_t bytes = 0);  // on the current device
  ~Buffer();
  Buffer(Buffer&& other) noexcept;
  Buffer& operator=(Buffer&& other) noexcept;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  void* get() const { return ptr_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }
  std::size_t size() const { return bytes_; }
  void upload(const void* host, std::size_t bytes, std::size_t offset = 0);
  void download(void* host, std::size_t bytes, std::size_t offset = 0) const;
  void fill(std::uint8_t byte);  // synchronous

 private:
  void* ptr_ = nullptr;
  std::size_t bytes_ = 0;
};

class StreamHandle {
 public:
  StreamHandle();  // a non-blocking stream on the current context
  ~StreamHandle();
  StreamHandle(const StreamHandle&) = delete;
  StreamHandle& operator=(const StreamHandle&) = delete;
  Stream get() const { return stream_; }
  void synchronize();

 private:
  Stream stream_ = nullptr;
};

class Event {
 public:
  Event();
  ~Event();
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  void record(Stream stream);
  void synchronize();
  float milliseconds_since(const Event& start) const;

 private:
  CUevent_st* event_ = nullptr;
};

// A CUDA graph captured from the calls `record` makes on `stream` (thread-local capture mode),
// replayed with launch().
class Graph {
 public:
  Graph(Stream stream, const std::function<void()>& record);
  ~Graph();
  Graph(const Graph&) = delete;
  Graph& operator=(const Graph&) = delete;
  void launch(Stream stream);

 private:
  CUgraph_st* graph_ = nullptr;
  CUgraphExec_st* exec_ = nullptr;
};

// A cubin the caller compiled itself (a test's own kernels), loaded on the current context.
class Module {
 public:
  explicit Module(const std::vector<char>& cubin);
  ~Module();
  Module(const Module&) = delete;
  Module& operator=(const Module&) = delete;
  // Launches the kernel of lowered name `name`; `args` points at each argument in order.
  void launch(const std::string& name, unsigned grid, unsigned block, void** args, Stream stream);

 private:
  CUlib_st* library_ = nullptr;
};

void copy_async(void* dst, const void* src, std::size_t bytes, Stream stream);
void memset_async(void* dst, std::uint8_t byte, std::size_t bytes, Stream stream);
void synchronize(Stream stream);

// The current context's device traits.
DeviceInfo current_device();

}  // namespace csa::device
