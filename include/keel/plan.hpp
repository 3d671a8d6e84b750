// One placement per layer from a per-expert load, with the inputs and outputs of DeepSeek EPLB's
// rebalance_experts (weight, num_replicas, num_groups, num_nodes, num_gpus in; phy2log, log2phy,
// logcnt out), so that any Keel policy can stand in where EPLB is called. `keel plan` is this.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "keel/config.hpp"
#include "keel/status.hpp"

namespace keel {

// The placement policies by name: the built-in ones (static, eplb, flexmoe, smartmoe, fastermoe,
// velb, lplb, swiftmoe, trtllm, keel; docs/policies.md), then those added with
// keel::RegisterPolicy (keel/policy.hpp) in the order they were added.
std::vector<std::string> PolicyNames();

struct PlanRequest {
  std::string policy = "eplb";  // one of PolicyNames()
  // >= 1; num_layers x num_replicas <= 2^24, and log2phy's largest size, num_layers x num_experts
  // x (num_replicas - num_experts + 1), <= 2^24
  int num_layers = 0;
  int num_experts = 0;  // in [1, 65536]
  // [num_layers, num_experts] float64, row-major: each expert's load; finite and >= 0.
  std::vector<double> weight;
  int num_replicas = 0;  // physical slots per layer: >= num_experts, divisible by num_gpus, <= 2^20
  // eplb: hierarchical when num_groups % num_nodes == 0, and then num_groups divides num_experts
  // and num_nodes divides num_gpus; otherwise global, with no such rule (DeepSeek's reference).
  // Every other policy: num_nodes divides num_gpus, and num_groups is not read.
  int num_groups = 1;  // <= 65536
  int num_nodes = 1;   // <= 4096
  int num_gpus = 1;    // <= 4096
  // Policy parameters and cost model (its topology and slots are replaced by the fields above);
  // null: the defaults. Not read by eplb, which is DeepSeek's algorithm as published.
  const Config* config = nullptr;
};

struct PlanResult {
  int num_layers = 0;
  int num_experts = 0;
  int num_replicas = 0;
  int max_copies = 0;            // the width of log2phy
  std::vector<int32_t> phy2log;  // [num_layers, num_replicas] expert per slot, -1 for empty
  std::vector<int32_t> log2phy;  // [num_layers, num_experts, max_copies] slots, padded with -1
  std::vector<int32_t> logcnt;   // [num_layers, num_experts] copies per expert
};

// Plans every layer. eplb runs DeepSeek's algorithm directly; every other policy plans on a
// num_nodes x (num_gpus / num_nodes) topology with num_replicas / num_gpus slots per GPU,
// replanning from its initial placement until the placement stops changing (nothing is trained
// yet, so moves are free). InvalidArgument naming the field and value for a bad request.
Result<PlanResult> PlanPlacement(const PlanRequest& request);

}  // namespace keel
