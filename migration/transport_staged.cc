// StagedTransport: every request is one of ours; a staged one walks copy-out -> host send, or
// host receive -> copy-in, and holds a page-locked buffer from a pool until it is over. Copies
// complete in start order (DeviceMemory), so one CompletedCopies() answers every request. Sends
// reach the host transport in the order they were posted to their peer, a host-memory send
// waiting behind staged ones still copying out.
#include "migration/transport_staged.h"

#include <deque>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

namespace keel {
namespace {

class StagedTransport final : public Transport {
 public:
  // `owned` is null when the host transport is borrowed.
  StagedTransport(std::unique_ptr<Transport> owned, Transport& host,
                  std::shared_ptr<DeviceMemory> device, const StagedTransportOptions& options)
      : owned_(std::move(owned)), host_(&host), device_(std::move(device)), options_(options) {}

  ~StagedTransport() override {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto& [id, request] : requests_) Drop(request);
    requests_.clear();
    for (auto& [bytes, buffers] : pool_) {
      for (std::byte* buffer : buffers) device_->FreeHost(buffer);
    }
  }

  std::string_view name() const override { return host_->name(); }
  int rank() const override { return host_->rank(); }
  int num_ranks() const override { return host_->num_ranks(); }
  DeviceMemory* device_memory() override { return device_.get(); }

  Result<RequestId> PostSend(int peer, uint64_t tag, const std::byte* data, size_t bytes) override {
    std::lock_guard<std::mutex> lock(mutex_);
    Request request;
    request.send = true;
    request.peer = peer;
    request.tag = tag;
    request.bytes = bytes;
    std::deque<RequestId>& unsent = unsent_[peer];
    if (!Staged(data) && unsent.empty()) {
      KEEL_ASSIGN_OR_RETURN(request.host, host_->PostSend(peer, tag, data, bytes));
      return Add(std::move(request));
    }
    if (Staged(data)) {
      KEEL_ASSIGN_OR_RETURN(request.staging, Acquire(bytes));
      Result<uint64_t> copy = device_->StartCopy(request.staging, data, bytes);
      if (!copy.ok()) {
        Release(request.staging, bytes);
        return Staging("send", peer, tag, copy.status());
      }
      request.copy = *copy;
    } else {
      request.source = data;
    }
    request.phase = Phase::kCopyOut;
    const RequestId id = Add(std::move(request));
    unsent.push_back(id);
    return id;
  }

  Result<RequestId> PostRecv(int peer, uint64_t tag, std::byte* data, size_t bytes) override {
    std::lock_guard<std::mutex> lock(mutex_);
    Request request;
    request.peer = peer;
    request.tag = tag;
    request.bytes = bytes;
    if (!Staged(data)) {
      KEEL_ASSIGN_OR_RETURN(request.host, host_->PostRecv(peer, tag, data, bytes));
      return Add(std::move(request));
    }
    KEEL_ASSIGN_OR_RETURN(request.staging, Acquire(bytes));
    Result<RequestId> posted = host_->PostRecv(peer, tag, request.staging, bytes);
    if (!posted.ok()) {
      Release(request.staging, bytes);
      return posted.status();
    }
    request.device = data;
    request.host = *posted;
    return Add(std::move(request));
  }

  void Progress() override {
    std::lock_guard<std::mutex> lock(mutex_);
    host_->Progress();
    RefreshCopies();
    for (auto& [peer, unsent] : unsent_) HandOver(peer);
    for (auto& [id, request] : requests_) Advance(request);
  }

  std::optional<Status> Test(RequestId id) override {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = requests_.find(id);
    if (it == requests_.end()) {
      return Internal("staged transport: unknown request " + std::to_string(id));
    }
    Request& request = it->second;
    if (request.phase != Phase::kDone) {
      RefreshCopies();
      Advance(request);
    }
    if (request.phase != Phase::kDone) return std::nullopt;
    Status result = std::move(request.result);
    Release(request.staging, request.bytes);
    requests_.erase(it);
    return result;
  }

  void Cancel(RequestId id) override {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = requests_.find(id);
    if (it == requests_.end()) return;
    if (it->second.phase == Phase::kCopyOut) std::erase(unsent_[it->second.peer], id);
    Drop(it->second);
    requests_.erase(it);
  }

 private:
  enum class Phase {
    kCopyOut,  // send: device -> staging (or its turn, from host memory), then the host send
    kHost,     // the host transport's request is open
    kCopyIn,   // receive: staging -> device, then done
    kDone,
  };

  struct Request {
    bool send = false;
    int peer = 0;
    uint64_t tag = 0;
    size_t bytes = 0;
    Phase phase = Phase::kHost;
    std::byte* staging = nullptr;       // [bytes] page-locked, for staged requests
    const std::byte* source = nullptr;  // a host-memory send waiting behind staged ones
    std::byte* device = nullptr;        // a staged receive's destination
    uint64_t copy = 0;                  // the number of the copy of kCopyOut / kCopyIn
    RequestId host = 0;                 // the host transport's request, in kHost
    Status result;                      // in kDone
  };

  bool Staged(const void* data) const { return options_.stage && device_->IsDeviceMemory(data); }

  RequestId Add(Request request) {
    const RequestId id = next_id_++;
    requests_.emplace(id, std::move(request));
    return id;
  }

  Status Staging(const char* what, int peer, uint64_t tag, const Status& why) const {
    return Status(why.code(), std::string("staged transport: ") + what + " with rank " +
                                  std::to_string(peer) + " tag " + std::to_string(tag) +
                                  ": device copy: " + why.message());
  }

