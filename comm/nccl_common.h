// What the NCCL backends of migration/ share (communicator_nccl.cc, transport_nccl.cc): NCCL
// return codes turned into Status with file:line, the RAII owner of a communicator, polling with
// a timeout, and the bootstrap of a non-blocking NCCL communicator over a Communicator. CUDA's
// part is in cuda_common.h. Includes NCCL's headers: only *_nccl.cc files include it.
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>

#include <chrono>
#include <cstring>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "comm/communicator.h"
#include "comm/cuda_common.h"
#include "keel/status.hpp"

namespace keel::nccl {

inline Status NcclError(std::string_view call, ncclResult_t code, const char* file, int line) {
  return Internal(std::string(file) + ":" + std::to_string(line) + ": " + std::string(call) +
                  " failed: " + ncclGetErrorString(code));
}

// Turns NCCL return codes into Status at the boundary, with file:line. NCCL calls on a
// non-blocking communicator may answer ncclInProgress, which the caller resolves by polling
// ncclCommGetAsyncError.
#define KEEL_NCCL_RETURN_IF_ERROR(call)                                         \
  do {                                                                          \
    const ncclResult_t keel_nccl_rc_ = (call);                                  \
    if (keel_nccl_rc_ != ncclSuccess && keel_nccl_rc_ != ncclInProgress) {      \
      return ::keel::nccl::NcclError(#call, keel_nccl_rc_, __FILE__, __LINE__); \
    }                                                                           \
  } while (0)

// The NCCL communicator: destroyed normally, or aborted once an operation has been abandoned
// (ncclCommDestroy would wait for it).
class NcclComm {
 public:
  NcclComm() = default;
  ~NcclComm() {
    if (comm_ == nullptr) return;
    if (aborted_) return;
    ncclCommDestroy(comm_);
  }
  NcclComm(const NcclComm&) = delete;
  NcclComm& operator=(const NcclComm&) = delete;

  ncclComm_t* out() { return &comm_; }
  ncclComm_t get() const { return comm_; }
  bool aborted() const { return aborted_; }
  void Abort() {
    if (comm_ != nullptr && !aborted_) ncclCommAbort(comm_);
    aborted_ = true;
  }

 private:
  ncclComm_t comm_ = nullptr;
  bool aborted_ = false;
};

// Polls `ready` (true: done; an error: failed) until it is done or `timeout_seconds` (<= 0: no
// limit) pass; spins briefly, then yields, then sleeps, so oversubscribed ranks make progress.
template <typename Ready>
Status Poll(double timeout_seconds, Ready&& ready, bool& timed_out) {
  using Clock = std::chrono::steady_clock;
  timed_out = false;
  const auto start = Clock::now();
  while (true) {
    KEEL_ASSIGN_OR_RETURN(const bool done, ready());
    if (done) return Status::Ok();
    const std::chrono::duration<double> waited = Clock::now() - start;
    if (timeout_seconds > 0 && waited.count() > timeout_seconds) {
      timed_out = true;
      return Status::Ok();
    }
    if (waited < std::chrono::microseconds(100)) continue;
    if (waited < std::chrono::milliseconds(2)) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }
}

// Creates `comm`, a non-blocking NCCL communicator with the ranks of `bootstrap` on CUDA device
// `device` (< 0: the current one), which this call makes current; every rank of `bootstrap`
// calls it. Rank 0 draws the unique id and `bootstrap` broadcasts it. Returns the device.
inline Result<int> InitComm(Communicator& bootstrap, int device, std::string_view what,
                            NcclComm& comm) {
  const int rank = bootstrap.rank();
  ncclUniqueId id{};
  Result<int> chosen = cuda::ChooseDevice(what, device);
  Status prepared = chosen.status();
  if (prepared.ok()) {
    const cudaError_t set = cudaSetDevice(*chosen);
    if (set != cudaSuccess) {
      prepared = cuda::CudaError("cudaSetDevice", set, __FILE__, __LINE__);
    } else if (rank == 0) {
      const ncclResult_t drawn = ncclGetUniqueId(&id);
      if (drawn != ncclSuccess) prepared = NcclError("ncclGetUniqueId", drawn, __FILE__, __LINE__);
    }
  }
  // Agree first, so a rank without a usable device fails every rank at once instead of leaving
  // the others to time out in ncclCommInitRank.
  KEEL_ASSIGN_OR_RETURN(const std::vector<std::string> problems,
                        bootstrap.AllGather(prepared.ok() ? "" : prepared.ToString()));
  if (!prepared.ok()) return prepared;
  for (int r = 0; r < bootstrap.size(); ++r) {
    if (!problems[r].empty()) {
      return FailedPrecondition(std::string(what) + ": rank " + std::to_string(r) +
                                " could not prepare: " + problems[r]);
    }
  }
  std::string id_bytes;
  if (rank == 0) id_bytes.assign(reinterpret_cast<const char*>(&id), sizeof(id));
  KEEL_RETURN_IF_ERROR(bootstrap.Broadcast(id_bytes, 0));
  if (id_bytes.size() != sizeof(id)) {
    return Internal(std::string(what) + ": the unique id from rank 0 has " +
                    std::to_string(id_bytes.size()) + " bytes, not " + std::to_string(sizeof(id)));
  }
  std::memcpy(&id, id_bytes.data(), sizeof(id));

  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;  // so no NCCL call blocks the host on a missing peer
  const ncclResult_t started =
      ncclCommInitRankConfig(comm.out(), bootstrap.size(), id, rank, &config);
  bool timed_out = false;
  Status initialized =
      started == ncclSuccess || started == ncclInProgress
          ? Poll(
                bootstrap.timeout_seconds(),
                [&]() -> Result<bool> {
                  ncclResult_t state = ncclSuccess;
                  KEEL_NCCL_RETURN_IF_ERROR(ncclCommGetAsyncError(comm.get(), &state));
                  if (state == ncclInProgress) return false;
                  if (state != ncclSuccess) {
                    return NcclError("ncclCommInitRankConfig", state, __FILE__, __LINE__);
                  }
                  return true;
                },
                timed_out)
          : NcclError("ncclCommInitRankConfig", started, __FILE__, __LINE__);
  if (!initialized.ok() || timed_out) {
    comm.Abort();
    if (timed_out) {
      initialized = collective::TimedOut("ncclCommInitRank", bootstrap.timeout_seconds(), rank, {});
    }
    return Status(initialized.code(), std::string(what) + " on rank " + std::to_string(rank) +
                                          ": " + initialized.message());
  }
  return *chosen;
}

}  // namespace keel::nccl
