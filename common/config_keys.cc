// The configuration's key table (common/config_keys.h): every key with its member, bounds,
// choices and documentation, and every section, checked at compile time to be in preorder.
#include "common/config_keys.h"

#include "common/policy_names.h"
#include "keel/limits.hpp"

namespace keel::config_table {
namespace {

constexpr std::string_view kPerExpertModes[] = {"off", "aggregated"};
constexpr std::string_view kLplbSolverNames[] = {"quota", "glpk"};
constexpr std::string_view kPlanAdoptionNames[] = {"when_ready", "next_step"};
constexpr std::string_view kSpareSlotNames[] = {"replicas", "per_step"};
constexpr std::string_view kStrategyNames[] = {"ep", "esp", "parm", "ppmoe", "auto"};
constexpr std::string_view kTransportNames[] = {"local", "ucx", "nccl"};
constexpr std::string_view kNcclHostTransportNames[] = {"ucx", "local"};

// Rates of the cost model (TFLOP/s, GB/s) lie within nine orders of magnitude either side of 1:
// with every size at its bound (widths 2^20, 16 matrices, 8-byte elements, 2^26 counts of 1e15
// tokens per step, 2^31 passes) a layer step is priced below 1e40 seconds, so no price of a trace
// overflows a double, while a rate near 0 (1e-320) or beyond 1e308 would make it inf, or NaN
// where it meets 0 tokens. train_flops_multiplier and home_move_bytes_per_parameter have bounds
// for the same reason.
constexpr double kMinRate = 1e-9;
constexpr double kMaxRate = 1e9;
// Durations the engine turns into a clock's deadline: a clock's int64 nanoseconds hold 292 years,
// 1e9 seconds is 31 (as --serve-seconds and --pace).
constexpr double kMaxSeconds = 1e9;

// The member expression is also the key's dotted path, so the two cannot drift apart.
#define KEEL_CONFIG_FIELD(member) \
  .path = #member, .field = [](KeelConfig& c) { return FieldRef(&c.member); }

constexpr ConfigKey kConfigKeys[] = {
    // topology
    {KEEL_CONFIG_FIELD(topology.num_nodes), .min = 1, .max = kMaxRanks,
     .doc = "Nodes (hosts) in the job; the ranks of one node share a fast link (NVLink)."},
    {KEEL_CONFIG_FIELD(topology.gpus_per_node), .min = 1, .max = kMaxRanks,
     .doc = "Ranks (GPUs) per node; the job has num_nodes x gpus_per_node ranks, at most "
            "4096."},
    {KEEL_CONFIG_FIELD(topology.intra_node_gb_per_s), .min = kMinRate, .max = kMaxRate,
     .unit = "GB/s",
     .doc = "Bandwidth between two ranks of one node, per GPU and direction (NVLink)."},
    {KEEL_CONFIG_FIELD(topology.inter_node_gb_per_s), .min = kMinRate, .max = kMaxRate,
     .unit = "GB/s",
     .doc = "Bandwidth from a rank to ranks on other nodes, per GPU and direction (the NIC)."},
    // slots
    {KEEL_CONFIG_FIELD(slots.persistent_per_rank), .min = 1, .max = kMaxSlotsPerLayer,
     .doc = "Expert slots per rank in every MoE layer, filled by the planned placement. All "
            "ranks' persistent and transient slots of a layer are at most 2^20."},
    {KEEL_CONFIG_FIELD(slots.transient_per_rank), .min = 0, .max = kMaxSlotsPerLayer,
     .doc = "Extra slots per rank, filled each step with replicas of bursting experts (used by "
            "the keel policy); 0 means none. The engine gives every layer its own transient "
            "slots, so a layer's backward finds the weights its forward used."},
    // cost_model
    {KEEL_CONFIG_FIELD(cost_model.expert_tflops), .min = kMinRate, .max = kMaxRate,
     .unit = "TFLOP/s",
     .doc = "Achieved throughput of the expert GEMMs on one GPU, in the weights' dtype."},
    {KEEL_CONFIG_FIELD(cost_model.hidden_size), .min = 1, .max = kMaxModelWidth, .unit = "elements",
     .doc = "Model hidden size: elements of one token's activation entering and leaving an "
            "expert."},
    {KEEL_CONFIG_FIELD(cost_model.expert_ffn_size), .min = 1, .max = kMaxModelWidth,
     .unit = "elements", .doc = "Inner (FFN) size of one expert."},
    {KEEL_CONFIG_FIELD(cost_model.expert_matrices), .min = 1, .max = 16,
     .doc = "Weight matrices of hidden_size x expert_ffn_size per expert (2 for a plain FFN, 3 "
            "for SwiGLU)."},
    {KEEL_CONFIG_FIELD(cost_model.dtype_bytes), .min = 1, .max = 8, .unit = "bytes",
     .doc = "Bytes per weight and per activation element (2 for bf16 or fp16)."},
    {KEEL_CONFIG_FIELD(cost_model.home_move_bytes_per_parameter), .min = 0, .min_exclusive = true,
     .max = 1024, .unit = "bytes",
     .doc = "Bytes moved per expert parameter when its home changes rank: weights plus optimizer "
            "state (about 14 with Adam and mixed precision)."},
    {KEEL_CONFIG_FIELD(cost_model.train_flops_multiplier), .min = 1, .max = 1000,
     .doc = "Training FLOPs per forward FLOP of an expert (3: forward plus backward)."},
    {KEEL_CONFIG_FIELD(cost_model.all_to_all_passes), .min = 0,
     .doc = "All-to-all exchanges of the tokens per layer and step (4: dispatch and combine, "
            "forward and backward)."},
    {KEEL_CONFIG_FIELD(cost_model.replica_sync_passes), .min = 0,
     .doc = "Transfers of a replica's parameters per step (2: gradient reduced into the home, "
            "updated weights pushed back)."},
    {KEEL_CONFIG_FIELD(cost_model.top_k), .min = 1, .max = 1024,
     .doc = "Experts each token is routed to: a layer's token rows divided by top_k are its "
            "tokens, which ppmoe's and parm's collectives carry."},
    {KEEL_CONFIG_FIELD(cost_model.gemm_efficiency),
     .doc = "Measured expert GEMM throughput by inner width, relative to expert_tflops, as "
            "\"columns:efficiency, ...\" with columns ascending (e.g. \"1024:0.72, 4096:0.95, "
            "8192:1\"); between points it is interpolated on log2(columns), beyond them held. "
            "Sharded strategies run GEMMs of expert_ffn_size / shards columns. Empty means the "
            "same throughput at every width."},
    // estimator
    {KEEL_CONFIG_FIELD(estimator.kind), .choices = kEstimatorKindNames,
     .doc = "How per-expert load is predicted from past steps: last (the last step), window "
            "(mean of the last window_steps), ema (exponential moving average)."},
    {KEEL_CONFIG_FIELD(estimator.ema_decay), .min = 0, .max = 1, .max_exclusive = true,
     .doc = "Weight of the past in the ema estimator: estimate = decay x estimate + (1 - decay) "
            "x observed."},
    {KEEL_CONFIG_FIELD(estimator.window_steps), .min = 1, .max = 10000, .unit = "steps",
     .doc = "Steps averaged by the window estimator."},
    // policy
    {KEEL_CONFIG_FIELD(policy.name), .choices = kBuiltinPolicyNames,
     .added_choices = AddedPolicyNames,
     .doc = "Placement policy: static (contiguous, never changes), eplb (DeepSeek EPLB), "
            "flexmoe, smartmoe, fastermoe, velb (Megatron's per-step virtual experts), lplb "
            "(EPLB plus a per-step LP over the replicas), swiftmoe (parameters move, optimizer "
            "state stays), trtllm (EPLB a few layers at a time), keel (migration-aware "
            "incremental placement with transient replicas), or a policy the program registered "
            "(keel::RegisterPolicy)."},
    {KEEL_CONFIG_FIELD(policy.replan_interval_steps), .min = 1, .unit = "steps",
     .doc = "Steps between two placement plans."},
    {KEEL_CONFIG_FIELD(policy.planner_watchdog_seconds), .min = 0, .min_exclusive = true,
     .max = kMaxSeconds, .unit = "seconds",
     .doc =
         "The engine's watchdog: a replan still running after this long is an error on every "
         "rank (StepEnd returns it), a log line and keel_watchdog_trips_total{what=\"planner\"}; "
         "the placement in force stays, and the late plan is dropped when it ends."},
    {KEEL_CONFIG_FIELD(policy.plan_adoption), .choices = kPlanAdoptionNames,
     .doc = "When the engine adopts a replan: when_ready (at the first step end at which every "
            "rank's planner has finished; training never waits for the planner) or next_step "
            "(at the step end after the replan started; a rank whose planner is still running "
            "waits for it there, up to planner_watchdog_seconds). With next_step, runs with the "
            "same router output make the same epochs at the same steps, whatever the machine's "
            "speed."},
    {KEEL_CONFIG_FIELD(policy.eplb.num_groups), .min = 0,
     .doc = "Expert groups for EPLB's hierarchical balancing; 0 means one per node (one in all "
            "when the experts do not divide among the nodes). As in DeepSeek's EPLB: hierarchical "
            "when the groups are a multiple of the nodes, and then the experts must divide into "
            "the groups; otherwise global."},
    {KEEL_CONFIG_FIELD(policy.flexmoe.balance_ratio_trigger), .min = 1,
     .doc = "FlexMoE replans only when the predicted max/mean rank load exceeds this ratio."},
    {KEEL_CONFIG_FIELD(policy.flexmoe.max_actions_per_replan), .min = 1,
     .doc = "Expand, shrink and migrate actions FlexMoE takes per replan, at most."},
    {KEEL_CONFIG_FIELD(policy.smartmoe.candidate_pool_size), .min = 1, .max = 4096,
     .doc = "Placements SmartMoE keeps and chooses among online with the cost model."},
    {KEEL_CONFIG_FIELD(policy.smartmoe.stickiness), .min = 0,
     .doc = "Relative load gain a swap must beat before SmartMoE moves an expert off its current "
            "rank."},
    {KEEL_CONFIG_FIELD(policy.fastermoe.max_shadowed_experts), .min = 0,
     .doc = "Hottest experts FasterMoE considers each step for shadowing (a copy on every rank)."},
    {KEEL_CONFIG_FIELD(policy.lplb.solver), .choices = kLplbSolverNames,
     .doc = "Who solves LPLB's per-step linear program: quota (Keel's exact quota solver, whole "
            "tokens: the LP optimum rounded up, and fast) or glpk (GLPK's simplex, the LP "
            "library's exact optimum in fractions of tokens)."},
    {KEEL_CONFIG_FIELD(policy.trtllm.layer_updates_per_iter), .min = 1, .unit = "layers",
     .doc = "Layers that adopt a new placement at each replan, in turn; the others keep theirs "
            "until their turn comes."},
    {KEEL_CONFIG_FIELD(policy.keel.transient_replicas),
     .doc = "Fill the transient slots each step with replicas of experts that burst beyond their "
            "placement."},
    {KEEL_CONFIG_FIELD(policy.keel.spare_slots), .choices = kSpareSlotNames,
     .doc = "What the persistent slots beyond the homes hold: replicas (each replan fills them "
            "with replicas of the experts the load estimate finds hot; they are synced every "
            "step) or per_step (replans move homes only and leave them empty; every step's "
            "planner fills them, with the transient slots, from that step's own counts, as velb "
            "does). per_step needs transient_replicas."},
    {KEEL_CONFIG_FIELD(policy.keel.max_moves_per_replan), .min = 0,
     .doc = "Persistent slots the keel policy changes per layer and replan, at most."},
    {KEEL_CONFIG_FIELD(policy.keel.home_payback_horizon_steps), .min = 0, .unit = "steps",
     .doc = "A home moves only if the predicted saving repays the move within this many steps."},
    {KEEL_CONFIG_FIELD(policy.keel.min_gain_fraction), .min = 0, .max = 1, .max_exclusive = true,
     .doc = "A move must cut the predicted layer step time by at least this fraction."},
    {KEEL_CONFIG_FIELD(policy.keel.shard_experts),
     .doc = "The engine chooses per expert at each replan between replicating a hot expert and "
            "sharding it over ranks of its node (its FFN split; every row to every shard), "
            "whichever the cost model prices lower; a change must repay its state moves within "
            "home_payback_horizon_steps. Needs a trainer that runs shards "
            "(docs/strategies.md, \"Sharded experts in the engine\")."},
    // strategy
    {KEEL_CONFIG_FIELD(strategy.name), .choices = kStrategyNames,
     .doc = "How each MoE layer is parallelised: ep (experts whole, placed by the policy), esp "
            "(each expert sharded over shard_degree ranks of a node), parm (experts sharded over "
            "the MP group, Parm's de-duplicated dispatch), ppmoe (every expert sliced over all "
            "ranks of every node; no all-to-all) or auto (chosen per layer at every replan from "
            "a pool). docs/strategies.md."},
    {KEEL_CONFIG_FIELD(strategy.shard_degree), .min = 0, .max = kMaxRanks, .unit = "ranks",
     .doc = "esp: ranks of one node each expert is sharded over; must divide "
            "topology.gpus_per_node; 0 means all of them."},
    {KEEL_CONFIG_FIELD(strategy.mp_degree), .min = 0, .max = kMaxRanks, .unit = "ranks",
     .doc = "parm: tensor-parallel (MP) degree, consecutive ranks of a node that hold the same "
            "tokens and shard the experts between them; must divide topology.gpus_per_node. 0 "
            "means the smallest divisor of gpus_per_node above 1 (2 on nodes of an even size), "
            "or 1 on a node of one rank."},
    {KEEL_CONFIG_FIELD(strategy.parm_chunks), .min = 1, .max = 1024,
     .doc = "parm: pieces its overlapped schedule cuts a pass into, so the exchange between "
            "nodes and the all-gather inside the MP group run at the same time (1 = one after "
            "the other, Parm's first schedule)."},
    {KEEL_CONFIG_FIELD(strategy.switch_payback_steps), .min = 1, .unit = "steps",
     .doc = "auto: a layer switches strategy only if the estimated saving repays moving its "
            "expert state within this many steps."},
    {KEEL_CONFIG_FIELD(strategy.min_gain_fraction), .min = 0, .max = 1, .max_exclusive = true,
     .doc = "auto: a switch must cut the layer's estimated step time by at least this fraction."},
    // monitor
    {KEEL_CONFIG_FIELD(monitor.metrics_address),
     .doc = "Where the Prometheus exporter serves /metrics: host:port (an IPv4 address or a "
            "host name), [v6addr]:port for IPv6, or a bare port, which listens on 127.0.0.1; "
            "port 0 picks a free one; empty means no exporter."},
    {KEEL_CONFIG_FIELD(monitor.per_expert), .choices = kPerExpertModes,
     .doc = "Per-(layer, expert) token series: off, or aggregated (exported by "
            "aggregating_rank only, so one exporter carries them rather than every rank)."},
    {KEEL_CONFIG_FIELD(monitor.aggregating_rank), .min = 0,
     .doc = "The rank that exports the per-expert series when per_expert is aggregated."},
    {KEEL_CONFIG_FIELD(monitor.queue_capacity), .min = 1, .max = 65536, .unit = "batches",
     .doc = "Routing batches the trainer can hand the monitor before the monitor thread drains "
            "them; beyond this, samples are dropped and counted, never waited for."},
    {KEEL_CONFIG_FIELD(monitor.per_source_rank),
     .doc = "Also count tokens per source rank and expert (the traffic matrix), not only per "
            "expert."},
    {KEEL_CONFIG_FIELD(monitor.trace_path),
     .doc = "Keel trace (JSONL) the run records for keel replay; empty means none."},
    {KEEL_CONFIG_FIELD(monitor.trace_sample_interval_steps), .min = 1, .unit = "steps",
     .doc = "The trace recorder writes every n-th step."},
    // migration
    {KEEL_CONFIG_FIELD(migration.transport), .choices = kTransportNames,
     .doc = "How expert state moves between ranks: local (ranks are threads of one process), "
            "ucx (UCP over shared memory, TCP or RDMA) or nccl (GPU memory)."},
    {KEEL_CONFIG_FIELD(migration.chunk_bytes), .min = 4096, .max = 1073741824, .unit = "bytes",
     .doc = "Transfers are cut into chunks of this size and pipelined."},
    {KEEL_CONFIG_FIELD(migration.pipeline_depth), .min = 1, .max = 1024, .unit = "chunks",
     .doc = "Chunks in flight per peer at once."},
    {KEEL_CONFIG_FIELD(migration.bandwidth_cap_gb_per_s), .min = 0, .max = kMaxRate, .unit = "GB/s",
     .doc = "Migration bandwidth per rank, at most, so training traffic keeps priority; 0 means "
            "uncapped."},
    {KEEL_CONFIG_FIELD(migration.deadline_seconds), .min = 0, .min_exclusive = true,
     .max = kMaxSeconds, .unit = "seconds",
     .doc = "An epoch's transfers must be done and verified within this time, or the epoch is "
            "aborted and the old placement stays."},
    {KEEL_CONFIG_FIELD(migration.ucx_progress_thread),
     .doc = "The ucx transport drives UCX from a thread of its own while transfers are "
            "outstanding, so they advance while the migrator hashes or copies a chunk; false "
            "leaves progress to the migrator's thread alone."},
    {KEEL_CONFIG_FIELD(migration.nccl_host_transport), .choices = kNcclHostTransportNames,
     .doc = "The nccl transport moves GPU memory with NCCL and sends host memory (checksums, "
            "verdicts) and the control messages that order its NCCL calls over this transport: "
            "ucx (between processes) or local (ranks are threads of one process)."},
    // engine
    {KEEL_CONFIG_FIELD(engine.collective_timeout_seconds), .min = 0, .min_exclusive = true,
     .max = kMaxSeconds, .unit = "seconds",
     .doc = "A collective (count all-gather, agreement, gradient and weight exchange) that some "
            "rank does not join within this time fails with an error naming the missing ranks, "
            "instead of hanging."},
};

#undef KEEL_CONFIG_FIELD

constexpr ConfigSection kConfigSections[] = {
    {"topology", "Ranks and the links between them."},
    {"slots", "Expert slots on every rank."},
    {"cost_model",
     "Constants of the cost model that prices a layer's step time and every migration."},
    {"estimator", "How each expert's coming load is estimated from the loads observed so far."},
    {"policy", "Which placement policy runs, how often, and the settings of each policy."},
    {"policy.eplb", "DeepSeek EPLB: replicas for hot experts, packed by load."},
    {"policy.flexmoe", "FlexMoE: expand, shrink and migrate experts when the balance drops."},
    {"policy.smartmoe", "SmartMoE: swaps experts between ranks, chosen from a candidate pool."},
    {"policy.fastermoe", "FasterMoE: shadows the hottest experts on every rank, step by step."},
    {"policy.lplb", "DeepSeek LPLB: EPLB packing, paired redundant experts, a per-step LP."},
    {"policy.trtllm", "TensorRT-LLM's online balancer: new placements, a few layers at a time."},
    {"policy.keel",
     "Keel: incremental placement that pays for its moves, plus transient replicas for bursts."},
    {"strategy", "How each MoE layer is parallelised: expert, sharded or tensor-sliced experts."},
    {"monitor", "Telemetry: load monitor, Prometheus exporter and trace recorder."},
    {"migration", "Moving expert state between ranks in the background."},
    {"engine", "The runtime a trainer embeds: per-step collectives between ranks."},
};

constexpr int SectionIndex(std::string_view path) {
  for (size_t i = 0; i < std::size(kConfigSections); ++i) {
    if (kConfigSections[i].path == path) return static_cast<int>(i);
  }
  return -1;
}

// Sections in preorder and every key inside a listed section: the YAML writer relies on both.
constexpr bool TablesAreConsistent() {
  for (size_t i = 0; i < std::size(kConfigSections); ++i) {
    std::string_view parent = ParentOf(kConfigSections[i].path);
    if (parent.empty()) continue;
    int p = SectionIndex(parent);
    if (p < 0 || p >= static_cast<int>(i)) return false;
    for (size_t j = static_cast<size_t>(p) + 1; j < i; ++j) {
      if (!IsDescendant(kConfigSections[j].path, parent)) return false;
    }
  }
  for (const ConfigKey& key : kConfigKeys) {
    if (SectionIndex(ParentOf(key.path)) < 0) return false;
    if (key.doc.empty()) return false;
  }
  return true;
}
static_assert(TablesAreConsistent(), "kConfigSections must be in preorder and contain every key");
static_assert(kMaxRanks == 4096, "topology.gpus_per_node's doc names the largest job");

}  // namespace

std::span<const ConfigKey> ConfigKeys() { return kConfigKeys; }
std::span<const ConfigSection> ConfigSections() { return kConfigSections; }

const ConfigKey* FindKey(std::string_view path) {
  for (const ConfigKey& key : kConfigKeys) {
    if (key.path == path) return &key;
  }
  return nullptr;
}

bool IsSection(std::string_view path) { return SectionIndex(path) >= 0; }

ValueType TypeOf(const ConfigKey& key) {
  KeelConfig probe;
  FieldRef ref = key.field(probe);
  switch (ref.index()) {
    case 0:
      return ValueType::kInt;
    case 1:
      return ValueType::kDouble;
    case 2:
      return ValueType::kBool;
    case 3:
      return key.choices.empty() ? ValueType::kString : ValueType::kEnum;
    default:
      return ValueType::kEnum;
  }
}

}  // namespace keel::config_table
