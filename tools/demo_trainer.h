// One rank of `keel demo`: trains the small MoE model of tools/demo_model.h through the Keel
// engine (Route, all-to-all dispatch and combine, backward, ReduceGradients, Adam on the homes,
// StepEnd) and measures each step the way separate GPUs would see it. Each rank's top-k expert
// ids come from tools/demo_gate.h, Luffy's sequences from tools/demo_sequences.h.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "common/config.h"
#include "keel/engine.hpp"
#include "keel/status.hpp"
#include "monitor/metrics.h"
#include "monitor/trace.h"
#include "tools/demo_gate.h"
#include "tools/demo_model.h"
#include "tools/demo_sequences.h"

namespace keel::tools {

// One training step, reduced over the ranks (identical on every rank). Times are thread CPU
// seconds (CLOCK_THREAD_CPUTIME_ID), so ranks that share cores measure what separate GPUs would,
// except exposed migration, which is the engine's wall-clock wait.
struct StepMeasurement {
  int64_t step = 0;
  double loss = 0;  // mean over every token of every rank
  // Σ_layers (max_ranks expert + max_ranks communication) + max_ranks control + exposed migration.
  double parallel_step_seconds = 0;
  double expert_seconds = 0;         // Σ_layers max over ranks, forward + backward
  double communication_seconds = 0;  // Σ_layers max over ranks: Route and the all-to-alls
  double control_seconds = 0;  // max over ranks: ReduceGradients + Adam + StepEnd, not waiting
  double engine_seconds = 0;   // max over ranks: Route + ReduceGradients + StepEnd (overhead)
  double exposed_migration_seconds = 0;  // max over ranks, this step
  double imbalance = 0;                  // max rank rows / mean rank rows, mean over layers
  std::vector<int64_t> rank_rows;        // [ranks] rows each rank's experts computed, all layers
  // Luffy mode (docs/luffy.md), summed over ranks and layers: forward (token, k) rows dispatched,
  // those sent to another rank, those kept after condensation; sequences moved and their bytes,
  // and the slowest rank's seconds moving them (in communication_seconds too).
  int64_t rows_dispatched = 0;
  int64_t rows_remote = 0;
  int64_t rows_kept = 0;
  int64_t sequences_moved = 0;
  double sequence_bytes = 0;
  double sequence_seconds = 0;
  // Bytes all ranks sent to other ranks: between ranks or groups (dispatch and combine, all
  // passes), and inside a shard or MP group (the sharded strategies' collectives).
  double all_to_all_bytes = 0;
  double group_bytes = 0;
  int64_t epoch = 0;
  int64_t epochs_committed = 0;
  int64_t epochs_aborted = 0;
  bool migration_in_flight = false;
  uint64_t bytes_moved = 0;  // so far
};

struct RankRunOptions {
  DemoModelOptions model;
  KeelConfig config;  // policy, slots and migration transport of this run
  const TokenGate* gate = nullptr;
  Communicator* communicator = nullptr;
  LocalGroup* local_group = nullptr;  // the communicator's group, for the local transport
  Metrics* metrics = nullptr;         // shared exporter (may be null)
  // Where the slot buffers live: "host", "device" (CUDA device memory of the current GPU) or
  // "guarded-host" (CreateGuardedHostMemory: the device path without a GPU). With device memory
  // the trainer keeps host copies for its CPU experts and moves them by copies, untimed, as a
  // GPU trainer's kernels would read and write the slots in place.
  std::string memory = "host";
  // Barrier (untimed) before each timed collective, so the time measured inside it is the
  // exchange and not the wait for the slowest rank: needed where waiting burns CPU (MPI polls).
  bool barrier_before_timing = false;
  // Called on every rank after every step.
  std::function<void(const StepMeasurement&)> on_step;
  // config.strategy.name other than "ep" trains sharded experts (tools/demo_strategies.h); for
  // parm, whether each MP rank sends only its share of the group's rows (Parm) or all of them.
  bool parm_dedup = true;
  // Experts the engine shards from the start (EngineOptions::sharded_experts); the demo runs
  // their shards as FFNs of their own, as it does for policy.keel.shard_experts.
  std::vector<ShardedExpert> sharded_experts;
  // > 1: the engine's MP groups (EngineOptions::mp_group_size) of this many consecutive ranks.
  // The members of a group hold the group's tokens (each member's drawn tokens, in member
  // order) and route them all; each dispatches only its share (its own tokens) and the group
  // all-gathers the combined outputs after every layer's forward and the input gradients after
  // its backward. The demo's model is token-wise, so a member's next layer reads only its share
  // of what it gathered.
  int mp_group_size = 1;

  // Luffy mode (docs/luffy.md). With a sequence gate each rank's tokens are its sequences and
  // their routing comes from it; null runs the plain demo, tokens drawn by `gate`.
  const SequenceGate* sequences = nullptr;
  // Every step, before the first layer: Engine::PlanSequences for all layers, then the moves
  // over `sequence_transport` (MigrateSequences); the sequences stay there for the backward.
  bool migrate_sequences = false;
  Transport* sequence_transport = nullptr;
  SequencePlanObjective sequence_objective = SequencePlanObjective::kStepTime;
  // > 0: rows of one slot that are near-duplicates (cosine >= this) are sent and computed once
  // in the forward (kernels/condense.h; its backward rule).
  float condense_threshold = 0;
  // > 0: emulated links of this many GB/s: the bytes a rank sends to or receives from other
  // ranks (rows and sequences, the larger of the two) add bytes / bandwidth to its
  // communication time.
  double link_gb_per_s = 0;
};

struct RankRunResult {
  std::vector<StepMeasurement> steps;
  EngineStats stats;
  // [layers, experts, weight_floats] every expert's final home weights, gathered from every rank.
  std::vector<float> final_weights;
};

// CPU seconds of the calling thread (CLOCK_THREAD_CPUTIME_ID): how the demo times a rank's work.
double ThreadCpuSeconds();

// Collective: every rank of `communicator` runs it with the same options. With
// config.strategy.name other than "ep" it trains sharded experts (RunShardedRank).
Result<RankRunResult> RunRank(const RankRunOptions& options);

}  // namespace keel::tools
