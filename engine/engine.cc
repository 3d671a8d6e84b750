// Engine creation (config, memory, transport, telemetry), slot registration, and the public
// Engine's calls, which forward to Engine::Impl (engine_impl.h says which file does what).
#include "engine/engine_impl.h"

#include <string>
#include <utility>

#include "common/file.h"
#include "engine/engine_internal.h"
#include "keel/limits.hpp"
#include "migration/transport_factory.h"
#include "migration/transport_local.h"
#include "migration/transport_staged.h"

namespace keel {
namespace {

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

// The layout must describe the regions whole, each tensor at least one element.
Status CheckShardLayout(const EngineOptions& o) {
  const std::pair<const char*, size_t> regions[] = {{"weights", o.shape.weight_bytes},
                                                    {"optimizer", o.shape.optimizer_bytes}};
  const std::vector<ShardedTensor>* layouts[] = {&o.shard_layout.weights,
                                                 &o.shard_layout.optimizer};
  for (int r = 0; r < 2; ++r) {
    if (layouts[r]->empty()) continue;
    size_t bytes = 0;
    for (size_t t = 0; t < layouts[r]->size(); ++t) {
      const ShardedTensor& tensor = (*layouts[r])[t];
      if (tensor.rows == 0 || tensor.columns == 0 || tensor.element_bytes == 0) {
        return InvalidArgument("shard_layout." + std::string(regions[r].first) + "[" +
                               std::to_string(t) + "] has a zero dimension");
      }
      bytes += tensor.bytes();
    }
    if (bytes != regions[r].second) {
      return InvalidArgument("shard_layout." + std::string(regions[r].first) + " covers " +
                             std::to_string(bytes) + " bytes, but the shape's region has " +
                             std::to_string(regions[r].second));
    }
  }
  return Status::Ok();
}

std::string ShardsFingerprint(const EngineOptions& o) {
  std::string text;
  for (const ShardedExpert& s : o.sharded_experts) {
    text += " shard " + std::to_string(s.layer) + ":" + std::to_string(s.expert) + "/" +
            std::to_string(s.shards);
  }
  return text;
}

std::string ShapeFingerprint(const EngineOptions& o, const KeelConfig& config) {
  return ConfigToYaml(config) + "\nlayers " + std::to_string(o.num_layers) + " experts " +
         std::to_string(o.num_experts) + " top_k " + std::to_string(o.top_k) + " weights " +
         std::to_string(o.shape.weight_bytes) + " gradients " +
         std::to_string(o.shape.gradient_bytes) + " optimizer " +
         std::to_string(o.shape.optimizer_bytes) + " gradient type " +
         std::to_string(static_cast<int>(o.shape.gradient_type)) + " memory " +
         std::to_string(static_cast<int>(o.shape.memory)) + " mp " +
         std::to_string(o.mp_group_size) + ShardsFingerprint(o);
}

}  // namespace

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
  // Upper bounds, so that a wrong size fails here rather than exhausting memory.
  const auto at_most = [](const std::string& field, long long value, long long most) -> Status {
    if (value <= most) return Status::Ok();
    return InvalidArgument(std::string(field) + " = " + std::to_string(value) + " is more than " +
                           std::to_string(most));
  };
  KEEL_RETURN_IF_ERROR(positive("num_layers", options_.num_layers));
  KEEL_RETURN_IF_ERROR(positive("num_experts", options_.num_experts));
  KEEL_RETURN_IF_ERROR(positive("top_k", options_.top_k));
  KEEL_RETURN_IF_ERROR(at_most("num_layers", options_.num_layers, kMaxLayers));
  KEEL_RETURN_IF_ERROR(at_most("num_experts", options_.num_experts, kMaxExperts));
  KEEL_RETURN_IF_ERROR(
      positive("shape.weight_bytes", static_cast<long long>(options_.shape.weight_bytes)));
  const size_t element = GradientElementBytes(options_.shape.gradient_type);
  if (options_.shape.gradient_bytes == 0 || options_.shape.gradient_bytes % element != 0) {
    return InvalidArgument(
        "shape.gradient_bytes = " + std::to_string(options_.shape.gradient_bytes) +
        " must be a positive multiple of the gradient element size " + std::to_string(element));
  }
  if (options_.mp_group_size < 1 || config.topology.gpus_per_node % options_.mp_group_size != 0) {
    return InvalidArgument("mp_group_size = " + std::to_string(options_.mp_group_size) +
                           " does not divide topology.gpus_per_node = " +
                           std::to_string(config.topology.gpus_per_node) +
                           " (an MP group lives in one node)");
  }
  if (options_.top_k > options_.num_experts) {
    return InvalidArgument("top_k = " + std::to_string(options_.top_k) +
                           " exceeds num_experts = " + std::to_string(options_.num_experts));
  }
  // Products of sizes the engine keeps tables of: every layer's placement, and every layer's
  // load estimates by source rank.
  const int64_t slots_per_layer =
      int64_t{num_ranks_} * (config.slots.persistent_per_rank + config.slots.transient_per_rank);
  KEEL_RETURN_IF_ERROR(
      at_most("num_layers x slots per layer (" + std::to_string(slots_per_layer) + ")",
              options_.num_layers * slots_per_layer, kMaxSlots));
  KEEL_RETURN_IF_ERROR(CheckEstimatorCounts(config.estimator, options_.num_layers, num_ranks_,
                                            options_.num_experts, config.estimator.window_steps));
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
  const bool keel_transients =
      config.policy.name == "keel" && config.policy.keel.transient_replicas;
  transients_planned_ = keel_transients ? transient_per_rank_ : 0;
  spare_slots_planned_ = config.policy.name == "keel" && config.policy.keel.spare_slots_per_step();
  // A policy per layer (policies keep no state across layers), so that the planner thread
  // replans the layers in parallel.
  for (int l = 0; l < options_.num_layers; ++l) {
    KEEL_ASSIGN_OR_RETURN(std::unique_ptr<Policy> policy,
                          MakePolicy(config.policy.name, *context_));
    KEEL_ASSIGN_OR_RETURN(Placement initial, policy->Initial(l));
    policies_.push_back(std::move(policy));
    placements_.push_back(std::move(initial));
  }
  KEEL_RETURN_IF_ERROR(ShardExperts());

