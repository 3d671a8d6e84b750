// The exact quota solver behind SplitQuotas, QuotaSplitter and the per-step planner (internal to
// placement/: its callers are quota_solver.cc and step_planner.cc).
#pragma once

#include <span>
#include <tuple>
#include <utility>
#include <vector>

#include "placement/placement.h"
#include "placement/routing.h"
#include "placement/topology.h"

namespace keel {

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
  // After AddCopy: the experts whose flows it moved, the new copy's expert among them, in no
  // order. Every other expert's quotas are what the previous call gave them.
  std::span<const int> changed_experts() const { return changed_list_; }

  // [num_ranks] load of each rank under the split.
  std::span<const long long> rank_load() const { return rank_load_; }
  // Experts that pin the max rank load: every split needs max load >= max_rank_tokens unless one
  // of them gets a copy outside the ranks they fill. Ascending ids. Found on the first call after
  // a solve, from its last min cut: a caller that does not ask does not pay.
  const std::vector<int>& bottleneck_experts() {
    if (!bottleneck_found_) RecordBottleneck(/*from_cut_ranks=*/true);
    return bottleneck_experts_;
  }

 private:
  void BuildCopies(const Placement& placement, std::span<const TransientReplica> extras);
  // BuildCopies(placement, {}). A planner solves the same placement at every step, so the copies
  // and arcs of the last placement built this way (the base) are restored rather than built
  // again when they were overwritten since.
  void BuildBaseCopies(const Placement& placement);
  // Before the copies and arcs are overwritten: saves them if they are the base, unsaved.
  void LeaveBase();
  // What BuildCopies with `extra` appended to the extras would give, copies and arcs, from what
  // the last one gave; `id` is the extra's copy id. Flows stay on their arcs; a new arc starts
  // empty.
  // Returns the new arc, or -1 when the extra's rank already held the expert.
  int InsertCopy(const TransientReplica& extra, int id);
  // Fixed loads, flexible experts and the arcs into each rank, for the current copies; no excess.
  // An expert on one rank gets its tokens as the flow of its one arc.
  void Prepare();
  // What Prepare would give after InsertCopy added `arc` to `expert`, from what it gave before
  // (all tokens routed, as a solve leaves them); `was_single`: whether the expert sat on one
  // rank before.
  void PrepareNewArc(int expert, int arc, bool was_single);
  void Pour(long long bound);
  // Once the previous flow sits on the current arcs (excess for what found no arc): the bound of
  // the cold start or of the previous cut, in_cut_ (which the caller widened by every rank that
  // gained a copy), whichever is higher. The flow above that bound goes back to its experts and
  // is poured again. Returns the bound; `cut_found` says whether it came from the cut.
  long long WarmStart(bool& cut_found);
  // Raises `bound` at each min cut until every token is routed; returns the final bound.
  // `cut_found`: the bound already comes from the cut in in_cut_ / cut_experts_.
  long long RouteAtLowestBound(long long bound, bool cut_found);
  // RouteAtLowestBound, then writes the quotas into `split`: after AddCopy only those of the
  // changed experts are computed (the rest are the previous call's, kept in solved_).
  void Finish(const Placement& placement, long long bound, bool cut_found, QuotaSplit& split);
  // Writes the quotas of copies [first_copy, last_copy) (whole experts) from their flows into
  // solved_; arc_given_ must be 0 for their arcs.
  void WriteQuotas(int first_copy, int last_copy);
  // Notes that `expert`'s flows moved (changed_experts()).
  void MarkChanged(int expert) {
    if (changed_[expert]) return;
    changed_[expert] = 1;
    changed_list_.push_back(expert);
  }
  // Starts a solve's list of changed experts afresh.
  void ClearChanged();
  // Routes remaining excess with augmenting paths; false when some is stuck (the last search's
  // marks then describe the min cut).
  bool RouteExcess();
  void Search();
  long long Augment(int rank);
  // `from_cut_ranks`: on copies that extend the base, list the base's single-rank experts of the
  // cut's ranks (found once per base) instead of passing over every expert, when they are few.
  // That pays for the transient search, which asks once per candidate on one base.
  void RecordBottleneck(bool from_cut_ranks);
  // The base's experts on one rank, by rank: base_single_begin_ / base_single_.
  void RecordBaseSingles();

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
  std::vector<long long> previous_flow_;  // scratch for Resolve
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

  // The base: its placement, and its copies and arcs once LeaveBase saved them. Tie() and
  // TieCopies() give the saved and the current ones as tuples of references, so that one
  // assignment copies all eight vectors (each keeping its capacity).
  struct Copies {
    std::vector<int> copy_begin, copy_id, copy_rank, copy_arc;
    std::vector<int> arc_begin, arc_rank, arc_expert, arc_copies;
    auto Tie() {
      return std::tie(copy_begin, copy_id, copy_rank, copy_arc, arc_begin, arc_rank, arc_expert,
                      arc_copies);
    }
  };
  auto TieCopies() {
    return std::tie(copy_begin_, copy_id_, copy_rank_, copy_arc_, arc_begin_, arc_rank_,
                    arc_expert_, arc_copies_);
  }
  bool has_base_ = false;
  std::vector<int> base_phy2log_;
  int base_num_experts_ = 0;
  int base_num_ranks_ = 0;
  Copies base_;
  bool base_saved_ = false;
  bool copies_are_base_ = false;  // whether copy_* and arc_* hold the base now
  // Whether they hold the base plus the copies AddCopy added since: an expert on one rank now
  // was one on that rank in the base.
  bool copies_extend_base_ = false;
  bool base_singles_found_ = false;     // whether the two below are the base's
  std::vector<int> base_single_begin_;  // [num_ranks + 1]
  std::vector<int> base_single_;        // the base's experts on one rank, by rank, ascending

  // The quotas of the last Finish, and whether they still describe the flows (Resolve moves
  // them without writing quotas).
  QuotaSplit solved_;
  bool solved_valid_ = false;
  std::vector<char> changed_;      // [num_experts] see changed_experts()
  std::vector<int> changed_list_;  // the experts marked in changed_

  std::vector<int> cut_experts_;  // experts of the last min cut, ascending
  std::vector<char> in_cut_;      // [num_ranks] ranks of the last min cut
  std::vector<int> bottleneck_experts_;
  bool bottleneck_found_ = false;  // whether bottleneck_experts_ is the last solve's
  std::vector<std::pair<long long, int>> pour_ranks_;
};

// The per-step planner's next transient replica to try (step_planner.cc), after `solver` solved
// for the placement and the transients so far with `tokens`: of the bottleneck experts that some
// rank can take, the one with the most tokens per copy (ties: the lowest id), on the
// least-loaded rank (the solver's loads; ties: the lowest) that has a free transient slot
// (transients_on_rank[g] < room[g], its slots for transients) and holds no copy of it, fed from
// its first holder in slot order on that rank's node, else from its home. False when there is
// none. `holds`: scratch.
bool NextTransient(const Placement& placement, const Topology& topology, QuotaSolver& solver,
                   std::span<const long long> tokens, std::span<const int> transients_on_rank,
                   std::span<const int> room, std::vector<char>& holds, TransientReplica& next);

}  // namespace keel
