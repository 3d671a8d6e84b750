// libFuzzer target: the C API's argument checks (include/keel/keel.h). The input picks one
// rank's engine options (counts, sizes, enum values, struct_size, a config built from fuzzed
// values or fuzzed YAML text, a NULL comm) and then a sequence of calls with fuzzed layers,
// slots, capacities, token counts, ids and NULL pointers. Besides "no crash": a call that fails
// leaves a message in keel_last_error and one that succeeds leaves it empty; a route that
// succeeds sends every (token, k) to a slot that holds its expert.
#include <fuzzer/FuzzedDataProvider.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "keel/keel.h"

namespace {

// The oracle every call must satisfy.
keel_status_t Check(keel_status_t status) {
  const bool has_message = keel_last_error()[0] != '\0';
  if ((status == KEEL_OK) == has_message) std::abort();
  return status;
}

// A config the engine can run with one rank: the slots, the policy and the planner's interval
// come from the input. Fuzzed YAML text is taken too, but never one that names the monitor or the
// migration transport: those open ports and files, or need other processes.
std::string Config(FuzzedDataProvider& in) {
  switch (in.ConsumeIntegralInRange(0, 3)) {
    case 0:
      return "";
    case 1: {
      std::string text = in.ConsumeRandomLengthString(512);
      if (text.find("monitor") != std::string::npos ||
          text.find("transport") != std::string::npos ||
          text.find("migration") != std::string::npos) {
        return "";
      }
      return text;
    }
    default: {
      static const char* const kPolicies[] = {"static", "keel",     "eplb",     "flexmoe", "velb",
                                              "lplb",   "smartmoe", "swiftmoe", "trtllm"};
      const char* policy = kPolicies[in.ConsumeIntegralInRange<size_t>(0, 8)];
      return "topology: {num_nodes: 1, gpus_per_node: " +
             std::to_string(in.ConsumeIntegralInRange(0, 2)) + "}\nslots: {persistent_per_rank: " +
             std::to_string(in.ConsumeIntegralInRange(-1, 12)) +
             ", transient_per_rank: " + std::to_string(in.ConsumeIntegralInRange(-1, 3)) +
             "}\npolicy: {name: " + policy +
             ", replan_interval_steps: " + std::to_string(in.ConsumeIntegralInRange(0, 3)) + "}\n";
    }
  }
}

// `memory` holds the slot buffers, which must outlive the engine (keel_engine_register_slot).
void Exercise(keel_engine_t* engine, FuzzedDataProvider& in, int num_layers, int num_experts,
              int top_k, const keel_engine_options_t& options,
              std::vector<std::vector<uint64_t>>& memory) {
  int ranks = 0, spr = 0, tpr = 0;
  Check(keel_engine_num_ranks(engine, &ranks));
  Check(keel_engine_slots_per_rank(engine, &spr));
  Check(keel_engine_transient_per_rank(engine, &tpr));
  const int local = spr + tpr;
  // Buffers for every slot; some slots are left out or get NULL pointers.
  const size_t weights = options.weight_bytes, gradients = options.gradient_bytes,
               optimizer = options.optimizer_bytes;
  memory.reserve(static_cast<size_t>(num_layers) * local);
  for (int l = 0; l < num_layers; ++l) {
    for (int i = 0; i < local; ++i) {
      memory.emplace_back((weights + gradients + optimizer) / 8 + 3, 0);
      auto* base = reinterpret_cast<char*>(memory.back().data());
      const int how = in.ConsumeIntegralInRange(0, 15);
      if (how == 0) continue;  // not registered
      void* w = how == 1 ? nullptr : base;
      void* g = how == 2 ? nullptr : base + weights;
      void* o = (i < spr && optimizer > 0 && how != 3) ? base + weights + gradients : nullptr;
      Check(keel_engine_register_slot(
          engine, in.ConsumeIntegralInRange(-1, num_layers) == -1 ? -1 : l, i, w, g, o));
    }
  }
  const int physical = ranks * local;
  for (int op = 0; op < 12 && in.remaining_bytes() > 0; ++op) {
    const int layer = in.ConsumeIntegralInRange(-1, num_layers);
    switch (in.ConsumeIntegralInRange(0, 8)) {
      case 0: {  // route
        const int64_t tokens = in.ConsumeIntegralInRange<int64_t>(-1, 64);
        std::vector<int32_t> ids(tokens > 0 ? tokens * top_k : 0);
        for (int32_t& id : ids) id = in.ConsumeIntegralInRange(-2, num_experts);
        std::vector<int32_t> slots(ids.size(), -7);
        std::vector<int64_t> send(ranks), recv(static_cast<size_t>(ranks) * local), totals(ranks);
        const bool null_ids = in.ConsumeIntegralInRange(0, 15) == 0;
        if (Check(keel_engine_route(engine, layer, null_ids ? nullptr : ids.data(), tokens,
                                    slots.data(), send.data(), recv.data(), totals.data())) !=
            KEEL_OK) {
          break;
        }
        std::vector<int32_t> phy2log(static_cast<size_t>(ranks) * spr);
        Check(keel_engine_placement(engine, layer, phy2log.data(),
                                    static_cast<int32_t>(phy2log.size())));
        for (size_t i = 0; i < ids.size(); ++i) {
          if (ids[i] == -1) {
            if (slots[i] != -1) std::abort();
            continue;
          }
          if (slots[i] < 0 || slots[i] >= physical) std::abort();
          if (slots[i] < ranks * spr && phy2log[slots[i]] != ids[i]) std::abort();
        }
        break;
      }
      case 1: {  // route_counts
        std::vector<int32_t> counts(num_experts);
        for (int32_t& c : counts) c = in.ConsumeIntegralInRange(-1, 50);
        std::vector<int64_t> send(ranks), recv(static_cast<size_t>(ranks) * local), totals(ranks);
        const int32_t capacity = in.ConsumeIntegralInRange(-1, physical + 1);
        std::vector<int32_t> begin(num_experts + 1), slot(capacity > 0 ? capacity : 0),
            quota(slot.size()), slot_rank(physical);
        int32_t copies = 0;
        Check(keel_engine_route_counts(engine, layer, counts.data(), send.data(), recv.data(),
                                       totals.data(), begin.data(), slot.data(), quota.data(),
                                       capacity, &copies, slot_rank.data()));
        break;
      }
      case 2:
        Check(keel_engine_reduce_gradients(engine));
        break;
      case 3:
        Check(keel_engine_step_end(engine));
        break;
      case 4: {
        const int32_t capacity = in.ConsumeIntegralInRange(-1, spr + 1);
        std::vector<int32_t> experts(capacity > 0 ? capacity : 0), slots(experts.size());
        int32_t count = 0;
        Check(keel_engine_home_slots(engine, layer, experts.empty() ? nullptr : experts.data(),
                                     slots.empty() ? nullptr : slots.data(), capacity, &count));
        break;
      }
      case 5: {
        const int32_t capacity = in.ConsumeIntegralInRange(-1, num_experts + 1);
        std::vector<int32_t> home(capacity > 0 ? capacity : 1);
        Check(keel_engine_homes(engine, layer, home.data(), capacity));
        break;
      }
      case 6: {
        const int32_t capacity = in.ConsumeIntegralInRange(-1, local + 1);
        std::vector<int32_t> experts(capacity > 0 ? capacity : 1);
        Check(keel_engine_local_experts(engine, layer, experts.data(), capacity));
        break;
      }
      case 7: {  // plan_sequences: one rank, so every sequence stays where it is
        const int planned = in.ConsumeIntegralInRange(0, num_layers + 1);
        const int64_t count = in.ConsumeIntegralInRange<int64_t>(-1, 6);
        const size_t sequences = count > 0 ? static_cast<size_t>(count) : 0;
        std::vector<int64_t> tokens(sequences);
        for (int64_t& t : tokens) t = in.ConsumeIntegralInRange<int64_t>(-1, 100);
        std::vector<int32_t> rows(sequences * (planned > 0 ? planned : 0) * num_experts);
        for (int32_t& r : rows) r = in.ConsumeIntegralInRange(-1, 20);
        const int64_t capacity = in.ConsumeIntegralInRange<int64_t>(-1, 7);
        std::vector<int32_t> origin(7, -7), index(7, -7), rank(7, -7);
        int64_t total = -1;
        int used = -1;
        if (Check(keel_engine_plan_sequences(
                engine, layer, planned, count, tokens.empty() ? nullptr : tokens.data(),
                rows.empty() ? nullptr : rows.data(), in.ConsumeFloatingPointInRange(0.5, 2.0),
                capacity, origin.data(), index.data(), rank.data(), &total, &used)) == KEEL_OK) {
          if (total != count || used != 0) std::abort();
          for (int64_t i = 0; i < total; ++i) {
            if (origin[i] != 0 || index[i] != i || rank[i] != 0) std::abort();
          }
        }
        break;
      }
      default: {
        keel_engine_stats_t stats{};
        // Up to the real size: a larger struct_size promises a larger struct, which the library
        // then zeroes to its end (the growth rule).
        stats.struct_size = in.ConsumeIntegralInRange<size_t>(0, sizeof(stats));
        Check(keel_engine_stats(engine, &stats));
        int64_t epoch = 0;
        Check(keel_engine_epoch(engine, in.ConsumeBool() ? &epoch : nullptr));
        break;
      }
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  keel_group_t* group = nullptr;
  keel_comm_t* comm = nullptr;
  if (Check(keel_group_create(1, &group)) != KEEL_OK) std::abort();
  if (Check(keel_comm_create_local(group, 0, &comm)) != KEEL_OK) std::abort();

  keel_engine_options_t options;
  const bool sized = in.ConsumeIntegralInRange(0, 7) == 0;
  if (Check(keel_engine_options_init_sized(
          &options, sized ? in.ConsumeIntegralInRange<size_t>(0, sizeof(options))
                          : sizeof(options))) != KEEL_OK) {
    keel_engine_options_init(&options);
  }
  const int num_layers = in.ConsumeIntegralInRange(-1, 3);
  const int num_experts = in.ConsumeIntegralInRange(-1, 24);
  const int top_k = in.ConsumeIntegralInRange(-1, 4);
  options.num_layers = num_layers;
  options.num_experts = num_experts;
  options.top_k = top_k;
  options.weight_bytes = in.ConsumeIntegralInRange<size_t>(0, 64);
  options.gradient_bytes = in.ConsumeIntegralInRange<size_t>(0, 64);
  options.optimizer_bytes = in.ConsumeIntegralInRange<size_t>(0, 64);
  options.gradient_type = static_cast<keel_gradient_type_t>(in.ConsumeIntegralInRange(-1, 3));
  options.memory = static_cast<keel_memory_kind_t>(in.ConsumeIntegralInRange(0, 2));
  const std::string config = Config(in);
  options.config_yaml = config.empty() ? nullptr : config.c_str();
  if (in.ConsumeIntegralInRange(0, 31) == 0) options.config_path = "/nonexistent/keel.yaml";
  options.comm = in.ConsumeIntegralInRange(0, 15) == 0 ? nullptr : comm;

  keel_engine_t* engine = nullptr;
  std::vector<std::vector<uint64_t>> memory;
  if (Check(keel_engine_create(&options, &engine)) == KEEL_OK) {
    Exercise(engine, in, num_layers, num_experts, top_k, options, memory);
    Check(keel_engine_destroy(engine));
  }
  Check(keel_comm_destroy(comm));
  Check(keel_group_destroy(group));
  return 0;
}
