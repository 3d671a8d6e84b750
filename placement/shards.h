// Sharded experts in a layer's placement (docs/strategies.md, "Sharded experts in the engine").
// An expert sharded s ways is s units: its FFN's inner dimension split s ways, each unit an FFN of
// its own with its slice of the weights, gradients and optimizer state. Placement, replicas,
// homes and migration treat every unit as an expert of its own (a Placement over units); routing
// sends every (token, k) of the expert to all of its units, and the combine sums their outputs.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "keel/shard_layout.hpp"
#include "keel/status.hpp"
#include "placement/cost_model.h"
#include "placement/placement.h"
#include "placement/topology.h"

namespace keel {

// The units of one layer: expert e is units [first_unit(e), first_unit(e) + shards(e)), shard j
// of it unit first_unit(e) + j. Unsharded experts are one unit each, so a layer without sharded
// experts has unit e = expert e.
class ShardMap {
 public:
  // shards: [num_experts], each >= 1.
  static Result<ShardMap> Create(std::vector<int> shards);
  static ShardMap Whole(int num_experts);

  int num_experts() const { return static_cast<int>(shards_.size()); }
  int num_units() const { return first_unit_.back(); }
  bool sharded() const { return num_units() != num_experts(); }
  int shards(int expert) const { return shards_[expert]; }
  const std::vector<int>& shard_counts() const { return shards_; }  // [num_experts]
  int first_unit(int expert) const { return first_unit_[expert]; }
  int expert_of(int unit) const { return unit_expert_[unit]; }
  int shard_of(int unit) const { return unit - first_unit_[unit_expert_[unit]]; }

  // Counts by expert -> counts by unit: every unit of e counts all of e's (token, k) entries.
  std::vector<int32_t> UnitCounts(std::span<const int32_t> expert_counts) const;
  // Traffic [sources * num_experts] by expert -> [sources * num_units] by unit (every unit of e
  // sees all of e's entries).
  std::vector<double> UnitTraffic(std::span<const double> expert_traffic) const;
  // Traffic [sources * num_units] by unit -> [sources * num_experts] by expert (each expert's
  // first unit, which sees all of its entries).
  std::vector<double> ExpertTraffic(std::span<const double> unit_traffic) const;

 private:
  ShardMap() = default;
  std::vector<int> shards_;
  std::vector<int> first_unit_;   // [num_experts + 1]
  std::vector<int> unit_expert_;  // [num_units]
};

// The placement of a layer's units that starts from `whole`, a placement of its experts: every
// expert's first unit takes all of the expert's slots (and its home), and shard j >= 1 of an
// expert whose home is rank r takes a slot of the next rank after r in r's node that holds no
// shard of it yet (wrapping around the node): its first empty persistent slot, else its first slot
// holding a replica (a copy of an expert with more than one, not its home slot).
// FailedPrecondition, naming the expert, when its node has no such slot left; InvalidArgument when
// a shard count exceeds the node's ranks.
Result<Placement> PlaceShards(const Placement& whole, const ShardMap& map,
                              const Topology& topology);

// The placement of a layer's units when its shard map changes from `from` to `to`: the units of
// experts whose shard count stays keep their slots and homes; an expert whose count changes
// drops all its copies, its first new unit takes the old first unit's home slot, and its other
// shards are placed as PlaceShards places them. `current` is over `from`'s units.
Result<Placement> Reshard(const Placement& current, const ShardMap& from, const ShardMap& to,
                          const Topology& topology);

// The tensors of a region of `region_bytes` as keel/shard_layout.hpp reads `tensors`: an empty
// list is one tensor of region_bytes rows of one byte, split by rows.
std::vector<ShardedTensor> RegionTensors(const std::vector<ShardedTensor>& tensors,
                                         size_t region_bytes);
// Whether every tensor's split dimension divides by `shards`.
bool ShardsDivide(std::span<const ShardedTensor> tensors, int shards);

// One contiguous piece of a region (weights or optimizer state) that a reshard copies from an old
// unit's home slot to a new unit's, offsets within the slots' regions.
struct ShardPiece {
  int src_slot = 0;  // a home slot of `current`
  size_t src_offset = 0;
  int dst_slot = 0;  // a home slot of `next`
  size_t dst_offset = 0;
  size_t bytes = 0;
  friend bool operator==(const ShardPiece&, const ShardPiece&) = default;
};
// The pieces that build `expert`'s new shards (in `next`, over `to`) from its old ones (in
// `current`, over `from`) for a region of `tensors` (RegionTensors), by new shard, tensor, row,
// then old shard. Both shard counts must divide every tensor (ShardsDivide).
std::vector<ShardPiece> ReshardPieces(const Placement& current, const ShardMap& from,
                                      const Placement& next, const ShardMap& to, int expert,
                                      std::span<const ShardedTensor> tensors);

// What spreading one expert's `expert_tokens` rows per step over `spread` ranks of a node costs
// per step each way, by the cost model's constants (docs/strategies.md, "Shard or replicate"):
//   replicate: a ring of `spread` copies syncs gradients and weights (replica_sync_passes);
//   shard: each shard's rank receives all of the expert's rows rather than 1/spread of them
//     (all_to_all_passes, over the slowest link tier the job has), and runs them at
//     `relative_gemm_efficiency` of the whole expert's GEMM throughput;
//   switch: moving (spread - 1) / spread of `state_bytes` inside the node, once.
struct ShardPricing {
  int spread = 1;
  double replicate_seconds = 0;
  double shard_seconds = 0;
  double switch_seconds = 0;
};
ShardPricing PriceSharding(const CostModel& cost, double expert_tokens, int spread,
                           double relative_gemm_efficiency, double state_bytes);

struct ShardChoiceOptions {
  // The regions' tensors (RegionTensors): a shard count must divide them all.
  std::vector<ShardedTensor> weights;
  std::vector<ShardedTensor> optimizer;
  double state_bytes = 0;      // what a reshard moves per expert (cost model bytes)
  double payback_steps = 100;  // a change must repay its move within this many steps
};
// The keel policy's choice per expert (docs/strategies.md): an expert that carries more than
// the mean rank's rows must spread over ceil(rows / mean) ranks of its node (at most the node,
// and a count that divides the state); it is sharded that many ways when sharding costs less
// than replicating (PriceSharding), else kept whole for the policy to replicate. A change from
// `current` happens only when the difference repays the state moves within payback_steps.
// `expert_tokens` [num_experts]: estimated rows per step. `relative_gemm_efficiency(columns)`:
// the GEMM curve (StrategyModel::RelativeGemmEfficiency). Returns shards per expert.
std::vector<int> ChooseShards(std::span<const double> expert_tokens, const ShardMap& current,
                              const CostModel& cost,
                              const std::function<double(double)>& relative_gemm_efficiency,
                              const ShardChoiceOptions& options);

}  // namespace keel
