// `keel demo`: every rank really trains a small MoE model on the CPU through the Keel engine, once
// with the static placement and once with the `keel` policy from the same seed, then compares
// them: parallel step time, imbalance, epochs, moved bytes, loss, and whether the final expert
// weights are bitwise identical (placement must never change the math). Luffy's runs compare the
// keel policy without and with sequence migration (--sequence-migration), or exact training with
// token condensation (--condense). Ranks are threads (default) or MPI processes
// (`mpirun -np N keel demo --comm mpi --transport ucx`).
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <numeric>
#include <optional>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "comm/communicator.h"
#include "common/config.h"
#include "common/file.h"
#include "keel/limits.hpp"
#include "keel/local_group.hpp"
#include "keel/version.hpp"
#include "kernels/device.h"
#include "migration/transport_factory.h"
#include "monitor/metrics.h"
#include "monitor/trace.h"
#include "placement/strategy.h"
#include "tools/commands.h"
#include "tools/demo_report.h"
#include "tools/demo_sequences.h"
#include "tools/demo_trainer.h"
#include "tools/flags.h"
#include "tools/progress.h"

#if KEEL_TOOLS_WITH_MPI
#include <mpi.h>
#endif

namespace keel::tools {
namespace {

// The issue's targets for the default demo.
constexpr double kTargetStepRatio = 0.75;     // keel parallel step <= 0.75 x static
constexpr double kTargetImbalance = 1.10;     // keel mean imbalance
constexpr double kTargetOverhead = 0.02;      // engine route + control <= 2% of the step
constexpr double kTargetSequenceRatio = 0.9;  // keel+seq parallel step <= 0.9 x keel
constexpr double kTargetShardedRatio = 0.8;   // esp (one expert >= 40% of tokens) <= 0.8 x ep
constexpr double kTargetParmBytes = 0.55;     // Parm's all-to-all bytes <= 0.55 x without de-dup
// Sharded experts sum their partial outputs in another order than a whole expert: the final
// weights may differ from ep's by float rounding, at most this much of the largest weight.
constexpr double kShardedWeightTolerance = 1e-3;
constexpr double kDemoExpertTflops = 0.002;   // about what one CPU thread achieves on the experts
constexpr double kDemoLinkGbPerSecond = 4.0;  // about a memcpy between threads

struct DemoFlags {
  int ranks = 8;
  std::string comm = "local";
  std::string transport = "local";
  std::string memory = "host";
  int layers = 4;
  int experts = 32;
  int top_k = 2;
  int tokens = 4096;
  int hidden = 16;
  int ffn = 32;
  int steps = 30;
  uint64_t seed = 1;
  double zipf = 1.0;
  double learning_rate = AdamOptions().learning_rate;
  std::string config_path;
  std::string metrics_address;
  std::string report_path;
  std::string trace_path;
  bool quiet = false;
  // Luffy (docs/luffy.md).
  bool sequence_migration = false;
  double condense = 0;  // threshold; 0 = off
  int sequence_tokens = 256;
  double affinity = 0.7;
  double repeat = 0;  // with --condense and no --token-repeat: 0.25 (RunDemo sets it)
  double link_gb_per_s = 0;
  std::string sequence_objective = "step";
  // Parallel strategies (docs/strategies.md).
  std::string strategy = "ep";
  int shard_degree = 0;  // esp; 0 = gpus_per_node
  int mp = 0;            // > 0: Parm with MP groups of this many ranks, without and with de-dup
  // Sharded experts in the engine (docs/strategies.md, "Sharded experts in the engine").
  int shard_hot = 0;           // > 0: shard each layer's this many hottest experts from the start
  bool shard_experts = false;  // the keel policy shards or replicates per expert
};

// The runs a demo compares: static against keel by default; with --sequence-migration the
// keel policy without and with it; with --condense exact against condensed training; with
// --strategy whole experts under the keel policy against the strategy's sharded ones; with --mp
// Parm's dispatch without and with its de-duplication, then whole experts under the keel policy
// without and with the engine's MP groups; with --shard-hot or --shard-experts the keel policy
// without and with the engine's sharded experts.
struct DemoRun {
  std::string name;
  std::string policy;
  bool migrate_sequences = false;
  float condense_threshold = 0;
  std::string strategy = "ep";
  bool parm_dedup = true;
  bool engine_shards = false;  // --shard-hot's experts, or policy.keel.shard_experts
  int mp_group_size = 1;       // the engine's MP groups (EngineOptions::mp_group_size)
};

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

// The sharded strategy a demo runs, and the shards each expert has under it.
std::pair<std::string, int> ShardsOf(const DemoFlags& f, const KeelConfig& config) {
  const int per_node = config.topology.gpus_per_node;
  if (f.shard_hot > 0) return {"--shard-hot", ShardDegree(config.strategy, per_node)};
  const std::string name = f.mp > 0 ? "parm" : f.strategy;
  if (name == "parm") return {name, MpDegree(config.strategy, per_node)};
  if (name == "esp") return {name, ShardDegree(config.strategy, per_node)};
  return {name, per_node};
}

bool SequenceMode(const DemoFlags& f) { return f.sequence_migration || f.condense > 0; }

// Each layer's `count` hottest experts by the gate's first step (all ranks' rows; the lower id
// first on a tie), each to be sharded `shards` ways.
std::vector<ShardedExpert> HottestExperts(const TokenGate& gate, int count, int shards, int ranks) {
  std::vector<ShardedExpert> hottest;
  if (count <= 0) return hottest;
  for (int l = 0; l < gate.num_layers(); ++l) {
    std::vector<int64_t> rows;
    for (int r = 0; r < ranks; ++r) {
      const std::vector<int64_t> counts = gate.Counts(0, l, r);
      rows.resize(counts.size(), 0);
      for (size_t e = 0; e < counts.size(); ++e) rows[e] += counts[e];
    }
    std::vector<int> order(rows.size());
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return rows[a] > rows[b]; });
    for (int i = 0; i < count && i < static_cast<int>(order.size()); ++i) {
      hottest.push_back({l, order[i], shards});
    }
  }
  return hottest;
}

