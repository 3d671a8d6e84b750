// UcxTransport: one UCP context and worker per process, one endpoint per peer (peer error
// handling, so a dead peer fails its requests instead of hanging them), every handle owned by
// an RAII wrapper. Calls are serialized by a mutex; the thread that runs an exchange drives
// progress, and so does the transport's progress thread when there is one.
#include "migration/transport_ucx.h"

#include <ucp/api/ucp.h>

#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "migration/progress_thread.h"

namespace keel {
namespace {

using Clock = std::chrono::steady_clock;

Status UcxError(const std::string& what, ucs_status_t status) {
  return Internal(what + " failed: " + ucs_status_string(status));
}

// RAII owners of UCX handles.
struct ConfigDeleter {
  void operator()(ucp_config_t* c) const { ucp_config_release(c); }
};
struct ContextDeleter {
  void operator()(ucp_context* c) const { ucp_cleanup(c); }
};
struct WorkerDeleter {
  void operator()(ucp_worker* w) const { ucp_worker_destroy(w); }
};
using UcpConfig = std::unique_ptr<ucp_config_t, ConfigDeleter>;
using UcpContext = std::unique_ptr<ucp_context, ContextDeleter>;
using UcpWorker = std::unique_ptr<ucp_worker, WorkerDeleter>;

// The worker's address, released back to the worker.
class WorkerAddress {
 public:
  WorkerAddress(ucp_worker_h worker, ucp_address_t* address, size_t length)
      : worker_(worker), address_(address), length_(length) {}
  ~WorkerAddress() { ucp_worker_release_address(worker_, address_); }
  WorkerAddress(const WorkerAddress&) = delete;
  WorkerAddress& operator=(const WorkerAddress&) = delete;
  std::string_view bytes() const { return {reinterpret_cast<const char*>(address_), length_}; }

 private:
  ucp_worker_h worker_;
  ucp_address_t* address_;
  size_t length_;
};

class UcxTransport;

// One endpoint; closing it (forced, so it never waits on a silent peer) is bounded.
class Endpoint {
 public:
  // `peer_errors`: created with peer error handling, which makes a forced close safe.
  Endpoint(ucp_worker_h worker, ucp_ep_h ep, bool peer_errors)
      : worker_(worker), ep_(ep), peer_errors_(peer_errors) {}
  ~Endpoint() { Close(); }
  Endpoint(const Endpoint&) = delete;
  Endpoint& operator=(const Endpoint&) = delete;
  ucp_ep_h get() const { return ep_; }
  bool peer_errors() const { return peer_errors_; }

  void Close() {
    if (ep_ == nullptr) return;
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    param.flags = peer_errors_ ? UCP_EP_CLOSE_FLAG_FORCE : 0;
    void* request = ucp_ep_close_nbx(ep_, &param);
    ep_ = nullptr;
    if (request == nullptr || UCS_PTR_IS_ERR(request)) return;
    const auto limit = Clock::now() + std::chrono::seconds(1);
    while (ucp_request_check_status(request) == UCS_INPROGRESS && Clock::now() < limit) {
      ucp_worker_progress(worker_);
    }
    ucp_request_free(request);
  }

 private:
  ucp_worker_h worker_;
  ucp_ep_h ep_;
  bool peer_errors_;
};

struct PeerState {
  std::string address;  // the peer's worker address, for reconnecting
  std::unique_ptr<Endpoint> endpoint;
  std::string failure;  // set by the error handler: why the connection broke
  UcxTransport* transport = nullptr;
  int rank = 0;
};

class UcxTransport final : public Transport {
 public:
  UcxTransport(int rank, int num_ranks, UcpContext context, UcpWorker worker,
               const UcxTransportOptions& options, bool carries_cuda)
      : rank_(rank),
        num_ranks_(num_ranks),
        carries_cuda_(carries_cuda),
        options_(options),
        context_(std::move(context)),
        worker_(std::move(worker)),
        peers_(num_ranks) {
    for (int r = 0; r < num_ranks; ++r) {
      peers_[r].transport = this;
      peers_[r].rank = r;
    }
    if (options_.progress_thread) progress_thread_ = std::thread([this] { DriveProgress(); });
  }

