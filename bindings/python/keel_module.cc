// keel._keel: the Python extension, pybind11 over include/keel/ and nothing else. Buffers cross as
// addresses (a tensor's data_ptr()) with their sizes, so the module works with any torch version,
// or none; the Python package (keel/__init__.py, keel/torch/) checks dtypes, shapes and devices
// before it calls in. A Status that is not OK becomes the exception keel/_errors.py maps its code
// to, with the message the library wrote (naming the bad field and value).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "keel/communicator.hpp"
#include "keel/condense.hpp"
#include "keel/config.hpp"
#include "keel/device_memory.hpp"
#include "keel/engine.hpp"
#include "keel/plan.hpp"
#include "keel/replay.hpp"
#include "keel/status.hpp"
#include "keel/trace.hpp"
#include "keel/version.hpp"

namespace py = pybind11;

namespace keel::python {
namespace {

// A failed Status on its way to Python; the translator registered below raises it.
class StatusError : public std::exception {
 public:
  explicit StatusError(Status status) : status_(std::move(status)), what_(status_.ToString()) {}
  const Status& status() const { return status_; }
  const char* what() const noexcept override { return what_.c_str(); }

 private:
  Status status_;
  std::string what_;
};

void ThrowIfError(const Status& status) {
  if (!status.ok()) throw StatusError(status);
}

template <typename T>
T ValueOrThrow(Result<T> result) {
  if (!result.ok()) throw StatusError(result.status());
  return std::move(result).value();
}

// The message of the Python exception being handled, "TypeName: text".
std::string DescribePythonError(const py::error_already_set& error) {
  std::string type = "exception";
  if (error.type()) type = py::str(error.type().attr("__name__"));
  return type + ": " + std::string(py::str(error.value()));
}

// The engine's collectives over a Python object (keel.torch.ProcessGroupCommunicator, or any
// object with the same methods). The engine calls it only from the thread that calls the engine,
// which released the GIL; every call takes the GIL back. A Python exception breaks the
// communicator as a lost peer does: TimeoutError is DeadlineExceeded, anything else Aborted, and
// every later call fails at once with Aborted. Optional, looked up once here:
// all_to_all_v_known (else AllToAllVKnownSizes runs all_to_all_v and compares the sizes), and
// moves_device_memory with all_to_all_v_device (device slot buffers exchanged without host
// staging).
class PythonCommunicator final : public Communicator {
 public:
  explicit PythonCommunicator(py::object impl) : impl_(std::move(impl)) {
    rank_ = impl_.attr("rank").cast<int>();
    size_ = impl_.attr("size").cast<int>();
    name_ = py::hasattr(impl_, "name") ? impl_.attr("name").cast<std::string>() : "python";
    has_known_sizes_ = py::hasattr(impl_, "all_to_all_v_known");
    moves_device_memory_ =
        py::hasattr(impl_, "moves_device_memory") && impl_.attr("moves_device_memory").cast<bool>();
  }
  ~PythonCommunicator() override {
    py::gil_scoped_acquire gil;
    impl_ = py::object();
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string_view name() const override { return name_; }

  Result<std::vector<std::string>> AllGather(std::string_view mine) override {
    std::vector<std::string> all;
    KEEL_RETURN_IF_ERROR(Call("all_gather", [&] {
      py::list parts = impl_.attr("all_gather")(py::bytes(mine.data(), mine.size()), timeout());
      if (static_cast<int>(parts.size()) != size_) throw WrongLength("all_gather", parts.size());
      for (py::handle part : parts) all.push_back(part.cast<std::string>());
    }));
    return all;
  }

  Status Barrier() override {
    return Call("barrier", [&] { impl_.attr("barrier")(timeout()); });
  }

  Status AllReduce(std::span<int64_t> values, ReduceOp op) override {
    return Reduce(values.data(), values.size() * sizeof(int64_t), "int64", op);
  }
  Status AllReduce(std::span<double> values, ReduceOp op) override {
    return Reduce(values.data(), values.size() * sizeof(double), "float64", op);
  }

  Status Broadcast(std::string& bytes, int root) override {
    if (root < 0 || root >= size_) {
      return InvalidArgument("broadcast root = " + std::to_string(root) + " is not in [0, " +
                             std::to_string(size_) + ")");
    }
    return Call("broadcast", [&] {
      bytes = impl_.attr("broadcast")(py::bytes(bytes), root, timeout()).cast<std::string>();
    });
  }

  Status AllToAllV(std::span<const std::byte> send, std::span<const size_t> send_bytes,
                   std::vector<std::byte>& recv, std::vector<size_t>& recv_bytes) override {
    KEEL_RETURN_IF_ERROR(CheckSizes("all_to_all_v", "send_bytes", send_bytes, send.size()));
    return Call("all_to_all_v", [&] {
      // The engine's bytes, lent for the call without a copy. Writable only so that torch can
      // wrap them (torch.frombuffer); the callee only reads them.
      py::memoryview view = py::memoryview::from_memory(const_cast<std::byte*>(send.data()),
                                                        static_cast<py::ssize_t>(send.size()));
      std::vector<size_t> counts(send_bytes.begin(), send_bytes.end());
      py::tuple answer = impl_.attr("all_to_all_v")(view, counts, timeout());
      py::buffer_info data = answer[0].cast<py::buffer>().request();
      recv_bytes = answer[1].cast<std::vector<size_t>>();
      size_t received = 0;
      for (size_t b : recv_bytes) received += b;
      const size_t data_bytes = static_cast<size_t>(data.size * data.itemsize);
      if (static_cast<int>(recv_bytes.size()) != size_ || received != data_bytes) {
        throw WrongLength("all_to_all_v", recv_bytes.size());
      }
      recv.resize(received);
      if (received > 0) std::memcpy(recv.data(), data.ptr, received);
    });
  }

  // impl.all_to_all_v_known(send, send_bytes, recv, recv_bytes, timeout) fills recv in place;
  // both memoryviews lend the engine's buffers for the call.
  Status AllToAllVKnownSizes(std::span<const std::byte> send, std::span<const size_t> send_bytes,
                             std::span<std::byte> recv,
                             std::span<const size_t> recv_bytes) override {
    if (!has_known_sizes_) {
      return Communicator::AllToAllVKnownSizes(send, send_bytes, recv, recv_bytes);
    }
    KEEL_RETURN_IF_ERROR(CheckSizes("all_to_all_v_known", "send_bytes", send_bytes, send.size()));
    KEEL_RETURN_IF_ERROR(CheckSizes("all_to_all_v_known", "recv_bytes", recv_bytes, recv.size()));
    return Call("all_to_all_v_known", [&] {
      // Writable only so that torch can wrap it (torch.frombuffer); the callee only reads it.
      py::memoryview send_view = py::memoryview::from_memory(const_cast<std::byte*>(send.data()),
                                                             static_cast<py::ssize_t>(send.size()));
      py::memoryview recv_view =
          py::memoryview::from_memory(recv.data(), static_cast<py::ssize_t>(recv.size()));
      impl_.attr("all_to_all_v_known")(send_view, Counts(send_bytes), recv_view, Counts(recv_bytes),
                                       timeout());
    });
  }

  bool MovesDeviceMemory() const override { return moves_device_memory_; }

  // impl.all_to_all_v_device(send, send_bytes, recv, recv_bytes, timeout) with the device
  // buffers' addresses; returns once recv holds the data.
  Status AllToAllVDevice(const std::byte* send, std::span<const size_t> send_bytes, std::byte* recv,
                         std::span<const size_t> recv_bytes) override {
    if (!moves_device_memory_) {
      return Communicator::AllToAllVDevice(send, send_bytes, recv, recv_bytes);
    }
    KEEL_RETURN_IF_ERROR(CheckSizes("all_to_all_v_device", "send_bytes", send_bytes, std::nullopt));
    KEEL_RETURN_IF_ERROR(CheckSizes("all_to_all_v_device", "recv_bytes", recv_bytes, std::nullopt));
    return Call("all_to_all_v_device", [&] {
      impl_.attr("all_to_all_v_device")(reinterpret_cast<uintptr_t>(send), Counts(send_bytes),
                                        reinterpret_cast<uintptr_t>(recv), Counts(recv_bytes),
                                        timeout());
    });
  }

 private:
  // InvalidArgument unless `sizes` has an entry per rank adding up to `bytes` (when known).
  Status CheckSizes(const char* method, const char* name, std::span<const size_t> sizes,
                    std::optional<size_t> bytes) const {
    size_t total = 0;
    for (size_t b : sizes) total += b;
    if (static_cast<int>(sizes.size()) == size_ && (!bytes.has_value() || total == *bytes)) {
      return Status::Ok();
    }
    return InvalidArgument(std::string(method) + ": " + name + " has " +
                           std::to_string(sizes.size()) + " entries adding up to " +
                           std::to_string(total) + ", expected " + std::to_string(size_) +
                           (bytes.has_value() ? " adding up to " + std::to_string(*bytes) : ""));
  }

  static std::vector<size_t> Counts(std::span<const size_t> sizes) {
    return {sizes.begin(), sizes.end()};
  }

  // A Python answer of the wrong shape: the Python side is broken, not a peer.
  static std::runtime_error WrongLength(const char* method, size_t got) {
    return std::runtime_error(std::string(method) + " returned " + std::to_string(got) +
                              " parts for the group's ranks");
  }

  double timeout() const { return timeout_seconds(); }

  Status Reduce(void* data, size_t bytes, const char* dtype, ReduceOp op) {
    return Call("all_reduce", [&] {
      py::memoryview view = py::memoryview::from_memory(data, static_cast<py::ssize_t>(bytes));
      impl_.attr("all_reduce")(view, dtype, std::string(ReduceOpName(op)), timeout());
    });
  }

  template <typename Body>
  Status Call(const char* collective, Body&& body) {
    if (!broken_.ok()) {
      return Aborted(std::string(collective) + ": the " + name_ +
                     " communicator is broken by an earlier failure (" + broken_.message() + ")");
    }
    py::gil_scoped_acquire gil;
    try {
      body();
      return Status::Ok();
    } catch (py::error_already_set& error) {
      const bool timed_out = error.matches(PyExc_TimeoutError);
      const std::string message = std::string(collective) + " on rank " + std::to_string(rank_) +
                                  " failed: " + DescribePythonError(error);
      broken_ = timed_out ? DeadlineExceeded(message) : Aborted(message);
      return broken_;
    } catch (const std::exception& error) {
      broken_ = Aborted(std::string(collective) + " on rank " + std::to_string(rank_) +
                        " failed: " + error.what());
      return broken_;
    }
  }

  py::object impl_;
  int rank_ = 0;
  int size_ = 1;
  std::string name_;
  bool has_known_sizes_ = false;
  bool moves_device_memory_ = false;
  Status broken_;
};

GradientType ParseGradientType(const std::string& name) {
  if (name == "float32") return GradientType::kFloat32;
  if (name == "float64") return GradientType::kFloat64;
  if (name == "fixed_int64") return GradientType::kFixedInt64;
  if (name == "bfloat16") return GradientType::kBFloat16;
  if (name == "float16") return GradientType::kFloat16;
  throw StatusError(InvalidArgument("gradient_type = '" + name +
                                    "' is not one of float32, float64, fixed_int64, bfloat16, "
                                    "float16"));
}

template <typename T>
T* Address(uintptr_t address) {
  return reinterpret_cast<T*>(address);
}

// Whether the slot buffers are device memory: "host" (false) or "cuda" (true: the GPU current
// on the creating thread).
bool ParseSlotMemory(const std::string& memory) {
  if (memory == "host") return false;
  if (memory == "cuda") return true;
  throw StatusError(
      InvalidArgument("memory = \"" + memory + "\" is not one of \"host\", \"cuda\""));
}

// One rank's engine and the communicator it runs over (destroyed after the engine).
class PythonEngine {
 public:
  PythonEngine(py::object communicator, std::optional<Config> config,
               const std::string& config_yaml, const std::string& config_path, int num_layers,
               int num_experts, int top_k, size_t weight_bytes, size_t gradient_bytes,
               size_t optimizer_bytes, const std::string& gradient_type, int mp_group_size,
               const std::string& memory)
      : communicator_(std::make_unique<PythonCommunicator>(std::move(communicator))),
        num_experts_(num_experts) {
    const bool on_cuda = ParseSlotMemory(memory);
    EngineOptions options;
    options.config = std::move(config);
    options.config_yaml = config_yaml;
    options.config_path = config_path;
    options.num_layers = num_layers;
    options.num_experts = num_experts;
    options.top_k = top_k;
    options.shape.weight_bytes = weight_bytes;
    options.shape.gradient_bytes = gradient_bytes;
    options.shape.optimizer_bytes = optimizer_bytes;
    options.shape.gradient_type = ParseGradientType(gradient_type);
    options.mp_group_size = mp_group_size;
    options.communicator = communicator_.get();
    py::gil_scoped_release release;
    if (on_cuda) {
      options.shape.memory = MemoryKind::kDevice;
      Result<std::shared_ptr<DeviceMemory>> cuda = CreateCudaDeviceMemory(-1);
      if (!cuda.ok()) {
        throw StatusError(
            Status(cuda.status().code(), "memory = \"cuda\": " + cuda.status().message()));
      }
      options.device_memory = std::move(*cuda);
    }
    engine_ = ValueOrThrow(Engine::Create(options));
    if (engine_->shards_experts()) {
      engine_.reset();
      throw StatusError(InvalidArgument(
          "policy.keel.shard_experts = true routes an entry of a sharded expert to every shard, "
          "which needs the C++ API (LayerRoute::row_entry); Python routes one row per entry"));
    }
  }
  ~PythonEngine() { Close(); }

