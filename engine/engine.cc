// The engine behind include/keel/engine.hpp: per-layer routing over all-gathered counts, the
// fixed-order gradient reduction into homes, weight pushes to replicas, the background planner
// and the epoch protocol (plan agreed by every rank -> transfers -> verified -> switched at the
// same step on every rank, or discarded).
#include "keel/engine.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <numeric>
#include <optional>
#include <string>
#include <thread>
#include <utility>

#include "common/config.h"
#include "common/log.h"
#include "engine/engine_internal.h"
#include "keel/device_memory.hpp"
#include "kernels/histogram.h"
#include "kernels/remap.h"
#include "migration/expert_store.h"
#include "migration/migrator.h"
#include "migration/transfer_plan.h"
#include "migration/transport_factory.h"
#include "migration/transport_local.h"
#include "migration/transport_staged.h"
#include "monitor/metrics.h"
#include "monitor/trace_recorder.h"
#include "placement/load.h"
#include "placement/policy.h"
#include "placement/routing.h"

namespace keel {

// transfer_plan.h's HomeSlot() (the slot of a home) hides the public struct's name here.
using HomeSlotEntry = struct HomeSlot;

namespace {

double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// The message for the first id in `topk_ids` that is neither an expert nor -1.
Status InvalidExpertId(std::span<const int32_t> topk_ids, int num_experts) {
  for (size_t i = 0; i < topk_ids.size(); ++i) {
    const int32_t id = topk_ids[i];
    if (id != -1 && (id < 0 || id >= num_experts)) {
      return InvalidArgument("topk_ids[" + std::to_string(i) + "] = " + std::to_string(id) +
                             " is not an expert id in [0, " + std::to_string(num_experts) +
                             ") or -1");
    }
  }
  return Internal("an invalid expert id was counted but not found");
}

size_t GradientElementBytes(GradientType type) {
  return type == GradientType::kFloat32 ? sizeof(float) : sizeof(double);
}

// A device buffer that grows to the largest size asked of it; the engine keeps it between steps.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() {
    if (data_ != nullptr) memory_->FreeDevice(data_);
  }
  Status Reserve(DeviceMemory& memory, size_t bytes) {
    if (data_ != nullptr && bytes <= size_) return Status::Ok();
    if (data_ != nullptr) memory_->FreeDevice(data_);
    data_ = nullptr;
    memory_ = &memory;
    KEEL_ASSIGN_OR_RETURN(data_, memory.AllocateDevice(bytes));
    size_ = bytes;
    return Status::Ok();
  }
  std::byte* data() const { return data_; }

 private:
  DeviceMemory* memory_ = nullptr;
  std::byte* data_ = nullptr;
  size_t size_ = 0;
};

// Waits for the last of a run of device operations (none: nothing to wait for).
Status WaitForLast(DeviceMemory& memory, std::optional<uint64_t> last) {
  return last.has_value() ? memory.WaitFor(*last) : Status::Ok();
}

// What every rank received from every peer in one AllToAllV, consumed front to back per peer.
class PeerReader {
 public:
  // The next `size` bytes from `peer`, in host memory.
  const std::byte* Next(int peer, size_t size) { return recv_.data() + Advance(peer, size); }
  // The same bytes in the device copy of everything received (CopyToDevice).
  const std::byte* NextOnDevice(int peer, size_t size) { return device_ + Advance(peer, size); }
  // Copies everything received into `buffer` (device memory, resized to fit) for NextOnDevice.
  Status CopyToDevice(DeviceMemory& memory, DeviceBuffer& buffer) {
    KEEL_RETURN_IF_ERROR(buffer.Reserve(memory, recv_.size()));
    device_ = buffer.data();
    return memory.Copy(device_, recv_.data(), recv_.size());
  }

  std::vector<std::byte> recv_;
  std::vector<size_t> recv_bytes_;
  std::vector<size_t> offset_;
  std::vector<size_t> consumed_;

 private:
  size_t Advance(int peer, size_t size) {
    const size_t at = offset_[peer] + consumed_[peer];
    consumed_[peer] += size;
    return at;
  }
  std::byte* device_ = nullptr;
};

// Slot bytes for each peer (registered buffers, which may be device memory), sent in one
// AllToAllV in an order both sides derive from the same plan.
class PeerSends {
 public:
  explicit PeerSends(int num_ranks) : parts_(num_ranks) {}
  void Add(int peer, const void* data, size_t size) {
    parts_[peer].push_back({static_cast<const std::byte*>(data), size});
  }

  // Gathers the parts into one host buffer through `memory` and exchanges it.
  Result<PeerReader> Exchange(Communicator& communicator, DeviceMemory& memory) const {
    const int size = communicator.size();
    std::vector<size_t> send_bytes(size, 0);
    for (int r = 0; r < size; ++r) {
      for (const Part& part : parts_[r]) send_bytes[r] += part.size;
    }
    std::vector<std::byte> send(std::accumulate(send_bytes.begin(), send_bytes.end(), size_t{0}));
    std::optional<uint64_t> last;
    size_t at = 0;
    for (int r = 0; r < size; ++r) {
      for (const Part& part : parts_[r]) {
        KEEL_ASSIGN_OR_RETURN(last, memory.StartCopy(send.data() + at, part.data, part.size));
        at += part.size;
      }
    }
    KEEL_RETURN_IF_ERROR(WaitForLast(memory, last));
    PeerReader reader;
    KEEL_RETURN_IF_ERROR(
        communicator.AllToAllV(send, send_bytes, reader.recv_, reader.recv_bytes_));
    reader.offset_.assign(size, 0);
    reader.consumed_.assign(size, 0);
    for (int r = 1; r < size; ++r) {
      reader.offset_[r] = reader.offset_[r - 1] + reader.recv_bytes_[r - 1];
    }
    return reader;
  }

