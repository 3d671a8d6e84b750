// The math of `keel demo`'s MoE model. Loops run in one fixed order per row; the reductions keep
// kLanes partial sums in a fixed pattern and add them in a fixed order, which lets the compiler
// use vector registers without the result depending on anything but the row itself.
#include "tools/demo_model.h"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <cstring>
#include <numeric>
#include <string>

namespace keel::tools {
namespace {

constexpr int kLanes = 8;

// Σ a[i] · b[i] over n floats: kLanes partial sums (lane i % kLanes), then the tail, then the
// partial sums added pairwise. Fixed order for a given n.
float Dot(const float* a, const float* b, int n) {
  float partial[kLanes] = {};
  int i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int lane = 0; lane < kLanes; ++lane) partial[lane] += a[i + lane] * b[i + lane];
  }
  for (int lane = 0; i < n; ++i, ++lane) partial[lane] += a[i] * b[i];
  for (int width = kLanes / 2; width > 0; width /= 2) {
    for (int lane = 0; lane < width; ++lane) partial[lane] += partial[lane + width];
  }
  return partial[0];
}

// gradient[j] += fixed(scale_value · v[j]) for j < n.
void AddOuterRow(float scale_value, const float* v, int n, int64_t* gradient) {
  const double s = static_cast<double>(scale_value) * kGradientScale;
  for (int j = 0; j < n; ++j) gradient[j] += ToFixedPoint(s * static_cast<double>(v[j]));
}

}  // namespace

int64_t ToFixedPoint(double value) {
  // Adding and subtracting 1.5 · 2^52 rounds to the nearest integer (ties to even) in the
  // default rounding mode, without a libm call; the clamp keeps it in the exact range.
  constexpr double kLimit = 0x1.0p50;
  constexpr double kRound = 0x1.8p52;
  const double clamped = std::clamp(value, -kLimit, kLimit);
  return static_cast<int64_t>((clamped + kRound) - kRound);
}

uint64_t MixSeed(std::span<const uint64_t> words) {
  uint64_t state = 0x6b65656c2064656dULL;  // "keel dem"
  uint64_t seed = 0;
  for (uint64_t word : words) {
    state ^= word;
    seed = SplitMix64(state);
    state = seed;
  }
  return seed;
}

void InitExpertWeights(const FfnShape& shape, uint64_t seed, int layer, int expert,
                       std::span<float> weights) {
  assert(weights.size() == shape.weight_floats());
  const uint64_t words[] = {seed, 1, static_cast<uint64_t>(layer), static_cast<uint64_t>(expert)};
  RandomStream stream(MixSeed(words));
  const size_t half = weights.size() / 2;
  const float w1_range = 1.0f / std::sqrt(static_cast<float>(shape.hidden));
  const float w2_range = 0.5f / std::sqrt(static_cast<float>(shape.ffn));
  for (size_t i = 0; i < half; ++i) weights[i] = w1_range * stream.Symmetric();
  for (size_t i = half; i < weights.size(); ++i) weights[i] = w2_range * stream.Symmetric();
}

FfnShape ShardShape(const FfnShape& full, int shards) {
  assert(shards >= 1 && full.ffn % shards == 0);
  return {full.hidden, full.ffn / shards};
}

namespace {

// Calls copy(full_offset, shard_offset, count) for each contiguous run that shard `index` shares
// with the full expert: its W1 rows (one block), then its part of each of W2's rows.
template <typename Copy>
void ForEachShardRun(const FfnShape& full, int shards, int index, const Copy& copy) {
  const size_t hidden = static_cast<size_t>(full.hidden);
  const size_t width = static_cast<size_t>(full.ffn / shards);
  const size_t first = static_cast<size_t>(index) * width;
  copy(first * hidden, size_t{0}, width * hidden);
  const size_t full_w2 = static_cast<size_t>(full.ffn) * hidden;
  const size_t shard_w2 = width * hidden;
  for (size_t i = 0; i < hidden; ++i) {
    copy(full_w2 + i * full.ffn + first, shard_w2 + i * width, width);
  }
}

}  // namespace

void SliceExpertWeights(const FfnShape& full, int shards, int index,
                        std::span<const float> full_weights, std::span<float> shard_weights) {
  assert(full_weights.size() == full.weight_floats());
  assert(shard_weights.size() == ShardShape(full, shards).weight_floats());
  ForEachShardRun(full, shards, index, [&](size_t at_full, size_t at_shard, size_t count) {
    std::copy_n(full_weights.begin() + at_full, count, shard_weights.begin() + at_shard);
  });
}

