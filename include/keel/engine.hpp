// Keel's C++ embedding API: the runtime a trainer calls per MoE layer and micro-batch, and once
// per optimizer step.
// Route() turns router output into physical expert copies, ReduceGradients() folds replica
// gradients into each home in a fixed order, StepEnd() pushes updated weights to replicas and
// plans and migrates the next epoch in the background. include/keel/keel.h is the C API over it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "keel/communicator.hpp"
#include "keel/config.hpp"
#include "keel/device_memory.hpp"
#include "keel/local_group.hpp"
#include "keel/shard_layout.hpp"
#include "keel/status.hpp"
#include "keel/transport.hpp"

namespace keel {

// Where the registered buffers live. With kDevice the engine never touches them from the CPU:
// every copy and gradient sum goes through EngineOptions::device_memory.
enum class MemoryKind { kHost, kDevice };

// GradientType (how ReduceGradients adds gradient buffers) is in keel/device_memory.hpp.

// Shapes of the expert state the trainer owns. The engine moves and adds these bytes; it never
// interprets weights or optimizer state.
struct ExpertShape {
  size_t weight_bytes = 0;     // one expert's working weights (every copy)
  size_t gradient_bytes = 0;   // one expert's gradient buffer (every copy)
  size_t optimizer_bytes = 0;  // master weights + moments (home copies only)
  GradientType gradient_type = GradientType::kFloat32;
  MemoryKind memory = MemoryKind::kHost;
};

// An expert split over `shards` slots, as ESP and Parm shard experts (docs/strategies.md): its
// FFN's inner dimension split `shards` ways, each shard an FFN of its own with its slice of the
// weights, gradients and optimizer state. Every (token, k) routed to the expert goes to all of its
// shards, and the combine adds up their outputs. The engine places, replicates, moves and
// optimizes every shard as an expert of its own. A shard's state comes first in its slot's
// buffers, cut as EngineOptions::shard_layout says; the rest of the slot is unused.
struct ShardedExpert {
  int layer = 0;
  int expert = 0;
  int shards = 2;  // in [2, topology.gpus_per_node]: a sharded expert starts within one node
};

struct EngineOptions {
  // The configuration (docs/config.md): `config`, YAML text `config_yaml`, or a YAML file
  // `config_path`; at most one of the three. None: every key at its default, with the topology
  // set to one node of communicator->size() ranks. Its ranks (topology.num_nodes x
  // topology.gpus_per_node) must equal communicator->size().
  std::optional<Config> config;
  std::string config_yaml;
  std::string config_path;
  int num_layers = 1;   // in [1, 65536]
  int num_experts = 1;  // in [1, 65536]
  int top_k = 1;        // routing choices per token
  // Parm's de-duplicated dispatch (docs/strategies.md): ranks [g * M, (g + 1) * M) form a
  // tensor-parallel (MP) group that holds the same tokens and passes the same topk_ids to Route.
  // Each member routes and dispatches only its share of them (LayerRoute::share_begin,
  // share_end), and the trainer all-gathers the group's combined outputs afterwards, so no
  // (token, k) travels twice. M must divide topology.gpus_per_node; 1: every rank routes all of
  // its tokens.
  int mp_group_size = 1;
  ExpertShape shape;
  // This rank's communicator (rank and size come from it); must outlive the engine.
  Communicator* communicator = nullptr;
  // The migration transport; must outlive the engine. Null: the engine creates the one that
  // migration.transport names, over the communicator: "ucx" and "nccl" bootstrap over it,
  // "local" connects to `local_group` (the group the communicator joined).
  Transport* transport = nullptr;
  LocalGroup* local_group = nullptr;
  // With shape.memory = kDevice: the device memory that holds the slot buffers (the same object
  // the trainer allocated them from, or any object that recognizes them). Null: CUDA device
  // memory on the device current on the creating thread (CreateCudaDeviceMemory). A transport
  // without device support (device_memory() null) is staged through host memory over it, and so
  // are the slot bytes the communicator carries (transient fills, weight pushes, replica
  // gradients) unless it moves device memory itself (Communicator::MovesDeviceMemory).
  // Ignored with kHost.
  std::shared_ptr<DeviceMemory> device_memory;
  // Experts to shard, each (layer, expert) at most once; the others stay whole. Each shard j >= 1
  // starts on an empty persistent slot of another rank of its expert's node (a free slot per shard
  // is needed). A layer with sharded experts takes Route, not RouteCounts, and no sequence plans.
  std::vector<ShardedExpert> sharded_experts;
  // How a shard cuts the weights and optimizer state (keel/shard_layout.hpp), for resharding:
  // every shard count the engine uses must divide each tensor's split dimension.
  ShardLayout shard_layout;
};

// A layer's placement in force, in DeepSeek EPLB's shapes (the same on every rank). Its experts are
// the layer's units: each expert that is not sharded, and each shard of a sharded one
// (EngineOptions::sharded_experts); without sharded experts, unit e is expert e.
struct LayerPlacement {
  int num_experts = 0;  // units
  int num_ranks = 0;
  int slots_per_rank = 0;  // persistent
  int max_copies = 0;      // the width of log2phy
  // [num_ranks * slots_per_rank] int32: the expert each persistent slot holds, -1 for none; slot
  // s lives on rank s / slots_per_rank.
  std::vector<int32_t> phy2log;
  // [num_experts, max_copies] int32: the slots holding each expert, ascending, padded with -1.
  std::vector<int32_t> log2phy;
  std::vector<int32_t> logcnt;  // [num_experts] int32: copies per expert
  std::vector<int32_t> home;    // [num_experts] int32: the rank of each expert's home
  // [num_experts] int32 each: the expert each unit is a part of, which shard it is, and how many
  // shards that expert has (1: the whole expert).
  std::vector<int32_t> unit_expert;
  std::vector<int32_t> unit_shard;
  std::vector<int32_t> unit_shards;

