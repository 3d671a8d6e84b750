// NcclDeviceMover: the DeviceMover of the nccl transport. Each group is one
// ncclGroupStart/ncclGroupEnd of ncclSend/ncclRecv (bytes as ncclUint8) on one non-blocking
// communicator and one non-blocking stream, followed by a CUDA event; groups complete in launch
// order, which the event queries see in order. On a non-blocking communicator ncclGroupEnd may
// answer ncclInProgress while NCCL still connects the peers: the next group, and the event of
// this one, wait until ncclCommGetAsyncError says the enqueue finished, polled from Completed(),
// so no call blocks the host on a peer.
#include "migration/transport_nccl.h"

#include <chrono>
#include <deque>
#include <string>
#include <thread>
#include <vector>

#include "comm/nccl_common.h"

namespace keel {
namespace {

using cuda::CudaError;
using cuda::CudaEvent;
using cuda::CudaStream;
using nccl::NcclComm;
using nccl::NcclError;

class NcclDeviceMover final : public DeviceMover {
 public:
  NcclDeviceMover(int device, std::unique_ptr<NcclComm> comm, std::unique_ptr<CudaStream> stream)
      : device_(device), stream_(std::move(stream)), comm_(std::move(comm)) {}

  ~NcclDeviceMover() override {
    // The members release this device's stream, events and communicator.
    cudaSetDevice(device_);
    groups_.clear();
    free_events_.clear();
  }

  std::string_view name() const override { return "nccl"; }

  Status Launch(std::span<const DeviceOp> ops) override {
    if (comm_->aborted()) return Aborted("nccl: the communicator was aborted");
    Group group;
    group.ops.assign(ops.begin(), ops.end());
    groups_.push_back(std::move(group));
    return Pump();
  }

  Result<uint64_t> Completed() override {
    if (comm_->aborted()) return Aborted("nccl: the communicator was aborted");
    KEEL_RETURN_IF_ERROR(Pump());
    ncclResult_t state = ncclSuccess;
    KEEL_NCCL_RETURN_IF_ERROR(ncclCommGetAsyncError(comm_->get(), &state));
    if (state != ncclSuccess && state != ncclInProgress) {
      return NcclError("device group on the NCCL communicator", state, __FILE__, __LINE__);
    }
    while (!groups_.empty() && groups_.front().event != nullptr) {
      const cudaError_t query = cudaEventQuery(groups_.front().event->get());
      if (query == cudaErrorNotReady) break;
      if (query != cudaSuccess) return CudaError("cudaEventQuery", query, __FILE__, __LINE__);
      free_events_.push_back(std::move(groups_.front().event));
      groups_.pop_front();
      --launched_;
      ++completed_;
    }
    return completed_;
  }

