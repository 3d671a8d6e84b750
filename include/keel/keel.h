/* Keel's stable C API: opaque handles, status codes with a per-thread last-error message, and
 * option structs that start with their size, over the C++ engine of include/keel/engine.hpp.
 * Pure C (C99 and later; also valid C++): bindings and trainers in any language can use it. */
#ifndef KEEL_KEEL_H_
#define KEEL_KEEL_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------------------------------------
 * Status codes and errors
 * ------------------------------------------------------------------------------------------- */

/* What every fallible call returns. The values mirror keel::StatusCode and never change; new
 * codes are only appended. */
typedef enum keel_status {
  KEEL_OK = 0,
  KEEL_INVALID_ARGUMENT = 1,    /* a bad argument, option or config value; the message names it */
  KEEL_NOT_FOUND = 2,           /* a file or name that does not exist (options->config_path) */
  KEEL_IO_ERROR = 3,            /* reading or writing failed */
  KEEL_FAILED_PRECONDITION = 4, /* a call out of order (e.g. destroying a comm still in use) */
  KEEL_OUT_OF_RANGE = 5,
  KEEL_UNIMPLEMENTED = 6,     /* a backend this build lacks (MPI, UCX, NCCL, CUDA) */
  KEEL_INTERNAL = 7,          /* a bug or an unexpected failure inside Keel */
  KEEL_DEADLINE_EXCEEDED = 8, /* a collective or transfer ran past its timeout */
  KEEL_ABORTED = 9            /* the job is unusable after an earlier failure (a lost peer) */
} keel_status_t;

/* The name of `status` without the prefix: "OK", "INVALID_ARGUMENT", ...; "UNKNOWN" for a value
 * that is not a keel_status_t. Never NULL; the string is static. */
const char* keel_status_name(keel_status_t status);

/* The message of the last call on this thread that returned an error, e.g.
 * "keel_engine_route: layer = 7 is not in [0, 4)". Every call of this API that returns a
 * keel_status_t clears it first, so after a call that returned KEEL_OK it is "" (empty). Never
 * NULL; the string is owned by the library and stays valid until the next call of this API on
 * this thread. Errors of one thread never show on another. */
const char* keel_last_error(void);

/* This library's version, "MAJOR.MINOR.PATCH". Never NULL; the string is static. */
const char* keel_version(void);

/* ---------------------------------------------------------------------------------------------
 * Handles
 *
 * All handles are opaque. A handle may be used by one thread at a time; different handles may be
 * used by different threads at once (the usual case: one thread per rank). Destroying NULL is a
 * no-op that returns KEEL_OK.
 * ------------------------------------------------------------------------------------------- */

/* The ranks of one process, run as threads: a rendezvous for their communicators and the local
 * migration transport ("migration.transport: local") that moves expert state between them. */
typedef struct keel_group keel_group_t;

/* One rank's communicator: rank, size and the collectives the engine runs. */
typedef struct keel_comm keel_comm_t;

/* One rank's engine: routing, gradient reduction, planning and migration for every MoE layer. */
typedef struct keel_engine keel_engine_t;

/* Creates a group of `num_ranks` ranks (threads of this process).
 * Errors: KEEL_INVALID_ARGUMENT when num_ranks is not in [1, 4096] or group_out is NULL. */
keel_status_t keel_group_create(int num_ranks, keel_group_t** group_out);

/* Destroys `group`. Every comm created from it must be destroyed first.
 * Errors: KEEL_FAILED_PRECONDITION while comms of the group still exist (nothing is destroyed). */
keel_status_t keel_group_destroy(keel_group_t* group);

/* Joins `group` as `rank`: the communicator of one thread-rank. Each rank joins once.
 * Errors: KEEL_INVALID_ARGUMENT when group or comm_out is NULL, rank is not in [0, num_ranks)
 * or that rank has already joined (and its comm was not destroyed). */
keel_status_t keel_comm_create_local(keel_group_t* group, int rank, keel_comm_t** comm_out);

