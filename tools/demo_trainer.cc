// One rank of `keel demo`: the token gate, and the training loop over the engine. A step draws
// the batch (in Luffy's runs a rank's tokens are sequences, which may move to other ranks before
// the first layer), runs every layer's forward and, in reverse order, its backward
// (demo_layer_pass.cc), then ReduceGradients, Adam on the homes and StepEnd, and reduces the
// step's measurement over the ranks.
#include "tools/demo_trainer.h"

#include <time.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <utility>

#include "engine/engine_internal.h"
#include "migration/sequence_migration.h"
#include "tools/demo_rank_trainer.h"
#include "tools/demo_strategies.h"

namespace keel::tools {

double ThreadCpuSeconds() {
  timespec now{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &now);
  return static_cast<double>(now.tv_sec) + static_cast<double>(now.tv_nsec) * 1e-9;
}

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
