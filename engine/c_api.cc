// The C API of include/keel/keel.h over keel::Engine: checks every argument and names the bad one
// by its C name and value, turns keel::Status into keel_status_t plus the thread's last-error
// message, and keeps every exception on this side of the boundary.
#include "keel/keel.h"

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "common/config.h"
#include "keel/engine.hpp"
#include "keel/local_group.hpp"
#include "keel/status.hpp"
#include "keel/version.hpp"

// The handles. They live in the global namespace because keel.h declares them there.

struct keel_group {
  std::unique_ptr<keel::LocalGroup> ranks;
  std::mutex mutex;  // guards live_comms
  int live_comms = 0;
};

struct keel_comm {
  std::unique_ptr<keel::Communicator> communicator;
  keel_group* group = nullptr;  // the group of a local comm; null for MPI
  std::atomic<int> live_engines{0};
};

struct keel_engine {
  std::unique_ptr<keel::Engine> engine;
  keel_comm* comm = nullptr;
  int num_layers = 0;
  int num_experts = 0;
  int top_k = 0;
  size_t optimizer_bytes = 0;
  std::string last_abort_message;  // what keel_engine_stats hands out
  // [num_layers][local_slots]: local_experts of each layer's latest route; empty before it.
  std::vector<std::vector<int32_t>> local_experts;
};

