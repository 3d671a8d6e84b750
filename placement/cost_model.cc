// Cost model: one layer's predicted step time and the cost of changing its placement.
#include "placement/cost_model.h"

#include <algorithm>
#include <span>
#include <utility>
#include <vector>

namespace keel {
namespace {

// Bytes each rank sends and receives over its intra-node and inter-node links. The two link
// classes and the two directions run concurrently, so a rank's time is the slowest of the four.
class LinkLoad {
 public:
  // rank_node: [num_ranks] node of each rank.
  LinkLoad(const Topology& topology, std::span<const int> rank_node)
      : topology_(topology),
        rank_node_(rank_node),
        bytes_(static_cast<size_t>(topology.num_ranks()) * 4, 0.0) {}

  void Add(int src, int dst, double bytes) {
    Add(src, dst, rank_node_[src] == rank_node_[dst] ? 0 : 1, bytes);
  }
  // `link`: 0 within a node, 1 between nodes.
  void Add(int src, int dst, int link, double bytes) {
    if (src == dst || bytes <= 0) return;
    bytes_[static_cast<size_t>(src) * 4 + link] += bytes;      // send
    bytes_[static_cast<size_t>(dst) * 4 + 2 + link] += bytes;  // receive
  }

  // Add(src, dst, rows[dst] * bytes_per_row) for dst = 0 .. num_rows - 1 in order, the hot loop of
  // every estimate: ranks of a node are contiguous, so the row splits into the ranks before the
  // node, the node and the ranks after it, with no per-pair lookup. The two send sums stay in
  // registers (same order of additions, so the same bits): through memory, each addition would
  // wait for the previous one's store.
  void AddRow(int src, const double* rows, int num_rows, double bytes_per_row) {
    const int per_node = topology_.gpus_per_node();
    const int node_begin = std::min(rank_node_[src] * per_node, num_rows);
    const int node_end = std::min(node_begin + per_node, num_rows);
    double* send = bytes_.data() + static_cast<size_t>(src) * 4;
    double* receive = bytes_.data() + 2;
    auto add = [&](int dst, int link, double& sent) {
      const double bytes = rows[dst] * bytes_per_row;
      if (bytes <= 0) return;
      sent += bytes;
      receive[static_cast<size_t>(dst) * 4 + link] += bytes;
    };
    double sent_intra = send[0];
    double sent_inter = send[1];
    for (int dst = 0; dst < node_begin; ++dst) add(dst, 1, sent_inter);
    for (int dst = node_begin; dst < std::min(src, node_end); ++dst) add(dst, 0, sent_intra);
    for (int dst = src + 1; dst < node_end; ++dst) add(dst, 0, sent_intra);
    for (int dst = node_end; dst < num_rows; ++dst) add(dst, 1, sent_inter);
    send[0] = sent_intra;
    send[1] = sent_inter;
  }

  double SlowestRankSeconds() const {
    // Rounding is monotone, so dividing the largest byte count of each link class gives the
    // same seconds as dividing every count first, with two divisions instead of one per count.
    double most[2] = {0, 0};
    for (size_t i = 0; i < bytes_.size(); ++i) most[i % 2] = std::max(most[i % 2], bytes_[i]);
    return std::max({0.0, most[0] / topology_.intra_node_bytes_per_second(),
                     most[1] / topology_.inter_node_bytes_per_second()});
  }

