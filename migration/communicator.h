// The small collective interface migration needs for bootstrap — all-gather of bytes and a
// barrier — so transports exchange worker addresses over whatever the job already has (MPI,
// the engine's communicator, threads) instead of opening a socket service. The engine reuses it.
#pragma once

#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace keel {

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Every rank contributes `mine`; returns [size] contributions in rank order. Collective: all
  // ranks call it in the same order.
  virtual Result<std::vector<std::string>> AllGather(std::string_view mine) = 0;
  virtual Status Barrier() = 0;
};

// Ranks as threads of one process: Join(r) hands out rank r's communicator; the group must
// outlive them.
class LocalCommunicatorGroup {
 public:
  explicit LocalCommunicatorGroup(int size);
  std::unique_ptr<Communicator> Join(int rank);

 private:
  friend class LocalCommunicator;
  Result<std::vector<std::string>> AllGather(int rank, std::string_view mine);

  const int size_;
  std::mutex mutex_;
  std::condition_variable changed_;
  uint64_t generation_ = 0;  // completed all-gathers
  int arrived_ = 0;
  std::vector<std::string> contributions_;
  std::vector<std::string> result_;
};

// MPI_COMM_WORLD (MPI already initialized by the caller). Defined only in builds with
// KEEL_WITH_MPI (keel::kWithMpi); communicator_mpi.cc.
Result<std::unique_ptr<Communicator>> CreateMpiCommunicator();

}  // namespace keel
