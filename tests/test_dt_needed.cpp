// libcsa.so must load where there is no GPU driver and no fmt/spdlog: its DT_NEEDED entries
// may name NVRTC and the C/C++ runtime only.
#include <gtest/gtest.h>

#include <cstdio>
#include <string>

namespace {

TEST(LibraryDependencies, NoDriverFmtOrSpdlog) {
  const std::string command = std::string("readelf -d '") + CSA_LIBRARY_PATH + "'";
  FILE* pipe = ::popen(command.c_str(), "r");
  ASSERT_NE(pipe, nullptr);
  std::string needed;
  char line[512];
  while (std::fgets(line, sizeof line, pipe) != nullptr) {
    const std::string s(line);
    if (s.find("(NEEDED)") != std::string::npos) needed += s;
  }
  ASSERT_EQ(::pclose(pipe), 0) << command;
  ASSERT_FALSE(needed.empty()) << "readelf printed no NEEDED entries";
  EXPECT_NE(needed.find("libnvrtc"), std::string::npos) << needed;
  for (const char* banned :
       {"libcuda", "libcudart", "libfmt", "libspdlog", "libxxhash", "libnlohmann"}) {
    EXPECT_EQ(needed.find(banned), std::string::npos) << banned << " in\n" << needed;
  }
}

}  // namespace
