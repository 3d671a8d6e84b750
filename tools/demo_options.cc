// What one `keel demo` trains and compares (tools/demo_options.h): the runs its flags ask for,
// the flags' checks and the config of its runs.
#include "tools/demo_options.h"

#include <cmath>
#include <string>

#include "common/file.h"
#include "common/listen_address.h"
#include "common/number_text.h"
#include "keel/limits.hpp"
#include "keel/version.hpp"
#include "kernels/device.h"
#include "placement/strategy.h"

namespace keel::tools {
namespace {

constexpr double kDemoExpertTflops = 0.002;   // about what one CPU thread achieves on the experts
constexpr double kDemoLinkGbPerSecond = 4.0;  // about a memcpy between threads

// Rows every rank routes in one step of one run: tokens x top_k per layer.
double RoutedRows(const DemoFlags& f) {
  return static_cast<double>(f.ranks) * f.tokens * f.top_k * f.layers;
}

// Memory the demo's model would take in all ranks, roughly: every slot's weights, gradients and
// Adam state (about 48 bytes per parameter), the teacher, and per layer the activations that
// backward keeps: float rows of hidden + ffn per routed row, measured at 10 to 12 bytes per
// element (--ranks 8 to 64, --hidden 16 to 64); 16 leaves room.
double DemoBytes(const DemoFlags& f) {
  const double parameters_per_expert = 2.0 * f.hidden * f.ffn;
  const double slots = f.ranks * (std::ceil(static_cast<double>(f.experts) / f.ranks) + 2.0);
  const double model = (slots * 48.0 + f.experts * 8.0) * parameters_per_expert * f.layers;
  const double activations = 16.0 * RoutedRows(f) * (f.hidden + f.ffn);
  return model + activations;
}

constexpr double kMaxDemoBytes = 16.0 * (1 << 30);
// Routed rows of one run over all its steps: the ranks are threads that share this machine's
// cores, and a default demo (8 ranks, 30 steps: 2^23 rows) trains for a minute or two on two
// cores, so 2^28 is about an hour there.
constexpr double kMaxDemoRows = 1 << 28;

}  // namespace

bool EngineShardMode(const DemoFlags& f) { return f.shard_hot > 0 || f.shard_experts; }

std::vector<DemoRun> DemoRuns(const DemoFlags& f) {
  if (f.sequence_migration) return {{"keel", "keel"}, {"keel+seq", "keel", true}};
  if (f.condense > 0) {
    return {{"exact", "keel"}, {"condensed", "keel", false, static_cast<float>(f.condense)}};
  }
  if (f.mp > 0) {
    return {{"parm-all", "keel", false, 0, "parm", false},
            {"parm", "keel", false, 0, "parm"},
            {"keel", "keel"},
            {"engine-mp", "keel", false, 0, "ep", true, false, f.mp}};
  }
  if (f.strategy != "ep") return {{"ep", "keel"}, {f.strategy, "keel", false, 0, f.strategy}};
  if (EngineShardMode(f)) return {{"ep", "keel"}, {"shards", "keel", false, 0, "ep", true, true}};
  return {{"static", "static"}, {"keel", "keel"}};
}

bool StrategyMode(const DemoFlags& f) { return f.mp > 0 || f.strategy != "ep"; }

std::pair<std::string, int> ShardsOf(const DemoFlags& f, const KeelConfig& config) {
  const int per_node = config.topology.gpus_per_node;
  if (f.shard_hot > 0) return {"--shard-hot", ShardDegree(config.strategy, per_node)};
  const std::string name = f.mp > 0 ? "parm" : f.strategy;
  if (name == "parm") return {name, MpDegree(config.strategy, per_node)};
  if (name == "esp") return {name, ShardDegree(config.strategy, per_node)};
  return {name, per_node};
}

bool SequenceMode(const DemoFlags& f) { return f.sequence_migration || f.condense > 0; }

bool ShardExperts(const DemoFlags& flags, const KeelConfig& config) {
  return flags.shard_experts || config.policy.keel.shard_experts;
}

Status CheckFlags(const DemoFlags& f, const FlagParser& parser) {
  // Each size between its least and largest value; the largest keep a typo from exhausting memory.
  auto in_range = [](const char* flag, long long value, long long least, long long most) -> Status {
    if (value >= least && value <= most) return Status::Ok();
    return InvalidArgument(std::string(flag) + " " + std::to_string(value) + " must be in [" +
                           std::to_string(least) + ", " + std::to_string(most) + "]");
  };
  KEEL_RETURN_IF_ERROR(in_range("--ranks", f.ranks, 1, 1024));
  KEEL_RETURN_IF_ERROR(in_range("--layers", f.layers, 1, 1024));
  KEEL_RETURN_IF_ERROR(in_range("--experts", f.experts, 1, kMaxExperts));
  KEEL_RETURN_IF_ERROR(in_range("--top-k", f.top_k, 1, 64));
  KEEL_RETURN_IF_ERROR(in_range("--tokens", f.tokens, 1, 1 << 20));
  KEEL_RETURN_IF_ERROR(in_range("--hidden", f.hidden, 1, 1 << 16));
  KEEL_RETURN_IF_ERROR(in_range("--ffn", f.ffn, 1, 1 << 16));
  KEEL_RETURN_IF_ERROR(in_range("--steps", f.steps, 1, 1000000));
  if (f.top_k > f.experts) {
    return InvalidArgument("--top-k " + std::to_string(f.top_k) + " exceeds --experts " +
                           std::to_string(f.experts));
  }
  if (const double bytes = DemoBytes(f); bytes > kMaxDemoBytes) {
    char gib[32];
    std::snprintf(gib, sizeof gib, "%.1f", bytes / (1 << 30));
    return InvalidArgument("--ranks " + std::to_string(f.ranks) + ", --layers " +
                           std::to_string(f.layers) + ", --experts " + std::to_string(f.experts) +
                           ", --tokens " + std::to_string(f.tokens) + ", --top-k " +
                           std::to_string(f.top_k) + ", --hidden " + std::to_string(f.hidden) +
                           " and --ffn " + std::to_string(f.ffn) + " need about " + gib +
                           " GiB, more than the demo's 16 GiB limit");
  }
  if (const double rows = RoutedRows(f) * f.steps; rows > kMaxDemoRows) {
    return InvalidArgument(
        "--steps " + std::to_string(f.steps) + " x --ranks " + std::to_string(f.ranks) +
        " x --tokens " + std::to_string(f.tokens) + " x --top-k " + std::to_string(f.top_k) +
        " x --layers " + std::to_string(f.layers) + " = " + NumberText(rows) +
        " routed rows per run, more than the demo's 2^28 (" + NumberText(kMaxDemoRows) + ")");
  }
  if (f.comm != "local" && f.comm != "mpi") {
    return InvalidArgument("--comm '" + f.comm + "' is not local or mpi");
  }
  if (f.transport != "local" && f.transport != "ucx") {
    return InvalidArgument("--transport '" + f.transport + "' is not local or ucx");
  }
  if (f.memory != "host" && f.memory != "device" && f.memory != "guarded-host") {
    return InvalidArgument("--memory '" + f.memory + "' is not host, device or guarded-host");
  }
  if (f.memory == "device" && !kernels::GpuAvailable()) {
    return FailedPrecondition(
        std::string("--memory device needs a GPU, and ") +
        (kWithCuda ? "the CUDA runtime sees none" : "this keel was built without CUDA") +
        "; --memory guarded-host runs the same device path on the CPU");
  }
  if (f.sequence_migration && f.condense > 0) {
    return InvalidArgument(
        "--sequence-migration and --condense each compare two runs of their own; give one");
  }
  if (!(f.condense >= 0.0 && f.condense <= 1.0)) {
    return InvalidArgument("--condense " + std::to_string(f.condense) +
                           " must be a cosine threshold in (0, 1]");
  }
  if (SequenceMode(f)) {
    KEEL_RETURN_IF_ERROR(in_range("--sequence-tokens", f.sequence_tokens, 1, f.tokens));
    if (f.tokens % f.sequence_tokens != 0) {
      return InvalidArgument("--tokens " + std::to_string(f.tokens) +
                             " is not a multiple of --sequence-tokens " +
                             std::to_string(f.sequence_tokens));
    }
  }
  if (!(f.affinity >= 0.0 && f.affinity <= 1.0)) {
    return InvalidArgument("--sequence-affinity " + NumberText(f.affinity) + " must be in [0, 1]");
  }
  if (!(f.repeat >= 0.0 && f.repeat <= 1.0)) {
    return InvalidArgument("--token-repeat " + NumberText(f.repeat) + " must be in [0, 1]");
  }
  if (f.sequence_objective != "step" && f.sequence_objective != "traffic") {
    return InvalidArgument("--sequence-objective '" + f.sequence_objective +
                           "' is not step or traffic");
  }
  if (!(f.link_gb_per_s >= 0.0 && f.link_gb_per_s <= 1e6)) {
    return InvalidArgument("--link-gb-per-s " + NumberText(f.link_gb_per_s) +
                           " must be in [0, 1e6] (0: no emulated links)");
  }
  if (f.strategy != "ep" && f.strategy != "esp" && f.strategy != "parm" && f.strategy != "ppmoe") {
    return InvalidArgument("--strategy '" + f.strategy + "' is not ep, esp, parm or ppmoe");
  }
  if (f.mp < 0 || f.shard_degree < 0) {
    return InvalidArgument(std::string(f.mp < 0 ? "--mp " : "--shard-degree ") +
                           std::to_string(f.mp < 0 ? f.mp : f.shard_degree) + " must be >= 0");
  }
  if (f.mp > 0 && f.strategy != "ep" && f.strategy != "parm") {
    return InvalidArgument(
        "--mp compares Parm's dispatch with and without de-duplication; it "
        "does not combine with --strategy " +
        f.strategy);
  }
  if (StrategyMode(f) && (SequenceMode(f) || f.memory != "host")) {
    return InvalidArgument(
        "--strategy and --mp train sharded experts in host memory, without --sequence-migration "
        "or --condense");
  }
  if (f.shard_hot < 0 || f.shard_hot > f.experts) {
    return InvalidArgument("--shard-hot " + std::to_string(f.shard_hot) + " is not in [0, " +
                           std::to_string(f.experts) + "] (the experts)");
  }
  if (EngineShardMode(f) && (StrategyMode(f) || SequenceMode(f))) {
    return InvalidArgument(
        "--shard-hot and --shard-experts compare the keel policy without and with the engine's "
        "sharded experts; they do not combine with --strategy, --mp, --sequence-migration or "
        "--condense");
  }
  if (!(f.learning_rate > 0.0 && f.learning_rate < 1.0)) {
    return InvalidArgument("--learning-rate " + NumberText(f.learning_rate) + " must be in (0, 1)");
  }
  // Flags the runs asked for do not read: refused by name rather than ignored.
  const auto refuse_unless = [&](bool applies, const char* flag, const char* which) -> Status {
    if (applies || !parser.IsSet(flag)) return Status::Ok();
    return InvalidArgument(std::string("--") + flag + " applies only " + which);
  };
  KEEL_RETURN_IF_ERROR(
      refuse_unless(f.sequence_migration, "sequence-objective", "with --sequence-migration"));
  for (const char* flag : {"sequence-tokens", "sequence-affinity", "token-repeat"}) {
    KEEL_RETURN_IF_ERROR(
        refuse_unless(SequenceMode(f), flag, "with --sequence-migration or --condense"));
  }
  KEEL_RETURN_IF_ERROR(refuse_unless(f.strategy == "esp" || f.shard_hot > 0, "shard-degree",
                                     "with --strategy esp or --shard-hot (parm's shards are its "
                                     "MP groups: --mp, or strategy.mp_degree)"));
  KEEL_RETURN_IF_ERROR(refuse_unless(f.trace_path.empty(), "zipf",
                                     "to the synthetic gate; with --trace the trace routes"));
  return Status::Ok();
}

Status CheckDemoPaths(const DemoFlags& f) {
  std::string recorded_trace;
  if (!f.config_path.empty()) {
    KEEL_ASSIGN_OR_RETURN(const KeelConfig config, LoadConfigFile(f.config_path));
    recorded_trace = config.monitor.trace_path;
  }
  return CheckOutputsApart({{"--trace", f.trace_path}, {"--config", f.config_path}},
                           {{"--report", f.report_path}, {"monitor.trace_path", recorded_trace}});
}

Result<KeelConfig> MakeConfig(const DemoFlags& f, const FlagParser& parser, int ranks) {
  KeelConfig config;
  if (!f.config_path.empty()) {
    KEEL_ASSIGN_OR_RETURN(config, LoadConfigFile(f.config_path));
    if (config.num_ranks() != ranks) {
      return InvalidArgument(f.config_path + ": topology has " +
                             std::to_string(config.num_ranks()) + " ranks (num_nodes " +
                             std::to_string(config.topology.num_nodes) + " x gpus_per_node " +
                             std::to_string(config.topology.gpus_per_node) + "), the demo runs " +
                             std::to_string(ranks));
    }
  } else {
    config.topology.num_nodes = 1;
    config.topology.gpus_per_node = ranks;
    // The cost model knows the links the demo emulates, or else about a memcpy.
    const double link = f.link_gb_per_s > 0 ? f.link_gb_per_s : kDemoLinkGbPerSecond;
    config.topology.intra_node_gb_per_s = link;
    config.topology.inter_node_gb_per_s = link;
    config.slots.persistent_per_rank = (f.experts + ranks - 1) / ranks + 1;
    config.slots.transient_per_rank = 1;
    config.cost_model.expert_tflops = kDemoExpertTflops;
    config.cost_model.hidden_size = f.hidden;
    config.cost_model.expert_ffn_size = f.ffn;
    config.cost_model.dtype_bytes = 4;
    config.cost_model.home_move_bytes_per_parameter = 12.0;  // float32 weights + Adam's m, v
    // Epochs at the same steps in every mode and on any machine, so that the modes compare
    // step by step (their all-to-all bytes, say) and a run repeats.
    config.policy.plan_adoption = "next_step";
  }
  if (f.config_path.empty() || parser.IsSet("transport")) {
    config.migration.transport = f.transport;
  }
  if (!f.metrics_address.empty()) {
    KEEL_RETURN_IF_ERROR(ParseListenAddress(f.metrics_address).status().WithContext("--metrics"));
    config.monitor.metrics_address = f.metrics_address;
  }
  if (parser.IsSet("shard-degree")) config.strategy.shard_degree = f.shard_degree;
  if (f.mp > 0) config.strategy.mp_degree = f.mp;
  KEEL_RETURN_IF_ERROR(ValidateConfig(config));
  return config;
}

}  // namespace keel::tools
