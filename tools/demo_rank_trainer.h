// The trainer of one `keel demo` rank (tools/demo_trainer.h's RunRank), shared by the files that
// implement it: demo_trainer.cc sets it up and runs a step (the batch, Luffy's sequence moves,
// ReduceGradients, Adam on the homes, StepEnd, the measurement), demo_layer_pass.cc runs one MoE
// layer's forward and backward (dispatch, the local slots' experts, combine). Internal to them.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string_view>
#include <utility>
#include <vector>

#include "keel/device_memory.hpp"
#include "keel/engine.hpp"
#include "keel/status.hpp"
#include "tools/demo_trainer.h"

namespace keel::tools {

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
inline size_t EntryOf(const LayerActivations& act, size_t row) {
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

}  // namespace keel::tools
