// Transfer planning: per expert, the new copies and the home move, each fed from the nearest and
// least-loaded holder of the old placement.
#include "migration/transfer_plan.h"

#include <limits>
#include <tuple>

namespace keel {
namespace {

Route RouteBetween(const Topology& topology, int src_rank, int dst_rank) {
  if (src_rank == dst_rank) return Route::kLocal;
  return topology.same_node(src_rank, dst_rank) ? Route::kIntraNode : Route::kInterNode;
}

size_t PayloadBytes(Payload payload, const ExpertLayout& layout) {
  return (CarriesWeights(payload) ? layout.weight_bytes : 0) +
         (CarriesOptimizer(payload) ? layout.optimizer_bytes : 0);
}

Status CheckShapes(std::span<const Placement> from, std::span<const Placement> to,
                   const Topology& topology) {
  if (from.size() != to.size()) {
    return InvalidArgument("old placement has " + std::to_string(from.size()) +
                           " layers, new placement " + std::to_string(to.size()));
  }
  for (size_t l = 0; l < from.size(); ++l) {
    const Placement& a = from[l];
    const Placement& b = to[l];
    const std::string where = "layer " + std::to_string(l) + ": ";
    if (a.num_experts() != b.num_experts() || a.num_ranks() != b.num_ranks() ||
        a.slots_per_rank() != b.slots_per_rank()) {
      return InvalidArgument(
          where + "old placement (" + std::to_string(a.num_experts()) + " experts, " +
          std::to_string(a.num_ranks()) + " ranks, " + std::to_string(a.slots_per_rank()) +
          " slots per rank) and new placement (" + std::to_string(b.num_experts()) + " experts, " +
          std::to_string(b.num_ranks()) + " ranks, " + std::to_string(b.slots_per_rank()) +
          " slots per rank) differ");
    }
    if (a.num_ranks() != topology.num_ranks()) {
      return InvalidArgument(where + "placement has " + std::to_string(a.num_ranks()) +
                             " ranks, topology " + std::to_string(topology.num_ranks()));
    }
    if (l > 0 && a.slots_per_rank() != from[0].slots_per_rank()) {
      return InvalidArgument(where + "slots per rank " + std::to_string(a.slots_per_rank()) +
                             " differs from layer 0's " + std::to_string(from[0].slots_per_rank()));
    }
  }
  return Status::Ok();
}

class LayerPlanner {
 public:
  LayerPlanner(int layer, const Placement& from, const Placement& to, const Topology& topology,
               TransferPlan& plan)
      : layer_(layer), from_(from), to_(to), topology_(topology), plan_(plan) {}

  void PlanExpert(int expert) {
    const int old_home_slot = from_.home_slot(expert);
    const int new_home_slot = to_.home_slot(expert);
    const bool home_moves = old_home_slot != new_home_slot;
    // Receivers fed so far per holder rank, for spreading one expert's receivers.
    std::vector<int> fed(from_.num_ranks(), 0);
    for (int slot : to_.copies(expert)) {
      const bool needs_weights = from_.expert_at(slot) != expert;
      const bool needs_optimizer = home_moves && slot == new_home_slot;
      if (!needs_weights && !needs_optimizer) continue;
      if (!needs_weights) {
        Add(expert, old_home_slot, slot, Payload::kOptimizer);
        continue;
      }
      const int dst_rank = to_.rank_of_slot(slot);
      int source_slot = NearestHolder(expert, dst_rank, fed);
      if (needs_optimizer) {
        // One transfer from the old home unless a strictly nearer copy can feed the weights.
        const Route home_route = Route_(from_.rank_of_slot(old_home_slot), dst_rank);
        if (home_route <= Route_(from_.rank_of_slot(source_slot), dst_rank)) {
          source_slot = old_home_slot;
        }
      }
      ++fed[from_.rank_of_slot(source_slot)];
      if (needs_optimizer && source_slot == old_home_slot) {
        Add(expert, source_slot, slot, Payload::kWeightsAndOptimizer);
      } else {
        Add(expert, source_slot, slot, Payload::kWeights);
        if (needs_optimizer) Add(expert, old_home_slot, slot, Payload::kOptimizer);
      }
    }
  }

