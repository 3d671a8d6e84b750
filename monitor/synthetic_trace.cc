// The seeded synthetic trace generator: Zipf popularity over a drifting permutation of experts,
// occasional bursts, and per-source top-k sampling. Everything after the Zipf weights runs in
// integer arithmetic on our own PRNG, so a seed gives the same trace on every machine.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "common/number_text.h"
#include "common/random.h"
#include "monitor/trace.h"

namespace keel {
namespace {

// xoshiro256** seeded through splitmix64: small, fast and fully specified, unlike the std::
// distributions whose output differs between standard libraries.
class Random {
 public:
  explicit Random(uint64_t seed) {
    for (uint64_t& word : state_) word = SplitMix64(seed);
  }

  uint64_t Next() {
    const uint64_t result = Rotl(state_[1] * 5, 7) * 9;
    const uint64_t t = state_[1] << 17;
    state_[2] ^= state_[0];
    state_[3] ^= state_[1];
    state_[1] ^= state_[2];
    state_[0] ^= state_[3];
    state_[2] ^= t;
    state_[3] = Rotl(state_[3], 45);
    return result;
  }

  uint32_t Next32() {
    if (have_half_) {
      have_half_ = false;
      return static_cast<uint32_t>(half_);
    }
    half_ = Next();
    have_half_ = true;
    return static_cast<uint32_t>(half_ >> 32);
  }

  // Uniform in [0, n) without bias (Lemire's multiply-shift with rejection); n >= 1.
  uint32_t Below(uint32_t n) {
    uint64_t product = uint64_t{Next32()} * n;
    uint32_t low = static_cast<uint32_t>(product);
    if (low < n) {
      const uint32_t threshold = static_cast<uint32_t>(-n) % n;
      while (low < threshold) {
        product = uint64_t{Next32()} * n;
        low = static_cast<uint32_t>(product);
      }
    }
    return static_cast<uint32_t>(product >> 32);
  }

  // Uniform in [0, 1) with 53 bits.
  double Uniform() { return static_cast<double>(Next() >> 11) * 0x1.0p-53; }

 private:
  static uint64_t Rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }
  uint64_t state_[4];
  uint64_t half_ = 0;
  bool have_half_ = false;
};

// Walker's alias table over integer weights: one uniform column and one uniform threshold per
// draw, exact integer arithmetic throughout.
class AliasTable {
 public:
  // weights: [n] positive, sum below 2^32.
  void Build(const std::vector<uint32_t>& weights) {
    const size_t n = weights.size();
    total_ = 0;
    for (uint32_t weight : weights) total_ += weight;
    threshold_.assign(n, 0);
    alias_.assign(n, 0);
    scaled_.resize(n);
    small_.clear();
    large_.clear();
    for (size_t i = 0; i < n; ++i) {
      scaled_[i] = uint64_t{weights[i]} * n;
      (scaled_[i] < total_ ? small_ : large_).push_back(static_cast<uint32_t>(i));
    }
    while (!small_.empty() && !large_.empty()) {
      uint32_t little = small_.back();
      small_.pop_back();
      uint32_t big = large_.back();
      threshold_[little] = static_cast<uint32_t>(scaled_[little]);
      alias_[little] = big;
      scaled_[big] -= total_ - scaled_[little];
      if (scaled_[big] < total_) {
        large_.pop_back();
        small_.push_back(big);
      }
    }
    for (uint32_t i : large_) threshold_[i] = static_cast<uint32_t>(total_), alias_[i] = i;
    for (uint32_t i : small_) threshold_[i] = static_cast<uint32_t>(total_), alias_[i] = i;
  }

