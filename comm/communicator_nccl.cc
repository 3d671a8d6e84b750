// The NCCL backend: host data staged through device buffers on a non-blocking stream of its own
// (AllToAllVDevice moves the caller's device buffers directly), collectives on a non-blocking NCCL
// communicator, completion polled with cudaStreamQuery and ncclCommGetAsyncError so a missing peer
// becomes a timeout (and ncclCommAbort), never a hang.
#include <algorithm>
#include <numeric>

#include "comm/communicator.h"
#include "comm/nccl_common.h"

namespace keel {
namespace {

using cuda::CudaError;
using cuda::CudaStream;
using nccl::NcclComm;
using nccl::NcclError;
using nccl::Poll;

constexpr std::string_view kBackend = "nccl";

// Device memory that grows on demand and is reused between collectives.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  ~DeviceBuffer() {
    if (data_ != nullptr) cudaFree(data_);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  // At least `bytes`; contents are not kept.
  Status Reserve(size_t bytes) {
    if (bytes <= capacity_) return Status::Ok();
    const size_t capacity = std::max(bytes, 2 * capacity_);
    if (data_ != nullptr) {
      cudaFree(data_);
      data_ = nullptr;
      capacity_ = 0;
    }
    KEEL_CUDA_RETURN_IF_ERROR(cudaMalloc(&data_, capacity));
    capacity_ = capacity;
    return Status::Ok();
  }
  std::byte* data() const { return static_cast<std::byte*>(data_); }