  void RefreshCopies() {
    if (!copy_failure_.ok()) return;
    Result<uint64_t> completed = device_->CompletedCopies();
    if (completed.ok()) {
      completed_copies_ = *completed;
    } else {
      copy_failure_ = completed.status();
    }
  }

  // Hands the sends to `peer` that wait in copy-out to the host transport, oldest first, up to
  // the first whose copy is still running: a message never overtakes one posted before it to the
  // same peer. The exchange relies on that: a rank's verdict is the last message it sends a peer,
  // and once the peer has it, the peer stops taking chunks.
  void HandOver(int peer) {
    std::deque<RequestId>& unsent = unsent_[peer];
    while (!unsent.empty()) {
      Request& request = requests_.at(unsent.front());
      if (request.staging != nullptr && !copy_failure_.ok()) {
        Finish(request, Staging("send", request.peer, request.tag, copy_failure_));
      } else if (request.staging != nullptr && request.copy >= completed_copies_) {
        return;
      } else {
        const std::byte* data = request.staging != nullptr ? request.staging : request.source;
        Result<RequestId> posted = host_->PostSend(request.peer, request.tag, data, request.bytes);
        if (posted.ok()) {
          request.host = *posted;
          request.phase = Phase::kHost;
        } else {
          Finish(request, posted.status());
        }
      }
      unsent.pop_front();
    }
  }

  // Moves `request` as far as the completed copies and the host transport allow.
  void Advance(Request& request) {
    if (request.phase == Phase::kCopyOut) HandOver(request.peer);
    if (request.phase == Phase::kCopyIn) {
      if (!copy_failure_.ok()) {
        Finish(request, Staging("receive", request.peer, request.tag, copy_failure_));
      } else if (request.copy < completed_copies_) {
        Finish(request, Status::Ok());
      }
      return;
    }
    if (request.phase != Phase::kHost) return;
    std::optional<Status> done = host_->Test(request.host);
    if (!done) return;
    if (!done->ok() || request.device == nullptr) {
      Finish(request, std::move(*done));
      return;
    }
    Result<uint64_t> copy = device_->StartCopy(request.device, request.staging, request.bytes);
    if (!copy.ok()) {
      Finish(request, Staging("receive", request.peer, request.tag, copy.status()));
      return;
    }
    request.copy = *copy;
    request.phase = Phase::kCopyIn;
  }

  static void Finish(Request& request, Status result) {
    request.result = std::move(result);
    request.phase = Phase::kDone;
  }

  // Gives up on `request`: the host transport lets go of its buffer, and a copy in flight is
  // waited for (copies are short and cannot be taken back), so nothing touches either buffer
  // afterwards.
  void Drop(Request& request) {
    if (request.phase == Phase::kHost) host_->Cancel(request.host);
    if ((request.phase == Phase::kCopyOut || request.phase == Phase::kCopyIn) &&
        request.staging != nullptr) {
      while (copy_failure_.ok() && request.copy >= completed_copies_) {
        std::this_thread::yield();
        RefreshCopies();
      }
    }
    Release(request.staging, request.bytes);
    request.staging = nullptr;
    request.phase = Phase::kDone;
  }

  Result<std::byte*> Acquire(size_t bytes) {
    auto it = pool_.find(bytes);
    if (it != pool_.end() && !it->second.empty()) {
      std::byte* buffer = it->second.back();
      it->second.pop_back();
      pooled_bytes_ -= bytes;
      return buffer;
    }
    Result<std::byte*> buffer = device_->AllocateHost(bytes);
    if (!buffer.ok()) {
      return Status(buffer.status().code(), "staged transport: page-locked staging buffer of " +
                                                std::to_string(bytes) +
                                                " bytes: " + buffer.status().message());
    }
    return *buffer;
  }

  void Release(std::byte* buffer, size_t bytes) {
    if (buffer == nullptr) return;
    if (pooled_bytes_ + bytes > options_.pool_bytes) {
      device_->FreeHost(buffer);
      return;
    }
    pool_[bytes].push_back(buffer);
    pooled_bytes_ += bytes;
  }

  std::unique_ptr<Transport> owned_;
  Transport* const host_;
  std::shared_ptr<DeviceMemory> device_;
  const StagedTransportOptions options_;
  std::mutex mutex_;  // guards everything below, and every call into host_
  std::unordered_map<RequestId, Request> requests_;
  std::map<int, std::deque<RequestId>> unsent_;  // [peer] sends in kCopyOut, oldest first
  RequestId next_id_ = 1;
  uint64_t completed_copies_ = 0;
  Status copy_failure_;  // the device stopped copying: every staged request fails with it
  std::map<size_t, std::vector<std::byte*>> pool_;  // free staging buffers by size
  size_t pooled_bytes_ = 0;
};

}  // namespace

Result<std::unique_ptr<Transport>> CreateStagedTransport(std::unique_ptr<Transport> host,
                                                         std::shared_ptr<DeviceMemory> device,
                                                         const StagedTransportOptions& options) {
  if (host == nullptr) return InvalidArgument("staged transport: needs a host transport");
  if (device == nullptr) return InvalidArgument("staged transport: needs device memory");
  Transport& borrowed = *host;
  return std::unique_ptr<Transport>(
      std::make_unique<StagedTransport>(std::move(host), borrowed, std::move(device), options));
}

Result<std::unique_ptr<Transport>> CreateStagedTransport(Transport& host,
                                                         std::shared_ptr<DeviceMemory> device,
                                                         const StagedTransportOptions& options) {
  if (device == nullptr) return InvalidArgument("staged transport: needs device memory");
  return std::unique_ptr<Transport>(
      std::make_unique<StagedTransport>(nullptr, host, std::move(device), options));
}

}  // namespace keel
