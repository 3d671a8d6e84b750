// The gate of `keel demo` (tools/demo_gate.h).
#include "tools/demo_gate.h"

#include <utility>

namespace keel::tools {

Result<TokenGate> TokenGate::Synthetic(const SyntheticTraceOptions& options) {
  KEEL_ASSIGN_OR_RETURN(Trace trace, GenerateSyntheticTrace(options));
  return TokenGate(std::move(trace), options.num_sources, options.tokens_per_source, options.top_k,
                   options.seed);
}

Result<TokenGate> TokenGate::FromTrace(Trace trace, const DemoModelOptions& model, int ranks) {
  KEEL_RETURN_IF_ERROR(trace.Validate());
  if (trace.num_steps() == 0) return InvalidArgument("trace has no steps");
  if (trace.num_layers != model.layers || trace.num_experts != model.experts) {
    return InvalidArgument("trace has " + std::to_string(trace.num_layers) + " layers x " +
                           std::to_string(trace.num_experts) + " experts, the model " +
                           std::to_string(model.layers) + " x " + std::to_string(model.experts));
  }
  return TokenGate(std::move(trace), ranks, model.tokens, model.top_k, model.seed);
}

TokenGate::TokenGate(Trace trace, int ranks, int tokens, int top_k, uint64_t seed)
    : trace_(std::move(trace)), ranks_(ranks), tokens_(tokens), top_k_(top_k), seed_(seed) {}

std::vector<int64_t> TokenGate::Counts(int64_t step, int layer, int rank) const {
  const int trace_step = static_cast<int>(step % trace_.num_steps());
  const int64_t total = static_cast<int64_t>(tokens_) * top_k_;
  std::vector<double> loads;
  if (trace_.num_sources == ranks_) {
    const std::span<const double> row = trace_.layer_row(trace_step, layer);
    loads.assign(row.begin() + static_cast<size_t>(rank) * trace_.num_experts,
                 row.begin() + static_cast<size_t>(rank + 1) * trace_.num_experts);
  } else {
    loads = trace_.ExpertCounts(trace_step, layer);
  }
  // A synthetic trace's row is already exact; keep it so.
  double sum = 0;
  bool integral = true;
  for (double load : loads) {
    sum += load;
    integral = integral && load == static_cast<double>(static_cast<int64_t>(load));
  }
  if (integral && sum == static_cast<double>(total)) {
    return std::vector<int64_t>(loads.begin(), loads.end());
  }
  return ScaleCounts(loads, total);
}

void TokenGate::Draw(int64_t step, int layer, int rank, std::span<int32_t> topk_ids) const {
  const std::vector<int64_t> counts = Counts(step, layer, rank);
  const uint64_t words[] = {seed_, 4, static_cast<uint64_t>(step), static_cast<uint64_t>(layer),
                            static_cast<uint64_t>(rank)};
  DrawTopkIds(counts, tokens_, top_k_, MixSeed(words), topk_ids);
}

}  // namespace keel::tools
