// Engine::Impl's epochs: StepEnd records the step's traffic, runs the planner thread every
// policy.replan_interval_steps, turns a plan every rank finished into background transfers, and
// ResolveMigration lets every rank agree at ReduceGradients whether the epoch commits.
#include "engine/engine_impl.h"

#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>

#include "common/log.h"
#include "common/parallel.h"
#include "migration/transfer_plan.h"

namespace keel {

// Waits for the running epoch and lets every rank agree whether it commits.
Status Engine::Impl::ResolveMigration(bool& commit) {
  commit = false;
  if (!migrating_) return Status::Ok();
  const auto start = std::chrono::steady_clock::now();
  Status status = migrator_->Wait();
  stats_.exposed_migration_seconds += SecondsSince(start);
  migrating_ = false;
  const MigrationReport report = migrator_->last_report();
  // One sum agrees on both: how many ranks failed their transfers, and the bytes moved.
  std::vector<int64_t> outcome = {
      status.ok() ? 0 : 1, static_cast<int64_t>(report.bytes_sent + report.bytes_copied_locally)};
  KEEL_RETURN_IF_ERROR(communicator_.AllReduce(outcome, ReduceOp::kSum));
  const int64_t moved = outcome[1];
  stats_.bytes_moved += static_cast<uint64_t>(moved);
  if (outcome[0] == 0) {
    commit = true;
  } else {
    if (status.ok()) {
      migrator_->Discard();
      status = Aborted("epoch " + std::to_string(stats_.epoch + 1) +
                       " aborted: another rank failed its transfers");
    }
    ++stats_.epochs_aborted;
    stats_.last_abort = status;
    pending_.clear();
    if (aggregating()) {
      KEEL_LOG_WARN("%s; training goes on with epoch %lld", status.message().c_str(),
                    static_cast<long long>(stats_.epoch));
    }
  }
  if (metrics_ != nullptr) {
    metrics_->RecordMigration(commit ? MigrationOutcome::kOk : MigrationOutcome::kAborted,
                              transport_->name(), static_cast<double>(moved), report.seconds,
                              SecondsSince(start));
    metrics_->SetMigrationsInFlight(0);
  }
  return Status::Ok();
}

Status Engine::Impl::RecordStep() {
  const size_t row = static_cast<size_t>(num_ranks_) * options_.num_experts;
  // A step's traffic is the sum of its micro-batches'.
  for (int l = 0; l < options_.num_layers; ++l) {
    if (step_[l].routes > 0) estimators_[l].Observe(step_[l].traffic);
  }
  if (recorder_ != nullptr) {
    std::vector<double> step(row * options_.num_layers, 0.0);
    for (int l = 0; l < options_.num_layers; ++l) {
      const LayerStep& layer = step_[l];
      if (layer.routes > 0)
        std::copy(layer.traffic.begin(), layer.traffic.end(), step.begin() + l * row);
    }
    KEEL_RETURN_IF_ERROR(recorder_->RecordStep(stats_.steps, step));
  }
  if (metrics_ != nullptr) metrics_->EndStep();
  return Status::Ok();
}

void Engine::Impl::StartPlanner() {
  // The planner sees copies: the placements in force do not change while it runs (no epoch is
  // in flight), but the copies keep it independent of the caller's thread anyway.
  struct Snapshot {
    std::vector<Placement> current;
    std::vector<std::vector<double>> traffic;
  };
  auto snapshot = std::make_shared<Snapshot>();
  snapshot->current = placements_;
  // By unit: every unit of an expert sees all of its rows.
  for (int l = 0; l < options_.num_layers; ++l) {
    snapshot->traffic.push_back(shards_[l].UnitTraffic(estimators_[l].Estimate()));
  }
  planning_ = true;
  planner_started_ = std::chrono::steady_clock::now();
  planner_started_step_ = stats_.steps;
  planner_done_.store(false, std::memory_order_relaxed);
  planner_ = std::thread([this, snapshot] {
    const auto start = std::chrono::steady_clock::now();
    const int num_layers = options_.num_layers;
    std::vector<std::optional<Placement>> planned(num_layers);
    std::vector<Status> failed(num_layers);
    // Layers replan in parallel (oneTBB), each with its own policy; the result does not depend
    // on the order, so every rank plans the same.
    ParallelFor(0, num_layers, [&](int l) {
      Result<StepLoad> traffic =
          StepLoad::FromTraffic(num_ranks_, shards_[l].num_units(), snapshot->traffic[l]);
      if (!traffic.ok()) {
        failed[l] = traffic.status();
        return;
      }
      const std::vector<double> expert_load = traffic->ExpertTotals();
      LayerView view;
      view.layer = l;
      view.current = &snapshot->current[l];
      view.expert_load = expert_load;
      view.traffic = &*traffic;
      Result<Placement> next = policies_[l]->Replan(view);
      if (next.ok()) {
        planned[l] = std::move(next).value();
      } else {
        failed[l] = next.status();
      }
    });
    // The lowest failed layer names the error, as a loop over the layers would.
    Status status;
    for (const Status& layer_status : failed) {
      if (!layer_status.ok()) {
        status = layer_status;
        break;
      }
    }
    std::vector<Placement> placements;
    if (status.ok()) {
      for (std::optional<Placement>& placement : planned) {
        placements.push_back(std::move(*placement));
      }
    }
    planned_ = std::move(placements);
    planner_status_ = status;
    planner_seconds_ = SecondsSince(start);
    planner_done_.store(true, std::memory_order_release);
  });
}

Status Engine::Impl::StartMigration(std::vector<Placement> planned) {
  const ExpertLayout layout{options_.shape.weight_bytes, options_.shape.optimizer_bytes};
  KEEL_ASSIGN_OR_RETURN(TransferPlan plan,
                        PlanTransfers(placements_, planned, context_->topology, layout));
  if (store_ == nullptr) {
    std::vector<std::span<std::byte>> weights;
    std::vector<std::span<std::byte>> optimizer;
    for (int l = 0; l < options_.num_layers; ++l) {
      for (int i = 0; i < slots_per_rank_; ++i) {
        const SlotBuffers& b = Buffers(l, i);
        weights.emplace_back(static_cast<std::byte*>(b.weights), layout.weight_bytes);
        optimizer.emplace_back(static_cast<std::byte*>(b.optimizer), layout.optimizer_bytes);
      }
    }
    KEEL_ASSIGN_OR_RETURN(
        ExpertStore store,
        ExpertStore::Wrap(rank_, options_.num_layers, slots_per_rank_, layout, std::move(weights),
                          std::move(optimizer), transport_->device_memory()));
    store_ = std::make_unique<ExpertStore>(std::move(store));
    KEEL_ASSIGN_OR_RETURN(migrator_, Migrator::Create(*transport_, *store_, config_.migration));
  }
  KEEL_RETURN_IF_ERROR(migrator_->Start(static_cast<uint64_t>(stats_.epoch + 1),
                                        std::make_shared<const TransferPlan>(std::move(plan))));
  pending_ = std::move(planned);
  migrating_ = true;
  if (metrics_ != nullptr) {
    metrics_->RecordPlan(PlanOutcome::kMade);
    metrics_->SetMigrationsInFlight(1);
  }
  return Status::Ok();
}

// Adopts the planner's result once every rank has it; starts the next run on replan steps.
Status Engine::Impl::AdvancePlanner() {
  if (planning_) {
    if (config_.policy.plan_adoption == "next_step") AwaitPlanner();
    // One minimum over the ranks says whether every rank's planner is done and, negated, how
    // long the slowest has run, so every rank takes the same decision.
    std::vector<int64_t> state = {planner_done_.load(std::memory_order_acquire) ? 1 : 0,
                                  -PlannerMilliseconds()};
    KEEL_RETURN_IF_ERROR(communicator_.AllReduce(state, ReduceOp::kMin));
    if (state[0] == 0) return CheckPlannerWatchdog(static_cast<double>(-state[1]) / 1e3);
    planner_.join();
    planning_ = false;
    if (metrics_ != nullptr) metrics_->RecordPlannerRun(planner_seconds_);
    if (planner_overdue_) {
      planner_overdue_ = false;
      if (aggregating()) {
        KEEL_LOG_WARN(
            "planner watchdog: the late replan of step %lld ended after %.1f s; its plan "
            "is dropped, epoch %lld stays",
            static_cast<long long>(planner_started_step_), planner_seconds_,
            static_cast<long long>(stats_.epoch));
      }
      return Status::Ok();
    }
    // The planner is deterministic: every rank reaches the same verdict. A failed plan keeps
    // the placement in force; training goes on.
    if (!planner_status_.ok()) {
      ++stats_.plans_failed;
      stats_.last_plan_error = planner_status_;
      if (metrics_ != nullptr) metrics_->RecordPlan(PlanOutcome::kRejected, "planner error");
      if (aggregating()) {
        KEEL_LOG_WARN("planner failed, keeping epoch %lld: %s",
                      static_cast<long long>(stats_.epoch), planner_status_.ToString().c_str());
      }
      return Status::Ok();
    }
    if (planned_ == placements_) {
      ++stats_.plans_unchanged;
      if (metrics_ != nullptr) metrics_->RecordPlan(PlanOutcome::kSkipped, "no change");
      return Status::Ok();
    }
    return StartMigration(std::move(planned_));
  }
  const int interval = config_.policy.replan_interval_steps;
  if (!migrating_ && config_.policy.name != "static" && stats_.steps % interval == 0) {
    KEEL_RETURN_IF_ERROR(ReshardExperts());
    StartPlanner();
  }
  return Status::Ok();
}

// policy.plan_adoption next_step: waits for this rank's planner, but not past the watchdog's
// limit (in the whole milliseconds the ranks compare), so that the watchdog below reports it at
// this step.
void Engine::Impl::AwaitPlanner() {
  const double limit = config_.policy.planner_watchdog_seconds;
  while (!planner_done_.load(std::memory_order_acquire) &&
         static_cast<double>(PlannerMilliseconds()) / 1e3 <= limit) {
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
}

int64_t Engine::Impl::PlannerMilliseconds() const {
  return static_cast<int64_t>(SecondsSince(planner_started_) * 1e3);
}

// The planner's watchdog: a replan that every rank has not finished after
// policy.planner_watchdog_seconds (on the slowest rank) is an error on every rank, once per run,
// with a log line and keel_watchdog_trips_total{what="planner"}. Training goes on with the
// placement in force; the run's plan is dropped when it ends.
Status Engine::Impl::CheckPlannerWatchdog(double slowest_seconds) {
  const double limit = config_.policy.planner_watchdog_seconds;
  if (planner_overdue_ || slowest_seconds <= limit) return Status::Ok();
  planner_overdue_ = true;
  ++stats_.watchdog_trips;
  if (metrics_ != nullptr) metrics_->RecordWatchdogTrip("planner");
  char message[256];
  std::snprintf(message, sizeof(message),
                "planner watchdog: the replan started at step %lld has run %.1f s, more than "
                "policy.planner_watchdog_seconds (%g); epoch %lld stays in force and the late "
                "plan will be dropped",
                static_cast<long long>(planner_started_step_), slowest_seconds, limit,
                static_cast<long long>(stats_.epoch));
  if (aggregating()) KEEL_LOG_ERROR("%s", message);
  return DeadlineExceeded(message);
}

Status Engine::Impl::StepEnd() {
  KEEL_RETURN_IF_ERROR(AgreeOnCall(CollectiveCall::kStepEnd, -1, CheckAllRegistered()));
  const auto start = std::chrono::steady_clock::now();
  KEEL_RETURN_IF_ERROR(PushWeights());
  KEEL_RETURN_IF_ERROR(RecordStep());
  ++stats_.steps;
  Status planned = AdvancePlanner();
  // The next step starts with no micro-batch routed and every transient slot free.
  for (LayerStep& layer : step_) {
    layer.routes = 0;
    std::fill(layer.traffic.begin(), layer.traffic.end(), 0.0);
    layer.transients.clear();
    layer.transient_slot.clear();
  }
  gradients_reduced_ = false;
  stats_.control_seconds += SecondsSince(start);
  return planned;
}

}  // namespace keel
