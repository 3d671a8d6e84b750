// `keel replay`: replays a routing trace (a recorded one, or a synthetic one made on the spot)
// under several placement policies and reports balance, moved state, simulated step time and
// planner time per policy, as a table, a JSON report and an SVG plot.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <iterator>
#include <memory>
#include <string>
#include <vector>

#include "common/config.h"
#include "monitor/trace.h"
#include "placement/policy.h"
#include "tools/commands.h"
#include "tools/flags.h"
#include "tools/progress.h"
#include "tools/replay.h"
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

// Without --config the topology follows the trace: one rank per recorded source (nodes of 8
// GPUs when the count allows), and at least one spare persistent slot per rank beyond what the
// experts need, so that replicating policies have room to act.
KeelConfig ConfigFittingTrace(const Trace& trace) {
  KeelConfig config;
  if (trace.num_sources > 0) {
    const int ranks = trace.num_sources;
    const bool whole_nodes = ranks > 8 && ranks % 8 == 0;
    config.topology.num_nodes = whole_nodes ? ranks / 8 : 1;
    config.topology.gpus_per_node = whole_nodes ? 8 : ranks;
  }
  const int ranks = config.num_ranks();
  const int needed = (trace.num_experts + ranks - 1) / ranks + 1;
  config.slots.persistent_per_rank = std::max(config.slots.persistent_per_rank, needed);
  return config;
}

std::string Cell(double value, int decimals) {
  char buffer[32];
  std::snprintf(buffer, sizeof(buffer), "%.*f", decimals, value);
  return buffer;
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
    rows.push_back({p.name, Cell(p.imbalance.mean, 3), Cell(p.imbalance.p99, 3), Cell(p.lb_gap, 3),
                    Cell(p.moved_slots_per_replan, 2), Cell(p.moved_bytes_total / 1e9, 2),
                    Cell(p.sim_step_seconds.mean * 1e3, 3),
                    Cell(p.planner_seconds_per_layer.p50 * 1e6, 1)});
  }
  std::vector<size_t> width(std::size(kHeader));
  for (size_t c = 0; c < width.size(); ++c) {
    width[c] = std::string(kHeader[c]).size();
    for (const auto& row : rows) width[c] = std::max(width[c], row[c].size());
  }
  auto print_row = [&](const std::vector<std::string>& row) {
    for (size_t c = 0; c < row.size(); ++c) {
      // The policy name aligns left, numbers align right.
      if (c == 0) {
        std::printf("%-*s", static_cast<int>(width[c]), row[c].c_str());
      } else {
        std::printf("  %*s", static_cast<int>(width[c]), row[c].c_str());
      }
    }
    std::printf("\n");
  };
  print_row(std::vector<std::string>(std::begin(kHeader), std::end(kHeader)));
  size_t total = 0;
  for (size_t w : width) total += w + 2;
  std::printf("%s\n", std::string(total - 2, '-').c_str());
  for (const auto& row : rows) print_row(row);
  std::printf("\nreplayed in %.2f s\n", report.wall_seconds);
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
  flags.Add("seed", "N", &seed, "seed of the synthetic trace");
  flags.Add("format", "NAME", &format_name,
            "trace format: auto, keel, smartmoe, esft, olmoe or megatron");
  flags.Add("config", "FILE", &config_path,
            "Keel config (YAML); without it the topology follows the trace: one GPU per traced "
            "source rank, a spare slot per GPU");
  flags.Add("policy", "LIST", &policy_list, "comma-separated policies to replay");
  flags.AddBool("oracle", &oracle, "plan each step from its own load instead of the estimate");
  flags.Add("report", "FILE", &report_path, "write the JSON report here");
  flags.Add("plot", "FILE", &plot_path,
            "write an SVG: imbalance per step per policy, and the per-expert load heatmap");
  flags.Add("heatmap-layer", "N", &heatmap_layer, "layer the heatmap shows; -1 sums all layers");
  flags.Add("threads", "N", &threads,
            "policies replayed at the same time; 0 = one per hardware thread");
  flags.AddBool("quiet", &quiet, "no progress bar and no notes on stderr");
  flags.SetEpilogue(
      "Metrics are defined in docs/replay.md. Config keys: keel config --markdown\n"
      "Example: keel replay --trace synthetic --report report.json --plot replay.svg");
  if (Status status = flags.Parse(argc, argv); !status.ok()) return Fail(status);
  if (flags.help_requested()) {
    std::fputs(flags.HelpText().c_str(), stdout);
    return 0;
  }
  if (trace_path == "synthetic") synthetic = true;
  if (!synthetic && trace_path.empty()) {
    return Fail(InvalidArgument("missing required flag --trace PATH (or --trace synthetic)"));
  }
  if (threads < 0)
    return Fail(InvalidArgument("--threads must be >= 0, got " + std::to_string(threads)));

  ReplayOptions options;
  options.policies = SplitCommaList(policy_list);
  options.oracle = oracle;
  options.max_threads = threads;
  options.heatmap_layer = heatmap_layer;
  if (options.policies.empty()) return Fail(InvalidArgument("--policy lists no policy"));
  // Names are checked before the trace is read, which can take seconds.
  for (const std::string& name : options.policies) {
    if (Status status = CheckPolicyName(name); !status.ok()) {
      return Fail(status.WithContext("--policy"));
    }
  }

  Result<Trace> trace = [&]() -> Result<Trace> {
    if (synthetic) {
      SyntheticTraceOptions synthetic_options;
      synthetic_options.seed = seed;
      return GenerateSyntheticTrace(synthetic_options);
    }
    KEEL_ASSIGN_OR_RETURN(TraceFormat format, ParseTraceFormat(format_name));
    return ReadTrace(trace_path, format);
  }();
  if (!trace.ok()) return Fail(trace.status());

  KeelConfig config;
  if (!config_path.empty()) {
    Result<KeelConfig> loaded = LoadConfigFile(config_path);
    if (!loaded.ok()) return Fail(loaded.status());
    config = *loaded;
  } else {
    config = ConfigFittingTrace(*trace);
    if (!quiet) {
      std::fprintf(stderr,
                   "keel replay: no --config; using %d node(s) x %d GPUs, %d persistent and %d "
                   "transient slots per GPU\n",
                   config.topology.num_nodes, config.topology.gpus_per_node,
                   config.slots.persistent_per_rank, config.slots.transient_per_rank);
    }
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

  if (!report_path.empty()) {
    const std::string text = ReplayReportToJson(*report).dump(2) + "\n";
    if (Status status = WriteFileAtomically(report_path, text); !status.ok()) return Fail(status);
  }
  if (!plot_path.empty()) {
    if (Status status = WriteReplaySvg(*report, plot_path); !status.ok()) return Fail(status);
  }
  PrintSummary(*report);
  if (!report_path.empty()) std::printf("report: %s\n", report_path.c_str());
  if (!plot_path.empty()) std::printf("plot:   %s\n", plot_path.c_str());
  return 0;
}

}  // namespace keel::tools
