// `keel plan`'s JSON input (plan_input.h).
#include "tools/plan_input.h"

#include <algorithm>
#include <cmath>
#include <iterator>
#include <string>
#include <string_view>

#include "common/json.h"

namespace keel::tools {
namespace {

using Json = nlohmann::json;

Result<int> PositiveIntField(const Json& input, const char* name) {
  if (!input.contains(name)) return InvalidArgument(std::string("missing field '") + name + "'");
  KEEL_ASSIGN_OR_RETURN(
      const int64_t value,
      JsonInteger(input.at(name), std::string("field '") + name + "'", 1, 1'000'000'000));
  return static_cast<int>(value);
}

}  // namespace

Result<PlanRequest> ParsePlanInput(const Json& input) {
  if (!input.is_object()) return InvalidArgument("input must be a JSON object");
  // The names of DeepSeek's rebalance_experts; anything else is a typo or a misunderstanding, as
  // an unknown config key is.
  constexpr std::string_view kFields[] = {"weight", "num_replicas", "num_groups", "num_nodes",
                                          "num_gpus"};
  for (const auto& [key, value] : input.items()) {
    if (std::find(std::begin(kFields), std::end(kFields), key) != std::end(kFields)) continue;
    std::string known;
    for (std::string_view field : kFields)
      known += (known.empty() ? "" : ", ") + std::string(field);
    return InvalidArgument("unknown field '" + key + "' (known: " + known + ")");
  }
  PlanRequest plan;
  if (!input.contains("weight")) return InvalidArgument("missing field 'weight'");
  const Json& weight = input.at("weight");
  if (!weight.is_array() || weight.empty()) {
    return InvalidArgument("field 'weight' must be a non-empty array of rows (layers x experts)");
  }
  plan.num_layers = static_cast<int>(weight.size());
  for (int layer = 0; layer < plan.num_layers; ++layer) {
    const Json& row = weight[layer];
    const std::string where = "weight[" + std::to_string(layer) + "]";
    if (!row.is_array() || row.empty()) {
      return InvalidArgument(where + " must be a non-empty array of per-expert loads, got " +
                             row.dump());
    }
    if (layer == 0) plan.num_experts = static_cast<int>(row.size());
    if (static_cast<int>(row.size()) != plan.num_experts) {
      return InvalidArgument("ragged rows: " + where + " has " + std::to_string(row.size()) +
                             " entries, weight[0] has " + std::to_string(plan.num_experts));
    }
    for (int e = 0; e < plan.num_experts; ++e) {
      const Json& value = row[e];
      const std::string cell = where + "[" + std::to_string(e) + "]";
      if (!value.is_number()) {
        return InvalidArgument(cell + " is not a number: " + value.dump());
      }
      const double load = value.get<double>();
      if (!std::isfinite(load)) return InvalidArgument(cell + " is not finite");
      if (load < 0) return InvalidArgument(cell + " = " + value.dump() + " is negative");
      plan.weight.push_back(load);
    }
  }
  KEEL_ASSIGN_OR_RETURN(plan.num_replicas, PositiveIntField(input, "num_replicas"));
  KEEL_ASSIGN_OR_RETURN(plan.num_groups, PositiveIntField(input, "num_groups"));
  KEEL_ASSIGN_OR_RETURN(plan.num_nodes, PositiveIntField(input, "num_nodes"));
  KEEL_ASSIGN_OR_RETURN(plan.num_gpus, PositiveIntField(input, "num_gpus"));
  return plan;
}

}  // namespace keel::tools
