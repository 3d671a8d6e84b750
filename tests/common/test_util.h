// Helpers shared by the tests of every module.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <utility>

#include "keel/status.hpp"
#include "placement/topology.h"

namespace keel::testing {

// The value of a Result the test expects to succeed; prints the error and aborts otherwise, so
// a setup failure stops the test at once instead of cascading.
template <typename T>
T ValueOrDie(Result<T> result) {
  if (!result.ok()) {
    std::fprintf(stderr, "unexpected error: %s\n", result.status().ToString().c_str());
    std::abort();
  }
  return std::move(result).value();
}

// The same for a Status.
inline void CheckOk(const Status& status) {
  if (!status.ok()) {
    std::fprintf(stderr, "unexpected error: %s\n", status.ToString().c_str());
    std::abort();
  }
}

// A topology of `num_nodes` x `gpus_per_node` ranks with the given link bandwidths (GB/s per GPU,
// one direction; the config's defaults unless named).
inline Topology MakeTopology(int num_nodes, int gpus_per_node, double intra_node_gb_per_s = 400,
                             double inter_node_gb_per_s = 50) {
  TopologyConfig config;
  config.num_nodes = num_nodes;
  config.gpus_per_node = gpus_per_node;
  config.intra_node_gb_per_s = intra_node_gb_per_s;
  config.inter_node_gb_per_s = inter_node_gb_per_s;
  return ValueOrDie(Topology::Create(config));
}

}  // namespace keel::testing
