// `keel replay`: replays a routing trace (a recorded one, or a synthetic one made on the spot)
// under several placement policies and reports balance, moved state, simulated step time and
// planner time per policy, as a table, a JSON report and an SVG plot.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <iterator>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "common/config.h"
#include "common/file.h"
#include "common/listen_address.h"
#include "common/number_text.h"
#include "keel/limits.hpp"
#include "monitor/metrics.h"
#include "monitor/trace.h"
#include "placement/policy.h"
#include "tools/commands.h"
#include "tools/flags.h"
#include "tools/progress.h"
#include "tools/replay.h"
#include "tools/sequence_replay.h"
#include "tools/strategy_replay.h"
#include "tools/svg_plot.h"

namespace keel::tools {
namespace {

int ExitCodeFor(const Status& status) {
  return status.code() == StatusCode::kInvalidArgument || status.code() == StatusCode::kNotFound
             ? 2
             : 1;
}

int Fail(const Status& status) {
  std::fprintf(stderr, "keel replay: %s\n", status.message().c_str());
  return ExitCodeFor(status);
}

void PrintSummary(const ReplayReport& report) {
  std::printf("\n%s: %d steps x %d layers x %d experts on %d x %d GPUs (%d slots each), %s\n\n",
              report.trace_description.empty() ? "trace" : report.trace_description.c_str(),
              report.num_steps, report.num_layers, report.num_experts,
              report.config.topology.num_nodes, report.config.topology.gpus_per_node,
              report.config.slots.persistent_per_rank, report.oracle ? "oracle" : "causal");
  const char* kHeader[] = {"policy",      "imbalance mean",     "p99",
                           "lb_gap",      "moved slots/replan", "moved GB",
                           "sim step ms", "planner us/layer"};
  std::vector<std::vector<std::string>> rows;
  for (const PolicyReplay& p : report.policies) {
    rows.push_back({p.name, FormatFixed(p.imbalance.mean, 3), FormatFixed(p.imbalance.p99, 3),
                    FormatFixed(p.lb_gap, 3), FormatFixed(p.moved_slots_per_replan, 2),
                    FormatFixed(p.moved_bytes_total / 1e9, 2),
                    FormatFixed(p.sim_step_seconds.mean * 1e3, 3),
                    FormatFixed(p.planner_seconds_per_layer.p50 * 1e6, 1)});
  }
  PrintTable(std::vector<std::string>(std::begin(kHeader), std::end(kHeader)), rows);
  std::printf("\nreplayed in %.2f s\n", report.wall_seconds);
}

// The report and plot files (when asked for) and the summary table on stdout.
Status WriteOutputs(const ReplayReport& report, const std::string& report_path,
                    const std::string& plot_path) {
  if (!report_path.empty()) {
    const std::string text = ReplayReportToJson(report).dump(2) + "\n";
    KEEL_RETURN_IF_ERROR(WriteFileAtomically(report_path, text));
  }
  if (!plot_path.empty()) KEEL_RETURN_IF_ERROR(WriteReplaySvg(report, plot_path));
  PrintSummary(report);
  if (!report_path.empty()) std::printf("report: %s\n", report_path.c_str());
  if (!plot_path.empty()) std::printf("plot:   %s\n", plot_path.c_str());
  std::fflush(stdout);
  return Status::Ok();
}

// `--sequence-migration`: the sequence replay instead of the policy replay.
int RunSequenceReplay(const Trace& trace, const KeelConfig& config,
                      const SequenceReplayOptions& base, const std::string& report_path,
                      bool quiet) {
  SequenceReplayOptions options = base;
  std::unique_ptr<ProgressBar> progress;
  if (!quiet) {
    progress = std::make_unique<ProgressBar>(
        "sequence replay", std::vector<std::string>{"steps"},
        std::vector<long>{SequenceReplaySteps(trace, options.batch_sequences)});
    options.progress = [bar = progress.get()](int done, int) { bar->Update(0, done); };
  }
  Result<SequenceReplayReport> report = ReplaySequenceMigration(trace, config, options);
  if (progress) progress->Finish();
  if (!report.ok()) return Fail(report.status());
  if (!report_path.empty()) {
    nlohmann::json json;
    json["sequence_migration"] = SequenceReplayReportToJson(*report);
    if (Status status = WriteFileAtomically(report_path, json.dump(2) + "\n"); !status.ok()) {
      return Fail(status);
    }
  }
  std::printf("\n%s\n%s", trace.description.c_str(), FormatSequenceReplayTable(*report).c_str());
  if (!report_path.empty()) std::printf("report: %s\n", report_path.c_str());
  std::fflush(stdout);
  return 0;
}

using Clock = std::chrono::steady_clock;

// Set by SIGINT/SIGTERM while metrics are served; the replay and the serving loop poll it.
std::atomic<bool> stop_requested{false};
static_assert(std::atomic<bool>::is_always_lock_free, "the signal handler needs a lock-free flag");

extern "C" void RequestStop(int /*signal*/) { stop_requested.store(true); }

// Turns one policy's replay into the metrics a live engine exports (docs/monitor.md): per
// layer as it is routed, per step the plan, epoch and migration the step's replans amount to.
// Runs on the replay's worker thread only (one policy, one thread).
class LiveExport {
 public:
  LiveExport(Metrics& metrics, double pace_seconds, Clock::time_point deadline)
      : metrics_(metrics),
        pace_seconds_(pace_seconds),
        deadline_(deadline),
        step_start_(Clock::now()) {}

