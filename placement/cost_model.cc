// Cost model: one layer's predicted step time and the cost of changing its placement.
#include "placement/cost_model.h"

#include <algorithm>
#include <array>
#include <cassert>
#include <cmath>
#include <cstring>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "common/number_text.h"
#include "common/simd.h"

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

  double SlowestRankSeconds() const {
    // Rounding is monotone, so dividing the largest byte count of each link class gives the
    // same seconds as dividing every count first, with two divisions instead of one per count.
    double most[2] = {0, 0};
    for (size_t i = 0; i < bytes_.size(); i += 2) {
      most[0] = std::max(most[0], bytes_[i]);
      most[1] = std::max(most[1], bytes_[i + 1]);
    }
    return std::max({0.0, most[0] / topology_.intra_node_bytes_per_second(),
                     most[1] / topology_.inter_node_bytes_per_second()});
  }

 private:
  const Topology& topology_;
  std::span<const int> rank_node_;
  std::vector<double> bytes_;  // [rank][send intra, send inter, recv intra, recv inter]
};

// For dst in [begin, end), ascending, the all-to-all pair (src, dst) of one link class carries
// bytes = row[dst] * bytes_per_row: receive[dst] += bytes, and the sender's sum `sent` += bytes.
// Returns `sent`. As in LinkLoad::Add, pairs with bytes <= 0 carry nothing; here they add +0.0,
// which leaves every sum as it was (sums start at +0.0 and only grow by positive or NaN terms),
// so four receivers take one vector addition and no branch depends on the data. The product
// and the sums stay separate roundings: ISO C++ mode does not contract them into FMAs, and AVX2
// alone has no FMA instruction.
KEEL_AVX2_CLONES double AddToLink(const double* row, int begin, int end, double bytes_per_row,
                                  double* receive, double sent) {
  const DoubleQuad zero = {};
  int dst = begin;
  for (; dst + 4 <= end; dst += 4) {
    DoubleQuad bytes, received;
    std::memcpy(&bytes, row + dst, sizeof bytes);
    bytes *= bytes_per_row;
    bytes = bytes <= 0 ? zero : bytes;
    std::memcpy(&received, receive + dst, sizeof received);
    received += bytes;
    std::memcpy(receive + dst, &received, sizeof received);
    sent = (((sent + bytes[0]) + bytes[1]) + bytes[2]) + bytes[3];
  }
  for (; dst < end; ++dst) {
    const double bytes = row[dst] * bytes_per_row;
    if (bytes <= 0) continue;
    receive[dst] += bytes;
    sent += bytes;
  }
  return sent;
}

// AddToLink for up to four sources at once (`rows`, `sums` [count]) over the same range, in
// lockstep: each sender's sum is a chain of additions in destination order, and one chain at a
// time would wait on the adder's latency at every step. Receivers add the sources in the order
// given, as one source after another would.
KEEL_AVX2_CLONES void AddToLinkInLockstep(const double* const* rows, int count, int begin, int end,
                                          double bytes_per_row, double* receive, double* sums) {
  const DoubleQuad zero = {};
  // Row `row`'s pairs with destinations dst .. dst + 3.
  auto add_quad = [&](const double* row, int dst, DoubleQuad& received, double& sum) {
    DoubleQuad bytes;
    std::memcpy(&bytes, row + dst, sizeof bytes);
    bytes *= bytes_per_row;
    bytes = bytes <= 0 ? zero : bytes;
    received += bytes;
    sum = (((sum + bytes[0]) + bytes[1]) + bytes[2]) + bytes[3];
  };
  int dst = begin;
  if (count == 4) {
    // Four named sums stay in registers; an array indexed in a loop would go through memory.
    double sum0 = sums[0], sum1 = sums[1], sum2 = sums[2], sum3 = sums[3];
    for (; dst + 4 <= end; dst += 4) {
      DoubleQuad received;
      std::memcpy(&received, receive + dst, sizeof received);
      add_quad(rows[0], dst, received, sum0);
      add_quad(rows[1], dst, received, sum1);
      add_quad(rows[2], dst, received, sum2);
      add_quad(rows[3], dst, received, sum3);
      std::memcpy(receive + dst, &received, sizeof received);
    }
    sums[0] = sum0;
    sums[1] = sum1;
    sums[2] = sum2;
    sums[3] = sum3;
  }
  for (; dst + 4 <= end; dst += 4) {
    DoubleQuad received;
    std::memcpy(&received, receive + dst, sizeof received);
    for (int k = 0; k < count; ++k) add_quad(rows[k], dst, received, sums[k]);
    std::memcpy(receive + dst, &received, sizeof received);
  }
  for (; dst < end; ++dst) {
    for (int k = 0; k < count; ++k) {
      const double bytes = rows[k][dst] * bytes_per_row;
      if (bytes <= 0) continue;
      receive[dst] += bytes;
      sums[k] += bytes;
    }
  }
}

