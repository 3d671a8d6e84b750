// `keel demo`: every rank really trains a small MoE model on the CPU through the Keel engine, once
// with the static placement and once with the `keel` policy from the same seed, then compares
// them: parallel step time, imbalance, epochs, moved bytes, loss, and whether the final expert
// weights are bitwise identical (placement must never change the math). Luffy's runs compare the
// keel policy without and with sequence migration (--sequence-migration), or exact training with
// token condensation (--condense); the other modes are in tools/demo_options.h. Ranks are
// threads (default) or MPI processes (`mpirun -np N keel demo --comm mpi --transport ucx`). This
// file sets up the model, gate and config (SetUpDemo), trains the runs (RunModes) and defines the
// flags; tools/demo_summary.h compares and reports.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <numeric>
#include <optional>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "comm/communicator.h"
#include "common/config.h"
#include "keel/local_group.hpp"
#include "keel/version.hpp"
#include "migration/transport_factory.h"
#include "monitor/metrics.h"
#include "monitor/trace.h"
#include "tools/commands.h"
#include "tools/demo_options.h"
#include "tools/demo_report.h"
#include "tools/demo_sequences.h"
#include "tools/demo_summary.h"
#include "tools/demo_trainer.h"
#include "tools/flags.h"
#include "tools/progress.h"

#if KEEL_TOOLS_WITH_MPI
#include <mpi.h>
#endif

namespace keel::tools {
namespace {

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

// Runs the demo's modes on this process's ranks; `communicator` is null for threads. Returns
// the exit code.
int RunAllModes(const DemoFlags& flags, const FlagParser& parser, Communicator* communicator) {
  DemoSetup setup;
  Status set_up = SetUpDemo(flags, parser, communicator, setup);
  if (!set_up.ok()) return Fail(set_up);
  Result<std::vector<ModeRun>> runs = RunModes(flags, setup, DemoRuns(flags));
  if (!runs.ok()) return Fail(runs.status());
  Result<int> code = ReportDemo(flags, setup, *runs);
  return code.ok() ? *code : Fail(code.status());
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
  parser.Add("steps", "N", &flags.steps,
             "training steps per run, at most 10^6; the rows a run routes in all, --steps x "
             "--ranks x --tokens x --top-k x --layers, at most 2^28");
  parser.Add("seed", "N", &flags.seed,
             "seed of the gate, inputs, teacher and initial weights (both runs use it)");
  parser.Add("zipf", "S", &flags.zipf,
             "Zipf exponent of the synthetic gate's expert popularity (higher = more skewed)");
  parser.Add("learning-rate", "LR", &flags.learning_rate,
             "Adam learning rate (betas 0.9, 0.999, epsilon 1e-8)");
  parser.Add("config", "FILE", &flags.config_path,
             "Keel config (YAML); its topology must have as many ranks as the demo. Default: 1 "
             "node x N GPUs, ceil(experts/N)+1 persistent and 1 transient slot per rank, cost "
             "model sized to the demo's experts, replans adopted at the next step "
             "(policy.plan_adoption: next_step, so epochs fall at the same steps in every run); "
             "policy.name is set by each run");
  parser.Add("metrics", "ADDR", &flags.metrics_address,
             "serve Prometheus metrics on host:port or [v6addr]:port (a bare port listens on "
             "127.0.0.1; 0 picks a free one) while both runs train");
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
  Status checked = CheckFlags(flags, parser);
  if (checked.ok()) checked = CheckDemoPaths(flags);
  if (!checked.ok()) return Fail(checked);
  if (flags.comm == "mpi") return RunDemoOverMpi(argc, argv, flags, parser);
  return RunAllModes(flags, parser, nullptr);
}

}  // namespace keel::tools