void PlaceShardWeights(const FfnShape& full, int shards, int index,
                       std::span<const float> shard_weights, std::span<float> full_weights) {
  assert(full_weights.size() == full.weight_floats());
  assert(shard_weights.size() == ShardShape(full, shards).weight_floats());
  ForEachShardRun(full, shards, index, [&](size_t at_full, size_t at_shard, size_t count) {
    std::copy_n(shard_weights.begin() + at_shard, count, full_weights.begin() + at_full);
  });
}

ShardLayout FfnShardLayout(const FfnShape& shape) {
  const size_t hidden = static_cast<size_t>(shape.hidden);
  const size_t ffn = static_cast<size_t>(shape.ffn);
  const std::vector<ShardedTensor> matrices = {{ffn, hidden, sizeof(float), false},
                                               {hidden, ffn, sizeof(float), true}};
  ShardLayout layout;
  layout.weights = matrices;
  for (int moment = 0; moment < 2; ++moment) {
    layout.optimizer.insert(layout.optimizer.end(), matrices.begin(), matrices.end());
  }
  return layout;
}

void DrawTokenInputs(uint64_t seed, int rank, int64_t step, std::span<float> inputs) {
  const uint64_t words[] = {seed, 2, static_cast<uint64_t>(rank), static_cast<uint64_t>(step)};
  RandomStream stream(MixSeed(words));
  for (float& value : inputs) value = stream.Symmetric();
}

std::vector<float> MakeTeacher(int hidden, uint64_t seed) {
  const uint64_t words[] = {seed, 3};
  RandomStream stream(MixSeed(words));
  std::vector<float> teacher(static_cast<size_t>(hidden) * hidden);
  const float range = 1.0f / std::sqrt(static_cast<float>(hidden));
  for (int i = 0; i < hidden; ++i) {
    for (int j = 0; j < hidden; ++j) {
      teacher[static_cast<size_t>(i) * hidden + j] =
          (i == j ? 1.0f : 0.0f) + range * stream.Symmetric();
    }
  }
  return teacher;
}

void TeacherTargets(int hidden, std::span<const float> teacher, std::span<const float> inputs,
                    std::span<float> targets) {
  assert(inputs.size() == targets.size() && inputs.size() % hidden == 0);
  const size_t tokens = inputs.size() / hidden;
  for (size_t t = 0; t < tokens; ++t) {
    const float* x = inputs.data() + t * hidden;
    for (int i = 0; i < hidden; ++i) {
      targets[t * hidden + i] = Dot(teacher.data() + static_cast<size_t>(i) * hidden, x, hidden);
    }
  }
}

void ExpertForward(const FfnShape& shape, const float* weights, const float* x, float* y,
                   float* activation) {
  const int hidden = shape.hidden;
  const int ffn = shape.ffn;
  const float* w1 = weights;
  const float* w2 = weights + static_cast<size_t>(ffn) * hidden;
  for (int f = 0; f < ffn; ++f) {
    const float h = Dot(w1 + static_cast<size_t>(f) * hidden, x, hidden);
    activation[f] = h > 0.0f ? h : 0.0f;
  }
  for (int i = 0; i < hidden; ++i) y[i] = Dot(w2 + static_cast<size_t>(i) * ffn, activation, ffn);
}

void ExpertBackward(const FfnShape& shape, const float* weights, const float* x,
                    const float* activation, const float* dy, int64_t* gradient, float* dx,
                    float* scratch) {
  const int hidden = shape.hidden;
  const int ffn = shape.ffn;
  const float* w1 = weights;
  const float* w2 = weights + static_cast<size_t>(ffn) * hidden;
  int64_t* grad_w1 = gradient;
  int64_t* grad_w2 = gradient + static_cast<size_t>(ffn) * hidden;
  // dW2 = dy ⊗ activation; d_activation = W2ᵀ · dy (i ascending for every f).
  float* d_hidden = scratch;
  std::fill(d_hidden, d_hidden + ffn, 0.0f);
  for (int i = 0; i < hidden; ++i) {
    const float* w2_row = w2 + static_cast<size_t>(i) * ffn;
    for (int f = 0; f < ffn; ++f) d_hidden[f] += w2_row[f] * dy[i];
    AddOuterRow(dy[i], activation, ffn, grad_w2 + static_cast<size_t>(i) * ffn);
  }
  // Through the relu, then dW1 = d_hidden ⊗ x and dx = W1ᵀ · d_hidden (f ascending for every j).
  // Rows of an inactive unit contribute exact zeros to both and are skipped.
  std::fill(dx, dx + hidden, 0.0f);
  for (int f = 0; f < ffn; ++f) {
    if (!(activation[f] > 0.0f)) continue;
    const float d = d_hidden[f];
    const float* w1_row = w1 + static_cast<size_t>(f) * hidden;
    for (int j = 0; j < hidden; ++j) dx[j] += w1_row[j] * d;
    AddOuterRow(d, x, hidden, grad_w1 + static_cast<size_t>(f) * hidden);
  }
}

