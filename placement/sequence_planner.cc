// PlanSequences: a routing model per layer (where a sequence's rows go from each rank), a local
// search over sequence-to-rank assignments on summed link time, a second one on the cost model's
// step, and the cost model's verdict. GroupExpertsBySequences: pairwise expert swaps between
// nodes, then experts to ranks by load.
#include "placement/sequence_planner.h"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <string>

#include "common/number_text.h"

namespace keel {
namespace {

// Where one layer's rows of each expert go from each rank: to the rank itself when it holds a
// copy, else evenly to the copies on its node, else evenly to every copy.
class LayerRoutes {
 public:
  LayerRoutes(const Placement& placement, const Topology& topology)
      : placement_(placement), topology_(topology) {
    const int experts = placement.num_experts();
    const int nodes = topology.num_nodes();
    node_begin_.assign(static_cast<size_t>(experts) * nodes + 1, 0);
    for (int e = 0; e < experts; ++e) {
      for (int node = 0; node < nodes; ++node) {
        for (const int rank : placement.copy_ranks(e)) {
          if (topology.node_of(rank) == node) node_ranks_.push_back(rank);
        }
        node_begin_[static_cast<size_t>(e) * nodes + node + 1] =
            static_cast<int>(node_ranks_.size());
      }
    }
  }

  // Adds the rows `expert_rows` [num_experts] of a sequence on `rank` to `to_rank` [num_ranks].
  void AddRows(std::span<const double> expert_rows, int rank, std::span<double> to_rank) const {
    const int nodes = topology_.num_nodes();
    const int node = topology_.node_of(rank);
    for (int e = 0; e < placement_.num_experts(); ++e) {
      const double rows = expert_rows[e];
      if (rows == 0) continue;
      if (placement_.holds(rank, e)) {
        to_rank[rank] += rows;
        continue;
      }
      const size_t at = static_cast<size_t>(e) * nodes + node;
      std::span<const int> targets(node_ranks_.data() + node_begin_[at],
                                   static_cast<size_t>(node_begin_[at + 1] - node_begin_[at]));
      if (targets.empty()) targets = placement_.copy_ranks(e);
      const double share = rows / static_cast<double>(targets.size());
      for (const int target : targets) to_rank[target] += share;
    }
  }

  const Placement& placement() const { return placement_; }

