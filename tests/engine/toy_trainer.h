// A toy trainer over the engine, shared by the threaded engine tests and the multi-process test:
// each (token, k) row adds a fixed vector to its expert's gradient (int64), so the exact result
// of any number of steps is known without the engine, whatever the placement did.
#pragma once

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "common/config.h"
#include "engine/engine_internal.h"
#include "keel/device_memory.hpp"
#include "keel/engine.hpp"
#include "keel/status.hpp"
#include "migration/transfer_plan.h"
#include "migration/transport_local.h"
#include "placement/placement.h"

namespace keel::toy {

constexpr int kRanks = 4;
constexpr int kLayers = 2;
constexpr int kExperts = 8;
constexpr int kTopK = 2;
constexpr int kTokens = 256;      // per rank per step
constexpr int kWeightWords = 64;  // floats per expert

inline KeelConfig TestConfig(const std::string& policy) {
  KeelConfig config;
  config.topology.num_nodes = 1;
  config.topology.gpus_per_node = kRanks;
  config.slots.persistent_per_rank = 3;
  config.slots.transient_per_rank = 1;
  // Small experts on slow "GPUs": compute dominates, so replicas pay.
  config.cost_model.hidden_size = 64;
  config.cost_model.expert_ffn_size = 128;
  config.cost_model.expert_tflops = 0.001;
  config.cost_model.dtype_bytes = 4;
  config.policy.name = policy;
  // Epochs at the same steps however busy the machine is, so what a test asserts about the
  // placements does not depend on when a replan happened to finish.
  config.policy.plan_adoption = "next_step";
  config.migration.deadline_seconds = 10;
  config.engine.collective_timeout_seconds = 30;
  return config;
}

// Router output of `rank` at `step`, skewed toward low expert ids and drifting every few steps.
inline std::vector<int32_t> RouterIds(int step, int rank, int layer) {
  std::mt19937 rng(static_cast<uint32_t>(step * 1009 + rank * 31 + layer * 7 + 1));
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  std::vector<int32_t> ids(kTokens * kTopK);
  for (int t = 0; t < kTokens; ++t) {
    const int first = static_cast<int>(kExperts * std::pow(uniform(rng), 3.0));
    int second = (first + 1 + static_cast<int>(uniform(rng) * (kExperts - 1))) % kExperts;
    ids[t * kTopK] = (first + step / 6 + layer) % kExperts;
    ids[t * kTopK + 1] = (second + step / 6 + layer) % kExperts;
    if (t % 97 == 5) ids[t * kTopK + 1] = -1;  // a dropped choice
  }
  return ids;
}

// A row routed to expert e adds this to its gradient, whichever copy computes it.
inline int64_t RowGradient(int layer, int expert, int word) {
  return 1000 * (layer + 1) + 37 * expert + word + 1;
}

// A sharded expert's shard j of s holds the expert's words [j * W / s, (j + 1) * W / s) first in
// its slot (W = kWeightWords); the rest of the slot is unused (zero, or what a reshard left). A
// row routed to the shard adds the expert's row gradient of those words.
// The sharded experts of the sharded runs: layer 0's expert 0 over 2 ranks, layer 1's expert 3
// over all 4.
inline std::vector<ShardedExpert> ToyShardedExperts() { return {{0, 0, 2}, {1, 3, 4}}; }

struct UnitWords {
  int expert = -1;
  int first = 0;  // the expert's first word in this unit
  int count = 0;  // words of the expert this unit holds
};
inline UnitWords WordsOfUnit(const LayerPlacement& placement, int unit) {
  if (unit < 0) return {};
  const int shards = placement.unit_shards[unit];
  const int count = kWeightWords / shards;
  return {placement.unit_expert[unit], placement.unit_shard[unit] * count, count};
}

// The toy optimizer: weights and an accumulated state, both exact functions of the gradient.
inline void Optimize(float* weights, double* state, const int64_t* gradient) {
  for (int j = 0; j < kWeightWords; ++j) {
    state[j] += static_cast<double>(gradient[j]);
    weights[j] -= 1e-6f * static_cast<float>(gradient[j]);
  }
}

struct RankBuffers {
  std::vector<std::vector<float>> weights;  // [layer * local_slots + local slot]
  std::vector<std::vector<int64_t>> gradients;
  std::vector<std::vector<double>> optimizer;
};

// The slot buffers the engine sees: the host vectors of RankBuffers themselves, or (with
// `device`) device buffers of the same sizes that the trainer reaches only by copies, as a GPU
// trainer's kernels would. Upload / Download move one slot's regions between the two.
class SlotMemory {
 public:
  SlotMemory(std::shared_ptr<DeviceMemory> device, RankBuffers& host)
      : device_(std::move(device)), host_(host) {}
  SlotMemory(const SlotMemory&) = delete;
  SlotMemory& operator=(const SlotMemory&) = delete;
  ~SlotMemory() {
    for (std::byte* data : allocated_) device_->FreeDevice(data);
  }

