// Subcommands of the `keel` command line. Each takes the arguments after its name and returns the
// process exit code: 0 success, 1 runtime failure, 2 bad usage or invalid input.
#pragma once

namespace keel::tools {

int RunPlan(int argc, char** argv);    // keel plan     (tools/plan_command.cc)
int RunReplay(int argc, char** argv);  // keel replay   (tools/replay_command.cc)
int RunTrace(int argc, char** argv);   // keel trace    (tools/trace_command.cc)
int RunConfig(int argc, char** argv);  // keel config   (tools/config_command.cc)
int RunDemo(int argc, char** argv);    // keel demo     (tools/demo_command.cc)

}  // namespace keel::tools
