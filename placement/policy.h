// The interface every placement policy implements, and the factory that builds one by name.
// Policies are deterministic: same inputs, same outputs, on every rank and every machine. They
// may keep state between calls (a trigger, a candidate pool), but no clocks, threads or I/O.
#pragma once

#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/config.h"
#include "keel/plan.hpp"
#include "keel/status.hpp"
#include "placement/cost_model.h"
#include "placement/load.h"
#include "placement/placement.h"
#include "placement/routing.h"
#include "placement/topology.h"

namespace keel {

// Fixed facts a policy plans within.
struct PolicyContext {
  // Topology, cost model, slots and policy parameters from a validated config.
  static Result<PolicyContext> FromConfig(const KeelConfig& config, int num_layers,
                                          int num_experts);

  Topology topology;
  CostModel cost;
  int num_layers = 1;
  int num_experts = 0;
  int slots_per_rank = 0;      // persistent slots
  int transient_per_rank = 0;  // transient slots
  PolicyConfig config = {};
};

// What a replan of one layer sees.
struct LayerView {
  int layer = 0;
  const Placement* current = nullptr;   // placement in force
  std::span<const double> expert_load;  // [num_experts] estimated tokens for the next step
  const StepLoad* traffic = nullptr;    // estimated traffic matrix, when known (may be null)
  // No expert state exists yet (a placement planned from scratch, as `keel plan` does): moving
  // costs nothing, so the policy plans for balance alone.
  bool fresh_start = false;
};

// OK when the view has its placement and one expected load per expert of it, each in [0,
// kMaxTokenCount]; otherwise an InvalidArgument that says which is wrong.
Status CheckLayerView(const LayerView& view);
// OK when every expected load is in [0, kMaxTokenCount]; otherwise the first that is not.
Status CheckExpertLoad(std::span<const double> expert_load);

// The step a replan plans for: the estimated traffic matrix when it covers the placement's ranks,
// otherwise the estimated per-expert totals sent evenly from every rank. Fails when the view is
// missing its placement or its sizes disagree with it.
Result<StepLoad> ExpectedStepLoad(const LayerView& view);

class Policy {
 public:
  virtual ~Policy() = default;
  virtual std::string_view name() const = 0;

  // The placement a layer starts with. Default: the static contiguous placement.
  virtual Result<Placement> Initial(int layer);

  // The placement for the next epoch; returning the current placement means "no change".
  virtual Result<Placement> Replan(const LayerView& view) = 0;

  // How this step's tokens are split among copies. Default: RouteEvenly.
  virtual Result<StepRouting> Route(int layer, const Placement& placement, const StepLoad& load);

 protected:
  explicit Policy(const PolicyContext& context) : context_(context) {}
  const PolicyContext& context() const { return context_; }

  // Seconds of transfers to turn the placement in force into `candidate`: the cost model's
  // migration time, or zero on a fresh start.
  double MigrationSeconds(const LayerView& view, const Placement& candidate) const;

 private:
  PolicyContext context_;
};

// PolicyNames() (keel/plan.hpp): the names MakePolicy accepts, in the order reports list them:
// the built-in policies (common/policy_names.h), then the registered ones (keel/policy.hpp).

// OK when `name` is in PolicyNames(); otherwise an InvalidArgument that lists the known ones.
Status CheckPolicyName(std::string_view name);

// Builds the policy called `name` (see PolicyNames); an unknown name fails as CheckPolicyName.
Result<std::unique_ptr<Policy>> MakePolicy(std::string_view name, const PolicyContext& context);

// Builds a policy added with keel::RegisterPolicy (registered_policy.cc); NotFound for a name
// that was not registered.
Result<std::unique_ptr<Policy>> MakeRegisteredPolicy(std::string_view name,
                                                     const PolicyContext& context);

// Policy factories, one per file.
std::unique_ptr<Policy> MakeStaticPolicy(const PolicyContext& context);
std::unique_ptr<Policy> MakeEplbPolicy(const PolicyContext& context);
std::unique_ptr<Policy> MakeFlexMoePolicy(const PolicyContext& context);
std::unique_ptr<Policy> MakeSmartMoePolicy(const PolicyContext& context);
std::unique_ptr<Policy> MakeFasterMoePolicy(const PolicyContext& context);
std::unique_ptr<Policy> MakeVelbPolicy(const PolicyContext& context);
std::unique_ptr<Policy> MakeLplbPolicy(const PolicyContext& context);
std::unique_ptr<Policy> MakeSwiftMoePolicy(const PolicyContext& context);
std::unique_ptr<Policy> MakeTrtllmPolicy(const PolicyContext& context);
std::unique_ptr<Policy> MakeKeelPolicy(const PolicyContext& context);

}  // namespace keel
