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
