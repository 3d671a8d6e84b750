// Load of one MoE layer: what a step routed (StepLoad) and what the planner expects next
// (LoadEstimator: last step, sliding window or EMA). Loads are token counts as doubles so that
// estimates can be fractional; observed step counts are whole numbers.
#pragma once

#include <cstdint>
#include <deque>
#include <span>
#include <vector>

#include "common/config.h"
#include "keel/limits.hpp"
#include "keel/status.hpp"

namespace keel {

// One layer, one step: tokens each source rank sent to each logical expert.
struct StepLoad {
  int num_sources = 0;  // ranks the tokens come from (= topology ranks)
  int num_experts = 0;
  std::vector<double> traffic;  // [num_sources * num_experts] tokens from source s to expert e

  // Traffic known per source rank. Fails on a size mismatch or a negative, non-finite or larger
  // than kMaxTokenCount count.
  static Result<StepLoad> FromTraffic(int num_sources, int num_experts,
                                      std::vector<double> traffic);
  // Only per-expert totals known: each expert's tokens come evenly from every source.
  static Result<StepLoad> FromExpertCounts(int num_sources, std::span<const double> counts);

  double at(int source, int expert) const { return traffic[source * num_experts + expert]; }
  // [num_experts] tokens per expert, summed over sources.
  std::vector<double> ExpertTotals() const;
  double TotalTokens() const;
};

// Imbalance (DESIGN.md): max rank load / mean rank load over `rank_tokens` [num_ranks]; 1.0 when
// nothing was routed, so an idle layer reads as balanced.
double Imbalance(std::span<const double> rank_tokens);

// The lower bound no placement can beat: LB = max(T / G, max_e load_e / r_max), where
// `expert_tokens` [num_experts] holds the loads (T their sum), G = num_ranks and r_max =
// max_copies, the most ranks one expert's tokens can be spread over. 0 for no experts.
double LoadLowerBound(std::span<const double> expert_tokens, int num_ranks, int max_copies);

// Whether the traffic estimators of `num_layers` layers, each [num_ranks * num_experts] and
// keeping up to `num_steps` past steps when `config` is a window, stay within kMaxCounts
// (keel/limits.hpp). An error names the sizes and the limit.
Status CheckEstimatorCounts(const EstimatorConfig& config, int64_t num_layers, int64_t num_ranks,
                            int64_t num_experts, int64_t num_steps);

// Per-step observations in, expected next-step values out. Works on any fixed-length vector
// (per-expert loads [E] or traffic matrices [G*E]).
class LoadEstimator {
 public:
  LoadEstimator(const EstimatorConfig& config, int size);

  void Observe(std::span<const double> values);
  // Zeros before the first observation.
  const std::vector<double>& Estimate() const { return estimate_; }
  int observed_steps() const { return observed_steps_; }

 private:
  EstimatorConfig config_;
  std::vector<double> estimate_;
  std::deque<std::vector<double>> window_;
  int observed_steps_ = 0;
};

}  // namespace keel
