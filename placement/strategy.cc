// Strategies: the step of a layer whose experts are sharded (esp, parm) or tensor-sliced (ppmoe),
// the price of switching a layer between strategies, and SmartMoE's pool and online choice.
#include "placement/strategy.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

namespace keel {

std::string_view StrategyName(Strategy strategy) {
  switch (strategy) {
    case Strategy::kEp:
      return "ep";
    case Strategy::kEsp:
      return "esp";
    case Strategy::kParm:
      return "parm";
    case Strategy::kPpmoe:
      return "ppmoe";
  }
  return "unknown";
}

Result<Strategy> ParseStrategy(std::string_view name) {
  for (Strategy strategy : kAllStrategies) {
    if (StrategyName(strategy) == name) return strategy;
  }
  return InvalidArgument("strategy '" + std::string(name) + "' is not one of ep, esp, parm, ppmoe");
}

int ShardDegree(const StrategyConfig& config, int gpus_per_node) {
  return config.shard_degree > 0 ? config.shard_degree : gpus_per_node;
}

int MpDegree(const StrategyConfig& config, int gpus_per_node) {
  if (config.mp_degree > 0) return config.mp_degree;
  for (int divisor = 2; divisor <= gpus_per_node; ++divisor) {
    if (gpus_per_node % divisor == 0) return divisor;
  }
  return 1;
}

namespace {

// Messages each rank sends in one exchange there and back of `rows` [num_ranks * num_ranks]
// (by source): one to each rank it sends rows to, one back to each rank it received rows from.
std::vector<int> ExchangeMessages(std::span<const double> rows, int num_ranks) {
  std::vector<int> messages(num_ranks, 0);
  for (int src = 0; src < num_ranks; ++src) {
    for (int dst = 0; dst < num_ranks; ++dst) {
      if (src == dst || rows[static_cast<size_t>(src) * num_ranks + dst] <= 0) continue;
      ++messages[src];  // dispatch
      ++messages[dst];  // combine, back
    }
  }
  return messages;
}

}  // namespace

StrategyCost EpStrategyCost(const CostModel& cost, const LayerCost& layer,
                            const StepRouting& routing) {
  StrategyCost out;
  out.compute_seconds = layer.compute_seconds;
  out.all_to_all_seconds = layer.all_to_all_seconds;
  out.sync_seconds = layer.replica_sync_seconds + layer.transient_seconds;
  out.migration_seconds = layer.exposed_migration_seconds;
  out.compute_imbalance = routing.imbalance();
  double rows = 0;
  for (int src = 0; src < routing.num_ranks; ++src) {
    for (int dst = 0; dst < routing.num_ranks; ++dst) {
      if (src != dst)
        rows += routing.sent_tokens[static_cast<size_t>(src) * routing.num_ranks + dst];
    }
  }
  out.link_bytes = rows * cost.token_row_bytes() * cost.config().all_to_all_passes;
  const std::vector<int> messages = ExchangeMessages(routing.sent_tokens, routing.num_ranks);
  out.messages_per_rank = *std::max_element(messages.begin(), messages.end());
  return out;
}

int ContiguousOwner(int expert, int num_experts, int count) {
  const int base = num_experts / count;
  const int extra = num_experts % count;  // the first `extra` owners hold base + 1
  if (expert < extra * (base + 1)) return expert / (base + 1);
  return extra + (expert - extra * (base + 1)) / base;
}

Result<StrategyModel> StrategyModel::Create(const CostModel& cost, const StrategyConfig& config) {
  const int per_node = cost.topology().gpus_per_node();
  for (auto [name, degree] :
       {std::pair<const char*, int>{"strategy.shard_degree", config.shard_degree},
        {"strategy.mp_degree", config.mp_degree}}) {
    if (degree < 0 || (degree > 0 && per_node % degree != 0)) {
      return InvalidArgument(std::string(name) + ": " + std::to_string(degree) +
                             " does not divide topology.gpus_per_node (" +
                             std::to_string(per_node) + ")");
    }
  }
  if (config.parm_chunks < 1) {
    return InvalidArgument("strategy.parm_chunks: " + std::to_string(config.parm_chunks) +
                           " must be >= 1");
  }
  Result<std::vector<GemmEfficiencyPoint>> curve =
      ParseGemmEfficiencyCurve(cost.config().gemm_efficiency);
  if (!curve.ok()) return curve.status().WithContext("cost_model.gemm_efficiency");
  return StrategyModel(cost, config, std::move(curve).value());
}

StrategyModel::StrategyModel(const CostModel& cost, const StrategyConfig& config,
                             std::vector<GemmEfficiencyPoint> curve)
    : cost_(&cost),
      config_(config),
      curve_(std::move(curve)),
      shard_degree_(ShardDegree(config, cost.topology().gpus_per_node())),
      mp_degree_(MpDegree(config, cost.topology().gpus_per_node())) {}

int StrategyModel::ShardsOf(Strategy strategy) const {
  switch (strategy) {
    case Strategy::kEp:
      return 1;
    case Strategy::kEsp:
      return shard_degree_;
    case Strategy::kParm:
      return mp_degree_;
    case Strategy::kPpmoe:
      return cost_->topology().gpus_per_node();
  }
  return 1;
}

double StrategyModel::CurveAt(double columns) const {
  if (curve_.empty()) return 1.0;
  if (columns <= curve_.front().columns) return curve_.front().efficiency;
  if (columns >= curve_.back().columns) return curve_.back().efficiency;
  size_t above = 1;
  while (curve_[above].columns < columns) ++above;
  const GemmEfficiencyPoint& low = curve_[above - 1];
  const GemmEfficiencyPoint& high = curve_[above];
  // GEMM throughput grows with the log of the width, so interpolate on log2(columns).
  const double t = (std::log2(columns) - std::log2(low.columns)) /
                   (std::log2(high.columns) - std::log2(low.columns));
  return low.efficiency + t * (high.efficiency - low.efficiency);
}

double StrategyModel::RelativeGemmEfficiency(double columns) const {
  return CurveAt(columns) / CurveAt(cost_->config().expert_ffn_size);
}

Result<StrategyCost> StrategyModel::Estimate(Strategy strategy, const StepLoad& load) const {
  const int num_ranks = cost_->topology().num_ranks();
  if (load.num_sources != num_ranks) {
    return InvalidArgument("load has " + std::to_string(load.num_sources) +
                           " source ranks, the topology " + std::to_string(num_ranks));
  }
  switch (strategy) {
    case Strategy::kEp:
      return InvalidArgument(
          "ep is priced on a placement by CostModel::Estimate, not by StrategyModel");
    case Strategy::kEsp:
      return EstimateSharded(load, shard_degree_, /*parm=*/false);
    case Strategy::kParm:
      return EstimateSharded(load, mp_degree_, /*parm=*/true);
    case Strategy::kPpmoe:
      return EstimatePpmoe(load);
  }
  return InvalidArgument("unknown strategy");
}

namespace {

// All-gather inside one group whose members hold `held` rows each: every member sends its own
// to each of the others and receives theirs, over the node's links. Returns the slowest
// member's bytes (send or receive) and adds every member's sends to `sent_bytes`.
double GroupGatherPeakBytes(std::span<const double> held, double row_bytes, double& sent_bytes) {
  double total = 0;
  for (double rows : held) total += rows;
  const double others = static_cast<double>(held.size()) - 1;
  double peak = 0;
  for (double rows : held) {
    peak = std::max({peak, others * rows * row_bytes, (total - rows) * row_bytes});
    sent_bytes += others * rows * row_bytes;
  }
  return peak;
}

}  // namespace

StrategyCost StrategyModel::EstimateSharded(const StepLoad& load, int group_size, bool parm) const {
  const Topology& topology = cost_->topology();
  const CostModelConfig& constants = cost_->config();
  const int num_ranks = topology.num_ranks();
  const int num_groups = num_ranks / group_size;
  const int num_experts = load.num_experts;
  const double row_bytes = cost_->token_row_bytes();
  const double passes = constants.all_to_all_passes;

  // Exchange: each rank sends its rows of an expert to the member of the expert's group that
  // sits at its own position in its group, so each row crosses the network at most once.
  std::vector<double> exchange(static_cast<size_t>(num_ranks) * num_ranks, 0.0);
  std::vector<double> received(num_ranks, 0.0);  // rows each member holds after the exchange
  std::vector<double> group_rows(num_groups, 0.0);
  std::vector<double> source_rows(num_ranks, 0.0);  // rows each rank routed
  for (int source = 0; source < num_ranks; ++source) {
    for (int e = 0; e < num_experts; ++e) {
      const double rows = load.at(source, e);
      if (rows <= 0) continue;
      const int group = ContiguousOwner(e, num_experts, num_groups);
      const int member = group * group_size + source % group_size;
      received[member] += rows;
      group_rows[group] += rows;
      source_rows[source] += rows;
      if (member != source) exchange[static_cast<size_t>(source) * num_ranks + member] += rows;
    }
  }
  std::vector<int> messages = ExchangeMessages(exchange, num_ranks);
  double exchange_bytes = 0;
  for (double& rows : exchange) {
    rows *= row_bytes;
    exchange_bytes += rows;
  }
  const double exchange_seconds = cost_->TransferSeconds(exchange);

  // All-gather of the rows inside each group (the combine's reduce-scatter of partial outputs
  // moves as many bytes the other way).
  double gather_peak = 0;
  double gather_bytes = 0;
  for (int group = 0; group < num_groups; ++group) {
    const std::span<const double> held(received.data() + group * group_size, group_size);
    gather_peak = std::max(gather_peak, GroupGatherPeakBytes(held, row_bytes, gather_bytes));
    // A member sends its rows to each other member (all-gather), and each other member's
    // block of partial outputs to that member (reduce-scatter).
    for (int j = 0; j < group_size; ++j) {
      for (int m = 0; m < group_size; ++m) {
        if (m == j) continue;
        if (held[j] > 0) ++messages[group * group_size + j];
        if (held[m] > 0) ++messages[group * group_size + j];
      }
    }
  }
  const double gather_seconds = gather_peak / topology.intra_node_bytes_per_second();

  StrategyCost cost;
  cost.all_to_all_seconds = exchange_seconds * passes;
  if (parm) {
    // Parm's overlapped schedule: the pass is cut into chunks, and each chunk's all-gather runs
    // while the next chunk is exchanged; what stays exposed beyond the exchange is charged here.
    const double chunks = config_.parm_chunks;
    const double overlapped = std::max(exchange_seconds, gather_seconds) +
                              std::min(exchange_seconds, gather_seconds) / chunks;
    cost.all_reduce_seconds = (overlapped - exchange_seconds) * passes;
    // The MP group's ranks hold the same tokens and each routed only its share of them: the
    // layer's output (forward) and input gradient (backward) are all-gathered in the group.
    double mp_peak = 0;
    double mp_bytes = 0;
    const double token_bytes = row_bytes / constants.top_k;
    for (int group = 0; group < num_groups; ++group) {
      const std::span<const double> held(source_rows.data() + group * group_size, group_size);
      mp_peak = std::max(mp_peak, GroupGatherPeakBytes(held, token_bytes, mp_bytes));
      for (int j = 0; j < group_size; ++j) {
        if (held[j] > 0) messages[group * group_size + j] += group_size - 1;
      }
    }
    cost.all_reduce_seconds += mp_peak / topology.intra_node_bytes_per_second() * (passes / 2);
    gather_bytes += mp_bytes / 2;  // counted over `passes` below
  } else {
    cost.all_reduce_seconds = gather_seconds * passes;
  }

  double most_rows = 0;
  double all_rows = 0;
  for (double rows : group_rows) {
    most_rows = std::max(most_rows, rows);
    all_rows += rows;
  }
  const double shard_columns = static_cast<double>(constants.expert_ffn_size) / group_size;
  cost.compute_seconds =
      cost_->ComputeSeconds(most_rows) / group_size / RelativeGemmEfficiency(shard_columns);
  cost.compute_imbalance = all_rows > 0 ? most_rows / (all_rows / num_groups) : 1.0;
  cost.link_bytes = (exchange_bytes + gather_bytes) * passes;
  cost.messages_per_rank = *std::max_element(messages.begin(), messages.end());
  return cost;
}

StrategyCost StrategyModel::EstimatePpmoe(const StepLoad& load) const {
  const Topology& topology = cost_->topology();
  const CostModelConfig& constants = cost_->config();
  const int per_node = topology.gpus_per_node();
  const int num_nodes = topology.num_nodes();
  const double row_bytes = cost_->token_row_bytes();
  const double passes = constants.all_to_all_passes;

  // Every rank of a node holds the node's tokens and a slice of every expert: dispatch is
  // slicing, and each rank runs its slice for all of the node's rows.
  std::vector<double> node_rows(num_nodes, 0.0);
  for (int source = 0; source < load.num_sources; ++source) {
    for (int e = 0; e < load.num_experts; ++e) {
      node_rows[topology.node_of(source)] += load.at(source, e);
    }
  }
  double most_rows = 0;
  double all_rows = 0;
  for (double rows : node_rows) {
    most_rows = std::max(most_rows, rows);
    all_rows += rows;
  }

  StrategyCost cost;
  const double slice_columns = static_cast<double>(constants.expert_ffn_size) / per_node;
  cost.compute_seconds =
      cost_->ComputeSeconds(most_rows) / per_node / RelativeGemmEfficiency(slice_columns);
  cost.compute_imbalance = all_rows > 0 ? most_rows / (all_rows / num_nodes) : 1.0;

  // Combine: a ring all-reduce of the node's token outputs (forward) and input gradients
  // (backward); each rank sends and receives 2 (P - 1) / P of them.
  const double ring = 2.0 * (per_node - 1) / per_node;
  const double token_bytes = row_bytes / constants.top_k;
  cost.all_reduce_seconds =
      ring * most_rows * token_bytes / topology.intra_node_bytes_per_second() * (passes / 2);
  cost.link_bytes = ring * all_rows * token_bytes * (passes / 2);
  // A ring all-reduce sends P - 1 pieces to reduce and P - 1 to gather.
  cost.messages_per_rank = most_rows > 0 ? 2 * (per_node - 1) : 0;

  // Each node holds every expert, so each slice has a copy per node whose gradients are reduced
  // and weights returned over the network, as a replica's are (replica_sync_passes).
  if (num_nodes > 1) {
    const double slice_bytes = cost_->expert_weight_bytes() * load.num_experts / per_node;
    const double per_rank = slice_bytes * constants.replica_sync_passes * (num_nodes - 1) /
                            static_cast<double>(num_nodes);
    cost.sync_seconds = per_rank / topology.inter_node_bytes_per_second();
  }
  return cost;
}

void StrategyModel::StateShares(const StrategyLayout& layout, int expert, int num_experts,
                                std::span<double> shares) const {
  std::fill(shares.begin(), shares.end(), 0.0);
  const int num_ranks = static_cast<int>(shares.size());
  switch (layout.strategy) {
    case Strategy::kEp:
      shares[layout.ep_homes.empty() ? ContiguousOwner(expert, num_experts, num_ranks)
                                     : layout.ep_homes[expert]] = 1.0;
      return;
    case Strategy::kPpmoe: {
      // A full copy per node, sliced over its ranks.
      const double share = 1.0 / cost_->topology().gpus_per_node();
      std::fill(shares.begin(), shares.end(), share);
      return;
    }
    case Strategy::kEsp:
    case Strategy::kParm: {
      const int size = ShardsOf(layout.strategy);
      const int group = ContiguousOwner(expert, num_experts, num_ranks / size);
      for (int member = 0; member < size; ++member) shares[group * size + member] = 1.0 / size;
      return;
    }
  }
}

double StrategyModel::SwitchSeconds(const StrategyLayout& from, const StrategyLayout& to,
                                    int num_experts) const {
  if (from.strategy == to.strategy && from.strategy != Strategy::kEp) return 0;
  const Topology& topology = cost_->topology();
  const int num_ranks = topology.num_ranks();
  std::vector<double> before(num_ranks), after(num_ranks);
  std::vector<double> received(static_cast<size_t>(num_ranks) * 2, 0.0);  // [rank][intra, inter]
  std::vector<char> node_held(topology.num_nodes());
  for (int e = 0; e < num_experts; ++e) {
    StateShares(from, e, num_experts, before);
    StateShares(to, e, num_experts, after);
    std::fill(node_held.begin(), node_held.end(), 0);
    for (int rank = 0; rank < num_ranks; ++rank) {
      if (before[rank] > 0) node_held[topology.node_of(rank)] = 1;
    }
    for (int rank = 0; rank < num_ranks; ++rank) {
      const double gained = after[rank] - before[rank];
      if (gained <= 0) continue;
      const int link = node_held[topology.node_of(rank)] ? 0 : 1;
      received[static_cast<size_t>(rank) * 2 + link] += gained * cost_->home_move_bytes();
    }
  }
  double seconds = 0;
  for (int rank = 0; rank < num_ranks; ++rank) {
    seconds = std::max({seconds, received[rank * 2] / topology.intra_node_bytes_per_second(),
                        received[rank * 2 + 1] / topology.inter_node_bytes_per_second()});
  }
  return seconds;
}

namespace {

// The sample standard deviation of `values` (0 for fewer than two).
double SampleDeviation(std::span<const double> values) {
  const size_t n = values.size();
  if (n < 2) return 0;
  double mean = 0;
  for (double v : values) mean += v;
  mean /= static_cast<double>(n);
  double squares = 0;
  for (double v : values) squares += (v - mean) * (v - mean);
  return std::sqrt(squares / static_cast<double>(n - 1));
}

// The pool's first member: `best`, the least total, unless another candidate ties with it (its
// mean excess over `best`, step by step, is within that excess's standard error) and its own
// steps spread less; then the steadiest such candidate. On a few profiling steps a lead of a
// hair is noise, and the steadier strategy is the safer start.
int PoolStart(std::span<const std::vector<double>> costs, int best) {
  const size_t steps = costs[best].size();
  if (steps < 2) return best;
  int start = best;
  double start_deviation = SampleDeviation(costs[best]);
  std::vector<double> excess(steps);
  for (int c = 0; c < static_cast<int>(costs.size()); ++c) {
    if (c == best) continue;
    double mean_excess = 0;
    for (size_t t = 0; t < steps; ++t) {
      excess[t] = costs[c][t] - costs[best][t];
      mean_excess += excess[t];
    }
    mean_excess /= static_cast<double>(steps);
    const double standard_error = SampleDeviation(excess) / std::sqrt(static_cast<double>(steps));
    const double deviation = SampleDeviation(costs[c]);
    if (mean_excess <= standard_error && deviation < start_deviation) {
      start = c;
      start_deviation = deviation;
    }
  }
  return start;
}

}  // namespace

std::vector<int> SelectPool(std::span<const std::vector<double>> costs, int size) {
  const int candidates = static_cast<int>(costs.size());
  std::vector<int> pool;
  if (candidates == 0) return pool;
  const size_t steps = costs[0].size();
  std::vector<double> best(steps, std::numeric_limits<double>::infinity());
  std::vector<char> picked(candidates, 0);
  for (int round = 0; round < std::min(size, candidates); ++round) {
    int choice = -1;
    double choice_total = 0;
    for (int c = 0; c < candidates; ++c) {
      if (picked[c]) continue;
      double total = 0;
      for (size_t t = 0; t < steps; ++t) total += std::min(best[t], costs[c][t]);
      if (choice < 0 || total < choice_total) {
        choice = c;
        choice_total = total;
      }
    }
    if (round == 0) choice = PoolStart(costs, choice);
    picked[choice] = 1;
    pool.push_back(choice);
    for (size_t t = 0; t < steps; ++t) best[t] = std::min(best[t], costs[choice][t]);
  }
  return pool;
}

int ChooseStrategy(int current, std::span<const double> estimated, std::span<const double> spread,
                   std::span<const double> switch_seconds, const StrategyConfig& config) {
  int best = current;
  for (int i = 0; i < static_cast<int>(estimated.size()); ++i) {
    if (estimated[i] < estimated[best]) best = i;
  }
  if (best == current) return current;
  // The gain counts only as far as it stands out of the estimates' own spread.
  const double gain = estimated[current] - estimated[best] -
                      std::sqrt(spread[current] * spread[current] + spread[best] * spread[best]);
  if (gain <= 0 || gain < config.min_gain_fraction * estimated[current]) return current;
  if (gain * config.switch_payback_steps < switch_seconds[best]) return current;
  return best;
}

}  // namespace keel