// One pass of the all-to-all of `sent_tokens` [num_ranks * num_ranks]: the most bytes any rank
// sends or receives over each link class, the same sums as LinkLoad::Add for every pair, row by
// row. The receive sums sit in two plain arrays, one per link class, so that four receivers take
// one vector addition.
LinkPeaks AllToAllPeaks(const Topology& topology, std::span<const int> rank_node,
                        const double* sent_tokens, int num_ranks, double bytes_per_row) {
  std::vector<double> receive(static_cast<size_t>(num_ranks) * 2, 0.0);
  double* receive_intra = receive.data();
  double* receive_inter = receive.data() + num_ranks;
  // Maxima over the ranks' sums. std::max keeps its first argument against a NaN and sums are
  // never -0.0, so the order in which the sums are visited does not change the result.
  double most_intra = 0;
  double most_inter = 0;
  const int per_node = topology.gpus_per_node();
  for (int src = 0; src < num_ranks;) {
    // Ranks of a node are contiguous: a row splits into the ranks before the node, the node
    // (less the source itself) and the ranks after it. Up to four sources of one node share the
    // ranges outside it and go through them together.
    const int node_begin = std::min(rank_node[src] * per_node, num_ranks);
    const int node_end = std::min(node_begin + per_node, num_ranks);
    const int count = std::min(4, node_end - src);
    const double* rows[4];
    double sent_inter[4] = {0, 0, 0, 0};
    for (int k = 0; k < count; ++k)
      rows[k] = sent_tokens + static_cast<size_t>(src + k) * num_ranks;
    AddToLinkInLockstep(rows, count, 0, node_begin, bytes_per_row, receive_inter, sent_inter);
    AddToLinkInLockstep(rows, count, node_end, num_ranks, bytes_per_row, receive_inter, sent_inter);
    for (int k = 0; k < count; ++k, ++src) {
      double sent_intra = AddToLink(rows[k], node_begin, src, bytes_per_row, receive_intra, 0.0);
      sent_intra = AddToLink(rows[k], src + 1, node_end, bytes_per_row, receive_intra, sent_intra);
      most_intra = std::max(most_intra, sent_intra);
      most_inter = std::max(most_inter, sent_inter[k]);
    }
  }
  for (int dst = 0; dst < num_ranks; ++dst) {
    most_intra = std::max(most_intra, receive_intra[dst]);
    most_inter = std::max(most_inter, receive_inter[dst]);
  }
  return {most_intra, most_inter};
}

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
  return EstimateWithSync(placement, routing, ReplicaSyncSeconds(placement), migration_seconds);
}

LayerCost CostModel::EstimateWithSync(const Placement& placement, const StepRouting& routing,
                                      double replica_sync_seconds, double migration_seconds) const {
  return EstimateParts(placement, routing.max_rank_tokens(), routing.sent_tokens,
                       routing.transients, replica_sync_seconds, migration_seconds);
}