int Fail(const Status& status) {
  std::fprintf(stderr, "keel demo: %s\n", status.message().c_str());
  return status.code() == StatusCode::kInvalidArgument || status.code() == StatusCode::kNotFound
             ? 2
             : 1;
}

// Memory the demo's model would take in all ranks, roughly: every slot's weights, gradients and
// Adam state (about 48 bytes per parameter), the teacher, and per layer the activations that
// backward keeps (four rows of hidden + ffn int64 or double values per routed token).
double DemoBytes(const DemoFlags& f) {
  const double parameters_per_expert = 2.0 * f.hidden * f.ffn;
  const double slots = f.ranks * (std::ceil(static_cast<double>(f.experts) / f.ranks) + 2.0);
  const double model = (slots * 48.0 + f.experts * 8.0) * parameters_per_expert * f.layers;
  const double activations =
      32.0 * f.ranks * static_cast<double>(f.tokens) * f.top_k * f.layers * (f.hidden + f.ffn);
  return model + activations;
}

constexpr double kMaxDemoBytes = 16.0 * (1 << 30);

Status CheckFlags(const DemoFlags& f) {
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
    return InvalidArgument("--sequence-affinity " + std::to_string(f.affinity) +
                           " must be in [0, 1]");
  }
  if (!(f.repeat >= 0.0 && f.repeat <= 1.0)) {
    return InvalidArgument("--token-repeat " + std::to_string(f.repeat) + " must be in [0, 1]");
  }
  if (f.sequence_objective != "step" && f.sequence_objective != "traffic") {
    return InvalidArgument("--sequence-objective '" + f.sequence_objective +
                           "' is not step or traffic");
  }
  if (!(f.link_gb_per_s >= 0.0 && f.link_gb_per_s <= 1e6)) {
    return InvalidArgument("--link-gb-per-s " + std::to_string(f.link_gb_per_s) +
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
    return InvalidArgument("--learning-rate " + std::to_string(f.learning_rate) +
                           " must be in (0, 1)");
  }
  return Status::Ok();
}

