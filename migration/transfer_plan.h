// Transfer planning: from each layer's old and new placement, the transfers that build the new
// slots — which slot receives which expert's state from which source slot. Pure and
// deterministic (no I/O, no clocks), so every rank computes the same plan from the same inputs.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "keel/status.hpp"
#include "placement/placement.h"
#include "placement/topology.h"

namespace keel {

// Bytes of one expert's state in a slot. Every copy holds the weights; only the home copy also
// holds the optimizer state (master weights and moments).
struct ExpertLayout {
  size_t weight_bytes = 0;
  size_t optimizer_bytes = 0;
};

// The regions of a slot one transfer carries.
enum class Payload : uint8_t {
  kWeights = 1,              // a new copy (replica, or the weights half of a split home move)
  kOptimizer = 2,            // the home moves to a slot that already holds the weights
  kWeightsAndOptimizer = 3,  // a home relocation fed from the old home: everything at once
};

bool CarriesWeights(Payload payload);
bool CarriesOptimizer(Payload payload);
std::string_view PayloadName(Payload payload);

// Where a transfer's bytes travel.
enum class Route : uint8_t { kLocal, kIntraNode, kInterNode };
std::string_view RouteName(Route route);

// One slot's worth of state moving from a slot of the old placement to a slot of the new one.
// Slots are physical indices into the layer's phy2log (rank = slot / slots_per_rank).
struct Transfer {
  int layer = 0;
  int expert = 0;
  int src_rank = 0;
  int src_slot = 0;
  int dst_rank = 0;
  int dst_slot = 0;
  Payload payload = Payload::kWeights;
  Route route = Route::kLocal;
  size_t bytes = 0;

  friend bool operator==(const Transfer&, const Transfer&) = default;
};

// "layer 3 expert 12 rank 1 -> rank 2 slot 5"
std::string DescribeTransfer(const Transfer& transfer);

struct TransferPlan {
  ExpertLayout layout;
  int slots_per_rank = 0;
  // Ordered by (layer, expert, destination slot, payload): the order ranks agree on.
  std::vector<Transfer> transfers;
  // [layers][experts] the home rank once the plan commits (the new placement's homes).
  std::vector<std::vector<int>> new_home;

  size_t local_bytes = 0;
  size_t intra_node_bytes = 0;
  size_t inter_node_bytes = 0;
  size_t total_bytes() const { return local_bytes + intra_node_bytes + inter_node_bytes; }
};

// Plans the transfers that turn placement `from[l]` into `to[l]` for every layer l.
//   - a slot whose expert is unchanged receives nothing (unless it becomes the home slot: then
//     only the optimizer state moves into it);
//   - a new copy is fed from a copy on the same rank when there is one (a local copy), else from
//     a holder on the same node, else from another node; receivers of one expert are spread over
//     its holders, least-loaded holder first, so inter-node bytes are as few as the placements
//     allow;
//   - a home relocation moves weights + optimizer state and makes the destination the home; the
//     optimizer state always comes from the old home slot, the weights from the nearest copy.
// Fails when the layer count, expert count, rank count or slots per rank differ, or when the
// topology has a different number of ranks.
Result<TransferPlan> PlanTransfers(std::span<const Placement> from, std::span<const Placement> to,
                                   const Topology& topology, const ExpertLayout& layout);

}  // namespace keel
