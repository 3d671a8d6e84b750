// StepPlanner::Impl, the per-step planner behind placement/step_planner.h, shared by the files
// that each do one of its jobs:
//   step_planner.cc         the scan of the traffic, the quotas, the greedy search for transient
//                           replicas, and the routing handed to the caller
//   step_planner_spread.cc  one expert's tokens to its copies: locality first, each node's
//                           sources and copies levelled, shares in source order
//   step_planner_patch.cc   a candidate transient's routing patched into the kept one in place,
//                           with its price floor and its undo
#pragma once

#include <algorithm>
#include <cassert>
#include <cstdint>
#include <cstring>
#include <span>
#include <vector>

#include "common/simd.h"
#include "keel/status.hpp"
#include "placement/cost_model.h"
#include "placement/placement.h"
#include "placement/quota_solver.h"
#include "placement/routing.h"
#include "placement/step_planner.h"
#include "placement/topology.h"
#include "placement/traffic_scan.h"

namespace keel {

// Link sums of a routing on the fast path (one source per rank, exact sums), three arrays of
// num_ranks: per rank, the tokens it receives from its own node and those it sends to its own
// node (both with what it keeps), and the tokens it keeps. What a rank receives in all is its
// load, and what it sends in all is its sources' traffic, so with these the four link sums of
// the all-to-all follow by subtraction (PeaksOf).
enum LinkSum { kFromNode = 0, kToNode = 1, kKept = 2 };
constexpr int kLinkSums = 3;

// Adds `sign` times the link sums of an expert whose copies all sit on `rank` to `links`: its
// sources `column` [num_ranks] send everything there, so rank `rank` receives the tokens of its
// node's sources [first, last), which each send theirs to their node, and keeps its own.
inline void AddSingleLinkSums(const double* column, int rank, int first, int last, int num_ranks,
                              double sign, double* links) {
  double* to_node = links + static_cast<size_t>(kToNode) * num_ranks;
  double from_node = 0;
  int s = first;
  if (first % 4 == 0) {
    DoubleQuad lanes = {};
    for (; s + 4 <= last; s += 4) {
      DoubleQuad tokens, cell;
      std::memcpy(&tokens, column + s, sizeof tokens);
      tokens *= sign;
      lanes += tokens;
      std::memcpy(&cell, to_node + s, sizeof cell);
      cell += tokens;
      std::memcpy(to_node + s, &cell, sizeof cell);
    }
    from_node = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
  }
  for (; s < last; ++s) {
    from_node += sign * column[s];
    to_node[s] += sign * column[s];
  }
  links[static_cast<size_t>(kFromNode) * num_ranks + rank] += from_node;
  links[static_cast<size_t>(kKept) * num_ranks + rank] += sign * column[rank];
}

// to[0, n) = counts[0, n) as doubles, n a multiple of 4: four at a time, as GCC's -O2 leaves
// the plain loop scalar.
inline void CountsToDoubles(const std::int32_t* counts, int n, double* to) {
  for (int i = 0; i < n; i += 4) {
    IntQuad quad;
    std::memcpy(&quad, counts + i, sizeof quad);
    const DoubleQuad doubles = __builtin_convertvector(quad, DoubleQuad);
    std::memcpy(to + i, &doubles, sizeof doubles);
  }
}

// Shares as a draft writes them: room is made once per expert, and an append is then a store (in
// the loops here std::vector::push_back stays a call). The buffer only grows; the entries past
// size() are left over.
class ShareList {
 public:
  size_t size() const { return size_; }
  const CopyShare* begin() const { return buffer_.data(); }
  const CopyShare* end() const { return buffer_.data() + size_; }
  void clear() { size_ = 0; }
  // Room for `count` more appends.
  void Reserve(size_t count) {
    if (buffer_.size() < size_ + count) buffer_.resize(size_ + count);
  }
  void Append(const CopyShare& share) {
    assert(size_ < buffer_.size());
    buffer_[size_++] = share;
  }
  void Append(const CopyShare* first, const CopyShare* last) {
    Reserve(static_cast<size_t>(last - first));
    std::copy(first, last, buffer_.data() + size_);
    size_ += static_cast<size_t>(last - first);
  }
  void swap(ShareList& other) {
    buffer_.swap(other.buffer_);
    std::swap(size_, other.size_);
  }
  // Moves the shares into `out`, whose old buffer this list takes (its entries left over).
  void MoveTo(std::vector<CopyShare>& out) {
    buffer_.resize(size_);
    out.swap(buffer_);
    size_ = 0;
  }