  void Abort() override {
    if (comm_->aborted()) return;
    cudaSetDevice(device_);
    comm_->Abort();
    // ncclCommAbort stops the kernels of the communicator; wait (bounded) for the stream to
    // drain so no buffer is touched after we return.
    const auto limit = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    while (cudaStreamQuery(stream_->get()) == cudaErrorNotReady &&
           std::chrono::steady_clock::now() < limit) {
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
    (void)cudaGetLastError();
    groups_.clear();
    launched_ = 0;
    enqueuing_ = false;
  }

 private:
  struct Group {
    std::vector<DeviceOp> ops;
    std::unique_ptr<CudaEvent> event;  // recorded once the group is on the stream
  };

  // Enqueues the groups that wait for their turn, and records the event of a group whose
  // enqueue has finished. groups_[0, launched_) were handed to NCCL, the rest wait.
  Status Pump() {
    KEEL_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    while (true) {
      if (enqueuing_) {
        ncclResult_t state = ncclSuccess;
        KEEL_NCCL_RETURN_IF_ERROR(ncclCommGetAsyncError(comm_->get(), &state));
        if (state == ncclInProgress) return Status::Ok();
        if (state != ncclSuccess) {
          return NcclError("ncclGroupEnd of a device group", state, __FILE__, __LINE__);
        }
        enqueuing_ = false;
        KEEL_RETURN_IF_ERROR(RecordEvent(groups_[launched_ - 1]));
        continue;
      }
      if (launched_ == groups_.size()) return Status::Ok();
      Group& group = groups_[launched_++];
      const ncclResult_t rc = Enqueue(group);
      if (rc == ncclInProgress) {
        enqueuing_ = true;
        continue;
      }
      if (rc != ncclSuccess) return NcclError("device group", rc, __FILE__, __LINE__);
      KEEL_RETURN_IF_ERROR(RecordEvent(group));
    }
  }

  // One NCCL group: ops with the same peer in the same direction keep their order, as the
  // protocol requires; the group is closed even when a call inside it failed.
  ncclResult_t Enqueue(const Group& group) {
    ncclResult_t rc = ncclGroupStart();
    if (rc != ncclSuccess) return rc;
    for (const DeviceOp& op : group.ops) {
      rc = op.send ? ncclSend(op.data, op.bytes, ncclUint8, op.peer, comm_->get(), stream_->get())
                   : ncclRecv(op.data, op.bytes, ncclUint8, op.peer, comm_->get(), stream_->get());
      if (rc != ncclSuccess && rc != ncclInProgress) break;
    }
    const ncclResult_t end = ncclGroupEnd();
    return rc != ncclSuccess && rc != ncclInProgress ? rc : end;
  }

  Status RecordEvent(Group& group) {
    if (free_events_.empty()) {
      auto event = std::make_unique<CudaEvent>();
      KEEL_RETURN_IF_ERROR(event->Create());
      free_events_.push_back(std::move(event));
    }
    group.event = std::move(free_events_.back());
    free_events_.pop_back();
    KEEL_CUDA_RETURN_IF_ERROR(cudaEventRecord(group.event->get(), stream_->get()));
    return Status::Ok();
  }

  const int device_;
  // Destroyed in reverse: events, then the communicator, then the stream it ran on.
  std::unique_ptr<CudaStream> stream_;
  std::unique_ptr<NcclComm> comm_;
  std::deque<Group> groups_;  // launched or waiting, not yet completed, in launch order
  size_t launched_ = 0;       // groups_[0, launched_) were handed to NCCL
  bool enqueuing_ = false;    // the last handed group's ncclGroupEnd is still in progress
  uint64_t completed_ = 0;
  std::vector<std::unique_ptr<CudaEvent>> free_events_;
};

}  // namespace

Result<std::unique_ptr<Transport>> CreateNcclTransport(Communicator& communicator,
                                                       std::unique_ptr<Transport> host,
                                                       const NcclTransportOptions& options) {
  if (host == nullptr) return InvalidArgument("nccl transport: needs a host transport");
  if (host->rank() != communicator.rank() || host->num_ranks() != communicator.size()) {
    return InvalidArgument(
        "nccl transport: the host transport is rank " + std::to_string(host->rank()) + " of " +
        std::to_string(host->num_ranks()) + ", the communicator rank " +
        std::to_string(communicator.rank()) + " of " + std::to_string(communicator.size()));
  }
  auto comm = std::make_unique<NcclComm>();
  KEEL_ASSIGN_OR_RETURN(const int device,
                        nccl::InitComm(communicator, options.device, "nccl transport", *comm));
  auto stream = std::make_unique<CudaStream>();
  KEEL_RETURN_IF_ERROR(stream->Create());
  KEEL_ASSIGN_OR_RETURN(std::shared_ptr<DeviceMemory> memory, CreateCudaDeviceMemory(device));
  auto mover = std::make_unique<NcclDeviceMover>(device, std::move(comm), std::move(stream));
  return CreateDeviceTransport(std::move(host), std::move(mover), std::move(memory),
                               options.protocol);
}

}  // namespace keel
