// What one `keel demo` trains and compares: its flags (DemoFlags), the runs they ask for
// (DemoRuns) and the model, gate, config and exporter every run shares (DemoSetup, filled by
// tools/demo_command.cc).
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "common/config.h"
#include "keel/communicator.hpp"
#include "keel/status.hpp"
#include "monitor/metrics.h"
#include "tools/demo_model.h"
#include "tools/demo_sequences.h"
#include "tools/demo_trainer.h"
#include "tools/flags.h"

namespace keel::tools {

// The flags of `keel demo`; RunDemo's flag table (tools/demo_command.cc) says what each does.
struct DemoFlags {
  int ranks = 8;
  std::string comm = "local";
  std::string transport = "local";
  std::string memory = "host";
  int layers = 4;
  int experts = 32;
  int top_k = 2;
  int tokens = 4096;
  int hidden = 16;
  int ffn = 32;
  int steps = 30;
  uint64_t seed = 1;
  double zipf = 1.0;
  double learning_rate = AdamOptions().learning_rate;
  std::string config_path;
  std::string metrics_address;
  std::string report_path;
  std::string trace_path;
  bool quiet = false;
  // Luffy (docs/luffy.md).
  bool sequence_migration = false;
  double condense = 0;  // threshold; 0 = off
  int sequence_tokens = 256;
  double affinity = 0.7;
  double repeat = 0;  // with --condense and no --token-repeat: 0.25 (RunDemo sets it)
  double link_gb_per_s = 0;
  std::string sequence_objective = "step";
  // Parallel strategies (docs/strategies.md).
  std::string strategy = "ep";
  int shard_degree = 0;  // esp; 0 = gpus_per_node
  int mp = 0;            // > 0: Parm with MP groups of this many ranks, without and with de-dup
  // Sharded experts in the engine (docs/strategies.md, "Sharded experts in the engine").
  int shard_hot = 0;           // > 0: shard each layer's this many hottest experts from the start
  bool shard_experts = false;  // the keel policy shards or replicates per expert
};

// The runs a demo compares: static against keel by default; with --sequence-migration the
// keel policy without and with it; with --condense exact against condensed training; with
// --strategy whole experts under the keel policy against the strategy's sharded ones; with --mp
// Parm's dispatch without and with its de-duplication, then whole experts under the keel policy
// without and with the engine's MP groups; with --shard-hot or --shard-experts the keel policy
// without and with the engine's sharded experts.
struct DemoRun {
  std::string name;
  std::string policy;
  bool migrate_sequences = false;
  float condense_threshold = 0;
  std::string strategy = "ep";
  bool parm_dedup = true;
  bool engine_shards = false;  // --shard-hot's experts, or policy.keel.shard_experts
  int mp_group_size = 1;       // the engine's MP groups (EngineOptions::mp_group_size)
};

std::vector<DemoRun> DemoRuns(const DemoFlags& f);

// Which comparison the flags ask for: the engine's sharded experts (--shard-hot,
// --shard-experts), a parallel strategy (--strategy, --mp) or Luffy (--sequence-migration,
// --condense).
bool EngineShardMode(const DemoFlags& f);
bool StrategyMode(const DemoFlags& f);
bool SequenceMode(const DemoFlags& f);

// The sharded strategy a demo runs, and the shards each expert has under it.
std::pair<std::string, int> ShardsOf(const DemoFlags& f, const KeelConfig& config);

// The keel policy shards or replicates per expert: by the flag, or by the config.
bool ShardExperts(const DemoFlags& flags, const KeelConfig& config);

// Each flag in its range, the flags' combinations, and no flag given that the runs they ask for
// would not read; errors name the flag and its value. `parser` says which flags were given.
Status CheckFlags(const DemoFlags& f, const FlagParser& parser);

// The files a demo reads (--trace, --config) against those it writes (--report, and the trace
// the engine records at the config's monitor.trace_path): none may replace another
// (CheckOutputsApart). Reads the config to learn its monitor.trace_path.
Status CheckDemoPaths(const DemoFlags& f);

// The config of a run: --config as written (its topology must have `ranks` ranks), or 1 node x
// `ranks` GPUs with room for the static placement plus one spare persistent slot and one
// transient slot per rank, the cost model sized to the demo's experts on a CPU.
Result<KeelConfig> MakeConfig(const DemoFlags& f, const FlagParser& parser, int ranks);

// What every run of one demo shares. Filled in place (SetUpDemo): the sequence gate refers to
// the token gate.
struct DemoSetup {
  Communicator* communicator = nullptr;  // null: the ranks are threads of this process
  int ranks = 0;
  bool rank0 = true;
  DemoModelOptions model;
  std::optional<TokenGate> gate;
  KeelConfig config;
  std::unique_ptr<Metrics> metrics;       // the exporter, in the aggregating rank's process
  std::optional<SequenceGate> sequences;  // Luffy's runs
  bool mpi() const { return communicator != nullptr; }
};

}  // namespace keel::tools