 private:
  std::vector<CopyShare> buffer_;
  size_t size_ = 0;
};

class StepPlanner::Impl {
 public:
  Impl(const Topology& topology, const CostModel& cost) : topology_(topology), cost_(cost) {}

  // StepPlanner::Plan after the shape checks. `load`: the same traffic by source, to name a bad
  // entry by its index there; null to name it in `by_expert`.
  Status Plan(const Placement& placement, int num_sources, std::span<const double> by_expert,
              const QuotaPlanOptions& options, StepRouting& routing, const StepLoad* load);
  // StepPlanner::Plan for integer counts after the shape checks.
  Status PlanCounts(const Placement& placement, int num_sources,
                    std::span<const std::int32_t> counts, const QuotaPlanOptions& options,
                    StepRouting& routing);

 private:
  // A routing under construction. The tokens that rank s sends to rank d sit at
  // received[d * num_ranks + s], the transpose of StepRouting::sent_tokens: a rank's row then
  // takes a single-rank expert's sources as one contiguous addition. On the fast path `received`
  // holds only the tokens of experts spread over several ranks (Publish adds the rest when the
  // caller wants the matrix), and `links` the link sums that price it.
  //
  // A step's search rebuilds or patches drafts once per candidate, and each writes only the
  // cells its routing sends tokens through: the draft notes them, so that the next rebuild
  // restores those cells alone rather than num_ranks^2 of them.
  struct Draft {
    std::vector<double> rank_tokens;  // [num_ranks]
    std::vector<double> received;     // [num_ranks * num_ranks]
    // Cells of `received` written since it last held the step's base (ResetReceived), repeats
    // included; every cell when `received_stale` (a new step, whose base is new). Past a quarter
    // of the cells the draft turns stale instead: restoring the whole base then costs no more
    // than the writes did, and the list stays within num_ranks^2 bytes.
    std::vector<std::uint32_t> written;
    bool received_stale = true;
    void Wrote(size_t cell) {
      if (received_stale) return;
      if (written.size() * 4 >= received.size()) {
        received_stale = true;
        written.clear();
        return;
      }
      written.push_back(static_cast<std::uint32_t>(cell));
    }
    std::vector<double> slot_tokens;  // [num_slots]
    std::vector<double> transient_tokens;
    ShareList shares;
    std::vector<double> links;  // [kLinkSums * num_ranks], fast path only
  };