  int expert_at(int slot) const { return phy2log[static_cast<size_t>(slot)]; }
};

// One slot's buffers, registered by the trainer before the first Route.
struct SlotBuffers {
  void* weights = nullptr;    // [weight_bytes]
  void* gradients = nullptr;  // [gradient_bytes], element type per ExpertShape::gradient_type
  // [optimizer_bytes]; every persistent slot needs one, since any slot can become a home.
  // Transient slots have none.
  void* optimizer = nullptr;
};

// Route()'s answer for one layer on this rank. Its rows are the (token, k) entries, except that an
// entry of a sharded expert is one row per shard.
struct LayerRoute {
  // [rows] int32: the physical slot of every row, -1 where the expert id was -1 (a dropped
  // token). Slots [0, num_slots) are persistent (rank = slot / slots_per_rank); slots num_slots +
  // g * transient_per_rank + i are rank g's transient slots. With policy.keel.spare_slots:
  // per_step a persistent slot the placement leaves empty may hold a transient replica for the
  // step: local_experts says which expert each slot holds now.
  std::vector<int32_t> slot;
  // [rows] int32: the (token, k) entry (token * top_k + k) of every row, in entry order, an
  // entry's shards in shard order; empty when the layer has no sharded expert (then row i is
  // entry i). A row's output is part of its entry's: the combine adds the rows of an entry up.
  std::vector<int32_t> row_entry;
  // [num_ranks] int64: (token, k) rows this rank sends to each rank (the dispatch split).
  std::vector<int64_t> send_counts;
  // [num_ranks * local_slots] int64: rows each source rank sends to each of this rank's slots,
  // local slots ordered persistent first, then transient. A dispatch that sends each rank its
  // rows sorted by (slot, token, k) lands them grouped by source, then by local slot.
  std::vector<int64_t> recv_counts;
  // [num_ranks] int64: row sums of recv_counts (the combine split).
  std::vector<int64_t> recv_totals;
  // [local_slots] int32: the expert each of this rank's slots holds for this step (persistent
  // slots from the placement in force, transient replicas as filled now, in transient slots or,
  // with policy.keel.spare_slots: per_step, in empty persistent slots), -1 where none.
  std::vector<int32_t> local_experts;
  // [local_slots] int32: which shard of its expert each slot holds, of how many (0 of 1: the
  // whole expert; 0 of 0 for an empty slot).
  std::vector<int32_t> local_shard;
  std::vector<int32_t> local_shards;
  // This rank's quota table (kernels/remap.h), which `slot` was assigned from (over the layer's
  // units: LayerPlacement): the copies of unit e are c in [copy_begin[e], copy_begin[e + 1]); copy
  // c is physical slot copy_slot[c] and takes copy_quota[c] of this rank's entries of e, in entry
  // order; entries past the quotas go to e's last copy. kernels::gpu::RemapWithQuotas takes these
  // four arrays as they are.
  std::vector<int32_t> copy_begin;  // [units + 1]
  std::vector<int32_t> copy_slot;   // [num_copies]
  std::vector<int32_t> copy_quota;  // [num_copies]
  std::vector<int32_t> slot_rank;   // [num_slots + num_ranks * transient_per_rank]
  int64_t epoch = 0;                // the placement epoch this routing used
  // The tokens [share_begin, share_end) of topk_ids this rank routes: member m of an MP group of
  // M (EngineOptions::mp_group_size) takes [m * T / M, (m + 1) * T / M) of the T tokens; the
  // other tokens' entries get slot -1. Without MP groups, every token. (Route only: RouteCounts
  // leaves both 0.)
  int64_t share_begin = 0;
  int64_t share_end = 0;
};

// A slot of this rank that holds an expert's home: the trainer runs the optimizer there.
struct HomeSlot {
  int expert = 0;
  int local_slot = 0;  // index into this rank's persistent slots
  int shard = 0;       // the part of the expert it holds: shard `shard` of `shards`
  int shards = 1;
};

// One of this rank's sequences, as Engine::PlanSequences sees it.
struct SequenceRouting {
  int64_t tokens = 0;  // its tokens (the token bound counts them, a move carries them)
  // [planned layers * num_experts] int32: the (token, k) rows the sequence sends to each expert
  // in each planned layer, layer-major; each >= 0.
  std::vector<int32_t> expert_rows;
};

// What Engine::PlanSequences minimises (placement/sequence_planner.h); either way the cost
// model's step decides whether the plan is used.
enum class SequencePlanObjective {
  kStepTime,  // the cost model's step: the slowest rank's links and experts
  kTraffic,   // the summed link time of rows and moves: cross-node bytes weigh most
};

struct SequencePlanningOptions {
  SequencePlanObjective objective = SequencePlanObjective::kStepTime;
  // No rank ends with more than this times the mean tokens (a rank already above it keeps what
  // it has but takes no more), so attention and dense layers stay balanced. >= 1.
  double max_token_imbalance = 1.10;
  // Bytes one token carries when its sequence moves, each way (hidden states there, gradient
  // back); 0: the cost model's token row, cost_model.hidden_size x cost_model.dtype_bytes.
  double move_bytes_per_token = 0;
};

// Engine::PlanSequences' answer, the same on every rank: every rank's sequences, rank 0's
// first, each rank's in the order it passed them.
struct SequencePlacement {
  std::vector<int32_t> origin_rank;   // [sequences] the rank that passed it
  std::vector<int32_t> origin_index;  // [sequences] its index in that rank's list
  std::vector<int32_t> rank;          // [sequences] the rank that runs it for the planned layers
  // False when no plan beat leaving every sequence where it is (the cost model's time); then
  // rank == origin_rank.
  bool used = false;
  int64_t moved_sequences = 0;
  double moved_bytes = 0;     // one way
  double seconds_before = 0;  // cost model: expert compute + all-to-all of the planned layers
  double seconds_after = 0;   // ... with the plan, the moves there and back included
};

// What the engine did so far on this rank.
struct EngineStats {
  int64_t steps = 0;
  int64_t epoch = 0;
  int64_t epochs_committed = 0;
  int64_t epochs_aborted = 0;
  int64_t plans_unchanged = 0;  // planner runs that kept the placement
  int64_t plans_failed = 0;     // planner runs that failed (the placement stays)
  int64_t watchdog_trips = 0;   // planner runs past policy.planner_watchdog_seconds (dropped)
  int64_t reshards = 0;         // layers resharded by the keel policy (policy.keel.shard_experts)
  bool migration_in_flight = false;      // an epoch's transfers are running
  uint64_t bytes_moved = 0;              // migration bytes of all ranks (sent + copied locally)
  double exposed_migration_seconds = 0;  // ReduceGradients waiting for transfers
  double route_seconds = 0;              // time inside Route (the engine's hot path)
  double control_seconds = 0;            // ReduceGradients + StepEnd, excluding that waiting
  Status last_abort;                     // why the last aborted epoch aborted
  Status last_plan_error;                // why the last failed planner run failed
};

// The engine's own state, for a checkpoint: the placement in force of every layer with its
// homes, and the epoch. A migration in flight is not part of it: its epoch has not committed, and
// a restored engine plans again. The load estimates start over.
struct EngineState {
  int64_t epoch = 0;
  // [layer][num_ranks * slots_per_rank]: the unit each slot holds (LayerPlacement), -1 = empty
  std::vector<std::vector<int32_t>> phy2log;
  std::vector<std::vector<int32_t>> home;  // [layer][units]: the rank of each unit's home
  // [layer][num_experts]: each expert's shard count; empty when no layer has a sharded expert.
  std::vector<std::vector<int32_t>> shards;
};

// A state as JSON text, and back (errors name the field and the value).
std::string EngineStateToJson(const EngineState& state);
Result<EngineState> EngineStateFromJson(std::string_view text);

// An engine takes one call at a time: a call from a second thread while another runs is refused
// with FailedPrecondition naming both (the accessors that return no Status wait for it instead).
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
  // Whether a route may have more rows than entries: some expert is sharded
  // (options.sharded_experts, a restored state) or may become so (policy.keel.shard_experts).
  bool shards_experts() const;