// The config of a run: --config as written (its topology must have `ranks` ranks), or 1 node x
// `ranks` GPUs with room for the static placement plus one spare persistent slot and one transient
// slot per rank, the cost model sized to the demo's experts on a CPU.
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
  }
  if (f.config_path.empty() || parser.IsSet("transport")) {
    config.migration.transport = f.transport;
  }
  if (!f.metrics_address.empty()) config.monitor.metrics_address = f.metrics_address;
  if (parser.IsSet("shard-degree")) config.strategy.shard_degree = f.shard_degree;
  if (f.mp > 0) config.strategy.mp_degree = f.mp;
  KEEL_RETURN_IF_ERROR(ValidateConfig(config));
  return config;
}

// Live progress on stderr from rank 0: one line per step, redrawn in place on a terminal.
class DemoProgress {
 public:
  DemoProgress(std::string policy, int steps)
      : policy_(std::move(policy)), steps_(steps), terminal_(isatty(fileno(stderr)) != 0) {}

  void OnStep(const StepMeasurement& m) {
    std::string bars;
    const int64_t most =
        std::max<int64_t>(1, *std::max_element(m.rank_rows.begin(), m.rank_rows.end()));
    static const char* const kBlocks[] = {"▁", "▂", "▃", "▄", "▅", "▆", "▇", "█"};
    for (int64_t rows : m.rank_rows) {
      const int level = static_cast<int>(std::lround(7.0 * static_cast<double>(rows) / most));
      bars += kBlocks[std::clamp(level, 0, 7)];
    }
    const char* in_flight = m.migration_in_flight ? "1" : "0";
    std::fprintf(stderr,
                 "%s%-6s step %3lld/%d  loss %.5f  ranks %s  imbalance %.3f  epoch %lld "
                 "(committed %lld, aborted %lld, in flight %s)  step %.1f ms%s",
                 terminal_ ? "\r\033[K" : "", policy_.c_str(), static_cast<long long>(m.step + 1),
                 steps_, m.loss, bars.c_str(), m.imbalance, static_cast<long long>(m.epoch),
                 static_cast<long long>(m.epochs_committed),
                 static_cast<long long>(m.epochs_aborted), in_flight, m.parallel_step_seconds * 1e3,
                 terminal_ ? "" : "\n");
    std::fflush(stderr);
  }
  void Finish() {
    if (terminal_) std::fputc('\n', stderr);
  }

 private:
  std::string policy_;
  int steps_;
  bool terminal_;
};

// Ranks as threads of one LocalGroup (communicators and the local transport); sequences move
// over a fabric of their own, apart from the engine's migrations.
Result<ModeRun> RunThreads(const RankRunOptions& base, int ranks, DemoProgress* progress) {
  KEEL_ASSIGN_OR_RETURN(std::unique_ptr<LocalGroup> group, LocalGroup::Create(ranks));
  LocalFabric sequence_fabric(ranks);
  std::vector<std::optional<Result<RankRunResult>>> results(ranks);
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r) {
    threads.emplace_back([&, r] {
      Result<std::unique_ptr<Communicator>> joined = group->Join(r);
      if (!joined.ok()) {
        results[r] = joined.status();
        return;
      }
      std::unique_ptr<Communicator> communicator = std::move(joined).value();
      RankRunOptions options = base;
      options.communicator = communicator.get();
      options.local_group = group.get();
      std::unique_ptr<Transport> sequence_transport;
      if (options.migrate_sequences) {
        sequence_transport = sequence_fabric.Connect(r);
        options.sequence_transport = sequence_transport.get();
      }
      if (r == 0 && progress != nullptr) {
        options.on_step = [progress](const StepMeasurement& m) { progress->OnStep(m); };
      }
      results[r] = RunRank(options);
    });
  }
  for (std::thread& thread : threads) thread.join();
  for (int r = 0; r < ranks; ++r) {
    if (!results[r]->ok()) {
      return results[r]->status().WithContext("rank " + std::to_string(r));
    }
  }
  ModeRun run;
  run.result = std::move(*results[0]).value();
  return run;
}