  // Cancels a running migration and stops the planner thread; later calls fail.
  void Close() {
    py::gil_scoped_release release;
    engine_.reset();
  }

  Engine& engine() {
    if (engine_ == nullptr) {
      throw StatusError(FailedPrecondition("the engine is closed (close() was called)"));
    }
    return *engine_;
  }

  void RegisterSlot(int layer, int local_slot, uintptr_t weights, uintptr_t gradients,
                    uintptr_t optimizer) {
    ThrowIfError(engine().RegisterSlot(
        layer, local_slot,
        {Address<void>(weights), Address<void>(gradients), Address<void>(optimizer)}));
  }

  // Plans sequence migration (Engine::PlanSequences): `tokens` [sequences] and `expert_rows`
  // [sequences * layers * num_experts] int32 at the given addresses; `row_size` = layers *
  // num_experts. Returns the SequencePlacement as a dict of lists.
  py::dict PlanSequences(int first_layer, int64_t num_sequences, uintptr_t tokens,
                         uintptr_t expert_rows, int64_t row_size, double max_token_imbalance,
                         double move_bytes_per_token, const std::string& objective) {
    if (num_sequences < 0 || row_size < 0) {
      throw StatusError(InvalidArgument("num_sequences = " + std::to_string(num_sequences) +
                                        " and row_size = " + std::to_string(row_size) +
                                        " must be >= 0"));
    }
    std::vector<SequenceRouting> sequences(static_cast<size_t>(num_sequences));
    const int64_t* token_counts = Address<const int64_t>(tokens);
    const int32_t* rows = Address<const int32_t>(expert_rows);
    for (int64_t s = 0; s < num_sequences; ++s) {
      sequences[s].tokens = token_counts[s];
      sequences[s].expert_rows.assign(rows + s * row_size, rows + (s + 1) * row_size);
    }
    SequencePlanningOptions options;
    options.max_token_imbalance = max_token_imbalance;
    options.move_bytes_per_token = move_bytes_per_token;
    if (objective == "traffic") {
      options.objective = SequencePlanObjective::kTraffic;
    } else if (objective != "step") {
      throw StatusError(
          InvalidArgument("objective = \"" + objective + "\" is not step or traffic"));
    }
    Engine& e = engine();
    SequencePlacement plan = [&] {
      py::gil_scoped_release release;
      return ValueOrThrow(e.PlanSequences(first_layer, sequences, options));
    }();
    py::dict out;
    out["origin_rank"] = plan.origin_rank;
    out["origin_index"] = plan.origin_index;
    out["rank"] = plan.rank;
    out["used"] = plan.used;
    out["moved_sequences"] = plan.moved_sequences;
    out["moved_bytes"] = plan.moved_bytes;
    out["seconds_before"] = plan.seconds_before;
    out["seconds_after"] = plan.seconds_after;
    return out;
  }

