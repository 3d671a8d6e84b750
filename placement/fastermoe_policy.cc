// `fastermoe`: FasterMoE's shadowing. The persistent placement never changes; every step the
// hottest experts are broadcast to all ranks ("shadowed") while the cost model predicts that the
// broadcast of their weights and gradients costs less than the imbalance and traffic it removes.
#include <algorithm>
#include <numeric>
#include <string>
#include <vector>

#include "placement/policy.h"

namespace keel {
namespace {

class FasterMoePolicy final : public Policy {
 public:
  explicit FasterMoePolicy(const PolicyContext& context) : Policy(context) {}
  std::string_view name() const override { return "fastermoe"; }

  Result<Placement> Replan(const LayerView& view) override {
    if (view.current == nullptr) return InvalidArgument("fastermoe: LayerView.current is null");
    return *view.current;
  }

  // Shadows are chosen from this step's own counts, as FasterMoE decides after the gate: the
  // next hottest expert joins while the predicted layer time drops, up to max_shadowed_experts.
  Result<StepRouting> Route(int /*layer*/, const Placement& placement,
                            const StepLoad& load) override {
    if (load.num_experts != placement.num_experts()) {
      return InvalidArgument("step load has " + std::to_string(load.num_experts) +
                             " experts, placement has " + std::to_string(placement.num_experts()));
    }
    const std::vector<double> totals = load.ExpertTotals();
    std::vector<int> order(totals.size());
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
                     [&](int a, int b) { return totals[a] > totals[b]; });

    const CostModel& cost = context().cost;
    StepRouting best = RouteEvenly(placement, load);
    double best_seconds = cost.Estimate(placement, best).total_seconds();
    std::vector<int> shadowed;
    const int limit =
        std::min(context().config.fastermoe.max_shadowed_experts, placement.num_experts());
    for (int i = 0; i < limit && totals[order[i]] > 0; ++i) {
      shadowed.push_back(order[i]);
      StepRouting trial = RouteWithShadows(placement, load, shadowed);
      const double seconds = cost.Estimate(placement, trial).total_seconds();
      if (!(seconds < best_seconds)) break;
      best = std::move(trial);
      best_seconds = seconds;
    }
    return best;
  }
};

}  // namespace

std::unique_ptr<Policy> MakeFasterMoePolicy(const PolicyContext& context) {
  return std::make_unique<FasterMoePolicy>(context);
}

}  // namespace keel