// What every run of one demo shares. Filled in place (SetUpDemo): the sequence gate refers to
// the token gate.
struct DemoSetup {
  Communicator* communicator = nullptr;  // null: the ranks are threads of this process
  int ranks = 0;
  bool rank0 = true;
  DemoModelOptions model;
  std::optional<TokenGate> gate;
  KeelConfig config;
  std::unique_ptr<Metrics> metrics;       // the exporter, in the aggregating rank's process
  std::optional<SequenceGate> sequences;  // Luffy's runs
  bool mpi() const { return communicator != nullptr; }
};

// The model, the gate (synthetic or --trace), the config, the exporter and Luffy's sequences
// of a demo; prints what it will train.
Status SetUpDemo(const DemoFlags& flags, const FlagParser& parser, Communicator* communicator,
                 DemoSetup& setup) {
  setup.communicator = communicator;
  setup.ranks = setup.mpi() ? communicator->size() : flags.ranks;
  setup.rank0 = !setup.mpi() || communicator->rank() == 0;
  const int ranks = setup.ranks;
  if (setup.mpi() && parser.IsSet("ranks") && flags.ranks != ranks) {
    return InvalidArgument("--ranks " + std::to_string(flags.ranks) + " but mpirun started " +
                           std::to_string(ranks) + " processes");
  }
  DemoModelOptions& model = setup.model;
  model.layers = flags.layers;
  model.experts = flags.experts;
  model.top_k = flags.top_k;
  model.tokens = flags.tokens;
  model.ffn.hidden = flags.hidden;
  model.ffn.ffn = flags.ffn;
  model.steps = flags.steps;
  model.seed = flags.seed;
  model.adam.learning_rate = flags.learning_rate;

  if (flags.trace_path.empty()) {
    SyntheticTraceOptions synthetic;
    synthetic.seed = flags.seed;
    synthetic.num_steps = flags.steps;
    synthetic.num_layers = flags.layers;
    synthetic.num_experts = flags.experts;
    synthetic.num_sources = ranks;
    synthetic.tokens_per_source = flags.tokens;
    synthetic.top_k = flags.top_k;
    synthetic.zipf_exponent = flags.zipf;
    KEEL_ASSIGN_OR_RETURN(TokenGate made, TokenGate::Synthetic(synthetic));
    setup.gate.emplace(std::move(made));
  } else {
    Result<Trace> trace = ReadTrace(flags.trace_path);
    if (!trace.ok()) return trace.status().WithContext(flags.trace_path);
    // The model takes the trace's shape unless the flags name another one.
    for (auto [flag, value, traced] : {std::tuple{"layers", flags.layers, trace->num_layers},
                                       std::tuple{"experts", flags.experts, trace->num_experts}}) {
      if (parser.IsSet(flag) && value != traced) {
        return InvalidArgument("--" + std::string(flag) + " " + std::to_string(value) +
                               " differs from the trace's " + std::to_string(traced));
      }
    }
    model.layers = trace->num_layers;
    model.experts = trace->num_experts;
    if (model.top_k > model.experts) {
      return InvalidArgument("--top-k " + std::to_string(model.top_k) + " exceeds the trace's " +
                             std::to_string(model.experts) + " experts");
    }
    Result<TokenGate> made = TokenGate::FromTrace(std::move(*trace), model, ranks);
    if (!made.ok()) return made.status().WithContext(flags.trace_path);
    setup.gate.emplace(std::move(*made));
  }
  DemoFlags sized = flags;
  sized.layers = model.layers;
  sized.experts = model.experts;
  KEEL_ASSIGN_OR_RETURN(setup.config, MakeConfig(sized, parser, ranks));
  KeelConfig& config = setup.config;
  if (StrategyMode(flags) || flags.shard_hot > 0) {
    // Checked before the first run, which trains whole experts.
    const auto [name, shards] = ShardsOf(flags, config);
    if (flags.ffn % shards != 0) {
      return InvalidArgument(name + ": --ffn " + std::to_string(flags.ffn) +
                             " does not split into " + std::to_string(shards) + " shards");
    }
  }
  if (setup.mpi() && config.migration.transport == "local") {
    return InvalidArgument(
        "--comm mpi needs --transport ucx: the local transport joins threads of one process");
  }
  if (config.migration.transport == "ucx" && !kWithUcx) {
    return InvalidArgument("--transport ucx: this keel was built without UCX");
  }

  // The exporter lives in the process of the aggregating rank and outlives every run.
  const int aggregating = config.monitor.aggregating_rank;
  if (!setup.mpi() || communicator->rank() == aggregating) {
    KEEL_ASSIGN_OR_RETURN(setup.metrics, Metrics::Create(MetricsLayout::FromConfig(
                                             config, model.layers, model.experts, aggregating)));
    if (!config.monitor.metrics_address.empty()) {
      KEEL_RETURN_IF_ERROR(setup.metrics->Serve(config.monitor.metrics_address));
      if (!flags.quiet) {
        std::fprintf(stderr, "keel demo: metrics on http://%s/metrics\n",
                     setup.metrics->bound_address().c_str());
      }
    }
  }
  config.monitor.metrics_address.clear();  // served above, not again by an engine

  if (setup.rank0 && !flags.quiet) {
    std::fprintf(stderr,
                 "keel demo: %d ranks (%s, %s transport, %s memory), %d layers x %d experts "
                 "top-%d, %d tokens per rank, FFN %dx%d, %d steps; gate: %s\n",
                 ranks, setup.mpi() ? "mpi processes" : "threads",
                 config.migration.transport.c_str(), flags.memory.c_str(), model.layers,
                 model.experts, model.top_k, model.tokens, model.ffn.hidden, model.ffn.ffn,
                 model.steps, setup.gate->description().c_str());
  }

  if (SequenceMode(flags)) {
    SequenceWorkload workload;
    workload.tokens_per_sequence = flags.sequence_tokens;
    workload.affinity = flags.affinity;
    workload.repeat = flags.repeat;
    setup.sequences.emplace(workload, *setup.gate, model, ranks);
    if (setup.rank0 && !flags.quiet) {
      std::fprintf(
          stderr,
          "keel demo: %d sequences of %d tokens per rank, affinity %.2f, token repeats "
          "%.2f%s\n",
          setup.sequences->sequences_per_rank(), flags.sequence_tokens, workload.affinity,
          workload.repeat,
          flags.link_gb_per_s > 0
              ? (", links emulated at " + FormatFixed(flags.link_gb_per_s, 2) + " GB/s").c_str()
              : "");
    }
  }
  return Status::Ok();
}

