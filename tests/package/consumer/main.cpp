// Links csa::csa, calls the C++ API and the C ABI, and catches a csa::Error thrown inside the
// library (type information crosses the library boundary).
#include <csa/csa.h>

#include <csa/csa.hpp>
#include <cstdio>
#include <cstring>

int main() {
  if (std::strcmp(csa::version(), csa_version()) != 0) return 1;
  try {
    csa::validate_shape({4, 512, 3}, 16, 1, 4);  // coff 3 is outside the envelope
    return 1;
  } catch (const csa::Error& e) {
    if (e.code() != csa::Status::kInvalidArgument) return 1;
  }
  std::printf("consumer (C++): csa %s\n", csa_version());
  return 0;
}