 private:
  Route Route_(int src_rank, int dst_rank) const {
    return RouteBetween(topology_, src_rank, dst_rank);
  }

  // The holder of `expert` nearest to `dst_rank`; among equally near ones the one that fed the
  // fewest receivers so far, then the lowest rank. Returns that rank's lowest slot of the expert.
  int NearestHolder(int expert, int dst_rank, const std::vector<int>& fed) const {
    int best_slot = -1;
    std::tuple<Route, int, int> best_key{Route::kInterNode, std::numeric_limits<int>::max(),
                                         std::numeric_limits<int>::max()};
    int last_rank = -1;
    for (int slot : from_.copies(expert)) {
      const int rank = from_.rank_of_slot(slot);
      if (rank == last_rank) continue;  // copies are ascending: the first one per rank wins
      last_rank = rank;
      const std::tuple<Route, int, int> key{Route_(rank, dst_rank), fed[rank], rank};
      if (best_slot < 0 || key < best_key) {
        best_slot = slot;
        best_key = key;
      }
    }
    return best_slot;
  }

  void Add(int expert, int src_slot, int dst_slot, Payload payload) {
    Transfer t;
    t.layer = layer_;
    t.expert = expert;
    t.src_slot = src_slot;
    t.src_rank = from_.rank_of_slot(src_slot);
    t.dst_slot = dst_slot;
    t.dst_rank = to_.rank_of_slot(dst_slot);
    t.payload = payload;
    t.route = Route_(t.src_rank, t.dst_rank);
    t.bytes = PayloadBytes(payload, plan_.layout);
    switch (t.route) {
      case Route::kLocal:
        plan_.local_bytes += t.bytes;
        break;
      case Route::kIntraNode:
        plan_.intra_node_bytes += t.bytes;
        break;
      case Route::kInterNode:
        plan_.inter_node_bytes += t.bytes;
        break;
    }
    plan_.transfers.push_back(t);
  }

  int layer_;
  const Placement& from_;
  const Placement& to_;
  const Topology& topology_;
  TransferPlan& plan_;
};

}  // namespace

bool CarriesWeights(Payload payload) {
  return (static_cast<uint8_t>(payload) & static_cast<uint8_t>(Payload::kWeights)) != 0;
}

bool CarriesOptimizer(Payload payload) {
  return (static_cast<uint8_t>(payload) & static_cast<uint8_t>(Payload::kOptimizer)) != 0;
}

std::string_view PayloadName(Payload payload) {
  switch (payload) {
    case Payload::kWeights:
      return "weights";
    case Payload::kOptimizer:
      return "optimizer state";
    case Payload::kWeightsAndOptimizer:
      return "weights + optimizer state";
  }
  return "?";
}

std::string_view RouteName(Route route) {
  switch (route) {
    case Route::kLocal:
      return "local";
    case Route::kIntraNode:
      return "intra-node";
    case Route::kInterNode:
      return "inter-node";
  }
  return "?";
}

std::string DescribeTransfer(const Transfer& t) {
  return "layer " + std::to_string(t.layer) + " expert " + std::to_string(t.expert) + " rank " +
         std::to_string(t.src_rank) + " -> rank " + std::to_string(t.dst_rank) + " slot " +
         std::to_string(t.dst_slot);
}

Result<TransferPlan> PlanTransfers(std::span<const Placement> from, std::span<const Placement> to,
                                   const Topology& topology, const ExpertLayout& layout) {
  KEEL_RETURN_IF_ERROR(CheckShapes(from, to, topology));
  TransferPlan plan;
  plan.layout = layout;
  plan.slots_per_rank = from.empty() ? 0 : from[0].slots_per_rank();
  for (size_t l = 0; l < from.size(); ++l) {
    LayerPlanner planner(static_cast<int>(l), from[l], to[l], topology, plan);
    for (int e = 0; e < from[l].num_experts(); ++e) planner.PlanExpert(e);
    plan.new_home.push_back(to[l].home());
  }
  return plan;
}

}  // namespace keel
