// The exact quota split: SplitQuotas, QuotaSplitter and the QuotaSolver behind them and the
// per-step planner (step_planner.cc), a parametric bipartite max-flow.
#include <algorithm>
#include <cassert>
#include <cstring>
#include <memory>
#include <span>
#include <vector>

#include "common/simd.h"
#include "placement/quota_solver.h"
#include "placement/routing.h"

namespace keel {
namespace {

long long CeilDiv(long long a, long long b) { return (a + b - 1) / b; }

// Adds 1 to each of values[0, n) that is at least `from`: ids after an inserted one move up.
// Four at a time (GCC's -O2 leaves such a loop scalar).
void MoveUpFrom(int* values, int n, int from) {
  int i = 0;
  for (; i + 4 <= n; i += 4) {
    IntQuad quad;
    std::memcpy(&quad, values + i, sizeof quad);
    quad -= quad >= from;  // a true comparison is -1
    std::memcpy(values + i, &quad, sizeof quad);
  }
  for (; i < n; ++i) values[i] += values[i] >= from ? 1 : 0;
}

// The quota of the next copy on an arc with `flow` shared by `on_rank` copies, of which `given`
// came before: an even share, the first flow % on_rank copies one more.
long long CopyQuota(long long flow, int on_rank, int& given) {
  // Almost always one copy: skip the slow 64-bit division.
  return on_rank == 1 ? flow : flow / on_rank + (given++ < flow % on_rank ? 1 : 0);
}

}  // namespace

void QuotaSolver::BuildCopies(const Placement& placement,
                              std::span<const TransientReplica> extras) {
  // Raw pointers and locals: through the vectors, every int store could change num_experts_ or
  // another int member as far as the compiler knows, and each loop would reload them.
  const int num_experts = num_experts_;
  const int num_slots = placement.num_slots();
  const std::vector<int>& logcnt = placement.logcnt();
  num_extras_ = static_cast<int>(extras.size());
  // The placement's copies, by expert, then the extras of each expert in their given order.
  const std::vector<int>& persistent_begin = placement.copy_begin();
  if (extras.empty()) {
    copy_begin_.assign(persistent_begin.begin(), persistent_begin.end());
    copy_id_.assign(placement.all_copy_slots().begin(), placement.all_copy_slots().end());
    copy_rank_.assign(placement.all_copy_ranks().begin(), placement.all_copy_ranks().end());
  } else {
    copy_begin_.assign(num_experts + 1, 0);
    for (const TransientReplica& x : extras) ++copy_begin_[x.expert + 1];
    for (int e = 0; e < num_experts; ++e) {
      copy_begin_[e + 1] += copy_begin_[e] + logcnt[e];
    }
    const int num_copies = copy_begin_[num_experts];
    copy_id_.resize(num_copies);
    copy_rank_.resize(num_copies);
    rank_fill_.resize(std::max(num_experts, num_ranks_));
    for (int e = 0; e < num_experts; ++e) {
      const int from = persistent_begin[e];
      const int to = copy_begin_[e];
      for (int i = 0; i < logcnt[e]; ++i) {
        copy_id_[to + i] = placement.all_copy_slots()[from + i];
        copy_rank_[to + i] = placement.all_copy_ranks()[from + i];
      }
      rank_fill_[e] = to + logcnt[e];
    }
    for (size_t i = 0; i < extras.size(); ++i) {
      const int pos = rank_fill_[extras[i].expert]++;
      copy_id_[pos] = num_slots + static_cast<int>(i);
      copy_rank_[pos] = extras[i].rank;
    }
  }
  copies_extend_base_ = false;
  const int* copy_begin = copy_begin_.data();
  const int* copy_rank = copy_rank_.data();
  const int num_copies = copy_begin[num_experts];
  copy_arc_.resize(num_copies);

  // At most one arc per copy: sized for that, trimmed after.
  arc_begin_.resize(num_experts + 1);
  arc_rank_.resize(num_copies);
  arc_expert_.resize(num_copies);
  arc_copies_.resize(num_copies);
  int* arc_begin = arc_begin_.data();
  int* arc_rank = arc_rank_.data();
  int* arc_expert = arc_expert_.data();
  int* arc_copies = arc_copies_.data();
  int* copy_arc = copy_arc_.data();
  int num_arcs = 0;
  for (int e = 0, c = 0; e < num_experts; ++e) {
    const int first_arc = num_arcs;
    arc_begin[e] = first_arc;
    // A placement lists copies by slot, so copies on one rank are adjacent: each rank change
    // starts an arc.
    int last_rank = -1;
    for (const int persistent_end = copy_begin[e] + logcnt[e]; c < persistent_end; ++c) {
      const int rank = copy_rank[c];
      if (rank != last_rank) {
        arc_rank[num_arcs] = rank;
        arc_expert[num_arcs] = e;
        arc_copies[num_arcs] = 0;
        ++num_arcs;
        last_rank = rank;
      }
      copy_arc[c] = num_arcs - 1;
      ++arc_copies[num_arcs - 1];
    }
    // Extras may land on any rank, one of the placement's included.
    for (const int end = copy_begin[e + 1]; c < end; ++c) {
      int arc = first_arc;
      while (arc < num_arcs && arc_rank[arc] != copy_rank[c]) ++arc;
      if (arc == num_arcs) {
        arc_rank[arc] = copy_rank[c];
        arc_expert[arc] = e;
        arc_copies[arc] = 0;
        ++num_arcs;
      }
      copy_arc[c] = arc;
      ++arc_copies[arc];
    }
  }
  arc_begin[num_experts] = num_arcs;
  arc_rank_.resize(num_arcs);
  arc_expert_.resize(num_arcs);
  arc_copies_.resize(num_arcs);
  arc_flow_.assign(num_arcs, 0);
}

void QuotaSolver::BuildBaseCopies(const Placement& placement) {
  if (!has_base_ || base_num_experts_ != placement.num_experts() ||
      base_num_ranks_ != placement.num_ranks() || base_phy2log_ != placement.phy2log()) {
    // A new base: the old one is not needed any more.
    BuildCopies(placement, {});
    has_base_ = true;
    base_singles_found_ = false;
    base_phy2log_.assign(placement.phy2log().begin(), placement.phy2log().end());
    base_num_experts_ = placement.num_experts();
    base_num_ranks_ = placement.num_ranks();
    base_saved_ = false;
  } else if (!copies_are_base_) {
    assert(base_saved_);
    TieCopies() = base_.Tie();
  }
  num_extras_ = 0;
  arc_flow_.assign(arc_rank_.size(), 0);
  copies_are_base_ = true;
  copies_extend_base_ = true;
}

void QuotaSolver::RecordBaseSingles() {
  // The base's arcs: the current ones, or those LeaveBase saved.
  assert(copies_are_base_ || base_saved_);
  const std::vector<int>& arc_begin = copies_are_base_ ? arc_begin_ : base_.arc_begin;
  const std::vector<int>& arc_rank = copies_are_base_ ? arc_rank_ : base_.arc_rank;
  auto single_rank = [&](int e) {
    return arc_begin[e + 1] - arc_begin[e] == 1 ? arc_rank[arc_begin[e]] : -1;
  };
  base_single_begin_.assign(num_ranks_ + 1, 0);
  for (int e = 0; e < num_experts_; ++e) {
    if (single_rank(e) >= 0) ++base_single_begin_[single_rank(e) + 1];
  }
  for (int r = 0; r < num_ranks_; ++r) base_single_begin_[r + 1] += base_single_begin_[r];
  base_single_.resize(base_single_begin_[num_ranks_]);
  rank_fill_.assign(base_single_begin_.begin(), base_single_begin_.end() - 1);
  for (int e = 0; e < num_experts_; ++e) {
    if (single_rank(e) >= 0) base_single_[rank_fill_[single_rank(e)]++] = e;
  }
  base_singles_found_ = true;
}

void QuotaSolver::LeaveBase() {
  if (copies_are_base_ && !base_saved_) {
    base_.Tie() = TieCopies();
    base_saved_ = true;
  }
  copies_are_base_ = false;
}

int QuotaSolver::InsertCopy(const TransientReplica& extra, int id) {
  LeaveBase();
  const int expert = extra.expert;
  MarkChanged(expert);
  int arc = arc_begin_[expert];
  while (arc < arc_begin_[expert + 1] && arc_rank_[arc] != extra.rank) ++arc;
  const bool new_arc = arc == arc_begin_[expert + 1];
  const int num_experts = num_experts_;
  if (new_arc) {
    arc_rank_.insert(arc_rank_.begin() + arc, extra.rank);
    arc_expert_.insert(arc_expert_.begin() + arc, expert);
    arc_copies_.insert(arc_copies_.begin() + arc, 0);
    arc_flow_.insert(arc_flow_.begin() + arc, 0);
    // Every expert after this one starts at least at `arc`, as every arc after it is.
    MoveUpFrom(arc_begin_.data() + expert + 1, num_experts - expert, arc);
    MoveUpFrom(copy_arc_.data(), static_cast<int>(copy_arc_.size()), arc);
  }
  ++arc_copies_[arc];
  const int copy = copy_begin_[expert + 1];
  copy_id_.insert(copy_id_.begin() + copy, id);
  copy_rank_.insert(copy_rank_.begin() + copy, extra.rank);
  copy_arc_.insert(copy_arc_.begin() + copy, arc);
  MoveUpFrom(copy_begin_.data() + expert + 1, num_experts - expert, copy);
  ++num_extras_;
  return new_arc ? arc : -1;
}

void QuotaSolver::PrepareNewArc(int expert, int arc, bool was_single) {
  assert(std::all_of(excess_.begin(), excess_.end(), [](long long x) { return x == 0; }));
  MoveUpFrom(rank_arcs_.data(), static_cast<int>(rank_arcs_.size()), arc);
  if (tokens_[expert] == 0) return;  // neither fixed nor flexible
  // Each rank lists its flexible arcs in ascending order, as Prepare does.
  auto enter = [&](int a) {
    const int rank = arc_rank_[a];
    const auto first = rank_arcs_.begin() + rank_arc_begin_[rank];
    const auto last = rank_arcs_.begin() + rank_arc_begin_[rank + 1];
    rank_arcs_.insert(std::upper_bound(first, last, a), a);
    MoveUpFrom(rank_arc_begin_.data() + rank + 1, num_ranks_ - rank, rank_arc_begin_[rank + 1]);
  };
  if (was_single) {
    // Its tokens leave its rank's fixed load and stay on its first arc as flow.
    const int first_arc = arc_begin_[expert];
    fixed_[arc_rank_[first_arc]] -= tokens_[expert];
    flexible_.insert(std::upper_bound(flexible_.begin(), flexible_.end(), expert), expert);
    enter(first_arc);
  }
  enter(arc);
}

// Water-fills each flexible expert, heaviest first, onto its least-loaded ranks up to `bound`.
void QuotaSolver::Pour(long long bound) {
  for (int e : pour_order_) {
    pour_ranks_.clear();
    for (int a = arc_begin_[e]; a < arc_begin_[e + 1]; ++a) {
      const long long load = bound - spare_[arc_rank_[a]];
      if (load < bound) pour_ranks_.push_back({load, a});
    }
    if (pour_ranks_.empty()) continue;
    std::sort(pour_ranks_.begin(), pour_ranks_.end(), [&](const auto& x, const auto& y) {
      return x.first != y.first ? x.first < y.first : arc_rank_[x.second] < arc_rank_[y.second];
    });
    const int n = static_cast<int>(pour_ranks_.size());
    long long amount = excess_[e];
    long long level = pour_ranks_[0].first;
    long long remainder = 0;
    int filled = 1;  // ranks raised to `level`
    while (amount > 0) {
      const long long next = filled < n ? pour_ranks_[filled].first : bound;
      const long long room = (next - level) * filled;
      if (room <= amount) {
        amount -= room;
        level = next;
        if (filled == n) break;  // every rank at the bound
        ++filled;
      } else {
        level += amount / filled;
        remainder = amount % filled;
        amount = 0;
      }
    }
    for (int i = 0; i < filled; ++i) {
      const long long give = level + (i < remainder ? 1 : 0) - pour_ranks_[i].first;
      if (give <= 0) continue;
      const int a = pour_ranks_[i].second;
      arc_flow_[a] += give;
      spare_[arc_rank_[a]] -= give;
      excess_[e] -= give;
    }
  }
}

void QuotaSolver::Search() {
  ++stamp_;
  queue_.clear();
  reached_ranks_.clear();
  for (int e : flexible_) {
    if (excess_[e] == 0) continue;
    expert_seen_[e] = stamp_;
    expert_parent_[e] = -1;
    queue_.push_back(e);
  }
  for (size_t head = 0; head < queue_.size(); ++head) {
    const int node = queue_[head];
    if (node < num_experts_) {
      for (int a = arc_begin_[node]; a < arc_begin_[node + 1]; ++a) {
        const int r = arc_rank_[a];
        if (rank_seen_[r] == stamp_) continue;
        rank_seen_[r] = stamp_;
        rank_parent_[r] = a;
        reached_ranks_.push_back(r);
        if (spare_[r] == 0) queue_.push_back(num_experts_ + r);  // a rank with room ends a path
      }
    } else {
      const int r = node - num_experts_;
      for (int i = rank_arc_begin_[r]; i < rank_arc_begin_[r + 1]; ++i) {
        const int a = rank_arcs_[i];
        const int e = arc_expert_[a];
        if (arc_flow_[a] == 0 || expert_seen_[e] == stamp_) continue;
        expert_seen_[e] = stamp_;
        expert_parent_[e] = a;
        queue_.push_back(e);
      }
    }
  }
}

// Pushes as much as the search tree's path to `rank` allows; returns the amount.
long long QuotaSolver::Augment(int rank) {
  long long amount = spare_[rank];
  for (int r = rank;;) {
    const int e = arc_expert_[rank_parent_[r]];
    const int back = expert_parent_[e];
    if (back < 0) {
      amount = std::min(amount, excess_[e]);
      break;
    }
    amount = std::min(amount, arc_flow_[back]);
    r = arc_rank_[back];
  }
  if (amount <= 0) return 0;
  spare_[rank] -= amount;
  for (int r = rank;;) {
    const int a = rank_parent_[r];
    arc_flow_[a] += amount;
    const int e = arc_expert_[a];
    MarkChanged(e);
    const int back = expert_parent_[e];
    if (back < 0) {
      excess_[e] -= amount;
      break;
    }
    arc_flow_[back] -= amount;
    r = arc_rank_[back];
  }
  return amount;
}

bool QuotaSolver::RouteExcess() {
  for (;;) {
    bool stuck = false;
    for (int e : flexible_) stuck |= excess_[e] > 0;
    if (!stuck) return true;
    Search();
    bool pushed = false;
    for (int r : reached_ranks_) {
      if (spare_[r] > 0 && Augment(r) > 0) pushed = true;
    }
    if (!pushed) return false;
  }
}

// Experts that pin the bound: those of the last min cut (`cut_experts_`), plus the experts whose
// copies all sit on one of the cut's ranks (`in_cut_`).
void QuotaSolver::RecordBottleneck(bool from_cut_ranks) {
  bottleneck_found_ = true;
  if (from_cut_ranks && copies_extend_base_) {
    // The base's single-rank experts of the cut's ranks (a copy added since may have spread
    // one). A cut usually holds a few ranks, and then this skips the pass over every expert.
    if (!base_singles_found_) RecordBaseSingles();
    size_t listed = cut_experts_.size();
    for (int r = 0; r < num_ranks_; ++r) {
      if (in_cut_[r]) listed += base_single_begin_[r + 1] - base_single_begin_[r];
    }
    if (listed <= static_cast<size_t>(num_experts_) / 4) {
      bottleneck_experts_.assign(cut_experts_.begin(), cut_experts_.end());
      for (int r = 0; r < num_ranks_; ++r) {
        if (!in_cut_[r]) continue;
        for (int i = base_single_begin_[r]; i < base_single_begin_[r + 1]; ++i) {
          const int e = base_single_[i];
          if (tokens_[e] != 0 && rank_count(e) == 1) bottleneck_experts_.push_back(e);
        }
      }
      std::sort(bottleneck_experts_.begin(), bottleneck_experts_.end());
      return;
    }
  }
  // Written to a buffer sized for every expert: push_back would make the compiler reload each
  // member the loop reads after every store.
  const int num_experts = num_experts_;
  bottleneck_experts_.resize(num_experts);
  int* bottleneck = bottleneck_experts_.data();
  const int* cut = cut_experts_.data();
  const int* cut_end = cut + cut_experts_.size();
  const long long* tokens = tokens_.data();
  const int* arc_begin = arc_begin_.data();
  const int* arc_rank = arc_rank_.data();
  const char* in_cut_rank = in_cut_.data();
  int count = 0;
  for (int e = 0; e < num_experts; ++e) {
    const bool in_cut = cut != cut_end && *cut == e;
    if (in_cut) ++cut;
    if (tokens[e] == 0) continue;
    if (in_cut || (arc_begin[e + 1] - arc_begin[e] == 1 && in_cut_rank[arc_rank[arc_begin[e]]])) {
      bottleneck[count++] = e;
    }
  }
  bottleneck_experts_.resize(count);
}

void QuotaSolver::Prepare() {
  const int num_experts = num_experts_;
  const int num_ranks = num_ranks_;
  const int* arc_begin = arc_begin_.data();
  const int* arc_rank = arc_rank_.data();
  const long long* tokens = tokens_.data();
  long long* arc_flow = arc_flow_.data();
  fixed_.assign(num_ranks, 0);
  excess_.assign(num_experts, 0);
  flexible_.resize(num_experts);
  rank_arc_begin_.assign(num_ranks + 1, 0);
  long long* fixed = fixed_.data();
  int* flexible = flexible_.data();
  int* rank_arc_begin = rank_arc_begin_.data();
  int num_flexible = 0;
  long long total = 0;
  for (int e = 0; e < num_experts; ++e) {
    total += tokens[e];
    if (tokens[e] == 0) continue;
    if (arc_begin[e + 1] - arc_begin[e] == 1) {
      fixed[arc_rank[arc_begin[e]]] += tokens[e];
      arc_flow[arc_begin[e]] = tokens[e];
    } else {
      flexible[num_flexible++] = e;
      for (int a = arc_begin[e]; a < arc_begin[e + 1]; ++a) ++rank_arc_begin[arc_rank[a] + 1];
    }
  }
  total_ = total;
  flexible_.resize(num_flexible);
  for (int r = 0; r < num_ranks; ++r) rank_arc_begin[r + 1] += rank_arc_begin[r];
  rank_arcs_.resize(rank_arc_begin[num_ranks]);
  rank_fill_.resize(std::max(num_experts, num_ranks));
  int* rank_fill = rank_fill_.data();
  int* rank_arcs = rank_arcs_.data();
  std::copy(rank_arc_begin, rank_arc_begin + num_ranks, rank_fill);
  for (int i = 0; i < num_flexible; ++i) {
    const int e = flexible[i];
    for (int a = arc_begin[e]; a < arc_begin[e + 1]; ++a) rank_arcs[rank_fill[arc_rank[a]]++] = a;
  }
  spare_.resize(num_ranks);
}

void QuotaSolver::Solve(const Placement& placement, std::span<const long long> tokens,
                        std::span<const TransientReplica> extras, QuotaSplit& split) {
  num_experts_ = placement.num_experts();
  num_ranks_ = placement.num_ranks();
  tokens_ = tokens;
  ClearChanged();
  solved_valid_ = false;  // every quota is written afresh
  if (extras.empty()) {
    BuildBaseCopies(placement);
  } else {
    LeaveBase();
    BuildCopies(placement, extras);
  }
  Prepare();
  for (int e : flexible_) excess_[e] = tokens[e];
  pour_order_.assign(flexible_.begin(), flexible_.end());
  std::sort(pour_order_.begin(), pour_order_.end(),
            [&](int a, int b) { return tokens[a] != tokens[b] ? tokens[a] > tokens[b] : a < b; });

  const long long max_fixed = *std::max_element(fixed_.begin(), fixed_.end());
  const long long bound = std::max(CeilDiv(total_, num_ranks_), max_fixed);
  for (int r = 0; r < num_ranks_; ++r) spare_[r] = bound - fixed_[r];
  expert_seen_.assign(num_experts_, 0);
  rank_seen_.assign(num_ranks_, 0);
  expert_parent_.resize(num_experts_);
  rank_parent_.resize(num_ranks_);
  stamp_ = 0;
  in_cut_.assign(num_ranks_, 0);
  cut_experts_.clear();

  Pour(bound);
  Finish(placement, bound, /*cut_found=*/false, split);
}

void QuotaSolver::AddCopy(const Placement& placement, std::span<const TransientReplica> extras,
                          QuotaSplit& split) {
  // The new copy's arc, if its rank is new to the expert, comes last among the expert's arcs;
  // every other arc keeps its flow (a single-rank expert's tokens sit on its one arc).
  const int expert = extras.back().expert;
  ClearChanged();
  const bool was_single = rank_count(expert) == 1;
  const int arc = InsertCopy(extras.back(), placement.num_slots() + num_extras_);
  if (arc >= 0) PrepareNewArc(expert, arc, was_single);

  // The previous cut (S, X) with the new copy's rank joined to S: the experts with every copy in
  // that S' load it with at least their tokens.
  in_cut_[extras.back().rank] = 1;
  bool cut_found = false;
  const long long bound = WarmStart(cut_found);
  Finish(placement, bound, cut_found, split);
}

long long QuotaSolver::WarmStart(bool& cut_found) {
  const long long max_fixed = *std::max_element(fixed_.begin(), fixed_.end());
  long long bound = std::max(CeilDiv(total_, num_ranks_), max_fixed);
  long long need = 0;
  long long cut_ranks = 0;
  for (int r = 0; r < num_ranks_; ++r) {
    if (!in_cut_[r]) continue;
    need += fixed_[r];
    ++cut_ranks;
  }
  cut_experts_.clear();
  for (int e : flexible_) {
    bool inside = true;
    for (int a = arc_begin_[e]; a < arc_begin_[e + 1] && inside; ++a)
      inside = in_cut_[arc_rank_[a]];
    if (!inside) continue;
    need += tokens_[e];
    cut_experts_.push_back(e);
  }
  cut_found = cut_ranks > 0 && CeilDiv(need, cut_ranks) > bound;
  if (cut_found) {
    bound = CeilDiv(need, cut_ranks);
  } else {
    std::fill(in_cut_.begin(), in_cut_.end(), 0);
    cut_experts_.clear();
  }

  // Take back the flow above the bound, in arc order, as excess of its experts.
  for (int r = 0; r < num_ranks_; ++r) spare_[r] = bound - fixed_[r];
  for (int e : flexible_) {
    for (int a = arc_begin_[e]; a < arc_begin_[e + 1]; ++a) spare_[arc_rank_[a]] -= arc_flow_[a];
  }
  for (int r = 0; r < num_ranks_; ++r) {
    for (int i = rank_arc_begin_[r]; i < rank_arc_begin_[r + 1] && spare_[r] < 0; ++i) {
      const int a = rank_arcs_[i];
      const long long take = std::min(arc_flow_[a], -spare_[r]);
      arc_flow_[a] -= take;
      excess_[arc_expert_[a]] += take;
      // Pour and Augment move only the flows of experts with excess (this one) or on a path.
      if (take > 0) MarkChanged(arc_expert_[a]);
      spare_[r] += take;
    }
  }
  // Pour what was taken back, as a cold start pours everything.
  pour_order_.clear();
  for (int e : flexible_) {
    if (excess_[e] > 0) pour_order_.push_back(e);
  }
  std::sort(pour_order_.begin(), pour_order_.end(), [&](int a, int b) {
    return tokens_[a] != tokens_[b] ? tokens_[a] > tokens_[b] : a < b;
  });
  Pour(bound);
  return bound;
}

long long QuotaSolver::Resolve(const Placement& placement) {
  // Its cut would replace the last solve's, whose bottleneck experts stay. A replan resolves
  // many placements, each once, and never asks for them: listing the base's single-rank experts
  // would not pay.
  if (!bottleneck_found_) RecordBottleneck(/*from_cut_ranks=*/false);
  solved_valid_ = false;
  ClearChanged();
  previous_arc_begin_.assign(arc_begin_.begin(), arc_begin_.end());
  previous_arc_rank_.assign(arc_rank_.begin(), arc_rank_.end());
  previous_flow_.assign(arc_flow_.begin(), arc_flow_.end());
  LeaveBase();
  BuildCopies(placement, {});
  Prepare();
  // Each expert keeps its flow on the ranks that still hold it; what sat on a rank that lost
  // its copy becomes excess. A single-rank expert's tokens were implicit on its one rank.
  for (int e : flexible_) {
    const int old_begin = previous_arc_begin_[e];
    const int old_end = previous_arc_begin_[e + 1];
    for (int old = old_begin; old < old_end; ++old) {
      const long long flow = old_end - old_begin == 1 ? tokens_[e] : previous_flow_[old];
      int a = arc_begin_[e];
      while (a < arc_begin_[e + 1] && arc_rank_[a] != previous_arc_rank_[old]) ++a;
      (a < arc_begin_[e + 1] ? arc_flow_[a] : excess_[e]) += flow;
    }
    for (int a = arc_begin_[e]; a < arc_begin_[e + 1]; ++a) {
      bool gained = true;
      for (int old = old_begin; old < old_end && gained; ++old) {
        gained = previous_arc_rank_[old] != arc_rank_[a];
      }
      if (gained) in_cut_[arc_rank_[a]] = 1;
    }
  }
  bool cut_found = false;
  const long long bound = RouteAtLowestBound(WarmStart(cut_found), cut_found);
  return bound - *std::min_element(spare_.begin(), spare_.end());
}

long long QuotaSolver::RouteAtLowestBound(long long bound, bool cut_found) {
  const std::span<const long long> tokens = tokens_;
  while (!RouteExcess()) {
    // The last search reached only full ranks: its marks are the min cut (X experts, S ranks).
    long long need = 0;
    long long cut_ranks = 0;
    for (int r = 0; r < num_ranks_; ++r) {
      in_cut_[r] = rank_seen_[r] == stamp_;
      if (in_cut_[r]) {
        need += fixed_[r];
        ++cut_ranks;
      }
    }
    cut_experts_.clear();
    for (int e : flexible_) {
      if (expert_seen_[e] != stamp_) continue;
      need += tokens[e];
      cut_experts_.push_back(e);
    }
    // Stuck tokens make need exceed the cut's capacity, so the bound always rises.
    const long long raised = std::max(CeilDiv(need, cut_ranks), bound + 1);
    for (int r = 0; r < num_ranks_; ++r) spare_[r] += raised - bound;
    bound = raised;
    cut_found = true;
  }
  if (!cut_found) {
    // The bound is ceil(total / G), which no copy can lower, or the fixed load of some ranks.
    for (int r = 0; r < num_ranks_; ++r) in_cut_[r] = bound > 0 && fixed_[r] == bound;
  }
  return bound;
}

void QuotaSolver::ClearChanged() {
  for (int e : changed_list_) changed_[e] = 0;
  changed_list_.clear();
  changed_.resize(num_experts_, 0);
}

void QuotaSolver::WriteQuotas(int first_copy, int last_copy) {
  const int num_slots = static_cast<int>(solved_.slot_quota.size());
  long long* slot_quota = solved_.slot_quota.data();
  long long* extra_quota = solved_.extra_quota.data();
  int* arc_given = arc_given_.data();
  const int* arc_copies = arc_copies_.data();
  const long long* arc_flow = arc_flow_.data();
  const int* copy_arc = copy_arc_.data();
  const int* copy_id = copy_id_.data();
  for (int c = first_copy; c < last_copy; ++c) {
    const int a = copy_arc[c];
    const long long share = CopyQuota(arc_flow[a], arc_copies[a], arc_given[a]);
    const int id = copy_id[c];
    (id < num_slots ? slot_quota[id] : extra_quota[id - num_slots]) = share;
  }
}

void QuotaSolver::Finish(const Placement& placement, long long bound, bool cut_found,
                         QuotaSplit& split) {
  RouteAtLowestBound(bound, cut_found);
  bottleneck_found_ = false;

  // Flows to per-copy quotas: every expert's, or after AddCopy those of the experts whose flows
  // moved (an expert's copies share its arcs alone, so its quotas depend on its flows alone).
  if (solved_valid_) {
    solved_.extra_quota.resize(num_extras_, 0);
    arc_given_.resize(arc_rank_.size());
    for (int e : changed_list_) {
      for (int a = arc_begin_[e]; a < arc_begin_[e + 1]; ++a) arc_given_[a] = 0;
      WriteQuotas(copy_begin_[e], copy_begin_[e + 1]);
    }
  } else {
    solved_.slot_quota.assign(placement.num_slots(), 0);
    solved_.extra_quota.assign(num_extras_, 0);
    arc_given_.assign(arc_rank_.size(), 0);
    WriteQuotas(0, copy_begin_[num_experts_]);
  }
  solved_valid_ = true;
  rank_load_.assign(fixed_.begin(), fixed_.end());
  long long* rank_load = rank_load_.data();
  const int* arc_begin = arc_begin_.data();
  const int* arc_rank = arc_rank_.data();
  const long long* arc_flow = arc_flow_.data();
  for (int e : flexible_) {
    for (int a = arc_begin[e]; a < arc_begin[e + 1]; ++a) rank_load[arc_rank[a]] += arc_flow[a];
  }
  solved_.max_rank_tokens = *std::max_element(rank_load_.begin(), rank_load_.end());
  split.slot_quota.assign(solved_.slot_quota.begin(), solved_.slot_quota.end());
  split.extra_quota.assign(solved_.extra_quota.begin(), solved_.extra_quota.end());
  split.max_rank_tokens = solved_.max_rank_tokens;
}

QuotaSplit SplitQuotas(const Placement& placement, const std::vector<long long>& expert_tokens,
                       const std::vector<TransientReplica>& extra_copies) {
  // Callers own these preconditions: one non-negative count per expert, extras in range.
  assert(expert_tokens.size() == static_cast<size_t>(placement.num_experts()));
  assert(
      std::all_of(expert_tokens.begin(), expert_tokens.end(), [](long long t) { return t >= 0; }));
  assert(std::all_of(extra_copies.begin(), extra_copies.end(), [&](const TransientReplica& x) {
    return x.expert >= 0 && x.expert < placement.num_experts() && x.rank >= 0 &&
           x.rank < placement.num_ranks();
  }));
  QuotaSolver solver;
  QuotaSplit split;
  solver.Solve(placement, expert_tokens, extra_copies, split);
  return split;
}

QuotaSplitter::QuotaSplitter() : solver_(std::make_unique<QuotaSolver>()) {}

QuotaSplitter::~QuotaSplitter() = default;

void QuotaSplitter::Split(const Placement& placement, std::span<const long long> tokens,
                          QuotaSplit& split) {
  assert(tokens.size() == static_cast<size_t>(placement.num_experts()));
  solver_->Solve(placement, tokens, {}, split);
}

long long QuotaSplitter::MaxRankTokens(const Placement& placement) {
  return solver_->Resolve(placement);
}

}  // namespace keel
