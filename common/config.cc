// The configuration table: every key of KeelConfig with its type, default, range, unit and
// meaning. The YAML reader, the validator, docs/config.md, --help and `keel config --defaults`
// all walk this one table, so they cannot disagree.
#include "common/config.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <climits>
#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <memory>
#include <span>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "common/file.h"
#include "common/policy_names.h"
#include "keel/limits.hpp"

namespace keel {

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// Names of EstimatorKind values, in the enum's order.
constexpr std::string_view kEstimatorKindNames[] = {"last", "window", "ema"};
static_assert(std::size(kEstimatorKindNames) == static_cast<size_t>(EstimatorKind::kEma) + 1);

constexpr std::string_view kPerExpertModes[] = {"off", "aggregated"};
constexpr std::string_view kLplbSolverNames[] = {"quota", "glpk"};
constexpr std::string_view kStrategyNames[] = {"ep", "esp", "parm", "ppmoe", "auto"};
constexpr std::string_view kTransportNames[] = {"local", "ucx", "nccl"};
constexpr std::string_view kNcclHostTransportNames[] = {"ucx", "local"};

// Where a key's value lives inside a KeelConfig; the alternative is the key's type.
using FieldRef = std::variant<int*, double*, bool*, std::string*, EstimatorKind*>;

// One configuration key. Numbers must lie within [min, max] (bounds excluded when marked);
// strings and enums must be one of `choices`.
struct ConfigKey {
  std::string_view path;  // dotted YAML path, "policy.flexmoe.balance_ratio_trigger"
  FieldRef (*field)(KeelConfig&);
  double min = -kInf;
  bool min_exclusive = false;
  double max = kInf;
  bool max_exclusive = false;
  std::span<const std::string_view> choices = {};
  // Allowed besides `choices`: names a program adds at run time (registered policies).
  std::vector<std::string> (*added_choices)() = nullptr;
  std::string_view unit = {};
  std::string_view doc = {};
};

// The member expression is also the key's dotted path, so the two cannot drift apart.
#define KEEL_CONFIG_FIELD(member) \
  .path = #member, .field = [](KeelConfig& c) { return FieldRef(&c.member); }

// Sizes have upper bounds (keel/limits.hpp), so that a typo fails here rather than as an
// exhausted memory later.
constexpr double kMaxModelWidth = 1 << 20;  // hidden and FFN sizes, elements

constexpr ConfigKey kConfigKeys[] = {
    // topology
    {KEEL_CONFIG_FIELD(topology.num_nodes), .min = 1, .max = kMaxRanks,
     .doc = "Nodes (hosts) in the job; the ranks of one node share a fast link (NVLink)."},
    {KEEL_CONFIG_FIELD(topology.gpus_per_node), .min = 1, .max = kMaxRanks,
     .doc = "Ranks (GPUs) per node; the job has num_nodes x gpus_per_node ranks, at most "
            "65536."},
    {KEEL_CONFIG_FIELD(topology.intra_node_gb_per_s), .min = 0, .min_exclusive = true,
     .unit = "GB/s",
     .doc = "Bandwidth between two ranks of one node, per GPU and direction (NVLink)."},
    {KEEL_CONFIG_FIELD(topology.inter_node_gb_per_s), .min = 0, .min_exclusive = true,
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
    {KEEL_CONFIG_FIELD(cost_model.expert_tflops), .min = 0, .min_exclusive = true,
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
     .unit = "bytes",
     .doc = "Bytes moved per expert parameter when its home changes rank: weights plus optimizer "
            "state (about 14 with Adam and mixed precision)."},
    {KEEL_CONFIG_FIELD(cost_model.train_flops_multiplier), .min = 1,
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
     .unit = "seconds",
     .doc =
         "The engine's watchdog: a replan still running after this long is an error on every "
         "rank (StepEnd returns it), a log line and keel_watchdog_trips_total{what=\"planner\"}; "
         "the placement in force stays, and the late plan is dropped when it ends."},
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
     .doc = "host:port where the Prometheus exporter serves /metrics; a bare port listens on "
            "127.0.0.1; empty means no exporter."},
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
    {KEEL_CONFIG_FIELD(migration.bandwidth_cap_gb_per_s), .min = 0, .unit = "GB/s",
     .doc = "Migration bandwidth per rank, at most, so training traffic keeps priority; 0 means "
            "uncapped."},
    {KEEL_CONFIG_FIELD(migration.deadline_seconds), .min = 0, .min_exclusive = true,
     .unit = "seconds",
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
     .unit = "seconds",
     .doc = "A collective (count all-gather, agreement, gradient and weight exchange) that some "
            "rank does not join within this time fails with an error naming the missing ranks, "
            "instead of hanging."},
};

#undef KEEL_CONFIG_FIELD

// Every map in the YAML file, in the order the writers print them: a parent comes before its
// children and its children follow it directly.
struct ConfigSection {
  std::string_view path;
  std::string_view doc;
};

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

constexpr std::string_view ParentOf(std::string_view path) {
  size_t dot = path.rfind('.');
  return dot == std::string_view::npos ? std::string_view() : path.substr(0, dot);
}

constexpr std::string_view LastPart(std::string_view path) {
  size_t dot = path.rfind('.');
  return dot == std::string_view::npos ? path : path.substr(dot + 1);
}

constexpr bool IsDescendant(std::string_view path, std::string_view ancestor) {
  return ancestor.empty() || (path.size() > ancestor.size() && path.starts_with(ancestor) &&
                              path[ancestor.size()] == '.');
}

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

enum class ValueType { kInt, kDouble, kBool, kString, kEnum };

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

const ConfigKey* FindKey(std::string_view path) {
  for (const ConfigKey& key : kConfigKeys) {
    if (key.path == path) return &key;
  }
  return nullptr;
}

// Shortest text that reads back to the same double, with ".0" on whole numbers so that a float
// key never looks like an int.
std::string FormatDouble(double value) {
  char buffer[64];
  auto [end, error] = std::to_chars(buffer, buffer + sizeof(buffer), value);
  if (error != std::errc()) return std::to_string(value);
  std::string text(buffer, end);
  if (std::isfinite(value) && text.find_first_of(".eE") == std::string::npos) text += ".0";
  return text;
}

// Range bounds read as plain numbers: "> 0", "in [0, 1)".
std::string FormatBound(double bound) {
  char buffer[64];
  auto [end, error] = std::to_chars(buffer, buffer + sizeof(buffer), bound);
  return error == std::errc() ? std::string(buffer, end) : std::to_string(bound);
}

// ">= 1", "> 0", "in [0, 1)"; empty when the key has no range.
std::string RangeText(const ConfigKey& key) {
  bool has_min = std::isfinite(key.min);
  bool has_max = std::isfinite(key.max);
  if (has_min && has_max) {
    return "in " + std::string(key.min_exclusive ? "(" : "[") + FormatBound(key.min) + ", " +
           FormatBound(key.max) + (key.max_exclusive ? ")" : "]");
  }
  if (has_min) return (key.min_exclusive ? "> " : ">= ") + FormatBound(key.min);
  if (has_max) return (key.max_exclusive ? "< " : "<= ") + FormatBound(key.max);
  return "";
}

std::string ChoicesText(const ConfigKey& key, std::string_view quote) {
  std::string text;
  for (size_t i = 0; i < key.choices.size(); ++i) {
    if (i > 0) text += ", ";
    text += quote;
    text += key.choices[i];
    text += quote;
  }
  return text;
}

std::string_view TypeName(ValueType type) {
  switch (type) {
    case ValueType::kInt:
      return "int";
    case ValueType::kDouble:
      return "float";
    case ValueType::kBool:
      return "bool";
    case ValueType::kString:
      return "string";
    case ValueType::kEnum:
      return "enum";
  }
  return "?";
}

// "int, >= 1", "float, in [0, 1)", "enum: one of last, window, ema", "bool".
std::string TypeText(const ConfigKey& key, std::string_view quote) {
  ValueType type = TypeOf(key);
  std::string text(TypeName(type));
  if (type == ValueType::kEnum) return text + ": one of " + ChoicesText(key, quote);
  std::string range = RangeText(key);
  if (!range.empty()) text += ", " + range;
  return text;
}

// Why `text` cannot be a free-form value (a path, an address), or "": control characters and
// bytes that are not UTF-8 would not survive a round trip through YAML, nor mean a real path.
std::string TextProblem(std::string_view text) {
  size_t i = 0;
  while (i < text.size()) {
    const auto byte = static_cast<unsigned char>(text[i]);
    if (byte < 0x20 || byte == 0x7f) {
      return "has a control character (byte " + std::to_string(byte) + ") at position " +
             std::to_string(i);
    }
    if (byte < 0x80) {
      ++i;
      continue;
    }
    // A lead byte 110xxxxx, 1110xxxx or 11110xxx and as many bytes 10xxxxxx, in shortest form,
    // at most U+10FFFF and no surrogate.
    const std::string invalid = "is not valid UTF-8 at position " + std::to_string(i);
    const int extra = (byte >> 5) == 0x6 ? 1 : (byte >> 4) == 0xe ? 2 : (byte >> 3) == 0x1e ? 3 : 0;
    if (extra == 0 || text.size() - i <= static_cast<size_t>(extra)) return invalid;
    uint32_t code = byte & (0x3f >> extra);
    for (int k = 1; k <= extra; ++k) {
      const auto next = static_cast<unsigned char>(text[i + k]);
      if ((next >> 6) != 0x2) return invalid;
      code = (code << 6) | (next & 0x3f);
    }
    constexpr uint32_t kSmallest[] = {0, 0x80, 0x800, 0x10000};
    if (code < kSmallest[extra] || code > 0x10ffff || (code >= 0xd800 && code <= 0xdfff)) {
      return invalid;
    }
    i += static_cast<size_t>(extra) + 1;
  }
  return "";
}

// A free-form string as a double-quoted YAML scalar, so that "" and values like "on" or "8080"
// read back as the same string; control characters (which TextProblem refuses) are shown as \xNN.
std::string QuotedYamlString(std::string_view text) {
  std::string quoted = "\"";
  for (char c : text) {
    const auto byte = static_cast<unsigned char>(c);
    if (byte < 0x20 || byte == 0x7f) {
      constexpr char kHex[] = "0123456789abcdef";
      quoted += {'\\', 'x', kHex[byte >> 4], kHex[byte & 0xf]};
      continue;
    }
    if (c == '"' || c == '\\') quoted += '\\';
    quoted += c;
  }
  return quoted + "\"";
}

std::string FormatValue(const ConfigKey& key, const KeelConfig& config) {
  KeelConfig copy = config;
  FieldRef ref = key.field(copy);
  if (auto* value = std::get_if<int*>(&ref)) return std::to_string(**value);
  if (auto* value = std::get_if<double*>(&ref)) return FormatDouble(**value);
  if (auto* value = std::get_if<bool*>(&ref)) return **value ? "true" : "false";
  if (auto* value = std::get_if<std::string*>(&ref)) {
    return key.choices.empty() ? QuotedYamlString(**value) : **value;
  }
  return std::string(EstimatorKindName(*std::get<EstimatorKind*>(ref)));
}

// Empty when `value` lies within the key's range, else "is out of range (must be >= 1)".
std::string RangeProblem(const ConfigKey& key, double value) {
  bool below = key.min_exclusive ? value <= key.min : value < key.min;
  bool above = key.max_exclusive ? value >= key.max : value > key.max;
  if (!below && !above) return "";
  return "is out of range (must be " + RangeText(key) + ")";
}

std::string ChoiceProblem(const ConfigKey& key, std::string_view value) {
  for (std::string_view choice : key.choices) {
    if (choice == value) return "";
  }
  std::string allowed = ChoicesText(key, "");
  if (key.added_choices != nullptr) {
    for (const std::string& choice : key.added_choices()) {
      if (choice == value) return "";
      allowed += ", " + choice;
    }
  }
  return "is not allowed (must be one of " + allowed + ")";
}

// ---------------------------------------------------------------------------------------------
// Reading YAML

// Where the values came from, for messages: the source name and each key's line.
struct ParseOrigin {
  std::string source;
  std::map<std::string, int, std::less<>> key_lines;  // dotted path -> 1-based line

