// How a sharded expert's state is cut into its shards (docs/strategies.md, "Sharded experts in
// the engine"): each region of a slot (weights, optimizer state) is a list of row-major tensors
// back to back, and shard j of s holds, for every tensor, its j-th slice of rows or of columns as
// a row-major tensor of its own, the slices back to back in the tensors' order. The engine reads
// it only when it reshards an expert (policy.keel.shard_experts): cutting a whole expert into
// shards, or joining shards, then copies exactly these slices.
#pragma once

#include <cstddef>
#include <vector>

namespace keel {

struct ShardedTensor {
  size_t rows = 0;
  size_t columns = 0;
  size_t element_bytes = 0;
  // false: shards take equal runs of rows (an FFN's first matrix, [ffn, hidden]);
  // true: equal runs of every row's columns (its second, [hidden, ffn]).
  bool split_columns = false;

  size_t bytes() const { return rows * columns * element_bytes; }
};

// Per region; an empty list stands for one tensor of the region's bytes split by rows of one
// byte (shard j holds the j-th contiguous 1/s of the region).
struct ShardLayout {
  std::vector<ShardedTensor> weights;
  std::vector<ShardedTensor> optimizer;
};

}  // namespace keel
