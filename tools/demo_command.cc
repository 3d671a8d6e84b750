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

// The two runs a demo compares: static against keel by default; with --sequence-migration the
// keel policy without and with it; with --condense exact against condensed training; with
// --strategy whole experts under the keel policy against the strategy's sharded ones; with --mp
// Parm's dispatch without and with its de-duplication; with --shard-hot or --shard-experts the
// keel policy without and with the engine's sharded experts.
struct DemoRun {
  std::string name;
  std::string policy;
  bool migrate_sequences = false;
  float condense_threshold = 0;
  std::string strategy = "ep";
  bool parm_dedup = true;
  bool engine_shards = false;  // --shard-hot's experts, or policy.keel.shard_experts
};

bool EngineShardMode(const DemoFlags& f) { return f.shard_hot > 0 || f.shard_experts; }

std::vector<DemoRun> DemoRuns(const DemoFlags& f) {
  if (f.sequence_migration) return {{"keel", "keel"}, {"keel+seq", "keel", true}};
  if (f.condense > 0) {
    return {{"exact", "keel"}, {"condensed", "keel", false, static_cast<float>(f.condense)}};
  }
  if (f.mp > 0) {
    return {{"parm-all", "keel", false, 0, "parm", false}, {"parm", "keel", false, 0, "parm"}};
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

// Runs both modes on this process's ranks; `communicator` is null for threads. Returns the
// exit code.
int RunBothModes(const DemoFlags& flags, const FlagParser& parser, Communicator* communicator) {
  const bool mpi = communicator != nullptr;
  const int ranks = mpi ? communicator->size() : flags.ranks;
  const bool rank0 = !mpi || communicator->rank() == 0;
  if (mpi && parser.IsSet("ranks") && flags.ranks != ranks) {
    return Fail(InvalidArgument("--ranks " + std::to_string(flags.ranks) + " but mpirun started " +
                                std::to_string(ranks) + " processes"));
  }
  DemoModelOptions model;
  model.layers = flags.layers;
  model.experts = flags.experts;
  model.top_k = flags.top_k;
  model.tokens = flags.tokens;
  model.ffn.hidden = flags.hidden;
  model.ffn.ffn = flags.ffn;
  model.steps = flags.steps;
  model.seed = flags.seed;
  model.adam.learning_rate = flags.learning_rate;

  std::optional<TokenGate> gate;
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
    Result<TokenGate> made = TokenGate::Synthetic(synthetic);
    if (!made.ok()) return Fail(made.status());
    gate.emplace(std::move(*made));
  } else {
    Result<Trace> trace = ReadTrace(flags.trace_path);
    if (!trace.ok()) return Fail(trace.status().WithContext(flags.trace_path));
    // The model takes the trace's shape unless the flags name another one.
    for (auto [flag, value, traced] : {std::tuple{"layers", flags.layers, trace->num_layers},
                                       std::tuple{"experts", flags.experts, trace->num_experts}}) {
      if (parser.IsSet(flag) && value != traced) {
        return Fail(InvalidArgument("--" + std::string(flag) + " " + std::to_string(value) +
                                    " differs from the trace's " + std::to_string(traced)));
      }
    }
    model.layers = trace->num_layers;
    model.experts = trace->num_experts;
    if (model.top_k > model.experts) {
      return Fail(InvalidArgument("--top-k " + std::to_string(model.top_k) +
                                  " exceeds the trace's " + std::to_string(model.experts) +
                                  " experts"));
    }
    Result<TokenGate> made = TokenGate::FromTrace(std::move(*trace), model, ranks);
    if (!made.ok()) return Fail(made.status().WithContext(flags.trace_path));
    gate.emplace(std::move(*made));
  }
  DemoFlags sized = flags;
  sized.layers = model.layers;
  sized.experts = model.experts;
  Result<KeelConfig> config = MakeConfig(sized, parser, ranks);
  if (!config.ok()) return Fail(config.status());
  if (StrategyMode(flags) || flags.shard_hot > 0) {
    // Checked before the first run, which trains whole experts.
    const auto [name, shards] = ShardsOf(flags, *config);
    if (flags.ffn % shards != 0) {
      return Fail(InvalidArgument(name + ": --ffn " + std::to_string(flags.ffn) +
                                  " does not split into " + std::to_string(shards) + " shards"));
    }
  }
  if (mpi && config->migration.transport == "local") {
    return Fail(InvalidArgument(
        "--comm mpi needs --transport ucx: the local transport joins threads of one process"));
  }
  if (config->migration.transport == "ucx" && !kWithUcx) {
    return Fail(InvalidArgument("--transport ucx: this keel was built without UCX"));
  }

  // The exporter lives in the process of the aggregating rank and outlives both runs.
  std::unique_ptr<Metrics> metrics;
  const int aggregating = config->monitor.aggregating_rank;
  if (!mpi || communicator->rank() == aggregating) {
    Result<std::unique_ptr<Metrics>> made = Metrics::Create(
        MetricsLayout::FromConfig(*config, model.layers, model.experts, aggregating));
    if (!made.ok()) return Fail(made.status());
    metrics = std::move(*made);
    if (!config->monitor.metrics_address.empty()) {
      Status served = metrics->Serve(config->monitor.metrics_address);
      if (!served.ok()) return Fail(served);
      if (!flags.quiet) {
        std::fprintf(stderr, "keel demo: metrics on http://%s/metrics\n",
                     metrics->bound_address().c_str());
      }
    }
  }
  config->monitor.metrics_address.clear();  // served above, not again by an engine

  if (rank0 && !flags.quiet) {
    std::fprintf(stderr,
                 "keel demo: %d ranks (%s, %s transport, %s memory), %d layers x %d experts "
                 "top-%d, %d tokens per rank, FFN %dx%d, %d steps; gate: %s\n",
                 ranks, mpi ? "mpi processes" : "threads", config->migration.transport.c_str(),
                 flags.memory.c_str(), model.layers, model.experts, model.top_k, model.tokens,
                 model.ffn.hidden, model.ffn.ffn, model.steps, gate->description().c_str());
  }

  std::optional<SequenceGate> sequences;
  if (SequenceMode(flags)) {
    SequenceWorkload workload;
    workload.tokens_per_sequence = flags.sequence_tokens;
    workload.affinity = flags.affinity;
    workload.repeat = flags.repeat;
    sequences.emplace(workload, *gate, model, ranks);
    if (rank0 && !flags.quiet) {
      std::fprintf(
          stderr,
          "keel demo: %d sequences of %d tokens per rank, affinity %.2f, token repeats "
          "%.2f%s\n",
          sequences->sequences_per_rank(), flags.sequence_tokens, workload.affinity,
          workload.repeat,
          flags.link_gb_per_s > 0
              ? (", links emulated at " + FormatFixed(flags.link_gb_per_s, 2) + " GB/s").c_str()
              : "");
    }
  }

  const std::vector<DemoRun> demo_runs = DemoRuns(flags);
  // The keel policy shards or replicates per expert: by the flag, or by the config.
  const bool shard_experts = flags.shard_experts || config->policy.keel.shard_experts;
  std::vector<ModeRun> runs;
  for (const DemoRun& demo_run : demo_runs) {
    RankRunOptions options;
    options.model = model;
    options.config = *config;
    options.config.policy.name = demo_run.policy;
    options.config.strategy.name = demo_run.strategy;
    options.parm_dedup = demo_run.parm_dedup;
    if (EngineShardMode(flags)) {
      // Whole experts against the engine's shards: only the second run shards.
      options.config.policy.keel.shard_experts = demo_run.engine_shards && shard_experts;
      if (demo_run.engine_shards) {
        options.sharded_experts =
            HottestExperts(*gate, flags.shard_hot, ShardsOf(flags, *config).second, ranks);
      }
    }
    options.gate = &*gate;
    options.metrics = metrics.get();
    options.memory = flags.memory;
    options.barrier_before_timing = mpi;
    options.sequences = sequences ? &*sequences : nullptr;
    options.migrate_sequences = demo_run.migrate_sequences;
    options.condense_threshold = demo_run.condense_threshold;
    options.link_gb_per_s = flags.link_gb_per_s;
    options.sequence_objective = flags.sequence_objective == "traffic"
                                     ? SequencePlanObjective::kTraffic
                                     : SequencePlanObjective::kStepTime;
    std::optional<DemoProgress> progress;
    if (rank0 && !flags.quiet) {
      progress.emplace(demo_run.name, model.steps);
    }
    const auto start = std::chrono::steady_clock::now();
    Result<ModeRun> run = [&]() -> Result<ModeRun> {
      if (!mpi) return RunThreads(options, ranks, progress ? &*progress : nullptr);
      options.communicator = communicator;
      if (progress) {
        options.on_step = [&progress](const StepMeasurement& m) { progress->OnStep(m); };
      }
      // Sequences move over a transport of their own, apart from the engine's migrations.
      std::unique_ptr<Transport> sequence_transport;
      if (options.migrate_sequences) {
        KEEL_ASSIGN_OR_RETURN(sequence_transport,
                              CreateTransport(options.config.migration, *communicator));
        options.sequence_transport = sequence_transport.get();
      }
      KEEL_ASSIGN_OR_RETURN(RankRunResult result, RunRank(options));
      return ModeRun{demo_run.name, std::move(result), 0.0};
    }();
    if (progress) progress->Finish();
    if (!run.ok()) return Fail(run.status().WithContext("run " + demo_run.name));
    run->policy = demo_run.name;
    run->wall_seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    runs.push_back(std::move(*run));
  }

  const bool identical = runs[0].result.final_weights == runs[1].result.final_weights;
  // Condensation below 1.0 changes the math, and sharded experts its rounding; nothing else may.
  const bool sharded_vs_whole = (flags.strategy != "ep" && flags.mp == 0) ||
                                EngineShardMode(flags) || config->policy.keel.shard_experts;
  const bool must_be_identical = !(flags.condense > 0 && flags.condense < 1.0) && !sharded_vs_whole;
  const double weight_difference =
      RelativeDifference(runs[0].result.final_weights, runs[1].result.final_weights);
  const bool within_tolerance = !sharded_vs_whole || weight_difference <= kShardedWeightTolerance;
  const int exit_code = (identical || !must_be_identical) && within_tolerance ? 0 : 1;
  if (!rank0) return exit_code;

  std::vector<nlohmann::json> modes;
  for (const ModeRun& run : runs) modes.push_back(ModeJson(run));
  const double first_step = modes[0]["parallel_step_seconds"]["mean"].get<double>();
  const double second_step = modes[1]["parallel_step_seconds"]["mean"].get<double>();
  const double ratio = first_step > 0 ? second_step / first_step : 0.0;
  const std::string first = demo_runs[0].name;
  const std::string second = demo_runs[1].name;
  nlohmann::json report = {
      {"ranks", ranks},
      {"comm", mpi ? "mpi" : "local"},
      {"transport", config->migration.transport},
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
        {"gate", gate->description()}}},
      {"config",
       {{"num_ranks", config->num_ranks()},
        {"persistent_per_rank", config->slots.persistent_per_rank},
        {"transient_per_rank", config->slots.transient_per_rank},
        {"yaml", ConfigToYaml(*config)}}},
      {"mode_order", {first, second}},
      {"modes", {{first, modes[0]}, {second, modes[1]}}},
      {"final_weights_identical", identical},
      {"final_weights_checksum", FinalWeightsChecksum(runs[1].result.final_weights)},
  };
  if (sequences) {
    report["sequences"] = {{"tokens_per_sequence", flags.sequence_tokens},
                           {"affinity", flags.affinity},
                           {"token_repeat", flags.repeat},
                           {"link_gb_per_s", flags.link_gb_per_s},
                           {"objective", flags.sequence_objective}};
  }

  std::printf("\n");
  PrintModeTable(modes);
  std::printf("\n");
  if (flags.sequence_migration) {
    report["targets"] = {{"sequence_migration_step_ratio", Target(ratio, kTargetSequenceRatio)}};
    for (const nlohmann::json& m : modes) {
      std::printf("%-9s rows to other ranks %.1f%%, sequences moved per step %.1f (%.2f MB)\n",
                  m["policy"].get<std::string>().c_str(),
                  100 * m["remote_row_fraction"].get<double>(),
                  m["sequences_moved_per_step"].get<double>(),
                  m["sequence_bytes_per_step"].get<double>() / 1e6);
    }
    std::printf("keel+seq / keel parallel step: %.3f (target <= %.2f: %s)\n", ratio,
                kTargetSequenceRatio, ratio <= kTargetSequenceRatio ? "met" : "missed");
  } else if (StrategyMode(flags)) {
    const double bytes_ratio = modes[0]["all_to_all_bytes_per_step"].get<double>() > 0
                                   ? modes[1]["all_to_all_bytes_per_step"].get<double>() /
                                         modes[0]["all_to_all_bytes_per_step"].get<double>()
                                   : 0.0;
    for (const nlohmann::json& m : modes) {
      std::printf("%-9s all-to-all %.2f MB per step, in-group collectives %.2f MB\n",
                  m["policy"].get<std::string>().c_str(),
                  m["all_to_all_bytes_per_step"].get<double>() / 1e6,
                  m["group_bytes_per_step"].get<double>() / 1e6);
    }
    report["strategy"] = {
        {"name", flags.mp > 0 ? "parm" : flags.strategy},
        {"shard_degree", ShardDegree(config->strategy, config->topology.gpus_per_node)},
        {"mp_degree", MpDegree(config->strategy, config->topology.gpus_per_node)},
        {"final_weights_relative_difference", weight_difference}};
    if (flags.mp > 0) {
      report["targets"] = {{"parm_all_to_all_bytes_ratio", Target(bytes_ratio, kTargetParmBytes)}};
      std::printf("parm / parm-all all-to-all bytes: %.3f (target <= %.2f: %s)\n", bytes_ratio,
                  kTargetParmBytes, bytes_ratio <= kTargetParmBytes ? "met" : "missed");
      std::printf("parm / parm-all parallel step:    %.3f\n", ratio);
    } else {
      report["targets"] = {{"sharded_parallel_step_ratio", Target(ratio, kTargetShardedRatio)}};
      std::printf(
          "%s / ep parallel step: %.3f (target <= %.2f with one expert at >= 40%% of the "
          "tokens: %s)\n",
          second.c_str(), ratio, kTargetShardedRatio,
          ratio <= kTargetShardedRatio ? "met" : "missed");
      std::printf(
          "final weights vs ep:       %.2e of the largest weight apart (tolerance %.0e: "
          "%s)\n",
          weight_difference, kShardedWeightTolerance, within_tolerance ? "within" : "OUTSIDE");
    }
  } else if (EngineShardMode(flags)) {
    const EngineStats& stats = runs[1].result.stats;
    report["engine_shards"] = {
        {"shard_hot", flags.shard_hot},
        {"shards", flags.shard_hot > 0 ? ShardsOf(flags, *config).second : 0},
        {"shard_experts", shard_experts},
        {"reshards", stats.reshards},
        {"final_weights_relative_difference", weight_difference}};
    report["targets"] = {{"sharded_parallel_step_ratio", Target(ratio, kTargetShardedRatio)}};
    const std::string at_start =
        flags.shard_hot > 0 ? std::to_string(flags.shard_hot) + " hottest experts per layer cut " +
                                  std::to_string(ShardsOf(flags, *config).second) + " ways"
                            : "none at the start";
    std::printf("shards: %s%s, %lld layer reshards by the keel policy\n", at_start.c_str(),
                shard_experts ? ", policy.keel.shard_experts on" : "",
                static_cast<long long>(stats.reshards));
    std::printf(
        "shards / ep parallel step: %.3f (target <= %.2f with one expert at >= 40%% of the "
        "tokens: %s)\n",
        ratio, kTargetShardedRatio, ratio <= kTargetShardedRatio ? "met" : "missed");
    std::printf(
        "final weights vs ep:       %.2e of the largest weight apart (tolerance %.0e: %s)\n",
        weight_difference, kShardedWeightTolerance, within_tolerance ? "within" : "OUTSIDE");
  } else if (flags.condense > 0) {
    const auto& exact_loss = modes[0]["loss"];
    const auto& condensed_loss = modes[1]["loss"];
    double mean_difference = 0;
    for (size_t i = 0; i < exact_loss.size(); ++i) {
      mean_difference += condensed_loss[i].get<double>() - exact_loss[i].get<double>();
    }
    mean_difference /= static_cast<double>(std::max<size_t>(1, exact_loss.size()));
    const double kept = modes[1]["kept_row_fraction"].get<double>();
    report["condensation"] = {{"threshold", flags.condense},
                              {"rows_saved_fraction", 1.0 - kept},
                              {"loss_last_exact", exact_loss.back()},
                              {"loss_last_condensed", condensed_loss.back()},
                              {"mean_loss_difference", mean_difference}};
    std::printf("rows saved by condensation: %.1f%% of the forward dispatch (threshold %.4g)\n",
                100 * (1.0 - kept), flags.condense);
    std::printf("loss, condensed - exact:    last %+.3e, mean over steps %+.3e\n",
                condensed_loss.back().get<double>() - exact_loss.back().get<double>(),
                mean_difference);
    std::printf("condensed / exact parallel step: %.3f\n", ratio);
  } else {
    report["targets"] = {
        {"keel_parallel_step_ratio", Target(ratio, kTargetStepRatio)},
        {"keel_mean_imbalance", Target(modes[1]["mean_imbalance"].get<double>(), kTargetImbalance)},
        {"keel_engine_overhead_fraction",
         Target(modes[1]["engine_overhead_fraction"].get<double>(), kTargetOverhead)}};
    std::printf("keel / static parallel step: %.3f (target <= %.2f: %s)\n", ratio, kTargetStepRatio,
                ratio <= kTargetStepRatio ? "met" : "missed");
    const double keel_imbalance = modes[1]["mean_imbalance"].get<double>();
    std::printf("keel mean imbalance:         %.3f (target <= %.2f: %s)\n", keel_imbalance,
                kTargetImbalance, keel_imbalance <= kTargetImbalance ? "met" : "missed");
    const double overhead = modes[1]["engine_overhead_fraction"].get<double>();
    std::printf("keel engine overhead:        %.2f%% (target <= %.0f%%: %s)\n", overhead * 100,
                kTargetOverhead * 100, overhead <= kTargetOverhead ? "met" : "missed");
  }
  std::printf("final weights identical:     %s%s\n", identical ? "yes (bitwise)" : "NO",
              must_be_identical || identical ? ""
              : sharded_vs_whole ? " (not expected: shards sum their outputs in another order)"
                                 : " (not expected: condensation below 1.0 changes the math)");
  if (!flags.report_path.empty()) {
    Status written = WriteFileAtomically(flags.report_path, report.dump(2) + "\n");
    if (!written.ok()) return Fail(written);
    std::printf("report: %s\n", flags.report_path.c_str());
  }
  std::fflush(stdout);
  if (exit_code != 0) {
    std::fprintf(stderr, "keel demo: the final expert weights differ between %s and %s%s\n",
                 first.c_str(), second.c_str(),
                 sharded_vs_whole ? " by more than the rounding tolerance" : "");
  }
  return exit_code;
}

int RunDemoOverMpi(int argc, char** argv, const DemoFlags& flags, const FlagParser& parser) {
#if KEEL_TOOLS_WITH_MPI
  MPI_Init(&argc, &argv);
  int code = 0;
  {
    Result<std::unique_ptr<Communicator>> communicator = CreateMpiCommunicator();
    code = communicator.ok() ? RunBothModes(flags, parser, communicator->get())
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
             "with it (each sends its share, then the group all-gathers); bitwise the same "
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
  return RunBothModes(flags, parser, nullptr);
}

}  // namespace keel::tools
