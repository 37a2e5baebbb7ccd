/* The C ABI from a C program: it compiles as C, links libcsa, reports errors through status codes
 * and csa_last_error(), and accepts a call with nothing to do without a GPU. */
#include <stdio.h>
#include <string.h>

#include "csa/csa.h"

static int failures = 0;
#define CHECK(cond)                                                            \
  do {                                                                         \
    if (!(cond)) {                                                             \
      fprintf(stderr, "%s:%d: CHECK(%s) failed\n", __FILE__, __LINE__, #cond); \
      ++failures;                                                              \
    }                                                                          \
  } while (0)

int main(void) {
  _Alignas(16) static uint16_t data[256];
  _Alignas(16) static float ape[256];
  _Alignas(16) static int32_t cu[2] = {0, 16};
  _Alignas(16) static int32_t cuc[2] = {0, 4};
  int rc;

  CHECK(strlen(csa_version()) > 0);

  rc = csa_compressor_forward(data, data, ape, cu, cuc, data, 16, 1, 4, 4, 8, 5, NULL);
  CHECK(rc == CSA_ERROR_INVALID_ARGUMENT);
  CHECK(strstr(csa_last_error(), "coff") != NULL);

  rc = csa_compressor_forward((const char*)data + 2, data, ape, cu, cuc, data, 16, 1, 4, 4, 8, 2,
                              NULL);
  CHECK(rc == CSA_ERROR_INVALID_ARGUMENT);
  CHECK(strstr(csa_last_error(), "aligned") != NULL);

  rc = csa_compressor_backward(data, data, ape, cu, cuc, data, data, data, ape, 16, 1, 4, 4, 8, 2,
                               CSA_ACCUMULATE_GRAD_APE | CSA_DETERMINISTIC | 8u, NULL);
  CHECK(rc == CSA_ERROR_INVALID_ARGUMENT);
  CHECK(strstr(csa_last_error(), "flags") != NULL);

  /* total_comp == 0: nothing to write, so no GPU is needed and a null out is fine. */
  rc = csa_compressor_forward(data, data, ape, cu, cuc, NULL, 16, 1, 0, 4, 8, 2, NULL);
  CHECK(rc == CSA_OK);
  CHECK(strcmp(csa_last_error(), "") == 0);

  rc = csa_prewarm(4, 8, 7, 0);
  CHECK(rc == CSA_ERROR_INVALID_ARGUMENT);

  /* The versioned arguments struct: its size names the version; anything else is rejected
   * before a field is read. */
  {
    csa_compressor_args a;
    memset(&a, 0, sizeof a);
    CHECK(sizeof a == CSA_COMPRESSOR_ARGS_SIZE_V3);
    a.struct_size = sizeof a;
    a.ratio = 4;
    a.head_dim = 8;
    a.coff = 2;
    a.dtype = CSA_DTYPE_FP16;
    a.layout = CSA_LAYOUT_THD;
    a.kv = data;
    a.score = data;
    a.ape = ape;
    a.cu_seqlens = cu;
    a.cu_seqlens_comp = cuc;
    a.total_tokens = 16;
    a.num_segments = 1;
    a.total_comp = 0; /* nothing to write: no GPU needed */
    rc = csa_compressor_forward_ex(&a, NULL);
    CHECK(rc == CSA_OK);

    a.struct_size = 0;
    rc = csa_compressor_forward_ex(&a, NULL);
    CHECK(rc == CSA_ERROR_INVALID_ARGUMENT);
    CHECK(strstr(csa_last_error(), "struct_size is 0") != NULL);
    a.struct_size = sizeof a - 4; /* a smaller struct this library does not know */
    rc = csa_compressor_backward_ex(&a, NULL);
    CHECK(rc == CSA_ERROR_INVALID_ARGUMENT);
    CHECK(strstr(csa_last_error(), "struct_size") != NULL);
    a.struct_size = sizeof a + 8; /* a newer one */
    rc = csa_prewarm_ex(&a, 0);
    CHECK(rc == CSA_ERROR_INVALID_ARGUMENT);
    CHECK(strstr(csa_last_error(), "struct_size") != NULL);
    rc = csa_compressor_forward_ex(NULL, NULL);
    CHECK(rc == CSA_ERROR_INVALID_ARGUMENT);
    CHECK(strstr(csa_last_error(), "args is null") != NULL);

    /* A version-1 caller's struct (it ends at grad_ape): its later fields are not read. */
    a.struct_size = CSA_COMPRESSOR_ARGS_SIZE_V1;
    a.tail_flags = 0xdead;
    rc = csa_compressor_forward_ex(&a, NULL);
    CHECK(rc == CSA_OK);
    a.struct_size = sizeof a;
    rc = csa_compressor_forward_ex(&a, NULL);
    CHECK(rc == CSA_ERROR_INVALID_ARGUMENT);
    CHECK(strstr(csa_last_error(), "tail_flags") != NULL);
    a.tail_flags = CSA_TAIL_NORM; /* without its weight */
    rc = csa_compressor_forward_ex(&a, NULL);
    CHECK(rc == CSA_ERROR_INVALID_ARGUMENT);
    CHECK(strstr(csa_last_error(), "norm_weight") != NULL);
    a.tail_flags = 0;
    a.rope_dim = 3; /* odd */
    rc = csa_compressor_forward_ex(&a, NULL);
    CHECK(rc == CSA_ERROR_INVALID_ARGUMENT);
    CHECK(strstr(csa_last_error(), "rope_dim") != NULL);
    a.rope_dim = 0;
    /* Version 3's pooled rows: with a tail only; a version-2 struct ends before them. */
    a.pooled = (float*)ape;
    rc = csa_compressor_forward_ex(&a, NULL);
    CHECK(rc == CSA_ERROR_INVALID_ARGUMENT);
    CHECK(strstr(csa_last_error(), "pooled is set") != NULL);
    a.struct_size = CSA_COMPRESSOR_ARGS_SIZE_V2;
    rc = csa_compressor_forward_ex(&a, NULL);
    CHECK(rc == CSA_OK);
    a.struct_size = sizeof a;
    a.pooled = NULL;
    a.reserved2 = 1;
    rc = csa_compressor_forward_ex(&a, NULL);
    CHECK(rc == CSA_ERROR_INVALID_ARGUMENT);
    CHECK(strstr(csa_last_error(), "reserved2") != NULL);
    a.reserved2 = 0;

    a.reserved = 1;
    rc = csa_compressor_forward_ex(&a, NULL);
    CHECK(rc == CSA_ERROR_INVALID_ARGUMENT);
    CHECK(strstr(csa_last_error(), "reserved") != NULL);
    a.reserved = 0;

    a.kv_stride = 12; /* below the width 16 */
    rc = csa_compressor_forward_ex(&a, NULL);
    CHECK(rc == CSA_ERROR_INVALID_ARGUMENT);
    CHECK(strstr(csa_last_error(), "kv_stride") != NULL);
    a.kv_stride = 20; /* fp16 rows of head_dim 8 are read 16 bytes at a time */
    rc = csa_compressor_forward_ex(&a, NULL);
    CHECK(rc == CSA_ERROR_INVALID_ARGUMENT);
    CHECK(strstr(csa_last_error(), "multiple of 8") != NULL);
    a.kv_stride = 32;
    rc = csa_compressor_forward_ex(&a, NULL);
    CHECK(rc == CSA_OK);

    a.dtype = 7;
    rc = csa_compressor_forward_ex(&a, NULL);
    CHECK(rc == CSA_ERROR_INVALID_ARGUMENT);
    CHECK(strstr(csa_last_error(), "dtype") != NULL);
    a.dtype = CSA_DTYPE_BF16;

    a.layout = CSA_LAYOUT_SBHD; /* offsets are THD's */
    rc = csa_compressor_forward_ex(&a, NULL);
    CHECK(rc == CSA_ERROR_INVALID_ARGUMENT);
    CHECK(strstr(csa_last_error(), "cu_seqlens") != NULL);
    a.cu_seqlens = NULL;
    a.cu_seqlens_comp = NULL;
    a.num_segments = 0;
    rc = csa_compressor_forward_ex(&a, NULL);
    CHECK(rc == CSA_ERROR_INVALID_ARGUMENT);
    CHECK(strstr(csa_last_error(), "batch") != NULL);
    a.num_segments = 2; /* S = 8, B = 2: 16 rows in, (8 / 4) * 2 = 4 rows out */
    a.seq_len = 8;
    a.total_comp = 3;
    rc = csa_compressor_forward_ex(&a, NULL);
    CHECK(rc == CSA_ERROR_INVALID_ARGUMENT);
    CHECK(strstr(csa_last_error(), "total_comp is 3") != NULL);

    a.flags = CSA_DETERMINISTIC;
    a.total_comp = 4;
    rc = csa_compressor_forward_ex(&a, NULL);
    CHECK(rc == CSA_ERROR_INVALID_ARGUMENT);
    CHECK(strstr(csa_last_error(), "flags") != NULL);
  }

  /* The state as JSON, with or without a driver. */
  {
    const char* info = csa_info_json();
    CHECK(info != NULL);
    if (info != NULL) {
      CHECK(strstr(info, "\"default_configs\"") != NULL);
      CHECK(strstr(info, "\"cache\"") != NULL);
      CHECK(strstr(info, csa_version()) != NULL);
    }
  }
  /* A device that does not exist: an error either way (no driver, or no such device). */
  rc = csa_set_device(1000);
  CHECK(rc == CSA_ERROR_DRIVER_UNAVAILABLE || rc == CSA_ERROR_INVALID_ARGUMENT);
  CHECK(strlen(csa_last_error()) > 0);

  if (failures == 0) printf("c_abi_test: all checks passed\n");
  return failures == 0 ? 0 : 1;
}
