// StepPlanner::Impl's in-place patching (step_planner_impl.h): on the fast path a candidate
// transient re-routes only the experts whose quotas its solve moved, so the kept routing is
// patched in place (the same bits as a fresh Assign), priced, and undone if it does not pay; a
// floor under its price skips the patch when it cannot.
#include <algorithm>
#include <vector>

#include "placement/step_planner_impl.h"

namespace keel {
namespace {

// PeaksOf's (step_planner.cc) receive side alone, over the ranks that `skip` does not mark: a floor
// under the peaks of any routing in which those ranks receive what they receive here.
LinkPeaks ReceivePeaks(const double* links, const double* rank_tokens, const char* skip,
                       int num_ranks, double bytes_per_row) {
  const double* from_node = links + static_cast<size_t>(kFromNode) * num_ranks;
  const double* kept = links + static_cast<size_t>(kKept) * num_ranks;
  double intra = 0;
  double inter = 0;
  for (int r = 0; r < num_ranks; ++r) {
    if (skip[r]) continue;
    intra = std::max(intra, from_node[r] - kept[r]);
    inter = std::max(inter, rank_tokens[r] - from_node[r]);
  }
  return {intra * bytes_per_row, inter * bytes_per_row};
}

}  // namespace

bool StepPlanner::Impl::QuotasMoved(int expert) const {
  // The candidate's own quota is new; the transients before it are in both splits.
  const size_t kept_extras = split_.extra_quota.size();
  for (int c = solver_.copy_begin(expert); c < solver_.copy_end(expert); ++c) {
    const int id = solver_.copy_id(c);
    if (id < num_slots_) {
      if (split_.slot_quota[id] != trial_split_.slot_quota[id]) return true;
      continue;
    }
    const size_t extra = static_cast<size_t>(id - num_slots_);
    if (extra < kept_extras && split_.extra_quota[extra] != trial_split_.extra_quota[extra]) {
      return true;
    }
  }
  return false;
}

void StepPlanner::Impl::ListPatched(int expert) {
  // Only the experts whose flows the candidate's solve moved can have new quotas.
  patched_.clear();
  for (int e : solver_.changed_experts()) {
    if (totals_[e] != 0 && (e == expert || QuotasMoved(e))) patched_.push_back(e);
  }
  std::sort(patched_.begin(), patched_.end());
  touched_.assign(num_ranks_, 0);
  for (int e : patched_) {
    for (int c = solver_.copy_begin(e); c < solver_.copy_end(e); ++c) {
      touched_[solver_.copy_rank(c)] = 1;
    }
  }
}

double StepPlanner::Impl::FloorSeconds() const {
  const LinkPeaks peaks = ReceivePeaks(best_.links.data(), best_.rank_tokens.data(),
                                       touched_.data(), num_ranks_, cost_.token_row_bytes());
  return cost_
      .EstimateFromPeaks(*placement_, static_cast<double>(trial_split_.max_rank_tokens), peaks,
                         transients_, sync_seconds_)
      .total_seconds();
}

void StepPlanner::Impl::PatchBest(int expert) {
  const bool record_shares = record_shares_;
  best_.transient_tokens.push_back(0.0);
  // The new shares of the experts patched, by expert: Assign's order.
  moved_shares_.shares.clear();
  for (int e : patched_) {
    // Out under the kept split, without the candidate; back in under the candidate's split.
    record_shares_ = false;
    excluded_expert_ = e == expert ? e : -1;
    AddExpert(e, split_, -1.0, /*single_row=*/true, best_);
    excluded_expert_ = -1;
    record_shares_ = record_shares;
    // Shares go to moved_shares_, whose sums are never read.
    best_.shares.swap(moved_shares_.shares);
    AddExpert(e, trial_split_, 1.0, /*single_row=*/true, best_);
    best_.shares.swap(moved_shares_.shares);
  }
}

void StepPlanner::Impl::KeepPatchedShares() {
  // best_'s shares with those of the patched experts replaced, still by expert.
  trial_.shares.clear();
  if (!record_shares_) return;
  const CopyShare* kept = best_.shares.begin();
  const CopyShare* fresh = moved_shares_.shares.begin();
  // The shares are by expert: binary searches find each patched expert's run.
  auto by_expert = [](const CopyShare& share, int expert) { return share.expert < expert; };
  for (int e : patched_) {
    const CopyShare* from = kept;
    kept = std::lower_bound(kept, best_.shares.end(), e, by_expert);
    trial_.shares.Append(from, kept);
    while (kept != best_.shares.end() && kept->expert == e) ++kept;
    from = fresh;
    while (fresh != moved_shares_.shares.end() && fresh->expert == e) ++fresh;
    trial_.shares.Append(from, fresh);
  }
  trial_.shares.Append(kept, best_.shares.end());
  best_.shares.swap(trial_.shares);
}

void StepPlanner::Impl::RestoreBest(int expert) {
  // PatchBest backwards: out under the candidate's split, back in under the kept one without
  // the candidate. best_'s shares were never touched.
  const bool record_shares = record_shares_;
  record_shares_ = false;
  for (int e : patched_) {
    AddExpert(e, trial_split_, -1.0, /*single_row=*/true, best_);
    excluded_expert_ = e == expert ? e : -1;
    AddExpert(e, split_, 1.0, /*single_row=*/true, best_);
    excluded_expert_ = -1;
  }
  record_shares_ = record_shares;
  best_.transient_tokens.pop_back();
}

}  // namespace keel
