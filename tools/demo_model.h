// The math of `keel demo`'s small Mixture-of-Experts model, as pure functions over raw float
// buffers: FFN experts (forward, backward with int64 fixed-point weight gradients), Adam, the
// teacher the model learns, seeded inputs and weights, and the gate that turns per-expert token
// counts into top-k expert ids. Every row is computed alone with plain loops in a fixed order, so
// its result never depends on the other rows of its batch or on the rank that computes it; with
// gradients summed as integers, training is bitwise identical under every placement.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "common/random.h"
#include "keel/shard_layout.hpp"
#include "keel/status.hpp"

namespace keel::tools {

// One expert's FFN: y = W2 · relu(W1 · x), x and y of `hidden` floats. An expert's weights are
// one buffer of weight_floats() float32: [W1: ffn × hidden][W2: hidden × ffn], row-major.
struct FfnShape {
  int hidden = 32;
  int ffn = 64;

  size_t weight_floats() const { return 2 * static_cast<size_t>(hidden) * ffn; }
  // The engine's ExpertShape for this FFN: float32 weights, int64 fixed-point gradients, Adam's
  // [m, v] as float32.
  size_t weight_bytes() const { return weight_floats() * sizeof(float); }
  size_t gradient_bytes() const { return weight_floats() * sizeof(int64_t); }
  size_t optimizer_bytes() const { return 2 * weight_floats() * sizeof(float); }
};

// Weight gradients are int64 fixed point: each per-element product dy_i · a_j (and dh_f · x_j) is
// rounded to the nearest integer multiple of 2^-32 and added. Integer addition is associative, so
// the sum does not depend on how an expert's rows are split among copies and ranks. Products are
// saturated at ±2^50 units (never reached by the demo's magnitudes) so no conversion overflows.
inline constexpr double kGradientScale = 4294967296.0;  // 2^32
int64_t ToFixedPoint(double value);

// A splitmix64 stream: fully specified, so the same seed draws the same numbers everywhere
// (std:: distributions differ between standard libraries).
class RandomStream {
 public:
  explicit RandomStream(uint64_t seed) : state_(seed) {}
  uint64_t Next() { return SplitMix64(state_); }
  // Uniform in [-1, 1) with 24 bits: exact in float.
  float Symmetric() {
    return static_cast<float>(static_cast<int32_t>(Next() >> 40) - (1 << 23)) * 0x1.0p-23f;
  }
  // Uniform in [0, n), n >= 1 (multiply-shift; the bias is below 2^-32 and the same everywhere).
  uint64_t Below(uint64_t n) { return ((Next() >> 32) * n) >> 32; }
  // Uniform in [0, 1) with 53 bits.
  double Unit() { return static_cast<double>(Next() >> 11) * 0x1.0p-53; }