  // "configs/x.yaml:7: " or "configs/x.yaml: " when the line is unknown.
  std::string Where(int line) const {
    if (source.empty()) return line > 0 ? "line " + std::to_string(line) + ": " : "";
    return line > 0 ? source + ":" + std::to_string(line) + ": " : source + ": ";
  }
  std::string WhereKey(std::string_view path) const {
    auto it = key_lines.find(path);
    return Where(it == key_lines.end() ? 0 : it->second);
  }
};

int LineOf(const YAML::Node& node) {
  YAML::Mark mark = node.Mark();
  return mark.line >= 0 ? mark.line + 1 : 0;
}

std::string DescribeNode(const YAML::Node& node) {
  switch (node.Type()) {
    case YAML::NodeType::Map:
      return "a map";
    case YAML::NodeType::Sequence:
      return "a list";
    case YAML::NodeType::Null:
      return "nothing";
    case YAML::NodeType::Scalar:
      return node.Scalar().empty() ? "''" : node.Scalar();
    case YAML::NodeType::Undefined:
      break;
  }
  return "nothing";
}

std::string ShownValue(std::string_view text) {
  return text.empty() ? std::string("''") : std::string(text);
}

bool ParseInteger(std::string_view text, long long& out) {
  if (text.starts_with('+')) text.remove_prefix(1);
  if (text.empty()) return false;
  auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), out);
  return error == std::errc() && end == text.data() + text.size();
}

