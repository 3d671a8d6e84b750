// ShardMap, the placements of a layer's units, and the choice between sharding and replicating.
#include "placement/shards.h"

#include <algorithm>
#include <cmath>
#include <string>

namespace keel {

Result<ShardMap> ShardMap::Create(std::vector<int> shards) {
  if (shards.empty()) return InvalidArgument("a shard map needs at least one expert");
  ShardMap map;
  map.first_unit_.assign(shards.size() + 1, 0);
  for (size_t e = 0; e < shards.size(); ++e) {
    if (shards[e] < 1) {
      return InvalidArgument("shards of expert " + std::to_string(e) + " = " +
                             std::to_string(shards[e]) + " must be >= 1");
    }
    map.first_unit_[e + 1] = map.first_unit_[e] + shards[e];
    map.unit_expert_.insert(map.unit_expert_.end(), static_cast<size_t>(shards[e]),
                            static_cast<int>(e));
  }
  map.shards_ = std::move(shards);
  return map;
}

ShardMap ShardMap::Whole(int num_experts) {
  return std::move(Create(std::vector<int>(static_cast<size_t>(num_experts), 1))).value();
}

std::vector<int32_t> ShardMap::UnitCounts(std::span<const int32_t> expert_counts) const {
  std::vector<int32_t> units(static_cast<size_t>(num_units()));
  for (int u = 0; u < num_units(); ++u) units[u] = expert_counts[unit_expert_[u]];
  return units;
}

std::vector<double> ShardMap::UnitTraffic(std::span<const double> expert_traffic) const {
  const size_t sources = expert_traffic.size() / static_cast<size_t>(num_experts());
  std::vector<double> traffic(sources * num_units());
  for (size_t s = 0; s < sources; ++s) {
    for (int u = 0; u < num_units(); ++u) {
      traffic[s * num_units() + u] = expert_traffic[s * num_experts() + unit_expert_[u]];
    }
  }
  return traffic;
}

std::vector<double> ShardMap::ExpertTraffic(std::span<const double> unit_traffic) const {
  const size_t sources = unit_traffic.size() / static_cast<size_t>(num_units());
  std::vector<double> traffic(sources * num_experts());
  for (size_t s = 0; s < sources; ++s) {
    for (int e = 0; e < num_experts(); ++e) {
      traffic[s * num_experts() + e] = unit_traffic[s * num_units() + first_unit_[e]];
    }
  }
  return traffic;
}

namespace {

// A layer's units being laid out slot by slot, for PlaceShards and Reshard.
struct UnitSlots {
  std::vector<int> phy2log;   // [slots] unit, or kEmptySlot
  std::vector<bool> is_home;  // [slots] the slot keeps its unit's optimizer state
  std::vector<int> copies;    // [units] slots holding each unit
  std::vector<int> home;      // [units] rank of each unit's home
  int slots_per_rank = 0;