 private:
  const Placement& placement_;
  const Topology& topology_;
  std::vector<int> node_ranks_;  // per (expert, node): the ranks of the expert's copies there
  std::vector<int> node_begin_;  // [num_experts * num_nodes + 1] offsets into node_ranks_
};

Status CheckInput(std::span<const Placement> layers, std::span<const SequenceTraffic> sequences,
                  const CostModel& cost, const SequencePlanOptions& options) {
  const int ranks = cost.topology().num_ranks();
  if (layers.empty()) return InvalidArgument("sequence plan: no layers to plan");
  for (size_t l = 0; l < layers.size(); ++l) {
    if (layers[l].num_ranks() != ranks || layers[l].num_experts() != layers[0].num_experts()) {
      return InvalidArgument("sequence plan: layer " + std::to_string(l) + " has " +
                             std::to_string(layers[l].num_ranks()) + " ranks x " +
                             std::to_string(layers[l].num_experts()) + " experts, expected " +
                             std::to_string(ranks) + " x " +
                             std::to_string(layers[0].num_experts()));
    }
  }
  if (!(options.max_token_imbalance >= 1.0) || !std::isfinite(options.max_token_imbalance)) {
    return InvalidArgument("sequence plan: max_token_imbalance " +
                           NumberText(options.max_token_imbalance) + " must be >= 1");
  }
  if (!(options.move_bytes_per_token >= 0) || !std::isfinite(options.move_bytes_per_token)) {
    return InvalidArgument("sequence plan: move_bytes_per_token " +
                           NumberText(options.move_bytes_per_token) + " must be >= 0");
  }
  const size_t row_size = layers.size() * static_cast<size_t>(layers[0].num_experts());
  for (size_t s = 0; s < sequences.size(); ++s) {
    const SequenceTraffic& sequence = sequences[s];
    const std::string name = "sequence plan: sequence " + std::to_string(s);
    if (sequence.origin_rank < 0 || sequence.origin_rank >= ranks) {
      return InvalidArgument(name + ": origin_rank " + std::to_string(sequence.origin_rank) +
                             " is not in [0, " + std::to_string(ranks) + ")");
    }
    if (sequence.tokens < 0) {
      return InvalidArgument(name + ": tokens " + std::to_string(sequence.tokens) + " < 0");
    }
    if (sequence.expert_rows.size() != row_size) {
      return InvalidArgument(name + ": expert_rows has " +
                             std::to_string(sequence.expert_rows.size()) + " entries, expected " +
                             std::to_string(row_size) + " (layers x experts)");
    }
    for (size_t i = 0; i < row_size; ++i) {
      const double rows = sequence.expert_rows[i];
      if (!(rows >= 0) || !std::isfinite(rows)) {
        return InvalidArgument(name + ": expert_rows[" + std::to_string(i) +
                               "] = " + std::to_string(rows) + " is not a finite count >= 0");
      }
    }
  }
  return Status::Ok();
}

// The cost model's view of one assignment: rows off rank and off node, and the summed layer time
// (expert compute + all-to-all) with the moves' time.
struct Evaluation {
  double remote_rows = 0;
  double cross_node_rows = 0;
  double layer_seconds = 0;
  double move_seconds = 0;
  double moved_bytes = 0;
  double cross_node_moved_bytes = 0;
  int moved = 0;
};

Evaluation Evaluate(std::span<const LayerRoutes> routes, std::span<const SequenceTraffic> sequences,
                    std::span<const int> rank, const CostModel& cost, double move_bytes_per_token) {
  const Topology& topology = cost.topology();
  const int ranks = topology.num_ranks();
  const int experts = routes[0].placement().num_experts();
  Evaluation evaluation;
  std::vector<double> matrix(static_cast<size_t>(ranks) * ranks);
  std::vector<double> rank_rows(ranks);
  for (size_t l = 0; l < routes.size(); ++l) {
    std::fill(matrix.begin(), matrix.end(), 0.0);
    for (size_t s = 0; s < sequences.size(); ++s) {
      const int src = rank[s];
      const std::span<const double> rows(sequences[s].expert_rows.data() + l * experts,
                                         static_cast<size_t>(experts));
      routes[l].AddRows(
          rows, src,
          {matrix.data() + static_cast<size_t>(src) * ranks, static_cast<size_t>(ranks)});
    }
    std::fill(rank_rows.begin(), rank_rows.end(), 0.0);
    for (int src = 0; src < ranks; ++src) {
      for (int dst = 0; dst < ranks; ++dst) {
        const double rows = matrix[static_cast<size_t>(src) * ranks + dst];
        rank_rows[dst] += rows;
        if (dst != src) evaluation.remote_rows += rows;
        if (!topology.same_node(src, dst)) evaluation.cross_node_rows += rows;
      }
    }
    const double most = *std::max_element(rank_rows.begin(), rank_rows.end());
    const LayerCost layer = cost.EstimateParts(routes[l].placement(), most, matrix, {}, 0.0);
    evaluation.layer_seconds += layer.compute_seconds + layer.all_to_all_seconds;
  }
  std::vector<double> there(static_cast<size_t>(ranks) * ranks, 0.0);
  std::vector<double> back(static_cast<size_t>(ranks) * ranks, 0.0);
  for (size_t s = 0; s < sequences.size(); ++s) {
    const int origin = sequences[s].origin_rank;
    if (rank[s] == origin) continue;
    const double bytes = static_cast<double>(sequences[s].tokens) * move_bytes_per_token;
    there[static_cast<size_t>(origin) * ranks + rank[s]] += bytes;
    back[static_cast<size_t>(rank[s]) * ranks + origin] += bytes;
    evaluation.moved_bytes += bytes;
    if (!topology.same_node(origin, rank[s])) evaluation.cross_node_moved_bytes += bytes;
    ++evaluation.moved;
  }
  if (evaluation.moved > 0) {
    evaluation.move_seconds = cost.TransferSeconds(there) + cost.TransferSeconds(back);
  }
  return evaluation;
}

// link_seconds[s * ranks + g]: the summed link time of sequence s's rows when it runs on rank g,
// plus its move there and back. Each byte is priced at its link's bandwidth, every pass.
std::vector<double> LinkSeconds(std::span<const LayerRoutes> routes,
                                std::span<const SequenceTraffic> sequences, const CostModel& cost,
                                double move_bytes_per_token) {
  const Topology& topology = cost.topology();
  const int ranks = topology.num_ranks();
  const int experts = routes[0].placement().num_experts();
  const double row_bytes = cost.token_row_bytes() * cost.config().all_to_all_passes;
  std::vector<double> seconds(sequences.size() * ranks, 0.0);
  std::vector<double> to_rank(ranks);
  for (size_t s = 0; s < sequences.size(); ++s) {
    for (int g = 0; g < ranks; ++g) {
      std::fill(to_rank.begin(), to_rank.end(), 0.0);
      for (size_t l = 0; l < routes.size(); ++l) {
        routes[l].AddRows(
            {sequences[s].expert_rows.data() + l * experts, static_cast<size_t>(experts)}, g,
            to_rank);
      }
      double total = 0;
      for (int r = 0; r < ranks; ++r) {
        if (r != g) total += to_rank[r] * row_bytes / topology.bandwidth(g, r);
      }
      const int origin = sequences[s].origin_rank;
      if (g != origin) {
        total += 2.0 * static_cast<double>(sequences[s].tokens) * move_bytes_per_token /
                 topology.bandwidth(origin, g);
      }
      seconds[s * ranks + g] = total;
    }
  }
  return seconds;
}

// Single moves, then pairwise swaps, while either lowers the summed link time by more than
// `tolerance`; every rank's tokens stay within its cap. Lowest index first, so the result is
// deterministic.
void LocalSearch(std::span<const double> link_seconds, std::span<const SequenceTraffic> sequences,
                 std::span<const int64_t> cap, int max_sweeps, std::vector<int>& rank,
                 std::vector<int64_t>& load) {
  const int ranks = static_cast<int>(cap.size());
  const size_t count = sequences.size();
  auto seconds = [&](size_t s, int g) { return link_seconds[s * ranks + g]; };
  double total = 0;
  for (size_t s = 0; s < count; ++s) total += seconds(s, rank[s]);
  const double tolerance = 1e-12 * total;
  for (int sweep = 0; sweep < max_sweeps; ++sweep) {
    bool improved = false;
    for (size_t s = 0; s < count; ++s) {
      const int from = rank[s];
      const int64_t tokens = sequences[s].tokens;
      int best = from;
      double best_gain = tolerance;
      for (int g = 0; g < ranks; ++g) {
        if (g == from || load[g] + tokens > cap[g]) continue;
        const double gain = seconds(s, from) - seconds(s, g);
        if (gain > best_gain) {
          best = g;
          best_gain = gain;
        }
      }
      if (best == from) continue;
      load[from] -= tokens;
      load[best] += tokens;
      rank[s] = best;
      improved = true;
    }
    for (size_t s = 0; s < count; ++s) {
      for (size_t t = s + 1; t < count; ++t) {
        const int a = rank[s];
        const int b = rank[t];
        if (a == b) continue;
        const double gain = seconds(s, a) + seconds(t, b) - seconds(s, b) - seconds(t, a);
        if (gain <= tolerance) continue;
        const int64_t delta = sequences[t].tokens - sequences[s].tokens;  // a gains, b loses
        if (load[a] + delta > cap[a] || load[b] - delta > cap[b]) continue;
        load[a] += delta;
        load[b] -= delta;
        rank[s] = b;
        rank[t] = a;
        improved = true;
      }
    }
    if (!improved) break;
  }
}

// The cost model's time of the planned layers and the moves, kept up to date as sequences
// change rank: per layer each rank's rows sent and received over each link class and the rows
// it computes, and each rank's move bytes. The same sums as Evaluate's, kept incrementally, so a
// move is priced in O(layers x ranks) instead of O(layers x ranks^2).
class PeakObjective {
 public:
  // traffic[((s * ranks + g) * layers + l) * ranks + r]: sequence s's rows to rank r in layer l
  // when it runs on g.
  PeakObjective(std::span<const SequenceTraffic> sequences, const CostModel& cost, int layers,
                std::vector<double> traffic, double move_bytes_per_token)
      : sequences_(sequences),
        cost_(cost),
        topology_(cost.topology()),
        ranks_(topology_.num_ranks()),
        layers_(layers),
        traffic_(std::move(traffic)),
        move_bytes_(move_bytes_per_token),
        rows_(static_cast<size_t>(layers) * ranks_ * kSums, 0.0),
        moves_(static_cast<size_t>(ranks_) * 4, 0.0) {}

