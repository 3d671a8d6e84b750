// Keel's per-step quota planner: the exact integer split of each expert's tokens among its copies
// (a parametric bipartite max-flow), the locality-first assignment of source ranks to those
// copies, and greedy transient replicas kept only while the cost model says the layer gets faster.
#include <algorithm>
#include <bit>
#include <cassert>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "common/simd.h"
#include "placement/cost_model.h"
#include "placement/routing.h"

namespace keel {
namespace {

// Token counts beyond this are input errors (and would overflow the integer quotas).
constexpr double kMaxTokens = 1e15;

long long CeilDiv(long long a, long long b) { return (a + b - 1) / b; }

}  // namespace

// Minimizes the max rank load over integer splits of every expert's tokens among its copies.
//
// A bound T is feasible iff a max-flow routes every token: source -> expert e (capacity tokens_e)
// -> each rank holding a copy of e (unbounded) -> sink (capacity T - fixed_r), where fixed_r is
// the load of experts whose copies all sit on rank r. T starts at the lower bound
// max(ceil(total / G), max fixed_r). When the flow cannot route every token, the ranks S and
// experts X reachable from unrouted tokens in the residual graph form a min cut: every copy of X
// lies in S and S is full, so any split needs T >= ceil((tokens(X) + fixed(S)) / |S|). T jumps
// there and the flow resumes where it stood (raising every sink capacity keeps it valid). Each
// jump is a lower bound, so the first feasible T is optimal; a handful of jumps is typical.
//
// Among optimal splits the solver returns the one found by pouring experts, heaviest first (ties:
// lower id), onto their least-loaded copy ranks up to T (water-filling, ties: lower rank), then
// repairing it with augmenting paths from breadth-first search in ascending expert, copy and rank
// order. Copies of one expert on one rank share that rank's tokens evenly, lower slots (then
// extra copies in their given order) taking the remainder.
//
// AddCopy re-solves after one more copy from the previous flow instead of from scratch: every
// split is a lower bound away from optimal, so it starts at the bound of the previous min cut
// widened by the new copy's rank, takes back only the flow above that bound, and resumes the
// augmenting paths. Its split is optimal too, but among optimal splits not necessarily the one a
// fresh Solve returns. Resolve does the same for any change of the placement's copies, each rank
// that gained a copy widening the cut, and returns the optimal max rank load alone. Buffers
// persist between calls, so re-solving allocates nothing.
class QuotaSolver {
 public:
  void Solve(const Placement& placement, std::span<const long long> tokens,
             std::span<const TransientReplica> extras, QuotaSplit& split);
  // Re-solves for `extras`: the previous call's extras plus one more at the back, same tokens.
  void AddCopy(const Placement& placement, std::span<const TransientReplica> extras,
               QuotaSplit& split);
  // The minimal max rank load of `placement` (same shape, no extras) for the previous call's
  // tokens. No split is written; rank_load() and bottleneck_experts() keep the previous call's.
  long long Resolve(const Placement& placement);

  // Copies of `expert` after Solve: id < num_slots is a persistent slot, otherwise the extra copy
  // id - num_slots. Persistent slots first (ascending), then extras in their given order.
  int copy_begin(int expert) const { return copy_begin_[expert]; }
  int copy_end(int expert) const { return copy_begin_[expert + 1]; }
  int copy_id(int copy) const { return copy_id_[copy]; }
  int copy_rank(int copy) const { return copy_rank_[copy]; }
  // Number of distinct ranks that hold `expert`.
  int rank_count(int expert) const { return arc_begin_[expert + 1] - arc_begin_[expert]; }

  // [num_ranks] load of each rank under the split.
  std::span<const long long> rank_load() const { return rank_load_; }
  // Experts that pin the max rank load: every split needs max load >= max_rank_tokens unless one
  // of them gets a copy outside the ranks they fill. Ascending ids.
  const std::vector<int>& bottleneck_experts() const { return bottleneck_experts_; }

 private:
  void BuildCopies(const Placement& placement, std::span<const TransientReplica> extras);
  // Fixed loads, flexible experts and the arcs into each rank, for the current copies; no excess.
  void Prepare();
  void Pour(long long bound);
  // Once the previous flow sits on the current arcs (excess for what found no arc): the bound of
  // the cold start or of the previous cut, in_cut_ (which the caller widened by every rank that
  // gained a copy), whichever is higher. The flow above that bound goes back to its experts and
  // is poured again. Returns the bound; `cut_found` says whether it came from the cut.
  long long WarmStart(bool& cut_found);
  // Raises `bound` at each min cut until every token is routed; returns the final bound.
  // `cut_found`: the bound already comes from the cut in in_cut_ / cut_experts_.
  long long RouteAtLowestBound(long long bound, bool cut_found);
  // RouteAtLowestBound, then writes the quotas.
  void Finish(const Placement& placement, long long bound, bool cut_found, QuotaSplit& split);
  // Routes remaining excess with augmenting paths; false when some is stuck (the last search's
  // marks then describe the min cut).
  bool RouteExcess();
  void Search();
  long long Augment(int rank);
  void RecordBottleneck();