bool ParseNumber(std::string_view text, double& out) {
  if (text.starts_with('+')) text.remove_prefix(1);
  if (text.empty()) return false;
  auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), out);
  return error == std::errc() && end == text.data() + text.size() && std::isfinite(out);
}

bool ParseBool(std::string_view text, bool& out) {
  if (text == "true" || text == "True" || text == "TRUE") {
    out = true;
    return true;
  }
  if (text == "false" || text == "False" || text == "FALSE") {
    out = false;
    return true;
  }
  return false;
}

// Sets one key from its YAML value, checking type, range and choices.
Status SetKey(const ConfigKey& key, const YAML::Node& node, int line, const ParseOrigin& origin,
              KeelConfig& config) {
  auto fail = [&](std::string_view value, std::string_view problem) {
    return InvalidArgument(origin.Where(line) + std::string(key.path) + ": " + std::string(value) +
                           " " + std::string(problem));
  };
  ValueType type = TypeOf(key);
  if (!node.IsScalar()) {
    std::string expected = type == ValueType::kInt      ? "an integer"
                           : type == ValueType::kDouble ? "a number"
                           : type == ValueType::kBool   ? "true or false"
                           : type == ValueType::kEnum   ? "one of " + ChoicesText(key, "")
                                                        : "a string";
    return InvalidArgument(origin.Where(line) + std::string(key.path) + ": expected " + expected +
                           ", got " + DescribeNode(node));
  }
  const std::string& text = node.Scalar();
  FieldRef ref = key.field(config);
  switch (type) {
    case ValueType::kInt: {
      long long value = 0;
      if (!ParseInteger(text, value)) return fail(ShownValue(text), "is not an integer");
      std::string problem = RangeProblem(key, static_cast<double>(value));
      if (problem.empty() && (value < INT_MIN || value > INT_MAX)) {
        problem = "is out of range (must fit in a 32-bit int)";
      }
      if (!problem.empty()) return fail(text, problem);
      *std::get<int*>(ref) = static_cast<int>(value);
      return Status::Ok();
    }
    case ValueType::kDouble: {
      double value = 0;
      if (!ParseNumber(text, value)) return fail(ShownValue(text), "is not a finite number");
      std::string problem = RangeProblem(key, value);
      if (!problem.empty()) return fail(text, problem);
      *std::get<double*>(ref) = value;
      return Status::Ok();
    }
    case ValueType::kBool: {
      bool value = false;
      if (!ParseBool(text, value)) {
        return fail(ShownValue(text), "is not a boolean (must be true or false)");
      }
      *std::get<bool*>(ref) = value;
      return Status::Ok();
    }
    case ValueType::kString:
    case ValueType::kEnum: {
      std::string problem = ChoiceProblem(key, text);
      if (!key.choices.empty() && !problem.empty()) return fail(ShownValue(text), problem);
      if (auto* value = std::get_if<std::string*>(&ref)) {
        **value = text;
      } else {
        auto it = std::find(std::begin(kEstimatorKindNames), std::end(kEstimatorKindNames), text);
        *std::get<EstimatorKind*>(ref) =
            static_cast<EstimatorKind>(it - std::begin(kEstimatorKindNames));
      }
      return Status::Ok();
    }
  }
  return Internal("config key " + std::string(key.path) + " has no type");
}