  // The slot of `rank` a new shard may take: its first empty slot, else its first slot holding
  // a replica (a copy of a unit with more than one, not its home slot); -1 when none.
  int FreeSlot(int rank) const {
    int replica = -1;
    for (int i = 0; i < slots_per_rank; ++i) {
      const int slot = rank * slots_per_rank + i;
      const int unit = phy2log[slot];
      if (unit == kEmptySlot) return slot;
      if (replica < 0 && copies[unit] > 1 && !is_home[slot]) replica = slot;
    }
    return replica;
  }
  void Take(int slot, int unit) {
    if (phy2log[slot] != kEmptySlot) --copies[phy2log[slot]];
    phy2log[slot] = unit;
    ++copies[unit];
    is_home[slot] = true;
    home[unit] = slot / slots_per_rank;
  }
};

// Places shards [1, shards) of `expert`, whose first unit's home is `home_rank`, on the ranks
// of its node after the home (one each, wrapping around).
Status PlaceOtherShards(int expert, int home_rank, const ShardMap& map, const Topology& topology,
                        UnitSlots& slots) {
  const int per_node = topology.gpus_per_node();
  if (map.shards(expert) > per_node) {
    return InvalidArgument(
        "expert " + std::to_string(expert) + " has " + std::to_string(map.shards(expert)) +
        " shards, more than the node's topology.gpus_per_node = " + std::to_string(per_node));
  }
  const int node_first = topology.node_of(home_rank) * per_node;
  int next = 1;
  for (int j = 1; j < map.shards(expert); ++j) {
    int placed = -1;
    for (; next < per_node && placed < 0; ++next) {
      placed = slots.FreeSlot(node_first + (home_rank - node_first + next) % per_node);
    }
    if (placed < 0) {
      return FailedPrecondition("expert " + std::to_string(expert) + "'s shard " +
                                std::to_string(j) + " of " + std::to_string(map.shards(expert)) +
                                " finds no empty or replica slot on the ranks of node " +
                                std::to_string(topology.node_of(home_rank)) +
                                " that hold none of its shards; raise slots.persistent_per_rank");
    }
    slots.Take(placed, map.first_unit(expert) + j);
  }
  return Status::Ok();
}

}  // namespace

Result<Placement> PlaceShards(const Placement& whole, const ShardMap& map,
                              const Topology& topology) {
  if (map.num_experts() != whole.num_experts()) {
    return InvalidArgument("the shard map has " + std::to_string(map.num_experts()) +
                           " experts, the placement " + std::to_string(whole.num_experts()));
  }
  UnitSlots slots;
  slots.slots_per_rank = whole.slots_per_rank();
  slots.phy2log.assign(whole.phy2log().size(), kEmptySlot);
  slots.is_home.assign(whole.phy2log().size(), false);
  slots.copies.assign(static_cast<size_t>(map.num_units()), 0);
  slots.home.assign(static_cast<size_t>(map.num_units()), 0);
  for (int slot = 0; slot < whole.num_slots(); ++slot) {
    const int e = whole.expert_at(slot);
    if (e == kEmptySlot) continue;
    slots.phy2log[slot] = map.first_unit(e);
    slots.is_home[slot] = whole.home_slot(e) == slot;
    ++slots.copies[map.first_unit(e)];
  }
  for (int e = 0; e < map.num_experts(); ++e) {
    slots.home[map.first_unit(e)] = whole.home(e);
    KEEL_RETURN_IF_ERROR(PlaceOtherShards(e, whole.home(e), map, topology, slots));
  }
  return Placement::Create(map.num_units(), whole.num_ranks(), std::move(slots.phy2log),
                           std::move(slots.home));
}

Result<Placement> Reshard(const Placement& current, const ShardMap& from, const ShardMap& to,
                          const Topology& topology) {
  if (current.num_experts() != from.num_units() || from.num_experts() != to.num_experts()) {
    return InvalidArgument("Reshard: the placement has " + std::to_string(current.num_experts()) +
                           " units, the maps " + std::to_string(from.num_units()) + " and " +
                           std::to_string(to.num_units()) + " over " +
                           std::to_string(from.num_experts()) + " and " +
                           std::to_string(to.num_experts()) + " experts");
  }
  UnitSlots slots;
  slots.slots_per_rank = current.slots_per_rank();
  slots.phy2log.assign(current.phy2log().size(), kEmptySlot);
  slots.is_home.assign(current.phy2log().size(), false);
  slots.copies.assign(static_cast<size_t>(to.num_units()), 0);
  slots.home.assign(static_cast<size_t>(to.num_units()), 0);
  // Units of experts whose shard count stays keep their slots and homes.
  for (int slot = 0; slot < current.num_slots(); ++slot) {
    const int unit = current.expert_at(slot);
    if (unit == kEmptySlot) continue;
    const int e = from.expert_of(unit);
    if (from.shards(e) != to.shards(e)) continue;
    const int kept = to.first_unit(e) + from.shard_of(unit);
    slots.phy2log[slot] = kept;
    slots.is_home[slot] = current.home_slot(unit) == slot;
    ++slots.copies[kept];
    slots.home[kept] = current.home(unit);
  }
  // A resharded expert starts again from its first shard's home slot; every such slot is taken
  // before any other shard is placed, so that no shard lands in a slot another expert restarts in.
  for (int e = 0; e < to.num_experts(); ++e) {
    if (from.shards(e) != to.shards(e)) {
      slots.Take(current.home_slot(from.first_unit(e)), to.first_unit(e));
    }
  }
  for (int e = 0; e < to.num_experts(); ++e) {
    if (from.shards(e) == to.shards(e)) continue;
    KEEL_RETURN_IF_ERROR(PlaceOtherShards(e, slots.home[to.first_unit(e)], to, topology, slots));
  }
  return Placement::Create(to.num_units(), current.num_ranks(), std::move(slots.phy2log),
                           std::move(slots.home));
}

std::vector<ShardedTensor> RegionTensors(const std::vector<ShardedTensor>& tensors,
                                         size_t region_bytes) {
  if (!tensors.empty()) return tensors;
  if (region_bytes == 0) return {};
  return {ShardedTensor{region_bytes, 1, 1, false}};
}

bool ShardsDivide(std::span<const ShardedTensor> tensors, int shards) {
  for (const ShardedTensor& t : tensors) {
    if ((t.split_columns ? t.columns : t.rows) % static_cast<size_t>(shards) != 0) return false;
  }
  return true;
}

std::vector<ShardPiece> ReshardPieces(const Placement& current, const ShardMap& from,
                                      const Placement& next, const ShardMap& to, int expert,
                                      std::span<const ShardedTensor> tensors) {
  std::vector<ShardPiece> pieces;
  const size_t old_shards = static_cast<size_t>(from.shards(expert));
  const size_t new_shards = static_cast<size_t>(to.shards(expert));
  for (size_t j = 0; j < new_shards; ++j) {
    const int dst_slot = next.home_slot(to.first_unit(expert) + static_cast<int>(j));
    size_t old_base = 0;  // where the tensor's slice starts in an old shard's region
    size_t new_base = 0;  // ... in a new shard's
    for (const ShardedTensor& t : tensors) {
      // Along the split dimension, shard i of s holds [i * n / s, (i + 1) * n / s): a split by
      // rows is one run of whole rows, a split by columns a run in every row.
      const size_t n = t.split_columns ? t.columns : t.rows;
      const size_t unit = t.split_columns ? t.element_bytes : t.columns * t.element_bytes;
      const size_t old_size = n / old_shards;
      const size_t new_size = n / new_shards;
      const size_t runs = t.split_columns ? t.rows : 1;
      const size_t begin = j * new_size;
      const size_t end = begin + new_size;
      for (size_t run = 0; run < runs; ++run) {
        for (size_t i = begin / old_size; i < old_shards && i * old_size < end; ++i) {
          const size_t from_index = std::max(begin, i * old_size);
          const size_t to_index = std::min(end, (i + 1) * old_size);
          const int src_slot = current.home_slot(from.first_unit(expert) + static_cast<int>(i));
          pieces.push_back({src_slot,
                            old_base + (run * old_size + from_index - i * old_size) * unit,
                            dst_slot, new_base + (run * new_size + from_index - begin) * unit,
                            (to_index - from_index) * unit});
        }
      }
      old_base += t.bytes() / old_shards;
      new_base += t.bytes() / new_shards;
    }
  }
  return pieces;
}

ShardPricing PriceSharding(const CostModel& cost, double expert_tokens, int spread,
                           double relative_gemm_efficiency, double state_bytes) {
  ShardPricing price;
  price.spread = spread;
  if (spread < 2) return price;
  const CostModelConfig& config = cost.config();
  const Topology& topology = cost.topology();
  const double intra = topology.intra_node_bytes_per_second();
  const double slowest =
      topology.num_nodes() > 1 ? std::min(intra, topology.inter_node_bytes_per_second()) : intra;
  const double m = spread;
  // Replicas: a ring of `spread` copies in one node; each edge carries (m-1)/m of the weights
  // per sync pass (CostModel::ReplicaSyncSeconds).
  price.replicate_seconds =
      cost.expert_weight_bytes() * config.replica_sync_passes * (m - 1) / m / intra;
  // Shards: each shard's rank receives all of the expert's rows instead of 1/m of them (every
  // all-to-all pass), and runs its rows at the narrower GEMM's efficiency.
  const double extra_rows = expert_tokens * (m - 1) / m;
  price.shard_seconds =
      extra_rows * cost.token_row_bytes() * config.all_to_all_passes / slowest +
      cost.ComputeSeconds(expert_tokens / m) * (1.0 / relative_gemm_efficiency - 1.0);
  // Resharding moves (m-1)/m of the expert's state within the node.
  price.switch_seconds = state_bytes * (m - 1) / m / intra;
  return price;
}

std::vector<int> ChooseShards(std::span<const double> expert_tokens, const ShardMap& current,
                              const CostModel& cost,
                              const std::function<double(double)>& relative_gemm_efficiency,
                              const ShardChoiceOptions& options) {
  const int num_experts = current.num_experts();
  const int per_node = cost.topology().gpus_per_node();
  const double ffn = cost.config().expert_ffn_size;
  double total = 0;
  for (double tokens : expert_tokens) total += tokens;
  const double mean_rank = total / cost.topology().num_ranks();
  std::vector<int> shards(static_cast<size_t>(num_experts), 1);
  for (int e = 0; e < num_experts; ++e) {
    // The ranks the expert must spread over so that none computes more than the mean rank's
    // rows, as far as its node allows and its state divides.
    int spread = mean_rank > 0 ? static_cast<int>(std::ceil(expert_tokens[e] / mean_rank)) : 1;
    spread = std::clamp(spread, 1, per_node);
    while (spread > 1 &&
           !(ShardsDivide(options.weights, spread) && ShardsDivide(options.optimizer, spread))) {
      --spread;
    }
    const int now = current.shards(e);
    if (spread < 2) {
      // Nothing to spread: a sharded expert goes back to whole only when its shards cost more
      // than that move repays.
      shards[e] = now;
      if (now > 1) {
        const ShardPricing kept = PriceSharding(
            cost, expert_tokens[e], now, relative_gemm_efficiency(ffn / now), options.state_bytes);
        const double saved = kept.shard_seconds;
        if (saved * options.payback_steps > kept.switch_seconds) shards[e] = 1;
      }
      continue;
    }
    const ShardPricing price =
        PriceSharding(cost, expert_tokens[e], spread, relative_gemm_efficiency(ffn / spread),
                      options.state_bytes);
    const bool shard_is_cheaper = price.shard_seconds < price.replicate_seconds;
    const int wanted = shard_is_cheaper ? spread : 1;
    if (wanted == now) {
      shards[e] = now;
      continue;
    }
    // A change must repay its state moves within the payback horizon.
    const double gain = std::abs(price.replicate_seconds - price.shard_seconds);
    shards[e] = gain * options.payback_steps > price.switch_seconds ? wanted : now;
  }
  return shards;
}

}  // namespace keel
