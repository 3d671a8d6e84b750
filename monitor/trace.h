// Routing traces inside the library: the Keel trace format's reader and writer, line by line for
// the recorder. The Trace itself, reading any format and the synthetic generator are public
// (include/keel/trace.hpp); the format is documented in docs/traces.md.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "keel/status.hpp"
#include "keel/trace.hpp"

namespace keel {

// The most counts a trace may hold (steps x layers x sources x experts, and the sequences' layers
// x experts): KEEL_MAX_TRACE_COUNT_BYTES over 8, by default kMaxCounts (keel/limits.hpp). An
// error names the variable when its value is not a size.
struct TraceCountLimit {
  int64_t counts = 0;
  std::string text;  // "the 67108864 counts (512 MiB) a trace may hold (set ... to raise it)"
};
Result<TraceCountLimit> TraceCounts();

// Within kMaxLayers, kMaxExperts, kMaxRanks, and `num_steps` steps of the shape within
// TraceCounts(); the error names the dimension and the limit. Sizes below 1 are not checked
// here. Readers and importers call it before they allocate the steps.
Status CheckTraceShape(int64_t num_layers, int64_t num_experts, int64_t num_sources,
                       int64_t num_steps = 1);

// "read as megatron (the format guessed ...)": the context of an error in a trace whose format
// was guessed, so that a wrong guess is seen as one.
std::string GuessedFormatContext(TraceFormat guessed);

Result<Trace> ReadKeelTrace(const std::string& path);
Status WriteKeelTrace(const Trace& trace, const std::string& path);

// The two line kinds of a Keel trace, for writers that emit it incrementally (the trace
// recorder). The header line describes `shape` (its steps are ignored); a step line holds
// counts: [num_layers * row_size] of `shape`, and the step's sequences when given. Both end
// with '\n'.
Result<std::string> KeelTraceHeaderLine(const Trace& shape);
void AppendKeelTraceStepLine(const Trace& shape, int64_t step_id, std::span<const double> counts,
                             std::string& out,
                             const std::vector<TraceSequence>* sequences = nullptr);

}  // namespace keel
