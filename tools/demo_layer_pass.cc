// One MoE layer of a `keel demo` rank (tools/demo_rank_trainer.h). Forward: Route, dispatch the
// (token, k) rows sorted by (rank, slot, token, k), run each local slot's rows, send the outputs
// back, combine in k order. Backward over the same routing, accumulating int64 fixed-point
// weight gradients in the slots' gradient buffers. The rows of one slot may be condensed before
// the dispatch (Luffy), and MP groups gather their members' rows first.
#include <algorithm>
#include <cstring>
#include <string>

#include "kernels/condense.h"
#include "tools/demo_rank_trainer.h"

namespace keel::tools {

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

}  // namespace keel::tools