void CombineRow(int hidden, int top_k, float gate, const float* x, const float* expert_out,
                float* out) {
  for (int i = 0; i < hidden; ++i) {
    float sum = x[i];
    for (int k = 0; k < top_k; ++k) sum += gate * expert_out[static_cast<size_t>(k) * hidden + i];
    out[i] = sum;
  }
}

double RowLoss(int hidden, const float* out, const float* target, float* d_out) {
  double loss = 0.0;
  const float scale = 2.0f / static_cast<float>(hidden);
  for (int i = 0; i < hidden; ++i) {
    const float diff = out[i] - target[i];
    loss += static_cast<double>(diff) * diff;
    d_out[i] = scale * diff;
  }
  return loss / hidden;
}

void AdamUpdate(const AdamOptions& adam, int64_t step, double tokens,
                std::span<const int64_t> gradient, std::span<float> weights,
                std::span<float> optimizer) {
  assert(gradient.size() == weights.size() && optimizer.size() == 2 * weights.size());
  const size_t n = weights.size();
  float* m = optimizer.data();
  float* v = optimizer.data() + n;
  const double unscale = 1.0 / (kGradientScale * tokens);
  const double correction1 = 1.0 - std::pow(adam.beta1, static_cast<double>(step));
  const double correction2 = 1.0 - std::pow(adam.beta2, static_cast<double>(step));
  for (size_t i = 0; i < n; ++i) {
    const double g = static_cast<double>(gradient[i]) * unscale;
    const double m_i = adam.beta1 * m[i] + (1.0 - adam.beta1) * g;
    const double v_i = adam.beta2 * v[i] + (1.0 - adam.beta2) * g * g;
    m[i] = static_cast<float>(m_i);
    v[i] = static_cast<float>(v_i);
    const double update =
        adam.learning_rate * (m_i / correction1) / (std::sqrt(v_i / correction2) + adam.epsilon);
    weights[i] = static_cast<float>(weights[i] - update);
  }
}

void DrawTopkIds(std::span<const int64_t> expert_counts, int num_tokens, int top_k, uint64_t seed,
                 std::span<int32_t> topk_ids) {
  const size_t total = static_cast<size_t>(num_tokens) * top_k;
  assert(topk_ids.size() == total);
  size_t position = 0;
  for (size_t e = 0; e < expert_counts.size(); ++e) {
    for (int64_t c = 0; c < expert_counts[e] && position < total; ++c) {
      topk_ids[position++] = static_cast<int32_t>(e);
    }
  }
  assert(position == total);
  for (; position < total; ++position) topk_ids[position] = -1;  // counts short: dropped
  RandomStream stream(seed);
  for (size_t i = total; i > 1; --i) std::swap(topk_ids[i - 1], topk_ids[stream.Below(i)]);
  if (top_k < 2) return;
  // A token holding an expert twice trades that choice with a random position whose expert it
  // lacks and whose token lacks ours; a few tries each, so hot experts may still repeat.
  auto token_has = [&](size_t token, int32_t expert, size_t skip) {
    for (int k = 0; k < top_k; ++k) {
      const size_t p = token * top_k + k;
      if (p != skip && topk_ids[p] == expert) return true;
    }
    return false;
  };
  for (size_t p = 0; p < total; ++p) {
    const size_t token = p / top_k;
    if (topk_ids[p] < 0 || !token_has(token, topk_ids[p], p)) continue;
    for (int attempt = 0; attempt < 8; ++attempt) {
      const size_t other = stream.Below(total);
      const size_t other_token = other / top_k;
      if (other_token == token) continue;
      if (token_has(token, topk_ids[other], p) || token_has(other_token, topk_ids[p], other)) {
        continue;
      }
      std::swap(topk_ids[p], topk_ids[other]);
      break;
    }
  }
}