// The names a map at `section` may hold: its keys, then its subsections.
std::vector<std::string_view> ChildNames(std::string_view section) {
  std::vector<std::string_view> names;
  for (const ConfigKey& key : kConfigKeys) {
    if (ParentOf(key.path) == section) names.push_back(LastPart(key.path));
  }
  for (const ConfigSection& child : kConfigSections) {
    if (ParentOf(child.path) == section) names.push_back(LastPart(child.path));
  }
  return names;
}

size_t EditDistance(std::string_view a, std::string_view b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      size_t above = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = above;
    }
  }
  return row[b.size()];
}

Status UnknownKey(std::string_view section, std::string_view name, int line,
                  const ParseOrigin& origin) {
  std::string path =
      section.empty() ? std::string(name) : std::string(section) + "." + std::string(name);
  std::vector<std::string_view> names = ChildNames(section);
  std::string message = origin.Where(line) + "unknown key '" + path + "'";
  std::string_view closest;
  // Suggest only near misses: a few edits, more for longer names.
  size_t best = std::max<size_t>(2, name.size() / 3) + 1;
  for (std::string_view candidate : names) {
    // A part of a longer name ("trigger" for "balance_ratio_trigger") counts as a near miss.
    bool part = name.size() >= 4 && (candidate.find(name) != std::string_view::npos ||
                                     name.find(candidate) != std::string_view::npos);
    size_t distance = part ? 1 : EditDistance(name, candidate);
    if (distance < best) {
      best = distance;
      closest = candidate;
    }
  }
  if (!closest.empty()) message += " (did you mean '" + std::string(closest) + "'?)";
  message += section.empty() ? "; valid top-level keys: "
                             : "; valid keys in '" + std::string(section) + "': ";
  for (size_t i = 0; i < names.size(); ++i) {
    if (i > 0) message += ", ";
    message += names[i];
  }
  return InvalidArgument(std::move(message));
}