LayerCost CostModel::EstimateParts(const Placement& placement, double max_rank_tokens,
                                   std::span<const double> all_to_all,
                                   std::span<const TransientReplica> transients,
                                   double replica_sync_seconds, double migration_seconds) const {
  assert(all_to_all.size() ==
         static_cast<size_t>(topology_.num_ranks()) * static_cast<size_t>(topology_.num_ranks()));
  const LinkPeaks peaks = AllToAllPeaks(topology_, rank_node_, all_to_all.data(),
                                        topology_.num_ranks(), token_row_bytes());
  return EstimateFromPeaks(placement, max_rank_tokens, peaks, transients, replica_sync_seconds,
                           migration_seconds);
}

LayerCost CostModel::EstimateFromPeaks(const Placement& placement, double max_rank_tokens,
                                       LinkPeaks peaks,
                                       std::span<const TransientReplica> transients,
                                       double replica_sync_seconds,
                                       double migration_seconds) const {
  LayerCost cost;
  cost.compute_seconds = ComputeSeconds(max_rank_tokens);
  // Rounding is monotone, so dividing the largest byte count of each link class gives the same
  // seconds as dividing every count first.
  const double pass_seconds =
      std::max({0.0, peaks.intra_bytes / topology_.intra_node_bytes_per_second(),
                peaks.inter_bytes / topology_.inter_node_bytes_per_second()});
  cost.all_to_all_seconds = pass_seconds * config_.all_to_all_passes;

  cost.replica_sync_seconds = replica_sync_seconds;
  cost.transient_seconds = TransientSeconds(placement, transients);

  const double overlap_window = cost.compute_seconds + cost.all_to_all_seconds;
  cost.exposed_migration_seconds = std::max(0.0, migration_seconds - overlap_window);
  return cost;
}

double CostModel::TransferSeconds(std::span<const double> bytes) const {
  assert(bytes.size() ==
         static_cast<size_t>(topology_.num_ranks()) * static_cast<size_t>(topology_.num_ranks()));
  const LinkPeaks peaks =
      AllToAllPeaks(topology_, rank_node_, bytes.data(), topology_.num_ranks(), 1.0);
  return std::max({0.0, peaks.intra_bytes / topology_.intra_node_bytes_per_second(),
                   peaks.inter_bytes / topology_.inter_node_bytes_per_second()});
}

double CostModel::ReplicaSyncSeconds(const Placement& placement) const {
  // The copies of an expert form a ring over their distinct ranks (ascending, so node-local
  // neighbours): gradients reduce into the home and new weights return along it, each edge
  // carrying (m-1)/m of the weights per pass, as a ring reduce / broadcast does.
  LinkLoad sync(topology_, rank_node_);
  for (int e = 0; e < placement.num_experts(); ++e) {
    // Copies are in slot order, so equal ranks are adjacent: the ring's members are the ranks
    // that differ from the copy before.
    const std::span<const int> ranks = placement.copy_ranks(e);
    int m = ranks.empty() ? 0 : 1;
    for (size_t i = 1; i < ranks.size(); ++i) m += ranks[i] != ranks[i - 1] ? 1 : 0;
    if (m < 2) continue;
    const double edge_bytes = expert_weight_bytes() * config_.replica_sync_passes * (m - 1) / m;
    auto add_edge = [&](int from, int to) {
      sync.Add(from, to, rank_node_[from] == rank_node_[to] ? 0 : 1, edge_bytes);
    };
    int from = ranks[0];
    for (size_t i = 1; i < ranks.size(); ++i) {
      if (ranks[i] == from) continue;
      add_edge(from, ranks[i]);
      from = ranks[i];
    }
    add_edge(from, ranks[0]);  // the last edge closes the ring
  }
  return sync.SlowestRankSeconds();
}