namespace keel {
namespace {

static_assert(KEEL_OK == static_cast<int>(StatusCode::kOk));
static_assert(KEEL_INVALID_ARGUMENT == static_cast<int>(StatusCode::kInvalidArgument));
static_assert(KEEL_NOT_FOUND == static_cast<int>(StatusCode::kNotFound));
static_assert(KEEL_IO_ERROR == static_cast<int>(StatusCode::kIoError));
static_assert(KEEL_FAILED_PRECONDITION == static_cast<int>(StatusCode::kFailedPrecondition));
static_assert(KEEL_OUT_OF_RANGE == static_cast<int>(StatusCode::kOutOfRange));
static_assert(KEEL_UNIMPLEMENTED == static_cast<int>(StatusCode::kUnimplemented));
static_assert(KEEL_INTERNAL == static_cast<int>(StatusCode::kInternal));
static_assert(KEEL_DEADLINE_EXCEEDED == static_cast<int>(StatusCode::kDeadlineExceeded));
static_assert(KEEL_ABORTED == static_cast<int>(StatusCode::kAborted));
static_assert(KEEL_GRADIENT_FLOAT32 == static_cast<int>(GradientType::kFloat32));
static_assert(KEEL_GRADIENT_FLOAT64 == static_cast<int>(GradientType::kFloat64));
static_assert(KEEL_GRADIENT_FIXED_INT64 == static_cast<int>(GradientType::kFixedInt64));
static_assert(KEEL_GRADIENT_BFLOAT16 == static_cast<int>(GradientType::kBFloat16));
static_assert(KEEL_GRADIENT_FLOAT16 == static_cast<int>(GradientType::kFloat16));
static_assert(KEEL_MEMORY_HOST == static_cast<int>(MemoryKind::kHost));
static_assert(KEEL_MEMORY_DEVICE == static_cast<int>(MemoryKind::kDevice));

// The first version of each struct ends after its last first-version field. These sizes never
// change: fields appended later lie beyond them.
constexpr size_t kEngineOptionsV1Size =
    offsetof(keel_engine_options_t, group) + sizeof(keel_group_t*);
constexpr size_t kEngineStatsV1Size =
    offsetof(keel_engine_stats_t, last_abort_message) + sizeof(const char*);

// A garbage size (an uninitialized struct) must not make the library read or write far past
// the caller's struct; no version of these structs will come near this size.
constexpr size_t kMaxStructSize = 4096;

thread_local std::string t_last_error;

// Records `message` as this thread's last error. Never throws: it runs inside catch handlers.
keel_status_t Fail(keel_status_t code, std::string_view message) noexcept {
  try {
    t_last_error.assign(message);
  } catch (...) {
    t_last_error.clear();  // out of memory: the status alone has to do
  }
  return code;
}

keel_status_t FromStatus(std::string_view function, const Status& status) {
  if (status.ok()) return KEEL_OK;
  return Fail(static_cast<keel_status_t>(status.code()),
              std::string(function) + ": " + status.message());
}

// Runs an entry point's body: clears the last error first and turns every exception into
// KEEL_INTERNAL, so nothing C++ crosses into the caller.
template <typename Body>
keel_status_t Guard(const char* function, Body&& body) noexcept {
  t_last_error.clear();
  try {
    return FromStatus(function, body());
  } catch (const std::exception& error) {
    return Fail(KEEL_INTERNAL, std::string(function) + ": unexpected exception: " + error.what());
  } catch (...) {
    return Fail(KEEL_INTERNAL, std::string(function) + ": unexpected exception of unknown type");
  }
}

// An enum read through its bytes: a caller may pass any integer, and loading an out-of-range
// value through the enum type itself is undefined behaviour in C++.
template <typename Enum>
long long RawEnum(const Enum& value) {
  // Signed, so that a C caller's -4 reads as -4 whatever underlying type the compiler chose.
  std::make_signed_t<std::underlying_type_t<Enum>> raw;
  std::memcpy(&raw, &value, sizeof(raw));
  return static_cast<long long>(raw);
}

Status Null(std::string_view name) { return InvalidArgument(std::string(name) + " = NULL"); }

// "layer = 7 is not in [0, 4)".
Status NotInRange(std::string_view name, long long value, long long begin, long long end) {
  return InvalidArgument(std::string(name) + " = " + std::to_string(value) + " is not in [" +
                         std::to_string(begin) + ", " + std::to_string(end) + ")");
}

Status CheckLayer(const keel_engine& engine, int layer) {
  if (layer < 0 || layer >= engine.num_layers) {
    return NotInRange("layer", layer, 0, engine.num_layers);
  }
  return Status::Ok();
}

// Hands a route's splits to the caller (recv_counts and recv_totals may be NULL) and keeps its
// local experts for keel_engine_local_experts.
Status DeliverRoute(keel_engine& engine, int layer, LayerRoute& route, int64_t* send_counts,
                    int64_t* recv_counts, int64_t* recv_totals) {
  const size_t num_ranks = static_cast<size_t>(engine.engine->num_ranks());
  const size_t local_slots = static_cast<size_t>(engine.engine->local_slots());
  if (route.send_counts.size() != num_ranks ||
      route.recv_counts.size() != num_ranks * local_slots ||
      route.recv_totals.size() != num_ranks || route.local_experts.size() != local_slots) {
    return Internal("the engine's route of layer " + std::to_string(layer) +
                    " does not have the shapes keel.h documents");
  }
  engine.local_experts[static_cast<size_t>(layer)] = std::move(route.local_experts);
  std::copy(route.send_counts.begin(), route.send_counts.end(), send_counts);
  if (recv_counts != nullptr) {
    std::copy(route.recv_counts.begin(), route.recv_counts.end(), recv_counts);
  }
  if (recv_totals != nullptr) {
    std::copy(route.recv_totals.begin(), route.recv_totals.end(), recv_totals);
  }
  return Status::Ok();
}

// Rejects a capacity below `needed` entries; `what` says what the array holds.
Status CheckCapacity(int32_t capacity, long long needed, std::string_view what) {
  if (capacity < 0) return InvalidArgument("capacity = " + std::to_string(capacity) + " < 0");
  if (capacity < needed) {
    return InvalidArgument("capacity = " + std::to_string(capacity) + " is smaller than " +
                           std::to_string(needed) + " (" + std::string(what) + ")");
  }
  return Status::Ok();
}

// A struct that is larger than the library's (the caller's keel.h is newer) is accepted only
// when every byte the library does not know is zero, which the growth rule makes the default.
Status CheckStructSize(std::string_view name, size_t struct_size, size_t v1_size, size_t known_size,
                       const void* data, bool check_unknown_bytes) {
  const std::string field = std::string(name) + "->struct_size";
  if (struct_size < v1_size) {
    return InvalidArgument(field + " = " + std::to_string(struct_size) +
                           " is smaller than the first version of the struct (" +
                           std::to_string(v1_size) + " bytes); set it to sizeof(the struct)");
  }
  if (struct_size > kMaxStructSize) {
    return InvalidArgument(field + " = " + std::to_string(struct_size) +
                           " is not a plausible size (the struct is " + std::to_string(known_size) +
                           " bytes in this library); was the struct initialized?");
  }
  if (check_unknown_bytes && struct_size > known_size) {
    const auto* bytes = static_cast<const unsigned char*>(data);
    for (size_t i = known_size; i < struct_size; ++i) {
      if (bytes[i] != 0) {
        return InvalidArgument(field + " = " + std::to_string(struct_size) + ": byte " +
                               std::to_string(i) + " is set, but this library (keel " + kVersion +
                               ") knows only the first " + std::to_string(known_size) +
                               " bytes; the caller's keel.h is newer than the library");
      }
    }
  }
  return Status::Ok();
}

// The config that options name: YAML text, a file, or the defaults sized to the communicator.
Result<KeelConfig> ReadConfig(const keel_engine_options_t& options, int comm_size) {
  if (options.config_yaml != nullptr && options.config_path != nullptr) {
    return InvalidArgument("options->config_yaml and options->config_path are both set (path \"" +
                           std::string(options.config_path) + "\"); give at most one");
  }
  if (options.config_yaml != nullptr) {
    return ParseConfig(options.config_yaml, "options->config_yaml");
  }
  if (options.config_path != nullptr) return LoadConfigFile(options.config_path);
  KeelConfig config;
  config.topology.num_nodes = 1;
  config.topology.gpus_per_node = comm_size;
  KEEL_RETURN_IF_ERROR(ValidateConfig(config));
  return config;
}

// Checks everything keel_engine_create can check alone and fills `out` (all but the
// communicator's and group's lifetimes, which the handles keep).
Status BuildEngineOptions(const keel_engine_options_t& options, EngineOptions& out) {
  if (options.comm == nullptr) return Null("options->comm");
  const keel_comm& comm = *options.comm;
  const int comm_size = comm.communicator->size();
  KEEL_ASSIGN_OR_RETURN(KeelConfig config, ReadConfig(options, comm_size));
  if (config.num_ranks() != comm_size) {
    return InvalidArgument(
        "options->comm has " + std::to_string(comm_size) + " ranks, but the config has " +
        std::to_string(config.num_ranks()) +
        " (topology.num_nodes = " + std::to_string(config.topology.num_nodes) +
        " x topology.gpus_per_node = " + std::to_string(config.topology.gpus_per_node) + ")");
  }
  const bool local_transport = config.migration.transport == "local";
  out.config = MakeConfig(std::move(config));
  if (options.num_layers < 1) {
    return InvalidArgument("options->num_layers = " + std::to_string(options.num_layers) +
                           " must be >= 1");
  }
  if (options.num_experts < 1) {
    return InvalidArgument("options->num_experts = " + std::to_string(options.num_experts) +
                           " must be >= 1");
  }
  if (options.top_k < 1 || options.top_k > options.num_experts) {
    return InvalidArgument("options->top_k = " + std::to_string(options.top_k) + " is not in [1, " +
                           "options->num_experts = " + std::to_string(options.num_experts) + "]");
  }
  const long long gradient_type = RawEnum(options.gradient_type);
  if (gradient_type < KEEL_GRADIENT_FLOAT32 || gradient_type > KEEL_GRADIENT_FLOAT16) {
    return InvalidArgument("options->gradient_type = " + std::to_string(gradient_type) +
                           " is not a keel_gradient_type_t (KEEL_GRADIENT_FLOAT32 = 0, "
                           "KEEL_GRADIENT_FLOAT64 = 1, KEEL_GRADIENT_FIXED_INT64 = 2, "
                           "KEEL_GRADIENT_BFLOAT16 = 3, KEEL_GRADIENT_FLOAT16 = 4)");
  }
  const long long memory = RawEnum(options.memory);
  if (memory < KEEL_MEMORY_HOST || memory > KEEL_MEMORY_DEVICE) {
    return InvalidArgument("options->memory = " + std::to_string(memory) +
                           " is not a keel_memory_kind_t (KEEL_MEMORY_HOST = 0, "
                           "KEEL_MEMORY_DEVICE = 1)");
  }
  if (options.mp_group_size < 0) {
    return InvalidArgument("options->mp_group_size = " + std::to_string(options.mp_group_size) +
                           " must be >= 0 (0 or 1: no MP groups)");
  }
  out.mp_group_size = std::max(1, options.mp_group_size);
  out.num_layers = options.num_layers;
  out.num_experts = options.num_experts;
  out.top_k = options.top_k;
  out.shape.weight_bytes = options.weight_bytes;
  out.shape.gradient_bytes = options.gradient_bytes;
  out.shape.optimizer_bytes = options.optimizer_bytes;
  out.shape.gradient_type = static_cast<GradientType>(gradient_type);
  out.shape.memory = static_cast<MemoryKind>(memory);
  if (options.weight_bytes == 0) return InvalidArgument("options->weight_bytes = 0 must be >= 1");
  const size_t element = GradientElementBytes(out.shape.gradient_type);
  if (options.gradient_bytes == 0 || options.gradient_bytes % element != 0) {
    return InvalidArgument("options->gradient_bytes = " + std::to_string(options.gradient_bytes) +
                           " is not a positive multiple of " + std::to_string(element) +
                           " (the size of one gradient_type = " + std::to_string(gradient_type) +
                           " element)");
  }

  keel_group* group = options.group != nullptr ? options.group : comm.group;
  if (options.group != nullptr && comm.group != options.group) {
    return InvalidArgument(
        "options->group is not the group options->comm was created from (" +
        std::string(comm.group == nullptr ? "comm is not local" : "comm joined another group") +
        ")");
  }
  if (local_transport && group == nullptr) {
    return InvalidArgument(
        "options->group = NULL and options->comm is not local, but migration.transport = "
        "\"local\" moves expert state between threads of one keel_group_t; name another "
        "transport (e.g. \"ucx\") for ranks in separate processes");
  }
  out.communicator = comm.communicator.get();
  out.local_group = group != nullptr ? group->ranks.get() : nullptr;
  return Status::Ok();
}

}  // namespace
}  // namespace keel