  ~UcxTransport() override {
    StopProgressThread(progress_thread_, mutex_, stop_, wake_);
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto& [id, request] : requests_) ReleaseLocked(request, /*cancel=*/true);
    requests_.clear();
    for (PeerState& peer : peers_) peer.endpoint.reset();
  }

  std::string_view name() const override { return "ucx"; }
  int rank() const override { return rank_; }
  int num_ranks() const override { return num_ranks_; }
  bool carries_cuda() const { return carries_cuda_; }

  Status SetPeerAddresses(const std::vector<std::string>& addresses) {
    std::lock_guard<std::mutex> lock(mutex_);
    for (int r = 0; r < num_ranks_; ++r) {
      peers_[r].address = addresses[r];
      if (r != rank_) KEEL_RETURN_IF_ERROR(ConnectLocked(r));
    }
    return Status::Ok();
  }

  Result<RequestId> PostSend(int peer, uint64_t tag, const std::byte* data, size_t bytes) override {
    std::lock_guard<std::mutex> lock(mutex_);
    KEEL_RETURN_IF_ERROR(CheckPeer(peer));
    if (peers_[peer].endpoint == nullptr) KEEL_RETURN_IF_ERROR(ConnectLocked(peer));
    ucp_request_param_t param{};
    void* request = ucp_tag_send_nbx(peers_[peer].endpoint->get(), data, bytes, tag, &param);
    return Track(request, peer, /*send=*/true);
  }

  Result<RequestId> PostRecv(int peer, uint64_t tag, std::byte* data, size_t bytes) override {
    std::lock_guard<std::mutex> lock(mutex_);
    KEEL_RETURN_IF_ERROR(CheckPeer(peer));
    ucp_request_param_t param{};
    void* request = ucp_tag_recv_nbx(worker_.get(), data, bytes, tag, ~ucp_tag_t{0}, &param);
    return Track(request, peer, /*send=*/false);
  }

  void Progress() override {
    // With a progress thread, a caller never waits for it: whoever holds the mutex progresses.
    std::unique_lock<std::mutex> lock(mutex_, std::defer_lock);
    if (progress_thread_.joinable()) {
      if (!lock.try_lock()) return;
    } else {
      lock.lock();
    }
    ProgressLocked();
  }

  std::optional<Status> Test(RequestId id) override {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = requests_.find(id);
    if (it == requests_.end())
      return Internal("ucx transport: unknown request " + std::to_string(id));
    Request& r = it->second;
    Status status;
    if (r.handle != nullptr) {
      const ucs_status_t s = ucp_request_check_status(r.handle);
      if (s == UCS_INPROGRESS) {
        // A receive from a peer whose connection broke will never be matched: fail it now.
        if (peers_[r.peer].failure.empty()) return std::nullopt;
        status = PeerFailed(r.peer);
        ReleaseLocked(r, /*cancel=*/true);
      } else {
        if (s != UCS_OK) status = Describe(r, s);
        ucp_request_free(r.handle);
        r.handle = nullptr;
      }
    } else {
      status = r.status;
    }
    requests_.erase(it);
    return status;
  }

  void Cancel(RequestId id) override {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = requests_.find(id);
    if (it == requests_.end()) return;
    ReleaseLocked(it->second, /*cancel=*/true);
    requests_.erase(it);
  }

  static void OnEndpointError(void* arg, ucp_ep_h /*ep*/, ucs_status_t status) {
    // Called from ucp_worker_progress, i.e. with the transport's mutex held.
    auto* peer = static_cast<PeerState*>(arg);
    peer->failure = ucs_status_string(status);
  }

 private:
  struct Request {
    void* handle = nullptr;  // nullptr: completed at once (status says how)
    Status status;
    int peer = 0;
    bool send = false;
  };

