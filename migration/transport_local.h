// The local transport: ranks are threads of one process that share a LocalFabric. It is the
// embedded default for single-process runs and the fast test path; its fault hooks let tests
// stall a rank, kill one, or corrupt a chunk in flight.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "keel/local_group.hpp"
#include "keel/transport.hpp"

namespace keel {

class LocalFabric {
 public:
  explicit LocalFabric(int num_ranks);
  ~LocalFabric();
  LocalFabric(const LocalFabric&) = delete;
  LocalFabric& operator=(const LocalFabric&) = delete;

  int num_ranks() const { return num_ranks_; }

  // The transport of `rank`; the fabric must outlive it. One per rank.
  std::unique_ptr<Transport> Connect(int rank);

  // Fault injection. A stalled rank stops answering: nothing it sends or is sent is delivered,
  // and nothing fails either (like a process stuck in a long kernel).
  void Stall(int rank);
  // A dead rank's requests, and every request to or from it, fail at once (a crashed process
  // whose connections were reset).
  void Kill(int rank);
  // Flips one byte of the `nth` (0-based) message of more than 64 bytes delivered from `src` to
  // `dst` from now on: data chunks, not checksums or verdicts.
  void CorruptChunk(int src, int dst, int nth);

 private:
  friend class LocalTransport;
  struct Request;
  struct Message;

  Result<RequestId> Post(int rank, int peer, uint64_t tag, std::byte* data, size_t bytes,
                         bool send);
  std::optional<Status> Test(int rank, RequestId id);
  void Cancel(int rank, RequestId id);
  // Pairs matching sends and receives; `lock` is held on entry and exit.
  void Deliver(std::unique_lock<std::mutex>& lock, Request* send, Request* recv);
  bool Reachable(int a, int b) const;

  const int num_ranks_;
  std::mutex mutex_;
  std::condition_variable copied_;
  RequestId next_id_ = 1;
  std::unordered_map<RequestId, std::unique_ptr<Request>> requests_;
  std::vector<bool> stalled_;
  std::vector<bool> dead_;
  struct Corruption {
    int src;
    int dst;
    int countdown;
  };
  std::vector<Corruption> corruptions_;
};

// The fabric of a public LocalGroup (include/keel/local_group.hpp), for the engine and the
// transport factory, which connect the group's ranks to it.
LocalFabric& FabricOf(LocalGroup& group);

}  // namespace keel