  // Routes `num_entries` int32 ids at `topk_ids` and writes each entry's physical slot to
  // `slot_out` ([num_entries] int32); returns the splits and the quota table as lists.
  py::dict Route(int layer, uintptr_t topk_ids, int64_t num_entries, uintptr_t slot_out) {
    if (num_entries < 0) {
      throw StatusError(InvalidArgument("num_entries = " + std::to_string(num_entries) + " < 0"));
    }
    Engine& e = engine();
    LayerRoute value = [&] {
      py::gil_scoped_release release;
      return ValueOrThrow(
          e.Route(layer, {Address<const int32_t>(topk_ids), static_cast<size_t>(num_entries)}));
    }();
    if (value.slot.size() != static_cast<size_t>(num_entries)) {
      throw StatusError(Internal("the route of layer " + std::to_string(layer) + " has " +
                                 std::to_string(value.slot.size()) + " rows for " +
                                 std::to_string(num_entries) + " entries"));
    }
    if (num_entries > 0) {
      std::memcpy(Address<int32_t>(slot_out), value.slot.data(),
                  value.slot.size() * sizeof(int32_t));
    }
    return RouteDict(value);
  }

  // Engine::RouteCounts: `expert_counts` is the address of [num_experts] int32 counts (this
  // rank's entries per expert, on the host); returns route's dict. The trainer assigns the slots
  // from the quota table (copy_begin, copy_slot, copy_quota, slot_rank).
  py::dict RouteCounts(int layer, uintptr_t expert_counts) {
    Engine& e = engine();
    LayerRoute value = [&] {
      py::gil_scoped_release release;
      return ValueOrThrow(e.RouteCounts(
          layer, {Address<const int32_t>(expert_counts), static_cast<size_t>(num_experts_)}));
    }();
    return RouteDict(value);
  }

