// The MPI backend: nonblocking collectives on a duplicate of MPI_COMM_WORLD, polled with MPI_Test
// until they complete or the timeout passes. MPI cannot cancel a collective, so a timed-out one
// stays posted: every buffer MPI may still touch is owned here (never the caller's), and the
// communicator refuses all later calls.
#include <mpi.h>

#include <chrono>
#include <climits>
#include <cstring>
#include <mutex>
#include <numeric>
#include <thread>

#include "comm/communicator.h"

namespace keel {
namespace {

using Clock = std::chrono::steady_clock;

constexpr std::string_view kBackend = "mpi";

Status MpiError(std::string_view call, int code) {
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  MPI_Error_string(code, text, &length);
  return Internal(std::string(call) + " failed: " + std::string(text, length));
}

bool MpiFinalized() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  return finalized != 0;
}

MPI_Op ToMpi(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return MPI_SUM;
    case ReduceOp::kMin:
      return MPI_MIN;
    case ReduceOp::kMax:
      return MPI_MAX;
  }
  return MPI_OP_NULL;
}

// MPI counts and displacements are int.
Status CheckCount(std::string_view what, size_t count) {
  if (count <= static_cast<size_t>(INT_MAX)) return Status::Ok();
  return InvalidArgument(std::string(kBackend) + " " + std::string(what) + " " +
                         std::to_string(count) + " exceeds MPI's int count limit " +
                         std::to_string(INT_MAX));
}

// Every buffer a posted request reads or writes. After a timeout MPI may still use them, so they
// live as long as the request might.
struct Staging {
  std::vector<int64_t> header;  // agreement values, reduced with MPI_MAX
  std::vector<int64_t> counts_out;
  std::vector<int64_t> counts_in;
  std::vector<int64_t> int64s;
  std::vector<double> doubles_out;
  std::vector<double> doubles_in;
  std::vector<std::byte> bytes_out;
  std::vector<std::byte> bytes_in;
  std::vector<int> send_counts, send_displs, recv_counts, recv_displs;
};

// Buffers of collectives abandoned by a timeout, kept for the life of the process: a late peer
// may still complete the collective into them, and MPI cannot cancel it.
void Park(std::unique_ptr<Staging> staging) {
  static std::mutex mutex;
  static auto* parked = new std::vector<std::unique_ptr<Staging>>();
  std::lock_guard<std::mutex> lock(mutex);
  parked->push_back(std::move(staging));
}

class MpiCommunicator final : public Communicator {
 public:
  explicit MpiCommunicator(MPI_Comm comm) : comm_(comm), staging_(std::make_unique<Staging>()) {
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
  }

  ~MpiCommunicator() override {
    // After MPI_Finalize the duplicate and any posted request are gone with MPI itself.
    if (MpiFinalized()) return;
    if (pending_ != MPI_REQUEST_NULL) {
      int done = 0;
      if (MPI_Test(&pending_, &done, MPI_STATUS_IGNORE) != MPI_SUCCESS || !done) {
        Park(std::move(staging_));
      }
    }
    MPI_Comm_free(&comm_);
  }

