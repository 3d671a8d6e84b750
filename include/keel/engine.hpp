// Keel's C++ embedding API: the runtime a trainer calls once per MoE layer and once per step.
// Route() turns router output into physical expert copies, ReduceGradients() folds replica
// gradients into each home in a fixed order, StepEnd() pushes updated weights to replicas and
// plans and migrates the next epoch in the background. include/keel/keel.h is the C API over it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "common/config.h"
#include "common/status.h"
#include "migration/communicator.h"
#include "migration/transport.h"
#include "migration/transport_local.h"
#include "placement/placement.h"

namespace keel {

class Metrics;

// Where the registered buffers live. Device buffers need a build with CUDA.
enum class MemoryKind { kHost, kDevice };

// How ReduceGradients adds gradient buffers. Sums always run in the same fixed order (home
// first, then the other copies by ascending slot, then this step's transient replicas), so a
// given placement always gives the same bits. kFixedInt64 (gradients as int64 fixed point) is
// order-independent too: training is then bitwise identical under every placement.
enum class GradientType { kFloat32, kFloat64, kFixedInt64 };

// Shapes of the expert state the trainer owns. The engine moves and adds these bytes; it never
// interprets weights or optimizer state.
struct ExpertShape {
  size_t weight_bytes = 0;     // one expert's working weights (every copy)
  size_t gradient_bytes = 0;   // one expert's gradient buffer (every copy)
  size_t optimizer_bytes = 0;  // master weights + moments (home copies only)
  GradientType gradient_type = GradientType::kFloat32;
  MemoryKind memory = MemoryKind::kHost;
};

struct EngineOptions {
  KeelConfig config;  // validated; config.num_ranks() must equal communicator->size()
  int num_layers = 1;
  int num_experts = 1;
  int top_k = 1;  // routing choices per token
  ExpertShape shape;
  // This rank's communicator (rank and size come from it); must outlive the engine.
  Communicator* communicator = nullptr;
  // The migration transport. Null: the engine creates config.migration.transport over the
  // communicator ("local" then needs `fabric`, shared by the ranks of this process).
  Transport* transport = nullptr;
  LocalFabric* fabric = nullptr;
  // Metrics to record into (may be shared by the ranks of one process; only
  // config.monitor.aggregating_rank records). Null: that rank creates its own and serves it on
  // config.monitor.metrics_address when one is set.
  Metrics* metrics = nullptr;
};

// One slot's buffers, registered by the trainer before the first Route.
struct SlotBuffers {
  void* weights = nullptr;    // [weight_bytes]
  void* gradients = nullptr;  // [gradient_bytes], element type per ExpertShape::gradient_type
  // [optimizer_bytes]; every persistent slot needs one, since any slot can become a home.
  // Transient slots have none.
  void* optimizer = nullptr;
};

// Route()'s answer for one layer on this rank.
struct LayerRoute {
  // [num_tokens * top_k] int32: the physical slot of every (token, k), -1 where the expert id
  // was -1 (a dropped token). Slots [0, num_slots) are persistent (rank = slot / slots_per_rank);
  // slots num_slots + g * transient_per_rank + i are rank g's transient slots.
  std::vector<int32_t> slot;
  // [num_ranks] int64: (token, k) rows this rank sends to each rank (the dispatch split).
  std::vector<int64_t> send_counts;
  // [num_ranks * local_slots] int64: rows each source rank sends to each of this rank's slots,
  // local slots ordered persistent first, then transient. A dispatch that sends each rank its
  // rows sorted by (slot, token, k) lands them grouped by source, then by local slot.
  std::vector<int64_t> recv_counts;
  // [num_ranks] int64: row sums of recv_counts (the combine split).
  std::vector<int64_t> recv_totals;
  // [local_slots] int32: the expert each of this rank's slots holds for this step (persistent
  // slots from the placement in force, transient slots as filled now), -1 where none.
  std::vector<int32_t> local_experts;
  // This rank's quota table (kernels/remap.h), which `slot` was assigned from: the copies of
  // expert e are c in [copy_begin[e], copy_begin[e + 1]); copy c is physical slot copy_slot[c]
  // and takes copy_quota[c] of this rank's entries of e, in entry order; entries past the quotas
  // go to e's last copy. kernels::gpu::RemapWithQuotas takes these four arrays as they are.
  std::vector<int32_t> copy_begin;  // [num_experts + 1]
  std::vector<int32_t> copy_slot;   // [num_copies]
  std::vector<int32_t> copy_quota;  // [num_copies]
  std::vector<int32_t> slot_rank;   // [num_slots + num_ranks * transient_per_rank]
  int64_t epoch = 0;                // the placement epoch this routing used
};

// A slot of this rank that holds an expert's home: the trainer runs the optimizer there.
struct HomeSlot {
  int expert = 0;
  int local_slot = 0;  // index into this rank's persistent slots
};

// What the engine did so far on this rank.
struct EngineStats {
  int64_t steps = 0;
  int64_t epoch = 0;
  int64_t epochs_committed = 0;
  int64_t epochs_aborted = 0;
  int64_t plans_unchanged = 0;           // planner runs that kept the placement
  int64_t plans_failed = 0;              // planner runs that failed (the placement stays)
  bool migration_in_flight = false;      // an epoch's transfers are running
  uint64_t bytes_moved = 0;              // migration bytes of all ranks (sent + copied locally)
  double exposed_migration_seconds = 0;  // ReduceGradients waiting for transfers
  double route_seconds = 0;              // time inside Route (the engine's hot path)
  double control_seconds = 0;            // ReduceGradients + StepEnd, excluding that waiting
  Status last_abort;                     // why the last aborted epoch aborted
  Status last_plan_error;                // why the last failed planner run failed
};

class Engine {
 public:
  // Collective: every rank creates its engine with the same config and shapes. Fails with a
  // message naming the bad field and value.
  static Result<std::unique_ptr<Engine>> Create(const EngineOptions& options);
  // Cancels a running migration (bounded by its deadline) and stops the planner thread.
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  int rank() const;
  int num_ranks() const;
  int slots_per_rank() const;  // persistent
  int transient_per_rank() const;
  int local_slots() const { return slots_per_rank() + transient_per_rank(); }