double CostModel::TransientSeconds(const Placement& placement,
                                   std::span<const TransientReplica> transients) const {
  if (transients.empty()) return 0;
  // Transient replicas of one expert are filled by a pipelined chain from the source through
  // the receivers in the order they were added, and return their gradients along the reverse chain.
  if (transients.size() <= kFewTransients) return FewTransientSeconds(transients);
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

double CostModel::FewTransientSeconds(std::span<const TransientReplica> transients) const {
  // LinkLoad's sums for the few (rank, link class, direction) entries that the chains touch,
  // added in the same order, in a short list instead of a table of every rank.
  std::array<std::pair<int, double>, 4 * kFewTransients> touched;
  size_t num_touched = 0;
  auto add = [&](size_t entry, double bytes) {
    size_t i = 0;
    while (i < num_touched && touched[i].first != static_cast<int>(entry)) ++i;
    if (i == num_touched) touched[num_touched++] = {static_cast<int>(entry), 0.0};
    touched[i].second += bytes;
  };
  const double bytes = expert_weight_bytes();
  auto edge = [&](int src, int dst) {
    if (src == dst || bytes <= 0) return;
    const int link = rank_node_[src] == rank_node_[dst] ? 0 : 1;
    add(static_cast<size_t>(src) * 4 + link, bytes);      // send
    add(static_cast<size_t>(dst) * 4 + 2 + link, bytes);  // receive
  };
  for (size_t i = 0; i < transients.size(); ++i) {
    const TransientReplica& t = transients[i];
    int previous = t.source_rank;  // the chain's last rank so far
    for (size_t j = i; j-- > 0;) {
      if (transients[j].expert == t.expert) {
        previous = transients[j].rank;
        break;
      }
    }
    edge(previous, t.rank);
    edge(t.rank, previous);
  }
  double most[2] = {0, 0};
  for (size_t i = 0; i < num_touched; ++i) {
    most[touched[i].first % 2] = std::max(most[touched[i].first % 2], touched[i].second);
  }
  return std::max({0.0, most[0] / topology_.intra_node_bytes_per_second(),
                   most[1] / topology_.inter_node_bytes_per_second()});
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

Status CostModel::CheckFinite(const LayerCost& cost, const MigrationCost* migration) const {
  const std::pair<const char*, double> terms[] = {
      {"compute_seconds", cost.compute_seconds},
      {"all_to_all_seconds", cost.all_to_all_seconds},
      {"replica_sync_seconds", cost.replica_sync_seconds},
      {"transient_seconds", cost.transient_seconds},
      {"exposed_migration_seconds", cost.exposed_migration_seconds},
      {"migration bytes", migration != nullptr ? migration->bytes : 0.0},
      {"migration seconds", migration != nullptr ? migration->seconds : 0.0},
  };
  std::string bad;
  for (const auto& [name, value] : terms) {
    if (std::isfinite(value)) continue;
    bad += (bad.empty() ? "" : ", ") + std::string(name) + " " + NumberText(value);
  }
  if (bad.empty()) return Status::Ok();
  const CostModelConfig& c = config_;
  return InvalidArgument(
      "the cost model priced a layer step at " + bad +
      " from constants out of scale: cost_model.expert_tflops " + NumberText(c.expert_tflops) +
      ", cost_model.train_flops_multiplier " + NumberText(c.train_flops_multiplier) +
      ", cost_model.hidden_size " + std::to_string(c.hidden_size) +
      ", cost_model.expert_ffn_size " + std::to_string(c.expert_ffn_size) +
      ", cost_model.expert_matrices " + std::to_string(c.expert_matrices) +
      ", cost_model.dtype_bytes " + std::to_string(c.dtype_bytes) +
      ", cost_model.home_move_bytes_per_parameter " + NumberText(c.home_move_bytes_per_parameter) +
      ", cost_model.all_to_all_passes " + std::to_string(c.all_to_all_passes) +
      ", cost_model.replica_sync_passes " + std::to_string(c.replica_sync_passes) +
      ", topology.intra_node_gb_per_s " +
      NumberText(topology_.intra_node_bytes_per_second() / 1e9) +
      ", topology.inter_node_gb_per_s " +
      NumberText(topology_.inter_node_bytes_per_second() / 1e9) +
      " (ValidateConfig, or keel config --check on a file, names the one out of range)");
}

}  // namespace keel