Status ParseSection(const YAML::Node& map, std::string_view section, ParseOrigin& origin,
                    KeelConfig& config) {
  std::map<std::string, int, std::less<>> seen;  // name -> line, to catch duplicates
  for (auto entry = map.begin(); entry != map.end(); ++entry) {
    YAML::Node key_node = entry->first;  // copies: the iterator hands out a temporary
    YAML::Node value = entry->second;
    int line = LineOf(key_node);
    if (!key_node.IsScalar()) {
      return InvalidArgument(origin.Where(line) + "a key in '" +
                             std::string(section.empty() ? "the top level" : section) + "' is " +
                             DescribeNode(key_node) + ", not a name");
    }
    const std::string& name = key_node.Scalar();
    std::string path = section.empty() ? name : std::string(section) + "." + name;
    auto [previous, inserted] = seen.emplace(name, line);
    if (!inserted) {
      return InvalidArgument(origin.Where(line) + path + ": key appears twice (first on line " +
                             std::to_string(previous->second) + ")");
    }
    if (const ConfigKey* key = FindKey(path)) {
      if (value.IsNull()) {
        return InvalidArgument(origin.Where(line) + path + ": has no value (expected " +
                               TypeText(*key, "") + "; leave the key out to keep the default)");
      }
      KEEL_RETURN_IF_ERROR(SetKey(*key, value, line, origin, config));
      origin.key_lines[path] = line;
    } else if (SectionIndex(path) >= 0) {
      if (value.IsNull()) continue;  // "policy:" with nothing under it keeps the defaults
      if (!value.IsMap()) {
        std::string names;
        for (std::string_view child : ChildNames(path)) {
          names += names.empty() ? "" : ", ";
          names += child;
        }
        return InvalidArgument(origin.Where(line) + path + ": expected a map of keys (" + names +
                               "), got " + DescribeNode(value));
      }
      KEEL_RETURN_IF_ERROR(ParseSection(value, path, origin, config));
    } else {
      return UnknownKey(section, name, line, origin);
    }
  }
  return Status::Ok();
}

