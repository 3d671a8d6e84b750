// `keel demo`'s model math: the FFN forward against a double-precision reference, the backward
// against finite differences, fixed-point gradients that are bitwise independent of how rows are
// split among copies, Adam's first step, seeded initialization, and the gate's exact counts.
#include "tools/demo_model.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <string>
#include <vector>

namespace keel::tools {
namespace {

constexpr FfnShape kShape{12, 20};  // sizes that leave tails after the 8-lane partial sums

std::vector<float> Weights(const FfnShape& shape, int expert) {
  std::vector<float> weights(shape.weight_floats());
  InitExpertWeights(shape, 42, 1, expert, weights);
  return weights;
}

std::vector<float> Inputs(int hidden, int tokens, int rank = 0, int64_t step = 0) {
  std::vector<float> inputs(static_cast<size_t>(hidden) * tokens);
  DrawTokenInputs(42, rank, step, inputs);
  return inputs;
}

// y = W2 · relu(W1 · x) in double.
std::vector<double> ReferenceForward(const FfnShape& shape, const std::vector<float>& w,
                                     const float* x) {
  std::vector<double> a(shape.ffn);
  for (int f = 0; f < shape.ffn; ++f) {
    double h = 0;
    for (int j = 0; j < shape.hidden; ++j) h += double{w[f * shape.hidden + j]} * x[j];
    a[f] = std::max(h, 0.0);
  }
  std::vector<double> y(shape.hidden);
  const size_t w2 = static_cast<size_t>(shape.ffn) * shape.hidden;
  for (int i = 0; i < shape.hidden; ++i) {
    for (int f = 0; f < shape.ffn; ++f) y[i] += double{w[w2 + i * shape.ffn + f]} * a[f];
  }
  return y;
}

TEST(DemoModelTest, ShapeGivesTheEngineBufferSizes) {
  const FfnShape shape{32, 64};
  EXPECT_EQ(shape.weight_floats(), 2u * 32 * 64);
  EXPECT_EQ(shape.weight_bytes(), 2u * 32 * 64 * 4);
  EXPECT_EQ(shape.gradient_bytes(), 2u * 32 * 64 * 8);
  EXPECT_EQ(shape.optimizer_bytes(), 2u * 2 * 32 * 64 * 4);
}

TEST(DemoModelTest, ForwardMatchesDoubleReference) {
  const std::vector<float> w = Weights(kShape, 3);
  const std::vector<float> x = Inputs(kShape.hidden, 5);
  std::vector<float> y(kShape.hidden);
  std::vector<float> activation(kShape.ffn);
  for (int t = 0; t < 5; ++t) {
    const float* row = x.data() + t * kShape.hidden;
    ExpertForward(kShape, w.data(), row, y.data(), activation.data());
    const std::vector<double> expected = ReferenceForward(kShape, w, row);
    for (int i = 0; i < kShape.hidden; ++i) EXPECT_NEAR(y[i], expected[i], 1e-5) << t << " " << i;
    for (float a : activation) EXPECT_GE(a, 0.0f);
  }
}

// loss(w, x) = Σ_i (y_i - target_i)² / hidden for a fixed target, in double.
double ReferenceLoss(const FfnShape& shape, const std::vector<float>& w, const float* x,
                     const std::vector<double>& target) {
  const std::vector<double> y = ReferenceForward(shape, w, x);
  double loss = 0;
  for (int i = 0; i < shape.hidden; ++i) loss += (y[i] - target[i]) * (y[i] - target[i]);
  return loss / shape.hidden;
}

TEST(DemoModelTest, BackwardMatchesFiniteDifferences) {
  const std::vector<float> w = Weights(kShape, 5);
  const std::vector<float> x = Inputs(kShape.hidden, 1, 0, 9);
  std::vector<double> target(kShape.hidden);
  for (int i = 0; i < kShape.hidden; ++i) target[i] = 0.3 * std::sin(i);

  std::vector<float> y(kShape.hidden), activation(kShape.ffn), target_f(kShape.hidden);
  for (int i = 0; i < kShape.hidden; ++i) target_f[i] = static_cast<float>(target[i]);
  ExpertForward(kShape, w.data(), x.data(), y.data(), activation.data());
  std::vector<float> dy(kShape.hidden);
  RowLoss(kShape.hidden, y.data(), target_f.data(), dy.data());
  std::vector<int64_t> gradient(kShape.weight_floats(), 0);
  std::vector<float> dx(kShape.hidden), scratch(kShape.ffn);
  ExpertBackward(kShape, w.data(), x.data(), activation.data(), dy.data(), gradient.data(),
                 dx.data(), scratch.data());

  const double step = 1e-3;
  for (size_t p = 0; p < w.size(); p += 7) {
    std::vector<float> plus = w, minus = w;
    plus[p] += static_cast<float>(step);
    minus[p] -= static_cast<float>(step);
    const double numeric = (ReferenceLoss(kShape, plus, x.data(), target) -
                            ReferenceLoss(kShape, minus, x.data(), target)) /
                           (double{plus[p]} - double{minus[p]});
    EXPECT_NEAR(static_cast<double>(gradient[p]) / kGradientScale, numeric, 2e-4) << "weight " << p;
  }
  for (int j = 0; j < kShape.hidden; ++j) {
    std::vector<float> plus = x, minus = x;
    plus[j] += static_cast<float>(step);
    minus[j] -= static_cast<float>(step);
    const double numeric = (ReferenceLoss(kShape, w, plus.data(), target) -
                            ReferenceLoss(kShape, w, minus.data(), target)) /
                           (double{plus[j]} - double{minus[j]});
    EXPECT_NEAR(dx[j], numeric, 2e-4) << "input " << j;
  }
}

// Runs the backward of rows [begin, end) of `x` into `gradient`.
void Backward(const std::vector<float>& w, const std::vector<float>& x,
              const std::vector<float>& dy, const std::vector<int>& rows, size_t begin, size_t end,
              std::vector<int64_t>& gradient) {
  std::vector<float> y(kShape.hidden), activation(kShape.ffn), dx(kShape.hidden),
      scratch(kShape.ffn);
  for (size_t r = begin; r < end; ++r) {
    const float* row = x.data() + rows[r] * kShape.hidden;
    ExpertForward(kShape, w.data(), row, y.data(), activation.data());
    ExpertBackward(kShape, w.data(), row, activation.data(), dy.data() + rows[r] * kShape.hidden,
                   gradient.data(), dx.data(), scratch.data());
  }
}

TEST(DemoModelTest, FixedPointGradientIsIndependentOfHowRowsAreSplit) {
  const int tokens = 64;
  const std::vector<float> w = Weights(kShape, 7);
  const std::vector<float> x = Inputs(kShape.hidden, tokens, 1, 3);
  const std::vector<float> dy = Inputs(kShape.hidden, tokens, 2, 3);
  std::vector<int> rows(tokens);
  std::iota(rows.begin(), rows.end(), 0);

  std::vector<int64_t> whole(kShape.weight_floats(), 0);
  Backward(w, x, dy, rows, 0, tokens, whole);

  // Three copies take uneven shares of the rows in another order; their buffers are then added
  // (as ReduceGradients adds replica gradients into the home) in two different orders.
  std::reverse(rows.begin(), rows.end());
  std::rotate(rows.begin(), rows.begin() + 17, rows.end());
  std::vector<int64_t> a(whole.size(), 0), b(whole.size(), 0), c(whole.size(), 0);
  Backward(w, x, dy, rows, 0, 5, a);
  Backward(w, x, dy, rows, 5, 41, b);
  Backward(w, x, dy, rows, 41, tokens, c);
  std::vector<int64_t> abc(whole.size()), cba(whole.size());
  for (size_t i = 0; i < whole.size(); ++i) {
    abc[i] = (a[i] + b[i]) + c[i];
    cba[i] = c[i] + (b[i] + a[i]);
  }
  EXPECT_EQ(abc, whole);
  EXPECT_EQ(cba, whole);
  EXPECT_NE(std::count(whole.begin(), whole.end(), 0), static_cast<long>(whole.size()));
}

TEST(DemoModelTest, ShardsSumToTheExpertAndOwnTheirSliceOfItsGradient) {
  const std::vector<float> w = Weights(kShape, 5);
  const std::vector<float> x = Inputs(kShape.hidden, 1, 0, 4);
  const std::vector<float> dy = Inputs(kShape.hidden, 1, 1, 4);
  std::vector<float> y(kShape.hidden), activation(kShape.ffn), dx(kShape.hidden);
  std::vector<float> scratch(kShape.ffn);
  std::vector<int64_t> gradient(kShape.weight_floats(), 0);
  ExpertForward(kShape, w.data(), x.data(), y.data(), activation.data());
  ExpertBackward(kShape, w.data(), x.data(), activation.data(), dy.data(), gradient.data(),
                 dx.data(), scratch.data());
  // Which element of the full expert each shard element is: indices are exact in float.
  std::vector<float> index(kShape.weight_floats());
  std::iota(index.begin(), index.end(), 0.0f);

  for (const int shards : {1, 2, 4}) {
    const FfnShape shape = ShardShape(kShape, shards);
    std::vector<float> y_sum(kShape.hidden, 0.0f), dx_sum(kShape.hidden, 0.0f);
    std::vector<float> rebuilt(w.size(), 0.0f);
    for (int j = 0; j < shards; ++j) {
      std::vector<float> shard(shape.weight_floats()), at(shape.weight_floats());
      SliceExpertWeights(kShape, shards, j, w, shard);
      SliceExpertWeights(kShape, shards, j, index, at);
      PlaceShardWeights(kShape, shards, j, shard, rebuilt);
      std::vector<float> y_j(kShape.hidden), a_j(shape.ffn), dx_j(kShape.hidden);
      std::vector<float> scratch_j(shape.ffn);
      std::vector<int64_t> gradient_j(shape.weight_floats(), 0);
      ExpertForward(shape, shard.data(), x.data(), y_j.data(), a_j.data());
      ExpertBackward(shape, shard.data(), x.data(), a_j.data(), dy.data(), gradient_j.data(),
                     dx_j.data(), scratch_j.data());
      for (int f = 0; f < shape.ffn; ++f) EXPECT_EQ(a_j[f], activation[j * shape.ffn + f]);
      // The shard's weight gradient is the expert's, element for element, bit for bit.
      for (size_t i = 0; i < at.size(); ++i) {
        ASSERT_EQ(gradient_j[i], gradient[static_cast<size_t>(at[i])]) << shards << " " << i;
      }
      for (int i = 0; i < kShape.hidden; ++i) {
        y_sum[i] += y_j[i];
        dx_sum[i] += dx_j[i];
      }
    }
    EXPECT_EQ(rebuilt, w);
    // Outputs and input gradients add up to the expert's, to float rounding.
    for (int i = 0; i < kShape.hidden; ++i) {
      EXPECT_NEAR(y_sum[i], y[i], 1e-6f * (1 + std::fabs(y[i]))) << shards;
      EXPECT_NEAR(dx_sum[i], dx[i], 1e-6f * (1 + std::fabs(dx[i]))) << shards;
    }
  }
}

// Whole experts and shards, spread over the ranks' strings in any order, assemble into every
// expert's weights; a missing shard or a cut record is an error.
TEST(DemoModelTest, PiecesAssembleIntoEveryExpertsWeights) {
  DemoModelOptions model;
  model.layers = 2;
  model.experts = 3;
  model.ffn = kShape;
  std::vector<std::vector<float>> whole;
  for (int i = 0; i < model.layers * model.experts; ++i) whole.push_back(Weights(kShape, 10 + i));
  const FfnShape half = ShardShape(kShape, 2);
  std::vector<std::string> ranks(3);
  std::vector<float> shard(half.weight_floats());
  for (int l = 0; l < model.layers; ++l) {
    for (int e = 0; e < model.experts; ++e) {
      const std::vector<float>& w = whole[l * model.experts + e];
      if (e == 1) {  // expert 1 in two shards, on two ranks, the second first
        for (const int j : {1, 0}) {
          SliceExpertWeights(kShape, 2, j, w, shard);
          AppendExpertPiece(l, e, j, 2, shard, ranks[1 + j]);
        }
      } else {
        AppendExpertPiece(l, e, 0, 1, w, ranks[e]);
      }
    }
  }
  Result<std::vector<float>> assembled = AssembleExpertWeights(model, ranks);
  ASSERT_TRUE(assembled.ok()) << assembled.status().ToString();
  std::vector<float> expected;
  for (const std::vector<float>& w : whole) expected.insert(expected.end(), w.begin(), w.end());
  EXPECT_EQ(*assembled, expected);

  std::vector<std::string> missing = ranks;
  missing[2].clear();  // shard 1 of expert 1, and expert 2
  EXPECT_FALSE(AssembleExpertWeights(model, missing).ok());
  std::vector<std::string> cut = ranks;
  cut[0].pop_back();
  EXPECT_FALSE(AssembleExpertWeights(model, cut).ok());
}

TEST(DemoModelTest, ToFixedPointRoundsToNearestAndSaturates) {
  EXPECT_EQ(ToFixedPoint(0.0), 0);
  EXPECT_EQ(ToFixedPoint(1.4), 1);
  EXPECT_EQ(ToFixedPoint(1.6), 2);
  EXPECT_EQ(ToFixedPoint(-1.6), -2);
  EXPECT_EQ(ToFixedPoint(2.5), 2);  // ties to even
  EXPECT_EQ(ToFixedPoint(1e300), int64_t{1} << 50);
  EXPECT_EQ(ToFixedPoint(-1e300), -(int64_t{1} << 50));
}

TEST(DemoModelTest, AdamFirstStepMovesEachWeightByTheLearningRate) {
  const AdamOptions adam;
  std::vector<float> weights = {1.0f, -2.0f, 0.5f, 0.0f};
  std::vector<float> optimizer(8, 0.0f);
  const double tokens = 10;
  std::vector<int64_t> gradient = {ToFixedPoint(3.0 * kGradientScale * tokens),
                                   ToFixedPoint(-0.5 * kGradientScale * tokens), 0,
                                   ToFixedPoint(1e-3 * kGradientScale * tokens)};
  AdamUpdate(adam, 1, tokens, gradient, weights, optimizer);
  // After one step m̂ = g and v̂ = g², so the update is lr · g / (|g| + eps) ≈ lr · sign(g).
  EXPECT_NEAR(weights[0], 1.0 - adam.learning_rate, 1e-6);
  EXPECT_NEAR(weights[1], -2.0 + adam.learning_rate, 1e-6);
  EXPECT_EQ(weights[2], 0.5f);
  EXPECT_NEAR(weights[3], -adam.learning_rate, 1e-6);
  EXPECT_NEAR(optimizer[0], 0.1 * 3.0, 1e-6);    // m
  EXPECT_NEAR(optimizer[4], 0.001 * 9.0, 1e-6);  // v
}

TEST(DemoModelTest, SeededDrawsRepeatAndDifferPerSeedWord) {
  EXPECT_EQ(Weights(kShape, 3), Weights(kShape, 3));
  EXPECT_NE(Weights(kShape, 3), Weights(kShape, 4));
  EXPECT_EQ(Inputs(8, 4, 1, 2), Inputs(8, 4, 1, 2));
  EXPECT_NE(Inputs(8, 4, 1, 2), Inputs(8, 4, 2, 2));
  EXPECT_NE(Inputs(8, 4, 1, 2), Inputs(8, 4, 1, 3));
  const std::vector<float> teacher = MakeTeacher(8, 5);
  EXPECT_EQ(teacher, MakeTeacher(8, 5));
  std::vector<float> targets(32);
  const std::vector<float> inputs = Inputs(8, 4);
  TeacherTargets(8, teacher, inputs, targets);
  EXPECT_NE(targets, inputs);
}

TEST(DemoModelTest, CombineAddsGatedExpertOutputsToTheResidual) {
  const float x[2] = {1.0f, 2.0f};
  const float expert_out[4] = {10.0f, 20.0f, 30.0f, 40.0f};  // [top_k = 2, hidden = 2]
  float out[2];
  CombineRow(2, 2, 0.5f, x, expert_out, out);
  EXPECT_EQ(out[0], 21.0f);
  EXPECT_EQ(out[1], 32.0f);
}

TEST(DemoModelTest, GateDrawsExactlyTheCountsWithMostlyDistinctExperts) {
  const int tokens = 500;
  const int top_k = 2;
  std::vector<int64_t> counts = {400, 250, 150, 100, 50, 30, 20, 0};
  std::vector<int32_t> ids(tokens * top_k);
  DrawTopkIds(counts, tokens, top_k, 11, ids);
  std::vector<int64_t> seen(counts.size(), 0);
  int repeats = 0;
  for (int t = 0; t < tokens; ++t) {
    for (int k = 0; k < top_k; ++k) ++seen[ids[t * top_k + k]];
    repeats += ids[t * top_k] == ids[t * top_k + 1];
  }
  EXPECT_EQ(seen, counts);
  EXPECT_LT(repeats, tokens / 50);
  std::vector<int32_t> again(ids.size());
  DrawTopkIds(counts, tokens, top_k, 11, again);
  EXPECT_EQ(again, ids);
}

TEST(DemoModelTest, ScaleCountsHitsTheTotal) {
  const std::vector<double> loads = {5.5, 0.0, 1.25, 3.0, 0.1};
  std::vector<int64_t> counts = ScaleCounts(loads, 1000);
  EXPECT_EQ(std::accumulate(counts.begin(), counts.end(), int64_t{0}), 1000);
  EXPECT_EQ(counts[1], 0);
  EXPECT_GT(counts[0], counts[3]);
  const std::vector<double> zeros(3, 0.0);
  EXPECT_EQ(ScaleCounts(zeros, 7), (std::vector<int64_t>{3, 2, 2}));
}

}  // namespace
}  // namespace keel::tools