  // A new pass over the trace starts from the policy's initial placement: a new epoch.
  void StartPass(int pass) {
    if (pass > 0) metrics_.SetEpoch(++epoch_);
    step_start_ = Clock::now();
  }

  void OnLayerStep(const ReplayLayerEvent& event) {
    metrics_.ObserveLayerRouting(event.layer, *event.placement, *event.routing, event.expert_tokens,
                                 event.estimated_rank_tokens, event.max_copies_per_expert);

    if (event.replanned) {
      replanned_ = true;
      planner_seconds_ += event.planner_seconds;
      changed_ = changed_ || event.placement_changed;
      migration_bytes_ += event.migration.bytes;
      migration_seconds_ = std::max(migration_seconds_, event.migration.seconds);
      exposed_seconds_ += event.cost.exposed_migration_seconds;
    }
  }

  // Publishes the step, waits out --pace, and says whether to go on.
  bool OnStepEnd() {
    metrics_.EndStep();
    if (replanned_) {
      metrics_.RecordPlannerRun(planner_seconds_);
      if (changed_) {
        // A replay applies every plan at once; the engine can also skip or reject one.
        metrics_.RecordPlan(PlanOutcome::kMade);
        metrics_.RecordPlan(PlanOutcome::kApplied);
        metrics_.RecordMigration(MigrationOutcome::kOk, "local", migration_bytes_,
                                 migration_seconds_, exposed_seconds_);
        metrics_.SetEpoch(++epoch_);
      } else {
        metrics_.RecordPlan(PlanOutcome::kSkipped, "no_gain");
      }
    }
    replanned_ = changed_ = false;
    planner_seconds_ = migration_bytes_ = migration_seconds_ = exposed_seconds_ = 0;

    const auto next_start = step_start_ + std::chrono::duration_cast<Clock::duration>(
                                              std::chrono::duration<double>(pace_seconds_));
    // Short sleeps so that a signal or the deadline stops a slow pace promptly.
    while (!ShouldStop() && Clock::now() < next_start) {
      std::this_thread::sleep_for(
          std::min<Clock::duration>(next_start - Clock::now(), std::chrono::milliseconds(50)));
    }
    step_start_ = std::max(next_start, Clock::now() - std::chrono::seconds(1));
    if (pace_seconds_ <= 0) step_start_ = Clock::now();
    return !ShouldStop();
  }

  bool ShouldStop() const { return stop_requested.load() || Clock::now() >= deadline_; }

