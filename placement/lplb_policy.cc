// `lplb`: DeepSeek's LPLB. A replan places the experts as LPLB does: EPLB's balanced packing with
// no replication (every expert once, ranks equally full), then each rank's redundant slots (its
// slots beyond ceil(num_experts / num_ranks)) copy the hottest experts of fixed partner ranks:
// rank i's d-th redundant slot copies the d-th hottest expert of rank r2o(i, d), the rank d + 1
// places further round a ring of the ranks of i's node (of all ranks on one-GPU nodes). Every
// redundant copy is thus an edge between two ranks, and no expert has more than two copies.
// Every step then splits each replicated expert's tokens between its two ranks by the linear
// program of lp_balance.h, which balances the ranks' token counts (it sees neither links nor the
// cost model); each source splits its tokens of an expert in the LP's proportions. By default
// Keel's quota solver solves it in whole tokens (policy.lplb.solver: quota); GLPK solves it as
// the LP library does (glpk), about a hundred times slower at 256 experts on 64 ranks.
#include <algorithm>
#include <cmath>
#include <memory>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "placement/eplb.h"
#include "placement/lp_balance.h"
#include "placement/policy.h"

namespace keel {
namespace {

class LplbPolicy final : public Policy {
 public:
  explicit LplbPolicy(const PolicyContext& context) : Policy(context) {}
  std::string_view name() const override { return "lplb"; }

  Result<Placement> Initial(int /*layer*/) override {
    KEEL_ASSIGN_OR_RETURN(std::vector<int> phy2log,
                          Plan(std::vector<double>(context().num_experts, 1.0)));
    return Placement::Create(context().num_experts, context().topology.num_ranks(),
                             std::move(phy2log));
  }

  Result<Placement> Replan(const LayerView& view) override {
    KEEL_RETURN_IF_ERROR(CheckLayerView(view));
    KEEL_ASSIGN_OR_RETURN(std::vector<int> phy2log, Plan(view.expert_load));
    return Placement::CreateKeepingHomes(*view.current, std::move(phy2log));
  }

  // The LP's split: GLPK's optimum, or the quota solver's whole-token one (the optimum rounded
  // up; lp_balance.h says why), each source in its proportions.
  Result<StepRouting> Route(int /*layer*/, const Placement& placement,
                            const StepLoad& load) override {
    const std::vector<double> totals = load.ExpertTotals();
    if (context().config.lplb.solver == "glpk") {
      KEEL_ASSIGN_OR_RETURN(LpBalance balance, SolveLpBalance(placement, totals));
      return RouteInProportion(placement, load, balance.slot_tokens);
    }
    tokens_.resize(totals.size());
    for (size_t e = 0; e < totals.size(); ++e) tokens_[e] = std::llround(totals[e]);
    splitter_.Split(placement, tokens_, split_);
    slot_tokens_.assign(split_.slot_quota.begin(), split_.slot_quota.end());
    return RouteInProportion(placement, load, slot_tokens_);
  }

 private:
  Result<std::vector<int>> Plan(std::span<const double> load) const;

  // The quota solver's state and buffers, kept between steps.
  QuotaSplitter splitter_;
  QuotaSplit split_;
  std::vector<long long> tokens_;
  std::vector<double> slot_tokens_;
};

Result<std::vector<int>> LplbPolicy::Plan(std::span<const double> load) const {
  const int num_experts = context().num_experts;
  const Topology& topology = context().topology;
  const int num_ranks = topology.num_ranks();
  const int per_rank = context().slots_per_rank;
  const int natives = (num_experts + num_ranks - 1) / num_ranks;

  // Each rank's own experts: EPLB's packing when the experts divide evenly, else the static
  // blocks.
  std::vector<std::vector<int>> own(num_ranks);
  if (num_experts % num_ranks == 0) {
    EplbInput input;
    input.num_layers = 1;
    input.num_experts = num_experts;
    input.weight.assign(load.begin(), load.end());
    input.num_replicas = num_experts;
    input.num_groups = 1;
    input.num_nodes = 1;
    input.num_gpus = num_ranks;
    KEEL_ASSIGN_OR_RETURN(EplbOutput packed, RebalanceExperts(input));
    for (int slot = 0; slot < num_experts; ++slot) {
      own[slot / natives].push_back(packed.phy2log[slot]);
    }
  } else {
    KEEL_ASSIGN_OR_RETURN(Placement blocks, Placement::Contiguous(num_experts, num_ranks, natives));
    for (int slot = 0; slot < blocks.num_slots(); ++slot) {
      if (blocks.expert_at(slot) != kEmptySlot)
        own[blocks.rank_of_slot(slot)].push_back(blocks.expert_at(slot));
    }
  }

  std::vector<int> phy2log(static_cast<size_t>(num_ranks) * per_rank, kEmptySlot);
  for (int r = 0; r < num_ranks; ++r) {
    std::copy(own[r].begin(), own[r].end(), phy2log.begin() + static_cast<size_t>(r) * per_rank);
  }
  // Each rank's experts, hottest first (ties: the lower id), for its partners to copy.
  std::vector<std::vector<int>> hottest = own;
  for (auto& experts : hottest) {
    std::stable_sort(experts.begin(), experts.end(), [&](int a, int b) {
      return load[a] > load[b] || (load[a] == load[b] && a < b);
    });
  }
  const int ring = topology.gpus_per_node() > 1 ? topology.gpus_per_node() : num_ranks;
  for (int r = 0; r < num_ranks; ++r) {
    const int ring_start = r / ring * ring;
    for (int d = 0; natives + d < per_rank; ++d) {
      const int partner = ring_start + (r - ring_start + d + 1) % ring;
      if (partner == r || d >= static_cast<int>(hottest[partner].size())) continue;
      phy2log[static_cast<size_t>(r) * per_rank + natives + d] = hottest[partner][d];
    }
  }
  return phy2log;
}

}  // namespace

std::unique_ptr<Policy> MakeLplbPolicy(const PolicyContext& context) {
  return std::make_unique<LplbPolicy>(context);
}

}  // namespace keel