  // Adds (sign +1) or removes (-1) sequence s running on rank g.
  void Apply(size_t s, int g, double sign) {
    for (int l = 0; l < layers_; ++l) {
      const double* to = traffic_.data() + ((s * ranks_ + g) * layers_ + l) * ranks_;
      double* layer = rows_.data() + static_cast<size_t>(l) * ranks_ * kSums;
      for (int r = 0; r < ranks_; ++r) {
        const double rows = sign * to[r];
        if (rows == 0) continue;
        layer[r * kSums + kLoad] += rows;
        if (r == g) continue;
        const int link = topology_.same_node(g, r) ? 0 : 1;
        layer[g * kSums + kSendIntra + link] += rows;
        layer[r * kSums + kReceiveIntra + link] += rows;
      }
    }
    const int origin = sequences_[s].origin_rank;
    if (g != origin) {
      const double bytes = sign * static_cast<double>(sequences_[s].tokens) * move_bytes_;
      const int link = topology_.same_node(g, origin) ? 0 : 1;
      moves_[origin * 4 + link] += bytes;  // sent by the origin
      moves_[g * 4 + 2 + link] += bytes;   // received by the runner
    }
  }

  // Expert compute + all-to-all of every layer, plus the moves there and back.
  double Seconds() const {
    const double intra = topology_.intra_node_bytes_per_second();
    const double inter = topology_.inter_node_bytes_per_second();
    const double row_bytes = cost_.token_row_bytes();
    double total = 0;
    for (int l = 0; l < layers_; ++l) {
      const double* layer = rows_.data() + static_cast<size_t>(l) * ranks_ * kSums;
      double load = 0, intra_rows = 0, inter_rows = 0;
      for (int r = 0; r < ranks_; ++r) {
        const double* sums = layer + r * kSums;
        load = std::max(load, sums[kLoad]);
        intra_rows = std::max({intra_rows, sums[kSendIntra], sums[kReceiveIntra]});
        inter_rows = std::max({inter_rows, sums[kSendInter], sums[kReceiveInter]});
      }
      total += cost_.ComputeSeconds(load) +
               cost_.config().all_to_all_passes *
                   std::max(intra_rows * row_bytes / intra, inter_rows * row_bytes / inter);
    }
    double intra_bytes = 0, inter_bytes = 0;
    for (int r = 0; r < ranks_; ++r) {
      intra_bytes = std::max({intra_bytes, moves_[r * 4], moves_[r * 4 + 2]});
      inter_bytes = std::max({inter_bytes, moves_[r * 4 + 1], moves_[r * 4 + 3]});
    }
    return total + 2.0 * std::max(intra_bytes / intra, inter_bytes / inter);
  }

