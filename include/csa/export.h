// Symbol visibility for libcsa.so: everything is hidden unless marked CSA_API.
#pragma once
#if defined(CSA_BUILDING_LIBRARY)
#define CSA_API __attribute__((visibility("default")))
#else
#define CSA_API
#endif
