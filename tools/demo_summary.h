// What `keel demo` prints and reports once its runs are done: the runs' table, the comparison
// its mode asks for against the targets, the check of the final weights, and the JSON report.
#pragma once

#include <vector>

#include "keel/status.hpp"
#include "tools/demo_options.h"
#include "tools/demo_report.h"

namespace keel::tools {

// Prints the runs' comparison (rank 0 only) and writes --report. Returns the exit code: 1 when
// the final weights differ where they must not, or a mode's own check failed; an error when the
// report cannot be written. Every rank calls it and gets the same code.
Result<int> ReportDemo(const DemoFlags& flags, const DemoSetup& setup,
                       const std::vector<ModeRun>& runs);

}  // namespace keel::tools
