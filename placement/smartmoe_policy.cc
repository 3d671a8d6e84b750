// `smartmoe`: SmartMoE's swap-only placement. Every expert keeps exactly one copy (its home);
// balance comes from exchanging experts between ranks. Each replan builds candidates (greedy
// sticky swaps from the current placement, a fresh packing) and chooses online, with the cost
// model, among them and a small per-layer pool of earlier candidates.
#include <algorithm>
#include <map>
#include <numeric>
#include <string>
#include <vector>

#include "placement/policy.h"

namespace keel {
namespace {

// Rank loads of a one-copy-per-expert phy2log: each expert's whole load lands on its rank.
std::vector<double> RankLoads(const std::vector<int>& phy2log, int slots_per_rank, int num_ranks,
                              std::span<const double> expert_load) {
  std::vector<double> rank_load(num_ranks, 0.0);
  for (size_t slot = 0; slot < phy2log.size(); ++slot) {
    if (phy2log[slot] != kEmptySlot) rank_load[slot / slots_per_rank] += expert_load[phy2log[slot]];
  }
  return rank_load;
}

double MaxOf(const std::vector<double>& values) {
  return *std::max_element(values.begin(), values.end());
}

// `placement` with one copy per expert: the copy on its home rank stays, replicas are dropped.
std::vector<int> SingleCopy(const Placement& placement) {
  std::vector<int> phy2log(placement.num_slots(), kEmptySlot);
  for (int e = 0; e < placement.num_experts(); ++e) {
    for (int slot : placement.copies(e)) {
      if (placement.rank_of_slot(slot) == placement.home(e)) {
        phy2log[slot] = e;
        break;
      }
    }
  }
  return phy2log;
}

// Greedy pairwise swaps from `phy2log`: the hottest rank exchanges one of its experts with an
// expert (or an empty slot) of another rank, the exchange that lowers the pair's larger load the
// most, as long as that gain beats `stickiness` of the hottest rank's load. Every swap lowers the
// sum of squared rank loads, so the loop ends.
std::vector<int> GreedySwaps(std::vector<int> phy2log, int slots_per_rank, int num_ranks,
                             std::span<const double> expert_load, double stickiness) {
  std::vector<double> rank_load = RankLoads(phy2log, slots_per_rank, num_ranks, expert_load);
  auto load_at = [&](int slot) {
    return phy2log[slot] == kEmptySlot ? 0.0 : expert_load[phy2log[slot]];
  };
  const int max_swaps = static_cast<int>(phy2log.size()) * slots_per_rank;
  for (int swap = 0; swap < max_swaps; ++swap) {
    const int hot =
        static_cast<int>(std::max_element(rank_load.begin(), rank_load.end()) - rank_load.begin());
    double best_pair_max = rank_load[hot] * (1.0 - stickiness);
    int best_a = -1;
    int best_b = -1;
    for (int a = hot * slots_per_rank; a < (hot + 1) * slots_per_rank; ++a) {
      if (phy2log[a] == kEmptySlot) continue;
      for (int b = 0; b < static_cast<int>(phy2log.size()); ++b) {
        const int rank = b / slots_per_rank;
        if (rank == hot) continue;
        const double moved = load_at(a) - load_at(b);
        const double pair_max = std::max(rank_load[hot] - moved, rank_load[rank] + moved);
        if (pair_max < best_pair_max) {
          best_pair_max = pair_max;
          best_a = a;
          best_b = b;
        }
      }
    }
    if (best_a < 0) break;
    const double moved = load_at(best_a) - load_at(best_b);
    rank_load[hot] -= moved;
    rank_load[best_b / slots_per_rank] += moved;
    std::swap(phy2log[best_a], phy2log[best_b]);
  }
  return phy2log;
}

// A fresh packing: experts by descending load onto the least-loaded rank with a free slot (LPT).
// The packed groups are then matched to the ranks that already hold most of their experts, and
// experts that stay on their rank keep their slot, so the packing moves as little as it can.
std::vector<int> FreshPacking(const std::vector<int>& base, int slots_per_rank, int num_ranks,
                              std::span<const double> expert_load) {
  const int num_experts = static_cast<int>(expert_load.size());
  std::vector<int> order(num_experts);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int a, int b) { return expert_load[a] > expert_load[b]; });
  std::vector<std::vector<int>> groups(num_ranks);
  std::vector<double> group_load(num_ranks, 0.0);
  for (int e : order) {
    int target = -1;
    for (int g = 0; g < num_ranks; ++g) {
      if (static_cast<int>(groups[g].size()) >= slots_per_rank) continue;
      if (target < 0 || group_load[g] < group_load[target]) target = g;
    }
    groups[target].push_back(e);
    group_load[target] += expert_load[e];
  }

