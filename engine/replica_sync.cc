// Engine::Impl's replica synchronisation: ReduceGradients adds every copy's gradient into its
// expert's home in a fixed order (home, other copies by ascending slot, this step's transients) on
// the device, and PushWeights copies every home's updated weights to its replicas.
#include "engine/engine_impl.h"

#include <algorithm>
#include <functional>
#include <optional>

#include "migration/transfer_plan.h"

namespace keel {

Status Engine::Impl::ReduceGradients() {
  Status checked = CheckAllRegistered();
  if (checked.ok() && gradients_reduced_) {
    // A second fold would add the replicas' gradients into the homes again.
    checked = FailedPrecondition("ReduceGradients was already called this step; call StepEnd");
  }
  KEEL_RETURN_IF_ERROR(AgreeOnCall(CollectiveCall::kReduceGradients, -1, checked));
  const auto start = std::chrono::steady_clock::now();
  bool commit = false;
  KEEL_RETURN_IF_ERROR(ResolveMigration(commit));
  const double waited = stats_.exposed_migration_seconds;
  const std::vector<Placement>& target = commit ? pending_ : placements_;
  const size_t bytes = options_.shape.gradient_bytes;

  // Sources of expert e in the fixed order: the home slot this step used, its other copies by
  // ascending slot, then this step's transient replicas in fill order (each holds the sum of
  // every micro-batch's gradients of its expert).
  auto for_each_source = [&](int layer, int expert, const std::function<void(int)>& visit) {
    const Placement& used = placements_[layer];
    const int home_slot = used.home_slot(expert);
    visit(home_slot);
    for (int slot : used.copies(expert)) {
      if (slot != home_slot) visit(slot);
    }
    const LayerStep& step = step_[layer];
    for (size_t i = 0; i < step.transients.size(); ++i) {
      if (step.transients[i].expert == expert) visit(step.transient_slot[i]);
    }
  };
  auto needs_reduction = [&](int layer, int expert) {
    const Placement& used = placements_[layer];
    if (used.logcnt()[expert] > 1 || target[layer].home_slot(expert) != used.home_slot(expert)) {
      return true;
    }
    const std::vector<TransientReplica>& transients = step_[layer].transients;
    return std::any_of(transients.begin(), transients.end(),
                       [&](const TransientReplica& t) { return t.expert == expert; });
  };

  exchange_.Begin(num_ranks_);
  for (int l = 0; l < options_.num_layers; ++l) {
    for (int e = 0; e < placements_[l].num_experts(); ++e) {
      if (!needs_reduction(l, e)) continue;
      const int destination = target[l].home(e);
      for_each_source(l, e, [&](int slot) {
        if (RankOfPhysical(slot) == rank_ && destination != rank_) {
          exchange_.Add(destination, Buffers(l, LocalOfPhysical(slot)).gradients, bytes);
        }
      });
    }
  }

  // Sum into zeroed scratch first: a home slot's own gradient buffer may still be another
  // expert's source until every sum of the layer is done.
  struct Sum {
    int layer;
    int expert;
    int local_slot;  // the home's
  };
  std::vector<Sum> sums;
  for (int l = 0; l < options_.num_layers; ++l) {
    for (int e = 0; e < placements_[l].num_experts(); ++e) {
      if (!needs_reduction(l, e) || target[l].home(e) != rank_) continue;
      sums.push_back({l, e, target[l].home_slot(e) % slots_per_rank_});
    }
  }
  // The gradients this rank receives, in the order the sums below read them.
  for (const Sum& sum : sums) {
    for_each_source(sum.layer, sum.expert, [&](int slot) {
      const int source_rank = RankOfPhysical(slot);
      if (source_rank != rank_) exchange_.Expect(source_rank, bytes);
    });
  }
  KEEL_RETURN_IF_ERROR(exchange_.Run(communicator_, *memory_, on_device()));

  KEEL_RETURN_IF_ERROR(sum_scratch_.Reserve(*memory_, sums.size() * bytes));
  if (zeros_.size() < sums.size() * bytes) zeros_.resize(sums.size() * bytes, std::byte{0});
  KEEL_RETURN_IF_ERROR(memory_->Copy(sum_scratch_.data(), zeros_.data(), sums.size() * bytes));
  std::optional<uint64_t> last;
  Status added;
  for (size_t i = 0; i < sums.size() && added.ok(); ++i) {
    std::byte* sum = sum_scratch_.data() + i * bytes;
    for_each_source(sums[i].layer, sums[i].expert, [&](int slot) {
      const int source_rank = RankOfPhysical(slot);
      const Result<const std::byte*> data =
          source_rank == rank_
              ? Result<const std::byte*>(Gradients(sums[i].layer, LocalOfPhysical(slot)))
              : exchange_.Received(source_rank, bytes);
      if (!data.ok()) {
        if (added.ok()) added = data.status();
        return;
      }
      Result<uint64_t> add = memory_->StartAdd(options_.shape.gradient_type, sum, *data, bytes);
      if (add.ok()) {
        last = *add;
      } else if (added.ok()) {
        added = add.status();
      }
    });
  }
  KEEL_RETURN_IF_ERROR(added);
  for (size_t i = 0; i < sums.size(); ++i) {
    KEEL_ASSIGN_OR_RETURN(last, memory_->StartCopy(Gradients(sums[i].layer, sums[i].local_slot),
                                                   sum_scratch_.data() + i * bytes, bytes));
  }
  KEEL_RETURN_IF_ERROR(WaitForLast(*memory_, last));

  gradients_reduced_ = true;
  if (commit) {
    KEEL_RETURN_IF_ERROR(migrator_->Commit(pending_));
    placements_ = std::move(pending_);
    pending_.clear();
    ++stats_.epoch;
    ++stats_.epochs_committed;
    if (metrics_ != nullptr) {
      metrics_->SetEpoch(stats_.epoch);
      metrics_->RecordPlan(PlanOutcome::kApplied);
    }
  }
  stats_.control_seconds += SecondsSince(start) - (stats_.exposed_migration_seconds - waited);
  return Status::Ok();
}

// Every home's weights to every other persistent copy of its expert, in (layer, expert, slot)
// order on both sides.
Status Engine::Impl::PushWeights() {
  const size_t bytes = options_.shape.weight_bytes;
  bool any = false;
  for (const Placement& p : placements_) any |= p.max_copies() > 1;
  if (!any) return Status::Ok();
  exchange_.Begin(num_ranks_);
  std::optional<uint64_t> last;
  for (int l = 0; l < options_.num_layers; ++l) {
    const Placement& p = placements_[l];
    for (int e = 0; e < placements_[l].num_experts(); ++e) {
      if (p.logcnt()[e] < 2 || p.home(e) != rank_) continue;
      const int home_slot = p.home_slot(e);
      const std::byte* weights = Weights(l, home_slot % slots_per_rank_);
      for (int slot : p.copies(e)) {
        if (slot == home_slot) continue;
        const int rank = p.rank_of_slot(slot);
        if (rank == rank_) {
          KEEL_ASSIGN_OR_RETURN(
              last, memory_->StartCopy(Weights(l, slot % slots_per_rank_), weights, bytes));
        } else {
          exchange_.Add(rank, weights, bytes);
        }
      }
    }
  }
  // This rank's replicas that a home elsewhere updates, in the sender's (layer, expert, slot)
  // order: declared to the exchange first, then read back in the same order.
  struct Incoming {
    int layer;
    int slot;
    int home_rank;
  };
  std::vector<Incoming> incoming;
  for (int l = 0; l < options_.num_layers; ++l) {
    const Placement& p = placements_[l];
    for (int e = 0; e < p.num_experts(); ++e) {
      if (p.logcnt()[e] < 2 || p.home(e) == rank_) continue;
      const int home_slot = p.home_slot(e);
      for (int slot : p.copies(e)) {
        if (slot != home_slot && p.rank_of_slot(slot) == rank_)
          incoming.push_back({l, slot, p.home(e)});
      }
    }
  }
  for (const Incoming& replica : incoming) exchange_.Expect(replica.home_rank, bytes);
  KEEL_RETURN_IF_ERROR(exchange_.Run(communicator_, *memory_, on_device()));
  for (const Incoming& replica : incoming) {
    KEEL_ASSIGN_OR_RETURN(const std::byte* weights, exchange_.Received(replica.home_rank, bytes));
    KEEL_ASSIGN_OR_RETURN(
        last,
        memory_->StartCopy(Weights(replica.layer, replica.slot % slots_per_rank_), weights, bytes));
  }
  return WaitForLast(*memory_, last);
}

}  // namespace keel
