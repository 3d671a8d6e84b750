// DeepSeek's EPLB in C++: pack expert groups to nodes, replicate hot experts within each node, pack
// the physical experts of a node to its GPUs. Every sort is stable and every sum is float32,
// accumulated one item at a time in visiting order, so results match the reference bit for bit.
#include "placement/eplb.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

namespace keel {
namespace {

// Orders are kept as 64-bit keys: a weight's float32 bits in the high half (for non-negative
// floats the bit patterns sort like the values) and an index in the low half, so one integer
// comparison orders by weight and breaks ties by index.
uint64_t WeightBits(float w) {
  return w == 0.0f ? 0 : std::bit_cast<uint32_t>(w);  // -0.0f sorts with 0.0f
}

// Reusable buffers, so that balancing many layers does not allocate per layer.
struct Scratch {
  std::vector<uint64_t> keys;
  std::vector<float> pack_weight;
  std::vector<int> pack_items;
};

// Assigns items to `num_packs` packs of equal item count. Items are visited heaviest first (ties:
// lower index first); each goes to the lightest pack that still has room (ties: lower pack
// index), and its rank in the pack is its arrival order. When every pack takes exactly one item,
// item i goes to pack i (the reference skips the greedy pass in that case).
// weight: [n] float32, non-negative; pack_index, rank_in_pack: [n] int, written.
void BalancedPacking(std::span<const float> weight, int num_packs, std::span<int> pack_index,
                     std::span<int> rank_in_pack, Scratch& scratch) {
  const int n = static_cast<int>(weight.size());
  const int items_per_pack = n / num_packs;
  if (items_per_pack == 1) {
    for (int i = 0; i < n; ++i) {
      pack_index[i] = i;
      rank_in_pack[i] = 0;
    }
    return;
  }
  // Ascending keys of (inverted weight, index): heaviest first, ties by lower index.
  std::vector<uint64_t>& order = scratch.keys;
  order.resize(n);
  for (int i = 0; i < n; ++i) order[i] = (~WeightBits(weight[i]) << 32) | uint64_t(i);
  std::sort(order.begin(), order.end());

  // (pack weight, pack) keys of the packs; a full pack's key is the largest value so it is never
  // the minimum. Few packs: scan them all. Many: a min-heap of the packs with room, where only
  // the pack that just took an item changes, so it alone is popped and pushed back.
  std::vector<float>& pack_weight = scratch.pack_weight;
  std::vector<int>& pack_items = scratch.pack_items;
  pack_weight.assign(num_packs, 0.0f);
  pack_items.assign(num_packs, 0);
  order.resize(n + num_packs);
  const auto packs = order.begin() + n;
  auto packs_end = order.end();
  for (int p = 0; p < num_packs; ++p) packs[p] = uint64_t(p);  // ascending: already a heap
  constexpr int kScanPacks = 16;
  for (int k = 0; k < n; ++k) {
    const int item = static_cast<int>(order[k] & 0xffffffffu);
    int pack;
    if (num_packs <= kScanPacks) {
      uint64_t lightest = packs[0];
      for (int p = 1; p < num_packs; ++p) lightest = std::min(lightest, packs[p]);
      pack = static_cast<int>(lightest & 0xffffffffu);
    } else {
      std::pop_heap(packs, packs_end, std::greater<>());
      pack = static_cast<int>(packs_end[-1] & 0xffffffffu);
    }
    pack_index[item] = pack;
    rank_in_pack[item] = pack_items[pack]++;
    pack_weight[pack] += weight[item];
    const bool full = pack_items[pack] == items_per_pack;
    const uint64_t key = full ? ~uint64_t{0} : (WeightBits(pack_weight[pack]) << 32) | pack;
    if (num_packs <= kScanPacks) {
      packs[pack] = key;
    } else if (full) {
      --packs_end;
    } else {
      packs_end[-1] = key;
      std::push_heap(packs, packs_end, std::greater<>());
    }
  }
}

// Spreads `num_physical` copies over the logical experts: each expert gets one, then each extra
// copy goes to the expert with the largest weight / copies (ties: lower index).
// weight: [num_logical] float32, non-negative. phy2log, phy_rank: [num_physical] int (logical
// expert of each copy and its replica rank); logcnt: [num_logical] int. All written.
void ReplicateExperts(std::span<const float> weight, int num_physical, std::span<int> phy2log,
                      std::span<int> phy_rank, std::span<int> logcnt, Scratch& scratch) {
  const int num_logical = static_cast<int>(weight.size());
  for (int e = 0; e < num_logical; ++e) {
    phy2log[e] = e;
    phy_rank[e] = 0;
    logcnt[e] = 1;
  }
  if (num_physical == num_logical) return;
  // Max-heap of (weight / copies, inverted expert) keys: larger load first, then lower expert.
  auto key = [](float load, int e) { return (WeightBits(load) << 32) | (0xffffffffu - e); };
  std::vector<uint64_t>& heap = scratch.keys;
  heap.resize(num_logical);
  for (int e = 0; e < num_logical; ++e) heap[e] = key(weight[e], e);
  std::make_heap(heap.begin(), heap.end());
  for (int p = num_logical; p < num_physical; ++p) {
    std::pop_heap(heap.begin(), heap.end());
    const int e = static_cast<int>(0xffffffffu - (heap.back() & 0xffffffffu));
    phy2log[p] = e;
    phy_rank[p] = logcnt[e]++;
    heap.back() = key(weight[e] / static_cast<float>(logcnt[e]), e);
    std::push_heap(heap.begin(), heap.end());
  }
}

// Shapes of one balancing problem, fixed for every layer.
struct Shape {
  int num_experts;
  int num_replicas;
  int num_groups;
  int num_nodes;
  int num_gpus;
  int group_size() const { return num_experts / num_groups; }
  int groups_per_node() const { return num_groups / num_nodes; }
  int experts_per_node() const { return num_experts / num_nodes; }
  int replicas_per_node() const { return num_replicas / num_nodes; }
  int gpus_per_node() const { return num_gpus / num_nodes; }
  int replicas_per_gpu() const { return num_replicas / num_gpus; }
};

// Buffers of one layer. "Node-local" (mlog) ids number the logical experts node by node, in the
// order their groups were packed onto the node.
struct LayerBuffers {
  std::vector<float> group_weight;  // [num_groups]
  std::vector<int> group_pack;      // [num_groups] node of each group
  std::vector<int> group_rank;      // [num_groups] position of the group within its node
  std::vector<int> log2mlog;        // [num_experts]
  std::vector<int> mlog2log;        // [num_experts]
  std::vector<int> mlogcnt;         // [num_experts] copies per node-local id
  std::vector<float> node_weight;   // [experts_per_node]
  std::vector<int> phy2mlog;        // [replicas_per_node] node-local id per physical expert
  std::vector<int> phy_rank;        // [replicas_per_node]
  std::vector<float> phy_weight;    // [replicas_per_node] load of each physical expert
  std::vector<int> phy_pack;        // [replicas_per_node] GPU (within the node)
  std::vector<int> phy_pack_rank;   // [replicas_per_node] slot within that GPU
  std::vector<int> slot2phy;        // [replicas_per_node]
  Scratch scratch;