 private:
  Metrics& metrics_;
  double pace_seconds_;
  Clock::time_point deadline_;
  Clock::time_point step_start_;
  int64_t epoch_ = 0;
  bool replanned_ = false;
  bool changed_ = false;
  double planner_seconds_ = 0;
  double migration_bytes_ = 0;
  double migration_seconds_ = 0;
  double exposed_seconds_ = 0;
};

// `keel replay --serve-metrics`: one policy replayed (in passes when looping) while the exporter
// serves its metrics; then serving goes on until a signal or the --serve-seconds deadline.
int ServeReplay(const Trace& trace, const KeelConfig& config, ReplayOptions options,
                const std::string& address, double pace_seconds, double serve_seconds, bool loop,
                bool quiet, const std::string& report_path, const std::string& plot_path) {
  Result<std::unique_ptr<Metrics>> metrics = Metrics::Create(MetricsLayout::FromConfig(
      config, trace.num_layers, trace.num_experts, config.monitor.aggregating_rank));
  if (!metrics.ok()) return Fail(metrics.status());
  if (Status status = (*metrics)->Serve(address); !status.ok()) {
    return Fail(status.WithContext("--serve-metrics"));
  }
  std::signal(SIGINT, RequestStop);
  std::signal(SIGTERM, RequestStop);
  // Scripts that asked for port 0 read the bound port from this line.
  std::fprintf(stderr, "keel replay: serving metrics on http://%s/metrics (policy %s)\n",
               (*metrics)->bound_address().c_str(), options.policies.front().c_str());
  std::fflush(stderr);

  const Clock::time_point deadline =
      serve_seconds > 0 ? Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                             std::chrono::duration<double>(serve_seconds))
                        : Clock::time_point::max();
  LiveExport live(**metrics, pace_seconds, deadline);
  options.max_threads = 1;
  options.on_layer_step = [&live](const ReplayLayerEvent& event) { live.OnLayerStep(event); };
  options.on_step_end = [&live](int, int) { return live.OnStepEnd(); };

  for (int pass = 0; pass == 0 || (loop && !live.ShouldStop()); ++pass) {
    std::unique_ptr<ProgressBar> progress;
    if (!quiet && pass == 0) {
      progress = std::make_unique<ProgressBar>("replay", options.policies,
                                               std::vector<long>{trace.num_steps()});
      options.progress = [bar = progress.get()](int policy, int done, int) {
        bar->Update(policy, done);
      };
    } else {
      options.progress = nullptr;
    }
    live.StartPass(pass);
    Result<ReplayReport> report = ReplayTrace(trace, config, options);
    if (progress) progress->Finish();
    if (!report.ok()) {
      if (report.status().code() == StatusCode::kAborted && live.ShouldStop()) break;
      return Fail(report.status());
    }
    if (pass == 0) {
      if (Status status = WriteOutputs(*report, report_path, plot_path); !status.ok()) {
        return Fail(status);
      }
    }
  }
  while (!live.ShouldStop()) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  if (!quiet) std::fprintf(stderr, "keel replay: stopped serving metrics\n");
  return 0;
}

}  // namespace