 private:
  struct Part {
    const std::byte* data;
    size_t size;
  };
  std::vector<std::vector<Part>> parts_;  // [peer]
};

// The config the options name: one of config, config_yaml, config_path, or the defaults sized to
// the communicator.
Result<KeelConfig> ResolveConfig(const EngineOptions& options, int num_ranks) {
  const int given = (options.config.has_value() ? 1 : 0) + (options.config_yaml.empty() ? 0 : 1) +
                    (options.config_path.empty() ? 0 : 1);
  if (given > 1) {
    return InvalidArgument("more than one of config, config_yaml and config_path is set" +
                           (options.config_path.empty()
                                ? std::string()
                                : " (config_path = \"" + options.config_path + "\")") +
                           "; give at most one");
  }
  if (options.config.has_value()) return TypedConfig(*options.config);
  if (!options.config_yaml.empty()) return ParseConfig(options.config_yaml, "config_yaml");
  if (!options.config_path.empty()) return LoadConfigFile(options.config_path);
  KeelConfig config;
  config.topology.num_nodes = 1;
  config.topology.gpus_per_node = num_ranks;
  return config;
}

std::string ShapeFingerprint(const EngineOptions& o, const KeelConfig& config) {
  return ConfigToYaml(config) + "\nlayers " + std::to_string(o.num_layers) + " experts " +
         std::to_string(o.num_experts) + " top_k " + std::to_string(o.top_k) + " weights " +
         std::to_string(o.shape.weight_bytes) + " gradients " +
         std::to_string(o.shape.gradient_bytes) + " optimizer " +
         std::to_string(o.shape.optimizer_bytes) + " gradient type " +
         std::to_string(static_cast<int>(o.shape.gradient_type)) + " memory " +
         std::to_string(static_cast<int>(o.shape.memory));
}

}  // namespace

class Engine::Impl {
 public:
  Impl(const EngineOptions& options, KeelConfig config, Metrics* metrics)
      : options_(options),
        config_(std::move(config)),
        communicator_(*options.communicator),
        shared_metrics_(metrics) {}
  ~Impl();

  Status Init();
  Status ChooseMemory();
  bool device_memory() const { return options_.shape.memory == MemoryKind::kDevice; }
  Status RegisterSlot(int layer, int local_slot, const SlotBuffers& buffers);
  Result<LayerRoute> Route(int layer, std::span<const int32_t> topk_ids);
  Result<LayerRoute> RouteCounts(int layer, std::span<const int32_t> expert_counts);
  Status ReduceGradients();
  Status StepEnd();
  std::vector<HomeSlotEntry> HomeSlots(int layer) const;
  bool migrating() const { return migrating_; }
  int RankOfPhysical(int slot) const {
    return slot < num_slots() ? slot / slots_per_rank_
                              : (slot - num_slots()) / std::max(1, transient_per_rank_);
  }
  int LocalOfPhysical(int slot) const {
    return slot < num_slots() ? slot % slots_per_rank_
                              : slots_per_rank_ + (slot - num_slots()) % transient_per_rank_;
  }

  const EngineOptions options_;
  const KeelConfig config_;
  Communicator& communicator_;
  Metrics* const shared_metrics_;  // from EngineFactory; null: the engine's own
  int rank_ = 0;
  int num_ranks_ = 0;
  int slots_per_rank_ = 0;
  int transient_per_rank_ = 0;  // registered transient slots
  int transients_planned_ = 0;  // transient replicas the quota planner may add per rank
  std::optional<PolicyContext> context_;
  std::unique_ptr<Policy> policy_;
  std::vector<Placement> placements_;  // in force
  EngineStats stats_;

 private:
  int num_slots() const { return num_ranks_ * slots_per_rank_; }
  int local_slots() const { return slots_per_rank_ + transient_per_rank_; }
  const SlotBuffers& Buffers(int layer, int local_slot) const {
    return buffers_[static_cast<size_t>(layer) * local_slots() + local_slot];
  }
  std::byte* Weights(int layer, int local_slot) const {
    return static_cast<std::byte*>(Buffers(layer, local_slot).weights);
  }
  std::byte* Gradients(int layer, int local_slot) const {
    return static_cast<std::byte*>(Buffers(layer, local_slot).gradients);
  }
  // The physical slot of copy `copy` of a StepRouting (a persistent slot, or num_slots + i for
  // transients[i]), given `transient_slot` [transients] from TransientSlots.
  int PhysicalSlot(int copy, const std::vector<int>& transient_slot) const {
    return copy < num_slots() ? copy : transient_slot[copy - num_slots()];
  }
  std::vector<int> TransientSlots(const StepRouting& routing) const;
  Status CheckRoutable(int layer) const;
  // Route's collective part: all-reduces the counts (`mine`: [num_experts] this rank's), plans
  // the quotas and transients, fills transient slots; returns all but `slot` and `send_counts`.
  Result<LayerRoute> PlanLayer(int layer, std::span<const int32_t> mine);
  Status FillTransients(int layer, const Placement& placement, const StepRouting& routing,
                        const std::vector<int>& transient_slot);
  Status ResolveMigration(bool& commit);
  Status PushWeights();
  Status AdvancePlanner();
  void StartPlanner();
  Status StartMigration(std::vector<Placement> planned);
  Status RecordStep();
  bool aggregating() const { return rank_ == config_.monitor.aggregating_rank; }

  // Every copy and sum of slot buffers goes through it (host memory for MemoryKind::kHost).
  std::shared_ptr<DeviceMemory> memory_;
  DeviceBuffer sum_scratch_;          // ReduceGradients' sums, one gradient buffer each
  DeviceBuffer received_;             // ReduceGradients' received gradients
  std::vector<SlotBuffers> buffers_;  // [layer * local_slots + local slot]
  int registered_ = 0;
  std::vector<bool> is_registered_;

