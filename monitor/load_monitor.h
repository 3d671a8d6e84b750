// The load monitor: the trainer's hot path hands it per-layer routing counts without locks or
// allocation; a monitor thread drains them per step into the load estimators, the Prometheus
// metrics and the trace recorder. When the monitor falls behind it drops batches and counts
// them; it never makes the trainer wait.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <thread>
#include <vector>

#include "common/config.h"
#include "keel/status.hpp"
#include "monitor/metrics.h"
#include "monitor/trace_recorder.h"
#include "placement/load.h"
#include "placement/placement.h"

namespace keel {

struct LoadMonitorOptions {
  int num_layers = 1;
  int num_experts = 1;
  int num_ranks = 1;      // ranks of the layer's placement (and sources of the traffic matrix)
  int rank = 0;           // this process's rank: the source row of RecordTopK and of [E] counts
  MonitorConfig monitor;  // queue_capacity, per_source_rank, trace_path, sample interval
  EstimatorConfig estimator;
  // Copies an expert may have, for the lower bound's r_max; 0 = num_ranks.
  int max_copies_per_expert = 0;
  std::string trace_description = "keel load monitor";

  static LoadMonitorOptions FromConfig(const KeelConfig& config, int num_layers, int num_experts,
                                       int rank);
};

// What RecordCounts / RecordTopK did with a batch.
enum class RecordOutcome {
  kQueued,
  kDropped,  // the queue was full; counted in dropped_samples()
  kInvalid,  // layer out of range or counts of the wrong size; nothing was queued
};

// Producers: RecordCounts and RecordTopK may be called from any number of threads at once
// (multi-producer); each call claims one preallocated batch with one compare-and-swap, so it
// never blocks, locks or allocates. StepEnd must be called by one thread at a time, after every
// Record call of that step has returned (the engine's step boundary). Everything else is for
// the control plane (planner, tests) and may lock.
class LoadMonitor {
 public:
  // Preallocates monitor.queue_capacity batches of one traffic row each ([num_experts], or
  // [num_ranks * num_experts] with monitor.per_source_rank), opens the trace recorder when
  // monitor.trace_path is set, and starts the monitor thread. `metrics` may be null; it must
  // outlive the monitor.
  static Result<std::unique_ptr<LoadMonitor>> Create(const LoadMonitorOptions& options,
                                                     Metrics* metrics = nullptr);
  // Processes everything already queued, ends the step in progress when StepEnd was called for
  // it, stops the thread and closes the trace.
  ~LoadMonitor();
  LoadMonitor(const LoadMonitor&) = delete;
  LoadMonitor& operator=(const LoadMonitor&) = delete;

  // --- hot path -------------------------------------------------------------------------------

  // counts: [num_experts] int32 tokens this rank routed to each expert of `layer` (source row
  // options.rank), or with monitor.per_source_rank also [num_ranks * num_experts] int32, the
  // layer's traffic matrix (source-major). Negative counts are rejected by the monitor thread
  // and counted in invalid_samples().
  RecordOutcome RecordCounts(int layer, std::span<const int32_t> counts);
  // expert_ids: [num_tokens * top_k] int32 router output; counted on the caller's thread
  // straight into the claimed batch. Ids outside [0, num_experts) (e.g. -1 for dropped tokens)
  // are skipped.
  RecordOutcome RecordTopK(int layer, std::span<const int32_t> expert_ids);
  // The step `step` (the trainer's step number) is complete: the monitor thread publishes it.
  void StepEnd(int64_t step);

  // --- control plane --------------------------------------------------------------------------

  // The placement whose ranks compute each expert of `layer`; rank loads follow it (tokens split
  // evenly among copies). Until set, experts are contiguous over ranks (the static placement).
  Status SetPlacement(int layer, const Placement& placement);

  // Blocks until every batch and StepEnd issued before the call has been processed. Returns
  // false at once while paused (nothing would make progress).
  bool Flush();
  // Holds the monitor thread (producers keep going and drop once the queue is full); for tests
  // and for diagnosing a slow consumer.
  void Pause();
  void Resume();

