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

/* ---- Versioned arguments (csa 0.2 and newer) -------------------------------------------------
 * One struct for every option of a call: element type, layout, row strides, shapes, flags.
 * Zero it, set struct_size = sizeof(csa_compressor_args), then the fields the call needs; a
 * zero stride means dense rows and the zero value of every other option is the behaviour of the
 * functions above. Later versions only append fields: the library tells versions apart by
 * struct_size and rejects a size it does not know. */
typedef enum csa_dtype { CSA_DTYPE_BF16 = 0, CSA_DTYPE_FP16 = 1, CSA_DTYPE_FP32 = 2 } csa_dtype;
typedef enum csa_layout { CSA_LAYOUT_THD = 0, CSA_LAYOUT_SBHD = 1 } csa_layout;

typedef struct csa_compressor_args {
  uint64_t struct_size; /* sizeof(csa_compressor_args) of the caller's header */
  int32_t ratio;
  int32_t head_dim;
  int32_t coff;
  int32_t dtype;  /* csa_dtype: kv, score, out, grad_out, grad_kv, grad_score (ape: fp32) */
  int32_t layout; /* csa_layout */
  uint32_t flags; /* backward: CSA_ACCUMULATE_GRAD_APE | CSA_DETERMINISTIC */
  /* THD: rows of the packed buffers and segments; SBHD: total_tokens = seq_len * num_segments
   * (S * B), total_comp = (seq_len / ratio) * num_segments, num_segments = B, no offsets. */
  int64_t total_tokens;
  int64_t total_comp;
  int64_t seq_len;
  int32_t num_segments;
  int32_t reserved; /* must be 0 */
  /* Elements from one row to the next; 0: dense (coff*head_dim, or head_dim for out and
   * grad_out). A stride keeps rows as aligned as dense rows (a multiple of the 16-byte vector
   * or of head_dim's largest power of two, whichever is smaller). */
  int64_t kv_stride;
  int64_t score_stride;
  int64_t out_stride;
  int64_t grad_out_stride;
  int64_t grad_kv_stride;
  int64_t grad_score_stride;
  const void* kv;
  const void* score;
  const float* ape;
  const int32_t* cu_seqlens;      /* THD only */
  const int32_t* cu_seqlens_comp; /* THD only */
  void* out;                      /* forward */
  const void* grad_out;           /* backward */
  void* grad_kv;
  void* grad_score;
  float* grad_ape;
  /* ---- version 2: the fused tail after the pooling, y = H(rope(rmsnorm(x) * w)) in fp32 with
   * one rounding of y; the backward takes grad_y in grad_out and writes grad_norm_weight. */
  uint32_t tail_flags;     /* CSA_TAIL_NORM | CSA_TAIL_NORM_WEIGHT_BF16 | CSA_TAIL_ROPE_HALF_SPLIT |
                              CSA_TAIL_HADAMARD; 0 with rope_dim 0: no tail */
  int32_t rope_dim;        /* RoPE on the last rope_dim columns (even, <= head_dim); 0: none */
  float eps;               /* CSA_TAIL_NORM: > 0 */
  int32_t reserved2;       /* must be 0 */
  int64_t rope_max_blocks; /* rows of rope_cos / rope_sin */
  const void* norm_weight; /* CSA_TAIL_NORM: (head_dim,) fp32, or bf16 with the flag */
  const float* rope_cos;   /* (rope_max_blocks, rope_dim / 2), row = the row's block */
  const float* rope_sin;
  float* rstd;             /* forward, optional with CSA_TAIL_NORM: (total_comp,) fp32 */
  float* grad_norm_weight; /* backward with CSA_TAIL_NORM: (head_dim,) fp32, overwritten
                              unless CSA_ACCUMULATE_GRAD_APE, like grad_ape */
  /* ---- version 3: the pooled rows before the tail, for the backward: (total_comp, head_dim)
   * fp32, dense, 16-byte aligned. Forward: optional output. Backward: required by the
   * long-window family's tail (ratio > 16) with CSA_TAIL_NORM; in the short-window family it
   * selects the backward's row-stats form (CSA_TAIL_NORM without CSA_TAIL_HADAMARD only).
   * Null without a tail. */
  float* pooled;
} csa_compressor_args;

/* tail_flags */
#define CSA_TAIL_NORM 1u
#define CSA_TAIL_NORM_WEIGHT_BF16 2u
#define CSA_TAIL_ROPE_HALF_SPLIT 4u /* RoPE pairs (i, i + rope_dim/2), not (2i, 2i+1) */
#define CSA_TAIL_HADAMARD 8u        /* head_dim a power of two; scaled by head_dim^-1/2 */

/* struct_size of the first version of csa_compressor_args (every field up to grad_ape), of the
 * second (the tail's fields) and of the third (pooled). The library takes any of them. */
#define CSA_COMPRESSOR_ARGS_SIZE_V1 ((uint64_t)(8 + 6 * 4 + 3 * 8 + 2 * 4 + 6 * 8 + 10 * 8))
#define CSA_COMPRESSOR_ARGS_SIZE_V2 (CSA_COMPRESSOR_ARGS_SIZE_V1 + (uint64_t)(4 * 4 + 8 + 5 * 8))
#define CSA_COMPRESSOR_ARGS_SIZE_V3 (CSA_COMPRESSOR_ARGS_SIZE_V2 + (uint64_t)8)

CSA_API int csa_compressor_forward_ex(const csa_compressor_args* args, void* stream);
CSA_API int csa_compressor_backward_ex(const csa_compressor_args* args, void* stream);
/* Compiles or loads every kernel of args' configuration (ratio, head_dim, coff, dtype, layout,
 * and from version 2 tail_flags and rope_dim) for `device`, and with any nonzero stride field the
 * kernels of THD calls with row strides too; the other fields are not read. */
CSA_API int csa_prewarm_ex(const csa_compressor_args* args, int device);

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
