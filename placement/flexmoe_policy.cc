// `flexmoe`: FlexMoE's dynamic device placement. When the predicted balance ratio (max / mean rank
// load) of the placement in force exceeds a trigger, greedy expand / shrink / migrate actions are
// applied one at a time, each chosen and gated by the shared cost model.
#include <algorithm>
#include <string>
#include <vector>

#include "placement/policy.h"

namespace keel {
namespace {

// Each copy's share of its expert's load when tokens split evenly among copies.
std::vector<double> CopyShare(const Placement& placement, std::span<const double> expert_load) {
  std::vector<double> share(placement.num_experts());
  for (int e = 0; e < placement.num_experts(); ++e) {
    share[e] = expert_load[e] / placement.logcnt()[e];
  }
  return share;
}

std::vector<double> RankLoads(const Placement& placement, const std::vector<double>& share) {
  std::vector<double> rank_load(placement.num_ranks(), 0.0);
  for (int slot = 0; slot < placement.num_slots(); ++slot) {
    const int e = placement.expert_at(slot);
    if (e != kEmptySlot) rank_load[placement.rank_of_slot(slot)] += share[e];
  }
  return rank_load;
}

int Hottest(const std::vector<double>& rank_load) {
  return static_cast<int>(std::max_element(rank_load.begin(), rank_load.end()) - rank_load.begin());
}

class FlexMoePolicy final : public Policy {
 public:
  explicit FlexMoePolicy(const PolicyContext& context) : Policy(context) {}
  std::string_view name() const override { return "flexmoe"; }

  Result<Placement> Replan(const LayerView& view) override {
    // ExpectedStepLoad also checks that the view has a placement and matching sizes.
    KEEL_ASSIGN_OR_RETURN(const StepLoad load, ExpectedStepLoad(view));
    const Placement& current = *view.current;

    const std::vector<double> rank_load = RankLoads(current, CopyShare(current, view.expert_load));
    double total = 0;
    for (double l : rank_load) total += l;
    if (total <= 0) return current;
    const double mean = total / current.num_ranks();
    const double balance_ratio = rank_load[Hottest(rank_load)] / mean;
    if (balance_ratio <= context().config.flexmoe.balance_ratio_trigger) return current;

    Placement working = current;
    double working_score = Score(view, current, load);
    for (int action = 0; action < context().config.flexmoe.max_actions_per_replan; ++action) {
      const Placement* best = nullptr;
      double best_score = working_score;
      std::vector<Placement> candidates;
      for (std::vector<int>& phy2log : Actions(working, view.expert_load)) {
        auto candidate = Placement::CreateKeepingHomes(working, std::move(phy2log));
        if (candidate.ok()) candidates.push_back(std::move(candidate).value());
      }
      for (const Placement& candidate : candidates) {
        const double score = Score(view, candidate, load);
        // A relative margin keeps rounding noise from counting as a gain.
        if (score < best_score && score < working_score * (1 - 1e-9)) {
          best = &candidate;
          best_score = score;
        }
      }
      if (best == nullptr) break;
      working = *best;
      working_score = best_score;
    }
    return working;
  }

 private:
  // Predicted seconds per step of `candidate` over one replan interval: its steady layer time plus
  // the migration from the placement in force that the first step cannot hide, spread over the
  // interval. An action pays only when its gain exceeds its share of exposed migration.
  double Score(const LayerView& view, const Placement& candidate, const StepLoad& load) const {
    const CostModel& cost = context().cost;
    const double migration = MigrationSeconds(view, candidate);
    const LayerCost layer = cost.Estimate(candidate, RouteEvenly(candidate, load), migration);
    const int interval = std::max(1, context().config.replan_interval_steps);
    return layer.total_seconds() - layer.exposed_migration_seconds +
           layer.exposed_migration_seconds / interval;
  }

  // The slot on `rank` that a new copy may take: the first empty slot, else the least-loaded
  // replica that is neither its expert's only copy nor its home. -1 when there is none.
  static int FreeableSlot(const Placement& placement, const std::vector<double>& share, int rank) {
    const int begin = rank * placement.slots_per_rank();
    int victim = -1;
    for (int slot = begin; slot < begin + placement.slots_per_rank(); ++slot) {
      const int e = placement.expert_at(slot);
      if (e == kEmptySlot) return slot;
      if (placement.logcnt()[e] < 2 || placement.home(e) == rank) continue;
      if (victim < 0 || share[e] < share[placement.expert_at(victim)]) victim = slot;
    }
    return victim;
  }