  int num_experts_ = 0;
  int num_ranks_ = 0;
  std::span<const long long> tokens_;
  long long total_ = 0;
  int num_extras_ = 0;

  std::vector<int> copy_begin_;  // [num_experts + 1]
  std::vector<int> copy_id_;     // [copies]
  std::vector<int> copy_rank_;   // [copies]
  std::vector<int> copy_arc_;    // [copies] arc of the copy's rank

  // Arcs: one per (expert, distinct rank holding it).
  std::vector<int> arc_begin_;  // [num_experts + 1]
  std::vector<int> arc_rank_;
  std::vector<int> arc_expert_;
  std::vector<int> arc_copies_;  // copies of the expert on the arc's rank
  std::vector<long long> arc_flow_;
  std::vector<long long> previous_flow_;  // scratch for AddCopy and Resolve
  std::vector<int> previous_arc_begin_;   // scratch for Resolve
  std::vector<int> previous_arc_rank_;    // scratch for Resolve
  std::vector<int> arc_given_;            // scratch for splitting an arc among its copies

  std::vector<int> flexible_;        // experts with tokens on >= 2 ranks, ascending
  std::vector<int> pour_order_;      // flexible_ by tokens descending
  std::vector<int> rank_arc_begin_;  // [num_ranks + 1] flexible arcs into each rank
  std::vector<int> rank_arcs_;
  std::vector<int> rank_fill_;
  std::vector<long long> fixed_;      // [num_ranks]
  std::vector<long long> spare_;      // [num_ranks] bound - fixed - inflow
  std::vector<long long> excess_;     // [num_experts] tokens not yet routed
  std::vector<long long> rank_load_;  // [num_ranks]

  // Breadth-first search state; marks compare against a stamp so nothing is cleared per search.
  int stamp_ = 0;
  std::vector<int> expert_seen_, rank_seen_;
  std::vector<int> expert_parent_;  // arc through which an expert was reached, -1 for a root
  std::vector<int> rank_parent_;    // arc through which a rank was reached
  std::vector<int> queue_;          // experts as e, ranks as num_experts + r
  std::vector<int> reached_ranks_;