  const size_t slots = static_cast<size_t>(options_.num_layers) * local_slots();
  buffers_.resize(slots);
  is_registered_.assign(slots, false);
  step_.assign(options_.num_layers, {});
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
  if (on_device() && transport_->device_memory() == nullptr) {
    // A transport of host memory only: device buffers travel through host staging buffers.
    KEEL_ASSIGN_OR_RETURN(staged_transport_, CreateStagedTransport(*transport_, memory_));
    transport_ = staged_transport_.get();
  }
  if (transport_->rank() != rank_ || transport_->num_ranks() != num_ranks_) {
    return InvalidArgument("transport is rank " + std::to_string(transport_->rank()) + " of " +
                           std::to_string(transport_->num_ranks()) + ", the communicator rank " +
                           std::to_string(rank_) + " of " + std::to_string(num_ranks_));
  }

  // The aggregating rank's outputs can fail where no other rank's can (a port in use, a missing
  // folder): every rank hears of it now, rather than at its first collective's deadline.
  return AgreeOnSetup(aggregating() ? OpenMonitorOutputs() : Status::Ok());
}

// Every layer's units: a layer with sharded experts places them with PlaceShards, starting from
// its policy's first placement, and replans them with a policy over its units.
Status Engine::Impl::ShardExperts() {
  const int num_layers = options_.num_layers;
  const int num_experts = options_.num_experts;
  const int per_node = context_->topology.gpus_per_node();
  KEEL_RETURN_IF_ERROR(CheckShardLayout(options_));
  shard_weights_ = RegionTensors(options_.shard_layout.weights, options_.shape.weight_bytes);
  shard_optimizer_ = RegionTensors(options_.shard_layout.optimizer, options_.shape.optimizer_bytes);
  std::vector<std::vector<int>> shards(num_layers, std::vector<int>(num_experts, 1));
  for (size_t i = 0; i < options_.sharded_experts.size(); ++i) {
    const ShardedExpert& s = options_.sharded_experts[i];
    const std::string field = "sharded_experts[" + std::to_string(i) + "]";
    if (s.layer < 0 || s.layer >= num_layers) {
      return InvalidArgument(field + ".layer = " + std::to_string(s.layer) + " is not in [0, " +
                             std::to_string(num_layers) + ")");
    }
    if (s.expert < 0 || s.expert >= num_experts) {
      return InvalidArgument(field + ".expert = " + std::to_string(s.expert) + " is not in [0, " +
                             std::to_string(num_experts) + ")");
    }
    if (s.shards < 2 || s.shards > per_node) {
      return InvalidArgument(field + ".shards = " + std::to_string(s.shards) +
                             " is not in [2, topology.gpus_per_node = " + std::to_string(per_node) +
                             "]");
    }
    if (!ShardsFit(s.shards)) {
      return InvalidArgument(field + ".shards = " + std::to_string(s.shards) +
                             " does not divide every tensor of shard_layout (or the regions' "
                             "bytes)");
    }
    int& count = shards[s.layer][s.expert];
    if (count != 1) {
      return InvalidArgument(field + " shards layer " + std::to_string(s.layer) + " expert " +
                             std::to_string(s.expert) + " a second time");
    }
    count = s.shards;
  }
  shards_.assign(num_layers, ShardMap::Whole(num_experts));
  reshard_refusals_.assign(num_layers, "");
  for (int l = 0; l < num_layers; ++l) {
    KEEL_ASSIGN_OR_RETURN(ShardMap map, ShardMap::Create(std::move(shards[l])));
    if (!map.sharded()) continue;
    Result<Placement> units = PlaceShards(placements_[l], map, context_->topology);
    if (!units.ok()) return units.status().WithContext("layer " + std::to_string(l));
    placements_[l] = std::move(*units);
    KEEL_RETURN_IF_ERROR(SetUnits(l, std::move(map)));
  }
  return Status::Ok();
}

