// What `keel demo` prints and reports once its runs are done (tools/demo_summary.h).
#include "tools/demo_summary.h"

#include <algorithm>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>

#include "common/file.h"
#include "placement/strategy.h"

namespace keel::tools {
namespace {

// The targets each mode's comparison is held to (docs/benchmarks.md).
constexpr double kTargetStepRatio = 0.75;     // keel parallel step <= 0.75 x static
constexpr double kTargetImbalance = 1.10;     // keel mean imbalance
constexpr double kTargetOverhead = 0.02;      // engine route + control <= 2% of the step
constexpr double kTargetSequenceRatio = 0.9;  // keel+seq parallel step <= 0.9 x keel
constexpr double kTargetShardedRatio = 0.8;   // esp (one expert >= 40% of tokens) <= 0.8 x ep
constexpr double kTargetParmBytes = 0.55;     // Parm's all-to-all bytes <= 0.55 x without de-dup
// Sharded experts sum their partial outputs in another order than a whole expert: the final
// weights may differ from ep's by float rounding, at most this much of the largest weight.
constexpr double kShardedWeightTolerance = 1e-3;

// How the final weights of a demo's first two runs must compare, and how they do. Placement
// never changes the math, so they are bitwise identical, except where the compared runs change
// it (condensation below 1.0) or its rounding (sharded against whole experts: within
// kShardedWeightTolerance of the largest weight).
struct WeightsVerdict {
  bool identical = false;
  bool must_be_identical = true;
  bool sharded_vs_whole = false;
  double difference = 0;  // RelativeDifference
  bool within_tolerance = true;
  bool ok() const { return (identical || !must_be_identical) && within_tolerance; }
};

WeightsVerdict CheckWeights(const DemoFlags& flags, const KeelConfig& config,
                            const std::vector<ModeRun>& runs) {
  WeightsVerdict v;
  const std::vector<float>& first = runs[0].result.final_weights;
  const std::vector<float>& second = runs[1].result.final_weights;
  v.identical = first == second;
  v.sharded_vs_whole = (flags.strategy != "ep" && flags.mp == 0) || EngineShardMode(flags) ||
                       config.policy.keel.shard_experts;
  v.must_be_identical = !(flags.condense > 0 && flags.condense < 1.0) && !v.sharded_vs_whole;
  v.difference = RelativeDifference(first, second);
  v.within_tolerance = !v.sharded_vs_whole || v.difference <= kShardedWeightTolerance;
  return v;
}

// What the summaries below read: the runs, their reports and the first comparison.
struct DemoOutcome {
  const DemoFlags& flags;
  const DemoSetup& setup;
  const std::vector<ModeRun>& runs;
  std::vector<nlohmann::json> modes;  // ModeJson of each run
  double ratio = 0;                   // mean parallel step: the second run's / the first's
  WeightsVerdict weights;
};

// Each mode's comparison: printed and added to the report (SummarizeStrategy also returns
// whether its own checks passed).
void SummarizeSequenceMigration(const DemoOutcome& o, nlohmann::json& report) {
  report["targets"] = {{"sequence_migration_step_ratio", Target(o.ratio, kTargetSequenceRatio)}};
  for (const nlohmann::json& m : o.modes) {
    std::printf("%-9s rows to other ranks %.1f%%, sequences moved per step %.1f (%.2f MB)\n",
                m["policy"].get<std::string>().c_str(),
                100 * m["remote_row_fraction"].get<double>(),
                m["sequences_moved_per_step"].get<double>(),
                m["sequence_bytes_per_step"].get<double>() / 1e6);
  }
  std::printf("keel+seq / keel parallel step: %.3f (target <= %.2f: %s)\n", o.ratio,
              kTargetSequenceRatio, o.ratio <= kTargetSequenceRatio ? "met" : "missed");
}

double BytesPerStep(const nlohmann::json& mode) {
  return mode["all_to_all_bytes_per_step"].get<double>();
}

// --strategy and --mp. With --mp the last two runs train whole experts without and with the
// engine's MP groups: each (token, k) of a group must be dispatched once, and the weights must
// be bitwise those without MP groups.
bool SummarizeStrategy(const DemoOutcome& o, nlohmann::json& report) {
  const DemoFlags& flags = o.flags;
  const KeelConfig& config = o.setup.config;
  const double bytes_ratio =
      BytesPerStep(o.modes[0]) > 0 ? BytesPerStep(o.modes[1]) / BytesPerStep(o.modes[0]) : 0.0;
  for (const nlohmann::json& m : o.modes) {
    std::printf("%-9s all-to-all %.2f MB per step, in-group collectives %.2f MB\n",
                m["policy"].get<std::string>().c_str(), BytesPerStep(m) / 1e6,
                m["group_bytes_per_step"].get<double>() / 1e6);
  }
  report["strategy"] = {
      {"name", flags.mp > 0 ? "parm" : flags.strategy},
      {"shard_degree", ShardDegree(config.strategy, config.topology.gpus_per_node)},
      {"mp_degree", MpDegree(config.strategy, config.topology.gpus_per_node)},
      {"final_weights_relative_difference", o.weights.difference}};
  const std::string second = o.runs[1].policy;
  if (flags.mp == 0) {
    report["targets"] = {{"sharded_parallel_step_ratio", Target(o.ratio, kTargetShardedRatio)}};
    std::printf(
        "%s / ep parallel step: %.3f (target <= %.2f with one expert at >= 40%% of the "
        "tokens: %s)\n",
        second.c_str(), o.ratio, kTargetShardedRatio,
        o.ratio <= kTargetShardedRatio ? "met" : "missed");
    std::printf(
        "final weights vs ep:       %.2e of the largest weight apart (tolerance %.0e: %s)\n",
        o.weights.difference, kShardedWeightTolerance,
        o.weights.within_tolerance ? "within" : "OUTSIDE");
    return true;
  }
  report["targets"] = {{"parm_all_to_all_bytes_ratio", Target(bytes_ratio, kTargetParmBytes)}};
  std::printf("parm / parm-all all-to-all bytes: %.3f (target <= %.2f: %s)\n", bytes_ratio,
              kTargetParmBytes, bytes_ratio <= kTargetParmBytes ? "met" : "missed");
  std::printf("parm / parm-all parallel step:    %.3f\n", o.ratio);

  // The engine's MP groups: every member routes its group's (token, k) entries and dispatches
  // only its share, so each entry is dispatched once, as without MP groups.
  const nlohmann::json& engine = o.modes[3];
  const double entries = static_cast<double>(o.setup.ranks) * o.setup.model.tokens *
                         o.setup.model.top_k * o.setup.model.layers;
  const double dispatched = engine["rows_dispatched_per_step"].get<double>();
  const bool once = dispatched == entries;
  const bool identical = o.runs[2].result.final_weights == o.runs[3].result.final_weights;
  const double keel_step = o.modes[2]["parallel_step_seconds"]["mean"].get<double>();
  const double engine_ratio =
      keel_step > 0 ? engine["parallel_step_seconds"]["mean"].get<double>() / keel_step : 0.0;
  report["engine_mp"] = {{"mp_group_size", flags.mp},
                         {"entries_per_step", entries},
                         {"rows_dispatched_per_step", dispatched},
                         {"final_weights_identical_to_keel", identical},
                         {"parallel_step_ratio_to_keel", engine_ratio}};
  std::printf("engine-mp: %.0f (token, k) rows dispatched per step for %.0f entries: %s\n",
              dispatched, entries, once ? "each once per MP group" : "NOT each once");
  std::printf("engine-mp / keel parallel step:   %.3f (the MP groups' all-gathers added)\n",
              engine_ratio);
  std::printf("engine-mp final weights:          %s\n",
              identical ? "bitwise those of keel without MP groups" : "DIFFER from keel's");
  if (!once) {
    std::fprintf(stderr,
                 "keel demo: the engine's MP groups dispatched %.0f rows for %.0f entries\n",
                 dispatched, entries);
  }
  if (!identical) {
    std::fprintf(stderr, "keel demo: the final expert weights differ between keel and engine-mp\n");
  }
  return once && identical;
}

void SummarizeEngineShards(const DemoOutcome& o, nlohmann::json& report) {
  const DemoFlags& flags = o.flags;
  const bool shard_experts = ShardExperts(flags, o.setup.config);
  const EngineStats& stats = o.runs[1].result.stats;
  const int shards = ShardsOf(flags, o.setup.config).second;
  report["engine_shards"] = {{"shard_hot", flags.shard_hot},
                             {"shards", flags.shard_hot > 0 ? shards : 0},
                             {"shard_experts", shard_experts},
                             {"reshards", stats.reshards},
                             {"final_weights_relative_difference", o.weights.difference}};
  report["targets"] = {{"sharded_parallel_step_ratio", Target(o.ratio, kTargetShardedRatio)}};
  const std::string at_start = flags.shard_hot > 0 ? std::to_string(flags.shard_hot) +
                                                         " hottest experts per layer cut " +
                                                         std::to_string(shards) + " ways"
                                                   : "none at the start";
  std::printf("shards: %s%s, %lld layer reshards by the keel policy\n", at_start.c_str(),
              shard_experts ? ", policy.keel.shard_experts on" : "",
              static_cast<long long>(stats.reshards));
  std::printf(
      "shards / ep parallel step: %.3f (target <= %.2f with one expert at >= 40%% of the "
      "tokens: %s)\n",
      o.ratio, kTargetShardedRatio, o.ratio <= kTargetShardedRatio ? "met" : "missed");
  std::printf("final weights vs ep:       %.2e of the largest weight apart (tolerance %.0e: %s)\n",
              o.weights.difference, kShardedWeightTolerance,
              o.weights.within_tolerance ? "within" : "OUTSIDE");
}

void SummarizeCondensation(const DemoOutcome& o, nlohmann::json& report) {
  const auto& exact_loss = o.modes[0]["loss"];
  const auto& condensed_loss = o.modes[1]["loss"];
  double mean_difference = 0;
  for (size_t i = 0; i < exact_loss.size(); ++i) {
    mean_difference += condensed_loss[i].get<double>() - exact_loss[i].get<double>();
  }
  mean_difference /= static_cast<double>(std::max<size_t>(1, exact_loss.size()));
  const double kept = o.modes[1]["kept_row_fraction"].get<double>();
  report["condensation"] = {{"threshold", o.flags.condense},
                            {"rows_saved_fraction", 1.0 - kept},
                            {"loss_last_exact", exact_loss.back()},
                            {"loss_last_condensed", condensed_loss.back()},
                            {"mean_loss_difference", mean_difference}};
  std::printf("rows saved by condensation: %.1f%% of the forward dispatch (threshold %.4g)\n",
              100 * (1.0 - kept), o.flags.condense);
  std::printf("loss, condensed - exact:    last %+.3e, mean over steps %+.3e\n",
              condensed_loss.back().get<double>() - exact_loss.back().get<double>(),
              mean_difference);
  std::printf("condensed / exact parallel step: %.3f\n", o.ratio);
}

// The default demo: static against keel, and keel's targets.
void SummarizeStaticVsKeel(const DemoOutcome& o, nlohmann::json& report) {
  const nlohmann::json& keel = o.modes[1];
  const double imbalance = keel["mean_imbalance"].get<double>();
  const double overhead = keel["engine_overhead_fraction"].get<double>();
  report["targets"] = {{"keel_parallel_step_ratio", Target(o.ratio, kTargetStepRatio)},
                       {"keel_mean_imbalance", Target(imbalance, kTargetImbalance)},
                       {"keel_engine_overhead_fraction", Target(overhead, kTargetOverhead)}};
  std::printf("keel / static parallel step: %.3f (target <= %.2f: %s)\n", o.ratio, kTargetStepRatio,
              o.ratio <= kTargetStepRatio ? "met" : "missed");
  std::printf("keel mean imbalance:         %.3f (target <= %.2f: %s)\n", imbalance,
              kTargetImbalance, imbalance <= kTargetImbalance ? "met" : "missed");
  std::printf("keel engine overhead:        %.2f%% (target <= %.0f%%: %s)\n", overhead * 100,
              kTargetOverhead * 100, overhead <= kTargetOverhead ? "met" : "missed");
}

// The report's fields every mode has.
nlohmann::json CommonReport(const DemoFlags& flags, const DemoOutcome& o) {
  const DemoSetup& setup = o.setup;
  const DemoModelOptions& model = setup.model;
  const KeelConfig& config = setup.config;
  nlohmann::json order = nlohmann::json::array();
  nlohmann::json modes = nlohmann::json::object();
  for (size_t i = 0; i < o.runs.size(); ++i) {
    order.push_back(o.runs[i].policy);
    modes[o.runs[i].policy] = o.modes[i];
  }
  nlohmann::json report = {
      {"ranks", setup.ranks},
      {"comm", setup.mpi() ? "mpi" : "local"},
      {"transport", config.migration.transport},
      {"memory", flags.memory},
      {"model",
       {{"layers", model.layers},
        {"experts", model.experts},
        {"top_k", model.top_k},
        {"tokens_per_rank", model.tokens},
        {"hidden", model.ffn.hidden},
        {"ffn", model.ffn.ffn},
        {"steps", model.steps},
        {"seed", model.seed},
        {"learning_rate", model.adam.learning_rate},
        {"gate", setup.gate->description()}}},
      {"config",
       {{"num_ranks", config.num_ranks()},
        {"persistent_per_rank", config.slots.persistent_per_rank},
        {"transient_per_rank", config.slots.transient_per_rank},
        {"yaml", ConfigToYaml(config)}}},
      {"mode_order", order},
      {"modes", modes},
      {"final_weights_identical", o.weights.identical},
      {"final_weights_checksum", FinalWeightsChecksum(o.runs[1].result.final_weights)},
  };
  if (setup.sequences) {
    report["sequences"] = {{"tokens_per_sequence", flags.sequence_tokens},
                           {"affinity", flags.affinity},
                           {"token_repeat", flags.repeat},
                           {"link_gb_per_s", flags.link_gb_per_s},
                           {"objective", flags.sequence_objective}};
  }
  return report;
}

}  // namespace

Result<int> ReportDemo(const DemoFlags& flags, const DemoSetup& setup,
                       const std::vector<ModeRun>& runs) {
  DemoOutcome o{flags, setup, runs, {}, 0.0, CheckWeights(flags, setup.config, runs)};
  if (!setup.rank0) return o.weights.ok() ? 0 : 1;
  for (const ModeRun& run : runs) o.modes.push_back(ModeJson(run));
  const double first_step = o.modes[0]["parallel_step_seconds"]["mean"].get<double>();
  const double second_step = o.modes[1]["parallel_step_seconds"]["mean"].get<double>();
  o.ratio = first_step > 0 ? second_step / first_step : 0.0;
  nlohmann::json report = CommonReport(flags, o);

  std::printf("\n");
  PrintModeTable(o.modes);
  std::printf("\n");
  bool checks_passed = true;
  if (flags.sequence_migration) {
    SummarizeSequenceMigration(o, report);
  } else if (StrategyMode(flags)) {
    checks_passed = SummarizeStrategy(o, report);
  } else if (EngineShardMode(flags)) {
    SummarizeEngineShards(o, report);
  } else if (flags.condense > 0) {
    SummarizeCondensation(o, report);
  } else {
    SummarizeStaticVsKeel(o, report);
  }
  const WeightsVerdict& weights = o.weights;
  std::printf("final weights identical:     %s%s\n", weights.identical ? "yes (bitwise)" : "NO",
              weights.must_be_identical || weights.identical ? ""
              : weights.sharded_vs_whole
                  ? " (not expected: shards sum their outputs in another order)"
                  : " (not expected: condensation below 1.0 changes the math)");
  if (!flags.report_path.empty()) {
    KEEL_RETURN_IF_ERROR(WriteFileAtomically(flags.report_path, report.dump(2) + "\n"));
    std::printf("report: %s\n", flags.report_path.c_str());
  }
  std::fflush(stdout);
  if (!weights.ok()) {
    std::fprintf(stderr, "keel demo: the final expert weights differ between %s and %s%s\n",
                 runs[0].policy.c_str(), runs[1].policy.c_str(),
                 weights.sharded_vs_whole ? " by more than the rounding tolerance" : "");
  }
  return weights.ok() && checks_passed ? 0 : 1;
}

}  // namespace keel::tools
