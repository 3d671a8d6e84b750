// `keel pool build` (SmartMoE's offline pool of strategies per layer, from a profiling trace)
// and the terminal side of `keel replay --strategy`, which uses such a pool.
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "common/file.h"
#include "common/json.h"
#include "tools/commands.h"
#include "tools/flags.h"
#include "tools/progress.h"
#include "tools/strategy_replay.h"
#include "tools/svg_plot.h"

namespace keel::tools {
namespace {

int Fail(const char* command, const Status& status) {
  std::fprintf(stderr, "%s: %s\n", command, status.message().c_str());
  return status.code() == StatusCode::kInvalidArgument || status.code() == StatusCode::kNotFound
             ? 2
             : 1;
}

// Runs the strategy replay with a progress bar on stderr (unless quiet).
Result<StrategyReplayReport> ReplayWithProgress(const Trace& trace, const KeelConfig& config,
                                                StrategyReplayOptions options, bool quiet) {
  std::unique_ptr<ProgressBar> progress;
  if (!quiet) {
    progress = std::make_unique<ProgressBar>(
        "strategies", std::vector<std::string>{"ep (" + config.policy.name + ")", "layers"},
        std::vector<long>{trace.num_steps(), trace.num_layers});
    options.progress = [bar = progress.get()](const std::string& phase, int done, int) {
      bar->Update(phase == "strategies" ? 1 : 0, done);
    };
  }
  Result<StrategyReplayReport> report = ReplayStrategies(trace, config, options);
  if (progress) progress->Finish();
  return report;
}

Result<StrategyPool> ReadPool(const std::string& path) {
  KEEL_ASSIGN_OR_RETURN(std::string text,
                        ReadFile(path, {.limit = InputLimit::kStrategyPoolBytes}));
  Result<nlohmann::json> json = ParseJson(text);
  if (!json.ok()) return json.status().WithContext(path);
  Result<StrategyPool> pool = StrategyPoolFromJson(*json);
  if (!pool.ok()) return pool.status().WithContext(path);
  return pool;
}

}  // namespace

int RunStrategyReplay(const Trace& trace, const KeelConfig& config, StrategyReplayOptions options,
                      const std::string& pool_path, const std::string& report_path,
                      const std::string& plot_path, bool quiet) {
  constexpr const char* kCommand = "keel replay";
  if (!pool_path.empty()) {
    Result<StrategyPool> pool = ReadPool(pool_path);
    if (!pool.ok()) return Fail(kCommand, pool.status().WithContext("--pool"));
    options.pool = std::move(pool).value();
  }
  Result<StrategyReplayReport> report = ReplayWithProgress(trace, config, options, quiet);
  if (!report.ok()) return Fail(kCommand, report.status());
  if (!report_path.empty()) {
    nlohmann::json json = {{"strategy_replay", StrategyReplayReportToJson(*report)}};
    if (Status status = WriteFileAtomically(report_path, json.dump(2) + "\n"); !status.ok()) {
      return Fail(kCommand, status);
    }
  }
  if (!plot_path.empty()) {
    if (Status status =
            WriteReplaySvg(StrategyPlotReport(*report), plot_path, PlotLines::kStepMilliseconds);
        !status.ok()) {
      return Fail(kCommand, status);
    }
  }
  std::printf("\n%s", FormatStrategyTable(*report).c_str());
  if (!report_path.empty()) std::printf("report: %s\n", report_path.c_str());
  if (!plot_path.empty()) std::printf("plot:   %s\n", plot_path.c_str());
  std::fflush(stdout);
  return 0;
}

int RunPool(int argc, char** argv) {
  constexpr const char* kCommand = "keel pool build";
  if (argc < 2 || std::string(argv[1]) != "build") {
    const bool help =
        argc >= 2 && (std::string(argv[1]) == "--help" || std::string(argv[1]) == "-h");
    std::fputs(
        "Usage: keel pool build --trace PATH --out FILE [flags]   (keel pool build --help)\n\n"
        "Builds SmartMoE's pool: per MoE layer, the few parallel strategies (ep, esp, parm,\n"
        "ppmoe) that together run a profiling trace fastest; keel replay --strategy auto --pool\n"
        "FILE then chooses among them at every replan.\n",
        help ? stdout : stderr);
    return help ? 0 : 2;
  }
  std::string trace_path;
  std::string format_name = "auto";
  std::string config_path;
  std::string out_path;
  std::string report_path;
  int size = 2;
  int profile_steps = 0;
  bool quiet = false;
  FlagParser flags(
      kCommand,
      "Replays a profiling trace under every fixed strategy (ep with the config's policy, esp,\n"
      "parm, ppmoe) and keeps, per layer, the --size strategies that together give the lowest\n"
      "summed step: first the best alone (or, among those that tie with it within the standard\n"
      "error of their step-by-step difference, the steadiest), then each time the one that most\n"
      "lowers the sum of the per-step minimum (SmartMoE's offline pool). docs/strategies.md.");
  flags.Add("trace", "PATH", &trace_path, "profiling trace (any format keel replay reads)",
            FlagRequirement::kRequired);
  flags.Add("format", "NAME", &format_name,
            "format of the trace file: auto, keel, smartmoe, esft, olmoe or megatron");
  flags.Add("config", "FILE", &config_path,
            "Keel config (YAML): topology, cost model and strategy settings; without it the "
            "topology follows the trace");
  flags.Add("size", "K", &size, "strategies kept per layer, 1 to 4");
  flags.Add("profile-steps", "N", &profile_steps,
            "profile on the trace's first N steps only, as a pool built early in a run would "
            "be (0 = every step)");
  flags.Add("out", "FILE", &out_path, "where the pool is written (JSON)",
            FlagRequirement::kRequired);
  flags.Add("report", "FILE", &report_path, "also write the profiling replay's JSON report");
  flags.AddBool("quiet", &quiet, "no progress bar");
  flags.SetEpilogue(
      "Example: keel pool build --trace ../shared/traces/smartmoe-ae --config "
      "configs/smartmoe-16gpu.yaml --size 2 --out pool.json\n"
      "         keel replay --trace ../shared/traces/smartmoe-ae --config "
      "configs/smartmoe-16gpu.yaml --strategy all --pool pool.json");
  if (Status status = flags.Parse(argc - 1, argv + 1); !status.ok()) {
    return Fail(kCommand, status);
  }
  if (flags.help_requested()) {
    std::fputs(flags.HelpText().c_str(), stdout);
    return 0;
  }
  if (size < 1 || size > 4) {
    return Fail(kCommand, InvalidArgument("--size must be in [1, 4], got " + std::to_string(size)));
  }
  const Result<TraceFormat> format = ParseTraceFormat(format_name);
  if (!format.ok()) return Fail(kCommand, format.status().WithContext("--format"));
  if (Status status = CheckOutputsApart({{"--trace", trace_path}, {"--config", config_path}},
                                        {{"--out", out_path}, {"--report", report_path}});
      !status.ok()) {
    return Fail(kCommand, status);
  }
  KeelConfig config;
  if (!config_path.empty()) {
    Result<KeelConfig> loaded = LoadConfigFile(config_path);
    if (!loaded.ok()) return Fail(kCommand, loaded.status());
    config = *loaded;
  }
  Result<Trace> trace = ReadTrace(trace_path, *format);
  if (!trace.ok()) return Fail(kCommand, trace.status());
  if (config_path.empty()) config = ConfigFittingTrace(*trace);
  if (profile_steps < 0) {
    return Fail(kCommand, InvalidArgument("--profile-steps must be >= 0, got " +
                                          std::to_string(profile_steps)));
  }
  if (profile_steps > 0 && profile_steps < trace->num_steps()) {
    trace->steps.resize(profile_steps);
    trace->step_ids.resize(profile_steps);
    if (trace->has_sequences()) trace->sequences.resize(profile_steps);
  }

  StrategyReplayOptions options;
  options.strategies = {"ep", "esp", "parm", "ppmoe"};
  Result<StrategyReplayReport> report = ReplayWithProgress(*trace, config, options, quiet);
  if (!report.ok()) return Fail(kCommand, report.status());
  const StrategyPool pool = BuildStrategyPool(*report, size);
  if (Status status = WriteFileAtomically(out_path, StrategyPoolToJson(pool).dump(2) + "\n");
      !status.ok()) {
    return Fail(kCommand, status);
  }
  if (!report_path.empty()) {
    nlohmann::json json = {{"strategy_replay", StrategyReplayReportToJson(*report)}};
    if (Status status = WriteFileAtomically(report_path, json.dump(2) + "\n"); !status.ok()) {
      return Fail(kCommand, status);
    }
  }
  std::printf("\n%s\n", FormatStrategyTable(*report).c_str());
  // How often each strategy made the pool, over the layers.
  std::vector<int> picked(kAllStrategies.size(), 0);
  for (const std::vector<Strategy>& layer : pool.layers) {
    for (Strategy strategy : layer) ++picked[static_cast<int>(strategy)];
  }
  std::printf("pool of %d per layer, over %zu layers:", size, pool.layers.size());
  for (Strategy strategy : kAllStrategies) {
    std::printf(" %s %d", std::string(StrategyName(strategy)).c_str(),
                picked[static_cast<int>(strategy)]);
  }
  std::printf("\npool:   %s\n", out_path.c_str());
  if (!report_path.empty()) std::printf("report: %s\n", report_path.c_str());
  return 0;
}

}  // namespace keel::tools
