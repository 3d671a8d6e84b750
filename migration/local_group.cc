// LocalGroup (include/keel/local_group.hpp): a LocalCommunicatorGroup and a LocalFabric with the
// same ranks, and the bookkeeping that keeps two live communicators from claiming one rank.
#include "keel/local_group.hpp"

#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "comm/communicator.h"
#include "keel/limits.hpp"
#include "migration/transport_local.h"

namespace keel {
namespace {

// Which ranks have a live communicator; shared with the communicators, which may outlive the
// group.
struct Membership {
  std::mutex mutex;
  std::vector<bool> joined;
};

// A joined rank's communicator: the local one, and the rank given back when it is destroyed.
class JoinedCommunicator final : public ForwardingCommunicator {
 public:
  JoinedCommunicator(std::unique_ptr<Communicator> local, std::shared_ptr<Membership> membership)
      : ForwardingCommunicator(std::move(local)), membership_(std::move(membership)) {}
  ~JoinedCommunicator() override {
    std::lock_guard<std::mutex> lock(membership_->mutex);
    membership_->joined[static_cast<size_t>(rank())] = false;
  }

 private:
  std::shared_ptr<Membership> membership_;
};

Status RankNotInGroup(int rank, int num_ranks) {
  return InvalidArgument("rank = " + std::to_string(rank) + " is not in [0, " +
                         std::to_string(num_ranks) + ")");
}

}  // namespace

struct LocalGroup::Members {
  explicit Members(int num_ranks)
      : communicators(num_ranks), fabric(num_ranks), membership(std::make_shared<Membership>()) {
    membership->joined.assign(static_cast<size_t>(num_ranks), false);
  }
  LocalCommunicatorGroup communicators;
  LocalFabric fabric;
  std::shared_ptr<Membership> membership;
};

LocalGroup::LocalGroup(int num_ranks) : members_(std::make_unique<Members>(num_ranks)) {}
LocalGroup::~LocalGroup() = default;

Result<std::unique_ptr<LocalGroup>> LocalGroup::Create(int num_ranks) {
  if (num_ranks < 1 || num_ranks > kMaxRanks) {
    return InvalidArgument("num_ranks = " + std::to_string(num_ranks) + " is not in [1, " +
                           std::to_string(kMaxRanks) + "]");
  }
  return std::unique_ptr<LocalGroup>(new LocalGroup(num_ranks));
}

int LocalGroup::num_ranks() const { return members_->fabric.num_ranks(); }

Result<std::unique_ptr<Communicator>> LocalGroup::Join(int rank) {
  if (rank < 0 || rank >= num_ranks()) return RankNotInGroup(rank, num_ranks());
  Membership& membership = *members_->membership;
  std::lock_guard<std::mutex> lock(membership.mutex);
  if (membership.joined[static_cast<size_t>(rank)]) {
    return InvalidArgument("rank = " + std::to_string(rank) +
                           " has already joined this group (each rank joins once; again only "
                           "after its communicator was destroyed)");
  }
  membership.joined[static_cast<size_t>(rank)] = true;
  return std::unique_ptr<Communicator>(std::make_unique<JoinedCommunicator>(
      members_->communicators.Join(rank), members_->membership));
}

Result<std::unique_ptr<Transport>> LocalGroup::Connect(int rank) {
  if (rank < 0 || rank >= num_ranks()) return RankNotInGroup(rank, num_ranks());
  return members_->fabric.Connect(rank);
}

LocalFabric& FabricOf(LocalGroup& group) { return group.members_->fabric; }

}  // namespace keel