// The keel policy shards or replicates per expert: by the flag, or by the config.
bool ShardExperts(const DemoFlags& flags, const KeelConfig& config) {
  return flags.shard_experts || config.policy.keel.shard_experts;
}

// What one of the demo's runs trains with.
RankRunOptions RunOptionsOf(const DemoFlags& flags, const DemoSetup& setup, const DemoRun& run) {
  RankRunOptions options;
  options.model = setup.model;
  options.config = setup.config;
  options.config.policy.name = run.policy;
  options.config.strategy.name = run.strategy;
  options.parm_dedup = run.parm_dedup;
  options.mp_group_size = run.mp_group_size;
  if (EngineShardMode(flags)) {
    // Whole experts against the engine's shards: only the second run shards.
    options.config.policy.keel.shard_experts =
        run.engine_shards && ShardExperts(flags, setup.config);
    if (run.engine_shards) {
      options.sharded_experts = HottestExperts(*setup.gate, flags.shard_hot,
                                               ShardsOf(flags, setup.config).second, setup.ranks);
    }
  }
  options.gate = &*setup.gate;
  options.metrics = setup.metrics.get();
  options.memory = flags.memory;
  options.barrier_before_timing = setup.mpi();
  options.sequences = setup.sequences ? &*setup.sequences : nullptr;
  options.migrate_sequences = run.migrate_sequences;
  options.condense_threshold = run.condense_threshold;
  options.link_gb_per_s = flags.link_gb_per_s;
  options.sequence_objective = flags.sequence_objective == "traffic"
                                   ? SequencePlanObjective::kTraffic
                                   : SequencePlanObjective::kStepTime;
  return options;
}

