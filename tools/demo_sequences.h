// `keel demo`'s sequences, for Luffy's sequence migration and token condensation: each rank's
// tokens come in sequences, and each sequence has what real ones have, a topic (a block of
// experts its tokens prefer in every layer) and repeated tokens (exact and near copies of earlier
// tokens, routed like them). A sequence is drawn from (seed, step, origin rank, index), so any
// rank that runs it draws the same routing, and its inputs can move to another rank.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "tools/demo_gate.h"
#include "tools/demo_model.h"

namespace keel::tools {

struct SequenceWorkload {
  int tokens_per_sequence = 256;
  // Share of a sequence's (token, k) choices drawn from its topic's experts; the rest follow the
  // rank's counts of the token gate (its Zipf skew, drift and bursts).
  double affinity = 0.7;
  // Share of tokens that repeat an earlier token of their sequence (at most 8 tokens back): half
  // exact copies, half near copies (each element moved by at most 1e-3). A repeat is routed like
  // the token it repeats.
  double repeat = 0;
};

class SequenceGate {
 public:
  // `gate` gives each rank's expert counts per (step, layer); it must outlive this. Topics are
  // contiguous blocks of experts / ranks experts (one per rank's share of the static placement).
  SequenceGate(const SequenceWorkload& workload, const TokenGate& gate,
               const DemoModelOptions& model, int ranks);

  int tokens_per_sequence() const { return workload_.tokens_per_sequence; }
  int sequences_per_rank() const { return model_.tokens / workload_.tokens_per_sequence; }

  // inputs: [tokens_per_sequence, hidden] float32, written.
  void DrawInputs(int64_t step, int origin_rank, int index, std::span<float> inputs) const;
  // topk_ids: [layers, tokens_per_sequence, top_k] int32, written.
  void DrawRouting(int64_t step, int origin_rank, int index, std::span<int32_t> topk_ids) const;
  // [layers * experts] int32: the rows `topk_ids` (as DrawRouting writes them) send to each
  // expert in each layer, as Engine::PlanSequences takes them.
  std::vector<int32_t> ExpertRows(std::span<const int32_t> topk_ids) const;

 private:
  // Which earlier token each token repeats (-1: none) and whether the copy is near, not exact.
  struct Repeats {
    std::vector<int> source;
    std::vector<bool> near;
  };
  Repeats DrawRepeats(int64_t step, int origin_rank, int index) const;
  uint64_t Seed(uint64_t purpose, int64_t step, int origin_rank, int index) const;

  SequenceWorkload workload_;
  const TokenGate& gate_;
  DemoModelOptions model_;
  int ranks_;
};

}  // namespace keel::tools
