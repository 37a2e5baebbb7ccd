// Launch-side helpers the service's translation units share: grid arithmetic, stream-ordered
// scratch memory, and filling the kernels' by-value parameter structs.
#pragma once

#include <cstdint>

#include "csa/csa.hpp"
#include "csa_params.h"
#include "driver/driver.hpp"

namespace csa::compressor::detail {

inline unsigned blocks_for(std::int64_t threads, unsigned per_block) {
  return static_cast<unsigned>((threads + per_block - 1) / per_block);
}

// Stream-ordered scratch memory: freed on the stream after the kernels that use it.
class StreamScratch {
 public:
  StreamScratch(const driver::Driver& driver, std::size_t bytes, CUstream stream)
      : driver_(driver), stream_(stream) {
    driver_.check(driver_.api().cuMemAllocAsync(&ptr_, bytes, stream_),
                  "cuMemAllocAsync (grad_ape workspace)");
  }
  ~StreamScratch() { driver_.api().cuMemFreeAsync(ptr_, stream_); }
  StreamScratch(const StreamScratch&) = delete;
  StreamScratch& operator=(const StreamScratch&) = delete;
  CUdeviceptr get() const { return ptr_; }

 private:
  const driver::Driver& driver_;
  CUstream stream_;
  CUdeviceptr ptr_ = 0;
};

// The inputs and sizes both kernel parameter structs share. Sizes fit int32: validated.
template <typename Params, typename Args>
void fill_inputs(Params& params, const Args& a) {
  params.kv = static_cast<const csa_u16*>(a.kv);
  params.score = static_cast<const csa_u16*>(a.score);
  params.ape = a.ape;
  params.cu_seqlens = a.cu_seqlens;
  params.cu_seqlens_comp = a.cu_seqlens_comp;
  params.total_tokens = static_cast<csa_i32>(a.total_tokens);
  params.num_segments = a.num_segments;
  params.total_comp = static_cast<csa_i32>(a.total_comp);
}

template <typename T>
T* device_ptr(CUdeviceptr p) {
  return reinterpret_cast<T*>(static_cast<std::uintptr_t>(p));
}

}  // namespace csa::compressor::detail