  // Collectives run with the GIL released: the communicator takes it back for each call. A
  // StatusError thrown here is translated once the release has ended.
  void ReduceGradients() {
    Engine& e = engine();
    py::gil_scoped_release release;
    ThrowIfError(e.ReduceGradients());
  }

  void StepEnd() {
    Engine& e = engine();
    py::gil_scoped_release release;
    ThrowIfError(e.StepEnd());
  }

  // Checkpoints: the engine's state as JSON text, and the experts by logical id (engine.hpp).
  // The accessors below wait for a call another thread has in progress (Engine's rule), whose
  // collectives may need the GIL: they wait without it.
  std::string SaveState() {
    EngineState state;
    {
      py::gil_scoped_release release;
      state = engine().SaveState();
    }
    return EngineStateToJson(state);
  }

  void RestoreState(const std::string& json) {
    Result<EngineState> state = EngineStateFromJson(json);
    ThrowIfError(state.status());
    for (const std::vector<int32_t>& layer : state->shards) {
      if (std::any_of(layer.begin(), layer.end(), [](int32_t shards) { return shards > 1; })) {
        throw StatusError(
            InvalidArgument("the state has sharded experts, whose routes need the C++ API "
                            "(LayerRoute::row_entry); Python routes one row per entry"));
      }
    }
    Engine& e = engine();
    py::gil_scoped_release release;
    ThrowIfError(e.RestoreState(*state));
  }

