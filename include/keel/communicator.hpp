// The collectives the engine runs over whatever the job already has (threads of one process,
// Open MPI, NCCL, or a trainer's own torch.distributed group through this interface), so Keel
// never opens a socket service of its own. Every collective has a timeout: a lost or stalled
// peer is an error the caller can act on, never a hang.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "keel/status.hpp"

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
// One communicator serves one thread at a time: the engine calls it only from the thread that
// calls the engine, so an implementation may call back into its host language there.
//
// Implement this interface to run the engine over another runtime's collectives (the Python
// package's keel.torch does so over a torch.distributed group).
class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // "local", "mpi", "nccl", or the name an implementation outside Keel gives itself.
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

  // AllToAllV for an exchange whose every size both sides already know (the engine's slot
  // exchanges derive them from one plan on every rank), so no sizes travel before the bytes.
  // send and send_bytes as for AllToAllV; recv_bytes: [size] bytes this rank receives from each
  // rank, which must equal what that rank sends it; recv: exactly their sum, filled back to back
  // in rank order. A rank that sends another size than its receiver expects is an
  // InvalidArgument error naming both ranks and both sizes, on the receiving rank at least (the
  // local backend reports it on every rank; under MPI a slice longer than expected is MPI's
  // truncation error instead); recv's contents are then undefined. The default runs AllToAllV
  // and compares the sizes that arrived; a backend overrides it to skip the size exchange (local
  // and MPI do).
  virtual Status AllToAllVKnownSizes(std::span<const std::byte> send,
                                     std::span<const size_t> send_bytes, std::span<std::byte> recv,
                                     std::span<const size_t> recv_bytes);

  // Whether AllToAllVDevice moves device memory itself (NCCL, or a trainer's process group over
  // GPUs), so the engine exchanges device slot buffers without staging them through host memory.
  virtual bool MovesDeviceMemory() const { return false; }

  // AllToAllVKnownSizes between device buffers: send [sum of send_bytes] and recv [sum of
  // recv_bytes] bytes are device memory of the GPU this rank runs on (the engine allocates them
  // from its DeviceMemory), laid out as AllToAllVKnownSizes lays out its host buffers. The engine
  // calls it only when MovesDeviceMemory() is true, from the thread that calls the engine, after
  // every device operation that wrote send has completed. Returns once recv holds the data and
  // send may be reused (the caller's next device operations, on streams of their own, read recv).
  // Sizes that differ between ranks need not be named here: with NCCL they show as the backend's
  // error or as a timeout. Default: Unimplemented naming the communicator.
  virtual Status AllToAllVDevice(const std::byte* send, std::span<const size_t> send_bytes,
                                 std::byte* recv, std::span<const size_t> recv_bytes);

  double timeout_seconds() const { return timeout_seconds_; }
  // <= 0: wait forever. The engine sets engine.collective_timeout_seconds (config) at creation.
  void set_timeout_seconds(double seconds) { timeout_seconds_ = seconds; }

 private:
  double timeout_seconds_ = 120.0;
};

// A duplicate of MPI_COMM_WORLD (MPI already initialized by the caller, and still initialized
// whenever the communicator is used), so Keel's traffic never mixes with the application's.
// Unimplemented in builds without MPI (keel::kWithMpi in keel/version.hpp).
Result<std::unique_ptr<Communicator>> CreateMpiCommunicator();

// An NCCL communicator on CUDA device `device` with the ranks of `bootstrap`, which carries the
// NCCL unique id from rank 0 to the others; every rank of `bootstrap` calls it. Host data is
// staged through device buffers on a stream of its own; AllToAllVDevice moves device memory of
// `device` directly. Unimplemented in builds without NCCL (keel::kWithNccl); FailedPrecondition
// without a usable GPU.
Result<std::unique_ptr<Communicator>> CreateNcclCommunicator(Communicator& bootstrap, int device);

}  // namespace keel
