// The communicator backends behind include/keel/communicator.hpp's interface: ranks as threads of
// one process (local) and NCCL, plus the argument checks, error wording and rank-order folds every
// backend shares. The MPI and NCCL backends' factories are public (keel/communicator.hpp).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "keel/communicator.hpp"
#include "keel/status.hpp"

namespace keel {

// Ranks as threads of one process: Join(r) hands out rank r's communicator. Collectives copy
// straight between the ranks' own buffers (each rank reads only what is meant for it), so the
// engine's per-step all-to-all costs one memcpy per slice. The communicators share the group's
// state, so they may outlive the group object.
class LocalCommunicatorGroup {
 public:
  explicit LocalCommunicatorGroup(int size);
  ~LocalCommunicatorGroup();
  LocalCommunicatorGroup(const LocalCommunicatorGroup&) = delete;
  LocalCommunicatorGroup& operator=(const LocalCommunicatorGroup&) = delete;

  // Rank `rank`'s communicator; nullptr unless rank is in [0, size). Join each rank once.
  std::unique_ptr<Communicator> Join(int rank);

 private:
  // Where the ranks meet; communicator.cc.
  class Rendezvous;
  friend class LocalCommunicator;

  std::shared_ptr<Rendezvous> rendezvous_;
};

// A communicator that hands every collective to `inner`, which it owns, with its own timeout:
// the base of wrappers that add something to a communicator (LocalGroup's membership, tests that
// count calls). A subclass overrides what it adds to and calls the base for the collective.
class ForwardingCommunicator : public Communicator {
 public:
  explicit ForwardingCommunicator(std::unique_ptr<Communicator> inner) : inner_(std::move(inner)) {}

  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  std::string_view name() const override { return inner_->name(); }
  Result<std::vector<std::string>> AllGather(std::string_view mine) override {
    return Inner().AllGather(mine);
  }
  Status Barrier() override { return Inner().Barrier(); }
  Status AllReduce(std::span<int64_t> values, ReduceOp op) override {
    return Inner().AllReduce(values, op);
  }
  Status AllReduce(std::span<double> values, ReduceOp op) override {
    return Inner().AllReduce(values, op);
  }
  Status Broadcast(std::string& bytes, int root) override { return Inner().Broadcast(bytes, root); }
  Status AllToAllV(std::span<const std::byte> send, std::span<const size_t> send_bytes,
                   std::vector<std::byte>& recv, std::vector<size_t>& recv_bytes) override {
    return Inner().AllToAllV(send, send_bytes, recv, recv_bytes);
  }
  Status AllToAllVKnownSizes(std::span<const std::byte> send, std::span<const size_t> send_bytes,
                             std::span<std::byte> recv,
                             std::span<const size_t> recv_bytes) override {
    return Inner().AllToAllVKnownSizes(send, send_bytes, recv, recv_bytes);
  }
  bool MovesDeviceMemory() const override { return inner_->MovesDeviceMemory(); }
  Status AllToAllVDevice(const std::byte* send, std::span<const size_t> send_bytes, std::byte* recv,
                         std::span<const size_t> recv_bytes) override {
    return Inner().AllToAllVDevice(send, send_bytes, recv, recv_bytes);
  }

 protected:
  // The wrapped communicator, waiting with this object's timeout (the one the engine sets).
  Communicator& Inner() {
    inner_->set_timeout_seconds(timeout_seconds());
    return *inner_;
  }

 private:
  std::unique_ptr<Communicator> inner_;
};

// Shared by the backends (and by communicators written for tests), so every backend checks
// arguments and words its errors the same way.
namespace collective {

// InvalidArgument unless send_bytes has [size] entries that add up to send.size().
Status CheckAllToAllV(std::string_view backend, int size, size_t send_size,
                      std::span<const size_t> send_bytes);
// The same for AllToAllVKnownSizes, and for its recv_bytes against recv.size().
Status CheckAllToAllVKnownSizes(std::string_view backend, int size, size_t send_size,
                                std::span<const size_t> send_bytes, size_t recv_size,
                                std::span<const size_t> recv_bytes);
// InvalidArgument unless send_bytes and recv_bytes of AllToAllVDevice have [size] entries.
Status CheckAllToAllVDevice(std::string_view backend, int size, std::span<const size_t> send_bytes,
                            std::span<const size_t> recv_bytes);
// InvalidArgument: "<backend> AllToAllVKnownSizes: rank <from> sends <sent> bytes to rank <to>,
// which expects <expected> (its recv_bytes[<from>])".
Status SizeMismatch(std::string_view backend, int from, int to, size_t sent, size_t expected);
// InvalidArgument unless root is in [0, size).
Status CheckRoot(std::string_view backend, int size, int root);
// "<collective> timed out after 2.0 s on rank 1: ranks 3 never arrived" (DeadlineExceeded);
// the part after the colon only when `missing_ranks` is known (non-empty).
Status TimedOut(std::string_view collective, double seconds, int rank,
                std::span<const int> missing_ranks);
// Aborted: "<backend> communicator is broken by an earlier failure (<cause>)".
Status Broken(std::string_view backend, const Status& cause);

// Folds `gathered` ([size, n], rank-major) over ranks in rank order into `out` ([n]). Integer
// sums wrap around instead of overflowing.
void FoldInRankOrder(std::span<const int64_t> gathered, ReduceOp op, std::span<int64_t> out);
void FoldInRankOrder(std::span<const double> gathered, ReduceOp op, std::span<double> out);

}  // namespace collective
}  // namespace keel
