// StepLoad construction and the load estimators.
#include "placement/load.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>

namespace keel {

Result<StepLoad> StepLoad::FromTraffic(int num_sources, int num_experts,
                                       std::vector<double> traffic) {
  if (num_sources < 1 || num_experts < 1) {
    return InvalidArgument("traffic matrix needs >= 1 source and expert, got " +
                           std::to_string(num_sources) + " x " + std::to_string(num_experts));
  }
  if (traffic.size() != static_cast<size_t>(num_sources) * num_experts) {
    return InvalidArgument("traffic matrix has " + std::to_string(traffic.size()) +
                           " entries, expected " + std::to_string(num_sources) + " x " +
                           std::to_string(num_experts));
  }
  for (size_t i = 0; i < traffic.size(); ++i) {
    if (!std::isfinite(traffic[i]) || traffic[i] < 0 || traffic[i] > kMaxTokenCount) {
      return InvalidArgument("traffic[source " + std::to_string(i / num_experts) + "][expert " +
                             std::to_string(i % num_experts) + "] = " + std::to_string(traffic[i]) +
                             " is not a token count in [0, 1e15]");
    }
  }
  StepLoad load;
  load.num_sources = num_sources;
  load.num_experts = num_experts;
  load.traffic = std::move(traffic);
  return load;
}

Result<StepLoad> StepLoad::FromExpertCounts(int num_sources, std::span<const double> counts) {
  if (num_sources < 1) {
    return InvalidArgument("num_sources must be >= 1, got " + std::to_string(num_sources));
  }
  const int num_experts = static_cast<int>(counts.size());
  std::vector<double> traffic(static_cast<size_t>(num_sources) * num_experts);
  for (int s = 0; s < num_sources; ++s) {
    for (int e = 0; e < num_experts; ++e) traffic[s * num_experts + e] = counts[e] / num_sources;
  }
  return FromTraffic(num_sources, num_experts, std::move(traffic));
}

std::vector<double> StepLoad::ExpertTotals() const {
  std::vector<double> totals(num_experts, 0.0);
  for (int s = 0; s < num_sources; ++s) {
    for (int e = 0; e < num_experts; ++e) totals[e] += at(s, e);
  }
  return totals;
}

double StepLoad::TotalTokens() const {
  return std::accumulate(traffic.begin(), traffic.end(), 0.0);
}

Status CheckEstimatorCounts(const EstimatorConfig& config, int64_t num_layers, int64_t num_ranks,
                            int64_t num_experts, int64_t num_steps) {
  // The estimate, plus the window's rows.
  const int64_t rows = 1 + (config.kind == EstimatorKind::kSlidingWindow
                                ? std::min<int64_t>(config.window_steps, num_steps)
                                : 0);
  const double counts = static_cast<double>(num_layers) * num_ranks * num_experts * rows;
  if (counts <= static_cast<double>(kMaxCounts)) return Status::Ok();
  return InvalidArgument("num_layers x ranks x num_experts" +
                         std::string(rows > 1 ? " x (estimator.window_steps + 1)" : "") + " = " +
                         std::to_string(num_layers) + " x " + std::to_string(num_ranks) + " x " +
                         std::to_string(num_experts) +
                         (rows > 1 ? " x " + std::to_string(rows) : std::string()) +
                         " load counts, more than the 2^26 the estimators of a job hold");
}

LoadEstimator::LoadEstimator(const EstimatorConfig& config, int size)
    : config_(config), estimate_(size, 0.0) {}

void LoadEstimator::Observe(std::span<const double> values) {
  const size_t n = estimate_.size();
  switch (config_.kind) {
    case EstimatorKind::kLastStep:
      estimate_.assign(values.begin(), values.end());
      break;
    case EstimatorKind::kEma:
      if (observed_steps_ == 0) {
        estimate_.assign(values.begin(), values.end());
      } else {
        const double decay = config_.ema_decay;
        for (size_t i = 0; i < n; ++i) {
          estimate_[i] = decay * estimate_[i] + (1.0 - decay) * values[i];
        }
      }
      break;
    case EstimatorKind::kSlidingWindow: {
      window_.emplace_back(values.begin(), values.end());
      if (static_cast<int>(window_.size()) > config_.window_steps) window_.pop_front();
      // Summing the window afresh (not add-new, subtract-old) keeps the estimate bit-identical
      // on every rank whatever the history length.
      const double count = static_cast<double>(window_.size());
      for (size_t i = 0; i < n; ++i) {
        double sum = 0;
        for (const auto& row : window_) sum += row[i];
        estimate_[i] = sum / count;
      }
      break;
    }
  }
  ++observed_steps_;
}

double Imbalance(std::span<const double> rank_tokens) {
  if (rank_tokens.empty()) return 1.0;
  const double mean =
      std::accumulate(rank_tokens.begin(), rank_tokens.end(), 0.0) / rank_tokens.size();
  return mean > 0 ? *std::max_element(rank_tokens.begin(), rank_tokens.end()) / mean : 1.0;
}

double LoadLowerBound(std::span<const double> expert_tokens, int num_ranks, int max_copies) {
  if (expert_tokens.empty()) return 0.0;
  const double total = std::accumulate(expert_tokens.begin(), expert_tokens.end(), 0.0);
  const double hottest = *std::max_element(expert_tokens.begin(), expert_tokens.end());
  return std::max(total / num_ranks, hottest / max_copies);
}

}  // namespace keel
