// SequenceGate: repeats first (shared by inputs and routing), then fresh inputs and copies, and
// per layer each fresh token's top-k from its topic's block or the rank's counts.
#include "tools/demo_sequences.h"

#include <algorithm>

namespace keel::tools {

SequenceGate::SequenceGate(const SequenceWorkload& workload, const TokenGate& gate,
                           const DemoModelOptions& model, int ranks)
    : workload_(workload), gate_(gate), model_(model), ranks_(ranks) {}

uint64_t SequenceGate::Seed(uint64_t purpose, int64_t step, int origin_rank, int index) const {
  const uint64_t words[] = {model_.seed, purpose, static_cast<uint64_t>(step),
                            static_cast<uint64_t>(origin_rank), static_cast<uint64_t>(index)};
  return MixSeed(words);
}

SequenceGate::Repeats SequenceGate::DrawRepeats(int64_t step, int origin_rank, int index) const {
  const int tokens = workload_.tokens_per_sequence;
  Repeats repeats{std::vector<int>(tokens, -1), std::vector<bool>(tokens, false)};
  RandomStream stream(Seed(11, step, origin_rank, index));
  for (int t = 1; t < tokens; ++t) {
    if (stream.Unit() >= workload_.repeat) continue;
    repeats.source[t] = t - 1 - static_cast<int>(stream.Below(std::min(t, 8)));
    repeats.near[t] = stream.Below(2) == 1;
  }
  return repeats;
}

void SequenceGate::DrawInputs(int64_t step, int origin_rank, int index,
                              std::span<float> inputs) const {
  const int hidden = model_.ffn.hidden;
  const Repeats repeats = DrawRepeats(step, origin_rank, index);
  RandomStream stream(Seed(12, step, origin_rank, index));
  for (int t = 0; t < workload_.tokens_per_sequence; ++t) {
    float* row = inputs.data() + static_cast<size_t>(t) * hidden;
    const int source = repeats.source[t];
    for (int h = 0; h < hidden; ++h) {
      row[h] = source < 0 ? stream.Symmetric()
                          : inputs[static_cast<size_t>(source) * hidden + h] +
                                (repeats.near[t] ? 1e-3f * stream.Symmetric() : 0.0f);
    }
  }
}

void SequenceGate::DrawRouting(int64_t step, int origin_rank, int index,
                               std::span<int32_t> topk_ids) const {
  const int tokens = workload_.tokens_per_sequence;
  const int top_k = model_.top_k;
  const int experts = model_.experts;
  const Repeats repeats = DrawRepeats(step, origin_rank, index);
  RandomStream stream(Seed(13, step, origin_rank, index));
  // The topic: one rank's share of the experts, in every layer.
  const int topic = static_cast<int>(stream.Below(static_cast<uint64_t>(ranks_)));
  const int width = std::max(1, experts / ranks_);
  const int block = (topic * width) % experts;
  std::vector<double> cumulative(experts);
  for (int l = 0; l < model_.layers; ++l) {
    const std::vector<int64_t> counts = gate_.Counts(step, l, origin_rank);
    double sum = 0;
    for (int e = 0; e < experts; ++e) cumulative[e] = sum += static_cast<double>(counts[e]);
    auto from_counts = [&] {
      if (sum <= 0) return static_cast<int32_t>(stream.Below(experts));
      const double at = stream.Unit() * sum;
      return static_cast<int32_t>(std::upper_bound(cumulative.begin(), cumulative.end(), at) -
                                  cumulative.begin());
    };
    int32_t* layer_ids = topk_ids.data() + static_cast<size_t>(l) * tokens * top_k;
    for (int t = 0; t < tokens; ++t) {
      int32_t* ids = layer_ids + static_cast<size_t>(t) * top_k;
      if (repeats.source[t] >= 0) {
        std::copy_n(layer_ids + static_cast<size_t>(repeats.source[t]) * top_k, top_k, ids);
        continue;
      }
      for (int k = 0; k < top_k; ++k) {
        // A token's choices are distinct experts when a few draws allow it.
        for (int attempt = 0; attempt < 4; ++attempt) {
          ids[k] = stream.Unit() < workload_.affinity
                       ? static_cast<int32_t>((block + stream.Below(width)) % experts)
                       : std::min<int32_t>(from_counts(), experts - 1);
          if (std::find(ids, ids + k, ids[k]) == ids + k) break;
        }
      }
    }
  }
}

std::vector<int32_t> SequenceGate::ExpertRows(std::span<const int32_t> topk_ids) const {
  const size_t per_layer = static_cast<size_t>(workload_.tokens_per_sequence) * model_.top_k;
  std::vector<int32_t> rows(static_cast<size_t>(model_.layers) * model_.experts, 0);
  for (int l = 0; l < model_.layers; ++l) {
    for (size_t i = 0; i < per_layer; ++i) {
      ++rows[static_cast<size_t>(l) * model_.experts + topk_ids[l * per_layer + i]];
    }
  }
  return rows;
}

}  // namespace keel::tools