  // This step, per layer.
  std::vector<bool> routed_;
  std::vector<std::vector<double>> traffic_;  // [layer][num_ranks * num_experts]
  std::vector<StepRouting> routing_;
  // One per layer: each keeps what its placement alone decides, and its buffers, between steps.
  std::vector<std::unique_ptr<StepPlanner>> planners_;
  std::vector<int64_t> reduced_;                  // scratch: this layer's traffic by expert
  std::vector<int32_t> by_expert_;                // the same, as the planner takes it
  StepRouting plan_scratch_;                      // scratch: the routing being planned
  std::vector<std::vector<int>> transient_slot_;  // [layer][transients] physical slot
  std::vector<LoadEstimator> estimators_;

  // Migration.
  std::unique_ptr<Transport> owned_transport_;
  std::unique_ptr<Transport> staged_transport_;  // over owned_transport_ or options.transport
  Transport* transport_ = nullptr;
  std::unique_ptr<ExpertStore> store_;
  std::unique_ptr<Migrator> migrator_;
  bool migrating_ = false;
  std::vector<Placement> pending_;  // the placement the running epoch builds

  // Planner thread.
  std::thread planner_;
  std::atomic<bool> planner_done_{false};
  bool planning_ = false;
  std::vector<Placement> planned_;
  Status planner_status_;
  double planner_seconds_ = 0;

  // Telemetry.
  std::unique_ptr<Metrics> owned_metrics_;
  Metrics* metrics_ = nullptr;
  std::unique_ptr<TraceRecorder> recorder_;
};

Engine::Impl::~Impl() {
  if (planner_.joinable()) planner_.join();
  if (migrator_ != nullptr) migrator_->Cancel();
  migrator_.reset();
}

Status Engine::Impl::Init() {
  const KeelConfig& config = config_;
  KEEL_RETURN_IF_ERROR(ValidateConfig(config));
  rank_ = communicator_.rank();
  num_ranks_ = communicator_.size();
  if (config.num_ranks() != num_ranks_) {
    return InvalidArgument(
        "topology.num_nodes x topology.gpus_per_node = " + std::to_string(config.num_ranks()) +
        " ranks, but the communicator has " + std::to_string(num_ranks_));
  }
  const auto positive = [](const char* field, long long value) -> Status {
    if (value > 0) return Status::Ok();
    return InvalidArgument(std::string(field) + " = " + std::to_string(value) + " must be > 0");
  };
  KEEL_RETURN_IF_ERROR(positive("num_layers", options_.num_layers));
  KEEL_RETURN_IF_ERROR(positive("num_experts", options_.num_experts));
  KEEL_RETURN_IF_ERROR(positive("top_k", options_.top_k));
  KEEL_RETURN_IF_ERROR(
      positive("shape.weight_bytes", static_cast<long long>(options_.shape.weight_bytes)));
  const size_t element = GradientElementBytes(options_.shape.gradient_type);
  if (options_.shape.gradient_bytes == 0 || options_.shape.gradient_bytes % element != 0) {
    return InvalidArgument(
        "shape.gradient_bytes = " + std::to_string(options_.shape.gradient_bytes) +
        " must be a positive multiple of the gradient element size " + std::to_string(element));
  }
  if (options_.top_k > options_.num_experts) {
    return InvalidArgument("top_k = " + std::to_string(options_.top_k) +
                           " exceeds num_experts = " + std::to_string(options_.num_experts));
  }
  KEEL_RETURN_IF_ERROR(ChooseMemory());
  communicator_.set_timeout_seconds(config.engine.collective_timeout_seconds);

  // Every rank must plan with the same inputs, or their placements would diverge.
  KEEL_ASSIGN_OR_RETURN(std::vector<std::string> fingerprints,
                        communicator_.AllGather(ShapeFingerprint(options_, config_)));
  for (int r = 0; r < num_ranks_; ++r) {
    if (fingerprints[r] != fingerprints[0]) {
      return InvalidArgument("rank " + std::to_string(r) +
                             " created its engine with a different config or shape than rank 0");
    }
  }

  KEEL_ASSIGN_OR_RETURN(
      PolicyContext context,
      PolicyContext::FromConfig(config, options_.num_layers, options_.num_experts));
  context_ = std::move(context);
  slots_per_rank_ = context_->slots_per_rank;
  transient_per_rank_ = context_->transient_per_rank;
  transients_planned_ = config.policy.name == "keel" && config.policy.keel.transient_replicas
                            ? transient_per_rank_
                            : 0;
  KEEL_ASSIGN_OR_RETURN(policy_, MakePolicy(config.policy.name, *context_));
  for (int l = 0; l < options_.num_layers; ++l) {
    KEEL_ASSIGN_OR_RETURN(Placement initial, policy_->Initial(l));
    placements_.push_back(std::move(initial));
  }

  const size_t slots = static_cast<size_t>(options_.num_layers) * local_slots();
  buffers_.resize(slots);
  is_registered_.assign(slots, false);
  routed_.assign(options_.num_layers, false);
  traffic_.assign(options_.num_layers, {});
  routing_.resize(options_.num_layers);
  transient_slot_.resize(options_.num_layers);
  for (int l = 0; l < options_.num_layers; ++l) {
    estimators_.emplace_back(config.estimator, num_ranks_ * options_.num_experts);
    planners_.push_back(std::make_unique<StepPlanner>(context_->topology, context_->cost));
  }

  if (options_.transport != nullptr) {
    transport_ = options_.transport;
  } else {
    LocalFabric* fabric =
        options_.local_group != nullptr ? &FabricOf(*options_.local_group) : nullptr;
    if (config.migration.transport == "local" && fabric == nullptr) {
      return InvalidArgument(
          "migration.transport = \"local\" moves expert state between threads of one "
          "LocalGroup, but neither options.transport nor options.local_group is set; name "
          "another transport (e.g. \"ucx\") for ranks in separate processes");
    }
    KEEL_ASSIGN_OR_RETURN(owned_transport_,
                          CreateTransport(config.migration, communicator_, fabric));
    transport_ = owned_transport_.get();
  }
  if (device_memory() && transport_->device_memory() == nullptr) {
    // A transport of host memory only: device buffers travel through host staging buffers.
    KEEL_ASSIGN_OR_RETURN(staged_transport_, CreateStagedTransport(*transport_, memory_));
    transport_ = staged_transport_.get();
  }
  if (transport_->rank() != rank_ || transport_->num_ranks() != num_ranks_) {
    return InvalidArgument("transport is rank " + std::to_string(transport_->rank()) + " of " +
                           std::to_string(transport_->num_ranks()) + ", the communicator rank " +
                           std::to_string(rank_) + " of " + std::to_string(num_ranks_));
  }

  if (aggregating()) {
    metrics_ = shared_metrics_;
    if (metrics_ == nullptr && !config.monitor.metrics_address.empty()) {
      KEEL_ASSIGN_OR_RETURN(
          owned_metrics_, Metrics::Create(MetricsLayout::FromConfig(config, options_.num_layers,
                                                                    options_.num_experts, rank_)));
      KEEL_RETURN_IF_ERROR(owned_metrics_->Serve(config.monitor.metrics_address));
      metrics_ = owned_metrics_.get();
    }
    if (!config.monitor.trace_path.empty()) {
      TraceRecorderOptions trace;
      trace.path = config.monitor.trace_path;
      trace.description = "recorded by the keel engine";
      trace.num_layers = options_.num_layers;
      trace.num_experts = options_.num_experts;
      trace.num_sources = num_ranks_;
      trace.sample_interval_steps = config.monitor.trace_sample_interval_steps;
      KEEL_ASSIGN_OR_RETURN(recorder_, TraceRecorder::Open(trace));
    }
    if (metrics_ != nullptr) metrics_->SetEpoch(0);
  }
  return Status::Ok();
}