// Range and choice checks of every key, then the constraints between keys.
Status Validate(const KeelConfig& config, const ParseOrigin& origin) {
  for (const ConfigKey& key : kConfigKeys) {
    KeelConfig copy = config;
    FieldRef ref = key.field(copy);
    std::string problem;
    if (auto* value = std::get_if<int*>(&ref)) problem = RangeProblem(key, **value);
    if (auto* value = std::get_if<double*>(&ref)) {
      problem = std::isfinite(**value) ? RangeProblem(key, **value) : "is not a finite number";
    }
    if (auto* value = std::get_if<std::string*>(&ref)) {
      problem = key.choices.empty() ? TextProblem(**value) : ChoiceProblem(key, **value);
    }
    if (auto* value = std::get_if<EstimatorKind*>(&ref)) {
      auto index = static_cast<size_t>(**value);
      if (index >= std::size(kEstimatorKindNames)) problem = "is not a known estimator kind";
    }
    if (!problem.empty()) {
      std::string shown = std::holds_alternative<EstimatorKind*>(ref)
                              ? std::to_string(static_cast<int>(*std::get<EstimatorKind*>(ref)))
                              : ShownValue(FormatValue(key, config));
      return InvalidArgument(origin.WhereKey(key.path) + std::string(key.path) + ": " + shown +
                             " " + problem);
    }
  }

  // Names a constraint between keys at the line of the first of them that the file set.
  auto cross_error = [&](std::string_view first, std::string_view second, std::string message) {
    bool first_set = origin.key_lines.count(first) > 0;
    return InvalidArgument(origin.WhereKey(first_set ? first : second) + message);
  };

  const TopologyConfig& topology = config.topology;
  const int64_t num_ranks = int64_t{topology.num_nodes} * topology.gpus_per_node;
  if (num_ranks > kMaxRanks) {
    return cross_error("topology.num_nodes", "topology.gpus_per_node",
                       "topology.num_nodes x topology.gpus_per_node: " + std::to_string(num_ranks) +
                           " ranks, more than the 65536 Keel supports");
  }
  const int64_t slots_per_layer =
      num_ranks * (int64_t{config.slots.persistent_per_rank} + config.slots.transient_per_rank);
  if (slots_per_layer > kMaxSlotsPerLayer) {
    return cross_error(
        "slots.persistent_per_rank", "slots.transient_per_rank",
        "slots.persistent_per_rank + slots.transient_per_rank: " + std::to_string(slots_per_layer) +
            " slots per layer on " + std::to_string(num_ranks) + " ranks, more than 2^20");
  }
  if (config.monitor.aggregating_rank >= num_ranks) {
    return cross_error(
        "monitor.aggregating_rank", "topology.gpus_per_node",
        "monitor.aggregating_rank: " + std::to_string(config.monitor.aggregating_rank) +
            " is not a rank of the job (it has " + std::to_string(num_ranks) + " ranks)");
  }
  const CostModelConfig& cost = config.cost_model;
  if (cost.home_move_bytes_per_parameter < cost.dtype_bytes) {
    return cross_error("cost_model.home_move_bytes_per_parameter", "cost_model.dtype_bytes",
                       "cost_model.home_move_bytes_per_parameter: " +
                           FormatDouble(cost.home_move_bytes_per_parameter) +
                           " is less than cost_model.dtype_bytes (" +
                           std::to_string(cost.dtype_bytes) +
                           "); moving a home moves at least the weights");
  }
  if (Result<std::vector<GemmEfficiencyPoint>> curve =
          ParseGemmEfficiencyCurve(cost.gemm_efficiency);
      !curve.ok()) {
    return InvalidArgument(origin.WhereKey("cost_model.gemm_efficiency") +
                           "cost_model.gemm_efficiency: " + curve.status().message());
  }
  // Shard and MP groups are consecutive ranks of one node.
  for (auto [path, degree] :
       {std::pair<std::string_view, int>{"strategy.shard_degree", config.strategy.shard_degree},
        {"strategy.mp_degree", config.strategy.mp_degree}}) {
    if (degree > 0 && topology.gpus_per_node % degree != 0) {
      return cross_error(path, "topology.gpus_per_node",
                         std::string(path) + ": " + std::to_string(degree) +
                             " does not divide topology.gpus_per_node (" +
                             std::to_string(topology.gpus_per_node) +
                             "); its groups must be ranks of one node");
    }
  }
  if (config.policy.name == "keel" && config.policy.keel.transient_replicas &&
      config.slots.transient_per_rank == 0) {
    return cross_error("policy.keel.transient_replicas", "slots.transient_per_rank",
                       "policy.keel.transient_replicas: true needs slots.transient_per_rank >= 1 "
                       "(it is 0); set transient_replicas to false or add a transient slot");
  }
  return Status::Ok();
}

// ---------------------------------------------------------------------------------------------
// Writing documentation

// Greedy word wrap of `text` into lines of at most `width` characters (longer words stay whole).
std::vector<std::string> WrapWords(std::string_view text, size_t width) {
  std::vector<std::string> lines;
  std::string line;
  size_t start = 0;
  while (start < text.size()) {
    size_t end = text.find(' ', start);
    if (end == std::string_view::npos) end = text.size();
    std::string_view word = text.substr(start, end - start);
    start = end + 1;
    if (word.empty()) continue;
    if (!line.empty() && line.size() + 1 + word.size() > width) {
      lines.push_back(std::move(line));
      line.clear();
    }
    if (!line.empty()) line += ' ';
    line += word;
  }
  if (!line.empty()) lines.push_back(std::move(line));
  return lines;
}

void AppendWrapped(std::string& out, std::string_view text, std::string_view indent,
                   size_t width = 100) {
  size_t room = width > indent.size() + 20 ? width - indent.size() : 20;
  for (const std::string& line : WrapWords(text, room)) {
    out += indent;
    out += line;
    out += '\n';
  }
}

// "GB/s; float, > 0", "one of last, window, ema", "bool": the note after a value in YAML.
std::string ValueNote(const ConfigKey& key) {
  std::string type = TypeText(key, "");
  if (TypeOf(key) == ValueType::kEnum) type = "one of " + ChoicesText(key, "");
  return key.unit.empty() ? type : std::string(key.unit) + "; " + type;
}

std::string EscapeMarkdownCell(std::string_view text) {
  std::string out;
  for (char c : text) {
    if (c == '|') out += '\\';
    out += c;
  }
  return out;
}

constexpr std::string_view kExampleYaml = R"(topology:
  num_nodes: 2
  gpus_per_node: 8
