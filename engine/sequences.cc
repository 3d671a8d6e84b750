// Engine::Impl::PlanSequences: gathers every rank's sequences (tokens and rows per expert) and
// runs the sequence planner on the placements in force, so every rank gets the same plan.
#include <cmath>
#include <cstring>
#include <string>

#include "engine/engine_impl.h"
#include "placement/sequence_planner.h"

namespace keel {
namespace {

// This rank's sequences as bytes for the all-gather: per sequence its tokens, then its rows.
std::string Encode(std::span<const SequenceRouting> sequences) {
  std::string bytes;
  for (const SequenceRouting& sequence : sequences) {
    bytes.append(reinterpret_cast<const char*>(&sequence.tokens), sizeof(int64_t));
    bytes.append(reinterpret_cast<const char*>(sequence.expert_rows.data()),
                 sequence.expert_rows.size() * sizeof(int32_t));
  }
  return bytes;
}

}  // namespace

Result<SequencePlacement> Engine::Impl::PlanSequences(int first_layer,
                                                      std::span<const SequenceRouting> sequences,
                                                      const SequencePlanningOptions& options) {
  const int experts = options_.num_experts;
  // Checks every rank can make alone; they are agreed on below, so a bad rank fails them all.
  Status local = Status::Ok();
  size_t row = 0;
  if (first_layer < 0 || first_layer >= options_.num_layers) {
    local = InvalidArgument("PlanSequences: first_layer " + std::to_string(first_layer) +
                            " is not a layer in [0, " + std::to_string(options_.num_layers) + ")");
  } else if (!sequences.empty()) {
    row = sequences[0].expert_rows.size();
    const size_t layers = row / static_cast<size_t>(experts);
    if (row == 0 || row % experts != 0 ||
        first_layer + layers > static_cast<size_t>(options_.num_layers)) {
      local = InvalidArgument("PlanSequences: sequence 0 has " + std::to_string(row) +
                              " expert_rows; expected a positive multiple of num_experts " +
                              std::to_string(experts) + " covering layers from " +
                              std::to_string(first_layer) + " to at most " +
                              std::to_string(options_.num_layers - 1));
    }
    for (size_t l = first_layer; local.ok() && l < first_layer + layers; ++l) {
      if (shards_[l].sharded()) {
        local = FailedPrecondition("PlanSequences: layer " + std::to_string(l) +
                                   " has sharded experts, which sequence plans do not model");
      }
    }
  }
  for (size_t s = 0; local.ok() && s < sequences.size(); ++s) {
    const SequenceRouting& sequence = sequences[s];
    if (sequence.expert_rows.size() != row) {
      local = InvalidArgument("PlanSequences: sequence " + std::to_string(s) + " has " +
                              std::to_string(sequence.expert_rows.size()) +
                              " expert_rows, sequence 0 has " + std::to_string(row));
    } else if (sequence.tokens < 0) {
      local = InvalidArgument("PlanSequences: sequence " + std::to_string(s) + " has tokens " +
                              std::to_string(sequence.tokens));
    }
    for (size_t i = 0; local.ok() && i < row; ++i) {
      if (sequence.expert_rows[i] < 0) {
        local = InvalidArgument("PlanSequences: sequence " + std::to_string(s) + " expert_rows[" +
                                std::to_string(i) +
                                "] = " + std::to_string(sequence.expert_rows[i]) + " is negative");
      }
    }
  }
  KEEL_RETURN_IF_ERROR(AgreeOnCall(CollectiveCall::kPlanSequences, first_layer, local));
  // [valid: 1 byte][row size: 8 bytes][sequences]: a rank that failed its checks says so.
  std::string mine;
  mine.push_back(local.ok() ? 1 : 0);
  if (local.ok()) {
    const uint64_t row_size = row;
    mine.append(reinterpret_cast<const char*>(&row_size), sizeof(row_size));
    mine += Encode(sequences);
  }
  KEEL_ASSIGN_OR_RETURN(const std::vector<std::string> all, communicator_.AllGather(mine));
  KEEL_RETURN_IF_ERROR(local);
  // Every rank's rows must cover the same layers (ranks without sequences say nothing).
  size_t agreed_row = 0;
  for (int r = 0; r < num_ranks_; ++r) {
    const std::string& part = all[r];
    if (part.empty() || part[0] == 0) {
      return InvalidArgument("PlanSequences: rank " + std::to_string(r) +
                             " passed invalid sequences");
    }
    uint64_t part_row = 0;
    std::memcpy(&part_row, part.data() + 1, sizeof(part_row));
    if (part.size() > 1 + sizeof(part_row) && part_row != 0) {
      if (agreed_row != 0 && part_row != agreed_row) {
        return InvalidArgument("PlanSequences: ranks disagree on the planned layers (" +
                               std::to_string(agreed_row / experts) + " and " +
                               std::to_string(part_row / experts) + " layers)");
      }
      agreed_row = part_row;
    }
  }

  SequencePlacement answer;
  std::vector<SequenceTraffic> batch;
  const size_t record = sizeof(int64_t) + agreed_row * sizeof(int32_t);
  for (int r = 0; r < num_ranks_; ++r) {
    const std::string& part = all[r];
    const size_t header = 1 + sizeof(uint64_t);
    int32_t index = 0;
    for (size_t at = header; record > sizeof(int64_t) && at + record <= part.size();
         at += record, ++index) {
      SequenceTraffic sequence;
      sequence.origin_rank = r;
      std::memcpy(&sequence.tokens, part.data() + at, sizeof(int64_t));
      sequence.expert_rows.resize(agreed_row);
      for (size_t i = 0; i < agreed_row; ++i) {
        int32_t rows = 0;
        std::memcpy(&rows, part.data() + at + sizeof(int64_t) + i * sizeof(int32_t), sizeof(rows));
        sequence.expert_rows[i] = rows;
      }
      batch.push_back(std::move(sequence));
      answer.origin_rank.push_back(r);
      answer.origin_index.push_back(index);
    }
  }
  if (batch.empty()) return answer;
  const size_t layers = agreed_row / static_cast<size_t>(experts);
  const std::span<const Placement> planned(placements_.data() + first_layer, layers);
  SequencePlanOptions plan_options;
  plan_options.max_token_imbalance = options.max_token_imbalance;
  plan_options.move_bytes_per_token = options.move_bytes_per_token;
  plan_options.objective = options.objective == SequencePlanObjective::kTraffic
                               ? SequenceObjective::kLinkTime
                               : SequenceObjective::kStepTime;
  KEEL_ASSIGN_OR_RETURN(const SequencePlan plan,
                        keel::PlanSequences(planned, batch, context_->cost, plan_options));
  answer.rank.assign(plan.rank.begin(), plan.rank.end());
  answer.used = plan.used;
  answer.moved_sequences = plan.moved_sequences;
  answer.moved_bytes = plan.moved_bytes;
  answer.seconds_before = plan.seconds_before;
  answer.seconds_after = plan.seconds_after;
  return answer;
}

}  // namespace keel
