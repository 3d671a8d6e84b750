// The background migrator: executes this rank's part of a TransferPlan while training runs —
// chunked, pipelined, optionally bandwidth-capped, with a deadline — verifies every moved
// region by checksum, and reports the epoch ready only when every rank verified its transfers.
// On any failure the epoch aborts: staged buffers are discarded, the live slots (old placement,
// every home) stay untouched, and the error names the transfer that failed and why.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <thread>
#include <vector>

#include "common/config.h"
#include "keel/status.hpp"
#include "keel/transport.hpp"
#include "migration/exchange.h"
#include "migration/expert_store.h"
#include "migration/observer.h"
#include "migration/transfer_plan.h"

namespace keel {

class Migrator {
 public:
  // `transport` and `store` belong to this rank and must outlive the migrator; `observer` may be
  // null. Fails when a migration config value is out of range.
  static Result<std::unique_ptr<Migrator>> Create(Transport& transport, ExpertStore& store,
                                                  const MigrationConfig& config,
                                                  MigrationObserver* observer = nullptr);
  // Cancels a running epoch and waits for it (bounded by the deadline).
  ~Migrator();
  Migrator(const Migrator&) = delete;
  Migrator& operator=(const Migrator&) = delete;

  // Starts this rank's part of `plan` for `epoch` in the background. Every rank starts the same
  // plan with the same epoch. Fails when an epoch is still running or has not been collected by
  // Wait, or when the plan does not fit the store. `participants` ([num_ranks], empty = all)
  // names the ranks that take part, so survivors of a failed rank can go on without it.
  Status Start(uint64_t epoch, std::shared_ptr<const TransferPlan> plan,
               std::vector<bool> participants = {});

  // True once the running epoch is ready or aborted (Wait then returns at once).
  bool done() const { return done_.load(std::memory_order_acquire); }

  // Waits for the epoch. OK: every rank verified its transfers; the staged state waits for
  // Commit. Error: the epoch aborted and its staged state is already discarded.
  Status Wait();

  // Makes the staged state live after a successful Wait. `placements` is the new placement (one
  // per layer); slots that stop being home slots release their optimizer state.
  Status Commit(std::span<const Placement> placements);

  // Drops a verified epoch instead of committing it (the live state stays as it is).
  void Discard();

  // Cancels the running epoch (it aborts with "cancelled by the caller").
  void Cancel() { cancel_.store(true, std::memory_order_relaxed); }

  // The last finished epoch's report (bytes, duration, outcome).
  MigrationReport last_report() const;

 private:
  Migrator(Transport& transport, ExpertStore& store, ExchangeOptions options,
           MigrationObserver* observer)
      : transport_(transport), store_(store), options_(options), observer_(observer) {}
  Status BuildItems(const TransferPlan& plan, std::vector<ExchangeItem>& items);
  void Run(uint64_t epoch, std::vector<bool> participants);

  Transport& transport_;
  ExpertStore& store_;
  ExchangeOptions options_;
  MigrationObserver* observer_;

  std::shared_ptr<const TransferPlan> plan_;
  std::vector<ExchangeItem> items_;
  std::thread worker_;
  std::atomic<bool> done_{false};
  std::atomic<bool> cancel_{false};
  bool running_ = false;  // started and not collected by Wait
  bool ready_ = false;    // collected OK, not committed yet
  Status result_;         // written by the worker before done_ is set
  mutable std::mutex report_mutex_;
  MigrationReport report_;
};

}  // namespace keel
