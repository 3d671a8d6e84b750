// Engine::Impl's routing: Route and RouteCounts count this rank's (token, k) entries per expert,
// all-reduce every rank's counts (AgreeOnCall), split each expert's entries among its copies with
// the layer's StepPlanner (the same quota plan on every rank, transient replicas included), fill
// new transient slots with their expert's weights, and answer the physical slot of every entry.
// A layer may be routed any number of times in a step, once per micro-batch: each is planned on
// its own counts, with the transients that earlier micro-batches filled kept as copies.
#include "engine/engine_impl.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "kernels/histogram.h"
#include "kernels/remap.h"
#include "migration/transfer_plan.h"

namespace keel {
namespace {

// The message for the first id in `topk_ids` that is neither an expert nor -1.
Status InvalidExpertId(std::span<const int32_t> topk_ids, int num_experts) {
  for (size_t i = 0; i < topk_ids.size(); ++i) {
    const int32_t id = topk_ids[i];
    if (id != -1 && (id < 0 || id >= num_experts)) {
      return InvalidArgument("topk_ids[" + std::to_string(i) + "] = " + std::to_string(id) +
                             " is not an expert id in [0, " + std::to_string(num_experts) +
                             ") or -1");
    }
  }
  return Internal("an invalid expert id was counted but not found");
}

}  // namespace

std::vector<int> Engine::Impl::TransientSlots(const Placement& placement,
                                              const StepRouting& routing,
                                              const LayerStep& step) const {
  const size_t filled = step.transient_slot.size();  // the first routing.transients
  std::vector<int> slot(step.transient_slot.begin(), step.transient_slot.end());
  std::vector<char> taken(num_slots() + static_cast<size_t>(num_ranks_) * transient_per_rank_, 0);
  for (int s : slot) taken[s] = 1;
  auto first_free = [&](int rank) {
    if (spare_slots_planned_) {
      for (int s = rank * slots_per_rank_; s < (rank + 1) * slots_per_rank_; ++s) {
        if (placement.expert_at(s) == kEmptySlot && !taken[s]) return s;
      }
    }
    for (int i = 0; i < transient_per_rank_; ++i) {
      const int s = num_slots() + rank * transient_per_rank_ + i;
      if (!taken[s]) return s;
    }
    return -1;  // the planner keeps within each rank's room
  };
  for (size_t i = filled; i < routing.transients.size(); ++i) {
    slot.push_back(first_free(routing.transients[i].rank));
    if (slot.back() >= 0) taken[slot.back()] = 1;
  }
  return slot;
}

// Route, ReduceGradients and StepEnd read and write every slot's buffers.
Status Engine::Impl::CheckAllRegistered() const {
  if (registered_ != static_cast<int>(buffers_.size())) {
    return FailedPrecondition("only " + std::to_string(registered_) + " of " +
                              std::to_string(buffers_.size()) +
                              " slots are registered; register every slot of every layer first");
  }
  return Status::Ok();
}

Status Engine::Impl::CheckRoutable(int layer) const {
  if (layer < 0 || layer >= options_.num_layers) {
    return InvalidArgument("layer = " + std::to_string(layer) + " is not in [0, " +
                           std::to_string(options_.num_layers) + ")");
  }
  KEEL_RETURN_IF_ERROR(CheckAllRegistered());
  if (gradients_reduced_) {
    // The gradients are folded and an epoch may have switched: the step's routing is closed.
    return FailedPrecondition("layer " + std::to_string(layer) +
                              " is routed after ReduceGradients; call StepEnd first");
  }
  return Status::Ok();
}

Status Engine::Impl::CheckRouteCounts(int layer, std::span<const int32_t> expert_counts) const {
  KEEL_RETURN_IF_ERROR(CheckRoutable(layer));
  if (shards_[layer].sharded()) {
    return FailedPrecondition("layer " + std::to_string(layer) +
                              " has sharded experts, whose rows RouteCounts cannot assign; use "
                              "Route");
  }
  if (expert_counts.size() != static_cast<size_t>(options_.num_experts)) {
    return InvalidArgument("expert_counts has " + std::to_string(expert_counts.size()) +
                           " entries, not num_experts = " + std::to_string(options_.num_experts));
  }
  for (size_t e = 0; e < expert_counts.size(); ++e) {
    if (expert_counts[e] < 0) {
      return InvalidArgument("expert_counts[" + std::to_string(e) +
                             "] = " + std::to_string(expert_counts[e]) + " is negative");
    }
  }
  return Status::Ok();
}

Result<LayerRoute> Engine::Impl::Route(int layer, std::span<const int32_t> topk_ids) {
  const auto start = std::chrono::steady_clock::now();
  const int num_experts = options_.num_experts;
  Status checked = CheckRoutable(layer);
  if (checked.ok() && topk_ids.size() % options_.top_k != 0) {
    checked =
        InvalidArgument("topk_ids has " + std::to_string(topk_ids.size()) +
                        " entries, not a multiple of top_k = " + std::to_string(options_.top_k));
  }
  // In an MP group every member holds the same tokens and routes only its share of them.
  const auto [share_begin, share_end] =
      Share(static_cast<int64_t>(topk_ids.size()) / options_.top_k);
  std::vector<int32_t> share_ids;
  if (checked.ok() && options_.mp_group_size > 1) {
    share_ids.assign(topk_ids.size(), -1);
    std::copy(topk_ids.begin() + share_begin * options_.top_k,
              topk_ids.begin() + share_end * options_.top_k,
              share_ids.begin() + share_begin * options_.top_k);
    topk_ids = share_ids;
  }
  std::vector<int32_t> mine(num_experts);
  if (checked.ok()) {
    int32_t invalid = 0;
    checked = kernels::cpu::ExpertHistogram(topk_ids.data(), static_cast<int64_t>(topk_ids.size()),
                                            num_experts, mine.data(), &invalid);
    if (checked.ok() && invalid > 0) checked = InvalidExpertId(topk_ids, num_experts);
  }
  KEEL_RETURN_IF_ERROR(AgreeOnCall(CollectiveCall::kRoute, layer, checked, mine));
  // With sharded experts the rows are the entries with one row per shard, each naming a unit.
  const ShardMap& units = shards_[layer];
  std::span<const int32_t> ids = topk_ids;
  std::vector<int32_t> unit_ids;
  std::vector<int32_t> row_entry;
  if (units.sharded()) {
    for (size_t i = 0; i < topk_ids.size(); ++i) {
      const int32_t e = topk_ids[i];
      const int rows = e < 0 ? 1 : units.shards(e);
      for (int j = 0; j < rows; ++j) {
        unit_ids.push_back(e < 0 ? -1 : units.first_unit(e) + j);
        row_entry.push_back(static_cast<int32_t>(i));
      }
    }
    ids = unit_ids;
  }
  KEEL_ASSIGN_OR_RETURN(LayerRoute route, PlanLayer(layer));
  route.row_entry = std::move(row_entry);
  route.share_begin = share_begin;
  route.share_end = share_end;
  const kernels::QuotaTable quotas = kernels::MakeQuotaTable(
      route.copy_begin, route.copy_slot, route.copy_quota, route.slot_rank, num_ranks_);
  route.slot.resize(ids.size());
  std::vector<int32_t> send_counts(num_ranks_);
  int32_t invalid = 0;
  KEEL_RETURN_IF_ERROR(kernels::cpu::RemapWithQuotas(ids.data(), static_cast<int64_t>(ids.size()),
                                                     quotas, route.slot.data(), send_counts.data(),
                                                     &invalid));
  if (invalid > 0) {
    return Internal("the quota plan of layer " + std::to_string(layer) + " gave rank " +
                    std::to_string(rank_) + " no copy for " + std::to_string(invalid) +
                    " of its entries");
  }
  route.send_counts.assign(send_counts.begin(), send_counts.end());
  stats_.route_seconds += SecondsSince(start);
  return route;
}

Result<LayerRoute> Engine::Impl::RouteCounts(int layer, std::span<const int32_t> expert_counts) {
  const auto start = std::chrono::steady_clock::now();
  KEEL_RETURN_IF_ERROR(AgreeOnCall(CollectiveCall::kRoute, layer,
                                   CheckRouteCounts(layer, expert_counts), expert_counts));
  KEEL_ASSIGN_OR_RETURN(LayerRoute route, PlanLayer(layer));
  // What the remap will send: the entries of e fill its copies' quotas in order, the last copy
  // takes the rest.
  route.send_counts.assign(num_ranks_, 0);
  for (int e = 0; e < options_.num_experts; ++e) {
    int64_t left = expert_counts[e];
    for (int c = route.copy_begin[e]; c < route.copy_begin[e + 1] && left > 0; ++c) {
      const bool last = c + 1 == route.copy_begin[e + 1];
      const int64_t taken = last ? left : std::min<int64_t>(left, route.copy_quota[c]);
      route.send_counts[route.slot_rank[route.copy_slot[c]]] += taken;
      left -= taken;
    }
  }
  stats_.route_seconds += SecondsSince(start);
  return route;
}

Result<LayerRoute> Engine::Impl::PlanLayer(int layer) {
  const ShardMap& units = shards_[layer];
  const int num_experts = units.num_units();  // the placement's experts
  LayerStep& step = step_[layer];
  // AgreeOnCall left every rank's counts by expert; each unit of an expert sees all of its rows.
  const size_t num_ranks = static_cast<size_t>(num_ranks_);
  std::span<const int32_t> by_unit = by_expert_;
  if (units.sharded()) {
    by_unit_.resize(num_ranks * num_experts);
    for (int u = 0; u < num_experts; ++u) {
      const auto column = by_expert_.begin() + units.expert_of(u) * num_ranks;
      std::copy(column, column + num_ranks, by_unit_.begin() + u * num_ranks);
    }
    by_unit = by_unit_;
  }

  const Placement& placement = placements_[layer];
  QuotaPlanOptions quota_options;
  quota_options.transient_per_rank = transients_planned_;
  quota_options.spare_slots = spare_slots_planned_;
  quota_options.record_shares = true;
  quota_options.shares_of_rank = rank_;  // the loop below reads nothing else
  quota_options.sent_tokens = false;     // nor does anything read the all-to-all matrix
  quota_options.fixed_transients = step.transients;
  StepRouting& routing = plan_scratch_;
  KEEL_RETURN_IF_ERROR(
      planners_[layer]->Plan(placement, num_ranks_, by_unit, quota_options, routing));
  std::vector<int> transient_slot = TransientSlots(placement, routing, step);
  if (std::find(transient_slot.begin(), transient_slot.end(), -1) != transient_slot.end()) {
    return Internal("the quota plan of layer " + std::to_string(layer) +
                    " put more transient replicas on a rank than it has free slots");
  }

  // This rank's quotas by expert, in the planner's order: its entries fill them front to back.
  struct Quota {
    int expert;
    int32_t slot;
    int32_t tokens;
  };
  std::vector<Quota> mine_quotas;
  LayerRoute route;
  route.epoch = stats_.epoch;
  route.copy_begin.assign(num_experts + 1, 0);
  route.recv_counts.assign(static_cast<size_t>(num_ranks_) * local_slots(), 0);
  route.recv_totals.assign(num_ranks_, 0);
  for (const CopyShare& share : routing.shares) {
    const int slot = PhysicalSlot(share.copy, transient_slot);
    const int64_t tokens = std::llround(share.tokens);
    if (tokens <= 0) continue;
    if (share.source == rank_) {
      mine_quotas.push_back({share.expert, slot, static_cast<int32_t>(tokens)});
      ++route.copy_begin[share.expert + 1];
    }
    if (RankOfPhysical(slot) == rank_) {
      route
          .recv_counts[static_cast<size_t>(share.source) * local_slots() + LocalOfPhysical(slot)] +=
          tokens;
      route.recv_totals[share.source] += tokens;
    }
  }
  for (int e = 0; e < num_experts; ++e) route.copy_begin[e + 1] += route.copy_begin[e];
  // Stable by expert: each expert's copies keep the planner's order.
  route.copy_slot.resize(mine_quotas.size());
  route.copy_quota.resize(mine_quotas.size());
  std::vector<int32_t> next(route.copy_begin.begin(), route.copy_begin.end() - 1);
  for (const Quota& quota : mine_quotas) {
    const int32_t at = next[quota.expert]++;
    route.copy_slot[at] = quota.slot;
    route.copy_quota[at] = quota.tokens;
  }
  route.slot_rank.resize(num_slots() + num_ranks_ * transient_per_rank_);
  for (size_t slot = 0; slot < route.slot_rank.size(); ++slot) {
    route.slot_rank[slot] = RankOfPhysical(static_cast<int>(slot));
  }
  // Each local slot's unit, then the expert and shard it is.
  route.local_experts.assign(local_slots(), -1);
  for (int i = 0; i < slots_per_rank_; ++i) {
    route.local_experts[i] = placement.expert_at(rank_ * slots_per_rank_ + i);
  }
  for (size_t i = 0; i < routing.transients.size(); ++i) {
    if (routing.transients[i].rank == rank_) {
      route.local_experts[LocalOfPhysical(transient_slot[i])] = routing.transients[i].expert;
    }
  }
  route.local_shard.assign(local_slots(), 0);
  route.local_shards.assign(local_slots(), 0);
  for (int i = 0; i < local_slots(); ++i) {
    const int unit = route.local_experts[i];
    if (unit < 0) continue;
    route.local_experts[i] = units.expert_of(unit);
    route.local_shard[i] = units.shard_of(unit);
    route.local_shards[i] = units.shards(units.expert_of(unit));
  }

  const size_t filled = step.transients.size();
  KEEL_RETURN_IF_ERROR(FillTransients(layer, placement, routing, transient_slot, filled));
  step.transients.assign(routing.transients.begin(), routing.transients.end());
  step.transient_slot = std::move(transient_slot);
  ++step.routes;
  // The estimators and the trace keep the step's traffic by source and expert.
  step.traffic.resize(num_ranks * options_.num_experts, 0.0);
  for (int e = 0; e < options_.num_experts; ++e) {
    for (size_t r = 0; r < num_ranks; ++r) {
      step.traffic[r * options_.num_experts + e] += by_expert_[e * num_ranks + r];
    }
  }
  if (metrics_ != nullptr) {
    std::vector<double> expert_tokens(options_.num_experts, 0.0);
    for (int e = 0; e < options_.num_experts; ++e) {
      for (size_t r = 0; r < num_ranks; ++r) expert_tokens[e] += by_expert_[e * num_ranks + r];
    }
    metrics_->ObserveLayerRouting(
        layer, placement, routing, expert_tokens, {},
        std::min(num_ranks_, placement.max_copies() + (transients_planned_ > 0 ? 1 : 0)));
  }
  return route;
}

// A transient replica's weights come from a copy on its source rank: the home slot when the
// home is there, else that rank's lowest copy.
Status Engine::Impl::FillTransients(int layer, const Placement& placement,
                                    const StepRouting& routing,
                                    const std::vector<int>& transient_slot, size_t first) {
  if (routing.transients.size() == first) return Status::Ok();
  const size_t bytes = options_.shape.weight_bytes;
  auto source_slot = [&](const TransientReplica& t) {
    if (placement.home(t.expert) == t.source_rank) return placement.home_slot(t.expert);
    for (int slot : placement.copies(t.expert)) {
      if (placement.rank_of_slot(slot) == t.source_rank) return slot;
    }
    return -1;
  };
  const std::span<const TransientReplica> fills =
      std::span<const TransientReplica>(routing.transients).subspan(first);
  exchange_.Begin(num_ranks_);
  for (const TransientReplica& t : fills) {
    if (t.source_rank != rank_) continue;
    const int slot = source_slot(t);
    if (slot < 0) {
      return Internal("transient replica of expert " + std::to_string(t.expert) +
                      " names source rank " + std::to_string(t.source_rank) +
                      ", which holds no copy");
    }
    exchange_.Add(t.rank, Buffers(layer, slot % slots_per_rank_).weights, bytes);
  }
  // The fills this rank receives, in the order the loop below reads them.
  for (const TransientReplica& t : fills) {
    if (t.rank == rank_) exchange_.Expect(t.source_rank, bytes);
  }
  KEEL_RETURN_IF_ERROR(exchange_.Run(communicator_, *memory_, on_device()));
  std::optional<uint64_t> last;
  for (size_t i = first; i < routing.transients.size(); ++i) {
    const TransientReplica& t = routing.transients[i];
    if (t.rank != rank_) continue;
    KEEL_ASSIGN_OR_RETURN(const std::byte* weights, exchange_.Received(t.source_rank, bytes));
    KEEL_ASSIGN_OR_RETURN(
        last,
        memory_->StartCopy(Weights(layer, LocalOfPhysical(transient_slot[i])), weights, bytes));
  }
  return WaitForLast(*memory_, last);
}

}  // namespace keel