  // The buffers of region `index` (RankBuffers' index) to register.
  Result<SlotBuffers> Buffers(size_t index, bool persistent) {
    SlotBuffers slot{host_.weights[index].data(), host_.gradients[index].data(),
                     persistent ? host_.optimizer[index].data() : nullptr};
    if (device_ == nullptr) return slot;
    if (device_slots_.size() <= index) device_slots_.resize(index + 1);
    KEEL_ASSIGN_OR_RETURN(slot.weights, Allocate(kWeightWords * sizeof(float)));
    KEEL_ASSIGN_OR_RETURN(slot.gradients, Allocate(kWeightWords * sizeof(int64_t)));
    if (persistent) {
      KEEL_ASSIGN_OR_RETURN(slot.optimizer, Allocate(kWeightWords * sizeof(double)));
    }
    device_slots_[index] = slot;
    return slot;
  }

  // Host -> device (no-op for host buffers) for the regions named.
  Status Upload(size_t index, bool weights, bool gradients, bool optimizer) {
    return Move(index, weights, gradients, optimizer, /*up=*/true);
  }
  // Device -> host.
  Status Download(size_t index, bool weights, bool gradients, bool optimizer) {
    return Move(index, weights, gradients, optimizer, /*up=*/false);
  }

 private:
  Result<void*> Allocate(size_t bytes) {
    KEEL_ASSIGN_OR_RETURN(std::byte * data, device_->AllocateDevice(bytes));
    allocated_.push_back(data);
    return static_cast<void*>(data);
  }
  Status Move(size_t index, bool weights, bool gradients, bool optimizer, bool up) {
    if (device_ == nullptr) return Status::Ok();
    const SlotBuffers& slot = device_slots_[index];
    auto copy = [&](void* device, void* host, size_t bytes) -> Status {
      if (device == nullptr) return Status::Ok();
      auto* d = static_cast<std::byte*>(device);
      auto* h = static_cast<std::byte*>(host);
      return up ? device_->Copy(d, h, bytes) : device_->Copy(h, d, bytes);
    };
    if (weights) {
      KEEL_RETURN_IF_ERROR(
          copy(slot.weights, host_.weights[index].data(), kWeightWords * sizeof(float)));
    }
    if (gradients) {
      KEEL_RETURN_IF_ERROR(
          copy(slot.gradients, host_.gradients[index].data(), kWeightWords * sizeof(int64_t)));
    }
    if (optimizer) {
      KEEL_RETURN_IF_ERROR(
          copy(slot.optimizer, host_.optimizer[index].data(), kWeightWords * sizeof(double)));
    }
    return Status::Ok();
  }