// Where the slot buffers live: host memory, the device memory the options name, or this rank's
// GPU.
Status Engine::Impl::ChooseMemory() {
  if (!device_memory()) {
    memory_ = CreateHostMemory();
    return Status::Ok();
  }
  if (options_.device_memory != nullptr) {
    memory_ = options_.device_memory;
    return Status::Ok();
  }
  Result<std::shared_ptr<DeviceMemory>> cuda = CreateCudaDeviceMemory();
  if (!cuda.ok()) {
    return Status(
        cuda.status().code(),
        "shape.memory = device needs a GPU (or options.device_memory): " + cuda.status().message());
  }
  memory_ = std::move(*cuda);
  return Status::Ok();
}

Status Engine::Impl::RegisterSlot(int layer, int local_slot, const SlotBuffers& buffers) {
  if (layer < 0 || layer >= options_.num_layers) {
    return InvalidArgument("layer = " + std::to_string(layer) + " is not in [0, " +
                           std::to_string(options_.num_layers) + ")");
  }
  if (local_slot < 0 || local_slot >= local_slots()) {
    return InvalidArgument("local_slot = " + std::to_string(local_slot) + " is not in [0, " +
                           std::to_string(local_slots()) + ")");
  }
  if (buffers.weights == nullptr) return InvalidArgument("buffers.weights is null");
  if (buffers.gradients == nullptr) return InvalidArgument("buffers.gradients is null");
  const bool persistent = local_slot < slots_per_rank_;
  if (persistent && options_.shape.optimizer_bytes > 0 && buffers.optimizer == nullptr) {
    return InvalidArgument("buffers.optimizer is null for persistent local_slot = " +
                           std::to_string(local_slot) + " (any persistent slot can become a home)");
  }
  if (migrating_) {
    return FailedPrecondition("slots cannot be registered again while an epoch's transfers run");
  }
  if (device_memory()) {
    const std::pair<const char*, const void*> regions[] = {
        {"weights", buffers.weights},
        {"gradients", buffers.gradients},
        {"optimizer", persistent ? buffers.optimizer : nullptr}};
    for (const auto& [name, data] : regions) {
      if (data != nullptr && !memory_->IsDeviceMemory(data)) {
        return InvalidArgument(std::string("buffers.") + name + " of layer " +
                               std::to_string(layer) + " local_slot " + std::to_string(local_slot) +
                               " is not device memory, but shape.memory = device");
      }
    }
  }
  const size_t index = static_cast<size_t>(layer) * local_slots() + local_slot;
  if (!is_registered_[index]) ++registered_;
  is_registered_[index] = true;
  buffers_[index] = buffers;
  store_.reset();  // rebuilt over the new buffers when the next epoch starts
  migrator_.reset();
  return Status::Ok();
}

std::vector<int> Engine::Impl::TransientSlots(const StepRouting& routing) const {
  std::vector<int> slot(routing.transients.size());
  std::vector<int> used(num_ranks_, 0);
  for (size_t i = 0; i < routing.transients.size(); ++i) {
    const int rank = routing.transients[i].rank;
    slot[i] = num_slots() + rank * transient_per_rank_ + used[rank]++;
  }
  return slot;
}

