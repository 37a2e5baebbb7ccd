/* csa: fused CUDA kernels for the CSA/HCA Compressor (gated-softmax pooling), C ABI.
 * The signatures below are a stable contract. Every call returns 0 (CSA_OK) on success, else a
 * nonzero csa_status; csa_last_error() explains the last failure of the calling thread. */
#ifndef CSA_CSA_H
#define CSA_CSA_H

#include <stdint.h>

#include "csa/export.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum csa_status {
  CSA_OK = 0,
  CSA_ERROR_INVALID_ARGUMENT = 1,
  CSA_ERROR_UNSUPPORTED = 2,
  CSA_ERROR_DRIVER_UNAVAILABLE = 3,
  CSA_ERROR_DRIVER = 4,
  CSA_ERROR_COMPILE = 5,
  CSA_ERROR_CACHE = 6,
  CSA_ERROR_CAPTURE_UNSAFE = 7,
  CSA_ERROR_JIT_DISABLED = 8,
  CSA_ERROR_INTERNAL = 9
} csa_status;

/* Backward flags. */
#define CSA_ACCUMULATE_GRAD_APE 1u /* add into grad_ape instead of overwriting it */
#define CSA_DETERMINISTIC 2u       /* fixed-order grad_ape reduction, bitwise run to run */

CSA_API int csa_compressor_forward(const void* kv, const void* score, const float* ape,
                                   const int32_t* cu_seqlens, const int32_t* cu_seqlens_comp,
                                   void* out, int64_t total_tokens, int32_t num_segments,
                                   int64_t total_comp, int32_t ratio, int32_t head_dim,
                                   int32_t coff, void* stream);

CSA_API int csa_compressor_backward(const void* kv, const void* score, const float* ape,
                                    const int32_t* cu_seqlens, const int32_t* cu_seqlens_comp,
                                    const void* grad_out, void* grad_kv, void* grad_score,
                                    float* grad_ape, int64_t total_tokens, int32_t num_segments,
                                    int64_t total_comp, int32_t ratio, int32_t head_dim,
                                    int32_t coff, uint32_t flags, void* stream);

/* Compiles (or loads from the disk cache) every kernel of one configuration for `device`. */
CSA_API int csa_prewarm(int32_t ratio, int32_t head_dim, int32_t coff, int device);

CSA_API const char* csa_last_error(void);
CSA_API const char* csa_version(void);

/* Makes `device`'s primary context (the one the CUDA runtime and frameworks use) current on the
 * calling thread, unless a context of that device already is: the calls above launch in the
 * calling thread's current context. Cheap when nothing changes. */
CSA_API int csa_set_device(int32_t device);

/* The library, NVRTC, driver, device and cache state as one JSON object (thread-local text,
 * valid until the thread's next call of this function); NULL on failure (csa_last_error()). */
CSA_API const char* csa_info_json(void);

#ifdef __cplusplus
}
#endif

#endif /* CSA_CSA_H */
