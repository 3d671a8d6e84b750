// Keel's configuration: plain typed structs with defaults, read from YAML and validated against
// one table of documented keys. The same table generates docs/config.md and the --help text, so a
// key cannot exist without documentation. Unknown keys and bad values are errors that name the
// key, the value and the line.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "keel/config.hpp"
#include "keel/status.hpp"

namespace keel {

// Ranks and the links between them.
struct TopologyConfig {
  int num_nodes = 1;
  int gpus_per_node = 8;
  double intra_node_gb_per_s = 400.0;  // per GPU, one direction (NVLink)
  double inter_node_gb_per_s = 50.0;   // per GPU, one direction (NIC)
};

// Expert slots on every rank.
struct SlotsConfig {
  int persistent_per_rank = 3;  // planned per layer
  int transient_per_rank = 1;   // filled per step (the engine: per layer)
};

// Constants of the cost model (placement/cost_model.h).
struct CostModelConfig {
  double expert_tflops = 600.0;  // achieved expert GEMM throughput per GPU
  int hidden_size = 2048;
  int expert_ffn_size = 8192;
  int expert_matrices = 2;                      // FFN weight matrices per expert
  int dtype_bytes = 2;                          // bytes per weight and per activation element
  double home_move_bytes_per_parameter = 14.0;  // weights + optimizer state (Adam, mixed precision)
  double train_flops_multiplier = 3.0;          // forward + backward = 3x forward
  int all_to_all_passes = 4;                    // dispatch + combine, forward and backward
  int replica_sync_passes = 2;                  // gradient reduce into home + weight push back
  int top_k = 2;                                // experts per token: rows / top_k = tokens
  // "columns:efficiency, ..." the expert GEMM's measured throughput at each inner width, relative
  // to expert_tflops; empty = the same at every width (ParseGemmEfficiencyCurve).
  std::string gemm_efficiency;
};

// One point of the GEMM efficiency curve: throughput at an inner width of `columns`, relative to
// CostModelConfig::expert_tflops.
struct GemmEfficiencyPoint {
  int columns = 0;
  double efficiency = 1.0;
};

// Parses "columns:efficiency, ..." (columns ascending, efficiencies in [0.001, 4]); "" is an empty
// curve. Errors name the bad entry.
Result<std::vector<GemmEfficiencyPoint>> ParseGemmEfficiencyCurve(std::string_view text);

// How each MoE layer is parallelised (placement/strategy.h, docs/strategies.md).
struct StrategyConfig {
  std::string name = "ep";  // ep | esp | parm | ppmoe | auto
  int shard_degree = 0;     // esp: ranks an expert is sharded over; 0 = gpus_per_node
  // parm: ranks of an MP group (they hold the same tokens); 0 = the smallest divisor of
  // gpus_per_node above 1.
  int mp_degree = 0;
  int parm_chunks = 4;              // parm: pieces its overlapped schedule pipelines
  int switch_payback_steps = 50;    // auto: a switch must repay its transfer within this many steps
  double min_gain_fraction = 0.02;  // auto: a switch must cut the estimated layer step this much
};

enum class EstimatorKind { kLastStep, kSlidingWindow, kEma };

struct EstimatorConfig {
  EstimatorKind kind = EstimatorKind::kEma;
  double ema_decay = 0.8;  // weight of the past: est = decay * est + (1 - decay) * observed
  int window_steps = 10;
};

struct EplbConfig {
  int num_groups = 0;  // expert groups for hierarchical balancing; 0 = one group per node
};

struct FlexMoeConfig {
  double balance_ratio_trigger = 1.05;  // replan only when predicted max/mean rank load exceeds it
  int max_actions_per_replan = 8;
};

struct SmartMoeConfig {
  int candidate_pool_size = 4;  // placements kept and chosen among online by the cost model
  double stickiness = 0.02;     // relative load gain a swap must beat to leave the current rank
};

struct FasterMoeConfig {
  int max_shadowed_experts = 4;  // hottest experts considered for broadcast each step
};

struct LplbConfig {
  std::string solver = "quota";  // quota | glpk: who solves the per-step linear program
};

struct TrtllmConfig {
  int layer_updates_per_iter = 1;  // layers that adopt their new EPLB placement per replan
};

struct KeelPolicyConfig {
  bool transient_replicas = true;
  // What the persistent slots beyond the homes hold: "replicas" (replans fill them with
  // replicas of the experts the estimate finds hot) or "per_step" (replans leave them empty, and
  // every step's planner uses them as transient slots, with that step's counts).
  std::string spare_slots = "replicas";
  int max_moves_per_replan = 4;          // persistent slots changed per layer per replan, at most
  int home_payback_horizon_steps = 100;  // a home moves only if it pays back within this many steps
  double min_gain_fraction = 0.002;      // a move must cut predicted layer time by this fraction
  // The engine shards a hot expert over ranks of its node instead of replicating it where that
  // costs less (placement/shards.h, ChooseShards).
  bool shard_experts = false;