 private:
  void* data_ = nullptr;
  size_t capacity_ = 0;
};

ncclRedOp_t ToNccl(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return ncclSum;
    case ReduceOp::kMin:
      return ncclMin;
    case ReduceOp::kMax:
      return ncclMax;
  }
  return ncclSum;
}

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(int rank, int size, int device, std::unique_ptr<NcclComm> comm,
                   std::unique_ptr<CudaStream> stream)
      : rank_(rank),
        size_(size),
        device_(device),
        stream_(std::move(stream)),
        comm_(std::move(comm)) {}

  ~NcclCommunicator() override {
    // The members free device memory and the communicator of this device.
    cudaSetDevice(device_);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string_view name() const override { return kBackend; }

  Result<std::vector<std::string>> AllGather(std::string_view mine) override {
    constexpr std::string_view kName = "AllGather";
    KEEL_RETURN_IF_ERROR(Begin());
    const int64_t length = static_cast<int64_t>(mine.size());
    std::vector<int64_t> lengths(size_);
    KEEL_RETURN_IF_ERROR(Upload(&length, sizeof(length)));
    KEEL_RETURN_IF_ERROR(recv_.Reserve(sizeof(int64_t) * size_));
    KEEL_RETURN_IF_ERROR(Run(kName, [&] {
      return ncclAllGather(send_.data(), recv_.data(), 1, ncclInt64, comm_->get(), stream());
    }));
    KEEL_RETURN_IF_ERROR(Download(lengths.data(), sizeof(int64_t) * size_));
    // ncclAllGather moves equal counts, so every contribution is padded to the longest.
    const size_t longest = static_cast<size_t>(*std::max_element(lengths.begin(), lengths.end()));
    KEEL_RETURN_IF_ERROR(send_.Reserve(longest));
    KEEL_RETURN_IF_ERROR(Upload(mine.data(), mine.size()));
    KEEL_RETURN_IF_ERROR(recv_.Reserve(longest * size_));
    KEEL_RETURN_IF_ERROR(Run(kName, [&] {
      return ncclAllGather(send_.data(), recv_.data(), longest, ncclUint8, comm_->get(), stream());
    }));
    std::string all_bytes(longest * size_, '\0');
    KEEL_RETURN_IF_ERROR(Download(all_bytes.data(), all_bytes.size()));
    std::vector<std::string> all(size_);
    for (int r = 0; r < size_; ++r) all[r] = all_bytes.substr(longest * r, lengths[r]);
    return all;
  }

  Status Barrier() override {
    KEEL_RETURN_IF_ERROR(Begin());
    KEEL_RETURN_IF_ERROR(send_.Reserve(sizeof(int64_t)));
    KEEL_RETURN_IF_ERROR(recv_.Reserve(sizeof(int64_t)));
    return Run("Barrier", [&] {
      return ncclAllReduce(send_.data(), recv_.data(), 1, ncclInt64, ncclSum, comm_->get(),
                           stream());
    });
  }

  Status AllReduce(std::span<int64_t> values, ReduceOp op) override {
    KEEL_RETURN_IF_ERROR(Begin());
    KEEL_RETURN_IF_ERROR(AgreeOnReduce(values.size(), op));
    // Integer sums are exact (wrapping) in any order.
    return Reduce(values, ncclInt64, op);
  }

  Status AllReduce(std::span<double> values, ReduceOp op) override {
    KEEL_RETURN_IF_ERROR(Begin());
    KEEL_RETURN_IF_ERROR(AgreeOnReduce(values.size(), op));
    if (op != ReduceOp::kSum) return Reduce(values, ncclFloat64, op);  // exact in any order
    // NCCL sums in whatever order its algorithm picks; gather and fold in rank order so the bits
    // are the same on every rank and every run.
    const size_t bytes = values.size_bytes();
    KEEL_RETURN_IF_ERROR(Upload(values.data(), bytes));
    KEEL_RETURN_IF_ERROR(recv_.Reserve(bytes * size_));
    KEEL_RETURN_IF_ERROR(Run("AllReduce", [&] {
      return ncclAllGather(send_.data(), recv_.data(), values.size(), ncclFloat64, comm_->get(),
                           stream());
    }));
    std::vector<double> gathered(values.size() * size_);
    KEEL_RETURN_IF_ERROR(Download(gathered.data(), bytes * size_));
    collective::FoldInRankOrder(gathered, op, values);
    return Status::Ok();
  }

  Status Broadcast(std::string& bytes, int root) override {
    constexpr std::string_view kName = "Broadcast";
    KEEL_RETURN_IF_ERROR(Begin());
    KEEL_RETURN_IF_ERROR(collective::CheckRoot(kBackend, size_, root));
    // One small reduction checks that every rank names the same root and carries the root's
    // size to the others (only the root contributes a size >= 0).
    std::vector<int64_t> header = {root, -root,
                                   rank_ == root ? static_cast<int64_t>(bytes.size()) : -1};
    KEEL_RETURN_IF_ERROR(MaxOverRanks(header));
    if (header[0] != root || -header[1] != root) {
      return InvalidArgument("nccl Broadcast: root differs between ranks (" +
                             std::to_string(-header[1]) + " to " + std::to_string(header[0]) +
                             "; " + std::to_string(root) + " on rank " + std::to_string(rank_) +
                             ")");
    }
    const size_t length = static_cast<size_t>(header[2]);
    KEEL_RETURN_IF_ERROR(recv_.Reserve(length));
    if (rank_ == root && length > 0) {
      KEEL_CUDA_RETURN_IF_ERROR(
          cudaMemcpyAsync(recv_.data(), bytes.data(), length, cudaMemcpyHostToDevice, stream()));
    }
    KEEL_RETURN_IF_ERROR(Run(kName, [&] {
      return ncclBroadcast(recv_.data(), recv_.data(), length, ncclUint8, root, comm_->get(),
                           stream());
    }));
    if (rank_ == root) return Status::Ok();
    bytes.resize(length);
    return Download(bytes.data(), length);
  }

  Status AllToAllV(std::span<const std::byte> send, std::span<const size_t> send_bytes,
                   std::vector<std::byte>& recv, std::vector<size_t>& recv_bytes) override {
    constexpr std::string_view kName = "AllToAllV";
    KEEL_RETURN_IF_ERROR(Begin());
    KEEL_RETURN_IF_ERROR(collective::CheckAllToAllV(kBackend, size_, send.size(), send_bytes));
    std::vector<int64_t> counts(send_bytes.begin(), send_bytes.end());
    KEEL_RETURN_IF_ERROR(Upload(counts.data(), sizeof(int64_t) * size_));
    KEEL_RETURN_IF_ERROR(recv_.Reserve(sizeof(int64_t) * size_));
    // One count to each peer by grouped sends and receives: ncclAlltoAll exists only from NCCL
    // 2.28 on, and torch's wheels bring older NCCLs, which then serve libkeel too.
    const std::vector<size_t> one_count(size_, sizeof(int64_t));
    KEEL_RETURN_IF_ERROR(SendReceive(kName, send_.data(), one_count, recv_.data(), one_count));
    KEEL_RETURN_IF_ERROR(Download(counts.data(), sizeof(int64_t) * size_));
    recv_bytes.assign(counts.begin(), counts.end());
    const size_t total = std::accumulate(recv_bytes.begin(), recv_bytes.end(), size_t{0});
    KEEL_RETURN_IF_ERROR(Upload(send.data(), send.size()));
    KEEL_RETURN_IF_ERROR(recv_.Reserve(total));
    KEEL_RETURN_IF_ERROR(SendReceive(kName, send_.data(), send_bytes, recv_.data(), recv_bytes));
    recv.resize(total);
    return Download(recv.data(), total);
  }

  bool MovesDeviceMemory() const override { return true; }

  // Straight between the caller's device buffers; Run waits for the stream, so recv holds the
  // data on return.
  Status AllToAllVDevice(const std::byte* send, std::span<const size_t> send_bytes, std::byte* recv,
                         std::span<const size_t> recv_bytes) override {
    KEEL_RETURN_IF_ERROR(Begin());
    KEEL_RETURN_IF_ERROR(collective::CheckAllToAllVDevice(kBackend, size_, send_bytes, recv_bytes));
    return SendReceive("AllToAllVDevice", send, send_bytes, recv, recv_bytes);
  }

 private:
  cudaStream_t stream() const { return stream_->get(); }

  // The slices of device buffers send and recv, back to back in rank order, as grouped
  // ncclSend / ncclRecv so every pair progresses at once; empty slices post nothing on either
  // side.
  Status SendReceive(std::string_view collective, const std::byte* send,
                     std::span<const size_t> send_bytes, std::byte* recv,
                     std::span<const size_t> recv_bytes) {
    return Run(collective, [&] {
      ncclResult_t rc = ncclGroupStart();
      if (rc != ncclSuccess) return rc;
      size_t send_offset = 0;
      size_t recv_offset = 0;
      for (int r = 0; r < size_; ++r) {
        if (send_bytes[r] > 0) {
          rc = ncclSend(send + send_offset, send_bytes[r], ncclUint8, r, comm_->get(), stream());
          if (rc != ncclSuccess && rc != ncclInProgress) break;
        }
        if (recv_bytes[r] > 0) {
          rc = ncclRecv(recv + recv_offset, recv_bytes[r], ncclUint8, r, comm_->get(), stream());
          if (rc != ncclSuccess && rc != ncclInProgress) break;
        }
        send_offset += send_bytes[r];
        recv_offset += recv_bytes[r];
      }
      const ncclResult_t end = ncclGroupEnd();
      return rc != ncclSuccess && rc != ncclInProgress ? rc : end;
    });
  }

  // Every collective starts here: refuse once broken, and make this rank's device current (the
  // calling thread may have switched).
  Status Begin() {
    if (!broken_.ok()) return collective::Broken(kBackend, broken_);
    KEEL_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    return Status::Ok();
  }

  Status Upload(const void* host, size_t bytes) {
    KEEL_RETURN_IF_ERROR(send_.Reserve(bytes));
    if (bytes == 0) return Status::Ok();
    KEEL_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(send_.data(), host, bytes, cudaMemcpyHostToDevice, stream()));
    return Status::Ok();
  }

  // Only after Run(): the stream is idle, so the copy cannot wait on a peer.
  Status Download(void* host, size_t bytes) {
    if (bytes == 0) return Status::Ok();
    KEEL_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(host, recv_.data(), bytes, cudaMemcpyDeviceToHost, stream()));
    KEEL_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream()));
    return Status::Ok();
  }

  // Enqueues one operation with `enqueue` and waits for the stream. A timeout or an NCCL error
  // aborts the NCCL communicator and breaks this one.
  template <typename Enqueue>
  Status Run(std::string_view collective, Enqueue&& enqueue) {
    const ncclResult_t rc = enqueue();
    if (rc != ncclSuccess && rc != ncclInProgress) {
      return Break(NcclError("enqueueing " + std::string(collective), rc, __FILE__, __LINE__));
    }
    bool timed_out = false;
    Status status = Poll(
        timeout_seconds(),
        [&]() -> Result<bool> {
          ncclResult_t state = ncclSuccess;
          const ncclResult_t query = ncclCommGetAsyncError(comm_->get(), &state);
          if (query != ncclSuccess)
            return NcclError("ncclCommGetAsyncError", query, __FILE__, __LINE__);
          if (state == ncclInProgress) return false;
          if (state != ncclSuccess) {
            return NcclError(std::string(collective) + " on NCCL", state, __FILE__, __LINE__);
          }
          const cudaError_t stream_state = cudaStreamQuery(stream());
          if (stream_state == cudaErrorNotReady) return false;
          if (stream_state != cudaSuccess) {
            return CudaError("cudaStreamQuery", stream_state, __FILE__, __LINE__);
          }
          return true;
        },
        timed_out);
    if (!status.ok()) return Break(status);
    if (timed_out) return Break(collective::TimedOut(collective, timeout_seconds(), rank_, {}));
    return Status::Ok();
  }

  Status Break(Status cause) {
    comm_->Abort();
    broken_ = cause;
    return cause;
  }

  // values on every rank replaced by the element-wise maximum over ranks.
  Status MaxOverRanks(std::vector<int64_t>& values) {
    const size_t bytes = sizeof(int64_t) * values.size();
    KEEL_RETURN_IF_ERROR(Upload(values.data(), bytes));
    KEEL_RETURN_IF_ERROR(recv_.Reserve(bytes));
    KEEL_RETURN_IF_ERROR(Run("AllReduce", [&] {
      return ncclAllReduce(send_.data(), recv_.data(), values.size(), ncclInt64, ncclMax,
                           comm_->get(), stream());
    }));
    return Download(values.data(), bytes);
  }

  // Every rank must reduce the same number of values with the same op, or NCCL would hang or
  // corrupt; one small max-reduction of [n, -n, op, -op] tells every rank whether all agree.
  Status AgreeOnReduce(size_t count, ReduceOp op) {
    const int64_t n = static_cast<int64_t>(count);
    const int64_t code = static_cast<int64_t>(op);
    std::vector<int64_t> header = {n, -n, code, -code};
    KEEL_RETURN_IF_ERROR(MaxOverRanks(header));
    if (header[0] != n || -header[1] != n) {
      return InvalidArgument("nccl AllReduce: values.size() differs between ranks (" +
                             std::to_string(-header[1]) + " to " + std::to_string(header[0]) +
                             "; " + std::to_string(n) + " on rank " + std::to_string(rank_) + ")");
    }
    if (header[2] != code || -header[3] != code) {
      return InvalidArgument("nccl AllReduce: op differs between ranks (" +
                             std::string(ReduceOpName(op)) + " on rank " + std::to_string(rank_) +
                             ")");
    }
    return Status::Ok();
  }

  template <typename T>
  Status Reduce(std::span<T> values, ncclDataType_t type, ReduceOp op) {
    const size_t bytes = values.size_bytes();
    KEEL_RETURN_IF_ERROR(Upload(values.data(), bytes));
    KEEL_RETURN_IF_ERROR(recv_.Reserve(bytes));
    KEEL_RETURN_IF_ERROR(Run("AllReduce", [&] {
      return ncclAllReduce(send_.data(), recv_.data(), values.size(), type, ToNccl(op),
                           comm_->get(), stream());
    }));
    return Download(values.data(), bytes);
  }

  const int rank_;
  const int size_;
  const int device_;
  // Destroyed in reverse: buffers, then the communicator, then the stream it ran on.
  std::unique_ptr<CudaStream> stream_;
  std::unique_ptr<NcclComm> comm_;
  DeviceBuffer send_;
  DeviceBuffer recv_;
  Status broken_;  // not OK once the communicator is broken
};

}  // namespace

Result<std::unique_ptr<Communicator>> CreateNcclCommunicator(Communicator& bootstrap, int device) {
  auto comm = std::make_unique<NcclComm>();
  KEEL_ASSIGN_OR_RETURN(device, nccl::InitComm(bootstrap, device, "nccl communicator", *comm));
  auto stream = std::make_unique<CudaStream>();
  KEEL_RETURN_IF_ERROR(stream->Create());
  const int rank = bootstrap.rank();
  auto communicator = std::make_unique<NcclCommunicator>(rank, bootstrap.size(), device,
                                                         std::move(comm), std::move(stream));
  communicator->set_timeout_seconds(bootstrap.timeout_seconds());
  return std::unique_ptr<Communicator>(std::move(communicator));
}

}  // namespace keel
