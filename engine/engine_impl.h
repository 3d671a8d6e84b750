// Engine::Impl, the engine behind include/keel/engine.hpp, shared by the files that each do one
// of its jobs:
//   engine.cc        creation, slot registration, the public Engine's calls
//   routing.cc       Route / RouteCounts: counts, the per-step quota plan, transient fills
//   replica_sync.cc  ReduceGradients (fixed-order sums into homes) and the weight push to replicas
//   epochs.cc        StepEnd: the background planner and the epoch protocol (plan agreed by every
//                    rank -> transfers -> verified -> switched at the same step, or discarded)
//   resharding.cc    the keel policy's shard-or-replicate choice per expert, applied at a replan
#pragma once

#include <atomic>
#include <chrono>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "common/config.h"
#include "engine/slot_exchange.h"
#include "keel/device_memory.hpp"
#include "keel/engine.hpp"
#include "migration/expert_store.h"
#include "migration/migrator.h"
#include "monitor/metrics.h"
#include "monitor/trace_recorder.h"
#include "placement/load.h"
#include "placement/policy.h"
#include "placement/routing.h"
#include "placement/shards.h"
#include "placement/step_planner.h"

namespace keel {

inline double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

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
  Status OpenMonitorOutputs();
  Status AgreeOnSetup(const Status& local);
  // Whether the slot buffers are device memory (shape.memory = kDevice).
  bool on_device() const { return options_.shape.memory == MemoryKind::kDevice; }
  Status RegisterSlot(int layer, int local_slot, const SlotBuffers& buffers);
  Result<LayerRoute> Route(int layer, std::span<const int32_t> topk_ids);
  Result<LayerRoute> RouteCounts(int layer, std::span<const int32_t> expert_counts);
  Status ReduceGradients();
  Status StepEnd();
  std::vector<HomeSlot> HomeSlots(int layer) const;
  // Sequence migration (engine/sequences.cc).
  Result<SequencePlacement> PlanSequences(int first_layer,
                                          std::span<const SequenceRouting> sequences,
                                          const SequencePlanningOptions& options);
  bool migrating() const { return migrating_; }
  // Checkpoints (engine/checkpoint.cc).
  EngineState SaveState() const;
  Status RestoreState(const EngineState& state);
  Status SaveExperts(const std::string& dir) const;
  Status LoadExperts(const std::string& dir);
  Status BeforeFirstRoute(const char* what) const;
  int RankOfPhysical(int slot) const {
    return slot < num_slots() ? slot / slots_per_rank_
                              : (slot - num_slots()) / std::max(1, transient_per_rank_);
  }
  // The tokens [begin, end) of `tokens` that this rank routes: its share in its MP group.
  std::pair<int64_t, int64_t> Share(int64_t tokens) const {
    const int64_t size = options_.mp_group_size;
    const int64_t member = rank_ % size;
    return {tokens * member / size, tokens * (member + 1) / size};
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
  // Beyond those, the persistent slots a placement leaves empty (policy.keel.spare_slots:
  // per_step): a transient there fills that slot's buffers for the step.
  bool spare_slots_planned_ = false;
  std::optional<PolicyContext> context_;
  std::vector<std::unique_ptr<Policy>> policies_;  // [layer]
  std::vector<Placement> placements_;              // in force, over each layer's units
  std::vector<ShardMap> shards_;                   // [layer] its experts' units
  std::vector<std::string> reshard_refusals_;      // [layer] why its last reshard could not be
  // The weights' and optimizer state's tensors as a shard cuts them (RegionTensors of
  // options.shard_layout), set at creation.
  std::vector<ShardedTensor> shard_weights_;
  std::vector<ShardedTensor> shard_optimizer_;
  // Whether `shards` shards can cut both regions.
  bool ShardsFit(int shards) const {
    return ShardsDivide(shard_weights_, shards) && ShardsDivide(shard_optimizer_, shards);
  }
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
  // The physical slot of each of `routing`'s transients: on its rank, the slots `placement`
  // leaves empty first (with spare_slots_planned_, in slot order), then the transient slots.
  std::vector<int> TransientSlots(const Placement& placement, const StepRouting& routing) const;
  Status CheckAllRegistered() const;
  Status CheckRoutable(int layer) const;
  // Every layer's units from options.sharded_experts (shards_, placements_, policies_).
  Status ShardExperts();
  // Makes `map` the units of `layer`, with a policy that plans over them.
  Status SetUnits(int layer, ShardMap map);
  // Reshards the layers whose experts the keel policy now shards otherwise (resharding.cc).
  Status ReshardExperts();
  // Route's collective part: all-reduces the counts (`mine`: [num_experts] this rank's), plans
  // the quotas and transients, fills transient slots; returns all but `slot` and `send_counts`.
  Result<LayerRoute> PlanLayer(int layer, std::span<const int32_t> mine);
  Status FillTransients(int layer, const Placement& placement, const StepRouting& routing,
                        const std::vector<int>& transient_slot);
  Status ResolveMigration(bool& commit);
  Status PushWeights();
  Status AdvancePlanner();
  void AwaitPlanner();
  int64_t PlannerMilliseconds() const;  // how long the running replan has run
  Status CheckPlannerWatchdog(double slowest_seconds);
  void StartPlanner();
  Status StartMigration(std::vector<Placement> planned);
  Status RecordStep();
  bool aggregating() const { return rank_ == config_.monitor.aggregating_rank; }

  // Every copy and sum of slot buffers goes through it (host memory for MemoryKind::kHost).
  std::shared_ptr<DeviceMemory> memory_;
  DeviceBuffer sum_scratch_;          // ReduceGradients' sums, one gradient buffer each
  std::vector<std::byte> zeros_;      // host zeros that clear sum_scratch_, only ever grown
  SlotExchange exchange_;             // transient fills, weight pushes and gradients between ranks
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
  std::chrono::steady_clock::time_point planner_started_;
  int64_t planner_started_step_ = 0;
  bool planner_overdue_ = false;  // the watchdog tripped on this run: its plan will be dropped
  std::vector<Placement> planned_;
  Status planner_status_;
  double planner_seconds_ = 0;

  // Telemetry.
  std::unique_ptr<Metrics> owned_metrics_;
  Metrics* metrics_ = nullptr;
  std::unique_ptr<TraceRecorder> recorder_;
};

}  // namespace keel
