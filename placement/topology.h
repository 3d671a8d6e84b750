// Ranks grouped into nodes and the bandwidth of the links between them. Rank g lives on node
// g / gpus_per_node; ranks of one node share a fast link (NVLink), nodes talk over the network.
#pragma once

#include "common/config.h"
#include "keel/status.hpp"

namespace keel {

class Topology {
 public:
  // Validates the config: positive node and GPU counts, positive bandwidths.
  static Result<Topology> Create(const TopologyConfig& config);

  int num_nodes() const { return num_nodes_; }
  int gpus_per_node() const { return gpus_per_node_; }
  int num_ranks() const { return num_nodes_ * gpus_per_node_; }
  int node_of(int rank) const { return rank / gpus_per_node_; }
  bool same_node(int a, int b) const { return node_of(a) == node_of(b); }

  // Bytes per second from rank `src` to rank `dst` (distinct ranks).
  double bandwidth(int src, int dst) const {
    return same_node(src, dst) ? intra_node_bytes_per_second_ : inter_node_bytes_per_second_;
  }
  double intra_node_bytes_per_second() const { return intra_node_bytes_per_second_; }
  double inter_node_bytes_per_second() const { return inter_node_bytes_per_second_; }

 private:
  Topology(int num_nodes, int gpus_per_node, double intra, double inter)
      : num_nodes_(num_nodes),
        gpus_per_node_(gpus_per_node),
        intra_node_bytes_per_second_(intra),
        inter_node_bytes_per_second_(inter) {}

  int num_nodes_;
  int gpus_per_node_;
  double intra_node_bytes_per_second_;
  double inter_node_bytes_per_second_;
};

}  // namespace keel