  std::vector<int> cut_experts_;  // experts of the last min cut, ascending
  std::vector<char> in_cut_;      // [num_ranks] ranks of the last min cut
  std::vector<int> bottleneck_experts_;
  std::vector<std::pair<long long, int>> pour_ranks_;
};

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
void QuotaSolver::RecordBottleneck() {
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
  BuildCopies(placement, extras);
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
  // every other arc keeps its flow. A single-rank expert's tokens were implicit: put them on its
  // one old arc.
  const int expert = extras.back().expert;
  const int old_end = arc_begin_[expert + 1];
  const bool was_single = rank_count(expert) == 1;
  previous_flow_.assign(arc_flow_.begin(), arc_flow_.end());
  BuildCopies(placement, extras);
  const int shift = static_cast<int>(arc_flow_.size() - previous_flow_.size());
  std::copy(previous_flow_.begin(), previous_flow_.begin() + old_end, arc_flow_.begin());
  std::copy(previous_flow_.begin() + old_end, previous_flow_.end(),
            arc_flow_.begin() + old_end + shift);
  if (was_single && shift == 1) arc_flow_[arc_begin_[expert]] = tokens_[expert];
  Prepare();

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
  previous_arc_begin_.assign(arc_begin_.begin(), arc_begin_.end());
  previous_arc_rank_.assign(arc_rank_.begin(), arc_rank_.end());
  previous_flow_.assign(arc_flow_.begin(), arc_flow_.end());
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

void QuotaSolver::Finish(const Placement& placement, long long bound, bool cut_found,
                         QuotaSplit& split) {
  const std::span<const long long> tokens = tokens_;
  RouteAtLowestBound(bound, cut_found);
  RecordBottleneck();

  // Flows to per-copy quotas.
  const int num_slots = placement.num_slots();
  split.slot_quota.assign(num_slots, 0);
  split.extra_quota.assign(num_extras_, 0);
  rank_load_.assign(fixed_.begin(), fixed_.end());
  arc_given_.assign(arc_rank_.size(), 0);
  long long* slot_quota = split.slot_quota.data();
  long long* extra_quota = split.extra_quota.data();
  long long* rank_load = rank_load_.data();
  int* arc_given = arc_given_.data();
  const int* arc_begin = arc_begin_.data();
  const int* arc_rank = arc_rank_.data();
  const int* arc_copies = arc_copies_.data();
  const long long* arc_flow = arc_flow_.data();
  const int* copy_begin = copy_begin_.data();
  const int* copy_arc = copy_arc_.data();
  const int* copy_id = copy_id_.data();
  for (int e = 0; e < num_experts_; ++e) {
    const bool single = arc_begin[e + 1] - arc_begin[e] == 1;
    for (int c = copy_begin[e]; c < copy_begin[e + 1]; ++c) {
      const int a = copy_arc[c];
      const long long flow = single ? tokens[e] : arc_flow[a];
      const int on_rank = arc_copies[a];  // almost always 1: skip the slow 64-bit division
      const long long share =
          on_rank == 1 ? flow : flow / on_rank + (arc_given[a]++ < flow % on_rank ? 1 : 0);
      const int id = copy_id[c];
      (id < num_slots ? slot_quota[id] : extra_quota[id - num_slots]) = share;
    }
    if (!single) {
      for (int a = arc_begin[e]; a < arc_begin[e + 1]; ++a) rank_load[arc_rank[a]] += arc_flow[a];
    }
  }
  split.max_rank_tokens = *std::max_element(rank_load_.begin(), rank_load_.end());
}

namespace {

// totals[e] = (((totals[e] + row0[e]) + row1[e]) + row2[e]) + row3[e] for e < n. Returns the OR
// of the bit patterns of every entry read. Written with DoubleQuad (common/simd.h) because GCC
// at -O2 does not vectorize the plain loop; the AVX2 clone does in one instruction what the
// default does in two.
KEEL_AVX2_CLONES std::uint64_t AddFourRows(double* totals, const double* row0, const double* row1,
                                           const double* row2, const double* row3, int n) {
  BitsQuad bits = {};
  int e = 0;
  for (; e + 4 <= n; e += 4) {
    DoubleQuad a, b, c, d, sum;
    std::memcpy(&a, row0 + e, sizeof a);
    std::memcpy(&b, row1 + e, sizeof b);
    std::memcpy(&c, row2 + e, sizeof c);
    std::memcpy(&d, row3 + e, sizeof d);
    std::memcpy(&sum, totals + e, sizeof sum);
    // A cast between vector types of one size keeps the bits, as std::bit_cast does.
    bits |= (BitsQuad)a | (BitsQuad)b | (BitsQuad)c | (BitsQuad)d;
    sum = (((sum + a) + b) + c) + d;
    std::memcpy(totals + e, &sum, sizeof sum);
  }
  std::uint64_t sign = bits[0] | bits[1] | bits[2] | bits[3];
  for (; e < n; ++e) {
    const double a = row0[e], b = row1[e], c = row2[e], d = row3[e];
    sign |= std::bit_cast<std::uint64_t>(a) | std::bit_cast<std::uint64_t>(b) |
            std::bit_cast<std::uint64_t>(c) | std::bit_cast<std::uint64_t>(d);
    totals[e] = (((totals[e] + a) + b) + c) + d;
  }
  return sign;
}

// Turns per-copy quotas into a routing: which source sends how many tokens to which copy.
class SourceAssigner {
 public:
  SourceAssigner(const Placement& placement, const StepLoad& load, const Topology& topology);
  void RecordShares(bool on) { record_shares_ = on; }

  // The one pass over the traffic: per-expert totals, and the rows of `routing` for experts that
  // one rank holds in the placement (every source sends there). False when some entry may be
  // negative, not finite or beyond kMaxTokens; the caller then names it.
  bool Scan(StepRouting& routing);
  const std::vector<long long>& rounded_totals() const { return rounded_; }

  // Completes `routing`, a copy of what Scan filled, for the copies in `solver`, solved with
  // `extras` beyond the placement, and the quotas in `split`.
  void Assign(const QuotaSolver& solver, const std::vector<TransientReplica>& extras,
              const QuotaSplit& split, StepRouting& routing);

 private:
  // Tokens of `expert` with copies on several ranks: local copies first, then copies on the same
  // node, then the rest, each pass in copy order and ascending source order.
  void AssignSpread(const QuotaSolver& solver, int expert, const QuotaSplit& split,
                    StepRouting& routing);
  // Shares of an expert whose copies sit on one rank: sources in ascending order fill the copies
  // in copy order up to the quotas in room_.
  void ShareInSourceOrder(const QuotaSolver& solver, int expert, StepRouting& routing);

  const Placement& placement_;
  const StepLoad& load_;
  const Topology& topology_;
  std::vector<int> source_rank_;  // [num_sources]
  std::vector<size_t> sent_row_;  // [num_sources] offset of the source's rank's row of sent tokens
  int num_ranks_ = 0;             // the placement's
  std::vector<double> totals_;
  std::vector<long long> rounded_;
  // [num_experts] totals_ / rounded_ (0 when rounded to 0): quotas count rounded tokens, and this
  // scales them to the expert's exact total. Computed once, as every Assign needs it.
  std::vector<double> scale_;
  std::vector<double> remaining_;      // [num_sources] tokens of the current expert still unsent
  std::vector<double> room_;           // [copies of the current expert] quota still open
  std::vector<int> ranks_by_singles_;  // ranks holding single-rank experts, fewest first
  // Experts on one rank in the placement, grouped by that rank.
  std::vector<int> rank_single_begin_;  // [num_ranks + 1]
  std::vector<int> rank_single_;
  bool record_shares_ = false;
};

SourceAssigner::SourceAssigner(const Placement& placement, const StepLoad& load,
                               const Topology& topology)
    : placement_(placement), load_(load), topology_(topology) {
  const int num_ranks = placement.num_ranks();
  const int num_experts = load.num_experts;
  std::vector<int> single_rank(num_experts);  // the one rank holding the expert, else -1
  rank_single_begin_.assign(num_ranks + 1, 0);
  for (int e = 0; e < num_experts; ++e) {
    single_rank[e] = -1;
    for (int rank : placement.copy_ranks(e)) {
      if (single_rank[e] == -1) {
        single_rank[e] = rank;
      } else if (single_rank[e] != rank) {
        single_rank[e] = -2;
        break;
      }
    }
    if (single_rank[e] < 0) single_rank[e] = -1;
    if (single_rank[e] >= 0) ++rank_single_begin_[single_rank[e] + 1];
  }
  for (int r = 0; r < num_ranks; ++r) rank_single_begin_[r + 1] += rank_single_begin_[r];
  rank_single_.resize(rank_single_begin_[num_ranks]);
  remaining_.resize(load.num_sources);
  source_rank_.resize(load.num_sources);
  sent_row_.resize(load.num_sources);
  num_ranks_ = num_ranks;
  for (int s = 0; s < load.num_sources; ++s) {
    source_rank_[s] = s % num_ranks;
    sent_row_[s] = static_cast<size_t>(source_rank_[s]) * num_ranks;
  }
  std::vector<int> fill(rank_single_begin_.begin(), rank_single_begin_.end() - 1);
  for (int e = 0; e < num_experts; ++e) {
    if (single_rank[e] >= 0) rank_single_[fill[single_rank[e]]++] = e;
  }
  // Ranks by their count of single-rank experts, ascending ranks within a count: a counting
  // sort, as the counts are small (at most the slots per rank).
  auto singles = [&](int r) { return rank_single_begin_[r + 1] - rank_single_begin_[r]; };
  int most = 0;
  for (int r = 0; r < num_ranks; ++r) most = std::max(most, singles(r));
  std::vector<int> count_begin(most + 2, 0);
  for (int r = 0; r < num_ranks; ++r) ++count_begin[singles(r) + 1];
  for (int c = 0; c <= most; ++c) count_begin[c + 1] += count_begin[c];
  const int without_singles = count_begin[1];
  ranks_by_singles_.resize(num_ranks - without_singles);
  for (int r = 0; r < num_ranks; ++r) {
    if (singles(r) > 0) ranks_by_singles_[count_begin[singles(r)]++ - without_singles] = r;
  }
}

bool SourceAssigner::Scan(StepRouting& routing) {
  const int num_ranks = placement_.num_ranks();
  const int num_experts = load_.num_experts;
  routing.num_ranks = num_ranks;
  routing.rank_tokens.assign(num_ranks, 0.0);
  routing.sent_tokens.assign(static_cast<size_t>(num_ranks) * num_ranks, 0.0);
  routing.slot_tokens.assign(placement_.num_slots(), 0.0);
  totals_.assign(num_experts, 0.0);
  // Any negative entry (or -0.0, or a NaN with its sign bit) sets the sign bit of the OR; a NaN,
  // an infinity or an entry beyond kMaxTokens makes its expert's total NaN or beyond kMaxTokens,
  // as all other entries are then non-negative. Either sends the caller to the exact check.
  std::uint64_t sign = 0;
  double* totals = totals_.data();
  const double* traffic = load_.traffic.data();
  double* sent = routing.sent_tokens.data();
  auto row_of = [&](int source) { return traffic + static_cast<size_t>(source) * num_experts; };
  auto sent_row = [&](int source) {
    return sent + static_cast<size_t>(source_rank_[source]) * num_ranks;
  };
  // Single-rank experts go straight to their rank, in ascending expert order, each sum in a
  // register. Ranks come by how many such experts they hold, so that the inner loop's length
  // changes rarely and its branch is predicted.
  auto send_singles = [&](int source) {
    const double* row = row_of(source);
    double* out = sent_row(source);
    for (int rank : ranks_by_singles_) {
      double sum = out[rank];
      for (int i = rank_single_begin_[rank]; i < rank_single_begin_[rank + 1]; ++i) {
        sum += row[rank_single_[i]];
      }
      out[rank] = sum;
    }
  };
  // Four sources at a time, their rows read twice while they are in the first-level cache: the
  // totals still add their sources in ascending order, with a quarter of the stores, and the
  // four sources' single-rank sums (four distinct rows of sent tokens when there are at least
  // four ranks) share the index loads and overlap their additions.
  int s = 0;
  for (; s + 4 <= load_.num_sources; s += 4) {
    const double* row0 = row_of(s);
    const double* row1 = row0 + num_experts;
    const double* row2 = row1 + num_experts;
    const double* row3 = row2 + num_experts;
    sign |= AddFourRows(totals, row0, row1, row2, row3, num_experts);
    if (num_ranks < 4) {
      for (int k = 0; k < 4; ++k) send_singles(s + k);
      continue;
    }
    double *sent0 = sent_row(s), *sent1 = sent_row(s + 1), *sent2 = sent_row(s + 2),
           *sent3 = sent_row(s + 3);
    for (int rank : ranks_by_singles_) {
      double sum0 = sent0[rank], sum1 = sent1[rank], sum2 = sent2[rank], sum3 = sent3[rank];
      for (int i = rank_single_begin_[rank]; i < rank_single_begin_[rank + 1]; ++i) {
        const int e = rank_single_[i];
        sum0 += row0[e];
        sum1 += row1[e];
        sum2 += row2[e];
        sum3 += row3[e];
      }
      sent0[rank] = sum0;
      sent1[rank] = sum1;
      sent2[rank] = sum2;
      sent3[rank] = sum3;
    }
  }
  for (; s < load_.num_sources; ++s) {
    const double* row = row_of(s);
    for (int e = 0; e < num_experts; ++e) {
      sign |= std::bit_cast<std::uint64_t>(row[e]);
      totals[e] += row[e];
    }
    send_singles(s);
  }
  bool in_range = (sign >> 63) == 0;
  rounded_.resize(num_experts);
  for (int e = 0; e < num_experts; ++e) {
    in_range &= totals_[e] <= kMaxTokens;
    rounded_[e] = std::isfinite(totals_[e]) ? std::llround(totals_[e]) : 0;
  }
  scale_.resize(num_experts);
  for (int e = 0; e < num_experts; ++e) {
    scale_[e] = rounded_[e] > 0 ? totals_[e] / static_cast<double>(rounded_[e]) : 0.0;
  }
  return in_range;
}

void SourceAssigner::AssignSpread(const QuotaSolver& solver, int expert, const QuotaSplit& split,
                                  StepRouting& routing) {
  const int num_slots = placement_.num_slots();
  const int num_sources = load_.num_sources;
  const int num_experts = load_.num_experts;
  const int begin = solver.copy_begin(expert);
  const int count = solver.copy_end(expert) - begin;
  const double scale = scale_[expert];
  room_.resize(count);
  for (int i = 0; i < count; ++i) {
    const int id = solver.copy_id(begin + i);
    const long long quota =
        id < num_slots ? split.slot_quota[id] : split.extra_quota[id - num_slots];
    room_[i] = static_cast<double>(quota) * scale;
  }
  if (rounded_[expert] == 0) room_[0] = totals_[expert];  // under half a token: first copy
  // Raw pointers: the loops below store doubles, which could be any of these vectors' elements
  // as far as the compiler knows, so through the vectors it would reload every pointer.
  double* remaining = remaining_.data();
  const double* column = load_.traffic.data() + expert;
  for (int s = 0; s < num_sources; ++s) remaining[s] = column[static_cast<size_t>(s) * num_experts];
  double* sent = routing.sent_tokens.data();
  double* rank_tokens = routing.rank_tokens.data();
  double* slot_tokens = routing.slot_tokens.data();
  double* transient_tokens = routing.transient_tokens.data();
  double* copy_room = room_.data();
  const size_t* sent_row = sent_row_.data();

  // The copy being filled keeps its open quota and its slot's and rank's running sums in
  // registers until another copy is filled: the additions happen in the same order as one store
  // per share would make them (so the same bits), without each waiting for the previous store.
  int open_copy = -1;
  int id = 0;
  int rank = 0;
  double room = 0;
  double slot_sum = 0;
  double rank_sum = 0;
  auto slot_cell = [&]() -> double& {
    return id < num_slots ? slot_tokens[id] : transient_tokens[id - num_slots];
  };
  auto close = [&]() {
    if (open_copy < 0) return;
    copy_room[open_copy] = room;
    slot_cell() = slot_sum;
    rank_tokens[rank] = rank_sum;
  };
  auto switch_to = [&](int i) {
    close();
    open_copy = i;
    id = solver.copy_id(begin + i);
    rank = solver.copy_rank(begin + i);
    room = copy_room[i];
    slot_sum = slot_cell();
    rank_sum = rank_tokens[rank];
  };
  // The check stays inline at every call; the rare switch is one out-of-line call.
  auto open = [&](int i) {
    if (i != open_copy) switch_to(i);
  };
  // Source s sends `tokens` to the open copy (the caller takes them off what s has left).
  auto send = [&](int s, double tokens) {
    if (record_shares_) routing.shares.push_back({source_rank_[s], expert, id, tokens});
    slot_sum += tokens;
    rank_sum += tokens;
    sent[sent_row[s] + rank] += tokens;
  };
  auto take = [&](int s) {
    const double tokens = std::min(remaining[s], room);
    if (tokens <= 0) return;
    room -= tokens;
    remaining[s] -= tokens;
    send(s, tokens);
  };
  // Local: sources on the copy's own rank. A copy without room takes nothing (quotas and what
  // sources have left are never negative), so it is not opened.
  for (int i = 0; i < count; ++i) {
    if (copy_room[i] <= 0 && i != open_copy) continue;
    open(i);
    for (int s = rank; s < num_sources; s += num_ranks_) take(s);
  }
  // Same node.
  const int per_node = topology_.gpus_per_node();
  for (int i = 0; i < count; ++i) {
    if (copy_room[i] <= 0 && i != open_copy) continue;
    open(i);
    const int first = topology_.node_of(rank) * per_node;
    for (int r = first; r < first + per_node; ++r) {
      for (int s = r; s < num_sources; s += num_ranks_) take(s);
    }
  }
  // The rest, in source order; rounding dust goes to the copy last used. Each source comes up
  // once here, so what it has left stays in a register.
  int next = 0;
  for (int s = 0; s < num_sources; ++s) {
    double left = remaining[s];
    if (!(left > 0)) continue;
    while (left > 0 && next < count) {
      open(next);
      const double tokens = std::min(left, room);
      if (tokens > 0) {
        room -= tokens;
        left -= tokens;
        send(s, tokens);
      }
      if (room <= 0) ++next;
    }
    if (left > 0) {
      open(std::min(next, count - 1));
      send(s, left);
    }
  }
  close();
}

void SourceAssigner::Assign(const QuotaSolver& solver, const std::vector<TransientReplica>& extras,
                            const QuotaSplit& split, StepRouting& routing) {
  const int num_ranks = placement_.num_ranks();
  const int num_slots = placement_.num_slots();
  const int num_experts = load_.num_experts;
  routing.transients = extras;
  routing.shares.clear();
  routing.transient_tokens.assign(extras.size(), 0.0);

  // Scan sent every single-rank expert's tokens to its rank. Redo the columns of ranks that lost
  // one to a transient, in Scan's order, so the sums are what a fresh pass would give.
  for (int rank = 0; rank < num_ranks; ++rank) {
    bool changed = false;
    for (int i = rank_single_begin_[rank]; i < rank_single_begin_[rank + 1]; ++i) {
      changed |= solver.rank_count(rank_single_[i]) != 1;
    }
    if (!changed) continue;
    for (int src = 0; src < num_ranks; ++src) {
      routing.sent_tokens[static_cast<size_t>(src) * num_ranks + rank] = 0;
    }
    for (int s = 0; s < load_.num_sources; ++s) {
      const double* row = load_.traffic.data() + static_cast<size_t>(s) * num_experts;
      double& sent = routing.sent_tokens[static_cast<size_t>(source_rank_[s]) * num_ranks + rank];
      for (int i = rank_single_begin_[rank]; i < rank_single_begin_[rank + 1]; ++i) {
        const int e = rank_single_[i];
        if (solver.rank_count(e) == 1) sent += row[e];
      }
    }
  }
  for (int e = 0; e < num_experts; ++e) {
    if (totals_[e] == 0) continue;
    if (solver.rank_count(e) > 1) {
      AssignSpread(solver, e, split, routing);
      continue;
    }
    const int begin = solver.copy_begin(e);
    const int end = solver.copy_end(e);
    const double scale = scale_[e];
    routing.rank_tokens[solver.copy_rank(begin)] += totals_[e];
    if (record_shares_) room_.resize(end - begin);
    for (int c = begin; c < end; ++c) {
      const int id = solver.copy_id(c);
      const double tokens =
          rounded_[e] == 0
              ? (c == begin ? totals_[e] : 0.0)
              : static_cast<double>(id < num_slots ? split.slot_quota[id]
                                                   : split.extra_quota[id - num_slots]) *
                    scale;
      (id < num_slots ? routing.slot_tokens[id] : routing.transient_tokens[id - num_slots]) +=
          tokens;
      if (record_shares_) room_[c - begin] = tokens;
    }
    if (record_shares_) ShareInSourceOrder(solver, e, routing);
  }
}

void SourceAssigner::ShareInSourceOrder(const QuotaSolver& solver, int expert,
                                        StepRouting& routing) {
  const int begin = solver.copy_begin(expert);
  const int count = solver.copy_end(expert) - begin;
  int open = 0;
  for (int s = 0; s < load_.num_sources; ++s) {
    double remaining = load_.traffic[static_cast<size_t>(s) * load_.num_experts + expert];
    while (remaining > 0 && open < count) {
      const double tokens = std::min(remaining, room_[open]);
      if (tokens > 0) {
        routing.shares.push_back({source_rank_[s], expert, solver.copy_id(begin + open), tokens});
        remaining -= tokens;
        room_[open] -= tokens;
      }
      if (room_[open] <= 0) ++open;
    }
    // Rounding dust goes to the copy last used.
    if (remaining > 0) {
      routing.shares.push_back(
          {source_rank_[s], expert, solver.copy_id(begin + std::min(open, count - 1)), remaining});
    }
  }
}

// Checks run in this order: the load's shape, then its entries (during SourceAssigner::Scan, and
// TrafficValues to name a bad one), then the rest.
Status ValidateLoadShape(const Placement& placement, const StepLoad& load) {
  if (load.num_experts != placement.num_experts()) {
    return InvalidArgument("load.num_experts " + std::to_string(load.num_experts) +
                           " does not match placement.num_experts " +
                           std::to_string(placement.num_experts()));
  }
  if (load.num_sources < 1) {
    return InvalidArgument("load.num_sources must be >= 1, got " +
                           std::to_string(load.num_sources));
  }
  if (load.traffic.size() != static_cast<size_t>(load.num_sources) * load.num_experts) {
    return InvalidArgument("load.traffic has " + std::to_string(load.traffic.size()) +
                           " entries, expected " + std::to_string(load.num_sources) + " x " +
                           std::to_string(load.num_experts));
  }
  return Status::Ok();
}

Status TrafficValues(const StepLoad& load) {
  for (size_t i = 0; i < load.traffic.size(); ++i) {
    if (!std::isfinite(load.traffic[i]) || load.traffic[i] < 0) {
      return InvalidArgument("load.traffic[" + std::to_string(i) +
                             "] = " + std::to_string(load.traffic[i]) +
                             " is not a non-negative token count");
    }
    if (load.traffic[i] > kMaxTokens) {
      return InvalidArgument("load.traffic[" + std::to_string(i) +
                             "] = " + std::to_string(load.traffic[i]) + " exceeds 1e15 tokens");
    }
  }
  return Status::Ok();
}

Status ValidateTopologyAndOptions(const Placement& placement, const Topology& topology,
                                  const CostModel& cost, const QuotaPlanOptions& options) {
  if (topology.num_ranks() != placement.num_ranks()) {
    return InvalidArgument("topology has " + std::to_string(topology.num_ranks()) +
                           " ranks, placement.num_ranks is " +
                           std::to_string(placement.num_ranks()));
  }
  if (cost.topology().num_ranks() != placement.num_ranks()) {
    return InvalidArgument(
        "cost model topology has " + std::to_string(cost.topology().num_ranks()) +
        " ranks, placement.num_ranks is " + std::to_string(placement.num_ranks()));
  }
  if (options.transient_per_rank < 0) {
    return InvalidArgument("transient_per_rank must be >= 0, got " +
                           std::to_string(options.transient_per_rank));
  }
  return Status::Ok();
}

// The next transient replica to try: the hottest expert per copy among those that pin the max
// rank load, on the least-loaded rank that has a free transient slot and no copy of it, fed from
// a holder on that rank's node, else from the home. False when there is none.
bool NextTransient(const Placement& placement, const Topology& topology, const QuotaSolver& solver,
                   std::span<const long long> tokens, const std::vector<int>& transients_on_rank,
                   int transient_per_rank, std::vector<char>& holds, TransientReplica& next) {
  const auto rank_load = solver.rank_load();
  bool found = false;
  long long best_tokens = 0;
  long long best_copies = 1;
  for (int e : solver.bottleneck_experts()) {
    const long long copies = solver.copy_end(e) - solver.copy_begin(e);
    // tokens[e] / copies > best_tokens / best_copies, in integers.
    if (found && tokens[e] * best_copies <= best_tokens * copies) continue;
    // The solver's copies are the placement's plus the transients so far.
    holds.assign(placement.num_ranks(), 0);
    for (int c = solver.copy_begin(e); c < solver.copy_end(e); ++c) holds[solver.copy_rank(c)] = 1;
    int target = -1;
    for (int g = 0; g < placement.num_ranks(); ++g) {
      if (transients_on_rank[g] >= transient_per_rank || holds[g]) continue;
      if (target < 0 || rank_load[g] < rank_load[target]) target = g;
    }
    if (target < 0) continue;
    int source = placement.home(e);
    for (int slot : placement.copies(e)) {
      const int holder = placement.rank_of_slot(slot);
      if (topology.same_node(holder, target)) {
        source = holder;
        break;
      }
    }
    next = {e, target, source};
    best_tokens = tokens[e];
    best_copies = copies;
    found = true;
  }
  return found;
}

}  // namespace

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

Result<StepRouting> PlanStepQuotas(const Placement& placement, const StepLoad& load,
                                   const Topology& topology, const CostModel& cost,
                                   const QuotaPlanOptions& options) {
  KEEL_RETURN_IF_ERROR(ValidateLoadShape(placement, load));
  SourceAssigner assigner(placement, load, topology);
  assigner.RecordShares(options.record_shares);
  StepRouting scanned;
  if (!assigner.Scan(scanned)) KEEL_RETURN_IF_ERROR(TrafficValues(load));
  KEEL_RETURN_IF_ERROR(ValidateTopologyAndOptions(placement, topology, cost, options));
  const std::vector<long long>& tokens = assigner.rounded_totals();
  QuotaSolver solver;
  QuotaSplit split;
  std::vector<TransientReplica> transients;
  solver.Solve(placement, tokens, transients, split);
  if (options.transient_per_rank == 0) {
    assigner.Assign(solver, transients, split, scanned);
    return scanned;
  }
  StepRouting best = scanned;
  assigner.Assign(solver, transients, split, best);

  // Greedy transients: each must lower the max rank load and the cost model's predicted layer
  // time; the first candidate that does not ends the search. The baseline is priced only once a
  // candidate gets that far. Each candidate re-solves from the previous flow.
  std::vector<int> transients_on_rank(placement.num_ranks(), 0);
  std::vector<char> holds;
  double best_seconds = -1;
  double sync_seconds = 0;  // the placement's, the same for every candidate
  QuotaSplit trial_split;
  StepRouting trial;
  TransientReplica next;
  while (NextTransient(placement, topology, solver, tokens, transients_on_rank,
                       options.transient_per_rank, holds, next)) {
    transients.push_back(next);
    solver.AddCopy(placement, transients, trial_split);
    if (trial_split.max_rank_tokens >= split.max_rank_tokens) break;
    trial = scanned;
    assigner.Assign(solver, transients, trial_split, trial);
    if (best_seconds < 0) {
      sync_seconds = cost.ReplicaSyncSeconds(placement);
      best_seconds = cost.EstimateWithSync(placement, best, sync_seconds).total_seconds();
    }
    const double trial_seconds =
        cost.EstimateWithSync(placement, trial, sync_seconds).total_seconds();
    if (!(trial_seconds < best_seconds)) break;
    ++transients_on_rank[next.rank];
    best_seconds = trial_seconds;
    std::swap(best, trial);
    std::swap(split, trial_split);
  }
  return best;
}

}  // namespace keel
