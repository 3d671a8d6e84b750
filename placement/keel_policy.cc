// `keel` (the default policy): migration-aware incremental placement plus per-step quota routing
// and transient replicas. A replan starts from the placement in force and changes only the few
// slots that pay for themselves under the cost model; the per-step planner (step_planner.cc) then
// splits every expert's tokens exactly among its copies and adds transient replicas for bursts.
#include <algorithm>
#include <cmath>
#include <span>
#include <string>
#include <vector>

#include "placement/policy.h"

namespace keel {
namespace {

// A placement, its exact quota split on the estimated load, and its predicted time. Replans
// judge candidates by the terms a copy move changes: the slowest rank's compute under exact
// quotas, the replica sync ring and the exposed migration from the placement in force. The
// all-to-all volume hardly depends on which rank holds a copy once quotas balance the receivers,
// and pricing it would cost a full routing per candidate.
struct Scored {
  Placement placement;
  QuotaSplit split;
  std::vector<long long> rank_tokens;  // [num_ranks]
  double seconds = 0;
};

// Starts from the static placement (homes contiguous, spare slots empty); replans fill the spare
// slots with replicas of the experts that turn out hot, or, with spare_slots: per_step, leave
// them to the per-step planner and only move homes. A candidate's time needs only its max
// rank load, which the splitter resumes from the last solution; the full split, which picks the
// next move, is solved afresh only for the candidates taken, so that every move is chosen from
// the same split a fresh solve gives.
class KeelPolicy final : public Policy {
 public:
  explicit KeelPolicy(const PolicyContext& context) : Policy(context) {}
  std::string_view name() const override { return "keel"; }

  Result<Placement> Replan(const LayerView& view) override;

  Result<StepRouting> Route(int /*layer*/, const Placement& placement,
                            const StepLoad& load) override {
    const KeelPolicyConfig& keel = context().config.keel;
    QuotaPlanOptions options;
    options.transient_per_rank = keel.transient_replicas ? context().transient_per_rank : 0;
    options.spare_slots = keel.spare_slots_per_step();
    return PlanStepQuotas(placement, load, context().topology, context().cost, options);
  }

 private:
  // Predicted time of `placement` with the given max rank load.
  double Seconds(const LayerView& view, const Placement& placement,
                 long long max_rank_tokens) const;
  // `placement` with its exact split; `seconds` comes from Seconds, or is negative to be computed.
  Scored Solve(const LayerView& view, Placement placement, const std::vector<long long>& tokens,
               double seconds = -1);

  // Adds a copy of the expert with the largest quota on the slowest rank to one of the coolest
  // ranks without it; true when that lowered the predicted time. When no such rank has a slot
  // to give (every slot holds a home or a sole copy, or spare slots are the per-step planner's),
  // falls back to SwapWithCoolest.
  Result<bool> SpreadHottest(const LayerView& view, const std::vector<long long>& tokens,
                             Scored& best);

  // Swaps the hot expert's copy on the slowest rank with the least-used copy on `cool_rank`:
  // homes relocate with their copies (weights + optimizer state), so the swap is kept only when
  // its gain per step pays the full transfer back within home_payback_horizon_steps.
  Result<bool> SwapWithCoolest(const LayerView& view, const std::vector<long long>& tokens,
                               int hot_rank, int hot_expert, int cool_rank, Scored& best);