  // Registers this rank's buffers of `layer`'s local slot `local_slot` (persistent slots
  // [0, slots_per_rank), then transient ones). Every slot of every layer must be registered
  // before the first Route. The trainer fills every persistent slot with its expert's initial
  // weights (placement(layer) says which expert) and the home slots (HomeSlots) with their
  // optimizer state; from then on StepEnd keeps every replica equal to its home.
  Status RegisterSlot(int layer, int local_slot, const SlotBuffers& buffers);

  // Collective per layer, in layer order. topk_ids: [num_tokens, top_k] int32 logical expert ids
  // (-1 = dropped). Counts them, all-gathers every rank's counts, splits each expert's tokens
  // among its copies (quotas, transient replicas; the same plan on every rank), fills this
  // step's transient slots with their expert's weights and returns the physical routing.
  Result<LayerRoute> Route(int layer, std::span<const int32_t> topk_ids);

  // Route for a trainer that counts and assigns its entries on the GPU (kernels/): it passes
  // this rank's count per expert (kernels::gpu::ExpertHistogram), gets everything Route returns
  // except `slot` (empty), and assigns slots with kernels::gpu::RemapWithQuotas from the
  // returned quota table, which gives the same slots Route would. expert_counts: [num_experts]
  // int32, each >= 0. Collective like Route; a layer takes one of the two per step.
  Result<LayerRoute> RouteCounts(int layer, std::span<const int32_t> expert_counts);

  // Collective, after the backward of every layer and before the optimizer. If an epoch's
  // transfers are running, waits for them (exposed migration time) and, when every rank verified
  // them, switches to the new placement now; otherwise discards them and keeps the old one. Then
  // adds every copy's gradient (persistent replicas and this step's transient replicas) into the
  // expert's home slot in a fixed order. Afterwards HomeSlots() lists where the optimizer runs.
  Status ReduceGradients();

  // Collective, after the optimizer updated the homes: copies every home's weights to its
  // replicas, feeds the load estimator, and every policy.replan_interval_steps starts the planner
  // thread; a plan every rank has finished is turned into transfers that run in the background
  // until ReduceGradients of a later step.
  Status StepEnd();

  // Where physical slot `slot` (LayerRoute::slot's numbering) lives: its rank and its local slot
  // there (persistent slots first, then transient ones).
  struct SlotLocation {
    int rank = 0;
    int local_slot = 0;
  };
  SlotLocation LocateSlot(int slot) const;

  // This rank's home slots of `layer` under the placement in force.
  std::vector<HomeSlot> HomeSlots(int layer) const;
  // The placement in force for `layer` (same on every rank).
  const Placement& placement(int layer) const;
  int64_t epoch() const;
  EngineStats stats() const;

 private:
  class Impl;
  explicit Engine(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace keel
