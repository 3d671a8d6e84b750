// `keel plan`: one placement from a per-expert load, with DeepSeek EPLB's inputs and outputs
// (weight, num_replicas, num_groups, num_nodes, num_gpus in; phy2log, log2phy, logcnt out), so
// any Keel policy can stand in wherever EPLB's function is called.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/file.h"
#include "common/json.h"
#include "keel/config.hpp"
#include "keel/plan.hpp"
#include "placement/policy.h"
#include "tools/commands.h"
#include "tools/flags.h"
#include "tools/plan_input.h"
#include "tools/replay.h"

namespace keel::tools {
namespace {

using Json = nlohmann::json;

// --repeat times a plan to report its median: beyond a thousand the median does not move, and the
// slots planned in all repeats are bounded as one plan's are (include/keel/plan.hpp).
constexpr int kMaxRepeat = 1000;
constexpr double kMaxRepeatedSlots = 1 << 24;

// Prints {"error": ...} on stdout, the message on stderr, and returns the exit code.
int Fail(const Status& status) {
  const bool bad_input =
      status.code() == StatusCode::kInvalidArgument || status.code() == StatusCode::kNotFound;
  std::cout << Json{{"error", status.message()}}.dump() << "\n";
  std::cerr << "keel plan: " << status.message() << "\n";
  return bad_input ? 2 : 1;
}

Result<Json> ReadJsonFile(const std::string& path) {
  KEEL_ASSIGN_OR_RETURN(const std::string text,
                        ReadFile(path, {.limit = InputLimit::kPlanInputBytes,
                                        .argument = "--input",
                                        .dash_is_stdin = true}));
  Result<Json> json = ParseJson(text, "is not valid JSON");
  if (!json.ok()) return json.status().WithContext("--input '" + path + "'");
  return json;
}

}  // namespace

int RunPlan(int argc, char** argv) {
  std::string policy_name = "eplb";
  std::string input_path;
  std::string output_path;
  std::string config_path;
  int repeat = 1;
  FlagParser flags("keel plan",
                   "Plans one placement per layer from a per-expert load, with DeepSeek EPLB's "
                   "inputs and outputs.\n"
                   "Input JSON: {\"weight\": [[...]] (layers x experts, loads >= 0), "
                   "\"num_replicas\": R,\n"
                   "  \"num_groups\": n, \"num_nodes\": m, \"num_gpus\": g}  (R divisible by g, "
                   "g by m)\n"
                   "Output JSON: {\"phy2log\": [[...]], \"log2phy\": [[[...]]], \"logcnt\": "
                   "[[...]],\n"
                   "  \"timing\": {\"median_seconds\": s}}; an empty slot is -1 in phy2log.\n"
                   "Errors print {\"error\": \"...\"} and exit 2 (bad input) or 1.");
  flags.Add("policy", "NAME", &policy_name,
            "policy: static, eplb, flexmoe, smartmoe, fastermoe, velb, lplb, swiftmoe, trtllm or "
            "keel; eplb calls DeepSeek's "
            "algorithm directly, the others plan on a num_nodes x (num_gpus/num_nodes) topology "
            "with num_replicas/num_gpus slots per GPU");
  flags.Add("input", "FILE", &input_path, "input JSON ('-' reads stdin)",
            FlagRequirement::kRequired);
  flags.Add("output", "FILE", &output_path, "write the output JSON here instead of stdout");
  flags.Add("config", "FILE", &config_path,
            "Keel config for policy parameters and the cost model (its topology and slots are "
            "replaced by the input's); not with eplb, which is DeepSeek's algorithm as published");
  flags.Add("repeat", "N", &repeat,
            "plan N times and report the median wall time of the whole planning call; at most " +
                std::to_string(kMaxRepeat) + ", and N x layers x num_replicas at most 2^24");
  flags.SetEpilogue("Config keys: keel config --markdown");
  if (Status status = flags.Parse(argc, argv); !status.ok()) return Fail(status);
  if (flags.help_requested()) {
    std::fputs(flags.HelpText().c_str(), stdout);
    return 0;
  }
  if (repeat < 1 || repeat > kMaxRepeat) {
    return Fail(InvalidArgument("--repeat " + std::to_string(repeat) + " is not in [1, " +
                                std::to_string(kMaxRepeat) + "]"));
  }
  if (Status status = CheckPolicyName(policy_name); !status.ok()) {
    return Fail(status.WithContext("--policy"));
  }
  if (policy_name == "eplb" && flags.IsSet("config")) {
    return Fail(InvalidArgument("--config " + config_path +
                                ": eplb is DeepSeek's algorithm as published and reads no config "
                                "(give another --policy, or leave --config out)"));
  }
  if (Status status = CheckOutputsApart({{"--input", input_path}, {"--config", config_path}},
                                        {{"--output", output_path}});
      !status.ok()) {
    return Fail(status);
  }

  Config config;
  if (!config_path.empty()) {
    Result<Config> loaded = Config::FromFile(config_path);
    if (!loaded.ok()) return Fail(loaded.status());
    config = *loaded;
  }
  Result<Json> json = ReadJsonFile(input_path);
  if (!json.ok()) return Fail(json.status());
  Result<PlanRequest> input = ParsePlanInput(*json);
  if (!input.ok()) return Fail(input.status());

  input->policy = policy_name;
  input->config = &config;
  // The planner's work grows with the slots of all layers (one plan's are bounded by
  // PlanPlacement); repeating it multiplies them.
  if (const double slots = static_cast<double>(repeat) * input->num_layers * input->num_replicas;
      repeat > 1 && slots > kMaxRepeatedSlots) {
    return Fail(InvalidArgument("--repeat " + std::to_string(repeat) + " x " +
                                std::to_string(input->num_layers) + " layers x num_replicas " +
                                std::to_string(input->num_replicas) +
                                " is more than the 2^24 slots keel plan plans in one call"));
  }
  std::vector<double> seconds;
  std::optional<PlanResult> plan;
  for (int i = 0; i < repeat; ++i) {
    const auto start = std::chrono::steady_clock::now();
    Result<PlanResult> result = PlanPlacement(*input);
    seconds.push_back(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    if (!result.ok()) return Fail(result.status());
    plan = std::move(result).value();
  }
  const Distribution timing = Summarize(seconds);

  // Nested per layer (and per expert for log2phy), as EPLB's tensors print.
  const auto slice = [](const std::vector<int32_t>& flat, size_t row, size_t width) {
    return std::vector<int32_t>(flat.begin() + row * width, flat.begin() + (row + 1) * width);
  };
  Json out = {{"phy2log", Json::array()}, {"log2phy", Json::array()}, {"logcnt", Json::array()}};
  const size_t experts = static_cast<size_t>(plan->num_experts);
  for (size_t l = 0; l < static_cast<size_t>(plan->num_layers); ++l) {
    out["phy2log"].push_back(slice(plan->phy2log, l, static_cast<size_t>(plan->num_replicas)));
    out["logcnt"].push_back(slice(plan->logcnt, l, experts));
    Json& experts_of_layer = out["log2phy"].emplace_back(Json::array());
    for (size_t e = 0; e < experts; ++e) {
      experts_of_layer.push_back(
          slice(plan->log2phy, l * experts + e, static_cast<size_t>(plan->max_copies)));
    }
  }
  out["policy"] = policy_name;
  out["timing"] = {{"median_seconds", timing.p50}, {"repeat", repeat}};
  const std::string text = out.dump() + "\n";
  if (output_path.empty()) {
    std::fputs(text.c_str(), stdout);
    return 0;
  }
  if (Status status = WriteFileAtomically(output_path, text); !status.ok()) return Fail(status);
  return 0;
}

}  // namespace keel::tools