  std::shared_ptr<DeviceMemory> device_;
  RankBuffers& host_;
  std::vector<SlotBuffers> device_slots_;
  std::vector<std::byte*> allocated_;
};

struct RankRecord {
  std::vector<int64_t> epoch_after_step;  // [step]
  // [step][micro-batch * layers + layer] (rows this rank sent to each physical slot) and its
  // recv_counts.
  std::vector<std::vector<std::map<int, int64_t>>> sent;
  std::vector<std::vector<std::vector<int64_t>>> recv;
  // [step][micro-batch * layers + layer] the route's local_experts: the expert each local slot
  // held then.
  std::vector<std::vector<std::vector<int32_t>>> local_experts;
  // Rows this rank computed in a transient replica that an earlier micro-batch of the step had
  // filled.
  int64_t rows_in_earlier_transients = 0;
  std::vector<Placement> final_placements;      // over units
  std::vector<LayerPlacement> final_layouts;    // the same, as the engine answers it
  std::vector<LayerPlacement> initial_layouts;  // as the run started
  EngineStats stats;
  Status status;
  int local_slots = 0;
  int slots_per_rank = 0;
};

// The engine's public placement as the placement module's type, for its helpers (HomeSlot).
inline Result<Placement> ToPlacement(const LayerPlacement& p) {
  return Placement::Create(p.num_experts, p.num_ranks,
                           std::vector<int>(p.phy2log.begin(), p.phy2log.end()),
                           std::vector<int>(p.home.begin(), p.home.end()));
}

// The toy model's engine options for this rank: its layers, experts and slot regions.
inline EngineOptions ToyOptions(const KeelConfig& config, Communicator& communicator) {
  EngineOptions options;
  options.config = MakeConfig(config);
  options.num_layers = kLayers;
  options.num_experts = kExperts;
  options.top_k = kTopK;
  options.shape.weight_bytes = kWeightWords * sizeof(float);
  options.shape.gradient_bytes = kWeightWords * sizeof(int64_t);
  options.shape.optimizer_bytes = kWeightWords * sizeof(double);
  options.shape.gradient_type = GradientType::kFixedInt64;
  options.communicator = &communicator;
  return options;
}

// Where a run starts and what it does around its steps, for the checkpoint tests: RunRank
// calls `before_fill` after creating the engine (RestoreState goes there), `after_register` once
// the slots are filled and registered (LoadExperts), and `after_step` after each StepEnd (true:
// stop after this step). `sharded_experts` go to the engine's options; with `mp_group_size` M,
// ranks [g * M, (g + 1) * M) hold the same tokens, those RouterIds gives ranks g * M to
// (g + 1) * M - 1, and each member routes its share: the same rows as without MP groups.
struct RunHooks {
  std::vector<ShardedExpert> sharded_experts;
  int mp_group_size = 1;
  int first_step = 0;
  std::function<Status(Engine&)> before_fill;
  std::function<Status(Engine&)> after_register;
  std::function<Result<bool>(Engine&, int step)> after_step;
  // Each step's tokens routed in this many micro-batches, layer by layer, every micro-batch's
  // gradients added up before one ReduceGradients; divides kTokens.
  int micro_batches = 1;
};

// Trains steps [hooks.first_step, steps) of the toy model on this rank; `fabric` is null unless
// the migration transport is local. With `device`, every slot buffer lives in that device memory;
// `mine` gets their final contents.
inline Status RunRank(const KeelConfig& config, int steps, Communicator& communicator,
                      LocalFabric* fabric, RankBuffers& mine, RankRecord& record,
                      Metrics* metrics = nullptr, std::shared_ptr<DeviceMemory> device = nullptr,
                      const RunHooks& hooks = {}) {
  const int rank = communicator.rank();
  // The transport outlives the engine, which is declared after it.
  std::unique_ptr<Transport> transport = fabric != nullptr ? fabric->Connect(rank) : nullptr;
  EngineOptions options = ToyOptions(config, communicator);
  options.shape.memory = device != nullptr ? MemoryKind::kDevice : MemoryKind::kHost;
  options.device_memory = device;
  options.transport = transport.get();
  options.sharded_experts = hooks.sharded_experts;
  options.mp_group_size = hooks.mp_group_size;
  // Declared before the engine, which it outlives.
  SlotMemory slots(device, mine);
  KEEL_ASSIGN_OR_RETURN(std::unique_ptr<Engine> engine, EngineFactory::Create(options, metrics));
  if (hooks.before_fill) KEEL_RETURN_IF_ERROR(hooks.before_fill(*engine));
  const int local_slots = engine->local_slots();
  const int slots_per_rank = engine->slots_per_rank();
  record.local_slots = local_slots;
  record.slots_per_rank = slots_per_rank;
  for (int l = 0; l < kLayers; ++l) record.initial_layouts.push_back(engine->placement(l));
  const size_t regions = static_cast<size_t>(kLayers) * local_slots;
  mine.weights.assign(regions, std::vector<float>(kWeightWords));
  mine.gradients.assign(regions, std::vector<int64_t>(kWeightWords));
  mine.optimizer.assign(regions, std::vector<double>(kWeightWords, 0.0));
  for (int l = 0; l < kLayers; ++l) {
    for (int i = 0; i < local_slots; ++i) {
      const size_t index = static_cast<size_t>(l) * local_slots + i;
      if (i < slots_per_rank) {
        const LayerPlacement placement = engine->placement(l);
        const UnitWords unit =
            WordsOfUnit(placement, placement.expert_at(rank * slots_per_rank + i));
        for (int j = 0; j < unit.count; ++j) {
          mine.weights[index][j] = static_cast<float>(unit.expert * 100 + unit.first + j);
        }
      }
      KEEL_ASSIGN_OR_RETURN(const SlotBuffers slot, slots.Buffers(index, i < slots_per_rank));
      KEEL_RETURN_IF_ERROR(slots.Upload(index, true, true, true));
      KEEL_RETURN_IF_ERROR(engine->RegisterSlot(l, i, slot));
    }
  }
  if (hooks.after_register) {
    KEEL_RETURN_IF_ERROR(hooks.after_register(*engine));
    for (size_t index = 0; index < regions; ++index) {
      KEEL_RETURN_IF_ERROR(slots.Download(index, true, false, true));
    }
  }
  record.sent.resize(steps);
  record.recv.resize(steps);
  record.local_experts.resize(steps);
  const int tokens = kTokens / hooks.micro_batches;  // per member and micro-batch
  for (int step = hooks.first_step; step < steps; ++step) {
    for (auto& g : mine.gradients) std::fill(g.begin(), g.end(), 0);
    // [layer][local slot] the expert it held in this step's earlier micro-batches, -1 for none.
    std::vector<std::vector<int32_t>> held(kLayers, std::vector<int32_t>(local_slots, -1));
    for (int micro_batch = 0; micro_batch < hooks.micro_batches; ++micro_batch) {
      for (int l = 0; l < kLayers; ++l) {
        // This rank's tokens of the micro-batch, or its MP group's, each member's in turn.
        std::vector<int32_t> ids;
        const int first = rank - rank % hooks.mp_group_size;
        for (int member = first; member < first + hooks.mp_group_size; ++member) {
          const std::vector<int32_t> own = RouterIds(step, member, l);
          ids.insert(ids.end(), own.begin() + micro_batch * tokens * kTopK,
                     own.begin() + (micro_batch + 1) * tokens * kTopK);
        }
        KEEL_ASSIGN_OR_RETURN(LayerRoute route, engine->Route(l, ids));
        if (route.share_begin != static_cast<int64_t>(rank - first) * tokens ||
            route.share_end != route.share_begin + tokens) {
          return Internal("the share is not this member's tokens");
        }
        // A slot keeps its expert for the whole step: its gradient buffer sums the micro-batches.
        for (int i = 0; i < local_slots; ++i) {
          const int32_t before = held[l][i];
          if (before >= 0 && route.local_experts[i] != before) {
            return Internal("local slot " + std::to_string(i) + " of layer " + std::to_string(l) +
                            " held expert " + std::to_string(before) + " and then " +
                            std::to_string(route.local_experts[i]) + " in one step");
          }
        }
        // The entries this rank routes: a chosen expert, in its share.
        const auto routes = [&](size_t entry) {
          const int64_t token = static_cast<int64_t>(entry / kTopK);
          return ids[entry] >= 0 && token >= route.share_begin && token < route.share_end;
        };
        const LayerPlacement layout = engine->placement(l);
        const auto entry_of = [&](size_t row) {
          return route.row_entry.empty() ? row : static_cast<size_t>(route.row_entry[row]);
        };
        if (!route.row_entry.empty() && route.row_entry.size() != route.slot.size()) {
          return Internal("row_entry and slot have different lengths");
        }
        std::map<int, int64_t> sent;
        int64_t valid = 0;
        for (size_t row = 0; row < route.slot.size(); ++row) {
          if (!routes(entry_of(row))) {
            if (route.slot[row] != -1) return Internal("a dropped or unshared choice got a slot");
            continue;
          }
          ++valid;
          ++sent[route.slot[row]];
        }
        int64_t sent_total = 0;
        for (int64_t c : route.send_counts) sent_total += c;
        if (sent_total != valid) return Internal("send_counts do not add up to the valid rows");
        // Every row lands on a copy of the expert its entry asked for, an entry of a sharded expert
        // on each of its shards once, in shard order; transients (in transient slots, or in the
        // persistent slots the placement leaves empty) are checked by their owners.
        KEEL_ASSIGN_OR_RETURN(const Placement placement, ToPlacement(layout));
        std::vector<int> rows_of_entry(ids.size(), 0);
        for (size_t row = 0; row < route.slot.size(); ++row) {
          const int slot = route.slot[row];
          const size_t entry = entry_of(row);
          const int shard = rows_of_entry[entry]++;
          if (slot < 0) continue;
          if (slot < placement.num_slots() && placement.expert_at(slot) != kEmptySlot) {
            const int unit = placement.expert_at(slot);
            if (layout.unit_expert[unit] != ids[entry] || layout.unit_shard[unit] != shard) {
              return Internal("slot holds another expert or shard");
            }
          } else if (slot >= placement.num_slots() + kRanks * engine->transient_per_rank()) {
            return Internal("slot out of range");
          }
        }
        std::vector<int> shards_of(kExperts, 1);
        for (size_t u = 0; u < layout.unit_expert.size(); ++u) {
          shards_of[layout.unit_expert[u]] = layout.unit_shards[u];
        }
        for (size_t entry = 0; entry < ids.size(); ++entry) {
          if (rows_of_entry[entry] != (routes(entry) ? shards_of[ids[entry]] : 1)) {
            return Internal("entry " + std::to_string(entry) + " has " +
                            std::to_string(rows_of_entry[entry]) + " rows, not one per shard");
          }
        }
        // The slot owner computes its rows: gradient = rows x the unit's row gradients.
        for (int src = 0; src < kRanks; ++src) {
          for (int i = 0; i < local_slots; ++i) {
            const int64_t rows = route.recv_counts[static_cast<size_t>(src) * local_slots + i];
            if (rows == 0) continue;
            const int expert = route.local_experts[i];
            if (expert < 0) return Internal("rows sent to an empty slot");
            const int count = kWeightWords / route.local_shards[i];
            const int first = route.local_shard[i] * count;
            int64_t* g = mine.gradients[static_cast<size_t>(l) * local_slots + i].data();
            for (int j = 0; j < count; ++j) g[j] += rows * RowGradient(l, expert, first + j);
            if (i >= slots_per_rank && held[l][i] >= 0) record.rows_in_earlier_transients += rows;
          }
        }
        for (int i = 0; i < local_slots; ++i) held[l][i] = route.local_experts[i];
        record.sent[step].push_back(std::move(sent));
        record.recv[step].push_back(route.recv_counts);
        record.local_experts[step].push_back(route.local_experts);
      }
    }
    for (size_t index = 0; index < regions; ++index) {
      KEEL_RETURN_IF_ERROR(slots.Upload(index, false, true, false));
    }
    KEEL_RETURN_IF_ERROR(engine->ReduceGradients());
    for (int l = 0; l < kLayers; ++l) {
      for (const auto& home : engine->HomeSlots(l)) {
        const size_t index = static_cast<size_t>(l) * local_slots + home.local_slot;
        KEEL_RETURN_IF_ERROR(slots.Download(index, true, true, true));
        Optimize(mine.weights[index].data(), mine.optimizer[index].data(),
                 mine.gradients[index].data());
        KEEL_RETURN_IF_ERROR(slots.Upload(index, true, false, true));
      }
    }
    KEEL_RETURN_IF_ERROR(engine->StepEnd());
    record.epoch_after_step.push_back(engine->epoch());
    if (hooks.after_step) {
      KEEL_ASSIGN_OR_RETURN(const bool stop, hooks.after_step(*engine, step));
      if (stop) break;
    }
  }
  for (int l = 0; l < kLayers; ++l) {
    record.final_layouts.push_back(engine->placement(l));
    KEEL_ASSIGN_OR_RETURN(Placement placement, ToPlacement(record.final_layouts.back()));
    record.final_placements.push_back(std::move(placement));
  }
  for (size_t index = 0; index < regions; ++index) {
    KEEL_RETURN_IF_ERROR(slots.Download(index, true, true, true));
  }
  record.stats = engine->stats();
  return Status::Ok();
}

// What every expert's home holds after `steps` steps, computed without the engine.
struct Reference {
  std::vector<std::vector<float>> weights;  // [layer * experts + expert]
  std::vector<std::vector<double>> state;
};

inline Reference ComputeReference(int steps) {
  Reference ref;
  ref.weights.resize(kLayers * kExperts);
  ref.state.assign(kLayers * kExperts, std::vector<double>(kWeightWords, 0.0));
  for (int l = 0; l < kLayers; ++l) {
    for (int e = 0; e < kExperts; ++e) {
      auto& w = ref.weights[l * kExperts + e];
      w.resize(kWeightWords);
      for (int j = 0; j < kWeightWords; ++j) w[j] = static_cast<float>(e * 100 + j);
    }
  }
  for (int step = 0; step < steps; ++step) {
    for (int l = 0; l < kLayers; ++l) {
      std::vector<int64_t> rows(kExperts, 0);
      for (int r = 0; r < kRanks; ++r) {
        for (int32_t id : RouterIds(step, r, l)) {
          if (id >= 0) ++rows[id];
        }
      }
      for (int e = 0; e < kExperts; ++e) {
        std::vector<int64_t> g(kWeightWords);
        for (int j = 0; j < kWeightWords; ++j) g[j] = rows[e] * RowGradient(l, e, j);
        Optimize(ref.weights[l * kExperts + e].data(), ref.state[l * kExperts + e].data(),
                 g.data());
      }
    }
  }
  return ref;
}

// Every copy of `record`'s rank holds the reference weights of its expert and every home slot
// the reference optimizer state.
inline Status CheckAgainstReference(int rank, const RankBuffers& buffers, const RankRecord& record,
                                    const Reference& ref) {
  for (int l = 0; l < kLayers; ++l) {
    const Placement& p = record.final_placements[l];
    for (int i = 0; i < record.slots_per_rank; ++i) {
      const int slot = rank * record.slots_per_rank + i;
      const int unit = p.expert_at(slot);
      if (unit < 0) continue;
      const UnitWords words = WordsOfUnit(record.final_layouts[l], unit);
      const int e = words.expert;
      const size_t index = static_cast<size_t>(l) * record.local_slots + i;
      const std::string where = "rank " + std::to_string(rank) + " layer " + std::to_string(l) +
                                " slot " + std::to_string(slot) + " expert " + std::to_string(e) +
                                " words from " + std::to_string(words.first);
      // The unit's words of the expert come first in the slot.
      const auto differs = [&](const auto& have, const auto& want) {
        return !std::equal(have.begin(), have.begin() + words.count, want.begin() + words.first);
      };
      if (differs(buffers.weights[index], ref.weights[l * kExperts + e])) {
        return Internal(where + ": weights differ from the reference");
      }
      if (p.home(unit) == rank && p.home_slot(unit) == slot &&
          differs(buffers.optimizer[index], ref.state[l * kExperts + e])) {
        return Internal(where + ": optimizer state differs from the reference");
      }
    }
  }
  return Status::Ok();
}

// (step, layer, physical slot, rows) for every slot `record`'s rank sent rows to.
inline std::vector<int64_t> FlattenSent(const RankRecord& record) {
  std::vector<int64_t> flat;
  for (size_t step = 0; step < record.sent.size(); ++step) {
    for (size_t l = 0; l < record.sent[step].size(); ++l) {
      for (const auto& [slot, rows] : record.sent[step][l]) {
        flat.insert(flat.end(), {static_cast<int64_t>(step), static_cast<int64_t>(l), slot, rows});
      }
    }
  }
  return flat;
}

// What source `src` sent to each of `owner`'s slots (FlattenSent of src) equals the rows
// `owner`'s engine announced in recv_counts, and nothing was sent that the owner did not expect.
inline Status CheckRoutingAgrees(int src, const std::vector<int64_t>& sent, int owner,
                                 const RankRecord& record) {
  const int persistent = kRanks * record.slots_per_rank;
  const int transient = record.local_slots - record.slots_per_rank;
  std::map<std::tuple<int64_t, int64_t, int>, int64_t> expected;
  for (size_t step = 0; step < record.recv.size(); ++step) {
    for (size_t l = 0; l < record.recv[step].size(); ++l) {
      for (int i = 0; i < record.local_slots; ++i) {
        const int64_t rows =
            record.recv[step][l][static_cast<size_t>(src) * record.local_slots + i];
        if (rows == 0) continue;
        const int slot = i < record.slots_per_rank
                             ? owner * record.slots_per_rank + i
                             : persistent + owner * transient + (i - record.slots_per_rank);
        expected[{static_cast<int64_t>(step), static_cast<int64_t>(l), slot}] = rows;
      }
    }
  }
  for (size_t i = 0; i + 3 < sent.size(); i += 4) {
    const int slot = static_cast<int>(sent[i + 2]);
    const int slot_owner =
        slot < persistent ? slot / record.slots_per_rank : (slot - persistent) / transient;
    if (slot_owner != owner) continue;
    auto it = expected.find({sent[i], sent[i + 1], slot});
    const int64_t announced = it == expected.end() ? 0 : it->second;
    if (announced != sent[i + 3]) {
      return Internal("step " + std::to_string(sent[i]) + " layer " + std::to_string(sent[i + 1]) +
                      ": rank " + std::to_string(src) + " sent " + std::to_string(sent[i + 3]) +
                      " rows to slot " + std::to_string(slot) + ", its owner expected " +
                      std::to_string(announced));
    }
    if (it != expected.end()) expected.erase(it);
  }
  if (!expected.empty()) {
    return Internal("rank " + std::to_string(owner) + " expected rows from rank " +
                    std::to_string(src) + " that never came");
  }
  return Status::Ok();
}

}  // namespace keel::toy