  // Candidate phy2log maps, one action each away from `placement`:
  //  expand:  a new copy of one of the hottest rank's top experts on a cooler rank that lacks it;
  //  migrate: that copy moved off the hottest rank instead;
  //  shrink:  one replica of an under-used replicated expert dropped, from its most loaded
  //           non-home rank.
  // A copy placed on an occupied slot evicts a replica that has other copies, so every expert
  // keeps at least one copy. Candidates are limited to the hottest rank's kSourceExperts largest
  // contributors, the kTargetRanks coolest ranks (plus the coolest one on the hottest rank's node,
  // whose links are fast) and the kShrinkExperts least-used replicated experts, which keeps a
  // replan cheap on large clusters.
  std::vector<std::vector<int>> Actions(const Placement& placement,
                                        std::span<const double> expert_load) const {
    constexpr int kSourceExperts = 3;
    constexpr int kTargetRanks = 3;
    constexpr int kShrinkExperts = 4;
    const Topology& topology = context().topology;
    const std::vector<double> share = CopyShare(placement, expert_load);
    const std::vector<double> rank_load = RankLoads(placement, share);
    const int hottest = Hottest(rank_load);
    const int per_rank = placement.slots_per_rank();
    std::vector<std::vector<int>> actions;

    std::vector<int> sources;  // slots of the hottest rank, largest share first
    for (int slot = hottest * per_rank; slot < (hottest + 1) * per_rank; ++slot) {
      const int e = placement.expert_at(slot);
      if (e != kEmptySlot && share[e] > 0) sources.push_back(slot);
    }
    std::stable_sort(sources.begin(), sources.end(), [&](int a, int b) {
      return share[placement.expert_at(a)] > share[placement.expert_at(b)];
    });
    if (static_cast<int>(sources.size()) > kSourceExperts) sources.resize(kSourceExperts);

    std::vector<int> cooler;  // ranks other than the hottest, coolest first
    for (int rank = 0; rank < placement.num_ranks(); ++rank) {
      if (rank != hottest) cooler.push_back(rank);
    }
    std::stable_sort(cooler.begin(), cooler.end(),
                     [&](int a, int b) { return rank_load[a] < rank_load[b]; });

    for (int slot : sources) {
      const int e = placement.expert_at(slot);
      int taken = 0;
      bool node_local = false;
      for (int rank : cooler) {
        const bool same_node = topology.same_node(rank, hottest);
        if (taken >= kTargetRanks && (node_local || !same_node)) continue;
        if (placement.holds(rank, e)) continue;
        const int target = FreeableSlot(placement, share, rank);
        if (target < 0) continue;
        ++taken;
        node_local = node_local || same_node;
        std::vector<int> expand = placement.phy2log();
        expand[target] = e;
        actions.push_back(expand);
        std::vector<int> migrate = std::move(expand);
        migrate[slot] = kEmptySlot;
        actions.push_back(std::move(migrate));
      }
    }

    std::vector<int> replicated;  // least-used copies first
    for (int e = 0; e < placement.num_experts(); ++e) {
      if (placement.logcnt()[e] > 1) replicated.push_back(e);
    }
    std::stable_sort(replicated.begin(), replicated.end(),
                     [&](int a, int b) { return share[a] < share[b]; });
    if (static_cast<int>(replicated.size()) > kShrinkExperts) replicated.resize(kShrinkExperts);
    for (int e : replicated) {
      int drop = -1;
      for (int slot : placement.copies(e)) {
        const int rank = placement.rank_of_slot(slot);
        if (rank == placement.home(e)) continue;
        if (drop < 0 || rank_load[rank] > rank_load[placement.rank_of_slot(drop)]) drop = slot;
      }
      if (drop < 0) continue;
      std::vector<int> shrink = placement.phy2log();
      shrink[drop] = kEmptySlot;
      actions.push_back(std::move(shrink));
    }
    return actions;
  }
};

}  // namespace

std::unique_ptr<Policy> MakeFlexMoePolicy(const PolicyContext& context) {
  return std::make_unique<FlexMoePolicy>(context);
}

}  // namespace keel