  // What depends on the placement and the number of sources alone; kept while they stay.
  void Bind(const Placement& placement, int num_sources);
  // The pass over the traffic: per-expert totals and, for the experts held by one rank in the
  // placement (every source sends there), their link sums (single_links_) on the fast path,
  // else the rows they fill (scanned_). False when some entry may be negative, not finite or
  // beyond kMaxTokenCount; the caller then names it.
  bool Scan();
  // Scan for integer counts (counts_), on the fast path alone: false when the routing cannot
  // take them there or some count is negative (the caller then names it, or plans the counts as
  // doubles).
  bool ScanCounts(const QuotaPlanOptions& options);
  // rounded_ for whole totals below 2^52 (whole_); false when some total is beyond kMaxTokenCount.
  bool RoundWholeTotals();
  // What follows the scan: the quotas, the transients and the routing.
  Status Route(const Placement& placement, const QuotaPlanOptions& options, StepRouting& routing);
  // `draft.received` back to the step's base: scanned_ off the fast path, zeros on it (empty
  // without keep_rows_). Restores the cells written since the last reset, or all when stale.
  void ResetReceived(Draft& draft);
  // Source s's tokens of `expert`, from by_expert_ or counts_.
  double Entry(int expert, int source) const {
    const size_t at = static_cast<size_t>(expert) * num_sources_ + source;
    return by_expert_ != nullptr ? by_expert_[at] : static_cast<double>(counts_[at]);
  }
  // What a quota of `expert` is multiplied by to give tokens: 1 for whole totals, which are their
  // rounded ones (an expert rounded to 0 has no quota above 0).
  double Scale(int expert) const { return whole_ ? 1.0 : scale_[expert]; }
  // `expert`'s sources' tokens: in by_expert_, or counts_ made doubles in column_ (valid until
  // the next call).
  const double* Column(int expert);
  // Adds `sign` times the link sums of `expert`, whose copies all sit on `rank`, to `links`.
  void AddSingleLinks(int expert, int rank, double sign, double* links);
  // Adds the tokens of `rank`'s single-rank experts that `keep` accepts to `row`, that rank's
  // row of received tokens: for each source, experts in ascending order, a rank's sources in
  // ascending order.
  template <typename Keep>
  void AddSingles(int rank, double* row, Keep keep);
  // The copies of `expert` in force: the solver's, less the candidate transient it holds last
  // when that candidate was dropped (excluded_expert_). Its rank never held the expert.
  int CopyEnd(int expert) const {
    return solver_.copy_end(expert) - (expert == excluded_expert_ ? 1 : 0);
  }
  int RankCount(int expert) const {
    return solver_.rank_count(expert) - (expert == excluded_expert_ ? 1 : 0);
  }
  // Fills `draft` for the copies in force, `num_extras` transients beyond the placement, and the
  // quotas in `split`.
  void Assign(size_t num_extras, const QuotaSplit& split, Draft& draft);
  // Adds `sign` (1 or -1) times the routing of `expert`'s tokens under `split` to `draft`; the
  // tokens of an expert on one rank enter its row of received tokens (its link sums on the fast
  // path) only with `single_row` (Assign has them from Scan).
  void AddExpert(int expert, const QuotaSplit& split, double sign, bool single_row, Draft& draft);
  // Tokens of `expert` with copies on several ranks: local copies first (copy order), then each
  // node's copies from that node's sources, levelled (LevelGives) so that what the sources keep
  // and what the copies still need, both of which cross nodes next, are as even as they can be,
  // then the rest in copy order and ascending source order.
  void AssignSpread(int expert, const QuotaSplit& split, double sign, Draft& draft);
  // The copies [begin, begin + count) of the solver with room[i] > 0, as indices i, by node
  // (ties: copy order): the same-node pass of the two Assign functions goes node by node.
  void ByNode(int begin, int count, const double* room, std::vector<int>& by_node) const;
  // The same-node pass's flow for the node of copy copy_nodes_[run] (ByNode's order): that node's
  // copies with room (node_copies_; `run` moves past them), its sources (node_sources_), and what
  // each source gives (gives_) and each copy takes (takes_), both levelled (LevelGives) to the
  // smaller of what the sources have left and what the copies still need.
  void LevelNode(int begin, const double* room, const double* remaining, size_t& run);
  // AssignSpread on the fast path: the same shares, found per copy instead of per source, and
  // the link sums. Every copy gets its whole quota (the quotas add up to the expert's total), so
  // the slot and rank sums take the quotas at once.
  void AssignSpreadWhole(int expert, const QuotaSplit& split, double sign, Draft& draft);
  // AssignSpreadWhole with (kRows) or without the rows of received tokens.
  template <bool kRows>
  void AssignSpreadWholeRows(int expert, const QuotaSplit& split, double sign, Draft& draft);
  // Whether any copy of `expert` has a different quota in trial_split_ than in split_ (split_
  // must be the solver's previous split, as it is when a candidate follows the base or a kept
  // candidate).
  bool QuotasMoved(int expert) const;
  // patched_: the experts with tokens whose routing the candidate transient of `expert` changes,
  // ascending: those whose quotas moved, and `expert`; touched_: the ranks that hold a copy of
  // one of them.
  void ListPatched(int expert);
  // On the fast path, after ListPatched: a floor under the candidate's price. Its max rank load
  // is the solver's (exact there), and a rank that holds no copy of a patched expert receives
  // what it received before, so those ranks' receive sums floor the all-to-all's peaks. Every
  // term of the price grows with its inputs.
  double FloorSeconds() const;
  // On the fast path, after ListPatched: turns best_ into the routing for the candidate
  // transient of `expert` in place, taking out and putting back the routing of each patched
  // expert: the same bits as a fresh Assign. The patched experts' new shares wait in
  // moved_shares_ until the candidate is kept.
  void PatchBest(int expert);
  // Once the candidate is kept: the new shares of the experts PatchBest patched replace theirs
  // in best_.
  void KeepPatchedShares();
  // Takes best_ back to what it was before PatchBest(expert) by the reverse patch: on the fast
  // path every sum is exact and no sum is -0.0, so taking the candidate's routing out and the
  // kept one back in restores every bit, at the cost of the patch itself. A copy of what the
  // patch overwrote would cost a row of num_ranks per rank holding a patched expert: with many
  // transients, num_ranks^2 per candidate.
  void RestoreBest(int expert);
  // Shares of an expert whose copies sit on one rank: sources in ascending order fill the copies
  // in copy order up to the quotas in room_.
  void ShareInSourceOrder(int expert, Draft& draft);
  // The most shares that the routing of an expert with `count` copies makes: each share empties
  // its source or fills its copy, and each source may send rounding dust once more.
  size_t MaxShares(int count) const { return 2 * static_cast<size_t>(num_sources_) + count; }
  // Whether a share from `source_rank` to a copy on `rank` is recorded (given record_shares_).
  bool Recorded(int source_rank, int rank) const {
    return shares_of_rank_ < 0 || source_rank == shares_of_rank_ || rank == shares_of_rank_;
  }
  // Keeps the candidate transient (the last of transients_, solved into trial_split_) when its
  // routing lowers the predicted time below `best_seconds` (then updated, with best_, split_
  // and the slot taken); else leaves them as they were.
  bool KeepCandidate(const TransientReplica& candidate, double& best_seconds);
  // After a candidate transient `first` (the last of transients_) that does not pay on its own:
  // adds the next candidates one at a time, while slots are free, and keeps them all at the
  // first that, together with the ones before, lowers the max rank load and the predicted time
  // below `best_seconds` (then updated, with best_, split_ and the slots taken). The first fill
  // costs a whole weight transfer while the copies after it fill in parallel on other ranks, so
  // a run of copies can pay where its first does not. Returns whether it kept the run; solver_
  // then holds all of its copies either way, as after any candidate that ends the search.
  bool TakeRun(const Placement& placement, std::span<const long long> tokens,
               const TransientReplica& first, double& best_seconds);
  // The cost model's layer time for `draft` with `transients`; from its link sums on the fast
  // path.
  double Seconds(const Draft& draft, std::span<const TransientReplica> transients) const;
  // Moves `draft` into `routing`, whose old buffers `draft` takes for the next step; the
  // all-to-all matrix only with `sent_tokens`.
  void Publish(Draft& draft, const std::vector<TransientReplica>& transients, bool sent_tokens,
               StepRouting& routing);

