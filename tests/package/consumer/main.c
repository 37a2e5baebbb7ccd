/* Links csa::csa (or the flags of pkg-config --cflags --libs csa) from C. */
#include <csa/csa.h>
#include <stdio.h>

int main(void) {
  printf("consumer (C): csa %s\n", csa_version());
  return csa_version()[0] == '\0';
}