  Status CheckPeer(int peer) const {
    if (peer < 0 || peer >= num_ranks_ || peer == rank_) {
      return InvalidArgument("ucx transport: rank " + std::to_string(rank_) +
                             " cannot talk to peer " + std::to_string(peer));
    }
    return Status::Ok();
  }

  Status PeerFailed(int peer) const {
    return Aborted("peer rank " + std::to_string(peer) + " failed (" + peers_[peer].failure + ")");
  }

  Status Describe(const Request& r, ucs_status_t s) const {
    if (s == UCS_ERR_MESSAGE_TRUNCATED) {
      return Internal("message from peer rank " + std::to_string(r.peer) +
                      " is larger than the receive buffer");
    }
    if (!peers_[r.peer].failure.empty()) return PeerFailed(r.peer);
    return Aborted(std::string(r.send ? "send to" : "receive from") + " peer rank " +
                   std::to_string(r.peer) + " failed (" + ucs_status_string(s) + ")");
  }

  Status ConnectLocked(int peer) {
    PeerState& state = peers_[peer];
    ucp_ep_params_t params{};
    params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                        UCP_EP_PARAM_FIELD_ERR_HANDLER;
    params.address = reinterpret_cast<const ucp_address_t*>(state.address.data());
    params.err_mode =
        peer_errors_supported_ ? UCP_ERR_HANDLING_MODE_PEER : UCP_ERR_HANDLING_MODE_NONE;
    params.err_handler.cb = &UcxTransport::OnEndpointError;
    params.err_handler.arg = &state;
    ucp_ep_h ep = nullptr;
    ucs_status_t s = ucp_ep_create(worker_.get(), &params, &ep);
    bool peer_errors = peer_errors_supported_;
    if (s == UCS_ERR_UNREACHABLE && peer_errors) {
      // Some transports (shared memory in UCX 1.13) cannot report peer failure: connect
      // without it; a dead or stalled peer is then caught by the exchange's deadline.
      params.err_mode = UCP_ERR_HANDLING_MODE_NONE;
      peer_errors = false;
      peer_errors_supported_ = false;  // ask once: UCX logs each refusal
      s = ucp_ep_create(worker_.get(), &params, &ep);
    }
    if (s != UCS_OK) {
      return UcxError("ucp_ep_create to peer rank " + std::to_string(peer), s);
    }
    state.endpoint = std::make_unique<Endpoint>(worker_.get(), ep, peer_errors);
    state.failure.clear();
    return Status::Ok();
  }

  // Up to 64 rounds of UCX progress, fewer when a round finds nothing to do; true when some did.
  bool ProgressLocked() {
    bool any = false;
    for (int i = 0; i < 64 && ucp_worker_progress(worker_.get()) != 0; ++i) any = true;
    return any;
  }

  // The progress thread: sleeps while no request is outstanding; otherwise progresses in bursts,
  // letting go of the mutex in between so callers get their turn, and backs off while the peers
  // have nothing for it.
  void DriveProgress() {
    std::unique_lock<std::mutex> lock(mutex_);
    while (!stop_) {
      if (requests_.empty()) {
        wake_.wait(lock, [this] { return stop_ || !requests_.empty(); });
        continue;
      }
      const bool any = ProgressLocked();
      lock.unlock();
      if (any) {
        std::this_thread::yield();
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(20));
      }
      lock.lock();
    }
  }

  Result<RequestId> Track(void* handle, int peer, bool send) {
    if (UCS_PTR_IS_ERR(handle)) {
      Request r;
      r.peer = peer;
      r.send = send;
      return Describe(r, UCS_PTR_STATUS(handle));
    }
    const RequestId id = next_id_++;
    Request r;
    r.handle = handle;
    r.peer = peer;
    r.send = send;
    requests_.emplace(id, std::move(r));
    wake_.notify_one();
    return id;
  }

