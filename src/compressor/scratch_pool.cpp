#include "compressor/scratch_pool.hpp"

#include <algorithm>
#include <string>

#include "common/error.hpp"

namespace csa::compressor {

namespace {

unsigned long long current_context_id(const driver::Driver& d) {
  CUcontext ctx = nullptr;
  d.check(d.api().cuCtxGetCurrent(&ctx), "cuCtxGetCurrent");
  unsigned long long id = 0;
  d.check(d.api().cuCtxGetId(ctx, &id), "cuCtxGetId");
  return id;
}

}  // namespace

ScratchPool::~ScratchPool() {
  std::string why;
  driver::Driver* d = loader_.try_get(&why);
  if (d == nullptr) return;
  // Errors are ignored: at process exit the driver may already be shutting down.
  for (const auto& w : workspaces_) d->api().cuMemFree(w.ptr);
  for (const auto& slab : capture_slabs_) d->api().cuMemFree(slab.ptr);
}

CUdeviceptr ScratchPool::stream_workspace(CUstream stream, bool capturing, std::size_t bytes,
                                          Use use) {
  if (capturing) return 0;
  driver::Driver& d = loader_.get();
  unsigned long long stream_id = 0;
  d.check(d.api().cuStreamGetId(stream, &stream_id), "cuStreamGetId");
  // The driver documents a stream's id as unique for the life of the process, so a stream the
  // application created needs nothing else (a recycled handle has a new id). The special
  // handles (the NULL stream, CU_STREAM_LEGACY, CU_STREAM_PER_THREAD) exist once per context:
  // only they are told apart by the context's id too, which costs two more driver queries.
  const bool per_context =
      stream == nullptr || stream == CU_STREAM_LEGACY || stream == CU_STREAM_PER_THREAD;
  const unsigned long long context_id = per_context ? current_context_id(d) : 0;
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = std::find_if(workspaces_.begin(), workspaces_.end(), [&](const StreamWorkspace& w) {
    return w.context_id == context_id && w.stream_id == stream_id && w.use == use;
  });
  if (it != workspaces_.end() && it->bytes >= bytes) return it->ptr;
  const std::size_t grown = std::max<std::size_t>(bytes, 1 << 20);
  CUdeviceptr ptr = 0;
  d.check(d.api().cuMemAllocAsync(&ptr, grown, stream), "cuMemAllocAsync (grad_ape workspace)");
  if (use == Use::kClaimWords) {
    // Zeroed once: every launch leaves the words as it found them (claim_await_zeroed resets them).
    d.check(d.api().cuMemsetD32Async(ptr, 0, grown / sizeof(std::uint32_t), stream),
            "cuMemsetD32Async (grad_ape claim words)");
  }
  if (it != workspaces_.end()) {
    // Stream-ordered: freed after every kernel already queued on this stream that uses it.
    d.api().cuMemFreeAsync(it->ptr, stream);
    it->ptr = ptr;
    it->bytes = grown;
  } else {
    workspaces_.push_back({context_id, stream_id, use, ptr, grown});
  }
  return ptr;
}

CUdeviceptr ScratchPool::claim_words(std::int64_t column_blocks, bool capturing, CUstream stream) {
  const std::size_t bytes = static_cast<std::size_t>(column_blocks) * sizeof(unsigned long long);
  if (capturing) return take_capture_words(bytes);
  if (capture_words_low_.load(std::memory_order_relaxed)) refill_capture_words();
  return stream_workspace(stream, false, bytes, Use::kClaimWords);
}

CUdeviceptr ScratchPool::take_capture_words(std::size_t bytes) {
  driver::Driver& d = loader_.get();
  const unsigned long long context_id = current_context_id(d);
  const std::size_t need =
      (bytes + kCaptureWordsAlign - 1) / kCaptureWordsAlign * kCaptureWordsAlign;
  std::lock_guard<std::mutex> lock(mutex_);
  std::size_t left = 0;
  CUdeviceptr taken = 0;
  for (auto& slab : capture_slabs_) {
    if (slab.context_id != context_id) continue;
    if (taken == 0 && slab.bytes - slab.used >= need) {
      taken = slab.ptr + slab.used;
      slab.used += need;
    }
    left += slab.bytes - slab.used;
  }
  if (left < kCaptureSlabBytes / 4) capture_words_low_.store(true, std::memory_order_relaxed);
  if (taken == 0) {
    logger_.debug(
        "no claim words left for a captured backward ({} bytes): it keeps the form "
        "without them; an eager backward on this context allocates more",
        bytes);
  }
  return taken;
}

void ScratchPool::refill_capture_words() {
  driver::Driver& d = loader_.get();
  const auto& api = d.api();
  const unsigned long long context_id = current_context_id(d);
  std::lock_guard<std::mutex> lock(mutex_);
  std::size_t left = 0;
  for (const auto& slab : capture_slabs_)
    if (slab.context_id == context_id) left += slab.bytes - slab.used;
  if (left < kCaptureSlabBytes / 4) {
    // Zeroed on a stream of its own and waited for: the words must be zero for a graph replayed
    // on any stream, and no caller's stream is held up. Stream-ordered allocation, so that a
    // capture running in another thread is not disturbed.
    CUstream own = nullptr;
    d.check(api.cuStreamCreate(&own, CU_STREAM_NON_BLOCKING), "cuStreamCreate (claim words)");
    CUdeviceptr ptr = 0;
    CUresult r = api.cuMemAllocAsync(&ptr, kCaptureSlabBytes, own);
    if (r == CUDA_SUCCESS) {
      r = api.cuMemsetD32Async(ptr, 0, kCaptureSlabBytes / sizeof(std::uint32_t), own);
      if (r == CUDA_SUCCESS) r = api.cuStreamSynchronize(own);
      if (r != CUDA_SUCCESS) api.cuMemFreeAsync(ptr, own);
    }
    api.cuStreamDestroy(own);
    d.check(r, "allocating and zeroing claim words for captured backwards");
    capture_slabs_.push_back({context_id, ptr, kCaptureSlabBytes, 0});
  }
  capture_words_low_.store(false, std::memory_order_relaxed);
}

void ScratchPool::set_aside_capture_words(int device) {
  if (!capture_words_low_.load(std::memory_order_relaxed)) return;
  driver::Driver& d = loader_.get();
  CUcontext ctx = nullptr;
  CUdevice current = 0;
  if (d.api().cuCtxGetCurrent(&ctx) != CUDA_SUCCESS || ctx == nullptr ||
      d.api().cuCtxGetDevice(&current) != CUDA_SUCCESS || static_cast<int>(current) != device)
    return;  // the calls will run in a context not current here: the first eager call does it
  try {
    refill_capture_words();
  } catch (const Error& e) {
    // Best effort: without them, captured calls take the forms without claim words.
    logger_.warn("setting aside claim words for captured backwards failed: {}", e.what());
  }
}

}  // namespace csa::compressor
