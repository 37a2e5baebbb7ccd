// Scratch memory of the backward launches, owned by one Service: per-stream workspaces (the
// fixed-order grad_ape partials; the atomic form's claim words) and, for calls captured into
// CUDA graphs, claim words of each call's own.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <vector>

#include "common/logger.hpp"
#include "driver/loader.hpp"

namespace csa::compressor {

class ScratchPool {
 public:
  ScratchPool(driver::Loader& loader, Logger& logger) : loader_(loader), logger_(logger) {}
  ~ScratchPool();  // frees everything; driver errors are ignored (process exit)
  ScratchPool(const ScratchPool&) = delete;
  ScratchPool& operator=(const ScratchPool&) = delete;

  // kClaimWords: zeroed when allocated; every launch leaves them so (the claim protocol,
  // kernels/csa_common.cuh).
  enum class Use { kPartials, kClaimWords };
  // A workspace of at least `bytes` usable in stream order on `stream`, grown on demand, or 0
  // when the stream is `capturing` (the caller's one query per call; it then allocates inside
  // the graph).
  // NOTE: keyed by the driver's unique context and stream ids, never by handle values, which
  // can be reused after a stream is destroyed while its work is still running.
  CUdeviceptr stream_workspace(CUstream stream, bool capturing, std::size_t bytes,
                               Use use = Use::kPartials);

  // The claim words of an atomic-grad_ape backward that overwrites grad_ape, 8 bytes per
  // column block: the stream's outside capture, the call's own under capture; 0 where there
  // are none.
  CUdeviceptr claim_words(std::int64_t column_blocks, bool capturing, CUstream stream);

  // After prewarm or a plan's prepare on `device`: sets aside claim words for captured calls
  // when the current context is on that device, so that graphs captured before any eager
  // backward get them too; best effort (a failure is logged, never raised).
  void set_aside_capture_words(int device);

  static constexpr std::size_t kCaptureSlabBytes = 64 << 10;
  static constexpr std::size_t kCaptureWordsAlign = 256;

 private:
  struct StreamWorkspace {
    // 0 for an application-created stream: its id is unique for the life of the process.
    unsigned long long context_id = 0;
    unsigned long long stream_id = 0;
    Use use = Use::kPartials;
    CUdeviceptr ptr = 0;
    std::size_t bytes = 0;
  };
  // Claim words for captured calls. A graph replays a launch with the words it was captured
  // with, so every captured call takes words of its own, never handed out again (the graph
  // may be replayed for as long as the Runtime lives), from slabs zeroed when they were
  // allocated, one list per context. Slabs are allocated outside capture only (an eager
  // atomic backward or set_aside_capture_words while capture_words_low_): a call captured
  // with none left takes the form without claim words (the fixed order, or a memset).
  // NOTE: one graph's words serve one replay at a time: two instantiations of one captured
  // graph must not run concurrently (CUDA already serializes replays of one instantiation).
  struct CaptureSlab {
    unsigned long long context_id = 0;
    CUdeviceptr ptr = 0;
    std::size_t bytes = 0;
    std::size_t used = 0;
  };
  // Under capture: `bytes` of zeroed claim words for this call alone, or 0 when none are left.
  CUdeviceptr take_capture_words(std::size_t bytes);
  // Outside capture: a new slab for the current context when its slabs are running low.
  void refill_capture_words();

  driver::Loader& loader_;
  Logger& logger_;
  std::mutex mutex_;  // guards workspaces_ and capture_slabs_
  std::vector<StreamWorkspace> workspaces_;
  std::vector<CaptureSlab> capture_slabs_;
  std::atomic<bool> capture_words_low_{true};
};

}  // namespace csa::compressor
