// The csa command-line tool. Exit codes: 0 success, 1 a failure (a csa::Error or another
// error while running), 2 a usage error (an option, value or configuration the command cannot
// take; the message names it).
#include <fmt/format.h>

#include <memory>

#include "commands.hpp"

int main(int argc, char** argv) try {
  CLI::App app{
      "csa: fused CUDA kernels for the CSA/HCA Compressor (runtime-compiled with NVRTC).\n"
      "A configuration is written ratio=R,coff=C,head_dim=D (short form: R,C,D)."};
  app.require_subcommand(1);
  app.set_version_flag("--version", csa::version());
  // One Runtime for the process, built after parsing so that commands may adjust options.
  std::unique_ptr<csa::Runtime> owned;
  csa::Runtime* runtime = nullptr;
  app.parse_complete_callback([&] {
    owned = std::make_unique<csa::Runtime>();
    runtime = owned.get();
  });
  csa::tools::add_info_command(app, runtime);
  csa::tools::add_prewarm_command(app, runtime);
  csa::tools::add_cache_command(app, runtime);
  csa::tools::add_bench_command(app, runtime);
  csa::tools::add_schedule_command(app, runtime);
  csa::tools::add_tune_command(app, runtime);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int code = app.exit(e);  // prints help, the version, or the usage error
    return code == 0 ? 0 : 2;
  } catch (const std::exception& e) {  // csa::Error and anything else: a message, exit 1
    fmt::print(stderr, "{}\n", e.what());
    return 1;
  }
  return 0;
} catch (...) {
  std::fputs("csa: unexpected error\n", stderr);
  return 1;
}
