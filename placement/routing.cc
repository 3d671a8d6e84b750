// Per-step routing that needs no optimization: even splits and FasterMoE-style shadows.
// The exact quota planner lives in quota_solver.cc.
#include "placement/routing.h"

#include <algorithm>
#include <numeric>
#include <string>
#include <utility>

namespace keel {

double StepRouting::max_rank_tokens() const {
  return rank_tokens.empty() ? 0.0 : *std::max_element(rank_tokens.begin(), rank_tokens.end());
}

double StepRouting::mean_rank_tokens() const {
  if (rank_tokens.empty()) return 0.0;
  return std::accumulate(rank_tokens.begin(), rank_tokens.end(), 0.0) / rank_tokens.size();
}

double StepRouting::imbalance() const { return Imbalance(rank_tokens); }

namespace {

StepRouting EmptyRouting(const Placement& placement) {
  StepRouting routing;
  routing.num_ranks = placement.num_ranks();
  routing.rank_tokens.assign(routing.num_ranks, 0.0);
  routing.sent_tokens.assign(static_cast<size_t>(routing.num_ranks) * routing.num_ranks, 0.0);
  routing.slot_tokens.assign(placement.num_slots(), 0.0);
  return routing;
}

// Sends `tokens` of `expert` from `source` evenly to every copy of the expert.
void SpreadEvenly(const Placement& placement, int source, int expert, double tokens,
                  StepRouting& routing) {
  const auto slots = placement.copies(expert);
  const auto ranks = placement.copy_ranks(expert);
  const double share = tokens / static_cast<double>(slots.size());
  for (size_t i = 0; i < slots.size(); ++i) {
    const int slot = slots[i];
    const int rank = ranks[i];
    routing.slot_tokens[slot] += share;
    routing.rank_tokens[rank] += share;
    routing.sent_tokens[static_cast<size_t>(source) * routing.num_ranks + rank] += share;
  }
}

}  // namespace

StepRouting RouteEvenly(const Placement& placement, const StepLoad& load) {
  return RouteWithShadows(placement, load, {});
}

StepRouting RouteWithShadows(const Placement& placement, const StepLoad& load,
                             const std::vector<int>& shadowed) {
  StepRouting routing = EmptyRouting(placement);
  std::vector<char> is_shadowed(load.num_experts, 0);
  for (int e : shadowed) is_shadowed[e] = 1;
  std::vector<double> shadow_tokens(
      shadowed.empty() ? 0 : static_cast<size_t>(load.num_experts) * routing.num_ranks);
  for (int s = 0; s < load.num_sources; ++s) {
    // Sources beyond the topology's ranks (a trace recorded on more ranks) map round-robin.
    const int source = s % routing.num_ranks;
    for (int e = 0; e < load.num_experts; ++e) {
      const double tokens = load.at(s, e);
      if (tokens == 0) continue;
      if (is_shadowed[e]) {
        routing.rank_tokens[source] += tokens;
        routing.sent_tokens[static_cast<size_t>(source) * routing.num_ranks + source] += tokens;
        shadow_tokens[static_cast<size_t>(e) * routing.num_ranks + source] += tokens;
      } else {
        SpreadEvenly(placement, source, e, tokens, routing);
      }
    }
  }
  // A shadow on a rank without a persistent copy is a transient replica fed from the home;
  // a shadow on a rank with a persistent copy runs in that slot.
  for (int e : shadowed) {
    for (int g = 0; g < routing.num_ranks; ++g) {
      const double tokens = shadow_tokens[static_cast<size_t>(e) * routing.num_ranks + g];
      const auto slots = placement.copies(e);
      const auto local = std::find_if(slots.begin(), slots.end(),
                                      [&](int s) { return placement.rank_of_slot(s) == g; });
      if (local != slots.end()) {
        routing.slot_tokens[*local] += tokens;
        continue;
      }
      routing.transients.push_back({e, g, placement.home(e)});
      routing.transient_tokens.push_back(tokens);
    }
  }
  return routing;
}

Result<StepRouting> RouteInProportion(const Placement& placement, const StepLoad& load,
                                      std::span<const double> slot_quota,
                                      std::vector<TransientReplica> transients,
                                      std::span<const double> transient_quota) {
  if (static_cast<int>(slot_quota.size()) != placement.num_slots()) {
    return InvalidArgument("slot_quota has " + std::to_string(slot_quota.size()) +
                           " entries, expected num_slots " + std::to_string(placement.num_slots()));
  }
  if (transient_quota.size() != transients.size()) {
    return InvalidArgument("transient_quota has " + std::to_string(transient_quota.size()) +
                           " entries for " + std::to_string(transients.size()) + " transients");
  }
  if (load.num_experts != placement.num_experts()) {
    return InvalidArgument("load has " + std::to_string(load.num_experts) + " experts, expected " +
                           std::to_string(placement.num_experts()));
  }
  StepRouting routing = EmptyRouting(placement);
  // Each expert's copies as (rank, quota, where its tokens are added).
  struct Copy {
    int rank;
    double quota;
    double* tokens;
    bool persistent;
  };
  std::vector<std::vector<Copy>> copies(load.num_experts);
  for (int e = 0; e < load.num_experts; ++e) {
    for (int slot : placement.copies(e)) {
      if (!(slot_quota[slot] >= 0)) {
        return InvalidArgument("slot_quota[" + std::to_string(slot) + "] is negative");
      }
      copies[e].push_back(
          {placement.rank_of_slot(slot), slot_quota[slot], &routing.slot_tokens[slot], true});
    }
  }
  routing.transients = std::move(transients);
  routing.transient_tokens.assign(routing.transients.size(), 0.0);
  for (size_t i = 0; i < routing.transients.size(); ++i) {
    const TransientReplica& t = routing.transients[i];
    if (t.expert < 0 || t.expert >= load.num_experts || t.rank < 0 || t.rank >= routing.num_ranks ||
        !(transient_quota[i] >= 0)) {
      return InvalidArgument("transient " + std::to_string(i) + " (expert " +
                             std::to_string(t.expert) + ", rank " + std::to_string(t.rank) +
                             ") is out of range or has a negative quota");
    }
    copies[t.expert].push_back({t.rank, transient_quota[i], &routing.transient_tokens[i], false});
  }
  for (int e = 0; e < load.num_experts; ++e) {
    double total = 0;
    for (const Copy& copy : copies[e]) total += copy.quota;
    if (total == 0) {
      // No quota anywhere: the persistent copies share evenly.
      for (Copy& copy : copies[e]) copy.quota = copy.persistent ? 1.0 : 0.0;
      total = static_cast<double>(placement.copies(e).size());
    }
    for (int s = 0; s < load.num_sources; ++s) {
      const double tokens = load.at(s, e);
      if (tokens == 0) continue;
      const int source = s % routing.num_ranks;
      for (const Copy& copy : copies[e]) {
        const double share = tokens * (copy.quota / total);
        *copy.tokens += share;
        routing.rank_tokens[copy.rank] += share;
        routing.sent_tokens[static_cast<size_t>(source) * routing.num_ranks + copy.rank] += share;
      }
    }
  }
  return routing;
}

}  // namespace keel