  MpiCommunicator(const MpiCommunicator&) = delete;
  MpiCommunicator& operator=(const MpiCommunicator&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string_view name() const override { return kBackend; }

  Result<std::vector<std::string>> AllGather(std::string_view mine) override {
    constexpr std::string_view kName = "AllGather";
    KEEL_RETURN_IF_ERROR(Usable());
    KEEL_RETURN_IF_ERROR(CheckCount("AllGather: mine.size()", mine.size()));
    Staging& s = *staging_;
    s.counts_out.assign(1, static_cast<int64_t>(mine.size()));
    s.counts_in.resize(size_);
    KEEL_RETURN_IF_ERROR(Complete(kName, "MPI_Iallgather", [&](MPI_Request* request) {
      return MPI_Iallgather(s.counts_out.data(), 1, MPI_INT64_T, s.counts_in.data(), 1, MPI_INT64_T,
                            comm_, request);
    }));
    // Every rank sees the same lengths, so every rank reaches the same verdict.
    const int64_t total = std::accumulate(s.counts_in.begin(), s.counts_in.end(), int64_t{0});
    KEEL_RETURN_IF_ERROR(CheckCount("AllGather: total bytes", static_cast<size_t>(total)));
    s.recv_counts.resize(size_);
    s.recv_displs.resize(size_);
    for (int r = 0; r < size_; ++r) s.recv_counts[r] = static_cast<int>(s.counts_in[r]);
    std::exclusive_scan(s.recv_counts.begin(), s.recv_counts.end(), s.recv_displs.begin(), 0);
    s.bytes_out.resize(mine.size());
    std::copy(mine.begin(), mine.end(), reinterpret_cast<char*>(s.bytes_out.data()));
    s.bytes_in.resize(static_cast<size_t>(total));
    KEEL_RETURN_IF_ERROR(Complete(kName, "MPI_Iallgatherv", [&](MPI_Request* request) {
      return MPI_Iallgatherv(s.bytes_out.data(), static_cast<int>(mine.size()), MPI_BYTE,
                             s.bytes_in.data(), s.recv_counts.data(), s.recv_displs.data(),
                             MPI_BYTE, comm_, request);
    }));
    std::vector<std::string> all(size_);
    for (int r = 0; r < size_; ++r) {
      all[r].assign(reinterpret_cast<const char*>(s.bytes_in.data()) + s.recv_displs[r],
                    s.recv_counts[r]);
    }
    return all;
  }

  Status Barrier() override {
    KEEL_RETURN_IF_ERROR(Usable());
    return Complete("Barrier", "MPI_Ibarrier",
                    [&](MPI_Request* request) { return MPI_Ibarrier(comm_, request); });
  }

  Status AllReduce(std::span<int64_t> values, ReduceOp op) override {
    constexpr std::string_view kName = "AllReduce";
    KEEL_RETURN_IF_ERROR(Usable());
    KEEL_RETURN_IF_ERROR(CheckCount("AllReduce: values.size()", values.size()));
    KEEL_RETURN_IF_ERROR(AgreeOnReduce(values.size(), op));
    // Integer sums are exact (wrapping) in any order, so MPI's own reduction is deterministic.
    Staging& s = *staging_;
    s.int64s.assign(values.begin(), values.end());
    KEEL_RETURN_IF_ERROR(Complete(kName, "MPI_Iallreduce", [&](MPI_Request* request) {
      return MPI_Iallreduce(MPI_IN_PLACE, s.int64s.data(), static_cast<int>(values.size()),
                            MPI_INT64_T, ToMpi(op), comm_, request);
    }));
    std::copy(s.int64s.begin(), s.int64s.end(), values.begin());
    return Status::Ok();
  }

  Status AllReduce(std::span<double> values, ReduceOp op) override {
    constexpr std::string_view kName = "AllReduce";
    KEEL_RETURN_IF_ERROR(Usable());
    KEEL_RETURN_IF_ERROR(CheckCount("AllReduce: values.size()", values.size()));
    KEEL_RETURN_IF_ERROR(AgreeOnReduce(values.size(), op));
    Staging& s = *staging_;
    s.doubles_out.assign(values.begin(), values.end());
    const int count = static_cast<int>(values.size());
    if (op != ReduceOp::kSum) {
      // min and max are exact in any order.
      KEEL_RETURN_IF_ERROR(Complete(kName, "MPI_Iallreduce", [&](MPI_Request* request) {
        return MPI_Iallreduce(MPI_IN_PLACE, s.doubles_out.data(), count, MPI_DOUBLE, ToMpi(op),
                              comm_, request);
      }));
      std::copy(s.doubles_out.begin(), s.doubles_out.end(), values.begin());
      return Status::Ok();
    }
    // MPI does not promise the order of a floating-point sum; gather and fold in rank order so
    // the bits are the same on every rank and every run.
    s.doubles_in.resize(values.size() * static_cast<size_t>(size_));
    KEEL_RETURN_IF_ERROR(Complete(kName, "MPI_Iallgather", [&](MPI_Request* request) {
      return MPI_Iallgather(s.doubles_out.data(), count, MPI_DOUBLE, s.doubles_in.data(), count,
                            MPI_DOUBLE, comm_, request);
    }));
    collective::FoldInRankOrder(s.doubles_in, op, values);
    return Status::Ok();
  }

  Status Broadcast(std::string& bytes, int root) override {
    constexpr std::string_view kName = "Broadcast";
    KEEL_RETURN_IF_ERROR(Usable());
    KEEL_RETURN_IF_ERROR(collective::CheckRoot(kBackend, size_, root));
    // One small reduction both checks that every rank names the same root and carries the
    // root's size to the others (only the root contributes a size >= 0).
    Staging& s = *staging_;
    s.header = {root, -root, rank_ == root ? static_cast<int64_t>(bytes.size()) : -1};
    KEEL_RETURN_IF_ERROR(Complete(kName, "MPI_Iallreduce", [&](MPI_Request* request) {
      return MPI_Iallreduce(MPI_IN_PLACE, s.header.data(), 3, MPI_INT64_T, MPI_MAX, comm_, request);
    }));
    if (s.header[0] != root || -s.header[1] != root) {
      return InvalidArgument("mpi Broadcast: root differs between ranks (" +
                             std::to_string(-s.header[1]) + " to " + std::to_string(s.header[0]) +
                             "; " + std::to_string(root) + " on rank " + std::to_string(rank_) +
                             ")");
    }
    const size_t length = static_cast<size_t>(s.header[2]);
    KEEL_RETURN_IF_ERROR(CheckCount("Broadcast: bytes.size()", length));
    s.bytes_in.resize(length);
    if (rank_ == root)
      std::copy(bytes.begin(), bytes.end(), reinterpret_cast<char*>(s.bytes_in.data()));
    KEEL_RETURN_IF_ERROR(Complete(kName, "MPI_Ibcast", [&](MPI_Request* request) {
      return MPI_Ibcast(s.bytes_in.data(), static_cast<int>(length), MPI_BYTE, root, comm_,
                        request);
    }));
    if (rank_ != root) bytes.assign(reinterpret_cast<const char*>(s.bytes_in.data()), length);
    return Status::Ok();
  }

  Status AllToAllV(std::span<const std::byte> send, std::span<const size_t> send_bytes,
                   std::vector<std::byte>& recv, std::vector<size_t>& recv_bytes) override {
    constexpr std::string_view kName = "AllToAllV";
    KEEL_RETURN_IF_ERROR(Usable());
    KEEL_RETURN_IF_ERROR(collective::CheckAllToAllV(kBackend, size_, send.size(), send_bytes));
    // The send total bounds every count and displacement.
    KEEL_RETURN_IF_ERROR(CheckCount("AllToAllV: send.size()", send.size()));
    Staging& s = *staging_;
    s.counts_out.assign(send_bytes.begin(), send_bytes.end());
    s.counts_in.resize(size_);
    KEEL_RETURN_IF_ERROR(Complete(kName, "MPI_Ialltoall", [&](MPI_Request* request) {
      return MPI_Ialltoall(s.counts_out.data(), 1, MPI_INT64_T, s.counts_in.data(), 1, MPI_INT64_T,
                           comm_, request);
    }));
    const int64_t total = std::accumulate(s.counts_in.begin(), s.counts_in.end(), int64_t{0});
    if (Status status = CheckCount("AllToAllV: bytes received", static_cast<size_t>(total));
        !status.ok()) {
      // Only this rank knows; the others go on to the exchange without it.
      broken_ = status;
      return status;
    }
    s.send_counts.resize(size_);
    s.send_displs.resize(size_);
    s.recv_counts.resize(size_);
    s.recv_displs.resize(size_);
    for (int r = 0; r < size_; ++r) {
      s.send_counts[r] = static_cast<int>(send_bytes[r]);
      s.recv_counts[r] = static_cast<int>(s.counts_in[r]);
    }
    std::exclusive_scan(s.send_counts.begin(), s.send_counts.end(), s.send_displs.begin(), 0);
    std::exclusive_scan(s.recv_counts.begin(), s.recv_counts.end(), s.recv_displs.begin(), 0);
    // A copy, not the caller's buffer: after a timeout MPI may still read it.
    s.bytes_out.assign(send.begin(), send.end());
    s.bytes_in.resize(static_cast<size_t>(total));
    KEEL_RETURN_IF_ERROR(Complete(kName, "MPI_Ialltoallv", [&](MPI_Request* request) {
      return MPI_Ialltoallv(s.bytes_out.data(), s.send_counts.data(), s.send_displs.data(),
                            MPI_BYTE, s.bytes_in.data(), s.recv_counts.data(), s.recv_displs.data(),
                            MPI_BYTE, comm_, request);
    }));
    // The received bytes change hands without a copy; the caller's old storage becomes the next
    // call's staging.
    recv.swap(s.bytes_in);
    recv_bytes.assign(s.counts_in.begin(), s.counts_in.end());
    return Status::Ok();
  }

  // One MPI_Ialltoallv and no count exchange. Each slice travels behind an 8-byte header with
  // its length, so a receiver that expects more than was sent names the mismatch instead of
  // handing on bytes nobody sent. A slice longer than its receiver expects is MPI's truncation
  // error, which Open MPI 4.1 reports as fatal (MPI_ERR_TRUNCATE aborts the job) although the
  // communicator returns errors: the engine derives both sides from one plan, so only a bug in
  // it gets there.
  Status AllToAllVKnownSizes(std::span<const std::byte> send, std::span<const size_t> send_bytes,
                             std::span<std::byte> recv,
                             std::span<const size_t> recv_bytes) override {
    constexpr std::string_view kName = "AllToAllVKnownSizes";
    constexpr size_t kHeader = sizeof(int64_t);
    KEEL_RETURN_IF_ERROR(Usable());
    KEEL_RETURN_IF_ERROR(collective::CheckAllToAllVKnownSizes(kBackend, size_, send.size(),
                                                              send_bytes, recv.size(), recv_bytes));
    const size_t headers = kHeader * static_cast<size_t>(size_);
    // The totals bound every count and displacement.
    KEEL_RETURN_IF_ERROR(
        CheckCount("AllToAllVKnownSizes: send.size() with headers", send.size() + headers));
    KEEL_RETURN_IF_ERROR(
        CheckCount("AllToAllVKnownSizes: recv.size() with headers", recv.size() + headers));
    Staging& s = *staging_;
    s.send_counts.resize(size_);
    s.send_displs.resize(size_);
    s.recv_counts.resize(size_);
    s.recv_displs.resize(size_);
    for (int r = 0; r < size_; ++r) {
      s.send_counts[r] = static_cast<int>(kHeader + send_bytes[r]);
      s.recv_counts[r] = static_cast<int>(kHeader + recv_bytes[r]);
    }
    std::exclusive_scan(s.send_counts.begin(), s.send_counts.end(), s.send_displs.begin(), 0);
    std::exclusive_scan(s.recv_counts.begin(), s.recv_counts.end(), s.recv_displs.begin(), 0);
    // Copies, not the caller's buffers: after a timeout MPI may still use them.
    s.bytes_out.resize(send.size() + headers);
    size_t from = 0;
    for (int r = 0; r < size_; ++r) {
      const int64_t length = static_cast<int64_t>(send_bytes[r]);
      std::byte* slice = s.bytes_out.data() + s.send_displs[r];
      std::memcpy(slice, &length, kHeader);
      if (send_bytes[r] > 0) std::memcpy(slice + kHeader, send.data() + from, send_bytes[r]);
      from += send_bytes[r];
    }
    s.bytes_in.resize(recv.size() + headers);
    KEEL_RETURN_IF_ERROR(Complete(kName, "MPI_Ialltoallv", [&](MPI_Request* request) {
      return MPI_Ialltoallv(s.bytes_out.data(), s.send_counts.data(), s.send_displs.data(),
                            MPI_BYTE, s.bytes_in.data(), s.recv_counts.data(), s.recv_displs.data(),
                            MPI_BYTE, comm_, request);
    }));
    size_t to = 0;
    for (int r = 0; r < size_; ++r) {
      const std::byte* slice = s.bytes_in.data() + s.recv_displs[r];
      int64_t length = 0;
      std::memcpy(&length, slice, kHeader);
      if (length != static_cast<int64_t>(recv_bytes[r])) {
        return collective::SizeMismatch(kBackend, r, rank_, static_cast<size_t>(length),
                                        recv_bytes[r]);
      }
      if (recv_bytes[r] > 0) std::memcpy(recv.data() + to, slice + kHeader, recv_bytes[r]);
      to += recv_bytes[r];
    }
    return Status::Ok();
  }

 private:
  Status Usable() const {
    if (!broken_.ok()) return collective::Broken(kBackend, broken_);
    return Status::Ok();
  }

  // Every rank must reduce the same number of values with the same op; MPI itself would hang or
  // truncate. One small reduction of [n, -n, op, -op] with MPI_MAX tells every rank whether all
  // agree.
  Status AgreeOnReduce(size_t count, ReduceOp op) {
    Staging& s = *staging_;
    const int64_t n = static_cast<int64_t>(count);
    const int64_t code = static_cast<int64_t>(op);
    s.header = {n, -n, code, -code};
    KEEL_RETURN_IF_ERROR(Complete("AllReduce", "MPI_Iallreduce", [&](MPI_Request* request) {
      return MPI_Iallreduce(MPI_IN_PLACE, s.header.data(), 4, MPI_INT64_T, MPI_MAX, comm_, request);
    }));
    if (s.header[0] != n || -s.header[1] != n) {
      return InvalidArgument("mpi AllReduce: values.size() differs between ranks (" +
                             std::to_string(-s.header[1]) + " to " + std::to_string(s.header[0]) +
                             "; " + std::to_string(n) + " on rank " + std::to_string(rank_) + ")");
    }
    if (s.header[2] != code || -s.header[3] != code) {
      return InvalidArgument("mpi AllReduce: op differs between ranks (" +
                             std::string(ReduceOpName(op)) + " on rank " + std::to_string(rank_) +
                             ")");
    }
    return Status::Ok();
  }

  // Posts one nonblocking collective with `post` and polls it until it completes or the timeout
  // passes. A timeout or an MPI error breaks the communicator; the request stays in pending_.
  template <typename Post>
  Status Complete(std::string_view collective, std::string_view call, Post&& post) {
    MPI_Request request = MPI_REQUEST_NULL;
    int rc = post(&request);
    if (rc != MPI_SUCCESS) {
      broken_ = MpiError(call, rc);
      return broken_;
    }
    const double timeout = timeout_seconds();
    const auto start = Clock::now();
    while (true) {
      int done = 0;
      rc = MPI_Test(&request, &done, MPI_STATUS_IGNORE);
      if (rc != MPI_SUCCESS) {
        pending_ = request;
        broken_ = MpiError("MPI_Test of " + std::string(call), rc);
        return broken_;
      }
      if (done) return Status::Ok();
      const std::chrono::duration<double> waited = Clock::now() - start;
      if (timeout > 0 && waited.count() > timeout) {
        pending_ = request;
        // MPI does not say which ranks have not arrived.
        broken_ = collective::TimedOut(collective, timeout, rank_, {});
        return broken_;
      }
      // Spin while a fast collective is likely, then give the core to the peers (ranks are often
      // oversubscribed on a node), then back off.
      if (waited < std::chrono::microseconds(100)) continue;
      if (waited < std::chrono::milliseconds(2)) {
        std::this_thread::yield();
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      }
    }
  }

  MPI_Comm comm_;
  int rank_ = 0;
  int size_ = 0;
  std::unique_ptr<Staging> staging_;
  MPI_Request pending_ = MPI_REQUEST_NULL;  // a collective abandoned by a timeout or an error
  Status broken_;                           // not OK once the communicator is broken
};

}  // namespace

