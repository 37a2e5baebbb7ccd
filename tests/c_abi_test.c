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
