// Offline replay of a routing trace under placement policies, as `keel replay` does it: every
// policy sees the same trace, topology and cost model and is scored on balance, moved state, the
// cost model's simulated step time and planner time. docs/replay.md defines every metric.
#pragma once

#include <string>
#include <vector>

#include "keel/config.hpp"
#include "keel/status.hpp"
#include "keel/trace.hpp"

namespace keel {

struct ReplayRequest {
  const Trace* trace = nullptr;  // required
  // Topology, slots, cost model, estimator and policy parameters. Null: a config that fits the
  // trace (one rank per recorded source, one spare slot per rank), as `keel replay` without
  // --config.
  const Config* config = nullptr;
  std::vector<std::string> policies;  // names (keel/plan.hpp's PolicyNames); empty: all of them
  bool oracle = false;  // plan each step from its own load (an upper bound) instead of estimates
  bool include_series = true;  // each policy's per-step imbalance and simulated seconds
};

// The report as JSON text: the document `keel replay --report` writes (docs/replay.md).
// InvalidArgument for a null or invalid trace, a config the trace does not fit, or an unknown
// policy; a policy's failure names the policy, step and layer.
Result<std::string> ReplayToJson(const ReplayRequest& request);

}  // namespace keel
