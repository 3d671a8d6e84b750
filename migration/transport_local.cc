// LocalFabric: one table of posted requests under a mutex. A send and a receive with the same
// (source, destination, tag) match; the thread that posts the second one copies the bytes
// outside the lock, so ranks copy in parallel.
#include "migration/transport_local.h"

#include <algorithm>
#include <cstring>
#include <string>

namespace keel {

struct LocalFabric::Request {
  int rank = 0;  // the rank that posted it
  int peer = 0;
  uint64_t tag = 0;
  std::byte* data = nullptr;
  size_t bytes = 0;
  bool send = false;
  bool matched = false;  // paired; the copy may be running
  bool complete = false;
  Status status;
};

class LocalTransport final : public Transport {
 public:
  LocalTransport(LocalFabric& fabric, int rank) : fabric_(fabric), rank_(rank) {}
  std::string_view name() const override { return "local"; }
  int rank() const override { return rank_; }
  int num_ranks() const override { return fabric_.num_ranks(); }
  Result<RequestId> PostSend(int peer, uint64_t tag, const std::byte* data, size_t bytes) override {
    // The fabric only reads a send buffer.
    return fabric_.Post(rank_, peer, tag, const_cast<std::byte*>(data), bytes, /*send=*/true);
  }
  Result<RequestId> PostRecv(int peer, uint64_t tag, std::byte* data, size_t bytes) override {
    return fabric_.Post(rank_, peer, tag, data, bytes, /*send=*/false);
  }
  void Progress() override {}
  std::optional<Status> Test(RequestId request) override { return fabric_.Test(rank_, request); }
  void Cancel(RequestId request) override { fabric_.Cancel(rank_, request); }

 private:
  LocalFabric& fabric_;
  int rank_;
};

LocalFabric::LocalFabric(int num_ranks)
    : num_ranks_(num_ranks), stalled_(num_ranks, false), dead_(num_ranks, false) {}

LocalFabric::~LocalFabric() = default;

std::unique_ptr<Transport> LocalFabric::Connect(int rank) {
  return std::make_unique<LocalTransport>(*this, rank);
}

bool LocalFabric::Reachable(int a, int b) const { return !stalled_[a] && !stalled_[b]; }

Result<RequestId> LocalFabric::Post(int rank, int peer, uint64_t tag, std::byte* data, size_t bytes,
                                    bool send) {
  if (peer < 0 || peer >= num_ranks_ || peer == rank) {
    return InvalidArgument("local transport: rank " + std::to_string(rank) +
                           " cannot talk to peer " + std::to_string(peer));
  }
  std::unique_lock<std::mutex> lock(mutex_);
  if (dead_[rank]) return Aborted("rank " + std::to_string(rank) + " is dead");
  if (dead_[peer]) {
    return Aborted("peer rank " + std::to_string(peer) + " failed (connection reset)");
  }
  auto request = std::make_unique<Request>();
  request->rank = rank;
  request->peer = peer;
  request->tag = tag;
  request->data = data;
  request->bytes = bytes;
  request->send = send;
  Request* mine = request.get();
  const RequestId id = next_id_++;
  requests_.emplace(id, std::move(request));
  if (Reachable(rank, peer)) {
    for (auto& [other_id, other] : requests_) {
      Request* r = other.get();
      if (r->matched || r->complete || r->send == send || r->rank != peer || r->peer != rank ||
          r->tag != tag) {
        continue;
      }
      Deliver(lock, send ? mine : r, send ? r : mine);
      break;
    }
  }
  return id;
}

void LocalFabric::Deliver(std::unique_lock<std::mutex>& lock, Request* send, Request* recv) {
  send->matched = recv->matched = true;
  if (send->bytes != recv->bytes) {
    const Status mismatch(StatusCode::kInternal,
                          "message size mismatch: " + std::to_string(send->bytes) +
                              " bytes sent, " + std::to_string(recv->bytes) + " expected");
    send->status = recv->status = mismatch;
    send->complete = recv->complete = true;
    return;
  }
  bool corrupt = false;
  if (send->bytes > 64) {
    for (Corruption& c : corruptions_) {
      if (c.src == send->rank && c.dst == recv->rank && c.countdown-- == 0) corrupt = true;
    }
  }
  // Both requests are matched, so neither can be cancelled or reused while the lock is free.
  lock.unlock();
  // An empty message may come with null buffers, which memcpy must not be given.
  if (send->bytes > 0) std::memcpy(recv->data, send->data, send->bytes);
  if (corrupt) recv->data[send->bytes / 2] ^= std::byte{0x5a};
  lock.lock();
  send->complete = recv->complete = true;
  copied_.notify_all();
}

std::optional<Status> LocalFabric::Test(int rank, RequestId id) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = requests_.find(id);
  if (it == requests_.end() || it->second->rank != rank) {
    return Internal("local transport: unknown request " + std::to_string(id));
  }
  Request& r = *it->second;
  if (!r.complete && (dead_[r.rank] || dead_[r.peer]) && !r.matched) {
    r.complete = true;
    r.status = Aborted("peer rank " + std::to_string(dead_[r.peer] ? r.peer : r.rank) +
                       " failed (connection reset)");
  }
  if (!r.complete) return std::nullopt;
  Status status = r.status;
  requests_.erase(it);
  return status;
}

void LocalFabric::Cancel(int rank, RequestId id) {
  std::unique_lock<std::mutex> lock(mutex_);
  auto it = requests_.find(id);
  if (it == requests_.end() || it->second->rank != rank) return;
  // A matched request is being copied by another thread: wait for that copy, it is short. Only
  // this rank erases its requests, so `r` stays valid while the lock is released.
  Request* r = it->second.get();
  copied_.wait(lock, [r] { return !r->matched || r->complete; });
  requests_.erase(id);
}

void LocalFabric::Stall(int rank) {
  std::lock_guard<std::mutex> lock(mutex_);
  stalled_[rank] = true;
}

void LocalFabric::Kill(int rank) {
  std::lock_guard<std::mutex> lock(mutex_);
  dead_[rank] = true;
}

void LocalFabric::CorruptChunk(int src, int dst, int nth) {
  std::lock_guard<std::mutex> lock(mutex_);
  corruptions_.push_back({src, dst, nth});
}

}  // namespace keel