Status Engine::Impl::CheckRoutable(int layer) const {
  if (layer < 0 || layer >= options_.num_layers) {
    return InvalidArgument("layer = " + std::to_string(layer) + " is not in [0, " +
                           std::to_string(options_.num_layers) + ")");
  }
  if (registered_ != static_cast<int>(buffers_.size())) {
    return FailedPrecondition("only " + std::to_string(registered_) + " of " +
                              std::to_string(buffers_.size()) +
                              " slots are registered; register every slot of every layer first");
  }
  if (routed_[layer]) {
    return FailedPrecondition("layer " + std::to_string(layer) +
                              " was already routed this step; call StepEnd first");
  }
  return Status::Ok();
}

Result<LayerRoute> Engine::Impl::Route(int layer, std::span<const int32_t> topk_ids) {
  const auto start = std::chrono::steady_clock::now();
  const int num_experts = options_.num_experts;
  KEEL_RETURN_IF_ERROR(CheckRoutable(layer));
  if (topk_ids.size() % options_.top_k != 0) {
    return InvalidArgument("topk_ids has " + std::to_string(topk_ids.size()) +
                           " entries, not a multiple of top_k = " + std::to_string(options_.top_k));
  }
  std::vector<int32_t> mine(num_experts);
  int32_t invalid = 0;
  KEEL_RETURN_IF_ERROR(kernels::cpu::ExpertHistogram(
      topk_ids.data(), static_cast<int64_t>(topk_ids.size()), num_experts, mine.data(), &invalid));
  if (invalid > 0) return InvalidExpertId(topk_ids, num_experts);
  KEEL_ASSIGN_OR_RETURN(LayerRoute route, PlanLayer(layer, mine));
  const kernels::QuotaTable quotas = kernels::MakeQuotaTable(
      route.copy_begin, route.copy_slot, route.copy_quota, route.slot_rank, num_ranks_);
  route.slot.resize(topk_ids.size());
  std::vector<int32_t> send_counts(num_ranks_);
  KEEL_RETURN_IF_ERROR(
      kernels::cpu::RemapWithQuotas(topk_ids.data(), static_cast<int64_t>(topk_ids.size()), quotas,
                                    route.slot.data(), send_counts.data(), &invalid));
  if (invalid > 0) {
    return Internal("the quota plan of layer " + std::to_string(layer) + " gave rank " +
                    std::to_string(rank_) + " no copy for " + std::to_string(invalid) +
                    " of its entries");
  }
  route.send_counts.assign(send_counts.begin(), send_counts.end());
  stats_.route_seconds += SecondsSince(start);
  return route;
}

Result<LayerRoute> Engine::Impl::RouteCounts(int layer, std::span<const int32_t> expert_counts) {
  const auto start = std::chrono::steady_clock::now();
  KEEL_RETURN_IF_ERROR(CheckRoutable(layer));
  if (expert_counts.size() != static_cast<size_t>(options_.num_experts)) {
    return InvalidArgument("expert_counts has " + std::to_string(expert_counts.size()) +
                           " entries, not num_experts = " + std::to_string(options_.num_experts));
  }
  for (size_t e = 0; e < expert_counts.size(); ++e) {
    if (expert_counts[e] < 0) {
      return InvalidArgument("expert_counts[" + std::to_string(e) +
                             "] = " + std::to_string(expert_counts[e]) + " is negative");
    }
  }
  KEEL_ASSIGN_OR_RETURN(LayerRoute route, PlanLayer(layer, expert_counts));
  // What the remap will send: the entries of e fill its copies' quotas in order, the last copy
  // takes the rest.
  route.send_counts.assign(num_ranks_, 0);
  for (int e = 0; e < options_.num_experts; ++e) {
    int64_t left = expert_counts[e];
    for (int c = route.copy_begin[e]; c < route.copy_begin[e + 1] && left > 0; ++c) {
      const bool last = c + 1 == route.copy_begin[e + 1];
      const int64_t taken = last ? left : std::min<int64_t>(left, route.copy_quota[c]);
      route.send_counts[route.slot_rank[route.copy_slot[c]]] += taken;
      left -= taken;
    }
  }
  stats_.route_seconds += SecondsSince(start);
  return route;
}