policy:
  name: flexmoe
  flexmoe:
    balance_ratio_trigger: 1.1
)";

}  // namespace

Result<std::vector<GemmEfficiencyPoint>> ParseGemmEfficiencyCurve(std::string_view text) {
  std::vector<GemmEfficiencyPoint> curve;
  auto trim = [](std::string_view part) {
    while (!part.empty() && std::isspace(static_cast<unsigned char>(part.front()))) {
      part.remove_prefix(1);
    }
    while (!part.empty() && std::isspace(static_cast<unsigned char>(part.back()))) {
      part.remove_suffix(1);
    }
    return part;
  };
  if (trim(text).empty()) return curve;
  size_t begin = 0;
  while (begin <= text.size()) {
    const size_t comma = std::min(text.find(',', begin), text.size());
    const std::string_view entry = trim(text.substr(begin, comma - begin));
    begin = comma + 1;
    const std::string shown = "entry '" + std::string(entry) + "'";
    const size_t colon = entry.find(':');
    if (colon == std::string_view::npos) {
      return InvalidArgument(shown + " is not columns:efficiency");
    }
    GemmEfficiencyPoint point;
    const std::string_view columns_text = trim(entry.substr(0, colon));
    const std::string_view efficiency_text = trim(entry.substr(colon + 1));
    // Whole text parsed, nothing left over.
    auto parse = [](std::string_view part, auto& value) {
      const auto [end, error] = std::from_chars(part.data(), part.data() + part.size(), value);
      return error == std::errc() && end == part.data() + part.size();
    };
    if (!parse(columns_text, point.columns) || point.columns < 1 ||
        point.columns > kMaxModelWidth) {
      return InvalidArgument(shown + ": columns must be a whole number in [1, 2^20]");
    }
    if (!parse(efficiency_text, point.efficiency) ||
        !(point.efficiency > 0 && point.efficiency <= 4)) {
      return InvalidArgument(shown + ": efficiency must be a number in (0, 4]");
    }
    if (!curve.empty() && point.columns <= curve.back().columns) {
      return InvalidArgument(shown + ": columns must ascend (the entry before has " +
                             std::to_string(curve.back().columns) + ")");
    }
    curve.push_back(point);
  }
  return curve;
}

std::string_view EstimatorKindName(EstimatorKind kind) {
  auto index = static_cast<size_t>(kind);
  return index < std::size(kEstimatorKindNames) ? kEstimatorKindNames[index] : "unknown";
}

Result<KeelConfig> ParseConfig(std::string_view yaml_text, std::string_view source) {
  ParseOrigin origin;
  origin.source = std::string(source);
  KeelConfig config;
  try {
    YAML::Node root = YAML::Load(std::string(yaml_text));
    if (root.IsMap()) {
      KEEL_RETURN_IF_ERROR(ParseSection(root, "", origin, config));
    } else if (!root.IsNull()) {
      std::string names;
      for (std::string_view child : ChildNames("")) {
        names += names.empty() ? "" : ", ";
        names += child;
      }
      return InvalidArgument(origin.Where(LineOf(root)) +
                             "expected a map of sections at the top level (" + names + "), got " +
                             DescribeNode(root));
    }
  } catch (const YAML::Exception& error) {
    int line = error.mark.line >= 0 ? error.mark.line + 1 : 0;
    return InvalidArgument(origin.Where(line) + "YAML syntax error: " + error.msg);
  } catch (const std::exception& error) {
    return InvalidArgument(origin.Where(0) + "cannot read YAML: " + error.what());
  }
  KEEL_RETURN_IF_ERROR(Validate(config, origin));
  return config;
}

Result<KeelConfig> LoadConfigFile(const std::string& path) {
  Result<std::string> text = ReadFile(path);
  if (!text.ok()) return text.status().WithContext("config file");
  return ParseConfig(*text, path);
}

Status ValidateConfig(const KeelConfig& config) { return Validate(config, ParseOrigin{}); }