  void SaveExperts(const std::string& dir) {
    Engine& e = engine();
    py::gil_scoped_release release;
    ThrowIfError(e.SaveExperts(dir));
  }

  void LoadExperts(const std::string& dir) {
    Engine& e = engine();
    py::gil_scoped_release release;
    ThrowIfError(e.LoadExperts(dir));
  }

  std::vector<std::pair<int, int>> HomeSlots(int layer) {
    std::vector<std::pair<int, int>> homes;
    std::vector<HomeSlot> slots;
    {
      py::gil_scoped_release release;
      slots = engine().HomeSlots(layer);
    }
    for (const HomeSlot& home : slots) {
      homes.emplace_back(home.expert, home.local_slot);
    }
    return homes;
  }

  py::dict Placement(int layer) {
    if (layer < 0) throw StatusError(InvalidArgument("layer = " + std::to_string(layer) + " < 0"));
    LayerPlacement p;
    {
      py::gil_scoped_release release;
      p = engine().placement(layer);
    }
    if (p.num_experts == 0) {
      throw StatusError(InvalidArgument("layer = " + std::to_string(layer) + " is out of range"));
    }
    py::dict out;
    out["num_experts"] = p.num_experts;
    out["num_ranks"] = p.num_ranks;
    out["slots_per_rank"] = p.slots_per_rank;
    out["max_copies"] = p.max_copies;
    out["phy2log"] = p.phy2log;
    out["log2phy"] = p.log2phy;
    out["logcnt"] = p.logcnt;
    out["home"] = p.home;
    return out;
  }