 private:
  const Topology& topology_;
  std::span<const int> rank_node_;
  std::vector<double> bytes_;  // [rank][send intra, send inter, recv intra, recv inter]
};

}  // namespace

CostModel::CostModel(const Topology& topology, const CostModelConfig& config)
    : topology_(topology), config_(config), rank_node_(topology.num_ranks()) {
  for (int rank = 0; rank < topology.num_ranks(); ++rank) rank_node_[rank] = topology.node_of(rank);
}

double CostModel::expert_parameters() const {
  return static_cast<double>(config_.expert_matrices) * config_.hidden_size *
         config_.expert_ffn_size;
}

double CostModel::expert_weight_bytes() const { return expert_parameters() * config_.dtype_bytes; }

double CostModel::home_move_bytes() const {
  return expert_parameters() * config_.home_move_bytes_per_parameter;
}

double CostModel::token_row_bytes() const {
  return static_cast<double>(config_.hidden_size) * config_.dtype_bytes;
}

double CostModel::ComputeSeconds(double tokens) const {
  const double flops_per_token = 2.0 * expert_parameters() * config_.train_flops_multiplier;
  return tokens * flops_per_token / (config_.expert_tflops * 1e12);
}

LayerCost CostModel::Estimate(const Placement& placement, const StepRouting& routing,
                              double migration_seconds) const {
  LayerCost cost;
  cost.compute_seconds = ComputeSeconds(routing.max_rank_tokens());

  LinkLoad a2a(topology_, rank_node_);
  for (int src = 0; src < routing.num_ranks; ++src) {
    a2a.AddRow(src, routing.sent_tokens.data() + static_cast<size_t>(src) * routing.num_ranks,
               routing.num_ranks, token_row_bytes());
  }
  cost.all_to_all_seconds = a2a.SlowestRankSeconds() * config_.all_to_all_passes;

  cost.replica_sync_seconds = ReplicaSyncSeconds(placement);
  cost.transient_seconds = TransientSeconds(placement, routing.transients);

  const double overlap_window = cost.compute_seconds + cost.all_to_all_seconds;
  cost.exposed_migration_seconds = std::max(0.0, migration_seconds - overlap_window);
  return cost;
}

double CostModel::ReplicaSyncSeconds(const Placement& placement) const {
  // The copies of an expert form a ring over their distinct ranks (ascending, so node-local
  // neighbours): gradients reduce into the home and new weights return along it, each edge
  // carrying (m-1)/m of the weights per pass, as a ring reduce / broadcast does.
  LinkLoad sync(topology_, rank_node_);
  // Distinct ranks of one expert's copies and their nodes.
  std::vector<std::pair<int, int>> ring;
  for (int e = 0; e < placement.num_experts(); ++e) {
    if (placement.copies(e).size() < 2) continue;
    // Copies are in slot order, so equal ranks are adjacent.
    ring.clear();
    for (int rank : placement.copy_ranks(e)) {
      if (ring.empty() || ring.back().first != rank) {
        ring.push_back({rank, rank_node_[rank]});
      }
    }
    const int m = static_cast<int>(ring.size());
    if (m < 2) continue;
    const double edge_bytes = expert_weight_bytes() * config_.replica_sync_passes * (m - 1) / m;
    for (int i = 0; i < m; ++i) {
      const auto& [from, from_node] = ring[i];
      const auto& [to, to_node] = ring[i + 1 < m ? i + 1 : 0];  // the last edge closes the ring
      sync.Add(from, to, from_node == to_node ? 0 : 1, edge_bytes);
    }
  }
  return sync.SlowestRankSeconds();
}

double CostModel::TransientSeconds(const Placement& placement,
                                   std::span<const TransientReplica> transients) const {
  if (transients.empty()) return 0;
  // Transient replicas of one expert are filled by a pipelined chain from the source through
  // the receivers in the order they were added, and return their gradients along the reverse chain.
  LinkLoad fill(topology_, rank_node_);
  std::vector<int> chain_end(placement.num_experts(), -1);  // last rank of each expert's chain
  for (const TransientReplica& t : transients) {
    const int previous = chain_end[t.expert] >= 0 ? chain_end[t.expert] : t.source_rank;
    fill.Add(previous, t.rank, expert_weight_bytes());
    fill.Add(t.rank, previous, expert_weight_bytes());
    chain_end[t.expert] = t.rank;
  }
  return fill.SlowestRankSeconds();
}

MigrationCost CostModel::Migration(const Placement& from, const Placement& to) const {
  MigrationCost cost;
  const PlacementChange change = DiffPlacements(from, to);
  cost.changed_slots = change.changed_slots;
  cost.moved_homes = change.moved_homes;

  // Nearest holder in `from`: same node first, then the home.
  auto source_for = [&](int expert, int rank) {
    for (int holder : from.copy_ranks(expert)) {
      if (holder != rank && rank_node_[holder] == rank_node_[rank]) return holder;
    }
    return from.home(expert);
  };

  LinkLoad links(topology_, rank_node_);
  std::vector<char> home_fed(to.num_experts(), 0);
  for (int slot = 0; slot < to.num_slots(); ++slot) {
    const int e = to.expert_at(slot);
    if (e == kEmptySlot || e == from.expert_at(slot)) continue;
    const int rank = to.rank_of_slot(slot);
    if (from.holds(rank, e)) continue;  // a local copy crosses no link
    const bool new_home = to.home(e) == rank && from.home(e) != rank;
    const double bytes = new_home ? home_move_bytes() : expert_weight_bytes();
    const int source = new_home ? from.home(e) : source_for(e, rank);
    if (new_home) home_fed[e] = 1;
    links.Add(source, rank, bytes);
    cost.bytes += bytes;
  }
  // A home that moved onto a rank that already held a replica still receives the rest of the
  // master weights and optimizer state.
  for (int e = 0; e < to.num_experts(); ++e) {
    if (to.home(e) == from.home(e) || home_fed[e]) continue;
    const double bytes = home_move_bytes() - expert_weight_bytes();
    links.Add(from.home(e), to.home(e), bytes);
    cost.bytes += bytes;
  }
  cost.seconds = links.SlowestRankSeconds();
  return cost;
}

}  // namespace keel
