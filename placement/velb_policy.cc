// `velb`: Megatron-Core's virtual-expert load balancer (moe_virtual_expert_load_balance, after
// MoonEP). Experts keep their homes in the static placement; every step, from that step's own
// router output, each rank's replica slots (its persistent slots beyond its homes plus its
// transient slots; Megatron gives every rank as many as it has local experts) take replicas of
// experts from overloaded ranks, and tokens move onto them until every rank receives the mean.
// The replicas live for one step: their weights are pushed from the home before the expert GEMMs
// and their gradients summed back into it, which the cost model charges as transient replicas.
#include <algorithm>
#include <memory>
#include <vector>

#include "placement/policy.h"

namespace keel {
namespace {

class VelbPolicy final : public Policy {
 public:
  explicit VelbPolicy(const PolicyContext& context) : Policy(context) {}
  std::string_view name() const override { return "velb"; }

  // The homes never move.
  Result<Placement> Replan(const LayerView& view) override {
    if (view.current == nullptr) return InvalidArgument("LayerView.current is null");
    return *view.current;
  }

  Result<StepRouting> Route(int layer, const Placement& placement, const StepLoad& load) override;
};

// Megatron's planner, in three passes (ties always to the lower rank, then the lower expert):
// 1. Quotas between ranks, num_ranks rounds: the rank furthest above the mean (its "balance")
//    gives the rank furthest below it that rank's whole deficit, so every receiver has one sender.
// 2. Each sender splits its quotas over its experts: the receiver with the most quota left takes
//    from the sender's expert with the most tokens left, as much as both allow.
// 3. A receiver holds one replica per expert it takes from; a receiver out of replica slots
//    keeps the experts with the most tokens and the rest stay at home.
Result<StepRouting> VelbPolicy::Route(int /*layer*/, const Placement& placement,
                                      const StepLoad& load) {
  const int num_ranks = placement.num_ranks();
  const int num_experts = placement.num_experts();
  const std::vector<double> totals = load.ExpertTotals();

  // Tokens each persistent copy receives before any replica: an even share of its expert's.
  std::vector<double> slot_quota(placement.num_slots(), 0.0);
  std::vector<double> balance(num_ranks, 0.0);
  std::vector<int> replica_slots(num_ranks, context().transient_per_rank);
  double total = 0;
  for (int slot = 0; slot < placement.num_slots(); ++slot) {
    const int e = placement.expert_at(slot);
    if (e == kEmptySlot) {
      ++replica_slots[placement.rank_of_slot(slot)];
      continue;
    }
    slot_quota[slot] = totals[e] / placement.copies(e).size();
    balance[placement.rank_of_slot(slot)] += slot_quota[slot];
    total += slot_quota[slot];
  }
  const double mean = total / num_ranks;
  for (double& b : balance) b -= mean;

  // 1. quota[sender * num_ranks + receiver]
  std::vector<double> quota(static_cast<size_t>(num_ranks) * num_ranks, 0.0);
  for (int round = 0; round < num_ranks; ++round) {
    const int sender =
        static_cast<int>(std::max_element(balance.begin(), balance.end()) - balance.begin());
    const int receiver =
        static_cast<int>(std::min_element(balance.begin(), balance.end()) - balance.begin());
    if (balance[sender] <= 0 || balance[receiver] >= 0) break;
    quota[static_cast<size_t>(sender) * num_ranks + receiver] += -balance[receiver];
    balance[sender] += balance[receiver];
    balance[receiver] = 0;
  }

  // 2. allocation[expert * num_ranks + receiver], taken from the sender's copies of the expert.
  std::vector<double> allocation(static_cast<size_t>(num_experts) * num_ranks, 0.0);
  const int per_rank = placement.slots_per_rank();
  for (int sender = 0; sender < num_ranks; ++sender) {
    double* sender_quota = &quota[static_cast<size_t>(sender) * num_ranks];
    for (;;) {
      const int receiver =
          static_cast<int>(std::max_element(sender_quota, sender_quota + num_ranks) - sender_quota);
      int from = -1;  // the sender's slot with the most tokens left
      for (int s = sender * per_rank; s < (sender + 1) * per_rank; ++s) {
        if (placement.expert_at(s) != kEmptySlot &&
            (from < 0 || slot_quota[s] > slot_quota[from])) {
          from = s;
        }
      }
      if (sender_quota[receiver] <= 0 || from < 0 || slot_quota[from] <= 0) break;
      const double moved = std::min(sender_quota[receiver], slot_quota[from]);
      sender_quota[receiver] -= moved;
      slot_quota[from] -= moved;
      allocation[static_cast<size_t>(placement.expert_at(from)) * num_ranks + receiver] += moved;
    }
  }

  // 3. Replicas, the biggest allocations first on each receiver while it has slots; what does
  // not fit goes back to the expert's persistent copies.
  std::vector<TransientReplica> replicas;
  std::vector<double> replica_quota;
  for (int receiver = 0; receiver < num_ranks; ++receiver) {
    std::vector<int> experts;
    for (int e = 0; e < num_experts; ++e) {
      if (allocation[static_cast<size_t>(e) * num_ranks + receiver] > 0) experts.push_back(e);
    }
    std::stable_sort(experts.begin(), experts.end(), [&](int a, int b) {
      return allocation[static_cast<size_t>(a) * num_ranks + receiver] >
             allocation[static_cast<size_t>(b) * num_ranks + receiver];
    });
    for (size_t i = 0; i < experts.size(); ++i) {
      const int e = experts[i];
      const double tokens = allocation[static_cast<size_t>(e) * num_ranks + receiver];
      if (static_cast<int>(i) < replica_slots[receiver]) {
        replicas.push_back({e, receiver, placement.home(e)});
        replica_quota.push_back(tokens);
      } else {
        for (int slot : placement.copies(e)) {
          slot_quota[slot] += tokens / placement.copies(e).size();
        }
      }
    }
  }
  return RouteInProportion(placement, load, slot_quota, std::move(replicas), replica_quota);
}

}  // namespace

std::unique_ptr<Policy> MakeVelbPolicy(const PolicyContext& context) {
  return std::make_unique<VelbPolicy>(context);
}

}  // namespace keel
