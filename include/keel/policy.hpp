// A placement policy of your own. Implement PlacementPolicy, register a factory under a name with
// RegisterPolicy, and the name works wherever a built-in policy's does: `policy.name` in a config,
// keel::ReplayToJson and keel::Plan, and the engine. docs/policies.md ("A policy of your own")
// walks through examples/custom_policy/.
#pragma once

#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "keel/status.hpp"

namespace keel {

// What a policy plans for; fixed for the policy's lifetime.
struct PolicyShape {
  int num_layers = 0;
  int num_experts = 0;
  int num_nodes = 0;
  int gpus_per_node = 0;       // ranks per node; rank r lives on node r / gpus_per_node
  int slots_per_rank = 0;      // persistent slots; slot s lives on rank s / slots_per_rank
  int transient_per_rank = 0;  // per-step slots, filled by the routing (not by the policy)
  int num_ranks() const { return num_nodes * gpus_per_node; }
  int num_slots() const { return num_ranks() * slots_per_rank; }
};

// What a replan of one layer sees. The spans are valid during the call only.
struct ReplanInput {
  int layer = 0;
  // [num_slots] the placement in force: the expert in each slot, -1 for an empty slot.
  std::span<const int> phy2log;
  // [num_experts] each expert's home: the rank holding its optimizer state.
  std::span<const int> home;
  // [num_experts] the tokens each expert is expected to receive in the coming step.
  std::span<const double> expert_load;
  // [num_ranks * num_experts] expected tokens from each source rank to each expert (row by
  // source); empty when unknown.
  std::span<const double> traffic;
  // No expert state exists yet: moving costs nothing, so plan for balance alone.
  bool fresh_start = false;
};

class PlacementPolicy {
 public:
  virtual ~PlacementPolicy() = default;

  // The phy2log a layer starts with. Empty (the default): the static placement, experts in
  // contiguous blocks in each rank's first slots.
  virtual Result<std::vector<int>> Initial(int layer);

  // The phy2log for the next epoch ([num_slots], -1 for an empty slot; every expert needs a
  // copy). Returning the current phy2log means "no change". Experts keep their home where the new
  // placement still has a copy; otherwise the home moves to the expert's first slot, a move the
  // cost model charges with the optimizer state. An error fails the replan (and a replay).
  virtual Result<std::vector<int>> Replan(const ReplanInput& input) = 0;
};

// How a step's tokens are split among an expert's copies.
enum class PolicyRouting {
  kEven,    // each source sends an equal share to every copy
  kQuotas,  // exact quotas that minimise the busiest rank's tokens, as the `keel` policy does
};

struct PolicyRegistration {
  // Letters, digits, '_' and '-'; must not be a built-in policy's or another registration's.
  std::string name;
  // Called once per layer the policy plans (replay and the engine keep a policy per layer).
  std::function<std::unique_ptr<PlacementPolicy>(const PolicyShape&)> create;
  PolicyRouting routing = PolicyRouting::kEven;
};

// Adds a policy by name for the rest of the process. Register before a config or a request names
// it. InvalidArgument names the bad field: an empty or malformed name, one already taken, or no
// `create`. Thread-safe.
Status RegisterPolicy(PolicyRegistration registration);

}  // namespace keel