  // Lets go of a request: a receive is cancelled; whatever UCX cannot let go of within the
  // grace period (a send to a stalled peer, a receive the peer is feeding) is failed by
  // force-closing the peer's endpoint; the next send reconnects. The peer keeps its end, and a
  // large message it sent over it before it noticed is refused here (UCX completes the receive
  // that takes it with "Request canceled"), which is why an aborting exchange has its live peers
  // take its sends rather than cancel them (exchange.cc, Abort). Without peer error handling a
  // forced close is unsafe: the request is then freed incomplete, which UCX allows (it releases
  // it when it completes); only a send can still be pending then, and a send only reads.
  void ReleaseLocked(Request& r, bool cancel) {
    if (r.handle == nullptr) return;
    if (cancel && !r.send) ucp_request_cancel(worker_.get(), r.handle);
    const auto grace =
        Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(
                           r.send ? 0.0 : options_.cancel_grace_seconds));
    while (ucp_request_check_status(r.handle) == UCS_INPROGRESS && Clock::now() < grace) {
      ucp_worker_progress(worker_.get());
    }
    if (ucp_request_check_status(r.handle) == UCS_INPROGRESS && peers_[r.peer].endpoint &&
        peers_[r.peer].endpoint->peer_errors()) {
      peers_[r.peer].endpoint.reset();  // forced close fails the peer's outstanding requests
      const auto limit = Clock::now() + std::chrono::seconds(1);
      while (ucp_request_check_status(r.handle) == UCS_INPROGRESS && Clock::now() < limit) {
        ucp_worker_progress(worker_.get());
      }
    }
    ucp_request_free(r.handle);
    r.handle = nullptr;
  }

  const int rank_;
  const int num_ranks_;
  const bool carries_cuda_;  // the UCX context supports CUDA memory
  const UcxTransportOptions options_;
  std::mutex mutex_;
  UcpContext context_;
  UcpWorker worker_;  // destroyed before the context (members die in reverse order)
  std::vector<PeerState> peers_;
  std::unordered_map<RequestId, Request> requests_;
  RequestId next_id_ = 1;
  bool peer_errors_supported_ = true;
  std::condition_variable wake_;  // a request was posted, or stop_ was set
  bool stop_ = false;
  std::thread progress_thread_;  // started last, joined first
};

// Every pair of ranks trades one small message, so that UCX wires up every connection now, while
// every rank is alive and progressing. UCX connects lazily, at the first message to a peer; over
// TCP, a first message to a peer that has died in the meantime trips an assertion inside UCX
// 1.13's wire-up and aborts the sender, instead of failing that peer's endpoint. A rank returns
// once it has heard from every peer and its own messages have left, so no peer still needs it to
// progress.
Status ConnectEveryPeer(Transport& transport, std::chrono::duration<double> limit) {
  constexpr uint64_t kHandshakeTag = uint64_t{0xF} << 60;  // above every exchange tag
  const int me = transport.rank();
  const uint64_t mine = kHandshakeTag | static_cast<uint64_t>(me);
  std::vector<uint64_t> landed(transport.num_ranks());
  std::vector<std::pair<RequestId, int>> open;  // request, peer
  for (int peer = 0; peer < transport.num_ranks(); ++peer) {
    if (peer == me) continue;
    KEEL_ASSIGN_OR_RETURN(
        RequestId send,
        transport.PostSend(peer, kHandshakeTag | me, reinterpret_cast<const std::byte*>(&mine),
                           sizeof(mine)));
    open.emplace_back(send, peer);
    KEEL_ASSIGN_OR_RETURN(
        RequestId recv,
        transport.PostRecv(peer, kHandshakeTag | static_cast<uint64_t>(peer),
                           reinterpret_cast<std::byte*>(&landed[peer]), sizeof(uint64_t)));
    open.emplace_back(recv, peer);
  }
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(limit);
  Status failure;
  while (!open.empty() && failure.ok()) {
    transport.Progress();
    for (size_t i = 0; i < open.size();) {
      std::optional<Status> done = transport.Test(open[i].first);
      if (!done) {
        ++i;
        continue;
      }
      if (!done->ok()) failure = *done;
      open[i] = open.back();
      open.pop_back();
    }
    if (failure.ok() && !open.empty() && Clock::now() > deadline) {
      failure =
          DeadlineExceeded("ucx transport: rank " + std::to_string(me) +
                           " could not connect to peer rank " + std::to_string(open[0].second) +
                           " within " + std::to_string(static_cast<int>(limit.count())) + " s");
    }
    if (!open.empty()) std::this_thread::yield();
  }
  for (const auto& [request, peer] : open) transport.Cancel(request);
  return failure;
}

}  // namespace