/* A communicator over a duplicate of MPI_COMM_WORLD, so Keel's traffic never mixes with the
 * application's. The caller initialized MPI (MPI_Init or MPI_Init_thread) and finalizes it only
 * after destroying the comm; the engine calls MPI only from the thread that calls it.
 * Errors: KEEL_INVALID_ARGUMENT when comm_out is NULL; KEEL_UNIMPLEMENTED when this library was
 * built without MPI; KEEL_FAILED_PRECONDITION when MPI is not initialized (or already
 * finalized); KEEL_DEADLINE_EXCEEDED when some rank never joins (the duplication is collective);
 * MPI's own failures as KEEL_INTERNAL. */
keel_status_t keel_comm_create_mpi(keel_comm_t** comm_out);

/* This comm's rank in [0, size) and the number of ranks.
 * Errors: KEEL_INVALID_ARGUMENT when comm or the out pointer is NULL. */
keel_status_t keel_comm_rank(const keel_comm_t* comm, int* rank_out);
keel_status_t keel_comm_size(const keel_comm_t* comm, int* size_out);

/* Destroys `comm`. Every engine created over it must be destroyed first.
 * Errors: KEEL_FAILED_PRECONDITION while an engine still uses it (nothing is destroyed). */
keel_status_t keel_comm_destroy(keel_comm_t* comm);

/* ---------------------------------------------------------------------------------------------
 * Engine options
 * ------------------------------------------------------------------------------------------- */

/* How keel_engine_reduce_gradients adds gradient buffers. Float sums run in a fixed order (home
 * first, then the other copies by ascending slot, then transient replicas), so one placement
 * always gives the same bits. FIXED_INT64 (gradients as int64 fixed point) is order-independent:
 * training is then bitwise identical under every placement. BFLOAT16 and FLOAT16 (IEEE half,
 * 2-byte elements) add each pair in float32 and round once to nearest even; a NaN sum is the
 * type's canonical quiet NaN (0x7fc0, 0x7e00), so the CPU and the GPU give the same bits. */
typedef enum keel_gradient_type {
  KEEL_GRADIENT_FLOAT32 = 0,
  KEEL_GRADIENT_FLOAT64 = 1,
  KEEL_GRADIENT_FIXED_INT64 = 2,
  KEEL_GRADIENT_BFLOAT16 = 3,
  KEEL_GRADIENT_FLOAT16 = 4
} keel_gradient_type_t;

/* Where registered buffers live. KEEL_MEMORY_DEVICE: CUDA device memory of the device current
 * on the thread that calls keel_engine_create; the engine then copies and adds them on that GPU
 * and never touches them from the CPU. Without a usable GPU (or in a build without CUDA)
 * keel_engine_create fails with a message that says so. */
typedef enum keel_memory_kind { KEEL_MEMORY_HOST = 0, KEEL_MEMORY_DEVICE = 1 } keel_memory_kind_t;

/* What keel_engine_create needs. Growth rule: fields are only ever appended, and a new field's
 * zero value means what the library did before the field existed. Fill it with
 * keel_engine_options_init, which sets struct_size to the sizeof of the keel.h you compile
 * against and every field to its default, then set what you need. The library rejects a
 * struct_size smaller than the first version of this struct, and a larger struct (a newer
 * keel.h than the library) unless every byte it does not know is zero: no option is ignored
 * silently. A struct_size above 4096 is taken for an uninitialized struct and rejected. */
typedef struct keel_engine_options {
  size_t struct_size; /* sizeof(keel_engine_options_t) of the caller's keel.h */

  /* The configuration (docs/config.md) as YAML text, or the path of a YAML file; at most one of
   * the two. Both NULL: the defaults, with the topology set to one node of comm's size. */
  const char* config_yaml;
  const char* config_path;

  int num_layers;  /* MoE layers, in [1, 65536]; default 1 */
  int num_experts; /* logical experts per layer, in [1, 65536]; default 1 */
  int top_k;       /* routing choices per token, in [1, num_experts]; default 1 */

  /* One expert's state in bytes; the engine moves and adds these bytes and never interprets
   * weights or optimizer state. */
  size_t weight_bytes;    /* working weights of every copy, >= 1 (default 0: must be set) */
  size_t gradient_bytes;  /* gradient buffer of every copy: >= 1 elements of gradient_type */
  size_t optimizer_bytes; /* master weights + optimizer moments of a home; 0 = none */
  keel_gradient_type_t gradient_type; /* element type of gradients; default FLOAT32 */
  keel_memory_kind_t memory;          /* where buffers live; default HOST */

  /* This rank's communicator (required); it must outlive the engine. The config's
   * num_nodes * gpus_per_node must equal its size. */
  keel_comm_t* comm;
  /* The group of the local transport. NULL: the group of comm when comm is local. Must be
   * comm's group when both are given. Not needed when the config names another transport. */
  keel_group_t* group;

  /* Tensor-parallel (MP) groups of this many consecutive ranks, whose members hold the same
   * tokens (Parm's de-duplicated dispatch, docs/integration.md): every member passes its group's
   * topk_ids to keel_engine_route, and member m = rank % mp_group_size routes only its share,
   * tokens [m * T / M, (m + 1) * T / M) of the T; the other tokens' slot_out entries are -1 and
   * the splits count the share alone. keel_engine_route_counts takes the share's counts. Must
   * divide topology.gpus_per_node. 0 or 1 (the default 0): no MP groups. Appended after the
   * first version of this struct: a library older than this field rejects a nonzero value. */
  int mp_group_size;
} keel_engine_options_t;

