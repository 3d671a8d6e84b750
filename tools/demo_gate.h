// The gate of `keel demo`: each rank's top-k expert ids per (step, layer), drawn from the
// per-expert counts of a synthetic or recorded routing trace.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "keel/status.hpp"
#include "monitor/trace.h"
#include "tools/demo_model.h"

namespace keel::tools {

// Where each rank's top-k expert ids come from: per (step, layer, rank) expert counts of a
// routing trace, turned into ids by DrawTopkIds. A synthetic trace (monitor/trace.h's Zipf
// generator with drifting popularity and bursts) has one source per rank with exactly tokens ·
// top_k selections each; a recorded trace is replayed in a loop over its steps, its per-source
// row when it has one source per rank, else its per-expert totals, scaled to tokens · top_k.
class TokenGate {
 public:
  // `options` carries the seed, zipf exponent and the shape (steps, layers, experts, top-k,
  // tokens per source); num_sources must be the number of ranks.
  static Result<TokenGate> Synthetic(const SyntheticTraceOptions& options);
  // Fails when the trace's layers or experts differ from the model's.
  static Result<TokenGate> FromTrace(Trace trace, const DemoModelOptions& model, int ranks);

  // topk_ids: [tokens, top_k] int32 of `rank` at (step, layer).
  void Draw(int64_t step, int layer, int rank, std::span<int32_t> topk_ids) const;
  // [experts] selection counts Draw uses.
  std::vector<int64_t> Counts(int64_t step, int layer, int rank) const;
  const std::string& description() const { return trace_.description; }
  int num_layers() const { return trace_.num_layers; }

 private:
  TokenGate(Trace trace, int ranks, int tokens, int top_k, uint64_t seed);

  Trace trace_;
  int ranks_;
  int tokens_;
  int top_k_;
  uint64_t seed_;
};

}  // namespace keel::tools