Status Engine::Impl::SetUnits(int layer, ShardMap map) {
  if (map.shard_counts() == shards_[layer].shard_counts()) return Status::Ok();
  PolicyContext unit_context = *context_;
  unit_context.num_experts = map.num_units();
  KEEL_ASSIGN_OR_RETURN(policies_[layer], MakePolicy(config_.policy.name, unit_context));
  shards_[layer] = std::move(map);
  return Status::Ok();
}

// The metrics exporter and the trace recorder of the aggregating rank.
Status Engine::Impl::OpenMonitorOutputs() {
  const KeelConfig& config = config_;
  metrics_ = shared_metrics_;
  if (metrics_ == nullptr && !config.monitor.metrics_address.empty()) {
    KEEL_ASSIGN_OR_RETURN(owned_metrics_,
                          Metrics::Create(MetricsLayout::FromConfig(config, options_.num_layers,
                                                                    options_.num_experts, rank_)));
    KEEL_RETURN_IF_ERROR(owned_metrics_->Serve(config.monitor.metrics_address)
                             .WithContext("monitor.metrics_address"));
    metrics_ = owned_metrics_.get();
  }
  if (!config.monitor.trace_path.empty()) {
    // A config file that names itself as the trace to record would be replaced by it.
    KEEL_RETURN_IF_ERROR(CheckOutputsApart({{"config_path", options_.config_path}},
                                           {{"monitor.trace_path", config.monitor.trace_path}}));
    TraceRecorderOptions trace;
    trace.path = config.monitor.trace_path;
    trace.description = "recorded by the keel engine";
    trace.num_layers = options_.num_layers;
    trace.num_experts = options_.num_experts;
    trace.num_sources = num_ranks_;
    trace.sample_interval_steps = config.monitor.trace_sample_interval_steps;
    Result<std::unique_ptr<TraceRecorder>> recorder = TraceRecorder::Open(trace);
    if (!recorder.ok()) return recorder.status().WithContext("monitor.trace_path");
    recorder_ = std::move(*recorder);
  }
  if (metrics_ != nullptr) metrics_->SetEpoch(0);
  return Status::Ok();
}

// Every rank's `local` setup result; the first failure (a rank's own, else the lowest failed
// rank's) for all of them.
Status Engine::Impl::AgreeOnSetup(const Status& local) {
  KEEL_ASSIGN_OR_RETURN(std::vector<std::string> verdicts,
                        communicator_.AllGather(local.ok() ? "" : local.ToString()));
  if (!local.ok()) return local;
  for (int r = 0; r < num_ranks_; ++r) {
    if (!verdicts[r].empty()) {
      return FailedPrecondition("rank " + std::to_string(r) +
                                " could not create its engine: " + verdicts[r]);
    }
  }
  return Status::Ok();
}

