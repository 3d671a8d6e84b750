// keel demo's report (tools/demo_report.h).
#include "tools/demo_report.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <span>

#include "kernels/checksum.h"
#include "tools/progress.h"

namespace keel::tools {
namespace {

double Mean(const std::vector<StepMeasurement>& steps, double StepMeasurement::*field) {
  double sum = 0;
  for (const StepMeasurement& m : steps) sum += m.*field;
  return steps.empty() ? 0.0 : sum / static_cast<double>(steps.size());
}

}  // namespace

nlohmann::json ModeJson(const ModeRun& run) {
  const std::vector<StepMeasurement>& steps = run.result.steps;
  nlohmann::json per_step = nlohmann::json::array();
  nlohmann::json imbalance = nlohmann::json::array();
  nlohmann::json loss = nlohmann::json::array();
  nlohmann::json epochs = nlohmann::json::array();
  for (const StepMeasurement& m : steps) {
    per_step.push_back(m.parallel_step_seconds);
    imbalance.push_back(m.imbalance);
    loss.push_back(m.loss);
    epochs.push_back(m.epoch);
  }
  const double step = Mean(steps, &StepMeasurement::parallel_step_seconds);
  const EngineStats& stats = run.result.stats;
  double dispatched = 0;
  double remote = 0;
  double kept = 0;
  double moved = 0;
  double moved_bytes = 0;
  for (const StepMeasurement& m : steps) {
    dispatched += static_cast<double>(m.rows_dispatched);
    remote += static_cast<double>(m.rows_remote);
    kept += static_cast<double>(m.rows_kept);
    moved += static_cast<double>(m.sequences_moved);
    moved_bytes += m.sequence_bytes;
  }
  const double step_count = steps.empty() ? 1.0 : static_cast<double>(steps.size());
  return {
      {"policy", run.policy},
      {"parallel_step_seconds", {{"mean", step}, {"per_step", per_step}}},
      {"expert_seconds", Mean(steps, &StepMeasurement::expert_seconds)},
      {"communication_seconds", Mean(steps, &StepMeasurement::communication_seconds)},
      {"control_seconds", Mean(steps, &StepMeasurement::control_seconds)},
      {"mean_imbalance", Mean(steps, &StepMeasurement::imbalance)},
      {"imbalance", imbalance},
      {"epochs", stats.epochs_committed},
      {"epochs_aborted", stats.epochs_aborted},
      {"plans_unchanged", stats.plans_unchanged},
      {"epoch_per_step", epochs},
      {"bytes_moved", stats.bytes_moved},
      {"exposed_migration_seconds", stats.exposed_migration_seconds},
      {"loss", loss},
      {"engine_overhead_fraction",
       step > 0 ? Mean(steps, &StepMeasurement::engine_seconds) / step : 0.0},
      {"wall_seconds", run.wall_seconds},
      {"rows_dispatched_per_step", dispatched / step_count},
      {"remote_row_fraction", dispatched > 0 ? remote / dispatched : 0.0},
      {"kept_row_fraction", dispatched > 0 ? kept / dispatched : 1.0},
      {"sequences_moved_per_step", moved / step_count},
      {"sequence_bytes_per_step", moved_bytes / step_count},
      {"sequence_seconds", Mean(steps, &StepMeasurement::sequence_seconds)},
      {"all_to_all_bytes_per_step", Mean(steps, &StepMeasurement::all_to_all_bytes)},
      {"group_bytes_per_step", Mean(steps, &StepMeasurement::group_bytes)},
  };
}

void PrintModeTable(const std::vector<nlohmann::json>& modes) {
  const std::vector<std::string> header = {"mode",       "step ms",    "expert ms", "comm ms",
                                           "imbalance",  "epochs",     "aborted",   "moved MB",
                                           "exposed ms", "loss first", "loss last", "overhead %"};
  std::vector<std::vector<std::string>> rows;
  for (const nlohmann::json& m : modes) {
    const auto& loss = m["loss"];
    rows.push_back({m["policy"].get<std::string>(),
                    FormatFixed(m["parallel_step_seconds"]["mean"].get<double>() * 1e3, 2),
                    FormatFixed(m["expert_seconds"].get<double>() * 1e3, 2),
                    FormatFixed(m["communication_seconds"].get<double>() * 1e3, 2),
                    FormatFixed(m["mean_imbalance"].get<double>(), 3),
                    std::to_string(m["epochs"].get<int64_t>()),
                    std::to_string(m["epochs_aborted"].get<int64_t>()),
                    FormatFixed(m["bytes_moved"].get<double>() / 1e6, 2),
                    FormatFixed(m["exposed_migration_seconds"].get<double>() * 1e3, 2),
                    FormatFixed(loss.front().get<double>(), 5),
                    FormatFixed(loss.back().get<double>(), 5),
                    FormatFixed(m["engine_overhead_fraction"].get<double>() * 100, 2)});
  }
  PrintTable(header, rows);
}

std::string FinalWeightsChecksum(const std::vector<float>& weights) {
  char hex[17];
  std::snprintf(hex, sizeof(hex), "%016llx",
                static_cast<unsigned long long>(kernels::cpu::Checksum64(
                    std::as_bytes(std::span<const float>(weights.data(), weights.size())))));
  return hex;
}

double RelativeDifference(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return std::numeric_limits<double>::infinity();
  double largest = 0;
  double difference = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    largest = std::max(largest, std::fabs(static_cast<double>(a[i])));
    difference = std::max(difference, std::fabs(static_cast<double>(a[i]) - b[i]));
  }
  return largest > 0 ? difference / largest : difference;
}

nlohmann::json Target(double value, double target) {
  return {{"value", value}, {"target", target}, {"met", value <= target}};
}

}  // namespace keel::tools
