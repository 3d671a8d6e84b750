// PlanPlacement (include/keel/plan.hpp): checks a request, then plans with DeepSeek's EPLB or
// replans any other policy from its initial placement until the placement settles.
#include "keel/plan.hpp"

#include <algorithm>
#include <cmath>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "common/config.h"
#include "keel/limits.hpp"
#include "placement/eplb.h"
#include "placement/load.h"
#include "placement/policy.h"

namespace keel {
namespace {

// Beyond keel/limits.hpp: log2phy's cells, the largest part of the answer.
constexpr long long kMaxPlanCells = 1 << 24;

Status CheckRequest(const PlanRequest& in) {
  const auto positive = [](const char* field, int value) -> Status {
    if (value >= 1) return Status::Ok();
    return InvalidArgument(std::string(field) + " = " + std::to_string(value) + " must be >= 1");
  };
  KEEL_RETURN_IF_ERROR(CheckPolicyName(in.policy));
  KEEL_RETURN_IF_ERROR(positive("num_layers", in.num_layers));
  KEEL_RETURN_IF_ERROR(positive("num_experts", in.num_experts));
  KEEL_RETURN_IF_ERROR(positive("num_replicas", in.num_replicas));
  KEEL_RETURN_IF_ERROR(positive("num_groups", in.num_groups));
  KEEL_RETURN_IF_ERROR(positive("num_nodes", in.num_nodes));
  KEEL_RETURN_IF_ERROR(positive("num_gpus", in.num_gpus));
  // Upper bounds, so that a typo fails here rather than exhausting memory or time.
  const auto at_most = [](const char* field, long long value, long long most) -> Status {
    if (value <= most) return Status::Ok();
    return InvalidArgument(std::string(field) + " = " + std::to_string(value) +
                           " is more than the " + std::to_string(most) + " keel plan supports");
  };
  KEEL_RETURN_IF_ERROR(at_most("num_experts", in.num_experts, kMaxExperts));
  KEEL_RETURN_IF_ERROR(at_most("num_replicas", in.num_replicas, kMaxSlotsPerLayer));
  KEEL_RETURN_IF_ERROR(at_most("num_gpus", in.num_gpus, kMaxRanks));
  KEEL_RETURN_IF_ERROR(at_most("num_nodes", in.num_nodes, kMaxRanks));
  KEEL_RETURN_IF_ERROR(at_most("num_groups", in.num_groups, kMaxExperts));
  KEEL_RETURN_IF_ERROR(at_most("num_layers x num_replicas",
                               static_cast<long long>(in.num_layers) * in.num_replicas, kMaxSlots));
  const size_t cells = static_cast<size_t>(in.num_layers) * static_cast<size_t>(in.num_experts);
  if (in.weight.size() != cells) {
    return InvalidArgument("weight has " + std::to_string(in.weight.size()) +
                           " entries, not num_layers x num_experts = " +
                           std::to_string(in.num_layers) + " x " + std::to_string(in.num_experts));
  }
  for (size_t i = 0; i < cells; ++i) {
    const double load = in.weight[i];
    if (std::isfinite(load) && load >= 0 && load <= kMaxTokenCount) continue;
    return InvalidArgument("weight[" + std::to_string(i / in.num_experts) + "][" +
                           std::to_string(i % in.num_experts) + "] = " + std::to_string(load) +
                           (!std::isfinite(load) ? " is not finite"
                            : load < 0           ? " is negative"
                                                 : " is more than 1e15 tokens"));
  }
  const std::string replicas = std::to_string(in.num_replicas);
  const std::string gpus = std::to_string(in.num_gpus);
  if (in.num_replicas % in.num_gpus != 0) {
    return InvalidArgument("num_replicas " + replicas + " is not divisible by num_gpus " + gpus);
  }
  if (in.num_replicas < in.num_experts) {
    return InvalidArgument("num_replicas " + replicas + " is smaller than the " +
                           std::to_string(in.num_experts) +
                           " experts per row of weight (every expert needs a slot)");
  }
  // log2phy is [layers, experts, max_copies], and one hot expert may take every slot the others
  // leave: its largest width is bounded before anything is planned.
  KEEL_RETURN_IF_ERROR(
      at_most("num_layers x num_experts x (num_replicas - num_experts + 1), the cells of log2phy",
              static_cast<long long>(in.num_layers) * in.num_experts *
                  (in.num_replicas - in.num_experts + 1),
              kMaxPlanCells));
  // EPLB applies DeepSeek's rule itself: the shapes below matter only when it is hierarchical.
  // Every other policy places ranks as num_nodes x gpus_per_node and has no groups.
  if (in.policy != "eplb" && in.num_gpus % in.num_nodes != 0) {
    return InvalidArgument("num_gpus " + gpus + " is not divisible by num_nodes " +
                           std::to_string(in.num_nodes) + " (policy " + in.policy +
                           " needs num_nodes x gpus_per_node ranks)");
  }
  return Status::Ok();
}

Result<PlanResult> PlanWithEplb(const PlanRequest& in) {
  EplbInput eplb;
  eplb.num_layers = in.num_layers;
  eplb.num_experts = in.num_experts;
  eplb.weight.assign(in.weight.begin(), in.weight.end());
  eplb.num_replicas = in.num_replicas;
  eplb.num_groups = in.num_groups;
  eplb.num_nodes = in.num_nodes;
  eplb.num_gpus = in.num_gpus;
  KEEL_ASSIGN_OR_RETURN(EplbOutput out, RebalanceExperts(eplb));
  PlanResult plan;
  plan.num_layers = in.num_layers;
  plan.num_experts = in.num_experts;
  plan.num_replicas = in.num_replicas;
  plan.max_copies = out.max_replicas;
  plan.phy2log.assign(out.phy2log.begin(), out.phy2log.end());
  plan.log2phy.assign(out.log2phy.begin(), out.log2phy.end());
  plan.logcnt.assign(out.logcnt.begin(), out.logcnt.end());
  return plan;
}

// Any other policy: its initial placement of each layer, replanned from scratch until it settles.
Result<PlanResult> PlanWithPolicy(const PlanRequest& in) {
  KeelConfig config = in.config != nullptr ? TypedConfig(*in.config) : KeelConfig();
  config.topology.num_nodes = in.num_nodes;
  config.topology.gpus_per_node = in.num_gpus / in.num_nodes;
  config.slots.persistent_per_rank = in.num_replicas / in.num_gpus;
  config.policy.name = in.policy;
  config.policy.eplb.num_groups = in.num_groups;
  KEEL_ASSIGN_OR_RETURN(const PolicyContext context,
                        PolicyContext::FromConfig(config, in.num_layers, in.num_experts));
  KEEL_ASSIGN_OR_RETURN(std::unique_ptr<Policy> policy, MakePolicy(in.policy, context));

  std::vector<Placement> placements;
  int width = 1;
  for (int layer = 0; layer < in.num_layers; ++layer) {
    const std::string where = "policy " + in.policy + ", layer " + std::to_string(layer) + ": ";
    Result<Placement> initial = policy->Initial(layer);
    if (!initial.ok()) return initial.status().WithContext(where + "Initial");
    std::span<const double> row(in.weight.data() + static_cast<size_t>(layer) * in.num_experts,
                                static_cast<size_t>(in.num_experts));
    KEEL_ASSIGN_OR_RETURN(StepLoad traffic, StepLoad::FromExpertCounts(in.num_gpus, row));
    // Planning from scratch: nothing is trained yet, so moves are free, and the policy replans
    // until its placement stops changing (incremental policies move a few slots per replan).
    constexpr int kMaxRounds = 256;
    Placement current = std::move(initial).value();
    Result<Placement> next = current;
    for (int round = 0; round < kMaxRounds; ++round) {
      LayerView view;
      view.layer = layer;
      view.current = &current;
      view.expert_load = row;
      view.traffic = &traffic;
      view.fresh_start = true;
      next = policy->Replan(view);
      if (!next.ok()) return next.status().WithContext(where + "Replan");
      if (*next == current) break;
      current = *next;
    }
    if (next->num_slots() != in.num_replicas) {
      return Internal(where + "Replan returned " + std::to_string(next->num_slots()) +
                      " slots, expected num_replicas " + std::to_string(in.num_replicas));
    }
    width = std::max(width, next->max_copies());
    placements.push_back(std::move(next).value());
  }
  PlanResult plan;
  plan.num_layers = in.num_layers;
  plan.num_experts = in.num_experts;
  plan.num_replicas = in.num_replicas;
  plan.max_copies = width;
  for (const Placement& p : placements) {
    plan.phy2log.insert(plan.phy2log.end(), p.phy2log().begin(), p.phy2log().end());
    plan.logcnt.insert(plan.logcnt.end(), p.logcnt().begin(), p.logcnt().end());
    const std::vector<int> log2phy = p.Log2Phy(width);
    plan.log2phy.insert(plan.log2phy.end(), log2phy.begin(), log2phy.end());
  }
  return plan;
}

}  // namespace

Result<PlanResult> PlanPlacement(const PlanRequest& request) {
  KEEL_RETURN_IF_ERROR(CheckRequest(request));
  return request.policy == "eplb" ? PlanWithEplb(request) : PlanWithPolicy(request);
}

}  // namespace keel