  uint64_t dropped_samples() const { return dropped_.load(std::memory_order_relaxed); }
  uint64_t invalid_samples() const { return invalid_.load(std::memory_order_relaxed); }
  int64_t steps_seen() const;
  // [num_experts] tokens per expert of `layer` summed over every processed step.
  std::vector<int64_t> ExpertTotals(int layer) const;
  // [num_experts] the estimator's expected tokens per expert of `layer` for the next step.
  std::vector<double> ExpertLoadEstimate(int layer) const;
  // [num_ranks * num_experts] expected traffic matrix; empty without monitor.per_source_rank.
  std::vector<double> TrafficEstimate(int layer) const;
  // The trace recorder's first error, if writing failed (recording then stops).
  Status trace_status() const;

 private:
  // One preallocated routing batch; `sequence` runs the bounded MPMC queue protocol (a cell is
  // free for position p when sequence == p, and holds data for the consumer at p + 1).
  struct Batch {
    std::atomic<uint64_t> sequence{0};
    uint64_t position = 0;  // queue position it was claimed for
    int layer = 0;
    uint64_t step_index = 0;  // StepEnd calls before it was recorded
    int offset = 0;           // first entry of the traffic row it fills
    int length = 0;
    std::vector<int32_t> counts;  // [row_size] preallocated
  };

  LoadMonitor(const LoadMonitorOptions& options, Metrics* metrics);
  Status Init();
  Batch* Claim(int layer);
  void Publish(Batch* batch);
  void Run();
  // Consumes every published batch, ending steps as batches of later steps show up. Called with
  // state_mutex_ held, as are the two below.
  void Drain();
  void Consume(const Batch& batch);
  void FinishStep();
  // Placement of `layer` in force: the one set, else the contiguous default.
  const Placement& PlacementOf(int layer) const;

  LoadMonitorOptions options_;
  Metrics* metrics_;
  int row_size_;
  std::vector<Batch> ring_;
  uint64_t mask_ = 0;
  alignas(64) std::atomic<uint64_t> enqueue_position_{0};
  alignas(64) std::atomic<uint64_t> dequeue_position_{0};  // written by the monitor thread only
  alignas(64) std::atomic<uint64_t> step_ends_{0};
  std::atomic<uint64_t> dropped_{0};
  std::atomic<uint64_t> invalid_{0};
  // StepEnd's step numbers, by step index modulo the size (the monitor is rarely more behind).
  std::vector<std::atomic<int64_t>> step_ids_;

  // Monitor-thread state; the mutex guards what the control plane reads.
  mutable std::mutex state_mutex_;
  uint64_t current_step_index_ = 0;  // the step being accumulated
  bool step_has_data_ = false;
  std::vector<int64_t> step_counts_;   // [num_layers * row_size] this step
  std::vector<int64_t> total_counts_;  // [num_layers * num_experts] since start
  std::vector<LoadEstimator> expert_estimators_;
  std::vector<LoadEstimator> traffic_estimators_;
  std::vector<std::optional<Placement>> placements_;
  std::vector<Placement> default_placements_;
  std::vector<bool> layer_has_data_;  // [num_layers] this step
  std::vector<double> trace_row_;     // [num_layers * row_size] scratch for the recorder
  uint64_t reported_dropped_ = 0;
  int64_t steps_seen_ = 0;
  std::unique_ptr<TraceRecorder> recorder_;
  Status trace_status_;

  // Guards stopping_ and paused_; wake_ rouses the thread early (StepEnd, Flush, shutdown).
  std::mutex wake_mutex_;
  std::condition_variable wake_;
  bool stopping_ = false;
  bool paused_ = false;
  std::atomic<bool> flush_requested_{false};
  std::condition_variable progress_;  // with state_mutex_: signalled after each drain round
  std::thread thread_;
};

}  // namespace keel