  // Registers this rank's buffers of `layer`'s local slot `local_slot` (persistent slots
  // [0, slots_per_rank), then transient ones). Every slot of every layer must be registered
  // before the first Route. The trainer fills every persistent slot with its expert's initial
  // weights (placement(layer) says which expert) and the home slots (HomeSlots) with their
  // optimizer state; from then on StepEnd keeps every replica equal to its home.
  Status RegisterSlot(int layer, int local_slot, const SlotBuffers& buffers);

  // Collective: every rank routes the same layer at the same time. topk_ids: [num_tokens, top_k]
  // int32 logical expert ids (-1 = dropped). Counts them, all-gathers every rank's counts,
  // splits each expert's tokens among its copies (quotas, transient replicas; the same plan on
  // every rank), fills new transient replicas with their expert's weights and returns the
  // physical routing.
  // A layer may be routed any number of times between two StepEnds, once per micro-batch
  // (gradient accumulation, pipeline schedules, evaluation passes), in any order of layers that
  // every rank follows: each micro-batch is planned on its own counts, and a transient replica
  // keeps its slot and expert until StepEnd, so each slot's gradient buffer sums every
  // micro-batch's gradients of one expert and ReduceGradients folds them once. Not after
  // ReduceGradients (FailedPrecondition until StepEnd). Ranks that make different calls here
  // (another layer, another collective) and a rank whose arguments are bad fail on every rank
  // with an error that names them, nothing routed.
  Result<LayerRoute> Route(int layer, std::span<const int32_t> topk_ids);