  // One 64-bit draw: the high half picks the column, the low half the side of its threshold
  // (multiply-shift; the bias is below 2^-32 and the same everywhere).
  static uint32_t Draw(uint64_t bits, uint64_t size, uint64_t total, const uint32_t* threshold,
                       const uint32_t* alias) {
    const uint32_t column = static_cast<uint32_t>(((bits >> 32) * size) >> 32);
    const uint64_t roll = ((bits & 0xffffffffULL) * total) >> 32;
    return roll < threshold[column] ? column : alias[column];
  }
  uint64_t size() const { return threshold_.size(); }
  uint64_t total() const { return total_; }
  const uint32_t* threshold() const { return threshold_.data(); }
  const uint32_t* alias() const { return alias_.data(); }

 private:
  uint64_t total_ = 0;
  std::vector<uint32_t> threshold_;
  std::vector<uint32_t> alias_;
  std::vector<uint64_t> scaled_;
  std::vector<uint32_t> small_;
  std::vector<uint32_t> large_;
};

bool Contains(const uint32_t* picked, int count, uint32_t expert) {
  for (int i = 0; i < count; ++i) {
    if (picked[i] == expert) return true;
  }
  return false;
}

// Draws one expert by a linear scan over the weights of experts not yet picked for this token.
// Used only when the alias table keeps hitting picked experts (very skewed weights).
uint32_t DrawExcluding(Random& random, const std::vector<uint32_t>& weights, const uint32_t* picked,
                       int count) {
  uint64_t remaining = 0;
  for (size_t e = 0; e < weights.size(); ++e) {
    if (!Contains(picked, count, static_cast<uint32_t>(e))) remaining += weights[e];
  }
  uint64_t roll = random.Below(static_cast<uint32_t>(remaining));
  for (size_t e = 0; e < weights.size(); ++e) {
    if (Contains(picked, count, static_cast<uint32_t>(e))) continue;
    if (roll < weights[e]) return static_cast<uint32_t>(e);
    roll -= weights[e];
  }
  return static_cast<uint32_t>(weights.size() - 1);  // not reached: roll < remaining
}

// Routes `tokens` tokens of one source, each to `top_k` distinct experts, adding into
// counts[expert]. `picked` is scratch of at least top_k entries.
void SampleSource(Random& random, const AliasTable& table, const std::vector<uint32_t>& weights,
                  int tokens, int top_k, uint32_t* counts, uint32_t* picked) {
  Random local = random;  // a local copy lets the compiler keep the state in registers
  const uint64_t size = table.size();
  const uint64_t total = table.total();
  const uint32_t* threshold = table.threshold();
  const uint32_t* alias = table.alias();
  for (int token = 0; token < tokens; ++token) {
    for (int k = 0; k < top_k; ++k) {
      uint32_t expert = AliasTable::Draw(local.Next(), size, total, threshold, alias);
      // Redraw duplicates: the same as drawing from the experts not yet picked.
      for (int attempt = 0; Contains(picked, k, expert); ++attempt) {
        expert = attempt < 8 ? AliasTable::Draw(local.Next(), size, total, threshold, alias)
                             : DrawExcluding(local, weights, picked, k);
      }
      picked[k] = expert;
      ++counts[expert];
    }
  }
  random = local;
}

struct Burst {
  int expert = 0;
  int steps_left = 0;
};

Status ValidateOptions(const SyntheticTraceOptions& o) {
  auto bad = [](const std::string& field, const std::string& value, const std::string& rule) {
    return InvalidArgument("synthetic trace: " + field + " " + value + " " + rule);
  };
  if (o.num_steps < 1) return bad("num_steps", std::to_string(o.num_steps), "must be >= 1");
  if (o.num_layers < 1) return bad("num_layers", std::to_string(o.num_layers), "must be >= 1");
  if (o.num_experts < 1 || o.num_experts > kMaxExperts) {
    return bad("num_experts", std::to_string(o.num_experts),
               "must be in 1.." + std::to_string(kMaxExperts));
  }
  if (o.num_sources < 0 || o.num_sources > kMaxRanks) {
    return bad("num_sources", std::to_string(o.num_sources),
               "must be in 0.." + std::to_string(kMaxRanks));
  }
  if (o.tokens_per_source < 1) {
    return bad("tokens_per_source", std::to_string(o.tokens_per_source), "must be >= 1");
  }
  if (o.top_k < 1 || o.top_k > o.num_experts) {
    return bad("top_k", std::to_string(o.top_k),
               "must be in 1..num_experts (" + std::to_string(o.num_experts) + ")");
  }
  if (!std::isfinite(o.zipf_exponent) || o.zipf_exponent < 0.0 || o.zipf_exponent > 10.0) {
    return bad("zipf_exponent", NumberText(o.zipf_exponent), "must be in [0, 10]");
  }
  if (!std::isfinite(o.drift_swaps_per_step) || o.drift_swaps_per_step < 0.0 ||
      o.drift_swaps_per_step > 1e6) {
    return bad("drift_swaps_per_step", NumberText(o.drift_swaps_per_step), "must be in [0, 1e6]");
  }
  if (!(o.burst_probability >= 0.0 && o.burst_probability <= 1.0)) {
    return bad("burst_probability", NumberText(o.burst_probability), "must be in [0, 1]");
  }
  if (!std::isfinite(o.burst_factor) || o.burst_factor <= 0.0 || o.burst_factor > 1e6) {
    return bad("burst_factor", NumberText(o.burst_factor), "must be in (0, 1e6]");
  }
  if (o.burst_steps < 1) return bad("burst_steps", std::to_string(o.burst_steps), "must be >= 1");
  if (o.num_layers > kMaxLayers) {
    return bad("num_layers", std::to_string(o.num_layers),
               "must be in 1.." + std::to_string(kMaxLayers));
  }
  const double row = static_cast<double>(o.num_experts) * std::max(o.num_sources, 1);
  const double step_layers = static_cast<double>(o.num_steps) * o.num_layers;
  KEEL_ASSIGN_OR_RETURN(const TraceCountLimit limit, TraceCounts());
  if (step_layers * row > static_cast<double>(limit.counts)) {
    return InvalidArgument("synthetic trace: num_steps * num_layers * num_sources * num_experts " +
                           NumberText(step_layers * row) + " counts is more than " + limit.text);
  }
  // The generator's work, bounded to about half a minute: every selection is a draw, every swap
  // and every running burst a step of its own per layer and step.
  constexpr double kMaxDraws = 1 << 30;
  const double selections =
      step_layers * std::max(o.num_sources, 1) * o.tokens_per_source * o.top_k;
  if (selections > kMaxDraws) {
    return InvalidArgument("synthetic trace: " + NumberText(selections) +
                           " token selections (steps * layers * sources * tokens * top_k) is "
                           "more than 2^30");
  }
  if (step_layers * o.drift_swaps_per_step > kMaxDraws) {
    return InvalidArgument("synthetic trace: " + NumberText(step_layers * o.drift_swaps_per_step) +
                           " popularity swaps (steps * layers * drift_swaps_per_step) is more "
                           "than 2^30");
  }
  const double running = std::min(o.num_steps, o.burst_steps) * o.burst_probability;
  if (step_layers * running > kMaxDraws) {
    return InvalidArgument("synthetic trace: about " + NumberText(step_layers * running) +
                           " burst updates (steps * layers * min(steps, burst_steps) * "
                           "burst_probability) is more than 2^30");
  }
  return Status::Ok();
}

// Turns real weights into integers that sum to about 2^31 (each at least 1), so sampling is
// exact integer arithmetic. Only the Zipf powers come from libm.
void Quantize(const std::vector<double>& weights, std::vector<uint32_t>& out) {
  double sum = 0.0;
  for (double weight : weights) sum += weight;
  out.resize(weights.size());
  for (size_t e = 0; e < weights.size(); ++e) {
    double scaled = std::floor(weights[e] / sum * 2147483648.0 + 0.5);
    out[e] = static_cast<uint32_t>(std::clamp(scaled, 1.0, 2147483648.0));
  }
}

}  // namespace

