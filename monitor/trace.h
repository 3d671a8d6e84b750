// Routing traces: the Keel trace format (reader and writer), importers for recorded traces from
// other systems, and a seeded synthetic generator so the project has data of its own. A trace is
// per step and layer: tokens per expert, optionally per source rank (the traffic matrix).
// The format is documented in docs/traces.md.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace keel {

struct Trace {
  std::string description;  // where it came from, e.g. "smartmoe: moe_trace (16 ranks)"
  int num_layers = 0;
  int num_experts = 0;
  int num_sources = 0;            // source ranks of the traffic matrix; 0 = per-expert counts only
  std::vector<int64_t> step_ids;  // [num_steps] original step / iteration number of each step
  // [num_steps][num_layers * row_size()] tokens; a layer's row is [num_sources * num_experts]
  // (source-major) when num_sources > 0, else [num_experts].
  std::vector<std::vector<double>> steps;

  int num_steps() const { return static_cast<int>(steps.size()); }
  int row_size() const { return num_sources > 0 ? num_sources * num_experts : num_experts; }
  std::span<const double> layer_row(int step, int layer) const {
    return {steps[step].data() + static_cast<size_t>(layer) * row_size(),
            static_cast<size_t>(row_size())};
  }
  // [num_experts] tokens of one (step, layer), summed over sources.
  std::vector<double> ExpertCounts(int step, int layer) const;
  // Shapes agree, counts finite and non-negative; errors name the step and layer.
  Status Validate() const;
};

enum class TraceFormat { kAuto, kKeel, kSmartMoe, kEsft, kOlmoe, kMegatron };

// "keel", "smartmoe", ... ; parsing fails with the list of known names.
Result<TraceFormat> ParseTraceFormat(std::string_view name);
std::string_view TraceFormatName(TraceFormat format);

// Reads a trace in any supported format; kAuto guesses from the path and content.
Result<Trace> ReadTrace(const std::string& path, TraceFormat format = TraceFormat::kAuto);

Result<Trace> ReadKeelTrace(const std::string& path);
Status WriteKeelTrace(const Trace& trace, const std::string& path);

// The two line kinds of a Keel trace, for writers that emit it incrementally (the trace
// recorder). The header line describes `shape` (its steps are ignored); a step line holds
// counts: [num_layers * row_size] of `shape`. Both end with '\n'.
Result<std::string> KeelTraceHeaderLine(const Trace& shape);
void AppendKeelTraceStepLine(const Trace& shape, int64_t step_id, std::span<const double> counts,
                             std::string& out);

// Options of the synthetic generator. Loads follow a Zipf law over a permutation of experts that
// drifts (neighbouring experts swap popularity) and occasionally bursts (one expert's load is
// multiplied for a few steps). Same options, same trace, on every machine.
struct SyntheticTraceOptions {
  uint64_t seed = 1;
  int num_steps = 200;
  int num_layers = 4;
  int num_experts = 32;
  int num_sources = 8;           // source ranks; 0 = per-expert counts only
  int tokens_per_source = 4096;  // tokens each source routes per step and layer
  int top_k = 2;
  double zipf_exponent = 1.0;
  double drift_swaps_per_step = 0.5;  // mean popularity swaps per layer per step
  double burst_probability = 0.02;    // per layer per step
  double burst_factor = 4.0;
  int burst_steps = 5;
};
Result<Trace> GenerateSyntheticTrace(const SyntheticTraceOptions& options);

}  // namespace keel