Result<LayerRoute> Engine::Impl::PlanLayer(int layer, std::span<const int32_t> mine) {
  const int num_experts = options_.num_experts;
  // Every rank's column of the traffic by expert arrives with one all-reduce: each entry is one
  // rank's count, so it stays a 32-bit count.
  const size_t num_ranks = static_cast<size_t>(num_ranks_);
  reduced_.assign(num_ranks * num_experts, 0);
  for (int e = 0; e < num_experts; ++e) reduced_[e * num_ranks + rank_] = mine[e];
  KEEL_RETURN_IF_ERROR(communicator_.AllReduce(reduced_, ReduceOp::kSum));
  by_expert_.assign(reduced_.begin(), reduced_.end());
  // The estimators and the trace keep the traffic by source.
  std::vector<double> traffic(reduced_.size());
  for (int e = 0; e < num_experts; ++e) {
    for (size_t r = 0; r < num_ranks; ++r)
      traffic[r * num_experts + e] = by_expert_[e * num_ranks + r];
  }

  const Placement& placement = placements_[layer];
  QuotaPlanOptions quota_options;
  quota_options.transient_per_rank = transients_planned_;
  quota_options.record_shares = true;
  quota_options.shares_of_rank = rank_;  // the loop below reads nothing else
  quota_options.sent_tokens = false;     // nor does anything read the all-to-all matrix
  StepRouting& routing = plan_scratch_;
  KEEL_RETURN_IF_ERROR(
      planners_[layer]->Plan(placement, num_ranks_, by_expert_, quota_options, routing));
  std::vector<int> transient_slot = TransientSlots(routing);

  // This rank's quotas by expert, in the planner's order: its entries fill them front to back.
  struct Quota {
    int expert;
    int32_t slot;
    int32_t tokens;
  };
  std::vector<Quota> mine_quotas;
  LayerRoute route;
  route.epoch = stats_.epoch;
  route.copy_begin.assign(num_experts + 1, 0);
  route.recv_counts.assign(static_cast<size_t>(num_ranks_) * local_slots(), 0);
  route.recv_totals.assign(num_ranks_, 0);
  for (const CopyShare& share : routing.shares) {
    const int slot = PhysicalSlot(share.copy, transient_slot);
    const int64_t tokens = std::llround(share.tokens);
    if (tokens <= 0) continue;
    if (share.source == rank_) {
      mine_quotas.push_back({share.expert, slot, static_cast<int32_t>(tokens)});
      ++route.copy_begin[share.expert + 1];
    }
    if (RankOfPhysical(slot) == rank_) {
      route
          .recv_counts[static_cast<size_t>(share.source) * local_slots() + LocalOfPhysical(slot)] +=
          tokens;
      route.recv_totals[share.source] += tokens;
    }
  }
  for (int e = 0; e < num_experts; ++e) route.copy_begin[e + 1] += route.copy_begin[e];
  // Stable by expert: each expert's copies keep the planner's order.
  route.copy_slot.resize(mine_quotas.size());
  route.copy_quota.resize(mine_quotas.size());
  std::vector<int32_t> next(route.copy_begin.begin(), route.copy_begin.end() - 1);
  for (const Quota& quota : mine_quotas) {
    const int32_t at = next[quota.expert]++;
    route.copy_slot[at] = quota.slot;
    route.copy_quota[at] = quota.tokens;
  }
  route.slot_rank.resize(num_slots() + num_ranks_ * transient_per_rank_);
  for (size_t slot = 0; slot < route.slot_rank.size(); ++slot) {
    route.slot_rank[slot] = RankOfPhysical(static_cast<int>(slot));
  }
  route.local_experts.assign(local_slots(), -1);
  for (int i = 0; i < slots_per_rank_; ++i) {
    route.local_experts[i] = placement.expert_at(rank_ * slots_per_rank_ + i);
  }
  for (size_t i = 0; i < routing.transients.size(); ++i) {
    if (routing.transients[i].rank == rank_) {
      route.local_experts[LocalOfPhysical(transient_slot[i])] = routing.transients[i].expert;
    }
  }

  KEEL_RETURN_IF_ERROR(FillTransients(layer, placement, routing, transient_slot));
  traffic_[layer] = std::move(traffic);
  routed_[layer] = true;
  if (metrics_ != nullptr) {
    std::vector<double> expert_tokens(num_experts, 0.0);
    for (size_t i = 0; i < traffic_[layer].size(); ++i) {
      expert_tokens[i % num_experts] += traffic_[layer][i];
    }
    LayerStepObservation observation;
    observation.layer = layer;
    observation.rank_tokens = routing.rank_tokens;
    observation.expert_tokens = expert_tokens;
    observation.max_copies_per_expert =
        std::min(num_ranks_, placement.max_copies() + (transients_planned_ > 0 ? 1 : 0));
    metrics_->ObserveLayerStep(observation);
    int extra = 0;
    for (int count : placement.logcnt()) extra += count - 1;
    metrics_->SetReplicas(layer, extra, static_cast<int>(routing.transients.size()));
  }
  std::swap(routing_[layer], routing);  // the old routing's buffers serve the next plan
  transient_slot_[layer] = std::move(transient_slot);
  return route;
}

// A transient replica's weights come from a copy on its source rank: the home slot when the
// home is there, else that rank's lowest copy.
Status Engine::Impl::FillTransients(int layer, const Placement& placement,
                                    const StepRouting& routing,
                                    const std::vector<int>& transient_slot) {
  if (routing.transients.empty()) return Status::Ok();
  const size_t bytes = options_.shape.weight_bytes;
  auto source_slot = [&](const TransientReplica& t) {
    if (placement.home(t.expert) == t.source_rank) return keel::HomeSlot(placement, t.expert);
    for (int slot : placement.copies(t.expert)) {
      if (placement.rank_of_slot(slot) == t.source_rank) return slot;
    }
    return -1;
  };
  PeerSends out(num_ranks_);
  for (const TransientReplica& t : routing.transients) {
    if (t.source_rank != rank_) continue;
    const int slot = source_slot(t);
    if (slot < 0) {
      return Internal("transient replica of expert " + std::to_string(t.expert) +
                      " names source rank " + std::to_string(t.source_rank) +
                      ", which holds no copy");
    }
    out.Add(t.rank, Buffers(layer, slot % slots_per_rank_).weights, bytes);
  }
  KEEL_ASSIGN_OR_RETURN(PeerReader in, out.Exchange(communicator_, *memory_));
  std::optional<uint64_t> last;
  for (size_t i = 0; i < routing.transients.size(); ++i) {
    const TransientReplica& t = routing.transients[i];
    if (t.rank != rank_) continue;
    KEEL_ASSIGN_OR_RETURN(last,
                          memory_->StartCopy(Weights(layer, LocalOfPhysical(transient_slot[i])),
                                             in.Next(t.source_rank, bytes), bytes));
  }
  return WaitForLast(*memory_, last);
}

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
  }
  if (metrics_ != nullptr) {
    metrics_->RecordMigration(commit ? MigrationOutcome::kOk : MigrationOutcome::kAborted,
                              transport_->name(), static_cast<double>(moved), report.seconds,
                              SecondsSince(start));
    metrics_->SetMigrationsInFlight(0);
  }
  return Status::Ok();
}