 private:
  uint64_t state_;
};

// A 64-bit seed mixed from several words (splitmix64 over each): the same words give the same
// seed on every machine.
uint64_t MixSeed(std::span<const uint64_t> words);

// Expert `expert` of layer `layer`'s initial weights ([shape.weight_floats()] float32): W1
// uniform in ±1/sqrt(hidden), W2 uniform in ±0.5/sqrt(ffn), drawn from (seed, layer, expert).
// Every copy of an expert starts from these bits.
void InitExpertWeights(const FfnShape& shape, uint64_t seed, int layer, int expert,
                       std::span<float> weights);

// Shard `index` of `shards` of one expert: the FFN's inner dimension split into equal slices, so
// that the shard is itself an FFN of ShardShape(full, shards) (W1's rows and W2's columns of its
// slice) and the shards' outputs sum to the expert's. `full` must divide: ffn % shards == 0.
// full_weights: [full.weight_floats()], shard_weights: [ShardShape(...).weight_floats()].
FfnShape ShardShape(const FfnShape& full, int shards);
void SliceExpertWeights(const FfnShape& full, int shards, int index,
                        std::span<const float> full_weights, std::span<float> shard_weights);
// The inverse: writes shard `index`'s slice into the full expert's weights.
void PlaceShardWeights(const FfnShape& full, int shards, int index,
                       std::span<const float> shard_weights, std::span<float> full_weights);
// The engine's ShardLayout for this FFN, the cut SliceExpertWeights makes: W1's rows and W2's
// columns, in the weights and in each of Adam's m and v.
ShardLayout FfnShardLayout(const FfnShape& shape);

// The model inputs of one rank's step: [num_tokens, hidden] float32 uniform in [-1, 1), drawn
// from (seed, rank, step).
void DrawTokenInputs(uint64_t seed, int rank, int64_t step, std::span<float> inputs);

// The teacher the model learns: target = A · x with A = I + N / sqrt(hidden), N uniform in ±1,
// drawn from the seed. [hidden, hidden] float32.
std::vector<float> MakeTeacher(int hidden, uint64_t seed);
// targets[t] = teacher · inputs[t]; inputs and targets [num_tokens, hidden] float32.
void TeacherTargets(int hidden, std::span<const float> teacher, std::span<const float> inputs,
                    std::span<float> targets);

// One row through one expert. x: [hidden], y: [hidden] (written), activation: [ffn] written with
// relu(W1 · x), which the backward needs.
void ExpertForward(const FfnShape& shape, const float* weights, const float* x, float* y,
                   float* activation);

// One row back through one expert. x, activation: the row's forward input and activation; dy:
// [hidden] the gradient at the expert output (gate already applied). Adds the row's weight
// gradient into gradient ([weight_floats()] int64 fixed point, layout of the weights) and writes
// dx ([hidden], gradient at the expert input). scratch: [ffn] floats.
void ExpertBackward(const FfnShape& shape, const float* weights, const float* x,
                    const float* activation, const float* dy, int64_t* gradient, float* dx,
                    float* scratch);

// Residual combine of one token: out = x + Σ_k gate · expert_out[k], summed in k order.
// x, out: [hidden]; expert_out: [top_k, hidden].
void CombineRow(int hidden, int top_k, float gate, const float* x, const float* expert_out,
                float* out);

// The loss of one token: Σ_i (out_i - target_i)² / hidden, returned; d_out ([hidden]) is written
// with its gradient 2 (out - target) / hidden. The step's loss is the mean over all tokens of all
// ranks, so weight gradients are divided by the global token count in AdamUpdate.
double RowLoss(int hidden, const float* out, const float* target, float* d_out);

// Adam with bias correction on one home: weights and optimizer ([m: weight_floats()][v:
// weight_floats()] float32) updated in place from the fixed-point gradient, divided by
// kGradientScale and `tokens` (the step's global token count). `step` counts from 1.
struct AdamOptions {
  double learning_rate = 3e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double epsilon = 1e-8;
};
void AdamUpdate(const AdamOptions& adam, int64_t step, double tokens,
                std::span<const int64_t> gradient, std::span<float> weights,
                std::span<float> optimizer);

// The model and its training run, the same on every rank.
struct DemoModelOptions {
  int layers = 4;
  int experts = 32;
  int top_k = 2;
  int tokens = 4096;  // per rank per step
  FfnShape ffn;
  int steps = 40;
  uint64_t seed = 1;
  AdamOptions adam;
};

// The final weights of every expert from the pieces the ranks hold: each rank appends each piece
// it owns (a whole expert, shards = 1, or shard `shard` of `shards`: SliceExpertWeights' slice)
// to a string, the ranks all-gather their strings, and AssembleExpertWeights puts every piece in
// its place: [layers, experts, ffn.weight_floats()]. It fails when an expert misses a piece or a
// record is malformed.
void AppendExpertPiece(int layer, int expert, int shard, int shards, std::span<const float> piece,
                       std::string& out);
Result<std::vector<float>> AssembleExpertWeights(const DemoModelOptions& model,
                                                 std::span<const std::string> pieces);

// The gate: turns one rank's per-expert selection counts of one (step, layer) into top-k expert
// ids [num_tokens, top_k] int32 with exactly those counts (counts must sum to num_tokens *
// top_k). Ids are shuffled over (token, k) from `seed`; a token that drew the same expert twice
// swaps with another position when that helps, so tokens mostly pick distinct experts.
void DrawTopkIds(std::span<const int64_t> expert_counts, int num_tokens, int top_k, uint64_t seed,
                 std::span<int32_t> topk_ids);

// Scales non-negative per-expert loads to integer counts summing to `total` (largest remainder,
// ties to the lower expert id); all-zero loads spread evenly.
std::vector<int64_t> ScaleCounts(std::span<const double> loads, int64_t total);

}  // namespace keel::tools
