// `trtllm`: TensorRT-LLM's online expert load balancer. Each replan updates only some layers:
// the layers fall into n = ceil(num_layers / layer_updates_per_iter) buckets, layer l in bucket
// l mod n (one more, empty, bucket when the first and the last hold as many layers), and the
// buckets take turns, one per replan. A layer whose turn it is gets a new placement from
// TensorRT-LLM's planner, which fills every slot afresh:
// - replication: every expert starts with one copy; each further slot goes to the expert with the
//   most load per copy (ties: the higher expert id); with no load at all, copies go round-robin;
// - placement: copies, the most load per copy first (ties: the lower expert id), each on the
//   least-loaded rank with a free slot (ties: the lower rank), filling its slots in order.
// Tokens split evenly among copies. Experts keep their homes where a copy stays.
#include <algorithm>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "placement/policy.h"

namespace keel {
namespace {

class TrtllmPolicy final : public Policy {
 public:
  explicit TrtllmPolicy(const PolicyContext& context) : Policy(context) {}
  std::string_view name() const override { return "trtllm"; }

  // Every slot filled, for a uniform load.
  Result<Placement> Initial(int /*layer*/) override {
    return Placement::Create(context().num_experts, context().topology.num_ranks(),
                             Plan(std::vector<double>(context().num_experts, 0.0)));
  }

  Result<Placement> Replan(const LayerView& view) override;

 private:
  std::vector<int> Plan(std::span<const double> load) const;
  bool MyTurn(int layer);

  long replans_ = 0;  // replans of this layer so far: whose turn it is
};

bool TrtllmPolicy::MyTurn(int layer) {
  const int num_layers = context().num_layers;
  const int per_replan = context().config.trtllm.layer_updates_per_iter;
  const int buckets = (num_layers + per_replan - 1) / per_replan;
  auto bucket_size = [&](int b) { return (num_layers - b + buckets - 1) / buckets; };
  const int turns = buckets + (buckets > 1 && bucket_size(0) == bucket_size(buckets - 1) ? 1 : 0);
  return replans_++ % turns == layer % buckets;
}

std::vector<int> TrtllmPolicy::Plan(std::span<const double> load) const {
  const int num_experts = context().num_experts;
  const int num_ranks = context().topology.num_ranks();
  const int per_rank = context().slots_per_rank;
  const int num_slots = num_ranks * per_rank;
  const bool idle = std::all_of(load.begin(), load.end(), [](double l) { return l <= 0; });

  std::vector<int> copies(num_experts, 1);
  for (int slot = num_experts; slot < num_slots; ++slot) {
    int best = 0;
    if (idle) {
      best = (slot - num_experts) % num_experts;
    } else {
      for (int e = 1; e < num_experts; ++e) {
        if (load[e] / copies[e] >= load[best] / copies[best]) best = e;
      }
    }
    ++copies[best];
  }

  std::vector<int> order(num_experts);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int a, int b) { return load[a] / copies[a] > load[b] / copies[b]; });
  std::vector<int> phy2log(num_slots, kEmptySlot);
  std::vector<double> rank_load(num_ranks, 0.0);
  std::vector<int> used(num_ranks, 0);
  for (int e : order) {
    for (int c = 0; c < copies[e]; ++c) {
      int target = -1;
      for (int r = 0; r < num_ranks; ++r) {
        if (used[r] < per_rank && (target < 0 || rank_load[r] < rank_load[target])) target = r;
      }
      phy2log[target * per_rank + used[target]++] = e;
      rank_load[target] += load[e] / copies[e];
    }
  }
  return phy2log;
}

Result<Placement> TrtllmPolicy::Replan(const LayerView& view) {
  KEEL_RETURN_IF_ERROR(CheckLayerView(view));
  if (!MyTurn(view.layer) && !view.fresh_start) return *view.current;
  return Placement::CreateKeepingHomes(*view.current, Plan(view.expert_load));
}

}  // namespace

std::unique_ptr<Policy> MakeTrtllmPolicy(const PolicyContext& context) {
  return std::make_unique<TrtllmPolicy>(context);
}

}  // namespace keel