/* Fills the first struct_size bytes of *options with the defaults of a library that knows
 * fields up to sizeof(keel_engine_options_t): zero for anything it does not know. Call
 * keel_engine_options_init instead, which passes the sizeof of your keel.h.
 * Errors: KEEL_INVALID_ARGUMENT when options is NULL or struct_size is smaller than the first
 * version of the struct or above 4096. */
keel_status_t keel_engine_options_init_sized(keel_engine_options_t* options, size_t struct_size);

/* Sets options->struct_size = sizeof(keel_engine_options_t) and every field to its default. */
static inline keel_status_t keel_engine_options_init(keel_engine_options_t* options) {
  return keel_engine_options_init_sized(options, sizeof(keel_engine_options_t));
}

/* ---------------------------------------------------------------------------------------------
 * Engine
 *
 * Calls marked "collective" must be made by every rank of the comm, in the same order (route:
 * per layer, in layer order). A rank that stops calling turns into KEEL_DEADLINE_EXCEEDED on the
 * others after engine.collective_timeout_seconds (config), never a hang; the comm is broken from
 * then on and every later collective fails with KEEL_ABORTED.
 * ------------------------------------------------------------------------------------------- */

/* Creates this rank's engine. Collective: every rank passes the same config and shapes.
 * Errors: KEEL_INVALID_ARGUMENT for a NULL pointer, a struct_size out of range, both or a bad
 * config (the config reader's message names the key, the value and the line), a count < 1,
 * num_layers or num_experts above 65536, top_k > num_experts, weight_bytes = 0, gradient_bytes
 * that is not a positive multiple of the gradient element size, an unknown enum value, a comm
 * whose size differs from the config's ranks, a group that is not comm's; KEEL_NOT_FOUND /
 * KEEL_IO_ERROR for an unreadable config_path; KEEL_UNIMPLEMENTED for a transport or memory kind
 * this build lacks; a communicator's failure as its own status. */
keel_status_t keel_engine_create(const keel_engine_options_t* options, keel_engine_t** engine_out);

/* Destroys `engine`: cancels a running migration (bounded by migration.deadline_seconds) and
 * stops the planner thread. Not collective. */
keel_status_t keel_engine_destroy(keel_engine_t* engine);

/* Registers the buffers of this rank's slot `local_slot` of `layer`. Local slots
 * [0, slots_per_rank) are persistent, [slots_per_rank, slots_per_rank + transient_per_rank)
 * transient; every layer has its own. Every slot of every layer must be registered before the
 * first route; the trainer fills the initial weights and optimizer state of the home slots
 * (keel_engine_home_slots).
 *   weights:    [weight_bytes] bytes, the copy's working weights (non-NULL)
 *   gradients:  [gradient_bytes / element size] of gradient_type: float32, float64 or int64
 *               (non-NULL)
 *   optimizer:  [optimizer_bytes] bytes for a persistent slot (non-NULL when
 *               optimizer_bytes > 0: any persistent slot can become a home); NULL for a
 *               transient slot, which never holds a home.
 * The buffers must stay valid, at the same address, until the engine is destroyed; the engine
 * copies migrated state into them. Registering a slot again replaces its buffers.
 * Errors: KEEL_INVALID_ARGUMENT for a NULL engine, a layer or local_slot out of range, or a
 * buffer pointer that breaks the rules above; KEEL_FAILED_PRECONDITION while an epoch's
 * transfers run. */
