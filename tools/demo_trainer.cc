// One rank of `keel demo`: the token gate, and the training loop over the engine. Forward per
// layer: Route, dispatch (token, k) rows sorted by (rank, slot, token, k), run each local slot's
// rows, send the outputs back, combine in k order. Backward in reverse layer order over the same
// routing, accumulating int64 fixed-point weight gradients in the slots' gradient buffers. Then
// ReduceGradients, Adam on the homes, StepEnd. In Luffy's runs a rank's tokens are sequences,
// which may move to other ranks before the first layer, and the rows of one slot may be
// condensed before the dispatch.
#include "tools/demo_trainer.h"

#include <time.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <string>
#include <utility>

#include "engine/engine_internal.h"
#include "kernels/condense.h"
#include "migration/sequence_migration.h"
#include "tools/demo_strategies.h"

namespace keel::tools {

double ThreadCpuSeconds() {
  timespec now{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &now);
  return static_cast<double>(now.tv_sec) + static_cast<double>(now.tv_nsec) * 1e-9;
}

namespace {

// Adds the thread CPU time of its scope to `*total`.
class CpuTimer {
 public:
  explicit CpuTimer(double* total) : total_(total), start_(ThreadCpuSeconds()) {}
  ~CpuTimer() { *total_ += ThreadCpuSeconds() - start_; }
  CpuTimer(const CpuTimer&) = delete;
  CpuTimer& operator=(const CpuTimer&) = delete;

 private:
  double* total_;
  double start_;
};

// What one layer's forward leaves for its backward. Without condensation every row is kept:
// the kept rows are the rows.
struct LayerActivations {
  std::vector<uint32_t> send_order;  // row indices in dispatch order (rows: LayerRoute's)
  // [rows] each row's (token, k) entry; empty when every entry is one row (no sharded expert).
  std::vector<int32_t> row_entry;
  std::vector<int32_t> local_shards;  // [local slots] shards of each slot's expert (1: whole)
  std::vector<int64_t> send_rows;     // [ranks] rows dispatched to each rank
  std::vector<int64_t> recv_rows;     // [ranks] rows received from each rank
  std::vector<int32_t> recv_slot;     // [received rows] local slot of each received row
  // [sent rows] the row's kept row among those sent to its rank; [ranks] kept rows sent to and
  // received from each rank; [received rows] the kept row (index into recv_x) of each row.
  std::vector<int32_t> send_kept;
  std::vector<int64_t> kept_to;
  std::vector<int64_t> kept_from;
  std::vector<int32_t> recv_kept;
  std::vector<float> recv_x;      // [kept received rows, hidden] expert inputs
  std::vector<float> activation;  // [kept received rows, ffn] relu(W1 · x)
};

// The (token, k) entry of dispatch row `row`.
size_t EntryOf(const LayerActivations& act, size_t row) {
  return act.row_entry.empty() ? row : static_cast<size_t>(act.row_entry[row]);
}

// Per-rank CPU seconds of one step.
struct StepTimes {
  std::vector<double> expert;         // [layers]
  std::vector<double> communication;  // [layers], Route included
  double sequences = 0;               // planning and moving sequences
  double route = 0;
  double control = 0;    // ReduceGradients + StepEnd
  double optimizer = 0;  // Adam on the homes
};

class RankTrainer {
 public:
  explicit RankTrainer(const RankRunOptions& options)
      : options_(options),
        model_(options.model),
        communicator_(*options.communicator),
        rank_(communicator_.rank()),
        ranks_(communicator_.size()),
        weight_floats_(model_.ffn.weight_floats()) {}

  ~RankTrainer() {
    engine_.reset();  // before the buffers it was given
    for (std::byte* buffer : device_buffers_) {
      if (buffer != nullptr) device_->FreeDevice(buffer);
    }
  }
  RankTrainer(const RankTrainer&) = delete;
  RankTrainer& operator=(const RankTrainer&) = delete;

  Status Init();
  Result<StepMeasurement> Step(int64_t step);
  Result<std::vector<float>> GatherFinalWeights();
  EngineStats stats() const { return engine_->stats(); }

 private:
  size_t SlotIndex(int layer, int local_slot) const {
    return static_cast<size_t>(layer) * local_slots_ + local_slot;
  }
  float* Weights(int layer, int local_slot) {
    return weights_.data() + SlotIndex(layer, local_slot) * weight_floats_;
  }
  int64_t* Gradients(int layer, int local_slot) {
    return gradients_.data() + SlotIndex(layer, local_slot) * weight_floats_;
  }
  float* Optimizer(int layer, int persistent_slot) {
    return optimizer_.data() +
           (static_cast<size_t>(layer) * slots_per_rank_ + persistent_slot) * 2 * weight_floats_;
  }
  // The FFN a slot holding one of `shards` shards runs (the whole expert's for 1).
  FfnShape ShapeOf(int shards) const {
    return shards > 1 ? ShardShape(model_.ffn, shards) : model_.ffn;
  }
  // Adds every row's output (`rows` [rows, hidden], in row order) into its entry's place in
  // `entries` [entries, hidden], the rows of an entry in shard order: the sharded experts'
  // partial outputs sum to the expert's.
  void FoldRows(const LayerActivations& act, std::span<const float> rows,
                std::vector<float>& entries) const;
  // Device memory: the host copies of the slots follow and feed the registered device buffers.
  enum Region { kWeights, kGradients, kOptimizer };
  Status SetUpMemory();
  // The host copy of a slot's region (kOptimizer: persistent slots only) and its size.
  std::pair<std::byte*, size_t> HostRegion(int layer, int local_slot, Region region);
  Status Download(int layer, int local_slot, Region region);
  Status Upload(int layer, int local_slot, Region region);
  Status SyncForTiming() {
    return options_.barrier_before_timing ? communicator_.Barrier() : Status::Ok();
  }
  // Sends rows of `width` values (rows_to[r] to rank r, back to back in `send`) and receives
  // into `recv`; every rank r must send expected_from[r] rows, or the routing is inconsistent.
  template <typename T>
  Status ExchangeRows(std::span<const T> send, std::span<const int64_t> rows_to,
                      std::span<const int64_t> expected_from, int width, std::vector<T>& recv,
                      std::string_view what, double* cpu);
  // MP groups: sends this rank's rows (`mine`, [tokens_, hidden]) to the other members of its
  // group and returns the group's [group tokens, hidden] in member order, this rank's own in
  // its place. The bytes count as group bytes.
  Status AllGatherInMpGroup(std::span<const float> mine, std::vector<float>& group, double* cpu);
  // The token of dispatch row `row` among this rank's tokens (rows index the group's entries).
  size_t TokenOf(const LayerActivations& act, size_t row) const {
    return EntryOf(act, row) / model_.top_k - static_cast<size_t>(share_token_);
  }
  // Seconds the emulated links take for this rank's `sent` and `received` off-rank bytes.
  double LinkSeconds(double sent, double received) const {
    if (options_.link_gb_per_s <= 0) return 0.0;
    return std::max(sent, received) / (options_.link_gb_per_s * 1e9);
  }
  // This step's tokens: drawn here (plain demo), or this rank's sequences after the moves.
  Status DrawBatch(int64_t step, StepTimes& times);
  Status MoveSequences(int64_t step, const SequencePlacement& plan,
                       const std::vector<std::vector<float>>& own_inputs,
                       std::vector<std::vector<float>>& received, StepTimes& times);
  // Condenses the dispatch rows `send_` (`bucket_begin` [ranks * local slots + 1]) and sends
  // the kept rows; fills act's kept fields and recv_x.
  Status DispatchCondensed(int layer, const std::vector<int32_t>& bucket_begin,
                           LayerActivations& act, StepTimes& times);
  Status Forward(int64_t step, int layer, StepTimes& times, std::vector<int64_t>& rows);
  Status Backward(int layer, StepTimes& times);