using keel::Guard;
using keel::InvalidArgument;
using keel::NotInRange;
using keel::Null;
using keel::Status;

extern "C" {

const char* keel_status_name(keel_status_t status) {
  const long long raw = keel::RawEnum(status);
  if (raw < KEEL_OK || raw > KEEL_ABORTED) return "UNKNOWN";
  // StatusCodeName returns views of string literals, so data() is NUL-terminated.
  return keel::StatusCodeName(static_cast<keel::StatusCode>(raw)).data();
}

const char* keel_last_error(void) { return keel::t_last_error.c_str(); }

const char* keel_version(void) { return keel::kVersion; }

keel_status_t keel_group_create(int num_ranks, keel_group_t** group_out) {
  return Guard("keel_group_create", [&]() -> Status {
    if (group_out == nullptr) return Null("group_out");
    *group_out = nullptr;
    auto group = std::make_unique<keel_group>();
    KEEL_ASSIGN_OR_RETURN(group->ranks, keel::LocalGroup::Create(num_ranks));
    *group_out = group.release();
    return Status::Ok();
  });
}

keel_status_t keel_group_destroy(keel_group_t* group) {
  return Guard("keel_group_destroy", [&]() -> Status {
    if (group == nullptr) return Status::Ok();
    {
      std::lock_guard<std::mutex> lock(group->mutex);
      if (group->live_comms > 0) {
        return keel::FailedPrecondition(
            "group still has " + std::to_string(group->live_comms) +
            " comm(s); destroy them (keel_comm_destroy) before the group");
      }
    }
    delete group;
    return Status::Ok();
  });
}

keel_status_t keel_comm_create_local(keel_group_t* group, int rank, keel_comm_t** comm_out) {
  return Guard("keel_comm_create_local", [&]() -> Status {
    if (comm_out == nullptr) return Null("comm_out");
    *comm_out = nullptr;
    if (group == nullptr) return Null("group");
    auto comm = std::make_unique<keel_comm>();
    comm->group = group;
    KEEL_ASSIGN_OR_RETURN(comm->communicator, group->ranks->Join(rank));
    std::lock_guard<std::mutex> lock(group->mutex);
    ++group->live_comms;
    *comm_out = comm.release();
    return Status::Ok();
  });
}

keel_status_t keel_comm_create_mpi(keel_comm_t** comm_out) {
  return Guard("keel_comm_create_mpi", [&]() -> Status {
    if (comm_out == nullptr) return Null("comm_out");
    *comm_out = nullptr;
    KEEL_ASSIGN_OR_RETURN(auto communicator, keel::CreateMpiCommunicator());
    auto comm = std::make_unique<keel_comm>();
    comm->communicator = std::move(communicator);
    *comm_out = comm.release();
    return Status::Ok();
  });
}

keel_status_t keel_comm_rank(const keel_comm_t* comm, int* rank_out) {
  return Guard("keel_comm_rank", [&]() -> Status {
    if (comm == nullptr) return Null("comm");
    if (rank_out == nullptr) return Null("rank_out");
    *rank_out = comm->communicator->rank();
    return Status::Ok();
  });
}

keel_status_t keel_comm_size(const keel_comm_t* comm, int* size_out) {
  return Guard("keel_comm_size", [&]() -> Status {
    if (comm == nullptr) return Null("comm");
    if (size_out == nullptr) return Null("size_out");
    *size_out = comm->communicator->size();
    return Status::Ok();
  });
}

keel_status_t keel_comm_destroy(keel_comm_t* comm) {
  return Guard("keel_comm_destroy", [&]() -> Status {
    if (comm == nullptr) return Status::Ok();
    const int engines = comm->live_engines.load();
    if (engines > 0) {
      return keel::FailedPrecondition("comm is still used by " + std::to_string(engines) +
                                      " engine(s); destroy them (keel_engine_destroy) first");
    }
    if (comm->group != nullptr) {
      std::lock_guard<std::mutex> lock(comm->group->mutex);
      --comm->group->live_comms;
    }
    delete comm;
    return Status::Ok();
  });
}

keel_status_t keel_engine_options_init_sized(keel_engine_options_t* options, size_t struct_size) {
  return Guard("keel_engine_options_init_sized", [&]() -> Status {
    if (options == nullptr) return Null("options");
    if (struct_size < keel::kEngineOptionsV1Size) {
      return InvalidArgument("struct_size = " + std::to_string(struct_size) +
                             " is smaller than the first version of keel_engine_options_t (" +
                             std::to_string(keel::kEngineOptionsV1Size) + " bytes)");
    }
    if (struct_size > keel::kMaxStructSize) {
      return InvalidArgument("struct_size = " + std::to_string(struct_size) +
                             " is not a plausible size of keel_engine_options_t");
    }
    // Zero is the default of every field this library does not know (the growth rule).
    std::memset(static_cast<void*>(options), 0, struct_size);
    options->struct_size = struct_size;
    options->config_yaml = nullptr;
    options->config_path = nullptr;
    options->num_layers = 1;
    options->num_experts = 1;
    options->top_k = 1;
    options->gradient_type = KEEL_GRADIENT_FLOAT32;
    options->memory = KEEL_MEMORY_HOST;
    options->comm = nullptr;
    options->group = nullptr;
    return Status::Ok();
  });
}

keel_status_t keel_engine_create(const keel_engine_options_t* options, keel_engine_t** engine_out) {
  return Guard("keel_engine_create", [&]() -> Status {
    if (engine_out == nullptr) return Null("engine_out");
    *engine_out = nullptr;
    if (options == nullptr) return Null("options");
    KEEL_RETURN_IF_ERROR(keel::CheckStructSize("options", options->struct_size,
                                               keel::kEngineOptionsV1Size,
                                               sizeof(keel_engine_options_t), options, true));
    keel_engine_options_t known;
    std::memset(static_cast<void*>(&known), 0, sizeof(known));
    std::memcpy(static_cast<void*>(&known), options, std::min(options->struct_size, sizeof(known)));

    keel::EngineOptions engine_options;
    KEEL_RETURN_IF_ERROR(keel::BuildEngineOptions(known, engine_options));
    KEEL_ASSIGN_OR_RETURN(auto engine, keel::Engine::Create(engine_options));
    if (engine->shards_experts()) {
      return keel::InvalidArgument(
          "policy.keel.shard_experts = true routes an entry of a sharded expert to every shard, "
          "which needs the C++ API (LayerRoute::row_entry); the C API routes one row per entry");
    }

    auto handle = std::make_unique<keel_engine>();
    handle->engine = std::move(engine);
    handle->comm = known.comm;
    handle->num_layers = known.num_layers;
    handle->num_experts = known.num_experts;
    handle->top_k = known.top_k;
    handle->optimizer_bytes = known.optimizer_bytes;
    handle->local_experts.resize(static_cast<size_t>(known.num_layers));
    ++known.comm->live_engines;
    *engine_out = handle.release();
    return Status::Ok();
  });
}

keel_status_t keel_engine_destroy(keel_engine_t* engine) {
  return Guard("keel_engine_destroy", [&]() -> Status {
    if (engine == nullptr) return Status::Ok();
    keel_comm* comm = engine->comm;
    delete engine;
    --comm->live_engines;
    return Status::Ok();
  });
}

keel_status_t keel_engine_register_slot(keel_engine_t* engine, int layer, int local_slot,
                                        void* weights, void* gradients, void* optimizer) {
  return Guard("keel_engine_register_slot", [&]() -> Status {
    if (engine == nullptr) return Null("engine");
    KEEL_RETURN_IF_ERROR(keel::CheckLayer(*engine, layer));
    const int persistent = engine->engine->slots_per_rank();
    const int local_slots = engine->engine->local_slots();
    if (local_slot < 0 || local_slot >= local_slots) {
      return NotInRange("local_slot", local_slot, 0, local_slots);
    }
    if (weights == nullptr) return Null("weights");
    if (gradients == nullptr) return Null("gradients");
    if (local_slot < persistent) {
      if (optimizer == nullptr && engine->optimizer_bytes > 0) {
        return InvalidArgument(
            "optimizer = NULL for persistent local_slot = " + std::to_string(local_slot) +
            ", but options->optimizer_bytes = " + std::to_string(engine->optimizer_bytes) +
            " (any persistent slot can become a home)");
      }
    } else if (optimizer != nullptr) {
      return InvalidArgument(
          "optimizer is set for transient local_slot = " + std::to_string(local_slot) +
          " (>= slots_per_rank = " + std::to_string(persistent) +
          "); transient slots never hold a home, pass NULL");
    }
    keel::SlotBuffers buffers;
    buffers.weights = weights;
    buffers.gradients = gradients;
    buffers.optimizer = optimizer;
    return engine->engine->RegisterSlot(layer, local_slot, buffers);
  });
}

keel_status_t keel_engine_route(keel_engine_t* engine, int layer, const int32_t* topk_ids,
                                int64_t num_tokens, int32_t* slot_out, int64_t* send_counts,
                                int64_t* recv_counts, int64_t* recv_totals) {
  return Guard("keel_engine_route", [&]() -> Status {
    if (engine == nullptr) return Null("engine");
    KEEL_RETURN_IF_ERROR(keel::CheckLayer(*engine, layer));
    if (num_tokens < 0) {
      return InvalidArgument("num_tokens = " + std::to_string(num_tokens) + " < 0");
    }
    // Bounded so that num_tokens * top_k fits the engine's int32 slots and size_t everywhere.
    const int64_t max_tokens = INT32_MAX / engine->top_k;
    if (num_tokens > max_tokens) {
      return InvalidArgument("num_tokens = " + std::to_string(num_tokens) + " is larger than " +
                             std::to_string(max_tokens) +
                             " (INT32_MAX / top_k = " + std::to_string(engine->top_k) + ")");
    }
    if (num_tokens > 0 && topk_ids == nullptr) {
      return InvalidArgument("topk_ids = NULL with num_tokens = " + std::to_string(num_tokens));
    }
    if (num_tokens > 0 && slot_out == nullptr) {
      return InvalidArgument("slot_out = NULL with num_tokens = " + std::to_string(num_tokens));
    }
    if (send_counts == nullptr) return Null("send_counts");
    const size_t pairs = static_cast<size_t>(num_tokens) * static_cast<size_t>(engine->top_k);
    // The engine checks the ids (naming the bad one by its index) while it counts them.
    std::span<const int32_t> ids(topk_ids, topk_ids == nullptr ? 0 : pairs);
    KEEL_ASSIGN_OR_RETURN(keel::LayerRoute route, engine->engine->Route(layer, ids));
    if (route.slot.size() != pairs) {
      return keel::Internal("the engine's route of layer " + std::to_string(layer) + " has " +
                            std::to_string(route.slot.size()) + " slots for " +
                            std::to_string(pairs) + " entries");
    }
    std::copy(route.slot.begin(), route.slot.end(), slot_out);
    return keel::DeliverRoute(*engine, layer, route, send_counts, recv_counts, recv_totals);
  });
}

keel_status_t keel_engine_plan_sequences(keel_engine_t* engine, int first_layer,
                                         int num_planned_layers, int64_t num_sequences,
                                         const int64_t* tokens, const int32_t* expert_rows,
                                         double max_token_imbalance, int64_t capacity,
                                         int32_t* origin_rank_out, int32_t* origin_index_out,
                                         int32_t* rank_out, int64_t* total_out, int* used_out) {
  return Guard("keel_engine_plan_sequences", [&]() -> Status {
    if (engine == nullptr) return Null("engine");
    if (num_planned_layers < 1 || num_planned_layers > engine->num_layers) {
      return InvalidArgument("num_planned_layers = " + std::to_string(num_planned_layers) +
                             " is not in [1, " + std::to_string(engine->num_layers) + "]");
    }
    if (num_sequences < 0 || num_sequences > INT32_MAX) {
      return InvalidArgument("num_sequences = " + std::to_string(num_sequences) +
                             " is not in [0, 2^31)");
    }
    if (num_sequences > 0 && tokens == nullptr) return Null("tokens");
    if (num_sequences > 0 && expert_rows == nullptr) return Null("expert_rows");
    if (capacity < 0) return InvalidArgument("capacity = " + std::to_string(capacity) + " < 0");
    if (capacity > 0 &&
        (origin_rank_out == nullptr || origin_index_out == nullptr || rank_out == nullptr)) {
      return Null(origin_rank_out == nullptr    ? "origin_rank_out"
                  : origin_index_out == nullptr ? "origin_index_out"
                                                : "rank_out");
    }
    if (total_out == nullptr) return Null("total_out");
    const size_t row = static_cast<size_t>(num_planned_layers) * engine->num_experts;
    std::vector<keel::SequenceRouting> sequences(static_cast<size_t>(num_sequences));
    for (size_t s = 0; s < sequences.size(); ++s) {
      sequences[s].tokens = tokens[s];
      sequences[s].expert_rows.assign(expert_rows + s * row, expert_rows + (s + 1) * row);
    }
    keel::SequencePlanningOptions options;
    options.max_token_imbalance = max_token_imbalance;
    KEEL_ASSIGN_OR_RETURN(keel::SequencePlacement plan,
                          engine->engine->PlanSequences(first_layer, sequences, options));
    *total_out = static_cast<int64_t>(plan.rank.size());
    if (used_out != nullptr) *used_out = plan.used ? 1 : 0;
    if (capacity < *total_out) {
      return keel::OutOfRange("capacity = " + std::to_string(capacity) + " is below the " +
                              std::to_string(*total_out) + " sequences of all ranks");
    }
    std::copy(plan.origin_rank.begin(), plan.origin_rank.end(), origin_rank_out);
    std::copy(plan.origin_index.begin(), plan.origin_index.end(), origin_index_out);
    std::copy(plan.rank.begin(), plan.rank.end(), rank_out);
    return Status::Ok();
  });
}

keel_status_t keel_engine_route_counts(keel_engine_t* engine, int layer,
                                       const int32_t* expert_counts, int64_t* send_counts,
                                       int64_t* recv_counts, int64_t* recv_totals,
                                       int32_t* copy_begin_out, int32_t* copy_slot_out,
                                       int32_t* copy_quota_out, int32_t copy_capacity,
                                       int32_t* num_copies_out, int32_t* slot_rank_out) {
  return Guard("keel_engine_route_counts", [&]() -> Status {
    if (engine == nullptr) return Null("engine");
    KEEL_RETURN_IF_ERROR(keel::CheckLayer(*engine, layer));
    if (expert_counts == nullptr) return Null("expert_counts");
    if (send_counts == nullptr) return Null("send_counts");
    if (copy_begin_out == nullptr) return Null("copy_begin_out");
    if (copy_slot_out == nullptr) return Null("copy_slot_out");
    if (copy_quota_out == nullptr) return Null("copy_quota_out");
    if (num_copies_out == nullptr) return Null("num_copies_out");
    if (slot_rank_out == nullptr) return Null("slot_rank_out");
    // Checked before the collective, which cannot be repeated. A physical slot holds one expert
    // and a rank's table lists it at most once, so room for every physical slot suffices.
    const int num_ranks = engine->engine->num_ranks();
    const int local_slots = engine->engine->local_slots();
    const size_t num_physical = static_cast<size_t>(num_ranks) * static_cast<size_t>(local_slots);
    if (copy_capacity < 0 || static_cast<size_t>(copy_capacity) < num_physical) {
      return InvalidArgument("copy_capacity = " + std::to_string(copy_capacity) +
                             " is smaller than num_ranks * (slots_per_rank + "
                             "transient_per_rank) = " +
                             std::to_string(num_ranks) + " * " + std::to_string(local_slots));
    }
    // The engine names a negative count by its index.
    std::span<const int32_t> counts(expert_counts, static_cast<size_t>(engine->num_experts));
    KEEL_ASSIGN_OR_RETURN(keel::LayerRoute route, engine->engine->RouteCounts(layer, counts));
    const size_t num_copies = route.copy_slot.size();
    if (route.copy_begin.size() != static_cast<size_t>(engine->num_experts) + 1 ||
        route.copy_quota.size() != num_copies || route.slot_rank.size() != num_physical) {
      return keel::Internal("the engine's quota table of layer " + std::to_string(layer) +
                            " does not have the shapes keel.h documents");
    }
    if (num_copies > num_physical) {
      return keel::Internal("the engine's quota table of layer " + std::to_string(layer) + " has " +
                            std::to_string(num_copies) + " copies, more than the " +
                            std::to_string(num_physical) + " physical slots");
    }
    *num_copies_out = static_cast<int32_t>(num_copies);
    std::copy(route.copy_begin.begin(), route.copy_begin.end(), copy_begin_out);
    std::copy(route.copy_slot.begin(), route.copy_slot.end(), copy_slot_out);
    std::copy(route.copy_quota.begin(), route.copy_quota.end(), copy_quota_out);
    std::copy(route.slot_rank.begin(), route.slot_rank.end(), slot_rank_out);
    return keel::DeliverRoute(*engine, layer, route, send_counts, recv_counts, recv_totals);
  });
}

keel_status_t keel_engine_reduce_gradients(keel_engine_t* engine) {
  return Guard("keel_engine_reduce_gradients", [&]() -> Status {
    if (engine == nullptr) return Null("engine");
    return engine->engine->ReduceGradients();
  });
}

keel_status_t keel_engine_step_end(keel_engine_t* engine) {
  return Guard("keel_engine_step_end", [&]() -> Status {
    if (engine == nullptr) return Null("engine");
    return engine->engine->StepEnd();
  });
}

keel_status_t keel_engine_home_slots(const keel_engine_t* engine, int layer, int32_t* experts_out,
                                     int32_t* local_slots_out, int32_t capacity,
                                     int32_t* count_out) {
  return Guard("keel_engine_home_slots", [&]() -> Status {
    if (engine == nullptr) return Null("engine");
    if (count_out == nullptr) return Null("count_out");
    KEEL_RETURN_IF_ERROR(keel::CheckLayer(*engine, layer));
    if (capacity > 0 && experts_out == nullptr) {
      return InvalidArgument("experts_out = NULL with capacity = " + std::to_string(capacity));
    }
    if (capacity > 0 && local_slots_out == nullptr) {
      return InvalidArgument("local_slots_out = NULL with capacity = " + std::to_string(capacity));
    }
    const std::vector<keel::HomeSlot> homes = engine->engine->HomeSlots(layer);
    *count_out = static_cast<int32_t>(homes.size());
    KEEL_RETURN_IF_ERROR(
        keel::CheckCapacity(capacity, static_cast<long long>(homes.size()),
                            "home slots of layer " + std::to_string(layer) + " on this rank"));
    for (size_t i = 0; i < homes.size(); ++i) {
      experts_out[i] = homes[i].expert;
      local_slots_out[i] = homes[i].local_slot;
    }
    return Status::Ok();
  });
}

keel_status_t keel_engine_placement(const keel_engine_t* engine, int layer, int32_t* phy2log_out,
                                    int32_t capacity) {
  return Guard("keel_engine_placement", [&]() -> Status {
    if (engine == nullptr) return Null("engine");
    if (phy2log_out == nullptr) return Null("phy2log_out");
    KEEL_RETURN_IF_ERROR(keel::CheckLayer(*engine, layer));
    const keel::LayerPlacement placement = engine->engine->placement(layer);
    KEEL_RETURN_IF_ERROR(
        keel::CheckCapacity(capacity, static_cast<long long>(placement.phy2log.size()),
                            "num_ranks * slots_per_rank = " + std::to_string(placement.num_ranks) +
                                " * " + std::to_string(placement.slots_per_rank)));
    std::copy(placement.phy2log.begin(), placement.phy2log.end(), phy2log_out);
    return Status::Ok();
  });
}

keel_status_t keel_engine_homes(const keel_engine_t* engine, int layer, int32_t* home_out,
                                int32_t capacity) {
  return Guard("keel_engine_homes", [&]() -> Status {
    if (engine == nullptr) return Null("engine");
    if (home_out == nullptr) return Null("home_out");
    KEEL_RETURN_IF_ERROR(keel::CheckLayer(*engine, layer));
    const std::vector<int32_t> home = engine->engine->placement(layer).home;
    KEEL_RETURN_IF_ERROR(
        keel::CheckCapacity(capacity, static_cast<long long>(home.size()), "num_experts"));
    std::copy(home.begin(), home.end(), home_out);
    return Status::Ok();
  });
}

keel_status_t keel_engine_local_experts(const keel_engine_t* engine, int layer,
                                        int32_t* experts_out, int32_t capacity) {
  return Guard("keel_engine_local_experts", [&]() -> Status {
    if (engine == nullptr) return Null("engine");
    if (experts_out == nullptr) return Null("experts_out");
    KEEL_RETURN_IF_ERROR(keel::CheckLayer(*engine, layer));
    const std::vector<int32_t>& experts = engine->local_experts[static_cast<size_t>(layer)];
    if (experts.empty()) {
      return keel::FailedPrecondition("layer = " + std::to_string(layer) +
                                      " has not been routed yet (call keel_engine_route first)");
    }
    KEEL_RETURN_IF_ERROR(
        keel::CheckCapacity(capacity, static_cast<long long>(experts.size()),
                            "slots_per_rank + transient_per_rank = " +
                                std::to_string(engine->engine->slots_per_rank()) + " + " +
                                std::to_string(engine->engine->transient_per_rank())));
    std::copy(experts.begin(), experts.end(), experts_out);
    return Status::Ok();
  });
}

keel_status_t keel_engine_rank(const keel_engine_t* engine, int* rank_out) {
  return Guard("keel_engine_rank", [&]() -> Status {
    if (engine == nullptr) return Null("engine");
    if (rank_out == nullptr) return Null("rank_out");
    *rank_out = engine->engine->rank();
    return Status::Ok();
  });
}

keel_status_t keel_engine_num_ranks(const keel_engine_t* engine, int* num_ranks_out) {
  return Guard("keel_engine_num_ranks", [&]() -> Status {
    if (engine == nullptr) return Null("engine");
    if (num_ranks_out == nullptr) return Null("num_ranks_out");
    *num_ranks_out = engine->engine->num_ranks();
    return Status::Ok();
  });
}

keel_status_t keel_engine_slots_per_rank(const keel_engine_t* engine, int* slots_out) {
  return Guard("keel_engine_slots_per_rank", [&]() -> Status {
    if (engine == nullptr) return Null("engine");
    if (slots_out == nullptr) return Null("slots_out");
    *slots_out = engine->engine->slots_per_rank();
    return Status::Ok();
  });
}

keel_status_t keel_engine_transient_per_rank(const keel_engine_t* engine, int* slots_out) {
  return Guard("keel_engine_transient_per_rank", [&]() -> Status {
    if (engine == nullptr) return Null("engine");
    if (slots_out == nullptr) return Null("slots_out");
    *slots_out = engine->engine->transient_per_rank();
    return Status::Ok();
  });
}

keel_status_t keel_engine_epoch(const keel_engine_t* engine, int64_t* epoch_out) {
  return Guard("keel_engine_epoch", [&]() -> Status {
    if (engine == nullptr) return Null("engine");
    if (epoch_out == nullptr) return Null("epoch_out");
    *epoch_out = engine->engine->epoch();
    return Status::Ok();
  });
}

keel_status_t keel_engine_stats(keel_engine_t* engine, keel_engine_stats_t* stats) {
  return Guard("keel_engine_stats", [&]() -> Status {
    if (engine == nullptr) return Null("engine");
    if (stats == nullptr) return Null("stats");
    const size_t struct_size = stats->struct_size;
    KEEL_RETURN_IF_ERROR(keel::CheckStructSize("stats", struct_size, keel::kEngineStatsV1Size,
                                               sizeof(keel_engine_stats_t), stats, false));
    const keel::EngineStats from = engine->engine->stats();
    engine->last_abort_message = from.last_abort.message();
    keel_engine_stats_t known;
    std::memset(static_cast<void*>(&known), 0, sizeof(known));
    known.struct_size = struct_size;
    known.steps = from.steps;
    known.epoch = from.epoch;
    known.epochs_committed = from.epochs_committed;
    known.epochs_aborted = from.epochs_aborted;
    known.plans_unchanged = from.plans_unchanged;
    known.bytes_moved = from.bytes_moved;
    known.exposed_migration_seconds = from.exposed_migration_seconds;
    known.route_seconds = from.route_seconds;
    known.control_seconds = from.control_seconds;
    known.last_abort_status = static_cast<keel_status_t>(from.last_abort.code());
    known.last_abort_message = engine->last_abort_message.c_str();
    // Fields of a newer keel.h that this library does not know read as zero.
    if (struct_size > sizeof(known)) {
      std::memset(reinterpret_cast<unsigned char*>(stats) + sizeof(known), 0,
                  struct_size - sizeof(known));
    }
    std::memcpy(static_cast<void*>(stats), &known, std::min(struct_size, sizeof(known)));
    return Status::Ok();
  });
}

}  // extern "C"
