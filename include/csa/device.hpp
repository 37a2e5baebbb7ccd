// Small device utilities over the Runtime's driver table, for tests, benchmarks and tools that
// must not link libcuda or the CUDA runtime: a device buffer, a stream, events and copies.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>

#include "csa/csa.hpp"

struct CUevent_st;
struct CUgraph_st;
struct CUgraphExec_st;

namespace csa::device {

// Makes `device`'s primary context current on the calling thread (retained by the Runtime).
CSA_API void make_current(Runtime& runtime, int device);
// The same, unless a context of `device` is already current (then nothing changes).
CSA_API void ensure_current(Runtime& runtime, int device);

class CSA_API Buffer {
 public:
  Buffer(Runtime& runtime, std::size_t bytes);  // on the current device
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
  Runtime* runtime_ = nullptr;
  void* ptr_ = nullptr;
  std::size_t bytes_ = 0;
};

class CSA_API StreamHandle {
 public:
  explicit StreamHandle(Runtime& runtime);  // a non-blocking stream on the current context
  ~StreamHandle();
  StreamHandle(const StreamHandle&) = delete;
  StreamHandle& operator=(const StreamHandle&) = delete;
  Stream get() const { return stream_; }
  void synchronize();

 private:
  Runtime* runtime_;
  Stream stream_ = nullptr;
};

class CSA_API Event {
 public:
  explicit Event(Runtime& runtime);
  ~Event();
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  void record(Stream stream);
  void synchronize();
  float milliseconds_since(const Event& start) const;

 private:
  Runtime* runtime_;
  CUevent_st* event_ = nullptr;
};

// A CUDA graph captured from the calls `record` makes on `stream` (thread-local capture mode),
// replayed with launch().
class CSA_API Graph {
 public:
  Graph(Runtime& runtime, Stream stream, const std::function<void()>& record);
  ~Graph();
  Graph(const Graph&) = delete;
  Graph& operator=(const Graph&) = delete;
  void launch(Stream stream);

 private:
  Runtime* runtime_;
  CUgraph_st* graph_ = nullptr;
  CUgraphExec_st* exec_ = nullptr;
};

CSA_API void copy_async(Runtime& runtime, void* dst, const void* src, std::size_t bytes,
                        Stream stream);
CSA_API void memset_async(Runtime& runtime, void* dst, std::uint8_t byte, std::size_t bytes,
                          Stream stream);
CSA_API void synchronize(Runtime& runtime, Stream stream);

// The current context's device traits.
CSA_API DeviceInfo current_device(Runtime& runtime);

}  // namespace csa::device