  // Whether the per-step planner takes the slots a placement leaves empty as transient room
  // (QuotaPlanOptions::spare_slots): spare_slots is per_step and transients are on.
  bool spare_slots_per_step() const { return transient_replicas && spare_slots == "per_step"; }
};

struct PolicyConfig {
  // static | eplb | flexmoe | smartmoe | fastermoe | velb | lplb | swiftmoe | trtllm | keel, or a
  // registered policy's name (keel/policy.hpp)
  std::string name = "keel";
  int replan_interval_steps = 1;
  double planner_watchdog_seconds = 120.0;  // a replan still running after this is an error
  // when_ready: the engine adopts a plan at the first step end at which every rank's planner has
  // finished (never waits); next_step: at the step end after it started, waiting for it there.
  std::string plan_adoption = "when_ready";
  EplbConfig eplb;
  FlexMoeConfig flexmoe;
  SmartMoeConfig smartmoe;
  FasterMoeConfig fastermoe;
  LplbConfig lplb;
  TrtllmConfig trtllm;
  KeelPolicyConfig keel;
};

// Telemetry: the load monitor, the Prometheus exporter and the trace recorder (monitor/).
struct MonitorConfig {
  std::string metrics_address;          // host:port of the exporter; "" = no exporter
  std::string per_expert = "off";       // off | aggregated
  int aggregating_rank = 0;             // the one rank that exports per-expert series
  int queue_capacity = 1024;            // batches the hot path can queue before it drops samples
  bool per_source_rank = false;         // also count tokens per source rank (the traffic matrix)
  std::string trace_path;               // Keel trace written during the run; "" = none
  int trace_sample_interval_steps = 1;  // record every n-th step
};

// Moving expert state between ranks (migration/).
struct MigrationConfig {
  std::string transport = "local";      // local | ucx | nccl
  int chunk_bytes = 4 << 20;            // transfers are cut into chunks of this size
  int pipeline_depth = 4;               // chunks in flight per peer
  double bandwidth_cap_gb_per_s = 0.0;  // 0 = uncapped
  double deadline_seconds = 30.0;       // an epoch's transfers must finish within this
  bool ucx_progress_thread = true;      // the ucx transport drives UCX from a thread of its own
  // What the nccl transport sends host memory and its control messages over: ucx | local.
  std::string nccl_host_transport = "ucx";
};

// The engine's control plane (engine/).
struct EngineConfig {
  double collective_timeout_seconds = 120.0;  // a collective a peer never joins fails after this
};

struct KeelConfig {
  TopologyConfig topology;
  SlotsConfig slots;
  CostModelConfig cost_model;
  EstimatorConfig estimator;
  PolicyConfig policy;
  StrategyConfig strategy;
  MonitorConfig monitor;
  MigrationConfig migration;
  EngineConfig engine;

  int num_ranks() const { return topology.num_nodes * topology.gpus_per_node; }
};

// Parses YAML text; `source` names it in errors ("configs/x.yaml:12: ...").
Result<KeelConfig> ParseConfig(std::string_view yaml_text, std::string_view source = "<config>");
Result<KeelConfig> LoadConfigFile(const std::string& path);

// Checks values that depend on each other (e.g. slots for the static placement).
Status ValidateConfig(const KeelConfig& config);

// Every key with type, default and meaning: Markdown (docs/config.md) and plain text (--help).
std::string ConfigReferenceMarkdown();
std::string ConfigHelpText();

// `config` as a complete YAML file, every key documented in a comment; ParseConfig reads it back
// to an equal config. `keel config --defaults` prints it for the defaults.
std::string ConfigToYaml(const KeelConfig& config);

std::string_view EstimatorKindName(EstimatorKind kind);

// The typed config behind the public handle (include/keel/config.hpp), and a handle over a typed
// config; MakeConfig does not validate (callers pass configs they built and checked).
const KeelConfig& TypedConfig(const Config& config);
Config MakeConfig(KeelConfig typed);

}  // namespace keel
