// Engine::Impl's resharding: with policy.keel.shard_experts, at a replan with no epoch in flight,
// the keel policy's choice per expert between replicating and sharding (placement/shards.h,
// ChooseShards) is applied at once: a layer whose shard counts change gets its new units placed
// (Reshard), their weights and optimizer state cut or joined from the old shards' home slots
// through the slot exchange, and a policy over its new units.
#include "engine/engine_impl.h"

#include <string>

#include "common/log.h"
#include "placement/strategy.h"

namespace keel {

Status Engine::Impl::ReshardExperts() {
  if (config_.policy.name != "keel" || !config_.policy.keel.shard_experts) return Status::Ok();
  KEEL_ASSIGN_OR_RETURN(const StrategyModel curve,
                        StrategyModel::Create(context_->cost, config_.strategy));
  ShardChoiceOptions choice;
  choice.weights = shard_weights_;
  choice.optimizer = shard_optimizer_;
  choice.state_bytes = context_->cost.home_move_bytes();
  choice.payback_steps = config_.policy.keel.home_payback_horizon_steps;
  struct Change {
    int layer;
    ShardMap map;
    Placement placement;
  };
  std::vector<Change> changes;
  const int num_experts = options_.num_experts;
  for (int l = 0; l < options_.num_layers; ++l) {
    // The estimate by expert: rows per step of each expert, summed over the sources.
    const std::vector<double> traffic = estimators_[l].Estimate();
    std::vector<double> expert_tokens(num_experts, 0.0);
    for (size_t i = 0; i < traffic.size(); ++i) expert_tokens[i % num_experts] += traffic[i];
    std::vector<int> shards = ChooseShards(
        expert_tokens, shards_[l], context_->cost,
        [&](double columns) { return curve.RelativeGemmEfficiency(columns); }, choice);
    bool same = true;
    for (int e = 0; e < num_experts; ++e) same &= shards[e] == shards_[l].shards(e);
    if (same) continue;
    KEEL_ASSIGN_OR_RETURN(ShardMap map, ShardMap::Create(std::move(shards)));
    Result<Placement> placement = Reshard(placements_[l], shards_[l], map, context_->topology);
    if (!placement.ok()) {
      // No room in the node: the layer keeps its shards (every rank decides the same), said once
      // until the reason changes.
      std::string& said = reshard_refusals_[l];
      if (aggregating() && said != placement.status().message()) {
        KEEL_LOG_WARN("layer %d keeps its shards: %s", l, placement.status().message().c_str());
      }
      said = placement.status().message();
      continue;
    }
    reshard_refusals_[l].clear();
    changes.push_back({l, std::move(map), std::move(*placement)});
  }
  if (changes.empty()) return Status::Ok();

  // Each changed expert's new shards from its old shards' home slots, region by region, in the
  // same order on every rank: (change, expert, region, piece).
  struct Region {
    const std::vector<ShardedTensor>& tensors;
    void* SlotBuffers::*buffer;
  };
  const Region regions[] = {{choice.weights, &SlotBuffers::weights},
                            {choice.optimizer, &SlotBuffers::optimizer}};
  struct Copy {
    int layer;
    ShardPiece piece;
    void* SlotBuffers::*buffer;
  };
  std::vector<Copy> copies;
  for (const Change& change : changes) {
    const int l = change.layer;
    for (int e = 0; e < num_experts; ++e) {
      if (change.map.shards(e) == shards_[l].shards(e)) continue;
      for (const Region& region : regions) {
        for (const ShardPiece& piece : ReshardPieces(placements_[l], shards_[l], change.placement,
                                                     change.map, e, region.tensors)) {
          copies.push_back({l, piece, region.buffer});
        }
      }
    }
  }
  auto at = [&](int layer, int slot, void* SlotBuffers::*buffer, size_t offset) {
    return static_cast<std::byte*>(Buffers(layer, slot % slots_per_rank_).*buffer) + offset;
  };
  exchange_.Begin(num_ranks_);
  uint64_t bytes = 0;
  for (const Copy& c : copies) {
    const int src_rank = c.piece.src_slot / slots_per_rank_;
    if (src_rank != rank_) continue;
    exchange_.Add(c.piece.dst_slot / slots_per_rank_,
                  at(c.layer, c.piece.src_slot, c.buffer, c.piece.src_offset), c.piece.bytes);
  }
  // The pieces this rank receives, in the order the loop below reads them.
  for (const Copy& c : copies) {
    if (c.piece.dst_slot / slots_per_rank_ != rank_) continue;
    exchange_.Expect(c.piece.src_slot / slots_per_rank_, c.piece.bytes);
  }
  KEEL_RETURN_IF_ERROR(exchange_.Run(communicator_, *memory_, on_device()));
  std::optional<uint64_t> last;
  for (const Copy& c : copies) {
    bytes += c.piece.bytes;
    if (c.piece.dst_slot / slots_per_rank_ != rank_) continue;
    KEEL_ASSIGN_OR_RETURN(const std::byte* piece,
                          exchange_.Received(c.piece.src_slot / slots_per_rank_, c.piece.bytes));
    KEEL_ASSIGN_OR_RETURN(
        last, memory_->StartCopy(at(c.layer, c.piece.dst_slot, c.buffer, c.piece.dst_offset), piece,
                                 c.piece.bytes));
  }
  KEEL_RETURN_IF_ERROR(WaitForLast(*memory_, last));

  for (Change& change : changes) {
    KEEL_RETURN_IF_ERROR(SetUnits(change.layer, std::move(change.map)));
    placements_[change.layer] = std::move(change.placement);
  }
  stats_.reshards += static_cast<int64_t>(changes.size());
  stats_.bytes_moved += bytes;
  if (aggregating()) {
    KEEL_LOG_INFO("resharded %zu layer(s), %llu bytes moved", changes.size(),
                  static_cast<unsigned long long>(bytes));
  }
  return Status::Ok();
}

}  // namespace keel
