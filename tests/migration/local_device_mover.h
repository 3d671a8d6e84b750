// A DeviceMover for tests without a GPU that moves real bytes with NCCL's semantics, so the
// device transport's protocol is tested for what NCCL needs from it: no tags (the n-th send from
// a to b meets the n-th receive on b from a: the k-th message of a direction travels under tag
// k of a LocalFabric that only movers use, and a size mismatch is an error there), one group at a
// time per rank (a group's operations are posted only once the previous group completed, like
// kernels on one stream), and the operations of one group posted together. A protocol that
// issued operations in different orders on the two ends would move wrong bytes or fail on sizes;
// one that could close a cycle of waits would hang, and the tests' deadlines would catch it.
#pragma once

#include <atomic>
#include <cstddef>
#include <deque>
#include <memory>
#include <vector>

#include "migration/device_transport.h"
#include "migration/transport_local.h"

namespace keel::testing {

class LocalDeviceMover final : public DeviceMover {
 public:
  LocalDeviceMover(LocalFabric& data_fabric, int rank)
      : data_(data_fabric.Connect(rank)),
        sent_(data_fabric.num_ranks(), 0),
        received_(data_fabric.num_ranks(), 0) {}

  ~LocalDeviceMover() override { Abort(); }

  std::string_view name() const override { return "device"; }

  Status Launch(std::span<const DeviceOp> ops) override {
    if (aborted_) return Aborted("local device mover: aborted");
    groups_.emplace_back(ops.begin(), ops.end());
    ++launched_groups;
    return Advance();
  }

  Result<uint64_t> Completed() override {
    if (aborted_) return Aborted("local device mover: aborted");
    KEEL_RETURN_IF_ERROR(Advance());
    return completed_;
  }

  void Abort() override {
    aborted_ = true;
    for (RequestId id : posted_) data_->Cancel(id);
    posted_.clear();
    groups_.clear();
  }

  // What went through this mover, for tests to check that device bytes took the device path.
  std::atomic<size_t> bytes_sent{0};
  std::atomic<size_t> launched_groups{0};

 private:
  // Posts the head group once the one before it completed; collects its completions.
  Status Advance() {
    while (!groups_.empty()) {
      if (!head_posted_) {
        for (const DeviceOp& op : groups_.front()) {
          Result<RequestId> posted =
              op.send ? data_->PostSend(op.peer, sent_[op.peer]++, op.data, op.bytes)
                      : data_->PostRecv(op.peer, received_[op.peer]++, op.data, op.bytes);
          KEEL_RETURN_IF_ERROR(posted.status());
          posted_.push_back(*posted);
          if (op.send) bytes_sent += op.bytes;
        }
        head_posted_ = true;
      }
      for (size_t i = 0; i < posted_.size();) {
        std::optional<Status> done = data_->Test(posted_[i]);
        if (!done) {
          ++i;
          continue;
        }
        posted_.erase(posted_.begin() + static_cast<std::ptrdiff_t>(i));
        if (!done->ok()) return Status(done->code(), "local device mover: " + done->message());
      }
      if (!posted_.empty()) return Status::Ok();
      groups_.pop_front();
      head_posted_ = false;
      ++completed_;
    }
    return Status::Ok();
  }

  std::unique_ptr<Transport> data_;
  std::vector<uint64_t> sent_;      // [peer] messages sent so far: the next one's tag
  std::vector<uint64_t> received_;  // [peer] messages received so far
  std::deque<std::vector<DeviceOp>> groups_;
  bool head_posted_ = false;
  std::vector<RequestId> posted_;  // the head group's requests still open
  uint64_t completed_ = 0;
  bool aborted_ = false;
};

}  // namespace keel::testing
