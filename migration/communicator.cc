// LocalCommunicatorGroup: a generation-counted rendezvous under one mutex.
#include "migration/communicator.h"

namespace keel {

class LocalCommunicator final : public Communicator {
 public:
  LocalCommunicator(LocalCommunicatorGroup& group, int rank) : group_(group), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return group_.size_; }
  Result<std::vector<std::string>> AllGather(std::string_view mine) override {
    return group_.AllGather(rank_, mine);
  }
  Status Barrier() override { return group_.AllGather(rank_, "").status(); }

 private:
  LocalCommunicatorGroup& group_;
  int rank_;
};

LocalCommunicatorGroup::LocalCommunicatorGroup(int size) : size_(size), contributions_(size) {}

std::unique_ptr<Communicator> LocalCommunicatorGroup::Join(int rank) {
  return std::make_unique<LocalCommunicator>(*this, rank);
}

Result<std::vector<std::string>> LocalCommunicatorGroup::AllGather(int rank,
                                                                   std::string_view mine) {
  std::unique_lock<std::mutex> lock(mutex_);
  const uint64_t generation = generation_;
  contributions_[rank] = std::string(mine);
  if (++arrived_ == size_) {
    result_ = contributions_;
    arrived_ = 0;
    ++generation_;
    changed_.notify_all();
  } else {
    changed_.wait(lock, [&] { return generation_ != generation; });
  }
  // result_ stays valid until the next generation completes, which needs this rank again.
  return result_;
}

}  // namespace keel