Result<std::unique_ptr<Transport>> CreateUcxTransport(Communicator& communicator,
                                                      const UcxTransportOptions& options) {
  ucp_config_t* raw_config = nullptr;
  ucs_status_t s = ucp_config_read(nullptr, nullptr, &raw_config);
  if (s != UCS_OK) return UcxError("ucp_config_read", s);
  UcpConfig config(raw_config);
  // UCX connects over TCP with a blocking connect() by default, and connects again at the first
  // send after a forced close. To a host that cannot be reached, that send then blocks for the
  // kernel's connect timeout (a second where ARP fails, minutes where SYNs go unanswered), past
  // any deadline. Connect without blocking unless the user chose otherwise. (A transport's key
  // goes to ucp_config_modify without its prefix, "TCP_"; UCX applies it to every transport that
  // has it.)
  if (std::getenv("UCX_TCP_CONN_NB") == nullptr) {
    s = ucp_config_modify(config.get(), "CONN_NB", "y");
    if (s != UCS_OK) return UcxError("ucp_config_modify CONN_NB=y", s);
  }

  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES;
  params.features = UCP_FEATURE_TAG;
  ucp_context_h raw_context = nullptr;
  s = ucp_init(&params, config.get(), &raw_context);
  if (s != UCS_OK) return UcxError("ucp_init", s);
  UcpContext context(raw_context);
  ucp_context_attr_t context_attributes{};
  context_attributes.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES;
  s = ucp_context_query(context.get(), &context_attributes);
  if (s != UCS_OK) return UcxError("ucp_context_query", s);
  const bool carries_cuda = (context_attributes.memory_types & UCS_BIT(UCS_MEMORY_TYPE_CUDA)) != 0;

  ucp_worker_params_t worker_params{};
  worker_params.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  worker_params.thread_mode = UCS_THREAD_MODE_SERIALIZED;  // our mutex serializes callers
  ucp_worker_h raw_worker = nullptr;
  s = ucp_worker_create(context.get(), &worker_params, &raw_worker);
  if (s != UCS_OK) return UcxError("ucp_worker_create", s);
  UcpWorker worker(raw_worker);

  ucp_address_t* raw_address = nullptr;
  size_t address_length = 0;
  s = ucp_worker_get_address(worker.get(), &raw_address, &address_length);
  if (s != UCS_OK) return UcxError("ucp_worker_get_address", s);
  std::vector<std::string> addresses;
  {
    WorkerAddress address(worker.get(), raw_address, address_length);
    KEEL_ASSIGN_OR_RETURN(addresses, communicator.AllGather(address.bytes()));
  }
  auto transport =
      std::make_unique<UcxTransport>(communicator.rank(), communicator.size(), std::move(context),
                                     std::move(worker), options, carries_cuda);
  KEEL_RETURN_IF_ERROR(transport->SetPeerAddresses(addresses));
  // The barrier keeps early senders from racing peers that have not created their worker's
  // endpoints yet.
  KEEL_RETURN_IF_ERROR(communicator.Barrier());
  KEEL_RETURN_IF_ERROR(ConnectEveryPeer(*transport, std::chrono::seconds(30)));
  return std::unique_ptr<Transport>(std::move(transport));
}

bool UcxCarriesCudaMemory(const Transport& transport) {
  const auto* ucx = dynamic_cast<const UcxTransport*>(&transport);
  return ucx != nullptr && ucx->carries_cuda();
}

}  // namespace keel
