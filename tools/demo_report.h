// What `keel demo` reports of each of its runs: each run's JSON (ModeJson), the table it prints,
// the final weights' checksum and how far two runs' weights are apart, and a target's verdict.
#pragma once

#include <nlohmann/json.hpp>

#include <string>
#include <vector>

#include "tools/demo_trainer.h"

namespace keel::tools {

// One mode's run as rank 0 saw it (every rank sees the same reduced numbers).
struct ModeRun {
  std::string policy;
  RankRunResult result;
  double wall_seconds = 0;
};

// A run's report: its steps' means and distributions, per-step loss, imbalance and epochs.
nlohmann::json ModeJson(const ModeRun& run);
// The runs' table on stdout, one row per run.
void PrintModeTable(const std::vector<nlohmann::json>& modes);
// Checksum64 of the keel run's final weights, as hex: equal across --memory kinds and transports.
std::string FinalWeightsChecksum(const std::vector<float>& weights);
// max |a - b| / max |a| over two equally long weight vectors (0 when both are zero).
double RelativeDifference(const std::vector<float>& a, const std::vector<float>& b);
// {"value", "target", "met": value <= target}
nlohmann::json Target(double value, double target);

}  // namespace keel::tools