Result<std::unique_ptr<Communicator>> CreateMpiCommunicator() {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) return FailedPrecondition("MPI is not initialized (call MPI_Init first)");
  if (MpiFinalized()) return FailedPrecondition("MPI is already finalized");
  // MPI_Comm_dup is itself a collective; the nonblocking form keeps a missing rank from hanging
  // the job here too.
  MPI_Comm comm = MPI_COMM_NULL;
  MPI_Request request = MPI_REQUEST_NULL;
  int rc = MPI_Comm_idup(MPI_COMM_WORLD, &comm, &request);
  if (rc != MPI_SUCCESS) return MpiError("MPI_Comm_idup", rc);
  constexpr double timeout = 120.0;  // the default of Communicator::timeout_seconds()
  const auto start = Clock::now();
  for (int done = 0; !done;) {
    rc = MPI_Test(&request, &done, MPI_STATUS_IGNORE);
    if (rc != MPI_SUCCESS) return MpiError("MPI_Test of MPI_Comm_idup", rc);
    const std::chrono::duration<double> waited = Clock::now() - start;
    if (!done && waited.count() > timeout) {
      int rank = 0;
      MPI_Comm_rank(MPI_COMM_WORLD, &rank);
      return collective::TimedOut("MPI_Comm_idup", timeout, rank, {});
    }
    if (!done) std::this_thread::yield();
  }
  // Errors come back as codes we turn into Status, instead of aborting the job.
  rc = MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN);
  if (rc != MPI_SUCCESS) {
    MPI_Comm_free(&comm);
    return MpiError("MPI_Comm_set_errhandler", rc);
  }
  return std::unique_ptr<Communicator>(new MpiCommunicator(comm));
}

}  // namespace keel