  // Route for a trainer that counts and assigns its entries on the GPU (kernels/): it passes
  // this rank's count per expert (kernels::gpu::ExpertHistogram; in an MP group, of its share's
  // entries only), gets everything Route returns except `slot` (empty), and assigns slots with
  // kernels::gpu::RemapWithQuotas from the returned quota table, which gives the same slots Route
  // would. expert_counts: [num_experts] int32, each >= 0. Collective like Route, and a
  // micro-batch like Route's: ranks may take either for the same micro-batch.
  Result<LayerRoute> RouteCounts(int layer, std::span<const int32_t> expert_counts);

  // Collective, after the backward of every layer and before the optimizer. If an epoch's
  // transfers are running, waits for them (exposed migration time) and, when every rank verified
  // them, switches to the new placement now; otherwise discards them and keeps the old one. Then
  // adds every copy's gradient (persistent replicas and this step's transient replicas) into the
  // expert's home slot in a fixed order. Afterwards HomeSlots() lists where the optimizer runs.
  // Once per step: a second call before StepEnd is refused (the replicas' gradients would be
  // added again).
  Status ReduceGradients();

  // Collective, after the optimizer updated the homes: copies every home's weights to its
  // replicas, feeds the load estimator, and every policy.replan_interval_steps starts the planner
  // thread; a plan every rank has finished is turned into transfers that run in the background
  // until ReduceGradients of a later step.
  Status StepEnd();