keel_status_t keel_engine_register_slot(keel_engine_t* engine, int layer, int local_slot,
                                        void* weights, void* gradients, void* optimizer);

/* Routes one layer's tokens (one micro-batch of them). Collective: every rank routes the same
 * layer at the same time; a layer may be routed several times between two step ends, once per
 * micro-batch, never after keel_engine_reduce_gradients (Engine::Route says more).
 *   topk_ids:     [num_tokens, top_k] int32, logical expert ids in [0, num_experts), -1 for a
 *                 dropped (token, k); may be NULL when num_tokens == 0
 *   num_tokens:   >= 0 tokens on this rank (0 is allowed: the rank still takes part)
 *   slot_out:     [num_tokens, top_k] int32, written: the physical slot of every (token, k), -1
 *                 where the id was -1. Slots [0, num_ranks * slots_per_rank) are persistent
 *                 (rank = slot / slots_per_rank); num_ranks * slots_per_rank + g *
 *                 transient_per_rank + i is rank g's transient slot i. With
 *                 policy.keel.spare_slots: per_step an empty persistent slot may hold a transient
 *                 for this route (keel_engine_local_experts says which). May be NULL when
 *                 num_tokens == 0
 *   send_counts:  [num_ranks] int64, written: (token, k) rows this rank sends to each rank
 *                 (the dispatch all-to-all split)
 *   recv_counts:  [num_ranks, slots_per_rank + transient_per_rank] int64, written: rows each
 *                 source rank sends to each local slot (persistent first, then transient); may
 *                 be NULL. Rows sent sorted by (slot, token, k) arrive grouped by source, then
 *                 by local slot
 *   recv_totals:  [num_ranks] int64, written: rows received from each rank (the row sums of
 *                 recv_counts; the combine split); may be NULL
 * Errors: KEEL_INVALID_ARGUMENT for a NULL engine or required pointer, a layer out of range, a
 * negative num_tokens or an id out of range (named by its index), or on every other rank when
 * one rank's arguments are bad; KEEL_FAILED_PRECONDITION for a slot not registered, a route after
 * keel_engine_reduce_gradients, ranks that make different calls (another layer, another
 * collective; on every rank) or a call while another thread's call runs; a collective's failure
 * (KEEL_DEADLINE_EXCEEDED, KEEL_ABORTED). */
keel_status_t keel_engine_route(keel_engine_t* engine, int layer, const int32_t* topk_ids,
                                int64_t num_tokens, int32_t* slot_out, int64_t* send_counts,
                                int64_t* recv_counts, int64_t* recv_totals);

/* keel_engine_route for a trainer that counts and assigns its (token, k) entries on the GPU
 * (kernels/remap.h): it passes this rank's count per expert and gets the same splits plus this
 * rank's quota table, which the remap kernel turns into the slots keel_engine_route would give.
 * Collective like keel_engine_route, one micro-batch like it.
 *   expert_counts:   [num_experts] int32, each >= 0: this rank's entries per expert (the
 *                    histogram of topk_ids without the -1 entries)
 *   send_counts, recv_counts, recv_totals: as keel_engine_route
 *   copy_begin_out:  [num_experts + 1] int32, written: expert e's copies are the entries
 *                    [copy_begin_out[e], copy_begin_out[e + 1]) of the next two arrays
 *   copy_slot_out:   [copy_capacity] int32, written: [*num_copies_out] physical slots
 *                    (keel_engine_route's numbering)
 *   copy_quota_out:  [copy_capacity] int32, written: [*num_copies_out] entries of this rank that
 *                    each copy takes, in entry order; entries past an expert's quotas go to its
 *                    last copy
 *   copy_capacity:   entries copy_slot_out and copy_quota_out hold: at least num_ranks *
 *                    (slots_per_rank + transient_per_rank), a bound the table never exceeds
 *   num_copies_out:  int32, written: the number of copies
 *   slot_rank_out:   [num_ranks * (slots_per_rank + transient_per_rank)] int32, written: the rank
 *                    holding each physical slot
 * Errors: KEEL_INVALID_ARGUMENT for a NULL engine or pointer, a layer out of range, a small
 * copy_capacity (checked before any collective) or a negative count (named by its index);
 * otherwise as keel_engine_route. */