int RunReplay(int argc, char** argv) {
  std::string trace_path;
  std::string format_name = "auto";
  std::string config_path;
  std::string policy_list;
  std::string report_path;
  std::string plot_path;
  bool synthetic = false;
  bool oracle = false;
  bool quiet = false;
  uint64_t seed = 1;
  int threads = 0;
  int heatmap_layer = -1;
  std::string serve_address;
  double pace_seconds = 0;
  double serve_seconds = 0;
  bool loop = false;
  bool sequence_migration = false;
  SequenceReplayOptions sequence_options;
  std::string strategy_list;
  std::string pool_path;
  for (const std::string& name : PolicyNames()) {
    policy_list += (policy_list.empty() ? "" : ",") + name;
  }

  FlagParser flags(
      "keel replay",
      "Replays a routing trace under placement policies and compares them: imbalance (max/mean\n"
      "rank load), gap to the lower bound, moved slots and bytes, the cost model's simulated\n"
      "step time, and planner time. Causal by default: the placement used at step t was planned\n"
      "from steps before t; --oracle plans on step t's own load (an upper bound).");
  flags.Add("trace", "PATH", &trace_path,
            "routing trace to replay; 'synthetic' generates one (see --seed)");
  flags.AddBool("synthetic", &synthetic, "replay a synthetic trace (same as --trace synthetic)");
  flags.Add("seed", "N", &seed, "seed of the synthetic trace (only with --trace synthetic)");
  flags.Add("format", "NAME", &format_name,
            "format of the trace file: auto, keel, smartmoe, esft, olmoe or megatron");
  flags.Add("config", "FILE", &config_path,
            "Keel config (YAML); without it the topology follows the trace: one GPU per traced "
            "source rank, a spare slot per GPU");
  flags.Add("policy", "LIST", &policy_list, "comma-separated policies to replay");
  flags.AddBool("oracle", &oracle, "plan each step from its own load instead of the estimate");
  flags.Add("report", "FILE", &report_path, "write the JSON report here");
  flags.Add("plot", "FILE", &plot_path,
            "write an SVG: imbalance per step per policy, and the per-expert load heatmap");
  flags.Add("heatmap-layer", "N", &heatmap_layer,
            "with --plot: layer the heatmap shows; -1 sums all layers");
  flags.Add("threads", "N", &threads,
            "threads the replay runs on (policies, and the layers of each, in parallel), at most " +
                std::to_string(kMaxThreads) + "; 0 = one per hardware thread");
  flags.AddBool("quiet", &quiet, "no progress bar and no notes on stderr");
  flags.Add("serve-metrics", "ADDR", &serve_address,
            "export Prometheus metrics on host:port or [v6addr]:port (a bare port listens on "
            "127.0.0.1; port 0 picks a free one) while replaying one policy: the one --policy "
            "names, else the config's policy.name");
  flags.Add("pace", "SECONDS", &pace_seconds,
            "make each replayed step take this long (0 = as fast as possible; at most 1e9)");
  flags.Add("serve-seconds", "N", &serve_seconds,
            "with --serve-metrics: exit N seconds after serving started (0 = on SIGINT/SIGTERM "
            "only; at most 1e9); the exporter stays up after the trace ends until then");
  flags.AddBool("loop", &loop, "with --serve-metrics: replay the trace again when it ends");
  flags.AddBool("sequence-migration", &sequence_migration,
                "instead of the policies, measure Luffy's sequence migration on a trace with "
                "per-sequence routing (an ESFT folder; docs/luffy.md): rows off rank and off "
                "node, bytes moved and the simulated step, with and without it");
  flags.Add("batch-sequences", "N", &sequence_options.batch_sequences,
            "with --sequence-migration: regroup the trace's sequences into steps of N (0 = the "
            "trace's own steps)");
  flags.Add("sequence-objective", "NAME", &sequence_options.objective,
            "with --sequence-migration: what the planner minimises, step (the cost model's "
            "step, default) or traffic (summed link time: cross-node bytes weigh most)");
  flags.Add("max-token-imbalance", "X", &sequence_options.max_token_imbalance,
            "with --sequence-migration: no rank ends with more than X times the mean tokens "
            "(>= 1; default 1.1)");
  flags.Add("strategy", "LIST", &strategy_list,
            "instead of policies, compare ways to parallelise the MoE layers: comma-separated ep, "
            "esp, parm, ppmoe, auto, or all (docs/strategies.md); ep runs the one policy --policy "
            "names, else the config's policy.name");
  flags.Add("pool", "FILE", &pool_path,
            "with --strategy: the per-layer pool auto chooses from, as keel pool build wrote it "
            "(default: every strategy)");
  flags.SetEpilogue(
      "Metrics are defined in docs/replay.md, the exported ones in docs/monitor.md. Config keys: "
      "keel config --markdown\n"
      "Example: keel replay --trace synthetic --report report.json --plot replay.svg\n"
      "Live:    keel replay --trace synthetic --policy keel --serve-metrics 9400 --pace 0.5 "
      "--loop\n"
      "Luffy:   keel replay --trace ../shared/traces/esft-dsv2lite --sequence-migration "
      "--batch-sequences 16 --config configs/esft-dsv2lite-2x4.yaml\n"
      "Strategies: keel replay --trace synthetic --strategy all --plot strategies.svg");
  if (Status status = flags.Parse(argc, argv); !status.ok()) return Fail(status);
  if (flags.help_requested()) {
    std::fputs(flags.HelpText().c_str(), stdout);
    return 0;
  }
  if (flags.IsSet("synthetic") && flags.IsSet("trace") && trace_path != "synthetic") {
    return Fail(InvalidArgument("--synthetic replays a generated trace, but --trace " + trace_path +
                                " names a file; give one of them"));
  }
  if (trace_path == "synthetic") synthetic = true;
  if (!synthetic && trace_path.empty()) {
    return Fail(InvalidArgument("missing required flag --trace PATH (or --trace synthetic)"));
  }
  // A synthetic trace is generated, not read: a format names how to read a file, and a seed
  // which trace to generate.
  if (synthetic && flags.IsSet("format")) {
    return Fail(InvalidArgument("--format " + format_name +
                                " names how to read a trace file; a synthetic trace is generated "
                                "(leave --format out, or give --trace PATH)"));
  }
  if (!synthetic && flags.IsSet("seed")) {
    return Fail(InvalidArgument("--seed picks a synthetic trace, but --trace " + trace_path +
                                " is a file (use --trace synthetic, or leave --seed out)"));
  }
  const Result<TraceFormat> format = ParseTraceFormat(format_name);
  if (!format.ok()) return Fail(format.status().WithContext("--format"));
  if (threads < 0 || threads > kMaxThreads) {
    return Fail(InvalidArgument("--threads " + std::to_string(threads) + " is not in [0, " +
                                std::to_string(kMaxThreads) + "] (0: one per hardware thread)"));
  }
  if (flags.IsSet("heatmap-layer") && plot_path.empty()) {
    return Fail(InvalidArgument("--heatmap-layer " + std::to_string(heatmap_layer) +
                                " chooses what --plot draws; there is no --plot"));
  }
  const bool serve = flags.IsSet("serve-metrics");
  // Durations up to 1e9 s (31 years): beyond about 9.2e9 s a clock's nanoseconds overflow.
  constexpr double kMaxSeconds = 1e9;
  if (!(pace_seconds >= 0 && pace_seconds <= kMaxSeconds)) {
    return Fail(
        InvalidArgument("--pace must be in [0, 1e9] seconds, got " + NumberText(pace_seconds)));
  }
  if (!(serve_seconds >= 0 && serve_seconds <= kMaxSeconds)) {
    return Fail(
        InvalidArgument("--serve-seconds must be in [0, 1e9], got " + NumberText(serve_seconds)));
  }
  if (!serve && (loop || flags.IsSet("serve-seconds"))) {
    return Fail(InvalidArgument(std::string(loop ? "--loop" : "--serve-seconds") +
                                " is only meaningful with --serve-metrics ADDR"));
  }
  if (serve && flags.IsSet("threads")) {
    return Fail(
        InvalidArgument("--threads: --serve-metrics replays one policy on one thread, "
                        "step by step"));
  }
  if (serve && serve_address.empty()) {
    return Fail(
        InvalidArgument("--serve-metrics needs an address ([v6addr]:port, host:port or port)"));
  }
  if (serve) {
    if (Result<ListenAddress> parsed = ParseListenAddress(serve_address); !parsed.ok()) {
      return Fail(parsed.status().WithContext("--serve-metrics"));
    }
  }

  const bool strategies = flags.IsSet("strategy");
  if (strategies) {
    for (const char* other : {"sequence-migration", "serve-metrics", "pace", "threads"}) {
      if (flags.IsSet(other)) {
        return Fail(InvalidArgument(std::string("--") + other +
                                    " belongs to the policy replay; --strategy compares "
                                    "strategies"));
      }
    }
  } else if (flags.IsSet("pool")) {
    return Fail(InvalidArgument("--pool is only meaningful with --strategy"));
  }
  if (sequence_migration) {
    for (const char* other : {"policy", "oracle", "plot", "serve-metrics", "pace", "heatmap-layer",
                              "threads", "synthetic"}) {
      if (flags.IsSet(other)) {
        return Fail(InvalidArgument(std::string("--") + other +
                                    " belongs to the policy replay; --sequence-migration replays "
                                    "sequence placement only"));
      }
    }
    if (synthetic) {
      return Fail(
          InvalidArgument("--sequence-migration needs a trace that records routing per sequence; "
                          "the synthetic trace has none"));
    }
  } else {
    for (const char* own : {"batch-sequences", "max-token-imbalance", "sequence-objective"}) {
      if (flags.IsSet(own)) {
        return Fail(InvalidArgument(std::string("--") + own +
                                    " is only meaningful with --sequence-migration"));
      }
    }
  }
  if (sequence_options.objective != "step" && sequence_options.objective != "traffic") {
    return Fail(InvalidArgument("--sequence-objective '" + sequence_options.objective +
                                "' is not step or traffic"));
  }
  if (sequence_options.batch_sequences < 0) {
    return Fail(InvalidArgument("--batch-sequences must be >= 0, got " +
                                std::to_string(sequence_options.batch_sequences)));
  }
  if (!(sequence_options.max_token_imbalance >= 1.0 &&
        sequence_options.max_token_imbalance <= 1e6)) {
    return Fail(InvalidArgument("--max-token-imbalance must be in [1, 1e6], got " +
                                NumberText(sequence_options.max_token_imbalance)));
  }

  // Before the trace is read or anything served: no output may replace an input or another.
  if (Status status = CheckOutputsApart({{"--trace", synthetic ? "" : trace_path},
                                         {"--config", config_path},
                                         {"--pool", pool_path}},
                                        {{"--report", report_path}, {"--plot", plot_path}});
      !status.ok()) {
    return Fail(status);
  }

  ReplayOptions options;
  Result<std::vector<std::string>> policies = SplitCommaList(policy_list, "policy");
  if (!policies.ok()) return Fail(policies.status());
  options.policies = std::move(policies).value();
  options.oracle = oracle;
  options.max_threads = threads;
  options.heatmap_layer = heatmap_layer;
  std::vector<std::string> strategy_names;
  if (strategies && strategy_list != "all") {
    Result<std::vector<std::string>> split = SplitCommaList(strategy_list, "strategy");
    if (!split.ok()) return Fail(split.status());
    strategy_names = std::move(split).value();
  }
  // Names and the config are checked before the trace is read, which can take seconds.
  for (const std::string& name : options.policies) {
    if (Status status = CheckPolicyName(name); !status.ok()) {
      return Fail(status.WithContext("--policy"));
    }
  }
  KeelConfig config;
  if (!config_path.empty()) {
    Result<KeelConfig> loaded = LoadConfigFile(config_path);
    if (!loaded.ok()) return Fail(loaded.status());
    config = *loaded;
  }

  Result<Trace> trace = [&]() -> Result<Trace> {
    if (synthetic) {
      SyntheticTraceOptions synthetic_options;
      synthetic_options.seed = seed;
      return GenerateSyntheticTrace(synthetic_options);
    }
    return ReadTrace(trace_path, *format);
  }();
  if (!trace.ok()) return Fail(trace.status());

  if (config_path.empty()) {
    config = ConfigFittingTrace(*trace);
    if (!quiet) {
      std::fprintf(stderr,
                   "keel replay: no --config; using %d node(s) x %d GPUs, %d persistent and %d "
                   "transient slots per GPU\n",
                   config.topology.num_nodes, config.topology.gpus_per_node,
                   config.slots.persistent_per_rank, config.slots.transient_per_rank);
    }
  }

  if (sequence_migration) {
    return RunSequenceReplay(*trace, config, sequence_options, report_path, quiet);
  }
  if (strategies) {
    if (flags.IsSet("policy")) {
      if (options.policies.size() != 1) {
        return Fail(InvalidArgument("--strategy runs one policy for ep, but --policy lists " +
                                    std::to_string(options.policies.size()) + " (" + policy_list +
                                    ")"));
      }
      config.policy.name = options.policies[0];
    }
    StrategyReplayOptions strategy_options;
    if (strategy_list != "all") strategy_options.strategies = std::move(strategy_names);
    strategy_options.oracle = oracle;
    strategy_options.heatmap_layer = heatmap_layer;
    return RunStrategyReplay(*trace, config, std::move(strategy_options), pool_path, report_path,
                             plot_path, quiet);
  }
  if (serve) {
    // The exported metrics describe one engine, so one policy: an explicit single --policy, or
    // the config's.
    if (flags.IsSet("policy")) {
      if (options.policies.size() != 1) {
        return Fail(
            InvalidArgument("--serve-metrics exports one policy's metrics, but --policy lists " +
                            std::to_string(options.policies.size()) + " (" + policy_list +
                            "); name one, or leave --policy out to use the config's policy.name"));
      }
    } else {
      if (Status status = CheckPolicyName(config.policy.name); !status.ok()) {
        return Fail(status.WithContext("policy.name"));
      }
      options.policies = {config.policy.name};
    }
    return ServeReplay(*trace, config, options, serve_address, pace_seconds, serve_seconds, loop,
                       quiet, report_path, plot_path);
  }

  if (pace_seconds > 0) {
    options.on_step_end = [pace_seconds](int, int) {
      std::this_thread::sleep_for(std::chrono::duration<double>(pace_seconds));
      return true;
    };
  }
  std::unique_ptr<ProgressBar> progress;
  if (!quiet) {
    progress = std::make_unique<ProgressBar>(
        "replay", options.policies, std::vector<long>(options.policies.size(), trace->num_steps()));
    options.progress = [bar = progress.get()](int policy, int done, int) {
      bar->Update(policy, done);
    };
  }
  Result<ReplayReport> report = ReplayTrace(*trace, config, options);
  if (progress) progress->Finish();
  if (!report.ok()) return Fail(report.status());

  if (Status status = WriteOutputs(*report, report_path, plot_path); !status.ok()) {
    return Fail(status);
  }
  return 0;
}

}  // namespace keel::tools