  // Luffy's sequence migration (docs/luffy.md), opt-in. Collective: every rank passes its own
  // sequences with their routing for layers [first_layer, first_layer + n), n the same on every
  // rank (expert_rows.size() / num_experts). Gathers every rank's sequences and plans, with the
  // placements in force and the config's cost model, which rank runs each one
  // (placement/sequence_planner.h), the same plan on every rank. The trainer moves the
  // sequences (e.g. with migration/sequence_migration.h, or its own all-to-all) before those
  // layers, runs their forward and backward there, and moves the gradients back. Plan once per
  // step for every layer when the routing is known ahead, or before each layer from its gate.
  Result<SequencePlacement> PlanSequences(int first_layer,
                                          std::span<const SequenceRouting> sequences,
                                          const SequencePlanningOptions& options = {});

  // Where physical slot `slot` (LayerRoute::slot's numbering) lives: its rank and its local slot
  // there (persistent slots first, then transient ones).
  struct SlotLocation {
    int rank = 0;
    int local_slot = 0;
  };
  SlotLocation LocateSlot(int slot) const;

  // This rank's home slots of `layer` under the placement in force.
  std::vector<HomeSlot> HomeSlots(int layer) const;
  // The placement in force for `layer` (same on every rank); empty for a layer out of range.
  LayerPlacement placement(int layer) const;
  int64_t epoch() const;
  EngineStats stats() const;

  // ---- Checkpoints (docs/integration.md, "Checkpoints")
  // The placement in force and the epoch; the same on every rank. A migration in flight does not
  // change it.
  EngineState SaveState() const;
  // Collective, before the first Route and before the trainer fills its slots: replaces the
  // placement of every layer and the epoch with `state`, saved by a job with the same number of
  // ranks, slots per rank, layers and experts. Every rank passes the same state.
  Status RestoreState(const EngineState& state);
  // Writes every expert whose home is on this rank, by logical id and independent of the
  // placement: `dir`/layer-<l>/expert-<e>.bin holds a header (layer, expert, shard, sizes and a
  // checksum over the file; docs/integration.md, "Expert files"), its weights, then its
  // optimizer state (each file written whole, then renamed into place). Every rank calls it at
  // the same point, after StepEnd (the registered slots are read through the engine's device
  // memory, so GPU buffers work too); a migration in flight does not change what it writes.
  // InvalidArgument for an empty `dir` or the filesystem root.
  Status SaveExperts(const std::string& dir) const;
  // Fills this rank's registered persistent slots from a SaveExperts folder under the placement
  // in force: every copy gets its expert's weights, every home slot also its optimizer state. The
  // folder may come from a job with another placement or another number of ranks. Call it after
  // RegisterSlot (and RestoreState), before the first Route. Every file this rank needs is read
  // and checked first (identity, sizes, exact length, checksum), and held in host memory until
  // the slots are filled: a bad or missing file is an error naming the file and the field
  // (InvalidArgument; NotFound for a missing one), and no slot changes.
  Status LoadExperts(const std::string& dir);

 private:
  class Impl;
  explicit Engine(std::unique_ptr<Impl> impl);
  // Keel's own programs create engines with internal options too (engine/engine_internal.h).
  friend class EngineFactory;
  std::unique_ptr<Impl> impl_;
};

}  // namespace keel
