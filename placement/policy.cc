// The policy factory and the defaults shared by every policy.
#include "placement/policy.h"

#include <algorithm>
#include <string>

#include "common/policy_names.h"

namespace keel {

Result<PolicyContext> PolicyContext::FromConfig(const KeelConfig& config, int num_layers,
                                                int num_experts) {
  KEEL_ASSIGN_OR_RETURN(Topology topology, Topology::Create(config.topology));
  if (num_layers < 1) {
    return InvalidArgument("num_layers must be >= 1, got " + std::to_string(num_layers));
  }
  if (num_experts < 1) {
    return InvalidArgument("num_experts must be >= 1, got " + std::to_string(num_experts));
  }
  if (config.slots.persistent_per_rank < 1) {
    return InvalidArgument("slots.persistent_per_rank must be >= 1, got " +
                           std::to_string(config.slots.persistent_per_rank));
  }
  if (config.slots.transient_per_rank < 0) {
    return InvalidArgument("slots.transient_per_rank must be >= 0, got " +
                           std::to_string(config.slots.transient_per_rank));
  }
  if (static_cast<long long>(config.slots.persistent_per_rank) * topology.num_ranks() <
      num_experts) {
    return InvalidArgument("slots.persistent_per_rank " +
                           std::to_string(config.slots.persistent_per_rank) + " x " +
                           std::to_string(topology.num_ranks()) + " ranks cannot hold " +
                           std::to_string(num_experts) + " experts");
  }
  return PolicyContext{
      topology,     CostModel(topology, config.cost_model), num_layers,
      num_experts,  config.slots.persistent_per_rank,       config.slots.transient_per_rank,
      config.policy};
}

Status CheckLayerView(const LayerView& view) {
  if (view.current == nullptr) return InvalidArgument("LayerView.current is null");
  const int num_experts = view.current->num_experts();
  if (static_cast<int>(view.expert_load.size()) != num_experts) {
    return InvalidArgument("expert_load has " + std::to_string(view.expert_load.size()) +
                           " entries, expected num_experts " + std::to_string(num_experts));
  }
  return CheckExpertLoad(view.expert_load);
}

Status CheckExpertLoad(std::span<const double> expert_load) {
  for (size_t e = 0; e < expert_load.size(); ++e) {
    const double load = expert_load[e];
    if (!(load >= 0 && load <= kMaxTokenCount)) {
      return InvalidArgument("expert_load[" + std::to_string(e) + "] = " + std::to_string(load) +
                             " is not a token count in [0, 1e15]");
    }
  }
  return Status::Ok();
}

Result<StepLoad> ExpectedStepLoad(const LayerView& view) {
  KEEL_RETURN_IF_ERROR(CheckLayerView(view));
  const int num_experts = view.current->num_experts();
  const int num_ranks = view.current->num_ranks();
  if (view.traffic == nullptr || view.traffic->num_sources != num_ranks) {
    return StepLoad::FromExpertCounts(num_ranks, view.expert_load);
  }
  if (view.traffic->num_experts != num_experts) {
    return InvalidArgument("traffic has " + std::to_string(view.traffic->num_experts) +
                           " experts, expected num_experts " + std::to_string(num_experts));
  }
  return *view.traffic;
}

Result<Placement> Policy::Initial(int /*layer*/) {
  return Placement::Contiguous(context_.num_experts, context_.topology.num_ranks(),
                               context_.slots_per_rank);
}

double Policy::MigrationSeconds(const LayerView& view, const Placement& candidate) const {
  return view.fresh_start ? 0.0 : context_.cost.Migration(*view.current, candidate).seconds;
}

Result<StepRouting> Policy::Route(int /*layer*/, const Placement& placement, const StepLoad& load) {
  return RouteEvenly(placement, load);
}

Status CheckPolicyName(std::string_view name) {
  if (IsPolicyName(name)) return Status::Ok();
  std::string known;
  for (const auto& n : PolicyNames()) known += (known.empty() ? "" : ", ") + n;
  return InvalidArgument("unknown policy '" + std::string(name) + "' (known: " + known + ")");
}

Result<std::unique_ptr<Policy>> MakePolicy(std::string_view name, const PolicyContext& context) {
  std::unique_ptr<Policy> policy;
  if (name == "static") policy = MakeStaticPolicy(context);
  if (name == "eplb") policy = MakeEplbPolicy(context);
  if (name == "flexmoe") policy = MakeFlexMoePolicy(context);
  if (name == "smartmoe") policy = MakeSmartMoePolicy(context);
  if (name == "fastermoe") policy = MakeFasterMoePolicy(context);
  if (name == "velb") policy = MakeVelbPolicy(context);
  if (name == "lplb") policy = MakeLplbPolicy(context);
  if (name == "swiftmoe") policy = MakeSwiftMoePolicy(context);
  if (name == "trtllm") policy = MakeTrtllmPolicy(context);
  if (name == "keel") policy = MakeKeelPolicy(context);
  if (policy) return policy;
  KEEL_RETURN_IF_ERROR(CheckPolicyName(name));
  return MakeRegisteredPolicy(name, context);
}

}  // namespace keel
