// `eplb`: DeepSeek's EPLB run on one layer's estimated load at every replan, filling every
// persistent slot. Homes stay where the new placement still holds a copy; tokens split evenly.
#include <string>
#include <utility>
#include <vector>

#include "placement/eplb.h"
#include "placement/policy.h"

namespace keel {
namespace {

class EplbPolicy final : public Policy {
 public:
  explicit EplbPolicy(const PolicyContext& context) : Policy(context) {}
  std::string_view name() const override { return "eplb"; }

  // Uniform load: EPLB spreads the spare slots over the experts so that every slot is used.
  Result<Placement> Initial(int /*layer*/) override {
    KEEL_ASSIGN_OR_RETURN(std::vector<int> phy2log,
                          Balance(std::vector<float>(context().num_experts, 1.0f)));
    return Placement::Create(context().num_experts, context().topology.num_ranks(),
                             std::move(phy2log));
  }

  Result<Placement> Replan(const LayerView& view) override {
    const int num_experts = context().num_experts;
    if (static_cast<int>(view.expert_load.size()) != num_experts) {
      return InvalidArgument("expert_load of layer " + std::to_string(view.layer) + " has " +
                             std::to_string(view.expert_load.size()) +
                             " entries, expected num_experts " + std::to_string(num_experts));
    }
    KEEL_RETURN_IF_ERROR(CheckExpertLoad(view.expert_load));
    std::vector<float> weight(view.expert_load.begin(), view.expert_load.end());
    KEEL_ASSIGN_OR_RETURN(std::vector<int> phy2log, Balance(std::move(weight)));
    if (view.current == nullptr) {
      return Placement::Create(num_experts, context().topology.num_ranks(), std::move(phy2log));
    }
    return Placement::CreateKeepingHomes(*view.current, std::move(phy2log));
  }

 private:
  // One layer through RebalanceExperts; slot s of the result lives on rank s / slots_per_rank.
  Result<std::vector<int>> Balance(std::vector<float> weight) const {
    const PolicyContext& ctx = context();
    int num_groups = ctx.config.eplb.num_groups;
    if (num_groups < 0) {
      return InvalidArgument("policy.eplb.num_groups must be >= 0, got " +
                             std::to_string(num_groups));
    }
    // 0: one group per node when the experts divide among the nodes, else one group, which
    // makes EPLB balance globally (with more than one node). A number the user chose goes to
    // EPLB as it is, which rejects what DeepSeek's reference rejects.
    if (num_groups == 0) {
      const int nodes = ctx.topology.num_nodes();
      num_groups = ctx.num_experts % nodes == 0 ? nodes : 1;
    }
    EplbInput input;
    input.num_layers = 1;
    input.num_experts = ctx.num_experts;
    input.weight = std::move(weight);
    input.num_replicas = ctx.topology.num_ranks() * ctx.slots_per_rank;
    input.num_groups = num_groups;
    input.num_nodes = ctx.topology.num_nodes();
    input.num_gpus = ctx.topology.num_ranks();
    Result<EplbOutput> out = RebalanceExperts(input);
    if (!out.ok()) {
      return out.status().WithContext("eplb with policy.eplb.num_groups " +
                                      std::to_string(ctx.config.eplb.num_groups));
    }
    return std::move(out->phy2log);
  }
};

}  // namespace

std::unique_ptr<Policy> MakeEplbPolicy(const PolicyContext& context) {
  return std::make_unique<EplbPolicy>(context);
}

}  // namespace keel