 private:
  enum Sum { kLoad, kSendIntra, kSendInter, kReceiveIntra, kReceiveInter, kSums };
  std::span<const SequenceTraffic> sequences_;
  const CostModel& cost_;
  const Topology& topology_;
  const int ranks_;
  const int layers_;
  std::vector<double> traffic_;
  double move_bytes_;
  std::vector<double> rows_;   // [layer][rank][Sum]
  std::vector<double> moves_;  // [rank][sent intra, sent inter, received intra, received inter]
};

// The second search: single moves, judged by the cost model's own measure (the slowest rank's
// links and experts, which the summed link time of LocalSearch does not see); the token caps
// still hold. Swaps, which cost a pass over every pair, are left to the first search, and at
// most `sweeps` passes run: sequences are planned every step, so the search must stay cheap.
// Returns the cost model's time of the plan it ends with.
constexpr int kPeakSweeps = 8;
double PeakSearch(std::span<const LayerRoutes> routes, std::span<const SequenceTraffic> sequences,
                  const CostModel& cost, double move_bytes, std::span<const int64_t> cap,
                  int sweeps, std::vector<int>& rank, std::vector<int64_t>& load) {
  const int ranks = cost.topology().num_ranks();
  const int layers = static_cast<int>(routes.size());
  const int experts = routes[0].placement().num_experts();
  std::vector<double> traffic(sequences.size() * ranks * layers * ranks, 0.0);
  for (size_t s = 0; s < sequences.size(); ++s) {
    for (int g = 0; g < ranks; ++g) {
      for (int l = 0; l < layers; ++l) {
        routes[l].AddRows(
            {sequences[s].expert_rows.data() + static_cast<size_t>(l) * experts,
             static_cast<size_t>(experts)},
            g,
            {traffic.data() + ((s * ranks + g) * layers + l) * ranks, static_cast<size_t>(ranks)});
      }
    }
  }
  PeakObjective objective(sequences, cost, layers, std::move(traffic), move_bytes);
  for (size_t s = 0; s < sequences.size(); ++s) objective.Apply(s, rank[s], +1.0);
  double seconds = objective.Seconds();
  const double tolerance = 1e-9 * seconds;
  for (int sweep = 0; sweep < sweeps; ++sweep) {
    bool improved = false;
    for (size_t s = 0; s < sequences.size(); ++s) {
      const int from = rank[s];
      const int64_t tokens = sequences[s].tokens;
      for (int g = 0; g < ranks; ++g) {
        if (g == from || load[g] + tokens > cap[g]) continue;
        objective.Apply(s, from, -1.0);
        objective.Apply(s, g, +1.0);
        const double candidate = objective.Seconds();
        if (candidate < seconds - tolerance) {
          seconds = candidate;
          load[from] -= tokens;
          load[g] += tokens;
          rank[s] = g;
          improved = true;
          break;
        }
        objective.Apply(s, g, -1.0);
        objective.Apply(s, from, +1.0);
      }
    }
    if (!improved) break;
  }
  return seconds;
}

}  // namespace

Result<SequencePlan> PlanSequences(std::span<const Placement> layers,
                                   std::span<const SequenceTraffic> sequences,
                                   const CostModel& cost, const SequencePlanOptions& options) {
  KEEL_RETURN_IF_ERROR(CheckInput(layers, sequences, cost, options));
  const Topology& topology = cost.topology();
  const int ranks = topology.num_ranks();
  const double move_bytes =
      options.move_bytes_per_token > 0 ? options.move_bytes_per_token : cost.token_row_bytes();
  std::vector<LayerRoutes> routes;
  routes.reserve(layers.size());
  for (const Placement& placement : layers) routes.emplace_back(placement, topology);

  std::vector<int> origin(sequences.size());
  std::vector<int64_t> load(ranks, 0);
  int64_t total_tokens = 0;
  for (size_t s = 0; s < sequences.size(); ++s) {
    origin[s] = sequences[s].origin_rank;
    load[origin[s]] += sequences[s].tokens;
    total_tokens += sequences[s].tokens;
  }
  const auto limit = static_cast<int64_t>(
      std::floor(options.max_token_imbalance * static_cast<double>(total_tokens) / ranks));
  std::vector<int64_t> cap(ranks);
  for (int g = 0; g < ranks; ++g) cap[g] = std::max(limit, load[g]);

  SequencePlan plan;
  plan.rank = origin;
  const std::vector<double> link_seconds = LinkSeconds(routes, sequences, cost, move_bytes);
  std::vector<int64_t> planned_load = load;
  LocalSearch(link_seconds, sequences, cap, std::max(0, options.max_sweeps), plan.rank,
              planned_load);
  // The second search keeps a [sequences x ranks x layers x ranks] table of rows; beyond 2^23
  // entries (64 MiB) the plan is the first search's alone.
  const double table =
      static_cast<double>(sequences.size()) * ranks * ranks * static_cast<double>(layers.size());
  [[maybe_unused]] double searched = -1;
  if (options.objective == SequenceObjective::kStepTime && table <= static_cast<double>(1 << 23)) {
    searched = PeakSearch(routes, sequences, cost, move_bytes, cap,
                          std::clamp(options.max_sweeps, 0, kPeakSweeps), plan.rank, planned_load);
  }

  const Evaluation before = Evaluate(routes, sequences, origin, cost, move_bytes);
  const Evaluation after = Evaluate(routes, sequences, plan.rank, cost, move_bytes);
  // The second search's running sums and the cost model agree, up to their rounding.
  assert(searched < 0 || std::abs(searched - (after.layer_seconds + after.move_seconds)) <=
                             1e-6 * (after.layer_seconds + after.move_seconds));
  plan.remote_rows_before = before.remote_rows;
  plan.cross_node_rows_before = before.cross_node_rows;
  plan.seconds_before = before.layer_seconds;
  plan.used = after.layer_seconds + after.move_seconds < before.layer_seconds;
  const Evaluation& chosen = plan.used ? after : before;
  if (!plan.used) {
    plan.rank = origin;
    planned_load = load;
  }
  plan.remote_rows_after = chosen.remote_rows;
  plan.cross_node_rows_after = chosen.cross_node_rows;
  plan.seconds_after = chosen.layer_seconds + chosen.move_seconds;
  plan.move_seconds = chosen.move_seconds;
  plan.moved_sequences = chosen.moved;
  plan.moved_bytes = chosen.moved_bytes;
  plan.cross_node_moved_bytes = chosen.cross_node_moved_bytes;
  plan.rank_tokens = std::move(planned_load);
  return plan;
}

Result<std::vector<Placement>> GroupExpertsBySequences(std::span<const SequenceTraffic> history,
                                                       int num_layers, int num_experts,
                                                       const Topology& topology, int slots_per_rank,
                                                       const ExpertGroupingOptions& options) {
  const int ranks = topology.num_ranks();
  const int nodes = topology.num_nodes();
  KEEL_ASSIGN_OR_RETURN(const Placement initial,
                        Placement::Contiguous(num_experts, ranks, slots_per_rank));
  if (num_layers < 1) {
    return InvalidArgument("expert grouping: num_layers " + std::to_string(num_layers) +
                           " must be at least 1");
  }
  if (!(options.max_node_load_imbalance >= 1.0) ||
      !std::isfinite(options.max_node_load_imbalance)) {
    return InvalidArgument("expert grouping: max_node_load_imbalance " +
                           NumberText(options.max_node_load_imbalance) + " must be >= 1");
  }
  const size_t row = static_cast<size_t>(num_layers) * num_experts;
  for (size_t s = 0; s < history.size(); ++s) {
    if (history[s].expert_rows.size() != row) {
      return InvalidArgument("expert grouping: sequence " + std::to_string(s) + " has " +
                             std::to_string(history[s].expert_rows.size()) +
                             " expert_rows, expected " + std::to_string(row) +
                             " (layers x experts)");
    }
  }
  auto rows = [&](size_t s, int layer, int expert) {
    return history[s].expert_rows[static_cast<size_t>(layer) * num_experts + expert];
  };
  // node_of[l * E + e], on_node[s * nodes + n]: the sequence's rows on node n over all layers,
  // node_load[l * nodes + n]: the rows node n's experts take in layer l.
  std::vector<int> node_of(row);
  std::vector<double> on_node(history.size() * nodes, 0.0);
  std::vector<double> node_load(static_cast<size_t>(num_layers) * nodes, 0.0);
  std::vector<double> bound(num_layers, 0.0);
  for (int l = 0; l < num_layers; ++l) {
    double total = 0;
    for (int e = 0; e < num_experts; ++e) {
      const int node = topology.node_of(initial.copy_ranks(e)[0]);
      node_of[static_cast<size_t>(l) * num_experts + e] = node;
      for (size_t s = 0; s < history.size(); ++s) {
        on_node[s * nodes + node] += rows(s, l, e);
        node_load[static_cast<size_t>(l) * nodes + node] += rows(s, l, e);
        total += rows(s, l, e);
      }
    }
    const auto loads = std::span(node_load).subspan(static_cast<size_t>(l) * nodes, nodes);
    bound[l] = std::max(options.max_node_load_imbalance * total / nodes,
                        *std::max_element(loads.begin(), loads.end()));
  }
  // The rows a sequence keeps on its best node; the search raises the sum of these.
  auto kept = [&](size_t s, int a, double a_rows, int b, double b_rows) {
    double best = 0;
    for (int n = 0; n < nodes; ++n) {
      best = std::max(best, n == a ? a_rows : n == b ? b_rows : on_node[s * nodes + n]);
    }
    return best;
  };
  double total_rows = 0;
  for (const SequenceTraffic& sequence : history) {
    for (const double r : sequence.expert_rows) total_rows += r;
  }
  const double tolerance = 1e-12 * total_rows;
  for (int sweep = 0; sweep < options.max_sweeps && nodes > 1; ++sweep) {
    bool improved = false;
    for (int l = 0; l < num_layers; ++l) {
      int* layer_node = node_of.data() + static_cast<size_t>(l) * num_experts;
      double* load = node_load.data() + static_cast<size_t>(l) * nodes;
      for (int e0 = 0; e0 < num_experts; ++e0) {
        for (int e1 = e0 + 1; e1 < num_experts; ++e1) {
          const int a = layer_node[e0];
          const int b = layer_node[e1];
          if (a == b) continue;
          // e0 moves to b and e1 to a.
          double load_delta = 0;  // what node a gains
          for (size_t s = 0; s < history.size(); ++s) load_delta += rows(s, l, e1) - rows(s, l, e0);
          if (load[a] + load_delta > bound[l] || load[b] - load_delta > bound[l]) continue;
          double gain = 0;
          for (size_t s = 0; s < history.size(); ++s) {
            const double delta = rows(s, l, e1) - rows(s, l, e0);
            if (delta == 0) continue;
            const double a_rows = on_node[s * nodes + a];
            const double b_rows = on_node[s * nodes + b];
            gain += kept(s, a, a_rows + delta, b, b_rows - delta) - kept(s, a, a_rows, b, b_rows);
          }
          if (gain <= tolerance) continue;
          for (size_t s = 0; s < history.size(); ++s) {
            const double delta = rows(s, l, e1) - rows(s, l, e0);
            on_node[s * nodes + a] += delta;
            on_node[s * nodes + b] -= delta;
          }
          load[a] += load_delta;
          load[b] -= load_delta;
          layer_node[e0] = b;
          layer_node[e1] = a;
          improved = true;
        }
      }
    }
    if (!improved) break;
  }

  // Within each node, experts to ranks: largest load first, to the least loaded rank that has a
  // free slot (as many experts per rank as the static placement gives it).
  std::vector<Placement> placements;
  placements.reserve(num_layers);
  const int per_node = topology.gpus_per_node();
  for (int l = 0; l < num_layers; ++l) {
    std::vector<double> expert_load(num_experts, 0.0);
    for (size_t s = 0; s < history.size(); ++s) {
      for (int e = 0; e < num_experts; ++e) expert_load[e] += rows(s, l, e);
    }
    std::vector<int> order(num_experts);
    for (int e = 0; e < num_experts; ++e) order[e] = e;
    std::stable_sort(order.begin(), order.end(),
                     [&](int x, int y) { return expert_load[x] > expert_load[y]; });
    std::vector<int> free_slots(ranks);
    for (int g = 0; g < ranks; ++g) {
      free_slots[g] = static_cast<int>(
          std::count_if(initial.phy2log().begin() + static_cast<ptrdiff_t>(g) * slots_per_rank,
                        initial.phy2log().begin() + static_cast<ptrdiff_t>(g + 1) * slots_per_rank,
                        [](int e) { return e != kEmptySlot; }));
    }
    std::vector<double> rank_load(ranks, 0.0);
    std::vector<std::vector<int>> rank_experts(ranks);
    for (const int e : order) {
      const int node = node_of[static_cast<size_t>(l) * num_experts + e];
      int best = -1;
      for (int g = node * per_node; g < (node + 1) * per_node; ++g) {
        if (free_slots[g] > 0 && (best < 0 || rank_load[g] < rank_load[best])) best = g;
      }
      // Swaps keep every node's expert count, so its ranks always have a free slot.
      --free_slots[best];
      rank_load[best] += expert_load[e];
      rank_experts[best].push_back(e);
    }
    std::vector<int> phy2log(static_cast<size_t>(ranks) * slots_per_rank, kEmptySlot);
    for (int g = 0; g < ranks; ++g) {
      std::sort(rank_experts[g].begin(), rank_experts[g].end());
      for (size_t i = 0; i < rank_experts[g].size(); ++i) {
        phy2log[static_cast<size_t>(g) * slots_per_rank + i] = rank_experts[g][i];
      }
    }
    KEEL_ASSIGN_OR_RETURN(Placement placement,
                          Placement::Create(num_experts, ranks, std::move(phy2log)));
    placements.push_back(std::move(placement));
  }
  return placements;
}

}  // namespace keel
