// DeepSeek's Expert Parallelism Load Balancer (EPLB), reproduced exactly as the reference
// computes it when its sorts are stable: float32 arithmetic accumulated one item at a time in
// visiting order; hierarchical iff num_groups % num_nodes == 0, else global.
#pragma once

#include <vector>

#include "keel/status.hpp"

namespace keel {

struct EplbInput {
  int num_layers = 0;
  int num_experts = 0;
  std::vector<float> weight;  // [num_layers, num_experts] float32 load per logical expert
  int num_replicas = 0;       // physical experts per layer; multiple of num_gpus
  int num_groups = 1;         // expert groups
  int num_nodes = 1;
  int num_gpus = 1;  // multiple of num_nodes
};

struct EplbOutput {
  int num_layers = 0;
  int num_replicas = 0;
  int max_replicas = 0;      // last dimension of log2phy: the largest logcnt over all layers
  std::vector<int> phy2log;  // [num_layers, num_replicas]
  std::vector<int> log2phy;  // [num_layers, num_experts, max_replicas], padded with -1
  std::vector<int> logcnt;   // [num_layers, num_experts]
};

// Validates the input (shapes, divisibility, non-negative finite weights) and balances every
// layer. Errors name the field and value.
Result<EplbOutput> RebalanceExperts(const EplbInput& input);

}  // namespace keel