Result<Trace> GenerateSyntheticTrace(const SyntheticTraceOptions& options) {
  KEEL_RETURN_IF_ERROR(ValidateOptions(options));
  const int num_experts = options.num_experts;
  const int sampled_sources = std::max(options.num_sources, 1);
  const int top_k = options.top_k;

  Trace trace;
  trace.num_layers = options.num_layers;
  trace.num_experts = num_experts;
  trace.num_sources = options.num_sources;
  trace.description =
      "synthetic: seed " + std::to_string(options.seed) + ", zipf " +
      NumberText(options.zipf_exponent) + ", drift " + NumberText(options.drift_swaps_per_step) +
      " swaps/step, bursts p=" + NumberText(options.burst_probability) + " x" +
      NumberText(options.burst_factor) + " for " + std::to_string(options.burst_steps) +
      " steps, " + std::to_string(options.tokens_per_source) + " tokens per source, top-" +
      std::to_string(top_k);
  const size_t row_size = static_cast<size_t>(trace.row_size());
  trace.steps.assign(options.num_steps, std::vector<double>(row_size * options.num_layers, 0.0));
  for (int step = 0; step < options.num_steps; ++step) trace.step_ids.push_back(step);

  std::vector<double> zipf(num_experts);
  for (int position = 0; position < num_experts; ++position) {
    zipf[position] = 1.0 / std::pow(static_cast<double>(position + 1), options.zipf_exponent);
  }
  const int whole_swaps = static_cast<int>(options.drift_swaps_per_step);
  const double extra_swap = options.drift_swaps_per_step - whole_swaps;

  std::vector<double> weights(num_experts);
  std::vector<uint32_t> quantized;
  std::vector<uint32_t> picked(top_k);
  std::vector<uint32_t> counts(row_size);
  AliasTable table;
  // Each layer has its own stream, so adding layers or steps leaves the existing ones unchanged.
  for (int layer = 0; layer < options.num_layers; ++layer) {
    uint64_t mix = options.seed ^ (0x5851f42d4c957f2dULL * static_cast<uint64_t>(layer + 1));
    Random random(SplitMix64(mix));
    // permutation[position] = expert holding that popularity rank.
    std::vector<int> permutation(num_experts);
    for (int e = 0; e < num_experts; ++e) permutation[e] = e;
    for (int i = num_experts - 1; i > 0; --i) {
      std::swap(permutation[i], permutation[random.Below(static_cast<uint32_t>(i + 1))]);
    }
    std::vector<Burst> bursts;
    for (int step = 0; step < options.num_steps; ++step) {
      int swaps = whole_swaps + (random.Uniform() < extra_swap ? 1 : 0);
      for (int s = 0; s < swaps && num_experts > 1; ++s) {
        uint32_t position = random.Below(static_cast<uint32_t>(num_experts - 1));
        std::swap(permutation[position], permutation[position + 1]);
      }
      if (random.Uniform() < options.burst_probability) {
        bursts.push_back({static_cast<int>(random.Below(static_cast<uint32_t>(num_experts))),
                          options.burst_steps});
      }
      for (int position = 0; position < num_experts; ++position) {
        weights[permutation[position]] = zipf[position];
      }
      for (Burst& burst : bursts) {
        weights[burst.expert] *= options.burst_factor;
        --burst.steps_left;
      }
      std::erase_if(bursts, [](const Burst& burst) { return burst.steps_left <= 0; });
      Quantize(weights, quantized);
      table.Build(quantized);

      std::fill(counts.begin(), counts.end(), 0);
      for (int source = 0; source < sampled_sources; ++source) {
        uint32_t* source_counts = counts.data() + static_cast<size_t>(source) * num_experts *
                                                      (options.num_sources > 0 ? 1 : 0);
        SampleSource(random, table, quantized, options.tokens_per_source, top_k, source_counts,
                     picked.data());
      }
      double* out = trace.steps[step].data() + static_cast<size_t>(layer) * row_size;
      for (size_t i = 0; i < row_size; ++i) out[i] = counts[i];
    }
  }
  return trace;
}

}  // namespace keel