  explicit LayerBuffers(const Shape& s)
      : group_weight(s.num_groups),
        group_pack(s.num_groups),
        group_rank(s.num_groups),
        log2mlog(s.num_experts),
        mlog2log(s.num_experts),
        mlogcnt(s.num_experts),
        node_weight(s.experts_per_node()),
        phy2mlog(s.replicas_per_node()),
        phy_rank(s.replicas_per_node()),
        phy_weight(s.replicas_per_node()),
        phy_pack(s.replicas_per_node()),
        phy_pack_rank(s.replicas_per_node()),
        slot2phy(s.replicas_per_node()) {}
};

// The hierarchical algorithm for one layer. weight: [num_experts]; phy2log, phy_rank:
// [num_replicas] written (slot s lives on GPU s / replicas_per_gpu); logcnt: [num_experts].
void BalanceLayer(const Shape& s, std::span<const float> weight, std::span<int> phy2log,
                  std::span<int> phy_rank, std::span<int> logcnt, LayerBuffers& b) {
  const int group_size = s.group_size();
  const int experts_per_node = s.experts_per_node();
  const int replicas_per_node = s.replicas_per_node();
  const int replicas_per_gpu = s.replicas_per_gpu();

  // Step 1: pack groups onto nodes by their total load.
  for (int g = 0; g < s.num_groups; ++g) {
    float sum = 0.0f;
    for (int k = 0; k < group_size; ++k) sum += weight[g * group_size + k];
    b.group_weight[g] = sum;
  }
  BalancedPacking(b.group_weight, s.num_nodes, b.group_pack, b.group_rank, b.scratch);
  for (int g = 0; g < s.num_groups; ++g) {
    const int first = (b.group_pack[g] * s.groups_per_node() + b.group_rank[g]) * group_size;
    for (int k = 0; k < group_size; ++k) {
      b.log2mlog[g * group_size + k] = first + k;
      b.mlog2log[first + k] = g * group_size + k;
    }
  }

  for (int node = 0; node < s.num_nodes; ++node) {
    const int mlog_base = node * experts_per_node;
    // Step 2: replicate the node's experts onto its physical experts.
    for (int j = 0; j < experts_per_node; ++j) b.node_weight[j] = weight[b.mlog2log[mlog_base + j]];
    std::span<int> node_cnt(b.mlogcnt.data() + mlog_base, experts_per_node);
    ReplicateExperts(b.node_weight, replicas_per_node, b.phy2mlog, b.phy_rank, node_cnt, b.scratch);

    // Step 3: pack the node's physical experts onto its GPUs.
    for (int p = 0; p < replicas_per_node; ++p) {
      const int j = b.phy2mlog[p];
      b.phy_weight[p] = b.node_weight[j] / static_cast<float>(node_cnt[j]);
    }
    BalancedPacking(b.phy_weight, s.gpus_per_node(), b.phy_pack, b.phy_pack_rank, b.scratch);
    for (int p = 0; p < replicas_per_node; ++p) {
      b.slot2phy[b.phy_pack[p] * replicas_per_gpu + b.phy_pack_rank[p]] = p;
    }
    const int slot_base = node * replicas_per_node;
    for (int q = 0; q < replicas_per_node; ++q) {
      const int p = b.slot2phy[q];
      phy2log[slot_base + q] = b.mlog2log[mlog_base + b.phy2mlog[p]];
      phy_rank[slot_base + q] = b.phy_rank[p];
    }
  }
  for (int e = 0; e < s.num_experts; ++e) logcnt[e] = b.mlogcnt[b.log2mlog[e]];
}

Status ValidateInput(const EplbInput& in) {
  auto at_least_one = [](const char* field, int value) -> Status {
    if (value >= 1) return Status::Ok();
    return InvalidArgument(std::string(field) + " must be >= 1, got " + std::to_string(value));
  };
  KEEL_RETURN_IF_ERROR(at_least_one("num_layers", in.num_layers));
  KEEL_RETURN_IF_ERROR(at_least_one("num_experts", in.num_experts));
  KEEL_RETURN_IF_ERROR(at_least_one("num_groups", in.num_groups));
  KEEL_RETURN_IF_ERROR(at_least_one("num_nodes", in.num_nodes));
  KEEL_RETURN_IF_ERROR(at_least_one("num_gpus", in.num_gpus));
  const int64_t expected = static_cast<int64_t>(in.num_layers) * in.num_experts;
  if (static_cast<int64_t>(in.weight.size()) != expected) {
    return InvalidArgument("weight has " + std::to_string(in.weight.size()) +
                           " entries, expected num_layers " + std::to_string(in.num_layers) +
                           " x num_experts " + std::to_string(in.num_experts) + " = " +
                           std::to_string(expected));
  }
  for (int64_t i = 0; i < expected; ++i) {
    const float w = in.weight[i];
    if (!std::isfinite(w) || w < 0.0f) {
      return InvalidArgument("weight[" + std::to_string(i / in.num_experts) + "][" +
                             std::to_string(i % in.num_experts) + "] = " + std::to_string(w) +
                             " must be finite and >= 0");
    }
  }
  if (in.num_replicas < in.num_experts) {
    return InvalidArgument("num_replicas " + std::to_string(in.num_replicas) +
                           " is less than num_experts " + std::to_string(in.num_experts) +
                           ": every expert needs a slot");
  }
  if (in.num_replicas % in.num_gpus != 0) {
    return InvalidArgument("num_replicas " + std::to_string(in.num_replicas) +
                           " is not divisible by num_gpus " + std::to_string(in.num_gpus));
  }
  // As the reference: hierarchical only when num_groups % num_nodes == 0, and then its shape rules
  // apply; otherwise the global policy runs with one group on one node, and experts need not
  // divide into groups nor GPUs into nodes.
  if (in.num_groups % in.num_nodes != 0) return Status::Ok();
  if (in.num_experts % in.num_groups != 0) {
    return InvalidArgument("num_experts " + std::to_string(in.num_experts) +
                           " is not divisible by num_groups " + std::to_string(in.num_groups) +
                           " (hierarchical, since num_groups " + std::to_string(in.num_groups) +
                           " % num_nodes " + std::to_string(in.num_nodes) + " == 0)");
  }
  if (in.num_gpus % in.num_nodes != 0) {
    return InvalidArgument("num_gpus " + std::to_string(in.num_gpus) +
                           " is not divisible by num_nodes " + std::to_string(in.num_nodes) +
                           " (hierarchical, since num_groups " + std::to_string(in.num_groups) +
                           " % num_nodes " + std::to_string(in.num_nodes) + " == 0)");
  }
  return Status::Ok();
}

}  // namespace

Result<EplbOutput> RebalanceExperts(const EplbInput& input) {
  KEEL_RETURN_IF_ERROR(ValidateInput(input));
  const bool hierarchical = input.num_groups % input.num_nodes == 0;
  const Shape shape{input.num_experts, input.num_replicas, hierarchical ? input.num_groups : 1,
                    hierarchical ? input.num_nodes : 1, input.num_gpus};
  const int num_layers = input.num_layers;
  const int num_experts = input.num_experts;
  const int num_replicas = input.num_replicas;

  EplbOutput out;
  out.num_layers = num_layers;
  out.num_replicas = num_replicas;
  out.phy2log.resize(static_cast<size_t>(num_layers) * num_replicas);
  out.logcnt.resize(static_cast<size_t>(num_layers) * num_experts);
  std::vector<int> phy_rank(out.phy2log.size());
  LayerBuffers buffers(shape);
  for (int l = 0; l < num_layers; ++l) {
    const size_t phy_base = static_cast<size_t>(l) * num_replicas;
    const size_t log_base = static_cast<size_t>(l) * num_experts;
    BalanceLayer(shape, std::span<const float>(input.weight.data() + log_base, num_experts),
                 std::span<int>(out.phy2log.data() + phy_base, num_replicas),
                 std::span<int>(phy_rank.data() + phy_base, num_replicas),
                 std::span<int>(out.logcnt.data() + log_base, num_experts), buffers);
  }

  out.max_replicas = *std::max_element(out.logcnt.begin(), out.logcnt.end());
  const int width = out.max_replicas;
  out.log2phy.assign(static_cast<size_t>(num_layers) * num_experts * width, -1);
  for (int l = 0; l < num_layers; ++l) {
    const size_t phy_base = static_cast<size_t>(l) * num_replicas;
    const size_t log_base = static_cast<size_t>(l) * num_experts;
    for (int s = 0; s < num_replicas; ++s) {
      const int e = out.phy2log[phy_base + s];
      out.log2phy[(log_base + e) * width + phy_rank[phy_base + s]] = s;
    }
  }
  return out;
}

}  // namespace keel
