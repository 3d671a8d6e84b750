// `keel plan`'s JSON input: DeepSeek EPLB's arguments (weight, num_replicas, num_groups,
// num_nodes, num_gpus) as a PlanRequest. Its own file so that the fuzz target reads input exactly
// as the command does.
#pragma once

#include <nlohmann/json.hpp>

#include "keel/plan.hpp"
#include "keel/status.hpp"

namespace keel::tools {

// The request `input` describes (policy eplb); errors name the field, row or cell.
Result<PlanRequest> ParsePlanInput(const nlohmann::json& input);

}  // namespace keel::tools
