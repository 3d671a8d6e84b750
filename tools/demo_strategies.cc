// The demo's sharded strategies. Per layer, forward:
//   routed (esp, parm): exchange each (token, k) row to its expert group's member at the sender's
//     position; all-gather the rows in the group (de-duplicated dispatch), or, without Parm's
//     de-duplication, every MP member sends all of its group's rows and needs no all-gather; each
//     member runs its shards; partial outputs are summed in member order (reduce-scatter to the
//     member that collected the row, or the MP group's all-reduce at the source); the outputs
//     return and combine in k order.
//   node (ppmoe): the node's tokens are all-gathered, every rank runs its slice of every expert
//     for all of them and combines its partial outputs per token, and the partial token outputs
//     are summed in member order at the token's rank.
// Backward walks the same exchanges in reverse with the gradients. Weight gradients are int64
// fixed point, so a shard's gradient is bit for bit its slice of the whole expert's.
#include "tools/demo_strategies.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "placement/strategy.h"

namespace keel::tools {
namespace {

// What one layer's forward leaves for its backward.
struct ShardedLayer {
  // Routed flow: this rank's (token, k) in dispatch order and the rows sent to each rank; the
  // rows collected from each rank in the exchange; the rows each member of the group collected.
  std::vector<uint32_t> send_order;
  std::vector<int64_t> send_rows;
  std::vector<int64_t> collected_from;
  std::vector<int64_t> block_rows;
  // Rows this rank runs its shards on (routed: the group's collected rows, blocks in member
  // order; node: every (token, k) of the node's tokens), their local expert, input, activation.
  std::vector<int32_t> run_expert;
  std::vector<float> run_x;
  std::vector<float> activation;
  // Node flow: the node's tokens' top-k ids.
  std::vector<int32_t> node_ids;
};

class ShardedTrainer {
 public:
  explicit ShardedTrainer(const RankRunOptions& options)
      : options_(options),
        model_(options.model),
        communicator_(*options.communicator),
        rank_(communicator_.rank()),
        ranks_(communicator_.size()) {}

  Status Init();
  Result<StepMeasurement> Step(int64_t step);
  Result<std::vector<float>> GatherFinalWeights();

 private:
  enum class Flow { kRouted, kNode };
  // Per-step costs of this rank.
  struct Costs {
    std::vector<double> expert;         // [layers] CPU seconds running shards
    std::vector<double> communication;  // [layers] CPU seconds exchanging, plus emulated links
    double all_to_all_bytes = 0;        // sent off this rank between groups
    double group_bytes = 0;             // sent off this rank inside its group
    double rows = 0;                    // rows through shards, in whole-expert rows
  };

  int group_first() const { return rank_ / group_size_ * group_size_; }
  int member() const { return rank_ % group_size_; }
  // Shard weights and gradients of local expert `local` of `layer`.
  float* Weights(int layer, int local) {
    return weights_.data() + (static_cast<size_t>(layer) * local_experts_ + local) * shard_floats_;
  }
  int64_t* Gradients(int layer, int local) {
    return gradients_.data() +
           (static_cast<size_t>(layer) * local_experts_ + local) * shard_floats_;
  }
  // Sends rows_to[r] rows of `width` values to rank r (back to back in `send`); fills `recv`
  // and `rows_from`. Bytes to other ranks count as all-to-all or group bytes.
  template <typename T>
  Status Exchange(std::span<const T> send, std::span<const int64_t> rows_to, int width,
                  std::vector<T>& recv, std::vector<int64_t>& rows_from, int layer, bool in_group,
                  Costs& costs);
  // The same `count` rows of `width` values to every other member of the group; returns the
  // members' rows, in member order, own included.
  template <typename T>
  Status AllGatherInGroup(std::span<const T> rows, int64_t count, int width, std::vector<T>& all,
                          std::vector<int64_t>& counts, int layer, Costs& costs);
  // Each member's partial rows for every member's block (`blocks` rows each, in member order)
  // go to that member, which sums them in member order into `sum` (its own block's rows).
  Status ReduceScatterInGroup(std::span<const float> partial, std::span<const int64_t> blocks,
                              int width, std::vector<float>& sum, int layer, Costs& costs);
  // The shards' partial results of the rows this rank ran (`partial`, consumed) summed over the
  // group and returned to the ranks the rows came from: [choices, hidden] in (token, k) order.
  Status SumAndReturn(const ShardedLayer& act, std::vector<float>& partial, int layer, Costs& costs,
                      std::vector<float>& by_choice);
  Status ForwardRouted(int64_t step, int layer, Costs& costs);
  Status BackwardRouted(int layer, Costs& costs);
  Status ForwardNode(int64_t step, int layer, Costs& costs);
  Status BackwardNode(int layer, Costs& costs);
  double LinkSeconds(double bytes) const {
    return options_.link_gb_per_s > 0 ? bytes / (options_.link_gb_per_s * 1e9) : 0.0;
  }