// Trains the demo's runs one after the other from the same seed, with live progress on rank 0.
Result<std::vector<ModeRun>> RunModes(const DemoFlags& flags, const DemoSetup& setup,
                                      const std::vector<DemoRun>& demo_runs) {
  std::vector<ModeRun> runs;
  for (const DemoRun& demo_run : demo_runs) {
    RankRunOptions options = RunOptionsOf(flags, setup, demo_run);
    std::optional<DemoProgress> progress;
    if (setup.rank0 && !flags.quiet) progress.emplace(demo_run.name, setup.model.steps);
    const auto start = std::chrono::steady_clock::now();
    Result<ModeRun> run = [&]() -> Result<ModeRun> {
      if (!setup.mpi()) {
        return RunThreads(options, setup.ranks, progress ? &*progress : nullptr);
      }
      options.communicator = setup.communicator;
      if (progress) {
        options.on_step = [&progress](const StepMeasurement& m) { progress->OnStep(m); };
      }
      // Sequences move over a transport of their own, apart from the engine's migrations.
      std::unique_ptr<Transport> sequence_transport;
      if (options.migrate_sequences) {
        KEEL_ASSIGN_OR_RETURN(sequence_transport,
                              CreateTransport(options.config.migration, *setup.communicator));
        options.sequence_transport = sequence_transport.get();
      }
      KEEL_ASSIGN_OR_RETURN(RankRunResult result, RunRank(options));
      return ModeRun{demo_run.name, std::move(result), 0.0};
    }();
    if (progress) progress->Finish();
    if (!run.ok()) return run.status().WithContext("run " + demo_run.name);
    run->policy = demo_run.name;
    run->wall_seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    runs.push_back(std::move(*run));
  }
  return runs;
}

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

// The default demo: static against keel, and the issue's targets for keel.
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

// Runs the demo's modes on this process's ranks; `communicator` is null for threads. Returns
// the exit code.
int RunAllModes(const DemoFlags& flags, const FlagParser& parser, Communicator* communicator) {
  DemoSetup setup;
  Status set_up = SetUpDemo(flags, parser, communicator, setup);
  if (!set_up.ok()) return Fail(set_up);
  Result<std::vector<ModeRun>> runs = RunModes(flags, setup, DemoRuns(flags));
  if (!runs.ok()) return Fail(runs.status());

  DemoOutcome o{flags, setup, *runs, {}, 0.0, CheckWeights(flags, setup.config, *runs)};
  if (!setup.rank0) return o.weights.ok() ? 0 : 1;
  for (const ModeRun& run : *runs) o.modes.push_back(ModeJson(run));
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
    Status written = WriteFileAtomically(flags.report_path, report.dump(2) + "\n");
    if (!written.ok()) return Fail(written);
    std::printf("report: %s\n", flags.report_path.c_str());
  }
  std::fflush(stdout);
  if (!weights.ok()) {
    std::fprintf(stderr, "keel demo: the final expert weights differ between %s and %s%s\n",
                 (*runs)[0].policy.c_str(), (*runs)[1].policy.c_str(),
                 weights.sharded_vs_whole ? " by more than the rounding tolerance" : "");
  }
  return weights.ok() && checks_passed ? 0 : 1;
}

int RunDemoOverMpi(int argc, char** argv, const DemoFlags& flags, const FlagParser& parser) {
#if KEEL_TOOLS_WITH_MPI
  MPI_Init(&argc, &argv);
  int code = 0;
  {
    Result<std::unique_ptr<Communicator>> communicator = CreateMpiCommunicator();
    code = communicator.ok() ? RunAllModes(flags, parser, communicator->get())
                             : Fail(communicator.status());
  }
  MPI_Finalize();
  return code;
#else
  (void)argc;
  (void)argv;
  (void)flags;
  (void)parser;
  return Fail(InvalidArgument("--comm mpi: this keel was built without MPI (KEEL_WITH_MPI off)"));
#endif
}

}  // namespace

