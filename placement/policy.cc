// The policy factory and the defaults shared by every policy.
#include "placement/policy.h"

#include <string>

namespace keel {

Result<Placement> Policy::Initial(int /*layer*/) {
  return Placement::Contiguous(context_.num_experts, context_.topology.num_ranks(),
                               context_.slots_per_rank);
}

Result<StepRouting> Policy::Route(int /*layer*/, const Placement& placement,
                                  const StepLoad& load) {
  return RouteEvenly(placement, load);
}

const std::vector<std::string>& PolicyNames() {
  static const std::vector<std::string> kNames = {"static",   "eplb",      "flexmoe",
                                                  "smartmoe", "fastermoe", "keel"};
  return kNames;
}

Result<std::unique_ptr<Policy>> MakePolicy(std::string_view name, const PolicyContext& context) {
  std::unique_ptr<Policy> policy;
  if (name == "static") policy = MakeStaticPolicy(context);
  if (name == "eplb") policy = MakeEplbPolicy(context);
  if (name == "flexmoe") policy = MakeFlexMoePolicy(context);
  if (name == "smartmoe") policy = MakeSmartMoePolicy(context);
  if (name == "fastermoe") policy = MakeFasterMoePolicy(context);
  if (name == "keel") policy = MakeKeelPolicy(context);
  if (policy) return policy;
  std::string known;
  for (const auto& n : PolicyNames()) known += (known.empty() ? "" : ", ") + n;
  return InvalidArgument("unknown policy '" + std::string(name) + "' (known: " + known + ")");
}

}  // namespace keel