  std::vector<int> rank_of_expert(num_experts, -1);
  for (size_t slot = 0; slot < base.size(); ++slot) {
    if (base[slot] != kEmptySlot)
      rank_of_expert[base[slot]] = static_cast<int>(slot) / slots_per_rank;
  }
  std::vector<int> group_rank(num_ranks, -1);
  std::vector<char> rank_taken(num_ranks, 0);
  for (int group = 0; group < num_ranks; ++group) {
    std::vector<int> kept(num_ranks, 0);
    for (int e : groups[group]) ++kept[rank_of_expert[e]];
    int best = -1;
    for (int g = 0; g < num_ranks; ++g) {
      if (!rank_taken[g] && (best < 0 || kept[g] > kept[best])) best = g;
    }
    group_rank[group] = best;
    rank_taken[best] = 1;
  }

  // Experts that stay on their rank keep their slot; newcomers take the slots left over.
  std::vector<int> phy2log(base.size(), kEmptySlot);
  for (int group = 0; group < num_ranks; ++group) {
    for (int e : groups[group]) {
      if (rank_of_expert[e] != group_rank[group]) continue;
      for (size_t slot = 0; slot < base.size(); ++slot) {
        if (base[slot] == e) phy2log[slot] = e;
      }
    }
  }
  for (int group = 0; group < num_ranks; ++group) {
    int slot = group_rank[group] * slots_per_rank;
    for (int e : groups[group]) {
      if (rank_of_expert[e] == group_rank[group]) continue;
      while (phy2log[slot] != kEmptySlot) ++slot;
      phy2log[slot] = e;
    }
  }
  return phy2log;
}

class SmartMoePolicy final : public Policy {
 public:
  explicit SmartMoePolicy(const PolicyContext& context) : Policy(context) {}
  std::string_view name() const override { return "smartmoe"; }

  Result<Placement> Replan(const LayerView& view) override {
    // ExpectedStepLoad also checks that the view has a placement and matching sizes.
    KEEL_ASSIGN_OR_RETURN(const StepLoad load, ExpectedStepLoad(view));
    const Placement& current = *view.current;
    const SmartMoeConfig& config = context().config.smartmoe;
    const int per_rank = current.slots_per_rank();
    const int num_ranks = current.num_ranks();

    // Candidates in order of preference on a tie: staying put, greedy swaps, fresh packing, pool.
    const std::vector<int> base = SingleCopy(current);
    std::vector<std::vector<int>> candidates = {
        base, GreedySwaps(base, per_rank, num_ranks, view.expert_load, config.stickiness),
        FreshPacking(base, per_rank, num_ranks, view.expert_load)};
    std::vector<std::vector<int>>& pool = pools_[view.layer];
    for (const auto& member : pool) {
      if (member.size() == base.size()) candidates.push_back(member);
    }

    // A candidate other than the base must cut the max rank load by more than the stickiness;
    // among the eligible ones the cost model picks the fastest over the replan interval.
    const double base_max = MaxOf(RankLoads(base, per_rank, num_ranks, view.expert_load));
    const int interval = std::max(1, context().config.replan_interval_steps);
    int chosen = -1;
    double chosen_score = 0;
    std::vector<Placement> placements;
    for (size_t i = 0; i < candidates.size(); ++i) {
      if (std::find(candidates.begin(), candidates.begin() + i, candidates[i]) !=
          candidates.begin() + i) {
        continue;
      }
      if (i > 0) {
        const double max_load =
            MaxOf(RankLoads(candidates[i], per_rank, num_ranks, view.expert_load));
        if (!(max_load < base_max * (1.0 - config.stickiness) && max_load < base_max)) continue;
      }
      KEEL_ASSIGN_OR_RETURN(Placement placement,
                            Placement::CreateKeepingHomes(current, candidates[i]));
      const CostModel& cost = context().cost;
      const LayerCost layer =
          cost.Estimate(placement, RouteEvenly(placement, load), MigrationSeconds(view, placement));
      const double score = layer.total_seconds() - layer.exposed_migration_seconds +
                           layer.exposed_migration_seconds / interval;
      if (chosen < 0 || score < chosen_score) {
        chosen = static_cast<int>(placements.size());
        chosen_score = score;
      }
      placements.push_back(std::move(placement));
    }

    // The pool keeps the placements that won most recently, so a load pattern that returns finds
    // its placement again; this replan's proposals fill the room that is left.
    std::vector<std::vector<int>> next_pool;
    auto remember = [&](const std::vector<int>& member) {
      if (static_cast<int>(next_pool.size()) >= config.candidate_pool_size) return;
      if (std::find(next_pool.begin(), next_pool.end(), member) == next_pool.end()) {
        next_pool.push_back(member);
      }
    };
    remember(placements[chosen].phy2log());
    for (const auto& member : pool) remember(member);
    remember(candidates[2]);  // the fresh packing
    remember(candidates[1]);  // the greedy swaps
    pool = std::move(next_pool);

    if (placements[chosen].phy2log() == current.phy2log()) return current;
    return placements[chosen];
  }

 private:
  std::map<int, std::vector<std::vector<int>>> pools_;  // per layer, phy2log maps
};

}  // namespace

std::unique_ptr<Policy> MakeSmartMoePolicy(const PolicyContext& context) {
  return std::make_unique<SmartMoePolicy>(context);
}

}  // namespace keel
