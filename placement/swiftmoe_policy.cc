// `swiftmoe`: SwiftMoE's split of an expert's parameters from its optimizer state. The optimizer
// state stays where the static placement put it (homes never move); at every replan the spare
// slots are planned afresh from the estimated load, and only parameters move to fill them. Each
// copy away from home sends its gradient to the home and receives updated weights every step,
// which the cost model charges as replica sync.
//
// A replan gives the spare slots to the experts with the most tokens per copy, one at a time,
// then places the new copies heaviest first on the least-loaded rank with a spare slot that does
// not already hold the expert. Copies already in a slot that the new plan keeps stay there, so
// only the changed slots move parameters.
#include <algorithm>
#include <memory>
#include <numeric>
#include <vector>

#include "placement/policy.h"

namespace keel {
namespace {

class SwiftMoePolicy final : public Policy {
 public:
  explicit SwiftMoePolicy(const PolicyContext& context) : Policy(context) {}
  std::string_view name() const override { return "swiftmoe"; }

  Result<Placement> Replan(const LayerView& view) override;
};

Result<Placement> SwiftMoePolicy::Replan(const LayerView& view) {
  KEEL_RETURN_IF_ERROR(CheckLayerView(view));
  const Placement& current = *view.current;
  const int num_experts = current.num_experts();
  const int num_ranks = current.num_ranks();
  const int per_rank = current.slots_per_rank();

  // Every expert keeps its home slot; the rest are spare.
  std::vector<int> phy2log(current.num_slots(), kEmptySlot);
  std::vector<double> rank_load(num_ranks, 0.0);
  std::vector<int> spare(num_ranks, per_rank);
  for (int e = 0; e < num_experts; ++e) {
    const int slot = current.home_slot(e);
    phy2log[slot] = e;
    --spare[current.rank_of_slot(slot)];
  }
  const int num_spare = std::accumulate(spare.begin(), spare.end(), 0);
  auto holds = [&](int rank, int e) {
    const auto first = phy2log.begin() + rank * per_rank;
    return std::find(first, first + per_rank, e) != first + per_rank;
  };

  // Copies per expert: each spare slot to the expert with the most tokens per copy.
  std::vector<int> copies(num_experts, 1);
  for (int given = 0; given < num_spare; ++given) {
    int best = -1;
    for (int e = 0; e < num_experts; ++e) {
      if (copies[e] >= num_ranks) continue;
      if (best < 0 || view.expert_load[e] / copies[e] > view.expert_load[best] / copies[best]) {
        best = e;
      }
    }
    if (best < 0 || view.expert_load[best] <= 0) break;
    ++copies[best];
  }
  for (int e = 0; e < num_experts; ++e) {
    rank_load[current.home(e)] += view.expert_load[e] / copies[e];
  }

  // Copies still wanted per expert beyond its home; those that the current placement already has
  // in a spare slot stay in place.
  std::vector<int> wanted(num_experts);
  for (int e = 0; e < num_experts; ++e) wanted[e] = copies[e] - 1;
  for (int slot = 0; slot < current.num_slots(); ++slot) {
    const int e = current.expert_at(slot);
    if (e == kEmptySlot || phy2log[slot] != kEmptySlot || wanted[e] == 0) continue;
    const int rank = current.rank_of_slot(slot);
    if (holds(rank, e)) continue;
    phy2log[slot] = e;
    --wanted[e];
    --spare[rank];
    rank_load[rank] += view.expert_load[e] / copies[e];
  }

  // The rest, heaviest copy first, each on the least-loaded rank that can take it.
  std::vector<int> order(num_experts);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
    return view.expert_load[a] / copies[a] > view.expert_load[b] / copies[b];
  });
  for (int e : order) {
    for (; wanted[e] > 0; --wanted[e]) {
      int target = -1;
      for (int r = 0; r < num_ranks; ++r) {
        if (spare[r] == 0) continue;
        if (holds(r, e)) continue;
        if (target < 0 || rank_load[r] < rank_load[target]) target = r;
      }
      if (target < 0) break;
      int slot = target * per_rank;
      while (phy2log[slot] != kEmptySlot) ++slot;
      phy2log[slot] = e;
      --spare[target];
      rank_load[target] += view.expert_load[e] / copies[e];
    }
  }
  return Placement::Create(num_experts, num_ranks, std::move(phy2log), current.home());
}

}  // namespace

std::unique_ptr<Policy> MakeSwiftMoePolicy(const PolicyContext& context) {
  return std::make_unique<SwiftMoePolicy>(context);
}

}  // namespace keel