keel_status_t keel_engine_route_counts(keel_engine_t* engine, int layer,
                                       const int32_t* expert_counts, int64_t* send_counts,
                                       int64_t* recv_counts, int64_t* recv_totals,
                                       int32_t* copy_begin_out, int32_t* copy_slot_out,
                                       int32_t* copy_quota_out, int32_t copy_capacity,
                                       int32_t* num_copies_out, int32_t* slot_rank_out);

/* Plans Luffy's sequence migration (docs/luffy.md), opt-in: which rank runs each sequence of
 * every rank for layers [first_layer, first_layer + num_planned_layers). Collective; every rank
 * gets the same answer.
 *   num_planned_layers: >= 1, the same on every rank
 *   num_sequences:      >= 0 sequences on this rank
 *   tokens:             [num_sequences] int64, each >= 0; may be NULL when num_sequences == 0
 *   expert_rows:        [num_sequences, num_planned_layers, num_experts] int32, each >= 0: the
 *                       (token, k) rows each sequence sends to each expert in each planned layer;
 *                       may be NULL when num_sequences == 0
 *   max_token_imbalance: >= 1: no rank ends with more than this times the mean tokens (a rank
 *                       already above it keeps what it has); 1.10 is a good start
 *   capacity:           entries the three arrays below hold
 *   origin_rank_out, origin_index_out, rank_out: [capacity] int32, written for every sequence
 *                       of every rank (rank 0's first, each rank's in its order): the rank that
 *                       passed it, its index there, and the rank that runs it
 *   total_out:          int64, written: the sequences of all ranks
 *   used_out:           int, written (may be NULL): 1 when the plan pays by the cost model, 0
 *                       when every sequence stays where it is
 * Errors: KEEL_INVALID_ARGUMENT for a NULL engine or required pointer, layers out of range, a
 * negative count or rows (named), here or on another rank; KEEL_OUT_OF_RANGE when capacity is
 * below *total_out (which is written); the collectives' failures. */
keel_status_t keel_engine_plan_sequences(keel_engine_t* engine, int first_layer,
                                         int num_planned_layers, int64_t num_sequences,
                                         const int64_t* tokens, const int32_t* expert_rows,
                                         double max_token_imbalance, int64_t capacity,
                                         int32_t* origin_rank_out, int32_t* origin_index_out,
                                         int32_t* rank_out, int64_t* total_out, int* used_out);

/* Collective, after the backward of every layer and before the optimizer: switches to a new
 * placement whose transfers every rank verified (or waits for them, or discards them), then adds
 * every copy's gradients into its expert's home slot in a fixed order. Afterwards
 * keel_engine_home_slots lists where the optimizer runs. Once per step.
 * Errors: KEEL_INVALID_ARGUMENT for a NULL engine; KEEL_FAILED_PRECONDITION for a second call
 * before keel_engine_step_end; the engine's and collectives' failures. */
keel_status_t keel_engine_reduce_gradients(keel_engine_t* engine);

/* Collective, after the optimizer updated the homes: copies every home's weights to its
 * replicas, feeds the load estimator, runs the planner in the background and starts the
 * migrations of the next epoch.
 * Errors: KEEL_INVALID_ARGUMENT for a NULL engine; the engine's and collectives' failures. */
keel_status_t keel_engine_step_end(keel_engine_t* engine);

/* This rank's home slots of `layer` under the placement in force: the experts whose master
 * weights and optimizer state live here, and where. At most slots_per_rank entries, so a
 * capacity of slots_per_rank always suffices.
 *   experts_out:      [capacity] int32, written: [*count_out] expert ids, ascending by slot
 *   local_slots_out:  [capacity] int32, written: [*count_out] persistent local slots
 *   capacity:         >= 0 entries the two arrays hold
 *   count_out:        int32, written: the number of home slots (also when capacity is too small)
 * Errors: KEEL_INVALID_ARGUMENT for a NULL pointer (the arrays may be NULL when capacity is 0),
 * a layer out of range, a negative capacity or one below the number of home slots. */