  const RankRunOptions& options_;
  const DemoModelOptions& model_;
  Communicator& communicator_;
  const int rank_;
  const int ranks_;
  Flow flow_ = Flow::kRouted;
  bool dedup_ = true;       // routed: members send only their share (esp always; parm by flag)
  bool mp_tokens_ = false;  // parm: the MP group's members hold the same tokens
  int group_size_ = 1;
  int num_groups_ = 1;
  FfnShape shard_;
  size_t shard_floats_ = 0;
  int local_experts_ = 0;
  std::vector<int> local_of_;      // [experts] local index in this rank's group, or -1
  std::vector<int> expert_group_;  // [experts] the group holding each expert (routed)
  std::vector<float> weights_;     // [layers, local experts, shard_floats]
  std::vector<int64_t> gradients_;
  std::vector<float> optimizer_;  // [layers, local experts, 2 * shard_floats]
  std::vector<float> teacher_;

  // This step. Tokens: this rank's own, or (parm without de-duplication) its MP group's, in
  // member order.
  int tokens_ = 0;
  std::vector<std::vector<float>> x_;  // [layers + 1][tokens, hidden]
  std::vector<float> d_x_;
  std::vector<int32_t> ids_;  // [tokens, top_k] of the current layer
  std::vector<std::vector<int32_t>> layer_ids_;
  std::vector<ShardedLayer> layers_;
};

Status ShardedTrainer::Init() {
  const StrategyConfig& strategy = options_.config.strategy;
  const int per_node = options_.config.topology.gpus_per_node;
  if (options_.config.num_ranks() != ranks_) {
    return InvalidArgument("the config's topology has " +
                           std::to_string(options_.config.num_ranks()) + " ranks, the run " +
                           std::to_string(ranks_));
  }
  if (strategy.name == "esp") {
    group_size_ = ShardDegree(strategy, per_node);
  } else if (strategy.name == "parm") {
    group_size_ = MpDegree(strategy, per_node);
    mp_tokens_ = true;
    dedup_ = options_.parm_dedup;
  } else if (strategy.name == "ppmoe") {
    group_size_ = per_node;
    flow_ = Flow::kNode;
  } else {
    return InvalidArgument("strategy '" + strategy.name +
                           "' is not one the sharded demo runs (esp, parm, ppmoe)");
  }
  if (group_size_ < 1 || per_node % group_size_ != 0 || ranks_ % group_size_ != 0) {
    return InvalidArgument(strategy.name + ": groups of " + std::to_string(group_size_) +
                           " ranks must divide the " + std::to_string(per_node) +
                           " ranks of a node");
  }
  if (model_.ffn.ffn % group_size_ != 0) {
    return InvalidArgument(strategy.name + ": --ffn " + std::to_string(model_.ffn.ffn) +
                           " does not split into " + std::to_string(group_size_) + " shards");
  }
  num_groups_ = ranks_ / group_size_;
  shard_ = ShardShape(model_.ffn, group_size_);
  shard_floats_ = shard_.weight_floats();
  local_of_.assign(model_.experts, -1);
  expert_group_.assign(model_.experts, 0);
  for (int e = 0; e < model_.experts; ++e) {
    expert_group_[e] = ContiguousOwner(e, model_.experts, num_groups_);
    // ppmoe: every node holds every expert.
    if (flow_ == Flow::kNode || expert_group_[e] == rank_ / group_size_) {
      local_of_[e] = local_experts_++;
    }
  }
  const size_t slices = static_cast<size_t>(model_.layers) * local_experts_;
  weights_.assign(slices * shard_floats_, 0.0f);
  gradients_.assign(slices * shard_floats_, 0);
  optimizer_.assign(slices * 2 * shard_floats_, 0.0f);
  std::vector<float> full(model_.ffn.weight_floats());
  for (int l = 0; l < model_.layers; ++l) {
    for (int e = 0; e < model_.experts; ++e) {
      if (local_of_[e] < 0) continue;
      InitExpertWeights(model_.ffn, model_.seed, l, e, full);
      SliceExpertWeights(model_.ffn, group_size_, member(), full,
                         {Weights(l, local_of_[e]), shard_floats_});
    }
  }
  teacher_ = MakeTeacher(model_.ffn.hidden, model_.seed);
  tokens_ = model_.tokens * (mp_tokens_ && !dedup_ ? group_size_ : 1);
  const size_t activations = static_cast<size_t>(tokens_) * model_.ffn.hidden;
  x_.assign(model_.layers + 1, std::vector<float>(activations));
  d_x_.resize(activations);
  layer_ids_.assign(model_.layers, {});
  layers_.resize(model_.layers);
  return Status::Ok();
}

template <typename T>
Status ShardedTrainer::Exchange(std::span<const T> send, std::span<const int64_t> rows_to,
                                int width, std::vector<T>& recv, std::vector<int64_t>& rows_from,
                                int layer, bool in_group, Costs& costs) {
  if (options_.barrier_before_timing) KEEL_RETURN_IF_ERROR(communicator_.Barrier());
  const double start = ThreadCpuSeconds();
  const size_t row_bytes = static_cast<size_t>(width) * sizeof(T);
  std::vector<size_t> send_bytes(ranks_);
  double off_rank = 0;
  for (int r = 0; r < ranks_; ++r) {
    send_bytes[r] = static_cast<size_t>(rows_to[r]) * row_bytes;
    if (r != rank_) off_rank += static_cast<double>(send_bytes[r]);
  }
  std::vector<std::byte> received;
  std::vector<size_t> recv_bytes;
  KEEL_RETURN_IF_ERROR(
      communicator_.AllToAllV(std::as_bytes(send), send_bytes, received, recv_bytes));
  rows_from.resize(ranks_);
  double arriving = 0;
  for (int r = 0; r < ranks_; ++r) {
    rows_from[r] = static_cast<int64_t>(recv_bytes[r] / row_bytes);
    if (r != rank_) arriving += static_cast<double>(recv_bytes[r]);
  }
  recv.resize(received.size() / sizeof(T));
  if (!received.empty()) std::memcpy(recv.data(), received.data(), received.size());
  costs.communication[layer] +=
      ThreadCpuSeconds() - start + LinkSeconds(std::max(off_rank, arriving));
  (in_group ? costs.group_bytes : costs.all_to_all_bytes) += off_rank;
  return Status::Ok();
}

template <typename T>
Status ShardedTrainer::AllGatherInGroup(std::span<const T> rows, int64_t count, int width,
                                        std::vector<T>& all, std::vector<int64_t>& counts,
                                        int layer, Costs& costs) {
  std::vector<T> send;
  std::vector<int64_t> rows_to(ranks_, 0);
  for (int m = 0; m < group_size_; ++m) {
    const int peer = group_first() + m;
    if (peer == rank_) continue;
    rows_to[peer] = count;
    send.insert(send.end(), rows.begin(), rows.end());
  }
  std::vector<T> received;
  std::vector<int64_t> rows_from;
  KEEL_RETURN_IF_ERROR(Exchange<T>(send, rows_to, width, received, rows_from, layer, true, costs));
  // Received rows come by source rank; this rank's own go in its place.
  all.clear();
  counts.assign(group_size_, 0);
  size_t at = 0;
  for (int m = 0; m < group_size_; ++m) {
    const int peer = group_first() + m;
    if (peer == rank_) {
      all.insert(all.end(), rows.begin(), rows.end());
      counts[m] = count;
      continue;
    }
    const size_t floats = static_cast<size_t>(rows_from[peer]) * width;
    all.insert(all.end(), received.begin() + at, received.begin() + at + floats);
    at += floats;
    counts[m] = rows_from[peer];
  }
  return Status::Ok();
}

Status ShardedTrainer::ReduceScatterInGroup(std::span<const float> partial,
                                            std::span<const int64_t> blocks, int width,
                                            std::vector<float>& sum, int layer, Costs& costs) {
  std::vector<float> send;
  std::vector<int64_t> rows_to(ranks_, 0);
  size_t at = 0;
  size_t own_at = 0;
  for (int m = 0; m < group_size_; ++m) {
    const size_t floats = static_cast<size_t>(blocks[m]) * width;
    const int peer = group_first() + m;
    if (peer == rank_) {
      own_at = at;
    } else {
      rows_to[peer] = blocks[m];
      send.insert(send.end(), partial.begin() + at, partial.begin() + at + floats);
    }
    at += floats;
  }
  std::vector<float> received;
  std::vector<int64_t> rows_from;
  KEEL_RETURN_IF_ERROR(
      Exchange<float>(send, rows_to, width, received, rows_from, layer, true, costs));
  const size_t floats = static_cast<size_t>(blocks[member()]) * width;
  sum.assign(floats, 0.0f);
  size_t from = 0;
  for (int m = 0; m < group_size_; ++m) {
    const int peer = group_first() + m;
    const float* part = peer == rank_ ? partial.data() + own_at : received.data() + from;
    if (peer != rank_) from += floats;
    for (size_t i = 0; i < floats; ++i) sum[i] += part[i];
  }
  return Status::Ok();
}

Status ShardedTrainer::ForwardRouted(int64_t step, int layer, Costs& costs) {
  const int hidden = model_.ffn.hidden;
  const int top_k = model_.top_k;
  ShardedLayer& act = layers_[layer];
  // This rank's choices: its own tokens', or every MP member's in member order.
  std::vector<int32_t>& ids = layer_ids_[layer];
  ids.resize(static_cast<size_t>(tokens_) * top_k);
  const int owners = mp_tokens_ && !dedup_ ? group_size_ : 1;
  for (int m = 0; m < owners; ++m) {
    const int owner = owners == 1 ? rank_ : group_first() + m;
    options_.gate->Draw(
        step, layer, owner,
        std::span<int32_t>(ids).subspan(static_cast<size_t>(m) * model_.tokens * top_k,
                                        static_cast<size_t>(model_.tokens) * top_k));
  }
  // Exchange: each row to its expert group's member at this rank's position.
  const size_t choices = ids.size();
  act.send_rows.assign(ranks_, 0);
  std::vector<int> destination(choices);
  for (size_t i = 0; i < choices; ++i) {
    destination[i] = expert_group_[ids[i]] * group_size_ + member();
    ++act.send_rows[destination[i]];
  }
  std::vector<size_t> start(ranks_ + 1, 0);
  for (int r = 0; r < ranks_; ++r) start[r + 1] = start[r] + act.send_rows[r];
  act.send_order.resize(choices);
  for (size_t i = 0; i < choices; ++i)
    act.send_order[start[destination[i]]++] = static_cast<uint32_t>(i);
  std::vector<float> send_x(choices * hidden);
  std::vector<int32_t> send_e(choices);
  const std::vector<float>& x = x_[layer];
  for (size_t r = 0; r < choices; ++r) {
    const uint32_t i = act.send_order[r];
    std::memcpy(send_x.data() + r * hidden, x.data() + static_cast<size_t>(i / top_k) * hidden,
                hidden * sizeof(float));
    send_e[r] = ids[i];
  }
  std::vector<float> collected_x;
  std::vector<int32_t> collected_e;
  std::vector<int64_t> ignored;
  KEEL_RETURN_IF_ERROR(Exchange<float>(send_x, act.send_rows, hidden, collected_x,
                                       act.collected_from, layer, false, costs));
  KEEL_RETURN_IF_ERROR(
      Exchange<int32_t>(send_e, act.send_rows, 1, collected_e, ignored, layer, false, costs));
  const int64_t collected = static_cast<int64_t>(collected_e.size());

  // De-duplicated: the group all-gathers what its members collected.
  std::vector<int32_t> expert_ids;
  if (dedup_) {
    KEEL_RETURN_IF_ERROR(AllGatherInGroup<float>(collected_x, collected, hidden, act.run_x,
                                                 act.block_rows, layer, costs));
    std::vector<int64_t> counts;
    KEEL_RETURN_IF_ERROR(
        AllGatherInGroup<int32_t>(collected_e, collected, 1, expert_ids, counts, layer, costs));
  } else {
    act.run_x = std::move(collected_x);
    act.block_rows.assign(group_size_, 0);
    act.block_rows[member()] = collected;
    expert_ids = std::move(collected_e);
  }
  const size_t run = expert_ids.size();
  act.run_expert.resize(run);
  std::vector<float> partial(run * hidden);
  {
    const double begin = ThreadCpuSeconds();
    act.activation.resize(run * shard_.ffn);
    for (size_t r = 0; r < run; ++r) {
      act.run_expert[r] = local_of_[expert_ids[r]];
      if (act.run_expert[r] < 0) return Internal("a row reached a group without its expert");
      ExpertForward(shard_, Weights(layer, act.run_expert[r]), act.run_x.data() + r * hidden,
                    partial.data() + r * hidden, act.activation.data() + r * shard_.ffn);
    }
    costs.expert[layer] += ThreadCpuSeconds() - begin;
    costs.rows += static_cast<double>(run) / group_size_;
  }
  std::vector<float> gathered;
  KEEL_RETURN_IF_ERROR(SumAndReturn(act, partial, layer, costs, gathered));
  const float gate = 1.0f / static_cast<float>(top_k);
  std::vector<float>& out = x_[layer + 1];
  for (int t = 0; t < tokens_; ++t) {
    const size_t row = static_cast<size_t>(t) * hidden;
    CombineRow(hidden, top_k, gate, x.data() + row, gathered.data() + row * top_k,
               out.data() + row);
  }
  if (mp_tokens_ && dedup_) {
    // The MP group's members hold the same tokens: each all-gathers the others' outputs.
    std::vector<float> all;
    std::vector<int64_t> counts;
    KEEL_RETURN_IF_ERROR(AllGatherInGroup<float>(out, tokens_, hidden, all, counts, layer, costs));
  }
  return Status::Ok();
}

Status ShardedTrainer::SumAndReturn(const ShardedLayer& act, std::vector<float>& partial, int layer,
                                    Costs& costs, std::vector<float>& by_choice) {
  const int hidden = model_.ffn.hidden;
  std::vector<float> rows;  // [collected rows, hidden]: summed (de-duplicated) or partial
  if (dedup_) {
    KEEL_RETURN_IF_ERROR(ReduceScatterInGroup(partial, act.block_rows, hidden, rows, layer, costs));
  } else {
    rows = std::move(partial);
  }
  std::vector<float> returned;
  std::vector<int64_t> ignored;
  KEEL_RETURN_IF_ERROR(
      Exchange<float>(rows, act.collected_from, hidden, returned, ignored, layer, false, costs));
  const size_t choices = act.send_order.size();
  by_choice.resize(choices * hidden);
  for (size_t r = 0; r < choices; ++r) {
    std::memcpy(by_choice.data() + static_cast<size_t>(act.send_order[r]) * hidden,
                returned.data() + r * hidden, hidden * sizeof(float));
  }
  if (dedup_) return Status::Ok();
  // Each member holds its shards' partial results for every row of the MP group: the group
  // all-reduces them, summed in member order (the order a de-duplicated run's reduce-scatter
  // adds them in, so both give the same bits).
  std::vector<float> all;
  std::vector<int64_t> counts;
  KEEL_RETURN_IF_ERROR(AllGatherInGroup<float>(by_choice, static_cast<int64_t>(choices), hidden,
                                               all, counts, layer, costs));
  std::fill(by_choice.begin(), by_choice.end(), 0.0f);
  for (int m = 0; m < group_size_; ++m) {
    const float* part = all.data() + static_cast<size_t>(m) * choices * hidden;
    for (size_t i = 0; i < by_choice.size(); ++i) by_choice[i] += part[i];
  }
  return Status::Ok();
}

Status ShardedTrainer::BackwardRouted(int layer, Costs& costs) {
  const int hidden = model_.ffn.hidden;
  const int top_k = model_.top_k;
  const ShardedLayer& act = layers_[layer];
  const float gate = 1.0f / static_cast<float>(top_k);
  const size_t choices = act.send_order.size();
  std::vector<float> send(choices * hidden);
  for (size_t r = 0; r < choices; ++r) {
    const float* d_out = d_x_.data() + static_cast<size_t>(act.send_order[r] / top_k) * hidden;
    for (int i = 0; i < hidden; ++i) send[r * hidden + i] = gate * d_out[i];
  }
  std::vector<float> collected_dy;
  std::vector<int64_t> ignored;
  KEEL_RETURN_IF_ERROR(
      Exchange<float>(send, act.send_rows, hidden, collected_dy, ignored, layer, false, costs));
  std::vector<float> run_dy;
  if (dedup_) {
    std::vector<int64_t> counts;
    KEEL_RETURN_IF_ERROR(AllGatherInGroup<float>(collected_dy, act.block_rows[member()], hidden,
                                                 run_dy, counts, layer, costs));
  } else {
    run_dy = std::move(collected_dy);
  }
  const size_t run = act.run_expert.size();
  std::vector<float> partial(run * hidden);
  {
    const double begin = ThreadCpuSeconds();
    std::vector<float> scratch(shard_.ffn);
    for (size_t r = 0; r < run; ++r) {
      ExpertBackward(shard_, Weights(layer, act.run_expert[r]), act.run_x.data() + r * hidden,
                     act.activation.data() + r * shard_.ffn, run_dy.data() + r * hidden,
                     Gradients(layer, act.run_expert[r]), partial.data() + r * hidden,
                     scratch.data());
    }
    costs.expert[layer] += ThreadCpuSeconds() - begin;
  }
  std::vector<float> gathered;
  KEEL_RETURN_IF_ERROR(SumAndReturn(act, partial, layer, costs, gathered));
  // d_in = d_out + Σ_k dx_k in k order.
  for (int t = 0; t < tokens_; ++t) {
    float* d = d_x_.data() + static_cast<size_t>(t) * hidden;
    const float* dxk = gathered.data() + static_cast<size_t>(t) * top_k * hidden;
    for (int i = 0; i < hidden; ++i) {
      float sum = d[i];
      for (int k = 0; k < top_k; ++k) sum += dxk[static_cast<size_t>(k) * hidden + i];
      d[i] = sum;
    }
  }
  if (mp_tokens_ && dedup_) {
    std::vector<float> all;
    std::vector<int64_t> counts;
    KEEL_RETURN_IF_ERROR(AllGatherInGroup<float>(d_x_, tokens_, hidden, all, counts, layer, costs));
  }
  return Status::Ok();
}

Status ShardedTrainer::ForwardNode(int64_t step, int layer, Costs& costs) {
  const int hidden = model_.ffn.hidden;
  const int top_k = model_.top_k;
  ShardedLayer& act = layers_[layer];
  std::vector<int32_t>& ids = layer_ids_[layer];
  ids.resize(static_cast<size_t>(tokens_) * top_k);
  options_.gate->Draw(step, layer, rank_, ids);
  // Every rank of the node gets the node's tokens and their choices, in member order.
  const std::vector<float>& x = x_[layer];
  std::vector<int64_t> counts;
  KEEL_RETURN_IF_ERROR(
      AllGatherInGroup<float>(x, tokens_, hidden, act.run_x, counts, layer, costs));
  KEEL_RETURN_IF_ERROR(AllGatherInGroup<int32_t>(ids, tokens_ * static_cast<int64_t>(top_k), 1,
                                                 act.node_ids, counts, layer, costs));
  const size_t node_tokens = act.run_x.size() / hidden;
  // Each rank runs its slice of every chosen expert and combines its partial outputs per token.
  std::vector<float> partial_out(node_tokens * hidden, 0.0f);
  {
    const double begin = ThreadCpuSeconds();
    const float gate = 1.0f / static_cast<float>(top_k);
    act.activation.resize(node_tokens * top_k * shard_.ffn);
    std::vector<float> y(hidden);
    for (size_t t = 0; t < node_tokens; ++t) {
      float* out = partial_out.data() + t * hidden;
      for (int k = 0; k < top_k; ++k) {
        const size_t choice = t * top_k + k;
        ExpertForward(shard_, Weights(layer, local_of_[act.node_ids[choice]]),
                      act.run_x.data() + t * hidden, y.data(),
                      act.activation.data() + choice * shard_.ffn);
        for (int i = 0; i < hidden; ++i) out[i] += gate * y[i];
      }
    }
    costs.expert[layer] += ThreadCpuSeconds() - begin;
    costs.rows += static_cast<double>(node_tokens) * top_k / group_size_;
  }
  std::vector<int64_t> blocks(group_size_, tokens_);
  std::vector<float> summed;
  KEEL_RETURN_IF_ERROR(ReduceScatterInGroup(partial_out, blocks, hidden, summed, layer, costs));
  std::vector<float>& out = x_[layer + 1];
  for (size_t i = 0; i < out.size(); ++i) out[i] = x[i] + summed[i];
  return Status::Ok();
}

Status ShardedTrainer::BackwardNode(int layer, Costs& costs) {
  const int hidden = model_.ffn.hidden;
  const int top_k = model_.top_k;
  const ShardedLayer& act = layers_[layer];
  std::vector<float> node_d_out;
  std::vector<int64_t> counts;
  KEEL_RETURN_IF_ERROR(
      AllGatherInGroup<float>(d_x_, tokens_, hidden, node_d_out, counts, layer, costs));
  const size_t node_tokens = node_d_out.size() / hidden;
  std::vector<float> partial_dx(node_tokens * hidden, 0.0f);
  {
    const double begin = ThreadCpuSeconds();
    const float gate = 1.0f / static_cast<float>(top_k);
    std::vector<float> dy(hidden), dx(hidden), scratch(shard_.ffn);
    for (size_t t = 0; t < node_tokens; ++t) {
      for (int i = 0; i < hidden; ++i) dy[i] = gate * node_d_out[t * hidden + i];
      float* sum = partial_dx.data() + t * hidden;
      for (int k = 0; k < top_k; ++k) {
        const size_t choice = t * top_k + k;
        const int local = local_of_[act.node_ids[choice]];
        ExpertBackward(shard_, Weights(layer, local), act.run_x.data() + t * hidden,
                       act.activation.data() + choice * shard_.ffn, dy.data(),
                       Gradients(layer, local), dx.data(), scratch.data());
        for (int i = 0; i < hidden; ++i) sum[i] += dx[i];
      }
    }
    costs.expert[layer] += ThreadCpuSeconds() - begin;
  }
  std::vector<int64_t> blocks(group_size_, tokens_);
  std::vector<float> summed;
  KEEL_RETURN_IF_ERROR(ReduceScatterInGroup(partial_dx, blocks, hidden, summed, layer, costs));
  for (size_t i = 0; i < d_x_.size(); ++i) d_x_[i] += summed[i];
  return Status::Ok();
}

Result<StepMeasurement> ShardedTrainer::Step(int64_t step) {
  const int layers = model_.layers;
  const int hidden = model_.ffn.hidden;
  Costs costs;
  costs.expert.assign(layers, 0.0);
  costs.communication.assign(layers, 0.0);
  // Inputs: this rank's tokens, or its MP group's in member order.
  const int owners = tokens_ / model_.tokens;
  const size_t per_owner = static_cast<size_t>(model_.tokens) * hidden;
  for (int m = 0; m < owners; ++m) {
    const int owner = owners == 1 ? rank_ : group_first() + m;
    DrawTokenInputs(model_.seed, owner, step,
                    std::span<float>(x_[0]).subspan(static_cast<size_t>(m) * per_owner, per_owner));
  }
  std::fill(gradients_.begin(), gradients_.end(), 0);
  for (int l = 0; l < layers; ++l) {
    KEEL_RETURN_IF_ERROR(flow_ == Flow::kNode ? ForwardNode(step, l, costs)
                                              : ForwardRouted(step, l, costs));
  }
  // The loss of this rank's own tokens; an MP group that holds the group's tokens has each
  // member's share of the gradient everywhere, the loss counted once.
  std::vector<float> targets(x_[0].size());
  TeacherTargets(hidden, teacher_, x_[0], targets);
  double loss = 0;
  const int own_first = owners == 1 ? 0 : member() * model_.tokens;
  for (int t = 0; t < tokens_; ++t) {
    const size_t row = static_cast<size_t>(t) * hidden;
    const double row_loss =
        RowLoss(hidden, x_[layers].data() + row, targets.data() + row, d_x_.data() + row);
    if (t >= own_first && t < own_first + model_.tokens) loss += row_loss;
  }
  for (int l = layers - 1; l >= 0; --l) {
    KEEL_RETURN_IF_ERROR(flow_ == Flow::kNode ? BackwardNode(l, costs) : BackwardRouted(l, costs));
  }
  // ppmoe on several nodes: each slice has a copy per node; their gradients are summed.
  double control = 0;
  if (flow_ == Flow::kNode && num_groups_ > 1) {
    const double begin = ThreadCpuSeconds();
    std::vector<int64_t> by_position(static_cast<size_t>(group_size_) * gradients_.size(), 0);
    std::copy(gradients_.begin(), gradients_.end(),
              by_position.begin() + static_cast<ptrdiff_t>(member() * gradients_.size()));
    KEEL_RETURN_IF_ERROR(communicator_.AllReduce(by_position, ReduceOp::kSum));
    std::copy_n(by_position.begin() + static_cast<ptrdiff_t>(member() * gradients_.size()),
                gradients_.size(), gradients_.begin());
    control += ThreadCpuSeconds() - begin;
  }
  {
    const double begin = ThreadCpuSeconds();
    const double global_tokens = static_cast<double>(model_.tokens) * ranks_;
    for (int l = 0; l < layers; ++l) {
      for (int local = 0; local < local_experts_; ++local) {
        AdamUpdate(model_.adam, step + 1, global_tokens, {Gradients(l, local), shard_floats_},
                   {Weights(l, local), shard_floats_},
                   {optimizer_.data() +
                        (static_cast<size_t>(l) * local_experts_ + local) * 2 * shard_floats_,
                    2 * shard_floats_});
      }
    }
    control += ThreadCpuSeconds() - begin;
  }

  std::vector<double> maxima;
  maxima.insert(maxima.end(), costs.expert.begin(), costs.expert.end());
  maxima.insert(maxima.end(), costs.communication.begin(), costs.communication.end());
  maxima.push_back(control);
  KEEL_RETURN_IF_ERROR(communicator_.AllReduce(maxima, ReduceOp::kMax));
  std::vector<double> sums = {loss, costs.all_to_all_bytes, costs.group_bytes};
  KEEL_RETURN_IF_ERROR(communicator_.AllReduce(sums, ReduceOp::kSum));
  std::vector<int64_t> rows(ranks_, 0);
  rows[rank_] = static_cast<int64_t>(costs.rows + 0.5);
  KEEL_RETURN_IF_ERROR(communicator_.AllReduce(rows, ReduceOp::kSum));

  StepMeasurement m;
  m.step = step;
  m.loss = sums[0] / (static_cast<double>(model_.tokens) * ranks_);
  m.all_to_all_bytes = sums[1];
  m.group_bytes = sums[2];
  for (int l = 0; l < layers; ++l) {
    m.expert_seconds += maxima[l];
    m.communication_seconds += maxima[layers + l];
  }
  m.control_seconds = maxima[2 * layers];
  m.parallel_step_seconds = m.expert_seconds + m.communication_seconds + m.control_seconds;
  m.rank_rows = rows;
  int64_t total = 0;
  int64_t most = 0;
  for (int64_t count : rows) {
    total += count;
    most = std::max(most, count);
  }
  m.imbalance = total > 0 ? static_cast<double>(most) * ranks_ / static_cast<double>(total) : 1.0;
  return m;
}

Result<std::vector<float>> ShardedTrainer::GatherFinalWeights() {
  // Each shard of each expert once: every rank of a routed group, the first node's under ppmoe.
  std::string mine;
  if (flow_ == Flow::kRouted || rank_ < group_size_) {
    for (int l = 0; l < model_.layers; ++l) {
      for (int e = 0; e < model_.experts; ++e) {
        if (local_of_[e] < 0) continue;
        AppendExpertPiece(l, e, member(), group_size_, {Weights(l, local_of_[e]), shard_floats_},
                          mine);
      }
    }
  }
  KEEL_ASSIGN_OR_RETURN(std::vector<std::string> all, communicator_.AllGather(mine));
  return AssembleExpertWeights(model_, all);
}

}  // namespace

Result<RankRunResult> RunShardedRank(const RankRunOptions& options) {
  if (options.communicator == nullptr || options.gate == nullptr) {
    return InvalidArgument("RunShardedRank needs a communicator and a gate");
  }
  if (options.sequences != nullptr || options.condense_threshold > 0 || options.memory != "host") {
    return InvalidArgument(
        "the sharded strategies train host memory without sequences or condensation");
  }
  ShardedTrainer trainer(options);
  KEEL_RETURN_IF_ERROR(trainer.Init());
  RankRunResult result;
  for (int64_t step = 0; step < options.model.steps; ++step) {
    KEEL_ASSIGN_OR_RETURN(StepMeasurement measurement, trainer.Step(step));
    if (options.on_step) options.on_step(measurement);
    result.steps.push_back(std::move(measurement));
  }
  KEEL_ASSIGN_OR_RETURN(result.final_weights, trainer.GatherFinalWeights());
  return result;
}

}  // namespace keel::tools
