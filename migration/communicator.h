// The collectives the engine and migration run over whatever the job already has — threads of one
// process, Open MPI, or NCCL — so Keel never opens a socket service of its own. Every collective
// has a timeout: a lost or stalled peer is an error the caller can act on, never a hang.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace keel {

enum class ReduceOp { kSum, kMin, kMax };

// "sum", "min" or "max".
std::string_view ReduceOpName(ReduceOp op);

// Collectives: every rank calls them in the same order with matching arguments. A collective
// that does not complete within timeout_seconds() returns DeadlineExceeded naming the collective
// (and, where the backend knows it, the ranks that never arrived); after that the communicator
// is broken and every later call fails at once with Aborted, because the ranks no longer agree
// on which collective comes next. Arguments that cannot match (a length that differs between
// ranks, a root out of range) are InvalidArgument errors naming the argument and its value.
// One communicator serves one thread at a time.
class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // "local", "mpi" or "nccl".
  virtual std::string_view name() const = 0;

  // Every rank contributes `mine`; returns [size] contributions in rank order.
  virtual Result<std::vector<std::string>> AllGather(std::string_view mine) = 0;
  virtual Status Barrier() = 0;

  // Element-wise reduction over ranks, in place; every rank passes the same length. Sums are
  // folded in rank order (rank 0 first), so the result is the same on every rank and every run.
  virtual Status AllReduce(std::span<int64_t> values, ReduceOp op) = 0;
  virtual Status AllReduce(std::span<double> values, ReduceOp op) = 0;

  // `bytes` of rank `root` replace `bytes` on every other rank (any size).
  virtual Status Broadcast(std::string& bytes, int root) = 0;

  // send: the bytes for every rank back to back in rank order; send_bytes: [size] bytes for each
  // rank. recv gets what every rank sent to this one, back to back in rank order, and
  // recv_bytes [size] how many bytes came from each (both resized by the call).
  virtual Status AllToAllV(std::span<const std::byte> send, std::span<const size_t> send_bytes,
                           std::vector<std::byte>& recv, std::vector<size_t>& recv_bytes) = 0;

  double timeout_seconds() const { return timeout_seconds_; }
  // <= 0: wait forever.
  void set_timeout_seconds(double seconds) { timeout_seconds_ = seconds; }

 private:
  double timeout_seconds_ = 120.0;
};

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

// A duplicate of MPI_COMM_WORLD (MPI already initialized by the caller, and still initialized
// whenever the communicator is used), so Keel's traffic never mixes with the application's.
// Defined only in builds with KEEL_WITH_MPI (keel::kWithMpi); communicator_mpi.cc.
Result<std::unique_ptr<Communicator>> CreateMpiCommunicator();

// An NCCL communicator on CUDA device `device` with the ranks of `bootstrap`, which carries the
// NCCL unique id from rank 0 to the others; every rank of `bootstrap` calls it. Host data is
// staged through device buffers on a stream of its own. Defined only in builds with
// KEEL_WITH_NCCL (keel::kWithNccl); communicator_nccl.cc.
Result<std::unique_ptr<Communicator>> CreateNcclCommunicator(Communicator& bootstrap, int device);

// Shared by the backends (and by communicators written for tests), so every backend checks
// arguments and words its errors the same way.
namespace collective {

// InvalidArgument unless send_bytes has [size] entries that add up to send.size().
Status CheckAllToAllV(std::string_view backend, int size, size_t send_size,
                      std::span<const size_t> send_bytes);
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