  const RankRunOptions& options_;
  const DemoModelOptions& model_;
  Communicator& communicator_;
  const int rank_;
  const int ranks_;
  const size_t weight_floats_;
  std::unique_ptr<Engine> engine_;
  int slots_per_rank_ = 0;
  int local_slots_ = 0;

  std::shared_ptr<DeviceMemory> device_;    // null: the host vectors below are the slots
  std::vector<std::byte*> device_buffers_;  // [layers, local slots, Region]; null: none
  std::vector<float> weights_;              // [layers, local slots, weight_floats]
  std::vector<int64_t> gradients_;          // [layers, local slots, weight_floats]
  std::vector<float> optimizer_;            // [layers, persistent slots, 2 * weight_floats]
  std::vector<float> teacher_;              // [hidden, hidden]

  // This step.
  std::vector<std::vector<float>> x_;  // [layers + 1][tokens, hidden] layer inputs, then output
  std::vector<float> targets_;         // [tokens, hidden]
  std::vector<float> d_x_;             // [tokens, hidden] gradient at the current layer output
  std::vector<LayerActivations> layers_;
  std::vector<int32_t> topk_ids_;
  int tokens_ = 0;  // this step's tokens on this rank
  // MP groups: the group's size, and where this rank's tokens begin among the group's (both
  // its own share of them and its place in topk_ids_); 1 and 0 without.
  int mp_ = 1;
  int64_t share_token_ = 0;
  std::vector<float> group_rows_;  // [group tokens, hidden] what the MP group gathered
  std::vector<std::vector<int32_t>> layer_ids_;  // [layers][tokens_ * top_k] with sequences
  // This step's Luffy counters (this rank's).
  int64_t rows_dispatched_ = 0;
  int64_t rows_remote_ = 0;
  int64_t rows_kept_ = 0;
  int64_t sequences_moved_ = 0;
  double sequence_bytes_ = 0;
  double all_to_all_bytes_ = 0;  // this step's bytes to other ranks in ExchangeRows
  double group_bytes_ = 0;       // this step's bytes to the other members of its MP group
  std::vector<float> send_;
  std::vector<float> recv_;
  std::vector<float> expert_out_;  // [received rows, hidden]
  std::vector<float> gathered_;    // [tokens * top_k, hidden] in (token, k) order
  std::vector<float> row_out_;     // [rows, hidden] in row order, with sharded experts
  double exposed_before_ = 0;
};

Status RankTrainer::Init() {
  EngineOptions engine_options;
  engine_options.config = MakeConfig(options_.config);
  engine_options.num_layers = model_.layers;
  engine_options.num_experts = model_.experts;
  engine_options.top_k = model_.top_k;
  engine_options.shape.weight_bytes = model_.ffn.weight_bytes();
  engine_options.shape.gradient_bytes = model_.ffn.gradient_bytes();
  engine_options.shape.optimizer_bytes = model_.ffn.optimizer_bytes();
  engine_options.shape.gradient_type = GradientType::kFixedInt64;
  engine_options.communicator = &communicator_;
  engine_options.sharded_experts = options_.sharded_experts;
  engine_options.shard_layout = FfnShardLayout(model_.ffn);
  engine_options.mp_group_size = options_.mp_group_size;
  engine_options.local_group = options_.local_group;
  KEEL_RETURN_IF_ERROR(SetUpMemory());
  if (device_ != nullptr) {
    engine_options.shape.memory = MemoryKind::kDevice;
    engine_options.device_memory = device_;
  }
  KEEL_ASSIGN_OR_RETURN(engine_, EngineFactory::Create(engine_options, options_.metrics));
  slots_per_rank_ = engine_->slots_per_rank();
  local_slots_ = engine_->local_slots();

  const size_t slots = static_cast<size_t>(model_.layers) * local_slots_;
  if (device_ != nullptr) device_buffers_.assign(slots * 3, nullptr);
  weights_.assign(slots * weight_floats_, 0.0f);
  gradients_.assign(slots * weight_floats_, 0);
  optimizer_.assign(static_cast<size_t>(model_.layers) * slots_per_rank_ * 2 * weight_floats_,
                    0.0f);
  for (int l = 0; l < model_.layers; ++l) {
    const LayerPlacement placement = engine_->placement(l);
    for (int s = 0; s < local_slots_; ++s) {
      SlotBuffers buffers;
      buffers.weights = Weights(l, s);
      buffers.gradients = Gradients(l, s);
      if (s < slots_per_rank_) {
        buffers.optimizer = Optimizer(l, s);
        // Every copy of an expert starts from the same bits as its home; a shard from its
        // slice of them.
        const int unit = placement.expert_at(rank_ * slots_per_rank_ + s);
        if (unit >= 0) {
          const int expert = placement.unit_expert[unit];
          const int shards = placement.unit_shards[unit];
          std::vector<float> whole(weight_floats_);
          InitExpertWeights(model_.ffn, model_.seed, l, expert, whole);
          if (shards == 1) {
            std::copy(whole.begin(), whole.end(), Weights(l, s));
          } else {
            SliceExpertWeights(model_.ffn, shards, placement.unit_shard[unit], whole,
                               {Weights(l, s), ShapeOf(shards).weight_floats()});
          }
        }
      }
      if (device_ != nullptr) {
        const size_t sizes[] = {model_.ffn.weight_bytes(), model_.ffn.gradient_bytes(),
                                s < slots_per_rank_ ? model_.ffn.optimizer_bytes() : 0};
        for (const Region region : {kWeights, kGradients, kOptimizer}) {
          if (sizes[region] == 0) continue;
          std::byte*& buffer = device_buffers_[SlotIndex(l, s) * 3 + region];
          KEEL_ASSIGN_OR_RETURN(buffer, device_->AllocateDevice(sizes[region]));
          KEEL_RETURN_IF_ERROR(Upload(l, s, region));
        }
        void** registered[] = {&buffers.weights, &buffers.gradients, &buffers.optimizer};
        for (const Region region : {kWeights, kGradients, kOptimizer}) {
          *registered[region] = device_buffers_[SlotIndex(l, s) * 3 + region];
        }
      }
      KEEL_RETURN_IF_ERROR(engine_->RegisterSlot(l, s, buffers));
    }
  }
  teacher_ = MakeTeacher(model_.ffn.hidden, model_.seed);
  const size_t activations = static_cast<size_t>(model_.tokens) * model_.ffn.hidden;
  x_.assign(model_.layers + 1, std::vector<float>(activations));
  targets_.resize(activations);
  d_x_.resize(activations);
  layers_.resize(model_.layers);
  tokens_ = model_.tokens;
  mp_ = options_.mp_group_size;
  share_token_ = static_cast<int64_t>(rank_ % mp_) * tokens_;
  topk_ids_.resize(static_cast<size_t>(mp_) * tokens_ * model_.top_k);
  if (mp_ > 1 && (options_.sequences != nullptr || options_.condense_threshold > 0)) {
    return InvalidArgument("MP groups do not combine with Luffy's sequences or condensation");
  }
  if (options_.migrate_sequences &&
      (options_.sequences == nullptr || options_.sequence_transport == nullptr)) {
    return InvalidArgument("sequence migration needs a sequence gate and a sequence transport");
  }
  return Status::Ok();
}

Status RankTrainer::SetUpMemory() {
  if (options_.memory == "host") return Status::Ok();
  if (options_.memory == "guarded-host") {
    KEEL_ASSIGN_OR_RETURN(device_, CreateGuardedHostMemory());
  } else if (options_.memory == "device") {
    KEEL_ASSIGN_OR_RETURN(device_, CreateCudaDeviceMemory());
  } else {
    return InvalidArgument("memory \"" + options_.memory +
                           "\" is not one of host, device, guarded-host");
  }
  return Status::Ok();
}

std::pair<std::byte*, size_t> RankTrainer::HostRegion(int layer, int local_slot, Region region) {
  switch (region) {
    case kWeights:
      return {reinterpret_cast<std::byte*>(Weights(layer, local_slot)),
              weight_floats_ * sizeof(float)};
    case kGradients:
      return {reinterpret_cast<std::byte*>(Gradients(layer, local_slot)),
              weight_floats_ * sizeof(int64_t)};
    case kOptimizer:
      break;
  }
  return {reinterpret_cast<std::byte*>(Optimizer(layer, local_slot)),
          2 * weight_floats_ * sizeof(float)};
}

Status RankTrainer::Download(int layer, int local_slot, Region region) {
  const std::byte* device = device_buffers_[SlotIndex(layer, local_slot) * 3 + region];
  if (device == nullptr) return Status::Ok();
  const auto [host, bytes] = HostRegion(layer, local_slot, region);
  return device_->Copy(host, device, bytes);
}

Status RankTrainer::Upload(int layer, int local_slot, Region region) {
  std::byte* device = device_buffers_[SlotIndex(layer, local_slot) * 3 + region];
  if (device == nullptr) return Status::Ok();
  const auto [host, bytes] = HostRegion(layer, local_slot, region);
  return device_->Copy(device, host, bytes);
}

template <typename T>
Status RankTrainer::ExchangeRows(std::span<const T> send, std::span<const int64_t> rows_to,
                                 std::span<const int64_t> expected_from, int width,
                                 std::vector<T>& recv, std::string_view what, double* cpu) {
  KEEL_RETURN_IF_ERROR(SyncForTiming());
  CpuTimer timer(cpu);
  const size_t row_bytes = static_cast<size_t>(width) * sizeof(T);
  std::vector<size_t> send_bytes(ranks_);
  for (int r = 0; r < ranks_; ++r) send_bytes[r] = static_cast<size_t>(rows_to[r]) * row_bytes;
  std::vector<std::byte> received;
  std::vector<size_t> recv_bytes;
  KEEL_RETURN_IF_ERROR(
      communicator_.AllToAllV(std::as_bytes(send), send_bytes, received, recv_bytes));
  double sent_off = 0;
  double received_off = 0;
  for (int r = 0; r < ranks_; ++r) {
    if (recv_bytes[r] != static_cast<size_t>(expected_from[r]) * row_bytes) {
      return Internal(std::string(what) + ": rank " + std::to_string(rank_) + " received " +
                      std::to_string(recv_bytes[r] / row_bytes) + " rows from rank " +
                      std::to_string(r) + ", the routing said " + std::to_string(expected_from[r]));
    }
    if (r != rank_) {
      sent_off += static_cast<double>(send_bytes[r]);
      received_off += static_cast<double>(recv_bytes[r]);
    }
  }
  *cpu += LinkSeconds(sent_off, received_off);
  all_to_all_bytes_ += sent_off;
  recv.resize(received.size() / sizeof(T));
  if (!received.empty()) std::memcpy(recv.data(), received.data(), received.size());
  return Status::Ok();
}

Status RankTrainer::AllGatherInMpGroup(std::span<const float> mine, std::vector<float>& group,
                                       double* cpu) {
  KEEL_RETURN_IF_ERROR(SyncForTiming());
  CpuTimer timer(cpu);
  const int first_member = rank_ - rank_ % mp_;
  std::vector<size_t> send_bytes(ranks_, 0);
  std::vector<float> send;
  for (int peer = first_member; peer < first_member + mp_; ++peer) {
    if (peer == rank_) continue;
    send_bytes[peer] = mine.size_bytes();
    send.insert(send.end(), mine.begin(), mine.end());
  }
  std::vector<std::byte> received;
  std::vector<size_t> recv_bytes;
  KEEL_RETURN_IF_ERROR(communicator_.AllToAllV(std::as_bytes(std::span<const float>(send)),
                                               send_bytes, received, recv_bytes));
  group.clear();
  size_t at = 0;
  for (int peer = first_member; peer < first_member + mp_; ++peer) {
    if (peer == rank_) {
      group.insert(group.end(), mine.begin(), mine.end());
      continue;
    }
    if (recv_bytes[peer] != mine.size_bytes()) {
      return Internal("MP group all-gather: rank " + std::to_string(rank_) + " received " +
                      std::to_string(recv_bytes[peer]) + " bytes from rank " +
                      std::to_string(peer) + ", expected " + std::to_string(mine.size_bytes()));
    }
    group.resize(group.size() + mine.size());
    std::memcpy(group.data() + group.size() - mine.size(), received.data() + at, recv_bytes[peer]);
    at += recv_bytes[peer];
  }
  const double bytes = static_cast<double>(send.size() * sizeof(float));
  *cpu += LinkSeconds(bytes, static_cast<double>(received.size()));
  group_bytes_ += bytes;
  return Status::Ok();
}

Status RankTrainer::DispatchCondensed(int layer, const std::vector<int32_t>& bucket_begin,
                                      LayerActivations& act, StepTimes& times) {
  const int hidden = model_.ffn.hidden;
  const size_t sent = act.send_order.size();
  const int buckets = static_cast<int>(bucket_begin.size()) - 1;
  std::vector<int32_t> representative(sent);
  std::vector<int32_t> kept(buckets);
  KEEL_RETURN_IF_ERROR(kernels::cpu::CondenseRows(
      send_.data(), static_cast<int64_t>(sent), hidden, kernels::DType::kFloat32,
      bucket_begin.data(), buckets, options_.condense_threshold, /*window=*/32,
      representative.data(), kept.data()));
  // A bucket's rows all go to one rank, so a row's representative goes there too: kept rows
  // are numbered per destination in dispatch order, and a condensed row takes its
  // representative's number.
  act.send_kept.assign(sent, 0);
  act.kept_to.assign(ranks_, 0);
  std::vector<float> kept_rows;
  for (int b = 0; b < buckets; ++b) {
    const int destination = b / local_slots_;
    for (int32_t i = bucket_begin[b]; i < bucket_begin[b + 1]; ++i) {
      if (representative[i] == i) {
        act.send_kept[i] = static_cast<int32_t>(act.kept_to[destination]++);
        kept_rows.insert(kept_rows.end(), send_.begin() + static_cast<ptrdiff_t>(i) * hidden,
                         send_.begin() + static_cast<ptrdiff_t>(i + 1) * hidden);
      } else {
        act.send_kept[i] = act.send_kept[representative[i]];
      }
    }
  }
  // First which kept row each row is, then the kept rows.
  KEEL_RETURN_IF_ERROR(ExchangeRows<int32_t>(act.send_kept, act.send_rows, act.recv_rows, 1,
                                             act.recv_kept, "condensed dispatch map",
                                             &times.communication[layer]));
  act.kept_from.assign(ranks_, 0);
  size_t at = 0;
  int64_t offset = 0;
  for (int source = 0; source < ranks_; ++source) {
    int64_t most = -1;
    for (int64_t i = 0; i < act.recv_rows[source]; ++i, ++at) {
      most = std::max<int64_t>(most, act.recv_kept[at]);
      act.recv_kept[at] += static_cast<int32_t>(offset);
    }
    act.kept_from[source] = most + 1;
    offset += most + 1;
  }
  return ExchangeRows<float>(kept_rows, act.kept_to, act.kept_from, hidden, act.recv_x,
                             "condensed dispatch", &times.communication[layer]);
}

Status RankTrainer::Forward(int64_t step, int layer, StepTimes& times, std::vector<int64_t>& rows) {
  const int hidden = model_.ffn.hidden;
  const int top_k = model_.top_k;
  if (options_.sequences != nullptr) {
    topk_ids_ = layer_ids_[layer];
  } else {
    // With MP groups: every member's tokens, in member order (the group's tokens).
    const size_t ids = static_cast<size_t>(tokens_) * top_k;
    const int first_member = rank_ - rank_ % mp_;
    for (int m = 0; m < mp_; ++m) {
      options_.gate->Draw(step, layer, first_member + m,
                          std::span<int32_t>(topk_ids_).subspan(m * ids, ids));
    }
  }

  KEEL_RETURN_IF_ERROR(SyncForTiming());
  const double route_start = ThreadCpuSeconds();
  Result<LayerRoute> routed = engine_->Route(layer, topk_ids_);
  const double route_cpu = ThreadCpuSeconds() - route_start;
  times.route += route_cpu;
  times.communication[layer] += route_cpu;
  if (!routed.ok())
    return routed.status().WithContext("Route(layer " + std::to_string(layer) + ")");
  const LayerRoute& route = *routed;
  if (route.share_begin != share_token_ || route.share_end != share_token_ + tokens_) {
    return Internal("Route(layer " + std::to_string(layer) + ") on rank " + std::to_string(rank_) +
                    " gave the share [" + std::to_string(route.share_begin) + ", " +
                    std::to_string(route.share_end) + ") of its group's tokens, not its own");
  }
  if (device_ != nullptr) {
    // The engine may have changed any slot's weights since the last step (pushes, migration,
    // this step's transient fills): the CPU experts read them from the device.
    for (int s = 0; s < local_slots_; ++s) KEEL_RETURN_IF_ERROR(Download(layer, s, kWeights));
  }

  // Dispatch order: a counting sort on (rank, local slot), stable in row order.
  LayerActivations& act = layers_[layer];
  act.row_entry = route.row_entry;
  act.local_shards = route.local_shards;
  const size_t route_rows = route.slot.size();
  std::vector<uint32_t> bucket_rows(static_cast<size_t>(ranks_) * local_slots_ + 1, 0);
  std::vector<uint32_t> bucket(route_rows);
  act.send_rows.assign(ranks_, 0);
  for (size_t i = 0; i < route_rows; ++i) {
    const int32_t slot = route.slot[i];
    if (slot < 0) {
      bucket[i] = static_cast<uint32_t>(bucket_rows.size() - 1);  // dropped: not sent
      continue;
    }
    const auto [owner, local] = engine_->LocateSlot(slot);
    bucket[i] = static_cast<uint32_t>(owner * local_slots_ + local);
    ++bucket_rows[bucket[i]];
    ++act.send_rows[owner];
  }
  if (act.send_rows != route.send_counts) {
    return Internal("Route(layer " + std::to_string(layer) + ") on rank " + std::to_string(rank_) +
                    ": send_counts disagree with the rows its slots send to each rank");
  }
  std::vector<size_t> start(bucket_rows.size(), 0);
  for (size_t b = 1; b < bucket_rows.size(); ++b) start[b] = start[b - 1] + bucket_rows[b - 1];
  const size_t sent = start.back();
  // [ranks * local slots + 1] the buckets' first rows, for condensation.
  const std::vector<int32_t> bucket_begin(start.begin(), start.end());
  act.send_order.resize(sent);
  for (size_t i = 0; i < route_rows; ++i) {
    if (route.slot[i] >= 0) act.send_order[start[bucket[i]]++] = static_cast<uint32_t>(i);
  }
  send_.resize(sent * hidden);
  const std::vector<float>& x = x_[layer];
  for (size_t r = 0; r < sent; ++r) {
    const size_t token = TokenOf(act, act.send_order[r]);
    std::memcpy(send_.data() + r * hidden, x.data() + token * hidden, hidden * sizeof(float));
  }
  act.recv_rows = route.recv_totals;
  rows_dispatched_ += static_cast<int64_t>(sent);
  rows_remote_ += static_cast<int64_t>(sent) - act.send_rows[rank_];
  if (options_.condense_threshold > 0) {
    KEEL_RETURN_IF_ERROR(DispatchCondensed(layer, bucket_begin, act, times));
  } else {
    KEEL_RETURN_IF_ERROR(ExchangeRows<float>(send_, act.send_rows, act.recv_rows, hidden,
                                             act.recv_x, "dispatch", &times.communication[layer]));
    act.send_kept.resize(sent);
    for (int r = 0, at = 0; r < ranks_; ++r) {
      for (int64_t i = 0; i < act.send_rows[r]; ++i) act.send_kept[at++] = static_cast<int32_t>(i);
    }
    act.kept_to = act.send_rows;
    act.kept_from = act.recv_rows;
    act.recv_kept.resize(act.recv_x.size() / hidden);
    for (size_t i = 0; i < act.recv_kept.size(); ++i) act.recv_kept[i] = static_cast<int32_t>(i);
  }

  // Received rows come grouped by source rank, then by local slot ascending.
  const size_t received = act.recv_kept.size();
  act.recv_slot.clear();
  for (int source = 0; source < ranks_; ++source) {
    for (int s = 0; s < local_slots_; ++s) {
      const int64_t count = route.recv_counts[static_cast<size_t>(source) * local_slots_ + s];
      if (count > 0 && route.local_experts[s] < 0) {
        return Internal("Route(layer " + std::to_string(layer) + ") sends rows to local slot " +
                        std::to_string(s) + " of rank " + std::to_string(rank_) +
                        ", which holds no expert");
      }
      act.recv_slot.insert(act.recv_slot.end(), static_cast<size_t>(count), s);
      rows[static_cast<size_t>(rank_) * model_.layers + layer] += count;
    }
  }
  if (act.recv_slot.size() != received) {
    return Internal("Route(layer " + std::to_string(layer) + ") on rank " + std::to_string(rank_) +
                    ": recv_counts add up to " + std::to_string(act.recv_slot.size()) +
                    " rows, recv_totals to " + std::to_string(received));
  }
  // The experts run on the kept rows; a kept row's slot is the slot of the rows it stands for.
  const size_t kept = act.recv_x.size() / hidden;
  std::vector<int32_t> kept_slot(kept, -1);
  for (size_t r = 0; r < received; ++r) {
    int32_t& slot = kept_slot[static_cast<size_t>(act.recv_kept[r])];
    if (slot >= 0 && slot != act.recv_slot[r]) {
      return Internal("condensed dispatch: a kept row stands for rows of two slots");
    }
    slot = act.recv_slot[r];
  }
  {
    CpuTimer timer(&times.expert[layer]);
    const int ffn = model_.ffn.ffn;
    act.activation.resize(kept * ffn);
    expert_out_.resize(kept * hidden);
    for (size_t r = 0; r < kept; ++r) {
      ExpertForward(ShapeOf(act.local_shards[kept_slot[r]]), Weights(layer, kept_slot[r]),
                    act.recv_x.data() + r * hidden, expert_out_.data() + r * hidden,
                    act.activation.data() + r * ffn);
    }
  }
  rows_kept_ += static_cast<int64_t>(kept);
  KEEL_RETURN_IF_ERROR(ExchangeRows<float>(expert_out_, act.kept_from, act.kept_to, hidden, recv_,
                                           "combine", &times.communication[layer]));

  // Combine: outputs come back per rank in the kept rows' order; every row takes its kept row's
  // output, dropped choices add nothing. With sharded experts the rows land in row order first,
  // and each entry adds up its shards' rows.
  std::vector<size_t> kept_begin(ranks_, 0);
  for (int r = 1; r < ranks_; ++r) kept_begin[r] = kept_begin[r - 1] + act.kept_to[r - 1];
  std::vector<float>& by_row = act.row_entry.empty() ? gathered_ : row_out_;
  by_row.assign(route_rows * hidden, 0.0f);
  size_t row = 0;
  for (int r = 0; r < ranks_; ++r) {
    for (int64_t i = 0; i < act.send_rows[r]; ++i, ++row) {
      const size_t from = kept_begin[r] + static_cast<size_t>(act.send_kept[row]);
      std::memcpy(by_row.data() + static_cast<size_t>(act.send_order[row]) * hidden,
                  recv_.data() + from * hidden, hidden * sizeof(float));
    }
  }
  if (!act.row_entry.empty()) FoldRows(act, row_out_, gathered_);
  const float gate = 1.0f / static_cast<float>(top_k);
  std::vector<float>& out = x_[layer + 1];
  const float* entries = gathered_.data() + static_cast<size_t>(share_token_) * top_k * hidden;
  for (int t = 0; t < tokens_; ++t) {
    const size_t token_row = static_cast<size_t>(t) * hidden;
    CombineRow(hidden, top_k, gate, x.data() + token_row, entries + token_row * top_k,
               out.data() + token_row);
  }
  if (mp_ > 1) {
    KEEL_RETURN_IF_ERROR(AllGatherInMpGroup(out, group_rows_, &times.communication[layer]));
  }
  return Status::Ok();
}

Status RankTrainer::Backward(int layer, StepTimes& times) {
  const int hidden = model_.ffn.hidden;
  const int ffn = model_.ffn.ffn;
  const int top_k = model_.top_k;
  const LayerActivations& act = layers_[layer];
  const float gate = 1.0f / static_cast<float>(top_k);
  // d_x_ holds the gradient at this layer's output; each expert gets gate · d_out.
  const size_t sent = act.send_order.size();
  send_.resize(sent * hidden);
  for (size_t r = 0; r < sent; ++r) {
    const float* d_out = d_x_.data() + TokenOf(act, act.send_order[r]) * hidden;
    for (int i = 0; i < hidden; ++i) send_[r * hidden + i] = gate * d_out[i];
  }
  KEEL_RETURN_IF_ERROR(ExchangeRows<float>(send_, act.send_rows, act.recv_rows, hidden, recv_,
                                           "backward dispatch", &times.communication[layer]));
  const size_t received = act.recv_slot.size();
  {
    CpuTimer timer(&times.expert[layer]);
    expert_out_.resize(received * hidden);
    std::vector<float> scratch(ffn);
    // Every row goes back through its kept row's forward (kernels/condense.h's rule; without
    // condensation each row is its own kept row).
    for (size_t r = 0; r < received; ++r) {
      const int slot = act.recv_slot[r];
      const size_t kept = static_cast<size_t>(act.recv_kept[r]);
      ExpertBackward(ShapeOf(act.local_shards[slot]), Weights(layer, slot),
                     act.recv_x.data() + kept * hidden, act.activation.data() + kept * ffn,
                     recv_.data() + r * hidden, Gradients(layer, slot),
                     expert_out_.data() + r * hidden, scratch.data());
    }
  }
  KEEL_RETURN_IF_ERROR(ExchangeRows<float>(expert_out_, act.recv_rows, act.send_rows, hidden, recv_,
                                           "backward combine", &times.communication[layer]));
  // d_in = d_out + Σ_k dx_k in k order (the residual plus every expert's input gradient; a
  // sharded expert's is the sum of its shards').
  const size_t route_rows = act.row_entry.empty() ? topk_ids_.size() : act.row_entry.size();
  std::vector<float>& by_row = act.row_entry.empty() ? gathered_ : row_out_;
  by_row.assign(route_rows * hidden, 0.0f);
  for (size_t r = 0; r < sent; ++r) {
    std::memcpy(by_row.data() + static_cast<size_t>(act.send_order[r]) * hidden,
                recv_.data() + r * hidden, hidden * sizeof(float));
  }
  if (!act.row_entry.empty()) FoldRows(act, row_out_, gathered_);
  const float* entries = gathered_.data() + static_cast<size_t>(share_token_) * top_k * hidden;
  for (int t = 0; t < tokens_; ++t) {
    float* d = d_x_.data() + static_cast<size_t>(t) * hidden;
    const float* dx = entries + static_cast<size_t>(t) * top_k * hidden;
    for (int i = 0; i < hidden; ++i) {
      float sum = d[i];
      for (int k = 0; k < top_k; ++k) sum += dx[static_cast<size_t>(k) * hidden + i];
      d[i] = sum;
    }
  }
  if (mp_ > 1) {
    KEEL_RETURN_IF_ERROR(AllGatherInMpGroup(d_x_, group_rows_, &times.communication[layer]));
  }
  return Status::Ok();
}

void RankTrainer::FoldRows(const LayerActivations& act, std::span<const float> rows,
                           std::vector<float>& entries) const {
  const size_t hidden = static_cast<size_t>(model_.ffn.hidden);
  entries.assign(topk_ids_.size() * hidden, 0.0f);
  for (size_t r = 0; r < act.row_entry.size(); ++r) {
    float* entry = entries.data() + static_cast<size_t>(act.row_entry[r]) * hidden;
    const float* row = rows.data() + r * hidden;
    const bool first = r == 0 || act.row_entry[r - 1] != act.row_entry[r];
    for (size_t i = 0; i < hidden; ++i) entry[i] = first ? row[i] : entry[i] + row[i];
  }
}

Status RankTrainer::DrawBatch(int64_t step, StepTimes& times) {
  const int hidden = model_.ffn.hidden;
  const SequenceGate* gate = options_.sequences;
  if (gate == nullptr) {
    DrawTokenInputs(model_.seed, rank_, step, x_[0]);
    return Status::Ok();
  }
  // This rank's own sequences, then (with migration) the plan and the moves; the sequences this
  // rank runs are then its own that stay and those it received, in (origin rank, index) order.
  const int per_rank = gate->sequences_per_rank();
  const int length = gate->tokens_per_sequence();
  const size_t ids_per_sequence = static_cast<size_t>(model_.layers) * length * model_.top_k;
  std::vector<std::vector<float>> own_inputs(
      per_rank, std::vector<float>(static_cast<size_t>(length) * hidden));
  for (int i = 0; i < per_rank; ++i) gate->DrawInputs(step, rank_, i, own_inputs[i]);
  struct Local {
    int origin = 0;
    int index = 0;
    const std::vector<float>* inputs = nullptr;
  };
  std::vector<Local> local;
  std::vector<std::vector<float>> received;
  if (options_.migrate_sequences) {
    std::vector<SequenceRouting> routings(per_rank);
    std::vector<int32_t> ids(ids_per_sequence);
    {
      CpuTimer timer(&times.sequences);
      for (int i = 0; i < per_rank; ++i) {
        gate->DrawRouting(step, rank_, i, ids);
        routings[i].tokens = length;
        routings[i].expert_rows = gate->ExpertRows(ids);
      }
    }
    KEEL_RETURN_IF_ERROR(SyncForTiming());
    Result<SequencePlacement> plan = [&] {
      CpuTimer timer(&times.sequences);
      SequencePlanningOptions planning;
      planning.objective = options_.sequence_objective;
      return engine_->PlanSequences(0, routings, planning);
    }();
    if (!plan.ok()) return plan.status().WithContext("PlanSequences");
    KEEL_RETURN_IF_ERROR(MoveSequences(step, *plan, own_inputs, received, times));
    size_t next_received = 0;
    for (size_t j = 0; j < plan->rank.size(); ++j) {
      if (plan->rank[j] != rank_) continue;
      const int origin = plan->origin_rank[j];
      const int index = plan->origin_index[j];
      local.push_back(
          {origin, index, origin == rank_ ? &own_inputs[index] : &received[next_received++]});
    }
  } else {
    for (int i = 0; i < per_rank; ++i) local.push_back({rank_, i, &own_inputs[i]});
  }

  tokens_ = static_cast<int>(local.size()) * length;
  const size_t activations = static_cast<size_t>(tokens_) * hidden;
  for (std::vector<float>& x : x_) x.resize(activations);
  targets_.resize(activations);
  d_x_.resize(activations);
  layer_ids_.assign(model_.layers,
                    std::vector<int32_t>(static_cast<size_t>(tokens_) * model_.top_k));
  std::vector<int32_t> ids(ids_per_sequence);
  const size_t per_layer = static_cast<size_t>(length) * model_.top_k;
  for (size_t s = 0; s < local.size(); ++s) {
    std::copy(local[s].inputs->begin(), local[s].inputs->end(),
              x_[0].begin() + static_cast<ptrdiff_t>(s * length * hidden));
    // The router of the rank that runs the sequence: the same ids wherever it runs.
    gate->DrawRouting(step, local[s].origin, local[s].index, ids);
    for (int l = 0; l < model_.layers; ++l) {
      std::copy_n(ids.begin() + static_cast<ptrdiff_t>(l * per_layer), per_layer,
                  layer_ids_[l].begin() + static_cast<ptrdiff_t>(s * per_layer));
    }
  }
  return Status::Ok();
}

Status RankTrainer::MoveSequences(int64_t step, const SequencePlacement& plan,
                                  const std::vector<std::vector<float>>& own_inputs,
                                  std::vector<std::vector<float>>& received, StepTimes& times) {
  const size_t bytes = own_inputs.empty() ? 0 : own_inputs[0].size() * sizeof(float);
  const int per_rank = static_cast<int>(own_inputs.size());
  std::vector<SequenceMove> moves;
  double sent = 0;
  double arriving = 0;
  for (size_t j = 0; j < plan.rank.size(); ++j) {
    const int origin = plan.origin_rank[j];
    const int destination = plan.rank[j];
    if (origin == destination) continue;
    SequenceMove move;
    move.sequence_id = static_cast<int64_t>(origin) * per_rank + plan.origin_index[j];
    move.src_rank = origin;
    move.dst_rank = destination;
    move.bytes = bytes;
    if (origin == rank_) {
      move.source = reinterpret_cast<const std::byte*>(own_inputs[plan.origin_index[j]].data());
      sent += static_cast<double>(bytes);
    }
    if (destination == rank_) {
      received.emplace_back(own_inputs.empty() ? 0 : own_inputs[0].size());
      move.destination = reinterpret_cast<std::byte*>(received.back().data());
      arriving += static_cast<double>(bytes);
    }
    moves.push_back(move);
  }
  sequences_moved_ = 0;
  for (const SequenceMove& move : moves) {
    if (move.src_rank == rank_) {
      ++sequences_moved_;
      sequence_bytes_ += static_cast<double>(move.bytes);
    }
  }
  if (moves.empty()) return Status::Ok();
  KEEL_RETURN_IF_ERROR(SyncForTiming());
  CpuTimer timer(&times.sequences);
  // The gradients return along the same links after the backward: the links carry both ways.
  times.sequences += 2.0 * LinkSeconds(sent, arriving);
  return MigrateSequences(*options_.sequence_transport, static_cast<uint64_t>(step), moves,
                          options_.config.migration)
      .WithContext("moving sequences");
}

Result<StepMeasurement> RankTrainer::Step(int64_t step) {
  const int layers = model_.layers;
  const int hidden = model_.ffn.hidden;
  StepTimes times;
  times.expert.assign(layers, 0.0);
  times.communication.assign(layers, 0.0);
  std::vector<int64_t> rows(static_cast<size_t>(ranks_) * layers, 0);  // [rank, layer]

  rows_dispatched_ = rows_remote_ = rows_kept_ = sequences_moved_ = 0;
  sequence_bytes_ = all_to_all_bytes_ = group_bytes_ = 0;
  KEEL_RETURN_IF_ERROR(DrawBatch(step, times));
  TeacherTargets(hidden, teacher_, x_[0], targets_);
  std::fill(gradients_.begin(), gradients_.end(), 0);
  for (int l = 0; l < layers; ++l) KEEL_RETURN_IF_ERROR(Forward(step, l, times, rows));

  double loss = 0;
  for (int t = 0; t < tokens_; ++t) {
    const size_t row = static_cast<size_t>(t) * hidden;
    loss += RowLoss(hidden, x_[layers].data() + row, targets_.data() + row, d_x_.data() + row);
  }
  for (int l = layers - 1; l >= 0; --l) KEEL_RETURN_IF_ERROR(Backward(l, times));
  if (device_ != nullptr) {
    for (int l = 0; l < layers; ++l) {
      for (int s = 0; s < local_slots_; ++s) KEEL_RETURN_IF_ERROR(Upload(l, s, kGradients));
    }
  }

  KEEL_RETURN_IF_ERROR(SyncForTiming());
  {
    CpuTimer timer(&times.control);
    KEEL_RETURN_IF_ERROR(engine_->ReduceGradients().WithContext("ReduceGradients"));
  }
  const double global_tokens = static_cast<double>(model_.tokens) * ranks_;
  for (int l = 0; l < layers; ++l) {
    for (const HomeSlot& home : engine_->HomeSlots(l)) {
      if (device_ != nullptr) {
        for (const Region region : {kWeights, kGradients, kOptimizer}) {
          KEEL_RETURN_IF_ERROR(Download(l, home.local_slot, region));
        }
      }
      {
        CpuTimer timer(&times.optimizer);
        const size_t floats = ShapeOf(home.shards).weight_floats();  // a shard's: its slice
        AdamUpdate(model_.adam, step + 1, global_tokens, {Gradients(l, home.local_slot), floats},
                   {Weights(l, home.local_slot), floats},
                   {Optimizer(l, home.local_slot), 2 * floats});
      }
      if (device_ != nullptr) {
        KEEL_RETURN_IF_ERROR(Upload(l, home.local_slot, kWeights));
        KEEL_RETURN_IF_ERROR(Upload(l, home.local_slot, kOptimizer));
      }
    }
  }
  KEEL_RETURN_IF_ERROR(SyncForTiming());
  {
    CpuTimer timer(&times.control);
    KEEL_RETURN_IF_ERROR(engine_->StepEnd().WithContext("StepEnd"));
  }
  const EngineStats stats = engine_->stats();

  // Reduce over ranks: the maxima of the times, the sums of rows and loss.
  std::vector<double> maxima;
  maxima.insert(maxima.end(), times.expert.begin(), times.expert.end());
  maxima.insert(maxima.end(), times.communication.begin(), times.communication.end());
  maxima.push_back(times.control + times.optimizer);
  maxima.push_back(times.route + times.control);
  maxima.push_back(stats.exposed_migration_seconds - exposed_before_);
  maxima.push_back(times.sequences);
  exposed_before_ = stats.exposed_migration_seconds;
  KEEL_RETURN_IF_ERROR(communicator_.AllReduce(maxima, ReduceOp::kMax));
  std::vector<double> sums = {loss,
                              static_cast<double>(rows_dispatched_),
                              static_cast<double>(rows_remote_),
                              static_cast<double>(rows_kept_),
                              static_cast<double>(sequences_moved_),
                              sequence_bytes_,
                              all_to_all_bytes_,
                              group_bytes_};
  KEEL_RETURN_IF_ERROR(communicator_.AllReduce(sums, ReduceOp::kSum));
  KEEL_RETURN_IF_ERROR(communicator_.AllReduce(rows, ReduceOp::kSum));

  StepMeasurement m;
  m.step = step;
  m.loss = sums[0] / (static_cast<double>(model_.tokens) * ranks_);
  m.rows_dispatched = static_cast<int64_t>(sums[1]);
  m.rows_remote = static_cast<int64_t>(sums[2]);
  m.rows_kept = static_cast<int64_t>(sums[3]);
  m.sequences_moved = static_cast<int64_t>(sums[4]);
  m.sequence_bytes = sums[5];
  m.all_to_all_bytes = sums[6];
  m.group_bytes = sums[7];
  for (int l = 0; l < layers; ++l) {
    m.expert_seconds += maxima[l];
    m.communication_seconds += maxima[layers + l];
  }
  m.control_seconds = maxima[2 * layers];
  m.engine_seconds = maxima[2 * layers + 1];
  m.exposed_migration_seconds = maxima[2 * layers + 2];
  m.sequence_seconds = maxima[2 * layers + 3];
  m.communication_seconds += m.sequence_seconds;
  m.parallel_step_seconds =
      m.expert_seconds + m.communication_seconds + m.control_seconds + m.exposed_migration_seconds;
  m.rank_rows.assign(ranks_, 0);
  for (int l = 0; l < layers; ++l) {
    int64_t total = 0;
    int64_t most = 0;
    for (int r = 0; r < ranks_; ++r) {
      const int64_t count = rows[static_cast<size_t>(r) * layers + l];
      m.rank_rows[r] += count;
      total += count;
      most = std::max(most, count);
    }
    m.imbalance +=
        total > 0 ? static_cast<double>(most) * ranks_ / static_cast<double>(total) : 1.0;
  }
  m.imbalance /= layers;
  m.epoch = stats.epoch;
  m.epochs_committed = stats.epochs_committed;
  m.epochs_aborted = stats.epochs_aborted;
  m.migration_in_flight = stats.migration_in_flight;
  m.bytes_moved = stats.bytes_moved;
  return m;
}

// Every rank contributes (layer, expert, shard, shards, weights) of its homes; every rank
// assembles them all, a sharded expert from its shards' slices.
Result<std::vector<float>> RankTrainer::GatherFinalWeights() {
  std::string mine;
  for (int l = 0; l < model_.layers; ++l) {
    for (const HomeSlot& home : engine_->HomeSlots(l)) {
      if (device_ != nullptr) KEEL_RETURN_IF_ERROR(Download(l, home.local_slot, kWeights));
      AppendExpertPiece(l, home.expert, home.shard, home.shards,
                        {Weights(l, home.local_slot), ShapeOf(home.shards).weight_floats()}, mine);
    }
  }
  KEEL_ASSIGN_OR_RETURN(std::vector<std::string> all, communicator_.AllGather(mine));
  return AssembleExpertWeights(model_, all);
}

}  // namespace

Result<RankRunResult> RunRank(const RankRunOptions& options) {
  if (options.communicator == nullptr || options.gate == nullptr) {
    return InvalidArgument("RunRank needs a communicator and a gate");
  }
  if (options.config.strategy.name != "ep") return RunShardedRank(options);
  RankTrainer trainer(options);
  KEEL_RETURN_IF_ERROR(trainer.Init());
  RankRunResult result;
  for (int64_t step = 0; step < options.model.steps; ++step) {
    KEEL_ASSIGN_OR_RETURN(StepMeasurement measurement, trainer.Step(step));
    if (options.on_step) options.on_step(measurement);
    result.steps.push_back(std::move(measurement));
  }
  result.stats = trainer.stats();
  KEEL_ASSIGN_OR_RETURN(result.final_weights, trainer.GatherFinalWeights());
  return result;
}

}  // namespace keel::tools
