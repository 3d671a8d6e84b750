// Ranks as threads of one process: the communicator each thread-rank joins and the local migration
// transport (migration.transport: local) that moves expert state between them. For a trainer that
// runs its ranks in one process, for tests, and for trying Keel without MPI.
#pragma once

#include <memory>

#include "keel/communicator.hpp"
#include "keel/status.hpp"
#include "keel/transport.hpp"

namespace keel {

class LocalFabric;  // the local transport's shared state (migration/transport_local.h)

class LocalGroup {
 public:
  // InvalidArgument unless num_ranks >= 1.
  static Result<std::unique_ptr<LocalGroup>> Create(int num_ranks);
  ~LocalGroup();
  LocalGroup(const LocalGroup&) = delete;
  LocalGroup& operator=(const LocalGroup&) = delete;

  int num_ranks() const;

  // Rank `rank`'s communicator. A rank joins once; it may join again after its communicator was
  // destroyed. Communicators may outlive the group. InvalidArgument for a rank out of
  // [0, num_ranks) or one whose communicator still exists.
  Result<std::unique_ptr<Communicator>> Join(int rank);

  // Rank `rank`'s local transport; the group must outlive it. InvalidArgument for a rank out of
  // range. An engine whose options name this group connects by itself.
  Result<std::unique_ptr<Transport>> Connect(int rank);

 private:
  struct Members;
  explicit LocalGroup(int num_ranks);
  friend LocalFabric& FabricOf(LocalGroup& group);

  std::unique_ptr<Members> members_;
};

}  // namespace keel