std::string ConfigReferenceMarkdown() {
  const KeelConfig defaults;
  std::string out;
  out += "# Keel configuration reference\n\n";
  out +=
      "<!-- Generated by `keel config --markdown` from the key table in common/config.cc; "
      "edit that table, not this file. -->\n\n";
  out +=
      "Keel reads its settings from one YAML file. This page names every key by its dotted "
      "path, such as `policy.flexmoe.balance_ratio_trigger`; in the file, each dot is one level "
      "of nesting:\n\n";
  out += "```yaml\n";
  out += kExampleYaml;
  out += "```\n\n";
  out +=
      "Keys left out keep their defaults, so an empty file is a complete configuration. An "
      "unknown key, a value of the wrong type or out of range, and a syntax error are all "
      "errors that name the key, the value and the line. `keel config --check FILE` checks a "
      "file; `keel config --defaults` prints every key at its default, with its meaning as a "
      "comment.\n";
  for (const ConfigSection& section : kConfigSections) {
    out += "\n## `" + std::string(section.path) + "`\n\n";
    out += std::string(section.doc) + "\n";
    bool header = false;
    for (const ConfigKey& key : kConfigKeys) {
      if (ParentOf(key.path) != section.path) continue;
      if (!header) {
        out += "\n| key | type | default | meaning |\n|---|---|---|---|\n";
        header = true;
      }
      std::string default_text = "`" + FormatValue(key, defaults) + "`";
      if (!key.unit.empty()) default_text += " " + std::string(key.unit);
      out += "| `" + std::string(key.path) + "` | " + EscapeMarkdownCell(TypeText(key, "`")) +
             " | " + default_text + " | " + EscapeMarkdownCell(key.doc) + " |\n";
    }
  }
  return out;
}

std::string ConfigHelpText() {
  const KeelConfig defaults;
  std::string out =
      "Configuration keys (YAML; each dot in a key is one level of nesting, and keys left\n"
      "out keep their defaults):\n";
  for (const ConfigSection& section : kConfigSections) {
    bool first = true;
    for (const ConfigKey& key : kConfigKeys) {
      if (ParentOf(key.path) != section.path) continue;
      if (first) {
        out += "\n" + std::string(section.path) + ": " + std::string(section.doc) + "\n";
        first = false;
      }
      out += "  " + std::string(key.path) + " = " + FormatValue(key, defaults);
      if (!key.unit.empty()) out += " " + std::string(key.unit);
      out += "  (" + TypeText(key, "") + ")\n";
      AppendWrapped(out, key.doc, "      ");
    }
  }
  return out;
}

std::string ConfigToYaml(const KeelConfig& config) {
  std::string out =
      "# Keel configuration. Keys left out keep their defaults; `keel config --markdown` "
      "documents\n# every key.\n";
  for (const ConfigSection& section : kConfigSections) {
    size_t depth = static_cast<size_t>(std::count(section.path.begin(), section.path.end(), '.'));
    std::string indent(2 * depth, ' ');
    out += "\n";
    AppendWrapped(out, section.doc, indent + "# ");
    out += indent + std::string(LastPart(section.path)) + ":\n";
    std::string key_indent(2 * (depth + 1), ' ');
    for (const ConfigKey& key : kConfigKeys) {
      if (ParentOf(key.path) != section.path) continue;
      AppendWrapped(out, key.doc, key_indent + "# ");
      out += key_indent + std::string(LastPart(key.path)) + ": " + FormatValue(key, config) +
             "  # " + ValueNote(key) + "\n";
    }
  }
  return out;
}

// --- Config, the public handle -----------------------------------------------------------------

Config::Config() : typed_(std::make_unique<KeelConfig>()) {}
Config::Config(std::unique_ptr<KeelConfig> typed) : typed_(std::move(typed)) {}
Config::Config(const Config& other) : typed_(std::make_unique<KeelConfig>(*other.typed_)) {}
Config& Config::operator=(const Config& other) {
  *typed_ = *other.typed_;
  return *this;
}
// A moved-from handle keeps a config of its own: typed_ is never null.
Config::Config(Config&& other) noexcept : typed_(std::make_unique<KeelConfig>()) {
  std::swap(typed_, other.typed_);
}
Config& Config::operator=(Config&& other) noexcept {
  std::swap(typed_, other.typed_);
  return *this;
}
Config::~Config() = default;

Result<Config> Config::FromYaml(std::string_view yaml, std::string_view source) {
  KEEL_ASSIGN_OR_RETURN(KeelConfig typed, ParseConfig(yaml, source));
  return MakeConfig(std::move(typed));
}

Result<Config> Config::FromFile(const std::string& path) {
  KEEL_ASSIGN_OR_RETURN(KeelConfig typed, LoadConfigFile(path));
  return MakeConfig(std::move(typed));
}

std::string Config::Reference() { return ConfigHelpText(); }
std::string Config::ToYaml() const { return ConfigToYaml(*typed_); }
int Config::num_ranks() const { return typed_->num_ranks(); }
std::string Config::policy() const { return typed_->policy.name; }

const KeelConfig& TypedConfig(const Config& config) { return *config.typed_; }
Config MakeConfig(KeelConfig typed) {
  return Config(std::make_unique<KeelConfig>(std::move(typed)));
}

}  // namespace keel
