// `keel`: the command line. Dispatches to one subcommand per verb.
#include <cstdio>
#include <cstring>
#include <string_view>

#include "keel/version.hpp"
#include "tools/commands.h"

namespace {

constexpr const char* kUsage = R"(keel - keeps Mixture-of-Experts training balanced across GPUs

Usage: keel <command> [flags]      (keel <command> --help for its flags)

Commands:
  demo     train a small MoE model on the CPU through the engine, static placement vs keel,
           and compare step time, imbalance and the final weights (bitwise)
  replay   replay a routing trace under one or more placement policies and report balance,
           moved bytes and simulated step time
  pool     build SmartMoE's pool of parallel strategies per layer from a profiling trace
  plan     plan one placement from a per-expert load (DeepSeek EPLB's inputs and outputs)
  trace    convert recorded routing traces to the Keel format, or generate a synthetic one
  config   print the configuration reference or check a config file
  version  print the version and the optional backends compiled in
)";

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fputs(kUsage, stderr);
    return 2;
  }
  std::string_view command = argv[1];
  if (command == "--help" || command == "-h" || command == "help") {
    std::fputs(kUsage, stdout);
    return 0;
  }
  if (command == "version" || command == "--version") {
    std::printf("keel %s (cuda=%s nccl=%s ucx=%s mpi=%s)\n", keel::kVersion,
                keel::kWithCuda ? "on" : "off", keel::kWithNccl ? "on" : "off",
                keel::kWithUcx ? "on" : "off", keel::kWithMpi ? "on" : "off");
    return 0;
  }
  if (command == "plan") return keel::tools::RunPlan(argc - 1, argv + 1);
  if (command == "replay") return keel::tools::RunReplay(argc - 1, argv + 1);
  if (command == "trace") return keel::tools::RunTrace(argc - 1, argv + 1);
  if (command == "config") return keel::tools::RunConfig(argc - 1, argv + 1);
  if (command == "demo") return keel::tools::RunDemo(argc - 1, argv + 1);
  if (command == "pool") return keel::tools::RunPool(argc - 1, argv + 1);
  std::fprintf(stderr, "keel: unknown command '%s'\n\n%s", argv[1], kUsage);
  return 2;
}