// Where the slot buffers live: host memory, the device memory the options name, or this rank's
// GPU.
Status Engine::Impl::ChooseMemory() {
  if (!on_device()) {
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
  if (on_device()) {
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

std::vector<HomeSlot> Engine::Impl::HomeSlots(int layer) const {
  std::vector<HomeSlot> homes;
  if (layer < 0 || layer >= options_.num_layers) return homes;
  const Placement& p = placements_[layer];
  const ShardMap& units = shards_[layer];
  for (int u = 0; u < p.num_experts(); ++u) {
    if (p.home(u) != rank_) continue;
    const int expert = units.expert_of(u);
    homes.push_back(
        {expert, p.home_slot(u) % slots_per_rank_, units.shard_of(u), units.shards(expert)});
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
bool Engine::shards_experts() const {
  std::lock_guard<std::mutex> lock(impl_->call_mutex_);
  if (impl_->config_.policy.name == "keel" && impl_->config_.policy.keel.shard_experts) return true;
  for (const ShardMap& map : impl_->shards_) {
    if (map.sharded()) return true;
  }
  return false;
}

Status Engine::RegisterSlot(int layer, int local_slot, const SlotBuffers& buffers) {
  Impl::ExclusiveCall call(*impl_, "RegisterSlot");
  KEEL_RETURN_IF_ERROR(call.status());
  return impl_->RegisterSlot(layer, local_slot, buffers);
}
Result<LayerRoute> Engine::Route(int layer, std::span<const int32_t> topk_ids) {
  Impl::ExclusiveCall call(*impl_, "Route");
  KEEL_RETURN_IF_ERROR(call.status());
  return impl_->Route(layer, topk_ids);
}

Result<LayerRoute> Engine::RouteCounts(int layer, std::span<const int32_t> expert_counts) {
  Impl::ExclusiveCall call(*impl_, "RouteCounts");
  KEEL_RETURN_IF_ERROR(call.status());
  return impl_->RouteCounts(layer, expert_counts);
}
Result<SequencePlacement> Engine::PlanSequences(int first_layer,
                                                std::span<const SequenceRouting> sequences,
                                                const SequencePlanningOptions& options) {
  Impl::ExclusiveCall call(*impl_, "PlanSequences");
  KEEL_RETURN_IF_ERROR(call.status());
  return impl_->PlanSequences(first_layer, sequences, options);
}
Status Engine::ReduceGradients() {
  Impl::ExclusiveCall call(*impl_, "ReduceGradients");
  KEEL_RETURN_IF_ERROR(call.status());
  return impl_->ReduceGradients();
}
Status Engine::StepEnd() {
  Impl::ExclusiveCall call(*impl_, "StepEnd");
  KEEL_RETURN_IF_ERROR(call.status());
  return impl_->StepEnd();
}
std::vector<HomeSlot> Engine::HomeSlots(int layer) const {
  std::lock_guard<std::mutex> lock(impl_->call_mutex_);
  return impl_->HomeSlots(layer);
}
Engine::SlotLocation Engine::LocateSlot(int slot) const {
  return {impl_->RankOfPhysical(slot), impl_->LocalOfPhysical(slot)};
}
LayerPlacement Engine::placement(int layer) const {
  std::lock_guard<std::mutex> lock(impl_->call_mutex_);
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
  const ShardMap& units = impl_->shards_[layer];
  for (int u = 0; u < units.num_units(); ++u) {
    out.unit_expert.push_back(units.expert_of(u));
    out.unit_shard.push_back(units.shard_of(u));
    out.unit_shards.push_back(units.shards(units.expert_of(u)));
  }
  return out;
}
int64_t Engine::epoch() const {
  std::lock_guard<std::mutex> lock(impl_->call_mutex_);
  return impl_->stats_.epoch;
}
EngineStats Engine::stats() const {
  std::lock_guard<std::mutex> lock(impl_->call_mutex_);
  EngineStats stats = impl_->stats_;
  stats.migration_in_flight = impl_->migrating();
  return stats;
}

}  // namespace keel