  const Topology& topology_;
  const CostModel& cost_;

  // Bound by Bind.
  const Placement* placement_ = nullptr;  // this call's
  bool bound_ = false;
  std::vector<int> phy2log_;  // the placement Bind last saw
  int num_experts_ = 0;
  int num_ranks_ = 0;
  int num_slots_ = 0;
  int num_sources_ = 0;
  std::vector<int> source_rank_;  // [num_sources]
  std::vector<int> node_of_;      // [num_ranks]
  // One source per rank, a multiple of 4 of them: source s is rank s, a rank's row of received
  // tokens lines up with an expert's sources, and both go four at a time.
  bool source_quads_ = false;
  std::vector<SingleExpert> singles_;  // the experts on one rank, by rank, then ascending
  std::vector<SingleExpert> experts_;  // [num_experts] where each sits, for ScanCounts
  // Experts on one rank in the placement, grouped by that rank, ascending.
  std::vector<int> rank_single_begin_;  // [num_ranks + 1]
  std::vector<int> rank_single_;
  std::vector<int> empty_on_rank_;  // [num_ranks] slots the placement leaves empty

  // This step's. The traffic by expert: by_expert_, or counts_ (then on the fast path).
  const double* by_expert_ = nullptr;
  const std::int32_t* counts_ = nullptr;
  std::vector<double> column_;            // scratch of Column
  std::vector<std::uint32_t> int_lanes_;  // scratch of ScanCounts
  std::vector<double> converted_;  // counts as doubles, where the fast path does not take them
  bool record_shares_ = false;
  int shares_of_rank_ = -1;  // options.shares_of_rank
  bool whole_ = false;       // every entry a whole number, and every sum of them exact
  // The fast path: whole_, one source per rank (source_quads_), and every link sum times the
  // cost model's bytes per token row exact, so that link sums price a routing (PeaksOf). A
  // routing is then patched in place and found per copy; sums are exact in any order.
  bool fast_ = false;
  std::vector<double> sent_;   // [num_ranks] what each source sends in all
  std::vector<double> lanes_;  // [4 * num_experts] scratch of ScanByExpert
  // Whether drafts keep their rows of received tokens: off the fast path, or when the caller
  // wants the all-to-all matrix.
  bool keep_rows_ = true;
  std::vector<double> single_links_;  // [kLinkSums * num_ranks] fast path: single-rank experts
  // The bound placement's replica sync, once a candidate needs it; -1 until then.
  double sync_seconds_ = -1;
  std::vector<double> totals_;
  std::vector<long long> rounded_;
  // [num_experts] totals_ / rounded_ (0 when rounded to 0), where not whole_: quotas count rounded
  // tokens, and this scales them to the expert's exact total. Computed once, as every Assign
  // needs it. Whole totals need no scale (Scale).
  std::vector<double> scale_;
  // [num_ranks * num_ranks] received from single-rank experts, off the fast path.
  std::vector<double> scanned_;
  std::vector<double> remaining_;  // [num_sources] tokens of the current expert still unsent
  std::vector<double> room_;       // [copies of the current expert] quota still open
  std::vector<int> kept_;          // scratch of AddSingles
  // Scratch of the same-node pass of AssignSpread and AssignSpreadWholeRows (LevelGives).
  std::vector<int> node_sources_;
  std::vector<int> node_copies_;
  std::vector<int> copy_nodes_;
  std::vector<double> gives_;
  std::vector<double> takes_;
  std::vector<int> level_order_;
  QuotaSolver solver_;
  QuotaSplit split_;
  QuotaSplit trial_split_;
  QuotaSplit run_split_;  // TakeRun's
  std::vector<TransientReplica> transients_;
  int excluded_expert_ = -1;  // see CopyEnd
  std::vector<int> transients_on_rank_;
  std::vector<int> transient_room_;  // [num_ranks] this call's slots for transients
  std::vector<char> holds_;
  Draft best_;
  // The candidate's routing where best_ is not patched in place; else the shares that
  // KeepPatchedShares builds.
  Draft trial_;
  std::vector<int> patched_;   // see ListPatched
  Draft moved_shares_;         // scratch of PatchBest: their new shares, until kept
  std::vector<char> touched_;  // [num_ranks] see ListPatched
  std::vector<char> gained_;   // [num_experts] scratch of Assign and Publish
};

}  // namespace keel
