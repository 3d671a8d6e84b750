// keel::RegisterPolicy (keel/policy.hpp): the factories registered by name, and the Policy that
// runs a registered PlacementPolicy, turning its phy2log answers into placements.
#include <algorithm>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "common/policy_names.h"
#include "keel/policy.hpp"
#include "placement/policy.h"

namespace keel {

Result<std::vector<int>> PlacementPolicy::Initial(int /*layer*/) { return std::vector<int>(); }

namespace {

std::mutex& RegistryMutex() {
  static std::mutex mutex;
  return mutex;
}

// Guarded by RegistryMutex().
std::map<std::string, PolicyRegistration, std::less<>>& Registry() {
  static std::map<std::string, PolicyRegistration, std::less<>> registry;
  return registry;
}

class RegisteredPolicy final : public Policy {
 public:
  RegisteredPolicy(const PolicyContext& context, const PolicyRegistration& registration,
                   std::unique_ptr<PlacementPolicy> plugin)
      : Policy(context),
        name_(registration.name),
        routing_(registration.routing),
        plugin_(std::move(plugin)) {}

  std::string_view name() const override { return name_; }

  Result<Placement> Initial(int layer) override {
    KEEL_ASSIGN_OR_RETURN(std::vector<int> phy2log, plugin_->Initial(layer));
    if (phy2log.empty()) return Policy::Initial(layer);
    Result<Placement> placement = Placement::Create(
        context().num_experts, context().topology.num_ranks(), std::move(phy2log));
    if (!placement.ok()) return placement.status().WithContext("policy " + name_ + ": Initial");
    return placement;
  }

  Result<Placement> Replan(const LayerView& view) override {
    KEEL_RETURN_IF_ERROR(CheckLayerView(view));
    const Placement& current = *view.current;
    ReplanInput input;
    input.layer = view.layer;
    input.phy2log = current.phy2log();
    input.home = current.home();
    input.expert_load = view.expert_load;
    if (view.traffic != nullptr && view.traffic->num_sources == current.num_ranks()) {
      input.traffic = view.traffic->traffic;
    }
    input.fresh_start = view.fresh_start;
    KEEL_ASSIGN_OR_RETURN(std::vector<int> phy2log, plugin_->Replan(input));
    if (static_cast<int>(phy2log.size()) != current.num_slots()) {
      return InvalidArgument("policy " + name_ + ": Replan returned " +
                             std::to_string(phy2log.size()) + " slots, expected " +
                             std::to_string(current.num_slots()));
    }
    Result<Placement> next = Placement::CreateKeepingHomes(current, std::move(phy2log));
    if (!next.ok()) return next.status().WithContext("policy " + name_ + ": Replan");
    return next;
  }

  Result<StepRouting> Route(int layer, const Placement& placement, const StepLoad& load) override {
    if (routing_ == PolicyRouting::kEven) return Policy::Route(layer, placement, load);
    return PlanStepQuotas(placement, load, context().topology, context().cost, QuotaPlanOptions());
  }

 private:
  std::string name_;
  PolicyRouting routing_;
  std::unique_ptr<PlacementPolicy> plugin_;
};

bool IsNameCharacter(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' ||
         c == '-';
}

}  // namespace

Status RegisterPolicy(PolicyRegistration registration) {
  const std::string& name = registration.name;
  if (name.empty()) return InvalidArgument("PolicyRegistration.name is empty");
  if (!std::all_of(name.begin(), name.end(), IsNameCharacter)) {
    return InvalidArgument("PolicyRegistration.name '" + name +
                           "' may hold only letters, digits, '_' and '-'");
  }
  if (!registration.create) {
    return InvalidArgument("PolicyRegistration.create of policy '" + name + "' is empty");
  }
  std::lock_guard<std::mutex> lock(RegistryMutex());
  if (!AddPolicyName(name)) {
    return InvalidArgument("PolicyRegistration.name '" + name + "' is already a policy's name");
  }
  std::string key = name;
  Registry().emplace(std::move(key), std::move(registration));
  return Status::Ok();
}

Result<std::unique_ptr<Policy>> MakeRegisteredPolicy(std::string_view name,
                                                     const PolicyContext& context) {
  PolicyRegistration registration;
  {
    std::lock_guard<std::mutex> lock(RegistryMutex());
    auto it = Registry().find(name);
    if (it == Registry().end())
      return NotFound("no policy registered as '" + std::string(name) + "'");
    registration = it->second;
  }
  PolicyShape shape;
  shape.num_layers = context.num_layers;
  shape.num_experts = context.num_experts;
  shape.num_nodes = context.topology.num_nodes();
  shape.gpus_per_node = context.topology.gpus_per_node();
  shape.slots_per_rank = context.slots_per_rank;
  shape.transient_per_rank = context.transient_per_rank;
  std::unique_ptr<PlacementPolicy> plugin = registration.create(shape);
  if (!plugin) {
    return InvalidArgument("policy '" + std::string(name) + "': create returned no policy");
  }
  return std::unique_ptr<Policy>(
      std::make_unique<RegisteredPolicy>(context, registration, std::move(plugin)));
}

}  // namespace keel