  py::dict Stats() {
    EngineStats s;
    {
      py::gil_scoped_release release;
      s = engine().stats();
    }
    py::dict out;
    out["steps"] = s.steps;
    out["epoch"] = s.epoch;
    out["epochs_committed"] = s.epochs_committed;
    out["epochs_aborted"] = s.epochs_aborted;
    out["plans_unchanged"] = s.plans_unchanged;
    out["plans_failed"] = s.plans_failed;
    out["watchdog_trips"] = s.watchdog_trips;
    out["migration_in_flight"] = s.migration_in_flight;
    out["bytes_moved"] = s.bytes_moved;
    out["exposed_migration_seconds"] = s.exposed_migration_seconds;
    out["route_seconds"] = s.route_seconds;
    out["control_seconds"] = s.control_seconds;
    out["last_abort"] = s.last_abort.ok() ? std::string() : s.last_abort.ToString();
    out["last_plan_error"] = s.last_plan_error.ok() ? std::string() : s.last_plan_error.ToString();
    return out;
  }

  std::pair<int, int> LocateSlot(int slot) {
    const Engine::SlotLocation at = engine().LocateSlot(slot);
    return {at.rank, at.local_slot};
  }

 private:
  // A route's splits and quota table as lists (everything but the slots).
  static py::dict RouteDict(const LayerRoute& value) {
    py::dict out;
    out["send_counts"] = value.send_counts;
    out["recv_counts"] = value.recv_counts;
    out["recv_totals"] = value.recv_totals;
    out["local_experts"] = value.local_experts;
    out["epoch"] = value.epoch;
    out["share_begin"] = value.share_begin;
    out["share_end"] = value.share_end;
    out["copy_begin"] = value.copy_begin;
    out["copy_slot"] = value.copy_slot;
    out["copy_quota"] = value.copy_quota;
    out["slot_rank"] = value.slot_rank;
    return out;
  }

