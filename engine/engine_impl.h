// Engine::Impl, the engine behind include/keel/engine.hpp, shared by the files that each do one
// of its jobs:
//   engine.cc        creation, slot registration, the public Engine's calls (one at a time)
//   agreement.cc     every collective call's first all-reduce: all ranks make the same call
//   routing.cc       Route / RouteCounts: counts, the per-micro-batch quota plan, transient fills
//   replica_sync.cc  ReduceGradients (fixed-order sums into homes) and the weight push to replicas
//   epochs.cc        StepEnd: the background planner and the epoch protocol (plan agreed by every
//                    rank -> transfers -> verified -> switched at the same step, or discarded)
//   resharding.cc    the keel policy's shard-or-replicate choice per expert, applied at a replan
#pragma once

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
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

// The engine's collective calls, as each rank announces them to the others (AgreeOnCall). Route
// and RouteCounts are one call: they plan the same from the same counts.
enum class CollectiveCall : int64_t {
  kRoute = 1,
  kReduceGradients,
  kStepEnd,
  kPlanSequences,
  kRestoreState,
};

// One layer's routing in the step under way, over all of its micro-batches (every Route of the
// layer between two StepEnds).
struct LayerStep {
  int routes = 0;               // micro-batches routed so far
  std::vector<double> traffic;  // [num_ranks * num_experts] summed over them, by expert
  // The transient replicas filled so far, in fill order, and the physical slot of each. A
  // transient slot keeps its expert until StepEnd, so that its gradient buffer accumulates every
  // micro-batch's gradients of that one expert; later micro-batches plan with these as copies.
  std::vector<TransientReplica> transients;
  std::vector<int> transient_slot;
};

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
  // The first collective of every collective call (agreement.cc): one all-reduce of a fixed size
  // in which each rank announces its call, its layer and micro-batch, its step and whether its
  // own checks of the arguments passed (`local`), and Route adds its counts by expert
  // (`expert_counts`, [num_experts]; empty for the other calls). Every rank gets the same answer:
  // the error of a rank whose checks failed, or a mismatch that names two ranks' calls, is
  // returned on every rank, before any state changes. The sums of the counts are left in
  // by_expert_ ([num_experts * num_ranks], e * num_ranks + rank).
  Status AgreeOnCall(CollectiveCall call, int layer, const Status& local,
                     std::span<const int32_t> expert_counts = {});
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
  // RestoreState's checks of `state` on this rank alone; fills the placements and units it sets.
  Status CheckState(const EngineState& state, std::vector<Placement>& restored,
                    std::vector<ShardMap>& units) const;
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
  // One call at a time (engine.cc's ExclusiveCall): the call that holds it, for the error that
  // refuses a second thread.
  mutable std::mutex call_mutex_;
  std::atomic<const char*> running_call_{nullptr};

  // Holds an engine for one public call. A call from a second thread while another runs would
  // interleave the two calls' collectives and scratch buffers, so calls that return a Status are
  // refused with an error that names both (status()); the accessors that cannot fail wait for the
  // call in progress instead (Engine's const calls take call_mutex_ directly).
  class ExclusiveCall {
   public:
    ExclusiveCall(Impl& impl, const char* name)
        : impl_(impl), lock_(impl.call_mutex_, std::try_to_lock) {
      if (lock_.owns_lock()) {
        impl.running_call_.store(name);
        return;
      }
      const char* running = impl.running_call_.load();
      status_ = FailedPrecondition(
          std::string("Engine::") + name + " was called while " +
          (running != nullptr ? "Engine::" + std::string(running) : std::string("another call")) +
          " runs on another thread: an engine takes one call at a time");
    }
    ~ExclusiveCall() {
      if (lock_.owns_lock()) impl_.running_call_.store(nullptr);
    }
    ExclusiveCall(const ExclusiveCall&) = delete;
    ExclusiveCall& operator=(const ExclusiveCall&) = delete;

    const Status& status() const { return status_; }

   private:
    Impl& impl_;
    std::unique_lock<std::mutex> lock_;
    Status status_;
  };

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
  // The physical slot of each of `routing`'s transients: those `step` filled already keep their
  // slots; each new one takes its rank's first free slot, those `placement` leaves empty first
  // (with spare_slots_planned_, in slot order), then the transient slots.
  std::vector<int> TransientSlots(const Placement& placement, const StepRouting& routing,
                                  const LayerStep& step) const;
  Status CheckAllRegistered() const;
  Status CheckRoutable(int layer) const;
  Status CheckRouteCounts(int layer, std::span<const int32_t> expert_counts) const;
  // The micro-batch that the next Route of `layer` is (-1 for a layer out of range).
  int NextMicroBatch(int layer) const {
    return layer >= 0 && layer < options_.num_layers ? step_[layer].routes : -1;
  }
  // Every layer's units from options.sharded_experts (shards_, placements_, policies_).
  Status ShardExperts();
  // Makes `map` the units of `layer`, with a policy that plans over them.
  Status SetUnits(int layer, ShardMap map);
  // Reshards the layers whose experts the keel policy now shards otherwise (resharding.cc).
  Status ReshardExperts();
  // Route's collective part after AgreeOnCall (whose counts by expert are in by_expert_): plans
  // the micro-batch's quotas and transients, fills the new transient slots; returns all but
  // `slot` and `send_counts`.
  Result<LayerRoute> PlanLayer(int layer);
  // Fills the transient slots of routing.transients[first...] with their expert's weights.
  Status FillTransients(int layer, const Placement& placement, const StepRouting& routing,
                        const std::vector<int>& transient_slot, size_t first);
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

  // This step.
  std::vector<LayerStep> step_;     // [layer]
  bool gradients_reduced_ = false;  // ReduceGradients ran; StepEnd comes next
  // One per layer: each keeps what its placement alone decides, and its buffers, between steps.
  std::vector<std::unique_ptr<StepPlanner>> planners_;
  std::vector<int64_t> agreement_;  // scratch: AgreeOnCall's all-reduce
  std::vector<int32_t> by_expert_;  // a micro-batch's traffic by expert, as the planner takes it
  std::vector<int32_t> by_unit_;    // the same by unit, for a layer with sharded experts
  StepRouting plan_scratch_;        // scratch: the routing being planned
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