keel_status_t keel_engine_home_slots(const keel_engine_t* engine, int layer, int32_t* experts_out,
                                     int32_t* local_slots_out, int32_t capacity,
                                     int32_t* count_out);

/* The placement in force for `layer` (the same on every rank).
 *   phy2log_out:  [capacity] int32, written: [num_ranks * slots_per_rank] logical expert per
 *                 persistent slot, -1 for an empty slot (DeepSeek EPLB's phy2log)
 *   capacity:     >= num_ranks * slots_per_rank
 * Errors: KEEL_INVALID_ARGUMENT for a NULL pointer, a layer out of range or a small capacity. */
keel_status_t keel_engine_placement(const keel_engine_t* engine, int layer, int32_t* phy2log_out,
                                    int32_t capacity);

/* The home rank of every expert of `layer` under the placement in force.
 *   home_out:  [capacity] int32, written: [num_experts] rank per expert
 *   capacity:  >= num_experts
 * Errors: KEEL_INVALID_ARGUMENT for a NULL pointer, a layer out of range or a small capacity. */
keel_status_t keel_engine_homes(const keel_engine_t* engine, int layer, int32_t* home_out,
                                int32_t capacity);

/* The expert each of this rank's local slots of `layer` held in the latest keel_engine_route of
 * that layer: persistent slots from the placement in force, transient replicas as that route
 * filled them (in transient slots or, with policy.keel.spare_slots: per_step, in empty persistent
 * slots); -1 for an empty slot. The trainer runs each slot's rows through this expert.
 *   experts_out:  [capacity] int32, written: [slots_per_rank + transient_per_rank] expert ids
 *   capacity:     >= slots_per_rank + transient_per_rank
 * Errors: KEEL_INVALID_ARGUMENT for a NULL pointer, a layer out of range or a small capacity;
 * KEEL_FAILED_PRECONDITION before the first route of `layer`. */
keel_status_t keel_engine_local_experts(const keel_engine_t* engine, int layer,
                                        int32_t* experts_out, int32_t capacity);

/* This rank, the number of ranks, persistent slots per rank and layer, transient slots per
 * rank, and the placement epoch in force.
 * Errors: KEEL_INVALID_ARGUMENT when engine or the out pointer is NULL. */
keel_status_t keel_engine_rank(const keel_engine_t* engine, int* rank_out);
keel_status_t keel_engine_num_ranks(const keel_engine_t* engine, int* num_ranks_out);
keel_status_t keel_engine_slots_per_rank(const keel_engine_t* engine, int* slots_out);
keel_status_t keel_engine_transient_per_rank(const keel_engine_t* engine, int* slots_out);
keel_status_t keel_engine_epoch(const keel_engine_t* engine, int64_t* epoch_out);

/* What the engine did so far on this rank. The caller sets struct_size (same growth rule as
 * keel_engine_options_t: `keel_engine_stats_t stats = {.struct_size = sizeof(stats)};`); the
 * library fills the fields it knows and zeroes the rest. */
typedef struct keel_engine_stats {
  size_t struct_size; /* sizeof(keel_engine_stats_t) of the caller's keel.h */
  int64_t steps;
  int64_t epoch;
  int64_t epochs_committed;
  int64_t epochs_aborted;
  int64_t plans_unchanged;          /* planner runs that kept the placement */
  uint64_t bytes_moved;             /* migration bytes this rank sent, received or copied */
  double exposed_migration_seconds; /* reduce_gradients waiting for transfers */
  double route_seconds;             /* time inside route (the engine's hot path) */
  double control_seconds;           /* reduce_gradients + step_end, excluding that waiting */
  keel_status_t last_abort_status;  /* why the last aborted epoch aborted; KEEL_OK: none */
  /* Its message ("" when none); owned by the engine, valid until the next keel_engine_stats
   * on this engine or its destruction. */
  const char* last_abort_message;
} keel_engine_stats_t;

/* Fills *stats.
 * Errors: KEEL_INVALID_ARGUMENT when engine or stats is NULL or stats->struct_size is smaller
 * than the first version of the struct. */
keel_status_t keel_engine_stats(keel_engine_t* engine, keel_engine_stats_t* stats);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* KEEL_KEEL_H_ */
