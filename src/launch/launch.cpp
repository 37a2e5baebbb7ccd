#include "launch/launch.hpp"

#include "common/error.hpp"

namespace csa::launch {

bool is_capturing(const driver::Driver& driver, CUstream stream) {
  CUstreamCaptureStatus status = CU_STREAM_CAPTURE_STATUS_NONE;
  driver.check(driver.api().cuStreamIsCapturing(stream, &status), "cuStreamIsCapturing");
  return status != CU_STREAM_CAPTURE_STATUS_NONE;
}

void ensure_not_capturing(const driver::Driver& driver, CUstream stream, const std::string& action,
                          const std::string& config, const std::string& prewarm_spec) {
  if (!is_capturing(driver, stream)) return;
  fail(Status::kCaptureUnsafe,
       "{} for {} would happen while the stream is capturing a CUDA graph; prewarm this "
       "configuration before capture (`csa prewarm --config {}`, Runtime::prewarm or "
       "csa_prewarm), then capture again",
       action, config, prewarm_spec);
}

}  // namespace csa::launch