int RunDemo(int argc, char** argv) {
  DemoFlags flags;
  FlagParser parser(
      "keel demo",
      "Trains a small Mixture-of-Experts model on the CPU, every rank through the Keel engine:\n"
      "FFN experts with forward, backward and Adam, tokens routed by a gate whose skew drifts\n"
      "and bursts (or by a recorded trace). Runs the same seed twice, with the static placement\n"
      "and with the keel policy, shows live progress, and compares parallel step time (the step\n"
      "the ranks would take on separate GPUs: per layer the slowest rank's expert CPU time plus\n"
      "communication, summed), imbalance, epochs, moved bytes and loss. Gradients are summed as\n"
      "int64 fixed point, so the final expert weights of both runs must be bitwise identical;\n"
      "the command fails when they are not.");
  parser.Add("ranks", "N", &flags.ranks,
             "ranks as threads of this process, at most 1024 (with --comm mpi: must equal the "
             "mpirun process count, or be left out)");
  parser.Add("comm", "NAME", &flags.comm,
             "communicator: local (ranks are threads) or mpi (ranks are the mpirun processes; "
             "needs --transport ucx)");
  parser.Add("transport", "NAME", &flags.transport,
             "migration transport: local (threads only) or ucx; overrides migration.transport "
             "of --config when given");
  parser.Add("memory", "KIND", &flags.memory,
             "where the expert slot buffers live: host, device (CUDA memory; needs a GPU) or "
             "guarded-host (host memory that faults on any direct CPU access: the device path "
             "without a GPU)");
  parser.Add("layers", "N", &flags.layers, "MoE layers, at most 1024 (with --trace: the trace's)");
  parser.Add("experts", "N", &flags.experts,
             "experts per layer, at most 65536 (with --trace: the trace's)");
  parser.Add("top-k", "K", &flags.top_k, "experts each token is routed to, at most 64");
  parser.Add("tokens", "N", &flags.tokens, "tokens per rank per step, at most 2^20");
  parser.Add("hidden", "N", &flags.hidden,
             "hidden size (expert input and output width), at most 65536");
  parser.Add("ffn", "N", &flags.ffn,
             "expert FFN size, at most 65536; all sizes together are refused when the model "
             "and activations of all ranks would take more than about 16 GiB");
  parser.Add("steps", "N", &flags.steps, "training steps per run, at most 10^6");
  parser.Add("seed", "N", &flags.seed,
             "seed of the gate, inputs, teacher and initial weights (both runs use it)");
  parser.Add("zipf", "S", &flags.zipf,
             "Zipf exponent of the synthetic gate's expert popularity (higher = more skewed)");
  parser.Add("learning-rate", "LR", &flags.learning_rate,
             "Adam learning rate (betas 0.9, 0.999, epsilon 1e-8)");
  parser.Add("config", "FILE", &flags.config_path,
             "Keel config (YAML); its topology must have as many ranks as the demo. Default: 1 "
             "node x N GPUs, ceil(experts/N)+1 persistent and 1 transient slot per rank, cost "
             "model sized to the demo's experts; policy.name is set by each run");
  parser.Add("metrics", "ADDR", &flags.metrics_address,
             "serve Prometheus metrics on host:port (a bare port listens on 127.0.0.1; 0 picks "
             "a free one) while both runs train");
  parser.Add("report", "FILE", &flags.report_path,
             "write the JSON report: per mode parallel step seconds, imbalance, epochs, bytes "
             "moved, exposed migration, loss curve, engine overhead; final_weights_identical, "
             "final_weights_checksum and "
             "the targets");
  parser.Add("trace", "FILE", &flags.trace_path,
             "draw each rank's expert ids from a routing trace's per-step, per-layer counts "
             "(any format keel trace reads) instead of the synthetic gate");
  parser.AddBool("quiet", &flags.quiet, "no progress on stderr");
  parser.AddBool("sequence-migration", &flags.sequence_migration,
                 "Luffy's sequence migration (docs/luffy.md): compare the keel policy without "
                 "and with it. Each rank's tokens come in sequences with a topic; every step "
                 "Engine::PlanSequences plans where each runs and the sequences move there");
  parser.Add("condense", "THRESHOLD", &flags.condense,
             "Luffy's token condensation: compare exact training with training whose rows of "
             "one expert with cosine >= THRESHOLD (in (0, 1]) are sent and computed once. 1.0 "
             "condenses only identical tokens and must train bit for bit as exact; lower "
             "thresholds change the math");
  parser.Add("sequence-tokens", "N", &flags.sequence_tokens,
             "with --sequence-migration or --condense: tokens per sequence (--tokens must be a "
             "multiple; default 256)");
  parser.Add("sequence-affinity", "A", &flags.affinity,
             "share of a sequence's expert choices drawn from its topic's block of experts, in "
             "[0, 1] (default 0.7)");
  parser.Add("token-repeat", "P", &flags.repeat,
             "share of a sequence's tokens that repeat an earlier token (half exactly, half "
             "nearly), in [0, 1]; with --condense 0.25 unless given");
  parser.Add("sequence-objective", "NAME", &flags.sequence_objective,
             "with --sequence-migration: what the sequence planner minimises, step (the cost "
             "model's step) or traffic (summed link time)");
  parser.Add("strategy", "NAME", &flags.strategy,
             "parallel strategy to compare with whole experts under the keel policy "
             "(docs/strategies.md): esp (experts sharded over --shard-degree ranks), parm "
             "(sharded over MP groups of strategy.mp_degree ranks, de-duplicated dispatch) or "
             "ppmoe (every expert sliced over a node's ranks); ep (default) runs static vs keel");
  parser.Add("shard-degree", "S", &flags.shard_degree,
             "with --strategy esp or --shard-hot: ranks each expert is sharded over (divides "
             "the ranks of a node; default 0 = all of them)");
  parser.Add("mp", "M", &flags.mp,
             "Parm: pairs (M = 2) or groups of M ranks hold the same tokens; compare their "
             "dispatch without de-duplication (every member sends all the group's rows) and "
             "with it (each sends its share, then the group all-gathers), experts sharded over "
             "the group; then whole experts under the keel policy without and with the "
             "engine's MP groups (EngineOptions::mp_group_size). Each pair: bitwise the same "
             "weights");
  parser.Add("shard-hot", "N", &flags.shard_hot,
             "the engine shards each layer's N hottest experts (by the first step's rows) over "
             "--shard-degree ranks of their node from the start, and the keel policy places "
             "their shards; compares the keel policy with whole experts (ep) against it");
  parser.AddBool("shard-experts", &flags.shard_experts,
                 "the keel policy chooses at every replan, per expert, between replicating and "
                 "sharding it (policy.keel.shard_experts); compares the keel policy without and "
                 "with it");
  parser.Add("link-gb-per-s", "X", &flags.link_gb_per_s,
             "emulate links of X GB/s between ranks: the bytes a rank exchanges with other "
             "ranks add bytes / X to its communication time (default 0: measured CPU time only)");
  parser.SetEpilogue(
      "Threads:  keel demo --report demo.json\n"
      "MPI:      mpirun -np 8 keel demo --comm mpi --transport ucx\n"
      "Small:    keel demo --ranks 4 --layers 2 --experts 8 --tokens 512 --steps 12\n"
      "Luffy:    keel demo --sequence-migration --link-gb-per-s 1\n"
      "Sharded:  keel demo --strategy esp --zipf 1.5 --config configs/demo-no-spares.yaml\n"
      "          keel demo --mp 2\n"
      "          keel demo --shard-hot 1 --zipf 1.5   (the engine's sharded experts)\n"
      "          keel demo --condense 0.99\n"
      "Times are thread CPU seconds, so ranks sharing cores measure what separate GPUs would.\n"
      "Config keys: keel config --markdown");
  Status parsed = parser.Parse(argc, argv);
  if (!parsed.ok()) {
    std::fprintf(stderr, "keel demo: %s\n\n%s", parsed.message().c_str(),
                 parser.HelpText().c_str());
    return 2;
  }
  if (parser.help_requested()) {
    std::fputs(parser.HelpText().c_str(), stdout);
    return 0;
  }
  // Condensation needs repeated tokens to find; a quarter unless --token-repeat says otherwise.
  if (flags.condense > 0 && !parser.IsSet("token-repeat")) flags.repeat = 0.25;
  Status checked = CheckFlags(flags);
  if (!checked.ok()) return Fail(checked);
  if (flags.comm == "mpi") return RunDemoOverMpi(argc, argv, flags, parser);
  return RunAllModes(flags, parser, nullptr);
}

}  // namespace keel::tools