std::vector<int64_t> ScaleCounts(std::span<const double> loads, int64_t total) {
  const size_t n = loads.size();
  std::vector<int64_t> counts(n, 0);
  if (n == 0) return counts;
  double sum = 0.0;
  for (double load : loads) sum += std::max(load, 0.0);
  if (!(sum > 0.0)) {
    for (size_t e = 0; e < n; ++e) {
      counts[e] = total / static_cast<int64_t>(n) +
                  (static_cast<int64_t>(e) < total % static_cast<int64_t>(n) ? 1 : 0);
    }
    return counts;
  }
  std::vector<double> remainder(n);
  int64_t assigned = 0;
  for (size_t e = 0; e < n; ++e) {
    const double exact = std::max(loads[e], 0.0) / sum * static_cast<double>(total);
    counts[e] = static_cast<int64_t>(std::floor(exact));
    remainder[e] = exact - static_cast<double>(counts[e]);
    assigned += counts[e];
  }
  std::vector<size_t> order(n);
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return remainder[a] > remainder[b]; });
  for (size_t i = 0; assigned < total; i = (i + 1) % n, ++assigned) ++counts[order[i]];
  // Rounding in the divisions can leave the floors one or two above `total`.
  for (size_t i = n - 1; assigned > total; i = i == 0 ? n - 1 : i - 1) {
    if (counts[order[i]] > 0) {
      --counts[order[i]];
      --assigned;
    }
  }
  return counts;
}

void AppendExpertPiece(int layer, int expert, int shard, int shards, std::span<const float> piece,
                       std::string& out) {
  const int32_t key[4] = {layer, expert, shard, shards};
  out.append(reinterpret_cast<const char*>(key), sizeof(key));
  out.append(reinterpret_cast<const char*>(piece.data()), piece.size_bytes());
}

Result<std::vector<float>> AssembleExpertWeights(const DemoModelOptions& model,
                                                 std::span<const std::string> pieces) {
  const size_t whole_floats = model.ffn.weight_floats();
  std::vector<float> weights(static_cast<size_t>(model.layers) * model.experts * whole_floats,
                             0.0f);
  // Each expert's pieces: a whole expert is one, a sharded one as many as its shards.
  std::vector<int> parts(static_cast<size_t>(model.layers) * model.experts, 0);
  std::vector<int> expected(parts.size(), 1);
  std::vector<float> slice;
  for (const std::string& part : pieces) {
    for (size_t at = 0; at < part.size();) {
      int32_t key[4];
      if (at + sizeof(key) > part.size()) return Internal("final weights: a truncated record");
      std::memcpy(key, part.data() + at, sizeof(key));
      const auto [layer, expert, shard, shards] = key;
      if (layer < 0 || layer >= model.layers || expert < 0 || expert >= model.experts ||
          shards < 1 || shard < 0 || shard >= shards) {
        return Internal("final weights: bad (layer, expert, shard) record");
      }
      const size_t floats = ShardShape(model.ffn, shards).weight_floats();
      at += sizeof(key);
      if (at + floats * sizeof(float) > part.size()) {
        return Internal("final weights: a truncated record");
      }
      slice.resize(floats);
      std::memcpy(slice.data(), part.data() + at, floats * sizeof(float));
      at += floats * sizeof(float);
      const size_t index = static_cast<size_t>(layer) * model.experts + expert;
      std::span<float> whole(weights.data() + index * whole_floats, whole_floats);
      if (shards == 1) {
        std::copy(slice.begin(), slice.end(), whole.begin());
      } else {
        PlaceShardWeights(model.ffn, shards, shard, slice, whole);
      }
      ++parts[index];
      expected[index] = shards;
    }
  }
  for (size_t i = 0; i < parts.size(); ++i) {
    if (parts[i] != expected[i]) {
      return Internal("final weights: expert " + std::to_string(i % model.experts) + " of layer " +
                      std::to_string(i / model.experts) + " has " + std::to_string(parts[i]) +
                      " of its " + std::to_string(expected[i]) + " pieces");
    }
  }
  return weights;
}

}  // namespace keel::tools