Status Engine::Impl::ReduceGradients() {
  const auto start = std::chrono::steady_clock::now();
  bool commit = false;
  KEEL_RETURN_IF_ERROR(ResolveMigration(commit));
  const double waited = stats_.exposed_migration_seconds;
  const std::vector<Placement>& target = commit ? pending_ : placements_;
  const size_t bytes = options_.shape.gradient_bytes;

  // Sources of expert e in the fixed order: the home slot this step used, its other copies by
  // ascending slot, then this step's transient replicas in plan order.
  auto for_each_source = [&](int layer, int expert, const std::function<void(int)>& visit) {
    const Placement& used = placements_[layer];
    const int home_slot = keel::HomeSlot(used, expert);
    visit(home_slot);
    for (int slot : used.copies(expert)) {
      if (slot != home_slot) visit(slot);
    }
    const StepRouting& routing = routing_[layer];
    if (!routed_[layer]) return;
    for (size_t i = 0; i < routing.transients.size(); ++i) {
      if (routing.transients[i].expert == expert) visit(transient_slot_[layer][i]);
    }
  };
  auto needs_reduction = [&](int layer, int expert) {
    const Placement& used = placements_[layer];
    if (used.logcnt()[expert] > 1 ||
        keel::HomeSlot(target[layer], expert) != keel::HomeSlot(used, expert)) {
      return true;
    }
    const StepRouting& routing = routing_[layer];
    return routed_[layer] &&
           std::any_of(routing.transients.begin(), routing.transients.end(),
                       [&](const TransientReplica& t) { return t.expert == expert; });
  };

  PeerSends out(num_ranks_);
  for (int l = 0; l < options_.num_layers; ++l) {
    for (int e = 0; e < options_.num_experts; ++e) {
      if (!needs_reduction(l, e)) continue;
      const int destination = target[l].home(e);
      for_each_source(l, e, [&](int slot) {
        if (RankOfPhysical(slot) == rank_ && destination != rank_) {
          out.Add(destination, Buffers(l, LocalOfPhysical(slot)).gradients, bytes);
        }
      });
    }
  }
  KEEL_ASSIGN_OR_RETURN(PeerReader in, out.Exchange(communicator_, *memory_));
  KEEL_RETURN_IF_ERROR(in.CopyToDevice(*memory_, received_));

  // Sum into zeroed scratch first: a home slot's own gradient buffer may still be another
  // expert's source until every sum of the layer is done.
  struct Sum {
    int layer;
    int expert;
    int local_slot;  // the home's
  };
  std::vector<Sum> sums;
  for (int l = 0; l < options_.num_layers; ++l) {
    for (int e = 0; e < options_.num_experts; ++e) {
      if (!needs_reduction(l, e) || target[l].home(e) != rank_) continue;
      sums.push_back({l, e, keel::HomeSlot(target[l], e) % slots_per_rank_});
    }
  }
  KEEL_RETURN_IF_ERROR(sum_scratch_.Reserve(*memory_, sums.size() * bytes));
  const std::vector<std::byte> zeros(sums.size() * bytes, std::byte{0});
  KEEL_RETURN_IF_ERROR(memory_->Copy(sum_scratch_.data(), zeros.data(), zeros.size()));
  std::optional<uint64_t> last;
  Status added;
  for (size_t i = 0; i < sums.size() && added.ok(); ++i) {
    std::byte* sum = sum_scratch_.data() + i * bytes;
    for_each_source(sums[i].layer, sums[i].expert, [&](int slot) {
      const int source_rank = RankOfPhysical(slot);
      const std::byte* data = source_rank == rank_ ? Gradients(sums[i].layer, LocalOfPhysical(slot))
                                                   : in.NextOnDevice(source_rank, bytes);
      Result<uint64_t> add = memory_->StartAdd(options_.shape.gradient_type, sum, data, bytes);
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
  PeerSends out(num_ranks_);
  std::optional<uint64_t> last;
  for (int l = 0; l < options_.num_layers; ++l) {
    const Placement& p = placements_[l];
    for (int e = 0; e < options_.num_experts; ++e) {
      if (p.logcnt()[e] < 2 || p.home(e) != rank_) continue;
      const int home_slot = keel::HomeSlot(p, e);
      const std::byte* weights = Weights(l, home_slot % slots_per_rank_);
      for (int slot : p.copies(e)) {
        if (slot == home_slot) continue;
        const int rank = p.rank_of_slot(slot);
        if (rank == rank_) {
          KEEL_ASSIGN_OR_RETURN(
              last, memory_->StartCopy(Weights(l, slot % slots_per_rank_), weights, bytes));
        } else {
          out.Add(rank, weights, bytes);
        }
      }
    }
  }
  KEEL_ASSIGN_OR_RETURN(PeerReader in, out.Exchange(communicator_, *memory_));
  for (int l = 0; l < options_.num_layers; ++l) {
    const Placement& p = placements_[l];
    for (int e = 0; e < options_.num_experts; ++e) {
      if (p.logcnt()[e] < 2 || p.home(e) == rank_) continue;
      const int home_slot = keel::HomeSlot(p, e);
      for (int slot : p.copies(e)) {
        if (slot == home_slot || p.rank_of_slot(slot) != rank_) continue;
        KEEL_ASSIGN_OR_RETURN(last, memory_->StartCopy(Weights(l, slot % slots_per_rank_),
                                                       in.Next(p.home(e), bytes), bytes));
      }
    }
  }
  return WaitForLast(*memory_, last);
}

Status Engine::Impl::RecordStep() {
  const size_t row = static_cast<size_t>(num_ranks_) * options_.num_experts;
  for (int l = 0; l < options_.num_layers; ++l) {
    if (routed_[l]) estimators_[l].Observe(traffic_[l]);
  }
  if (recorder_ != nullptr) {
    std::vector<double> step(row * options_.num_layers, 0.0);
    for (int l = 0; l < options_.num_layers; ++l) {
      if (routed_[l]) std::copy(traffic_[l].begin(), traffic_[l].end(), step.begin() + l * row);
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
  for (const LoadEstimator& estimator : estimators_) {
    snapshot->traffic.push_back(estimator.Estimate());
  }
  planning_ = true;
  planner_done_.store(false, std::memory_order_relaxed);
  planner_ = std::thread([this, snapshot] {
    const auto start = std::chrono::steady_clock::now();
    const int num_experts = options_.num_experts;
    std::vector<Placement> planned;
    Status status;
    for (int l = 0; l < options_.num_layers && status.ok(); ++l) {
      Result<StepLoad> traffic =
          StepLoad::FromTraffic(num_ranks_, num_experts, snapshot->traffic[l]);
      if (!traffic.ok()) {
        status = traffic.status();
        break;
      }
      const std::vector<double> expert_load = traffic->ExpertTotals();
      LayerView view;
      view.layer = l;
      view.current = &snapshot->current[l];
      view.expert_load = expert_load;
      view.traffic = &*traffic;
      Result<Placement> next = policy_->Replan(view);
      if (!next.ok()) {
        status = next.status();
        break;
      }
      planned.push_back(std::move(*next));
    }
    planned_ = std::move(planned);
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
    std::vector<int64_t> done = {planner_done_.load(std::memory_order_acquire) ? 1 : 0};
    KEEL_RETURN_IF_ERROR(communicator_.AllReduce(done, ReduceOp::kMin));
    if (done[0] == 0) return Status::Ok();
    planner_.join();
    planning_ = false;
    if (metrics_ != nullptr) metrics_->RecordPlannerRun(planner_seconds_);
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
    StartPlanner();
  }
  return Status::Ok();
}

Status Engine::Impl::StepEnd() {
  const auto start = std::chrono::steady_clock::now();
  KEEL_RETURN_IF_ERROR(PushWeights());
  KEEL_RETURN_IF_ERROR(RecordStep());
  ++stats_.steps;
  Status planned = AdvancePlanner();
  std::fill(routed_.begin(), routed_.end(), false);
  stats_.control_seconds += SecondsSince(start);
  return planned;
}

std::vector<HomeSlotEntry> Engine::Impl::HomeSlots(int layer) const {
  std::vector<HomeSlotEntry> homes;
  if (layer < 0 || layer >= options_.num_layers) return homes;
  const Placement& p = placements_[layer];
  for (int e = 0; e < options_.num_experts; ++e) {
    if (p.home(e) == rank_) homes.push_back({e, keel::HomeSlot(p, e) % slots_per_rank_});
  }
  return homes;
}

// --- Engine ----------------------------------------------------------------------------------

Result<std::unique_ptr<Engine>> Engine::Create(const EngineOptions& options) {
  return EngineFactory::Create(options, nullptr);
}

Result<std::unique_ptr<Engine>> EngineFactory::Create(const EngineOptions& options,
                                                      Metrics* metrics) {
  if (options.communicator == nullptr) return InvalidArgument("communicator is null");
  KEEL_ASSIGN_OR_RETURN(KeelConfig config, ResolveConfig(options, options.communicator->size()));
  auto impl = std::make_unique<Engine::Impl>(options, std::move(config), metrics);
  KEEL_RETURN_IF_ERROR(impl->Init());
  return std::unique_ptr<Engine>(new Engine(std::move(impl)));
}

Engine::Engine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Engine::~Engine() = default;

int Engine::rank() const { return impl_->rank_; }
int Engine::num_ranks() const { return impl_->num_ranks_; }
int Engine::slots_per_rank() const { return impl_->slots_per_rank_; }
int Engine::transient_per_rank() const { return impl_->transient_per_rank_; }

Status Engine::RegisterSlot(int layer, int local_slot, const SlotBuffers& buffers) {
  return impl_->RegisterSlot(layer, local_slot, buffers);
}
Result<LayerRoute> Engine::Route(int layer, std::span<const int32_t> topk_ids) {
  return impl_->Route(layer, topk_ids);
}

Result<LayerRoute> Engine::RouteCounts(int layer, std::span<const int32_t> expert_counts) {
  return impl_->RouteCounts(layer, expert_counts);
}
Status Engine::ReduceGradients() { return impl_->ReduceGradients(); }
Status Engine::StepEnd() { return impl_->StepEnd(); }
std::vector<HomeSlotEntry> Engine::HomeSlots(int layer) const { return impl_->HomeSlots(layer); }
Engine::SlotLocation Engine::LocateSlot(int slot) const {
  return {impl_->RankOfPhysical(slot), impl_->LocalOfPhysical(slot)};
}
LayerPlacement Engine::placement(int layer) const {
  LayerPlacement out;
  if (layer < 0 || layer >= static_cast<int>(impl_->placements_.size())) return out;
  const Placement& p = impl_->placements_[layer];
  out.num_experts = p.num_experts();
  out.num_ranks = p.num_ranks();
  out.slots_per_rank = p.slots_per_rank();
  out.max_copies = p.max_copies();
  out.phy2log.assign(p.phy2log().begin(), p.phy2log().end());
  const std::vector<int> log2phy = p.Log2Phy(out.max_copies);
  out.log2phy.assign(log2phy.begin(), log2phy.end());
  out.logcnt.assign(p.logcnt().begin(), p.logcnt().end());
  out.home.assign(p.home().begin(), p.home().end());
  return out;
}
int64_t Engine::epoch() const { return impl_->stats_.epoch; }
EngineStats Engine::stats() const {
  EngineStats stats = impl_->stats_;
  stats.migration_in_flight = impl_->migrating();
  return stats;
}

}  // namespace keel
