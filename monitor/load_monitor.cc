// The load monitor. The queue is a bounded multi-producer single-consumer ring of preallocated
// batches using per-cell sequence numbers (the classic array-based bounded queue): a producer
// claims a cell with one compare-and-swap on the enqueue position, fills the cell's own buffer
// and publishes it by advancing the cell's sequence; the monitor thread consumes cells in
// position order. A full ring makes the producer drop, never wait.
#include "monitor/load_monitor.h"

#include <algorithm>
#include <chrono>
#include <cstring>

#include "placement/routing.h"

namespace keel {
namespace {

// How long the monitor thread sleeps when nobody wakes it: short enough that a long step's
// batches do not pile up in the ring, long enough to cost nothing measurable.
constexpr auto kPollInterval = std::chrono::milliseconds(2);

// Step numbers kept for steps ended but not yet processed.
constexpr size_t kStepIdSlots = 1024;

}  // namespace

LoadMonitorOptions LoadMonitorOptions::FromConfig(const KeelConfig& config, int num_layers,
                                                  int num_experts, int rank) {
  LoadMonitorOptions options;
  options.num_layers = num_layers;
  options.num_experts = num_experts;
  options.num_ranks = config.num_ranks();
  options.rank = rank;
  options.monitor = config.monitor;
  options.estimator = config.estimator;
  const int total_slots = config.num_ranks() * config.slots.persistent_per_rank;
  options.max_copies_per_expert =
      std::max(1, std::min(config.num_ranks(), total_slots - num_experts + 1));
  return options;
}

Result<std::unique_ptr<LoadMonitor>> LoadMonitor::Create(const LoadMonitorOptions& options,
                                                         Metrics* metrics) {
  if (options.num_layers < 1 || options.num_experts < 1 || options.num_ranks < 1) {
    return InvalidArgument("load monitor needs positive sizes, got " +
                           std::to_string(options.num_layers) + " layers, " +
                           std::to_string(options.num_experts) + " experts, " +
                           std::to_string(options.num_ranks) + " ranks");
  }
  if (options.rank < 0 || options.rank >= options.num_ranks) {
    return InvalidArgument("load monitor rank " + std::to_string(options.rank) + " is not in 0.." +
                           std::to_string(options.num_ranks - 1));
  }
  if (options.monitor.queue_capacity < 1) {
    return InvalidArgument("monitor.queue_capacity " +
                           std::to_string(options.monitor.queue_capacity) + " must be >= 1");
  }
  // The counts it preallocates: the queue's batches of one traffic row each, and every layer's
  // step rows and estimates.
  const int64_t sources = options.monitor.per_source_rank ? options.num_ranks : 1;
  const int64_t row = sources * options.num_experts;
  if (options.monitor.queue_capacity * row > kMaxCounts) {
    return InvalidArgument(
        "monitor.queue_capacity " + std::to_string(options.monitor.queue_capacity) + " x " +
        std::to_string(row) + " counts per batch is more than the 2^26 " + "counts a job holds");
  }
  KEEL_RETURN_IF_ERROR(CheckEstimatorCounts(options.estimator, options.num_layers, sources,
                                            options.num_experts, options.estimator.window_steps));
  if (metrics != nullptr && (metrics->layout().num_layers != options.num_layers ||
                             metrics->layout().num_ranks != options.num_ranks ||
                             metrics->layout().num_experts != options.num_experts)) {
    return InvalidArgument("load monitor and metrics disagree on layers, ranks or experts");
  }
  std::unique_ptr<LoadMonitor> monitor(new LoadMonitor(options, metrics));
  KEEL_RETURN_IF_ERROR(monitor->Init());
  monitor->thread_ = std::thread([raw = monitor.get()] { raw->Run(); });
  return monitor;
}

LoadMonitor::LoadMonitor(const LoadMonitorOptions& options, Metrics* metrics)
    : options_(options),
      metrics_(metrics),
      row_size_(options.monitor.per_source_rank ? options.num_ranks * options.num_experts
                                                : options.num_experts),
      ring_(static_cast<size_t>(options.monitor.queue_capacity)),
      step_ids_(kStepIdSlots) {}

Status LoadMonitor::Init() {
  for (size_t i = 0; i < ring_.size(); ++i) {
    ring_[i].sequence.store(i, std::memory_order_relaxed);
    ring_[i].counts.assign(static_cast<size_t>(row_size_), 0);
  }
  const size_t layers = static_cast<size_t>(options_.num_layers);
  step_counts_.assign(layers * row_size_, 0);
  total_counts_.assign(layers * options_.num_experts, 0);
  layer_has_data_.assign(layers, false);
  trace_row_.assign(layers * row_size_, 0.0);
  placements_.resize(layers);
  const int slots_per_rank = (options_.num_experts + options_.num_ranks - 1) / options_.num_ranks;
  KEEL_ASSIGN_OR_RETURN(
      Placement contiguous,
      Placement::Contiguous(options_.num_experts, options_.num_ranks, slots_per_rank));
  default_placements_.assign(layers, contiguous);
  for (size_t layer = 0; layer < layers; ++layer) {
    expert_estimators_.emplace_back(options_.estimator, options_.num_experts);
    if (options_.monitor.per_source_rank) {
      traffic_estimators_.emplace_back(options_.estimator, row_size_);
    }
  }
  if (!options_.monitor.trace_path.empty()) {
    TraceRecorderOptions trace;
    trace.path = options_.monitor.trace_path;
    trace.description = options_.trace_description;
    trace.num_layers = options_.num_layers;
    trace.num_experts = options_.num_experts;
    trace.num_sources = options_.monitor.per_source_rank ? options_.num_ranks : 0;
    trace.sample_interval_steps = options_.monitor.trace_sample_interval_steps;
    KEEL_ASSIGN_OR_RETURN(recorder_, TraceRecorder::Open(trace));
  }
  return Status::Ok();
}

LoadMonitor::~LoadMonitor() {
  {
    std::lock_guard<std::mutex> lock(wake_mutex_);
    stopping_ = true;
  }
  wake_.notify_one();
  if (thread_.joinable()) thread_.join();
}

// --- hot path ---------------------------------------------------------------------------------

LoadMonitor::Batch* LoadMonitor::Claim(int layer) {
  const uint64_t size = ring_.size();
  uint64_t position = enqueue_position_.load(std::memory_order_relaxed);
  for (;;) {
    Batch& batch = ring_[position % size];
    const uint64_t sequence = batch.sequence.load(std::memory_order_acquire);
    const int64_t lag = static_cast<int64_t>(sequence - position);
    if (lag == 0) {
      // Another producer may take the same position first; then retry at the new one.
      if (enqueue_position_.compare_exchange_weak(position, position + 1,
                                                  std::memory_order_relaxed)) {
        batch.position = position;
        batch.layer = layer;
        batch.step_index = step_ends_.load(std::memory_order_acquire);
        return &batch;
      }
    } else if (lag < 0) {
      // The cell still holds a batch from one lap ago: the ring is full.
      dropped_.fetch_add(1, std::memory_order_relaxed);
      return nullptr;
    } else {
      position = enqueue_position_.load(std::memory_order_relaxed);
    }
  }
}

void LoadMonitor::Publish(Batch* batch) {
  batch->sequence.store(batch->position + 1, std::memory_order_release);
}

RecordOutcome LoadMonitor::RecordCounts(int layer, std::span<const int32_t> counts) {
  const size_t experts = static_cast<size_t>(options_.num_experts);
  const bool traffic = options_.monitor.per_source_rank && counts.size() == size_t(row_size_) &&
                       row_size_ != options_.num_experts;
  if (layer < 0 || layer >= options_.num_layers || (counts.size() != experts && !traffic)) {
    return RecordOutcome::kInvalid;
  }
  Batch* batch = Claim(layer);
  if (batch == nullptr) return RecordOutcome::kDropped;
  batch->offset =
      traffic || !options_.monitor.per_source_rank ? 0 : options_.rank * options_.num_experts;
  batch->length = static_cast<int>(counts.size());
  std::memcpy(batch->counts.data() + batch->offset, counts.data(), counts.size_bytes());
  Publish(batch);
  return RecordOutcome::kQueued;
}

RecordOutcome LoadMonitor::RecordTopK(int layer, std::span<const int32_t> expert_ids) {
  if (layer < 0 || layer >= options_.num_layers) return RecordOutcome::kInvalid;
  Batch* batch = Claim(layer);
  if (batch == nullptr) return RecordOutcome::kDropped;
  const uint32_t experts = static_cast<uint32_t>(options_.num_experts);
  batch->offset = options_.monitor.per_source_rank ? options_.rank * options_.num_experts : 0;
  batch->length = options_.num_experts;
  int32_t* counts = batch->counts.data() + batch->offset;
  std::memset(counts, 0, experts * sizeof(int32_t));
  // One unsigned compare rejects both negative ids (dropped tokens) and ids past the end.
  for (const int32_t id : expert_ids) {
    if (static_cast<uint32_t>(id) < experts) ++counts[id];
  }
  Publish(batch);
  return RecordOutcome::kQueued;
}

void LoadMonitor::StepEnd(int64_t step) {
  const uint64_t index = step_ends_.load(std::memory_order_relaxed);
  step_ids_[index % kStepIdSlots].store(step, std::memory_order_relaxed);
  step_ends_.store(index + 1, std::memory_order_release);
  // Not a lock: a futex wake at most, once per step.
  wake_.notify_one();
}

// --- monitor thread -----------------------------------------------------------------------------

void LoadMonitor::Run() {
  for (;;) {
    bool stopping = false;
    {
      std::unique_lock<std::mutex> lock(wake_mutex_);
      wake_.wait_for(lock, kPollInterval);
      stopping = stopping_;
      if (paused_ && !stopping) continue;
    }
    {
      std::lock_guard<std::mutex> lock(state_mutex_);
      // Steps ended before the drain: every batch of theirs was published before StepEnd.
      const uint64_t ends = step_ends_.load(std::memory_order_acquire);
      Drain();
      while (current_step_index_ < ends) FinishStep();
      if (metrics_ != nullptr) {
        const uint64_t dropped = dropped_.load(std::memory_order_relaxed);
        metrics_->AddDroppedSamples(dropped - reported_dropped_);
        reported_dropped_ = dropped;
      }
    }
    progress_.notify_all();
    if (stopping) break;
  }
  std::lock_guard<std::mutex> lock(state_mutex_);
  if (recorder_) {
    Status closed = recorder_->Close();
    if (trace_status_.ok()) trace_status_ = closed;
  }
}

void LoadMonitor::Drain() {
  const uint64_t size = ring_.size();
  uint64_t position = dequeue_position_.load(std::memory_order_relaxed);
  for (;;) {
    Batch& batch = ring_[position % size];
    if (batch.sequence.load(std::memory_order_acquire) != position + 1) break;  // empty
    // A batch stamped with a later step proves those StepEnd calls happened.
    while (current_step_index_ < batch.step_index) FinishStep();
    Consume(batch);
    batch.sequence.store(position + size, std::memory_order_release);
    ++position;
    dequeue_position_.store(position, std::memory_order_release);
  }
}

void LoadMonitor::Consume(const Batch& batch) {
  const int32_t* counts = batch.counts.data() + batch.offset;
  for (int i = 0; i < batch.length; ++i) {
    if (counts[i] < 0) {
      invalid_.fetch_add(1, std::memory_order_relaxed);
      return;
    }
  }
  int64_t* step_row = step_counts_.data() + static_cast<size_t>(batch.layer) * row_size_;
  int64_t* totals = total_counts_.data() + static_cast<size_t>(batch.layer) * options_.num_experts;
  for (int i = 0; i < batch.length; ++i) {
    step_row[batch.offset + i] += counts[i];
    totals[(batch.offset + i) % options_.num_experts] += counts[i];
  }
  layer_has_data_[batch.layer] = true;
}

const Placement& LoadMonitor::PlacementOf(int layer) const {
  return placements_[layer] ? *placements_[layer] : default_placements_[layer];
}

void LoadMonitor::FinishStep() {
  const int64_t step_id = step_ids_[current_step_index_ % kStepIdSlots].load();
  ++current_step_index_;
  const int ranks = options_.num_ranks;
  const int experts = options_.num_experts;
  const bool per_source = options_.monitor.per_source_rank;
  for (int layer = 0; layer < options_.num_layers; ++layer) {
    const int64_t* row = step_counts_.data() + static_cast<size_t>(layer) * row_size_;
    double* trace_row = trace_row_.data() + static_cast<size_t>(layer) * row_size_;
    for (int i = 0; i < row_size_; ++i) trace_row[i] = static_cast<double>(row[i]);
    // A layer nobody reported this step (all its batches dropped) keeps its estimate.
    if (!layer_has_data_[layer]) continue;

    std::span<const double> values(trace_row, static_cast<size_t>(row_size_));
    Result<StepLoad> load =
        per_source ? StepLoad::FromTraffic(ranks, experts, {values.begin(), values.end()})
                   : StepLoad::FromExpertCounts(ranks, values);
    if (!load.ok()) continue;
    const std::vector<double> expert_tokens = load->ExpertTotals();
    expert_estimators_[layer].Observe(expert_tokens);
    if (per_source) traffic_estimators_[layer].Observe(load->traffic);
    if (metrics_ == nullptr) continue;
    // Rank loads follow the placement in force; the estimate is what the planner will see.
    Result<StepLoad> estimate =
        per_source ? StepLoad::FromTraffic(ranks, experts, traffic_estimators_[layer].Estimate())
                   : StepLoad::FromExpertCounts(ranks, expert_estimators_[layer].Estimate());
    const Placement& placement = PlacementOf(layer);
    const StepRouting routing = RouteEvenly(placement, *load);
    std::vector<double> estimated_rank_tokens;
    if (estimate.ok()) estimated_rank_tokens = RouteEvenly(placement, *estimate).rank_tokens;
    metrics_->ObserveLayerRouting(
        layer, placement, routing, expert_tokens, estimated_rank_tokens,
        options_.max_copies_per_expert > 0 ? options_.max_copies_per_expert : ranks);
  }
  if (recorder_ && trace_status_.ok()) trace_status_ = recorder_->RecordStep(step_id, trace_row_);
  std::fill(step_counts_.begin(), step_counts_.end(), 0);
  std::fill(layer_has_data_.begin(), layer_has_data_.end(), false);
  ++steps_seen_;
  if (metrics_ != nullptr) metrics_->EndStep();
}

// --- control plane ------------------------------------------------------------------------------

Status LoadMonitor::SetPlacement(int layer, const Placement& placement) {
  if (layer < 0 || layer >= options_.num_layers) {
    return InvalidArgument("SetPlacement: layer " + std::to_string(layer) + " is not in 0.." +
                           std::to_string(options_.num_layers - 1));
  }
  if (placement.num_experts() != options_.num_experts ||
      placement.num_ranks() != options_.num_ranks) {
    return InvalidArgument("SetPlacement: layer " + std::to_string(layer) + " placement has " +
                           std::to_string(placement.num_experts()) + " experts on " +
                           std::to_string(placement.num_ranks()) + " ranks, monitor has " +
                           std::to_string(options_.num_experts) + " on " +
                           std::to_string(options_.num_ranks));
  }
  std::lock_guard<std::mutex> lock(state_mutex_);
  placements_[layer] = placement;
  return Status::Ok();
}

bool LoadMonitor::Flush() {
  const uint64_t enqueued = enqueue_position_.load(std::memory_order_acquire);
  const uint64_t ends = step_ends_.load(std::memory_order_acquire);
  {
    std::lock_guard<std::mutex> lock(wake_mutex_);
    if (paused_) return false;
  }
  wake_.notify_one();
  std::unique_lock<std::mutex> lock(state_mutex_);
  progress_.wait(lock, [&] {
    return dequeue_position_.load(std::memory_order_acquire) >= enqueued &&
           current_step_index_ >= ends;
  });
  return true;
}

void LoadMonitor::Pause() {
  std::lock_guard<std::mutex> lock(wake_mutex_);
  paused_ = true;
}

void LoadMonitor::Resume() {
  {
    std::lock_guard<std::mutex> lock(wake_mutex_);
    paused_ = false;
  }
  wake_.notify_one();
}

int64_t LoadMonitor::steps_seen() const {
  std::lock_guard<std::mutex> lock(state_mutex_);
  return steps_seen_;
}

std::vector<int64_t> LoadMonitor::ExpertTotals(int layer) const {
  if (layer < 0 || layer >= options_.num_layers) return {};
  std::lock_guard<std::mutex> lock(state_mutex_);
  const auto begin = total_counts_.begin() + static_cast<ptrdiff_t>(layer) * options_.num_experts;
  return {begin, begin + options_.num_experts};
}

std::vector<double> LoadMonitor::ExpertLoadEstimate(int layer) const {
  if (layer < 0 || layer >= options_.num_layers) return {};
  std::lock_guard<std::mutex> lock(state_mutex_);
  return expert_estimators_[layer].Estimate();
}

std::vector<double> LoadMonitor::TrafficEstimate(int layer) const {
  if (layer < 0 || layer >= options_.num_layers || traffic_estimators_.empty()) return {};
  std::lock_guard<std::mutex> lock(state_mutex_);
  return traffic_estimators_[layer].Estimate();
}

Status LoadMonitor::trace_status() const {
  std::lock_guard<std::mutex> lock(state_mutex_);
  return trace_status_;
}

}  // namespace keel
