// Migrator: turns plan transfers into exchange items over live (source) and staged
// (destination) slot buffers, and runs the exchange on a background thread.
#include "migration/migrator.h"

#include <string>
#include <utility>

namespace keel {

Result<std::unique_ptr<Migrator>> Migrator::Create(Transport& transport, ExpertStore& store,
                                                   const MigrationConfig& config,
                                                   MigrationObserver* observer) {
  KEEL_ASSIGN_OR_RETURN(ExchangeOptions options, ExchangeOptions::FromConfig(config));
  if (store.rank() != transport.rank()) {
    return InvalidArgument("expert store of rank " + std::to_string(store.rank()) +
                           " given to the transport of rank " + std::to_string(transport.rank()));
  }
  return std::unique_ptr<Migrator>(new Migrator(transport, store, options, observer));
}

Migrator::~Migrator() {
  cancel_.store(true, std::memory_order_relaxed);
  if (worker_.joinable()) worker_.join();
  if (running_ || ready_) store_.Discard();
}

Status Migrator::BuildItems(const TransferPlan& plan, std::vector<ExchangeItem>& items) {
  const ExpertLayout& layout = store_.layout();
  if (layout.weight_bytes != plan.layout.weight_bytes ||
      layout.optimizer_bytes != plan.layout.optimizer_bytes) {
    return InvalidArgument("plan layout (" + std::to_string(plan.layout.weight_bytes) + " + " +
                           std::to_string(plan.layout.optimizer_bytes) +
                           " bytes) differs from the expert store's (" +
                           std::to_string(layout.weight_bytes) + " + " +
                           std::to_string(layout.optimizer_bytes) + " bytes)");
  }
  const int num_slots = store_.slots_per_rank() * transport_.num_ranks();
  items.reserve(plan.transfers.size());
  for (const Transfer& t : plan.transfers) {
    if (t.layer < 0 || t.layer >= store_.num_layers() || t.src_slot < 0 ||
        t.src_slot >= num_slots || t.dst_slot < 0 || t.dst_slot >= num_slots ||
        plan.slots_per_rank != store_.slots_per_rank()) {
      return InvalidArgument("transfer " + DescribeTransfer(t) +
                             " does not fit the expert store (" +
                             std::to_string(store_.num_layers()) + " layers, " +
                             std::to_string(store_.slots_per_rank()) + " slots per rank)");
    }
    ExchangeItem item;
    item.src_rank = t.src_rank;
    item.dst_rank = t.dst_rank;
    item.label = "transfer " + DescribeTransfer(t);
    const bool mine_src = t.src_rank == store_.rank();
    const bool mine_dst = t.dst_rank == store_.rank();
    auto add = [&](SlotRegion region, size_t bytes) {
      const int r = item.num_regions++;
      item.region_bytes[r] = bytes;
      if (mine_src) {
        std::span<const std::byte> live = std::as_const(store_).Live(t.layer, t.src_slot, region);
        if (live.size() != bytes) return false;
        item.source[r] = live.data();
      }
      if (mine_dst) item.destination[r] = store_.Stage(t.layer, t.dst_slot, region).data();
      return true;
    };
    bool ok = true;
    if (CarriesWeights(t.payload)) ok &= add(SlotRegion::kWeights, layout.weight_bytes);
    if (CarriesOptimizer(t.payload)) ok &= add(SlotRegion::kOptimizer, layout.optimizer_bytes);
    if (!ok) {
      return FailedPrecondition(
          "transfer " + DescribeTransfer(t) + ": source slot " + std::to_string(t.src_slot) +
          " on rank " + std::to_string(t.src_rank) + " holds no " +
          std::string(PayloadName(t.payload)) + " (is the plan for this store's placement?)");
    }
    items.push_back(std::move(item));
  }
  return Status::Ok();
}

Status Migrator::Start(uint64_t epoch, std::shared_ptr<const TransferPlan> plan,
                       std::vector<bool> participants) {
  if (running_ || ready_) {
    return FailedPrecondition("migration epoch " + std::to_string(epoch) +
                              " cannot start: the previous epoch was not " +
                              (running_ ? "collected by Wait" : "committed"));
  }
  if (plan == nullptr)
    return InvalidArgument("migration epoch " + std::to_string(epoch) + ": no plan");
  if (worker_.joinable()) worker_.join();
  std::vector<ExchangeItem> items;
  Status built = BuildItems(*plan, items);
  if (!built.ok()) {
    store_.Discard();
    return built.WithContext("migration epoch " + std::to_string(epoch));
  }
  plan_ = std::move(plan);
  items_ = std::move(items);
  done_.store(false, std::memory_order_relaxed);
  cancel_.store(false, std::memory_order_relaxed);
  running_ = true;
  if (observer_ != nullptr) {
    observer_->OnEpochStarted(epoch, static_cast<int>(items_.size()), plan_->total_bytes());
  }
  worker_ = std::thread([this, epoch, participants = std::move(participants)]() mutable {
    Run(epoch, std::move(participants));
  });
  return Status::Ok();
}

void Migrator::Run(uint64_t epoch, std::vector<bool> participants) {
  MigrationReport report;
  ExchangeRun run{.channel = ExchangeChannel::kExperts,
                  .epoch = epoch,
                  .what = "migration epoch " + std::to_string(epoch),
                  .cancel = &cancel_,
                  .participants = std::move(participants)};
  // Exceptions must not leave this thread: an allocation failure becomes the epoch's error.
  try {
    result_ = RunExchange(transport_, items_, options_, run, observer_, &report);
  } catch (const std::exception& e) {
    result_ = Internal(run.what + " aborted: " + e.what());
    report.status = result_;
  }
  if (observer_ != nullptr) observer_->OnEpochFinished(report);
  {
    std::lock_guard<std::mutex> lock(report_mutex_);
    report_ = report;
  }
  done_.store(true, std::memory_order_release);
}

Status Migrator::Wait() {
  if (!running_) return FailedPrecondition("no migration epoch is running");
  if (worker_.joinable()) worker_.join();
  running_ = false;
  items_.clear();
  if (!result_.ok()) {
    store_.Discard();
    return result_;
  }
  ready_ = true;
  return Status::Ok();
}

Status Migrator::Commit(std::span<const Placement> placements) {
  if (!ready_) return FailedPrecondition("no verified migration epoch to commit");
  KEEL_RETURN_IF_ERROR(store_.Commit(placements));
  ready_ = false;
  plan_.reset();
  return Status::Ok();
}

void Migrator::Discard() {
  if (!ready_) return;
  store_.Discard();
  ready_ = false;
  plan_.reset();
}

MigrationReport Migrator::last_report() const {
  std::lock_guard<std::mutex> lock(report_mutex_);
  return report_;
}

}  // namespace keel