  QuotaSplitter splitter_;  // only Replan uses it, one layer at a time
};

double KeelPolicy::Seconds(const LayerView& view, const Placement& placement,
                           long long max_rank_tokens) const {
  const CostModel& cost = context().cost;
  const double compute = cost.ComputeSeconds(static_cast<double>(max_rank_tokens));
  // The placement in force moves nothing; pricing it as a migration would give zero too.
  const double migration = placement == *view.current ? 0.0 : MigrationSeconds(view, placement);
  return compute + cost.ReplicaSyncSeconds(placement) + std::max(0.0, migration - compute);
}

Scored KeelPolicy::Solve(const LayerView& view, Placement placement,
                         const std::vector<long long>& tokens, double seconds) {
  Scored scored{std::move(placement), {}, {}, seconds};
  const Placement& p = scored.placement;
  splitter_.Split(p, tokens, scored.split);
  scored.rank_tokens.assign(p.num_ranks(), 0);
  for (int rank = 0, s = 0; rank < p.num_ranks(); ++rank) {
    for (int i = 0; i < p.slots_per_rank(); ++i)
      scored.rank_tokens[rank] += scored.split.slot_quota[s++];
  }
  if (seconds < 0) scored.seconds = Seconds(view, p, scored.split.max_rank_tokens);
  return scored;
}

Result<bool> KeelPolicy::SpreadHottest(const LayerView& view, const std::vector<long long>& tokens,
                                       Scored& best) {
  const Placement& p = best.placement;
  const int num_ranks = p.num_ranks();
  const std::vector<long long>& rank_tokens = best.rank_tokens;
  const int hot_rank = static_cast<int>(std::max_element(rank_tokens.begin(), rank_tokens.end()) -
                                        rank_tokens.begin());

  int hot_expert = -1;
  long long hot_quota = 0;
  for (int s = hot_rank * p.slots_per_rank(); s < (hot_rank + 1) * p.slots_per_rank(); ++s) {
    const int e = p.expert_at(s);
    if (e == kEmptySlot || p.logcnt()[e] >= num_ranks) continue;
    if (best.split.slot_quota[s] > hot_quota) {
      hot_quota = best.split.slot_quota[s];
      hot_expert = e;
    }
  }
  if (hot_expert < 0) return false;

  // Receivers: ranks without a copy, coolest first, the home's node breaking ties (cheaper
  // sync). The first that helps is taken, and at most two are tried, so that a replan stays
  // within tens of microseconds.
  constexpr int kReceiversTried = 2;
  const Topology& topology = context().topology;
  const int home = p.home(hot_expert);
  auto cooler = [&](int a, int b) {
    if (rank_tokens[a] != rank_tokens[b]) return rank_tokens[a] < rank_tokens[b];
    const bool a_near = topology.same_node(a, home), b_near = topology.same_node(b, home);
    return a_near != b_near ? a_near : a < b;
  };
  std::vector<char> holds(num_ranks, 0);
  for (int rank : p.copy_ranks(hot_expert)) holds[rank] = 1;
  std::vector<int> receivers;
  for (int g = 0; g < num_ranks; ++g) {
    if (!holds[g]) receivers.push_back(g);
  }
  const int tried = std::min<int>(kReceiversTried, static_cast<int>(receivers.size()));
  std::partial_sort(receivers.begin(), receivers.begin() + tried, receivers.end(), cooler);
  receivers.resize(tried);

  // Spare slots left to the per-step planner take no copy: only homes move.
  const bool spares_per_step = context().config.keel.spare_slots == "per_step";
  const std::span<const int> copy_receivers =
      spares_per_step ? std::span<const int>() : std::span<const int>(receivers);
  bool improved = false;
  bool any_donor = false;
  for (int rank : copy_receivers) {
    // Donor slot on the receiver: an empty slot, else the replica (never a home) whose quota is
    // smallest, i.e. the copy the layer misses least.
    int donor = -1;
    long long donor_quota = 0;
    for (int s = rank * p.slots_per_rank(); s < (rank + 1) * p.slots_per_rank(); ++s) {
      const int e = p.expert_at(s);
      if (e == kEmptySlot) {
        donor = s;
        break;
      }
      if (p.home(e) == rank || p.logcnt()[e] < 2) continue;
      if (donor < 0 || best.split.slot_quota[s] < donor_quota) {
        donor_quota = best.split.slot_quota[s];
        donor = s;
      }
    }
    if (donor < 0) continue;
    any_donor = true;
    std::vector<int> phy2log = best.placement.phy2log();
    phy2log[donor] = hot_expert;
    KEEL_ASSIGN_OR_RETURN(
        Placement candidate,
        Placement::Create(p.num_experts(), num_ranks, std::move(phy2log), best.placement.home()));
    const double seconds = Seconds(view, candidate, splitter_.MaxRankTokens(candidate));
    if (seconds < best.seconds) {
      best = Solve(view, std::move(candidate), tokens, seconds);
      improved = true;
      break;  // the coolest receiver that helps is taken; the next move looks again
    }
  }
  if (improved || any_donor || receivers.empty()) return improved;
  return SwapWithCoolest(view, tokens, hot_rank, hot_expert, receivers.front(), best);
}

Result<bool> KeelPolicy::SwapWithCoolest(const LayerView& view,
                                         const std::vector<long long>& tokens, int hot_rank,
                                         int hot_expert, int cool_rank, Scored& best) {
  const Placement& p = best.placement;
  int hot_slot = -1, cool_slot = -1;
  long long cool_quota = 0;
  for (int s = hot_rank * p.slots_per_rank(); s < (hot_rank + 1) * p.slots_per_rank(); ++s) {
    if (p.expert_at(s) == hot_expert) hot_slot = s;
  }
  for (int s = cool_rank * p.slots_per_rank(); s < (cool_rank + 1) * p.slots_per_rank(); ++s) {
    const int e = p.expert_at(s);
    if (e == kEmptySlot || p.holds(hot_rank, e)) continue;  // never two copies on one rank
    if (cool_slot < 0 || best.split.slot_quota[s] < cool_quota) {
      cool_quota = best.split.slot_quota[s];
      cool_slot = s;
    }
  }
  if (hot_slot < 0 || cool_slot < 0) return false;
  std::vector<int> phy2log = p.phy2log();
  std::swap(phy2log[hot_slot], phy2log[cool_slot]);
  KEEL_ASSIGN_OR_RETURN(Placement candidate, Placement::CreateKeepingHomes(p, std::move(phy2log)));
  const double move_seconds =
      view.fresh_start ? 0.0 : context().cost.Migration(p, candidate).seconds;
  const double seconds = Seconds(view, candidate, splitter_.MaxRankTokens(candidate));
  const double gain_per_step = best.seconds - seconds;
  const double horizon = context().config.keel.home_payback_horizon_steps;
  if (gain_per_step <= 0 || gain_per_step * horizon <= move_seconds) return false;
  best = Solve(view, std::move(candidate), tokens, seconds);
  return true;
}

Result<Placement> KeelPolicy::Replan(const LayerView& view) {
  KEEL_RETURN_IF_ERROR(CheckLayerView(view).WithContext("keel"));
  const Placement& current = *view.current;
  const int num_ranks = current.num_ranks();
  std::vector<long long> tokens(view.expert_load.size());
  long long total = 0;
  for (size_t e = 0; e < tokens.size(); ++e) {
    tokens[e] = std::llround(std::max(0.0, view.expert_load[e]));
    total += tokens[e];
  }
  if (total <= 0) return current;

  const KeelPolicyConfig& config = context().config.keel;
  Scored best = Solve(view, current, tokens);
  const double start_seconds = best.seconds;
  // Already within the gain threshold of a perfect split: nothing can pay for a change.
  const double perfect = static_cast<double>(total) / num_ranks;
  if (best.split.max_rank_tokens <= perfect * (1.0 + config.min_gain_fraction)) return current;

  for (int move = 0; move < config.max_moves_per_replan; ++move) {
    KEEL_ASSIGN_OR_RETURN(bool improved, SpreadHottest(view, tokens, best));
    if (!improved) break;
  }
  // Small predicted gains are noise in the estimate: not worth an epoch change.
  if (best.seconds >= start_seconds * (1.0 - config.min_gain_fraction)) return current;
  return std::move(best.placement);
}

}  // namespace

std::unique_ptr<Policy> MakeKeelPolicy(const PolicyContext& context) {
  return std::make_unique<KeelPolicy>(context);
}

}  // namespace keel
