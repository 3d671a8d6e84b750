// Subcommands of the `keel` command line. Each takes the arguments after its name and returns the
// process exit code: 0 success, 1 runtime failure, 2 bad usage or invalid input.
#pragma once

#include <string>

#include "common/config.h"
#include "keel/trace.hpp"

namespace keel::tools {

int RunPlan(int argc, char** argv);    // keel plan     (tools/plan_command.cc)
int RunReplay(int argc, char** argv);  // keel replay   (tools/replay_command.cc)
int RunTrace(int argc, char** argv);   // keel trace    (tools/trace_command.cc)
int RunConfig(int argc, char** argv);  // keel config   (tools/config_command.cc)
int RunDemo(int argc, char** argv);    // keel demo     (tools/demo_command.cc)
int RunPool(int argc, char** argv);    // keel pool     (tools/pool_command.cc)

// `keel replay --strategy`: replays `trace` under the strategies in `options` (with the pool in
// `pool_path` when given), prints the table and writes the report and plot when their paths are
// given. Returns the exit code. (tools/pool_command.cc)
struct StrategyReplayOptions;
int RunStrategyReplay(const Trace& trace, const KeelConfig& config, StrategyReplayOptions options,
                      const std::string& pool_path, const std::string& report_path,
                      const std::string& plot_path, bool quiet);

}  // namespace keel::tools