  std::unique_ptr<PythonCommunicator> communicator_;
  int num_experts_ = 0;
  std::unique_ptr<Engine> engine_;
};

py::dict Plan(const std::string& policy, const py::bytes& weight, int num_layers, int num_experts,
              int num_replicas, int num_groups, int num_nodes, int num_gpus, const Config* config) {
  PlanRequest request;
  request.policy = policy;
  request.num_layers = num_layers;
  request.num_experts = num_experts;
  const std::string raw = weight;
  if (raw.size() % sizeof(double) != 0) {
    throw StatusError(InvalidArgument("weight holds " + std::to_string(raw.size()) +
                                      " bytes, not whole float64 values"));
  }
  request.weight.resize(raw.size() / sizeof(double));
  if (!raw.empty()) std::memcpy(request.weight.data(), raw.data(), raw.size());
  request.num_replicas = num_replicas;
  request.num_groups = num_groups;
  request.num_nodes = num_nodes;
  request.num_gpus = num_gpus;
  request.config = config;
  PlanResult result = [&] {
    py::gil_scoped_release release;
    return ValueOrThrow(PlanPlacement(request));
  }();
  py::dict out;
  out["num_layers"] = result.num_layers;
  out["num_experts"] = result.num_experts;
  out["num_replicas"] = result.num_replicas;
  out["max_copies"] = result.max_copies;
  out["phy2log"] = result.phy2log;
  out["log2phy"] = result.log2phy;
  out["logcnt"] = result.logcnt;
  return out;
}

std::string Replay(const Trace& trace, const Config* config,
                   const std::vector<std::string>& policies, bool oracle, bool include_series) {
  ReplayRequest request;
  request.trace = &trace;
  request.config = config;
  request.policies = policies;
  request.oracle = oracle;
  request.include_series = include_series;
  py::gil_scoped_release release;
  return ValueOrThrow(ReplayToJson(request));
}

// Every step's counts back to back as float64 bytes: [num_steps, num_layers * row_size].
py::bytes TraceCounts(const Trace& trace) {
  const size_t row = static_cast<size_t>(trace.num_layers) * trace.row_size();
  std::string bytes(trace.steps.size() * row * sizeof(double), '\0');
  for (size_t s = 0; s < trace.steps.size(); ++s) {
    if (trace.steps[s].size() != row) {
      throw StatusError(Internal("trace step " + std::to_string(s) + " has " +
                                 std::to_string(trace.steps[s].size()) + " counts, expected " +
                                 std::to_string(row)));
    }
    std::memcpy(bytes.data() + s * row * sizeof(double), trace.steps[s].data(),
                row * sizeof(double));
  }
  return py::bytes(bytes);
}

}  // namespace
}  // namespace keel::python

PYBIND11_MODULE(_keel, m) {
  using namespace keel;
  using namespace keel::python;
  m.doc() = "Keel's native core (pybind11 over include/keel/); use the keel package instead.";
  m.attr("__version__") = kVersion;
  m.attr("with_cuda") = kWithCuda;
  m.attr("with_nccl") = kWithNccl;
  m.attr("with_ucx") = kWithUcx;
  m.attr("with_mpi") = kWithMpi;

  py::register_exception_translator([](std::exception_ptr pointer) {
    try {
      if (pointer) std::rethrow_exception(pointer);
    } catch (const StatusError& error) {
      py::object from_status = py::module_::import("keel._errors").attr("from_status");
      py::object exception =
          from_status(std::string(StatusCodeName(error.status().code())), error.status().message());
      PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exception.ptr())), exception.ptr());
    }
  });

  py::class_<Config>(m, "Config")
      .def(py::init<>())
      .def_static(
          "from_yaml",
          [](const std::string& yaml, const std::string& source) {
            return ValueOrThrow(Config::FromYaml(yaml, source));
          },
          py::arg("yaml"), py::arg("source") = "<config>")
      .def_static(
          "from_file", [](const std::string& path) { return ValueOrThrow(Config::FromFile(path)); },
          py::arg("path"))
      .def_static("reference", &Config::Reference)
      .def("to_yaml", &Config::ToYaml)
      .def_property_readonly("num_ranks", &Config::num_ranks)
      .def_property_readonly("policy", &Config::policy)
      .def("__eq__", [](const Config& a, const Config& b) { return a == b; })
      .def("__copy__", [](const Config& c) { return Config(c); })
      .def("__deepcopy__", [](const Config& c, py::dict) { return Config(c); });

  py::class_<Trace>(m, "Trace")
      .def_readonly("description", &Trace::description)
      .def_readonly("num_layers", &Trace::num_layers)
      .def_readonly("num_experts", &Trace::num_experts)
      .def_readonly("num_sources", &Trace::num_sources)
      .def_readonly("step_ids", &Trace::step_ids)
      .def_property_readonly("num_steps", &Trace::num_steps)
      .def("counts_bytes", &TraceCounts);

  m.def(
      "read_trace",
      [](const std::string& path, const std::string& format) {
        const TraceFormat parsed = ValueOrThrow(ParseTraceFormat(format));
        py::gil_scoped_release release;
        return ValueOrThrow(ReadTrace(path, parsed));
      },
      py::arg("path"), py::arg("format") = "auto");

  m.def(
      "synthetic_trace",
      [](uint64_t seed, int num_steps, int num_layers, int num_experts, int num_sources,
         int tokens_per_source, int top_k, double zipf_exponent) {
        SyntheticTraceOptions options;
        options.seed = seed;
        options.num_steps = num_steps;
        options.num_layers = num_layers;
        options.num_experts = num_experts;
        options.num_sources = num_sources;
        options.tokens_per_source = tokens_per_source;
        options.top_k = top_k;
        options.zipf_exponent = zipf_exponent;
        return ValueOrThrow(GenerateSyntheticTrace(options));
      },
      py::arg("seed"), py::arg("num_steps"), py::arg("num_layers"), py::arg("num_experts"),
      py::arg("num_sources"), py::arg("tokens_per_source"), py::arg("top_k"),
      py::arg("zipf_exponent"));

  m.def(
      "condense_rows",
      [](uintptr_t rows, int64_t num_rows, int64_t hidden, uintptr_t bucket_begin, int num_buckets,
         float threshold, int window, uintptr_t representative, uintptr_t kept) {
        py::gil_scoped_release release;
        ThrowIfError(CondenseRows(Address<const float>(rows), num_rows, hidden,
                                  Address<const int32_t>(bucket_begin), num_buckets, threshold,
                                  window, Address<int32_t>(representative),
                                  Address<int32_t>(kept)));
      },
      py::arg("rows"), py::arg("num_rows"), py::arg("hidden"), py::arg("bucket_begin"),
      py::arg("num_buckets"), py::arg("threshold"), py::arg("window"), py::arg("representative"),
      py::arg("kept"));
  m.def("policy_names", [] { return PolicyNames(); });
  m.def("plan", &Plan, py::arg("policy"), py::arg("weight"), py::arg("num_layers"),
        py::arg("num_experts"), py::arg("num_replicas"), py::arg("num_groups"),
        py::arg("num_nodes"), py::arg("num_gpus"), py::arg("config") = nullptr);
  m.def("replay", &Replay, py::arg("trace"), py::arg("config") = nullptr,
        py::arg("policies") = std::vector<std::string>{}, py::arg("oracle") = false,
        py::arg("include_series") = true);

  py::class_<PythonEngine>(m, "Engine")
      .def(
          py::init<py::object, std::optional<Config>, const std::string&, const std::string&, int,
                   int, int, size_t, size_t, size_t, const std::string&, int, const std::string&>(),
          py::arg("communicator"), py::arg("config") = std::nullopt, py::arg("config_yaml") = "",
          py::arg("config_path") = "", py::arg("num_layers"), py::arg("num_experts"),
          py::arg("top_k"), py::arg("weight_bytes"), py::arg("gradient_bytes"),
          py::arg("optimizer_bytes"), py::arg("gradient_type") = "float32",
          py::arg("mp_group_size") = 1, py::arg("memory") = "host")
      .def("close", &PythonEngine::Close)
      .def("register_slot", &PythonEngine::RegisterSlot, py::arg("layer"), py::arg("local_slot"),
           py::arg("weights"), py::arg("gradients"), py::arg("optimizer"))
      .def("route", &PythonEngine::Route, py::arg("layer"), py::arg("topk_ids"),
           py::arg("num_entries"), py::arg("slot_out"))
      .def("route_counts", &PythonEngine::RouteCounts, py::arg("layer"), py::arg("expert_counts"))
      .def("plan_sequences", &PythonEngine::PlanSequences, py::arg("first_layer"),
           py::arg("num_sequences"), py::arg("tokens"), py::arg("expert_rows"), py::arg("row_size"),
           py::arg("max_token_imbalance"), py::arg("move_bytes_per_token"), py::arg("objective"))
      .def("reduce_gradients", &PythonEngine::ReduceGradients)
      .def("step_end", &PythonEngine::StepEnd)
      .def("home_slots", &PythonEngine::HomeSlots, py::arg("layer"))
      .def("placement", &PythonEngine::Placement, py::arg("layer"))
      .def("stats", &PythonEngine::Stats)
      .def("save_state", &PythonEngine::SaveState)
      .def("restore_state", &PythonEngine::RestoreState, py::arg("state"))
      .def("save_experts", &PythonEngine::SaveExperts, py::arg("dir"))
      .def("load_experts", &PythonEngine::LoadExperts, py::arg("dir"))
      .def("locate_slot", &PythonEngine::LocateSlot, py::arg("slot"))
      .def_property_readonly("rank", [](PythonEngine& e) { return e.engine().rank(); })
      .def_property_readonly("num_ranks", [](PythonEngine& e) { return e.engine().num_ranks(); })
      .def_property_readonly("slots_per_rank",
                             [](PythonEngine& e) { return e.engine().slots_per_rank(); })
      .def_property_readonly("transient_per_rank",
                             [](PythonEngine& e) { return e.engine().transient_per_rank(); })
      .def_property_readonly("epoch", [](PythonEngine& e) {
        py::gil_scoped_release release;  // it waits for another thread's call in progress
        return e.engine().epoch();
      });
}
