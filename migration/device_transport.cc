// DeviceTransport. Host-memory messages go to the host transport as they are, under the caller's
// tag. Device-memory messages follow a protocol, carried by control messages over the host
// transport, that decides which device operations every rank launches, in which group and in
// which order, because the device path (NCCL) has no tags and blocks:
//
// Matching. Every device send is announced to its receiver: "send #s to you, tag T, n bytes".
// The receiver matches announcements with its posted device receives by tag, first posted with
// first announced (the other transports' order for one tag), and only the receiver decides when
// a matched pair moves. A size mismatch fails both ends at once, naming the peer, tag and sizes.
//
// Rounds. Device data moves in rounds 1, 2, 3, ... that every rank takes part in. A rank that
// holds matched receives starts the next round; a rank that hears of a round it has not started
// joins it. Starting or joining round k, a rank tells every peer which of that peer's sends it
// takes in round k (matched receives, up to a cap), then "end of round k". Once it has heard
// "end of round k" from every peer, it knows round k's operations with each peer: the sends the
// peer took from it and the receives it took from the peer, each in take order. It launches them
// as one device group: for each peer in rank order its sends, then its receives. A peer's control
// messages are processed in the order it sent them (frame sequence numbers in the tag: the host
// transport may complete messages under different tags out of order), so the two ends of a pair
// list the same operations, in the same order, in the same round. Nobody starts round k+1 before
// hearing every "end of round k", so ranks are at most one round apart.
//
// Why the device groups cannot deadlock. A group holds the stream until each of its operations
// has met its counterpart, and groups run in launch order. (1) Each rank launches at most one
// group per round, in increasing round order. (2) For every pair (a, b) and round k, a's round-k
// group holds exactly the counterparts of the operations with a in b's round-k group, in the same
// order in each direction, and an operation never changes round. (3) Every live rank eventually
// launches every round (it joins any round it hears of, and the rounds of a live rank are heard
// by all). Take the lowest round k whose group has not completed on some rank. Every earlier group
// on every rank is complete, so every round-k group is at the head of its stream, and every
// operation in it is matched by an operation in a round-k group, also at the head of its stream.
// NCCL progresses the operations of one group independently of each other when both ends group
// them the same way (its documented group semantics, which (2) gives), so all round-k groups
// complete; by induction every round does. Waits only point from round k to lower rounds on the
// same stream or to round k on another stream, so no cycle exists, whatever the post orders, the
// number of ranks or the timing. Per-pair ordering alone would not do: with a single stream per
// rank, a -> b, b -> c, c -> a transfers issued in different orders close a cycle of three.
//
// Liveness needs every rank to answer rounds, hence the progress thread. A rank that the host
// transport reports failed leaves the rounds and its transfers fail; a rank that stalls stalls
// the rounds until callers give up: Cancel waits cancel_grace_seconds for agreed transfers, then
// aborts the device path of this rank and tells the peers, which abort theirs, so nothing hangs.
#include "migration/device_transport.h"

#include <algorithm>
#include <array>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <list>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>
#include <unordered_map>
#include <vector>

#include "common/number_text.h"
#include "migration/progress_thread.h"

namespace keel {
namespace {

using Clock = std::chrono::steady_clock;

// Control tags: [0xFE | sender rank 16 | frame sequence 40].
constexpr uint64_t kControlTagBase = kDeviceControlTagByte << 56;
constexpr uint64_t kFrameSequenceMask = (uint64_t{1} << 40) - 1;
constexpr int kMaxRanks = 1 << 16;
constexpr int kFramesPostedAhead = 8;  // control receives posted per peer
// A round takes at most this many receives from one peer and in all, so a group stays far below
// what one NCCL group call accepts.
constexpr size_t kMaxTakesPerPeer = 32;
constexpr size_t kMaxTakesPerRound = 512;

enum class RecordType : uint32_t {
  kAnnounce = 1,  // sender -> receiver: send `send` under `tag`, `bytes` bytes
  kTake = 2,      // receiver -> sender: send `send` moves in round `round`
  kRefuse = 3,    // receiver -> sender: send `send` will not move (`reason`; `bytes` expected)
  kWithdraw = 4,  // sender -> receiver: the sender cancels send `send` unless it was taken
  kRoundEnd = 5,  // every rank -> every peer: round `round` took `count` of your sends
  kAborted = 6,   // every rank -> every peer: this rank aborted its device transfers
};

enum class RefuseReason : uint32_t { kSizeMismatch = 1, kCancelled = 2, kWithdrawn = 3 };

struct Record {
  RecordType type = RecordType::kAnnounce;
  RefuseReason reason = RefuseReason::kSizeMismatch;
  uint64_t send = 0;   // the sender's sequence number of a device send to this receiver
  uint64_t round = 0;  // kTake, kRoundEnd
  uint64_t tag = 0;    // kAnnounce
  uint64_t bytes = 0;  // kAnnounce: the send's size; kRefuse: the receive's size
  uint64_t count = 0;  // kRoundEnd
};

// What goes over the host transport: fixed size, because a receive names its exact size.
constexpr int kRecordsPerFrame = 24;
struct Frame {
  uint64_t sequence = 0;
  uint32_t count = 0;
  uint32_t sender = 0;  // checked against the peer the frame came in from
  Record records[kRecordsPerFrame];
};
static_assert(std::is_trivially_copyable_v<Frame>);

std::string TagString(uint64_t tag) {
  char buffer[24];
  std::snprintf(buffer, sizeof(buffer), "0x%llx", static_cast<unsigned long long>(tag));
  return buffer;
}

enum class Stage {
  kPosted,     // receive: waiting for a matching announcement; send: announced
  kMatched,    // receive: matched with an announcement, not yet taken into a round
  kCommitted,  // both ends put it in round `round`; not launched yet
  kLaunched,   // in a launched device group
  kDone,
};

struct DeviceRequest {
  RequestId id = 0;
  int peer = 0;
  bool send = false;
  uint64_t tag = 0;
  std::byte* data = nullptr;
  size_t bytes = 0;
  Stage stage = Stage::kPosted;
  uint64_t send_sequence = 0;  // send: its own; receive: the matched announcement's
  uint64_t round = 0;
  bool withdrawing = false;  // a cancelled send waiting for the receiver's answer
  Status status;

  std::string Describe() const {
    return std::string(send ? "device send to" : "device receive from") + " peer rank " +
           std::to_string(peer) + " under tag " + TagString(tag) + " (" + std::to_string(bytes) +
           " bytes)";
  }
};

// A device send a peer announced and this rank has not yet taken or refused.
struct Announcement {
  uint64_t send = 0;
  uint64_t tag = 0;
  uint64_t bytes = 0;
  DeviceRequest* receive = nullptr;  // the matched receive, if any
};

struct PeerState {
  bool live = true;
  std::string failure;  // why the host transport gave up on the peer
  // Control channel, out: the next frame's sequence and the records waiting for a frame.
  uint64_t next_frame_out = 0;
  std::vector<Record> outbox;
  // Control channel, in: kFramesPostedAhead receives; slot i holds frames i, i + ahead, ...
  uint64_t next_frame_in = 0;
  std::array<Frame, kFramesPostedAhead> inbox{};
  std::array<RequestId, kFramesPostedAhead> inbox_request{};
  std::array<bool, kFramesPostedAhead> inbox_posted{};
  // Matching.
  uint64_t next_send = 0;                        // sequence of this rank's next send to the peer
  std::map<uint64_t, DeviceRequest*> announced;  // this rank's sends not yet taken or refused
  std::deque<Announcement> announcements;        // the peer's sends not yet taken or refused
  std::vector<DeviceRequest*> receives;          // receives from the peer, in post order
  // Rounds.
  uint64_t heard_round = 0;                                     // last "end of round" heard
  std::map<uint64_t, std::vector<DeviceRequest*>> taken_sends;  // [round] sends it took
  std::vector<DeviceRequest*> takes;  // receives this rank takes in the round it collects
};

// One launched device group: its requests and the peers it waits for.
struct Group {
  std::vector<DeviceRequest*> requests;
  std::vector<bool> peers;
};

class DeviceTransport final : public Transport {
 public:
  DeviceTransport(std::unique_ptr<Transport> host, std::unique_ptr<DeviceMover> mover,
                  std::shared_ptr<DeviceMemory> memory, const DeviceTransportOptions& options)
      : host_(std::move(host)),
        mover_(std::move(mover)),
        memory_(std::move(memory)),
        options_(options),
        rank_(host_->rank()),
        num_ranks_(host_->num_ranks()),
        peers_(num_ranks_) {
    std::lock_guard<std::mutex> lock(mutex_);
    for (int p = 0; p < num_ranks_; ++p) {
      if (p == rank_) continue;
      for (int slot = 0; slot < kFramesPostedAhead; ++slot) PostFrameReceive(p, slot, slot);
    }
    if (options_.progress_thread) progress_thread_ = std::thread([this] { DriveProgress(); });
  }

  ~DeviceTransport() override {
    StopProgressThread(progress_thread_, mutex_, stop_, wake_);
    std::lock_guard<std::mutex> lock(mutex_);
    // A group still running cannot be waited for (its peers may be gone): stop it.
    if (!groups_.empty()) mover_->Abort();
    for (const OutFrame& out : out_frames_) host_->Cancel(out.request);
    for (PeerState& peer : peers_) {
      for (int slot = 0; slot < kFramesPostedAhead; ++slot) {
        if (peer.inbox_posted[slot]) host_->Cancel(peer.inbox_request[slot]);
      }
    }
    for (auto& [id, entry] : requests_) {
      if (entry.device == nullptr) host_->Cancel(entry.host_request);
    }
  }

  std::string_view name() const override { return mover_->name(); }
  int rank() const override { return rank_; }
  int num_ranks() const override { return num_ranks_; }
  DeviceMemory* device_memory() override { return memory_.get(); }

  Result<RequestId> PostSend(int peer, uint64_t tag, const std::byte* data, size_t bytes) override {
    // A device send only reads its buffer; the mover's operation type is shared with receives.
    return Post(peer, tag, const_cast<std::byte*>(data), bytes, /*send=*/true);
  }

  Result<RequestId> PostRecv(int peer, uint64_t tag, std::byte* data, size_t bytes) override {
    return Post(peer, tag, data, bytes, /*send=*/false);
  }

  void Progress() override {
    host_->Progress();
    std::lock_guard<std::mutex> lock(mutex_);
    Pump();
  }

  std::optional<Status> Test(RequestId id) override {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = requests_.find(id);
    if (it == requests_.end()) {
      return Internal(std::string(name()) + " transport: unknown request " + std::to_string(id));
    }
    Entry& entry = it->second;
    if (entry.device == nullptr) {
      std::optional<Status> done = host_->Test(entry.host_request);
      if (done) requests_.erase(it);
      return done;
    }
    if (entry.device->stage != Stage::kDone) return std::nullopt;
    Status status = entry.device->status;
    requests_.erase(it);
    return status;
  }

  void Cancel(RequestId id) override {
    std::unique_lock<std::mutex> lock(mutex_);
    auto it = requests_.find(id);
    if (it == requests_.end()) return;
    if (it->second.device == nullptr) {
      host_->Cancel(it->second.host_request);
      requests_.erase(it);
      return;
    }
    DeviceRequest& r = *it->second.device;
    if (!Retract(r)) {
      // Both ends agreed on it, or the receiver has not answered a withdrawal yet: it either
      // completes within the grace period or every device transfer of this rank is aborted.
      const auto limit =
          Clock::now() + std::chrono::duration_cast<Clock::duration>(
                             std::chrono::duration<double>(options_.cancel_grace_seconds));
      while (r.stage != Stage::kDone && Clock::now() < limit) {
        lock.unlock();
        host_->Progress();
        std::this_thread::sleep_for(std::chrono::microseconds(20));
        lock.lock();
        Pump();
      }
      if (r.stage != Stage::kDone) {
        char grace[32];
        std::snprintf(grace, sizeof(grace), "%.1f s", options_.cancel_grace_seconds);
        AbortDevice("cancelling the " + r.Describe() + " did not finish within " + grace);
      }
    }
    requests_.erase(id);
  }

 private:
  // A request handed to the caller: on the host transport, or a device request of ours.
  struct Entry {
    RequestId host_request = 0;
    std::unique_ptr<DeviceRequest> device;
  };
  struct OutFrame {
    int peer = 0;
    RequestId request = 0;
    std::unique_ptr<Frame> frame;  // stays put until the host transport is done with it
  };

  Result<RequestId> Post(int peer, uint64_t tag, std::byte* data, size_t bytes, bool send) {
    if (peer < 0 || peer >= num_ranks_ || peer == rank_) {
      return InvalidArgument(std::string(name()) + " transport: rank " + std::to_string(rank_) +
                             " cannot talk to peer " + std::to_string(peer));
    }
    if ((tag >> 56) == kDeviceControlTagByte) {
      return InvalidArgument(std::string(name()) + " transport: tag " + TagString(tag) +
                             " is reserved for its control messages (top byte 0xfe)");
    }
    std::lock_guard<std::mutex> lock(mutex_);
    const RequestId id = next_id_++;
    if (!memory_->IsDeviceMemory(data)) {
      Result<RequestId> posted =
          send ? host_->PostSend(peer, tag, data, bytes) : host_->PostRecv(peer, tag, data, bytes);
      if (!posted.ok()) return posted.status();
      requests_[id].host_request = *posted;
      return id;
    }
    auto request = std::make_unique<DeviceRequest>();
    DeviceRequest& r = *request;
    r.id = id;
    r.peer = peer;
    r.send = send;
    r.tag = tag;
    r.data = data;
    r.bytes = bytes;
    if (!aborted_.ok()) return Failure(r, aborted_);
    PeerState& state = peers_[peer];
    if (!state.live) return Failure(r, PeerFailed(peer));
    requests_[id].device = std::move(request);
    if (send) {
      r.send_sequence = state.next_send++;
      state.announced[r.send_sequence] = &r;
      state.outbox.push_back(
          {.type = RecordType::kAnnounce, .send = r.send_sequence, .tag = tag, .bytes = bytes});
    } else {
      state.receives.push_back(&r);
      MatchReceive(peer, r);
    }
    Pump();
    wake_.notify_one();
    return id;
  }

  Status Failure(const DeviceRequest& r, const Status& cause) const {
    return Status(cause.code(), r.Describe() + ": " + cause.message());
  }

  Status PeerFailed(int peer) const {
    return Aborted("control messages with peer rank " + std::to_string(peer) +
                   " failed: " + peers_[peer].failure);
  }

  void Finish(DeviceRequest& r, Status status) {
    r.stage = Stage::kDone;
    r.status = status.ok() ? Status::Ok() : Failure(r, status);
  }

  // ---- Matching ----

  void MatchReceive(int peer, DeviceRequest& receive) {
    PeerState& state = peers_[peer];
    for (auto it = state.announcements.begin(); it != state.announcements.end(); ++it) {
      if (it->receive != nullptr || it->tag != receive.tag) continue;
      Pair(peer, it, receive);
      return;
    }
  }

  void MatchAnnouncement(int peer, std::deque<Announcement>::iterator announcement) {
    PeerState& state = peers_[peer];
    for (DeviceRequest* receive : state.receives) {
      if (receive->stage != Stage::kPosted || receive->tag != announcement->tag) continue;
      Pair(peer, announcement, *receive);
      return;
    }
  }

  void Pair(int peer, std::deque<Announcement>::iterator announcement, DeviceRequest& receive) {
    PeerState& state = peers_[peer];
    if (announcement->bytes != receive.bytes) {
      state.outbox.push_back({.type = RecordType::kRefuse,
                              .reason = RefuseReason::kSizeMismatch,
                              .send = announcement->send,
                              .bytes = receive.bytes});
      Finish(receive,
             Internal("message size mismatch: peer rank " + std::to_string(peer) + " sends " +
                      std::to_string(announcement->bytes) + " bytes under tag " +
                      TagString(receive.tag) + ", " + std::to_string(receive.bytes) + " expected"));
      Forget(state.receives, &receive);
      state.announcements.erase(announcement);
      return;
    }
    announcement->receive = &receive;
    receive.stage = Stage::kMatched;
    receive.send_sequence = announcement->send;
    ++matched_;
  }

  static void Forget(std::vector<DeviceRequest*>& list, const DeviceRequest* r) {
    list.erase(std::remove(list.begin(), list.end(), r), list.end());
  }

  // Cancels `r` if no peer can still count on it; false when it must be waited for.
  bool Retract(DeviceRequest& r) {
    PeerState& state = peers_[r.peer];
    switch (r.stage) {
      case Stage::kDone:
        return true;
      case Stage::kPosted:
        if (!r.send) {
          Forget(state.receives, &r);
          return true;
        }
        if (!r.withdrawing) {
          r.withdrawing = true;
          state.outbox.push_back({.type = RecordType::kWithdraw, .send = r.send_sequence});
          Pump();
        }
        return false;
      case Stage::kMatched: {
        auto it = std::find_if(state.announcements.begin(), state.announcements.end(),
                               [&](const Announcement& a) { return a.receive == &r; });
        if (it != state.announcements.end()) state.announcements.erase(it);
        state.outbox.push_back({.type = RecordType::kRefuse,
                                .reason = RefuseReason::kCancelled,
                                .send = r.send_sequence,
                                .bytes = r.bytes});
        --matched_;
        Forget(state.receives, &r);
        Pump();
        return true;
      }
      case Stage::kCommitted:
      case Stage::kLaunched:
        return false;
    }
    return false;
  }

  // ---- Control records from a peer, in the order it sent them ----

  void Handle(int peer, const Record& record) {
    PeerState& state = peers_[peer];
    switch (record.type) {
      case RecordType::kAnnounce: {
        state.announcements.push_back(
            {.send = record.send, .tag = record.tag, .bytes = record.bytes});
        MatchAnnouncement(peer, std::prev(state.announcements.end()));
        return;
      }
      case RecordType::kTake: {
        auto it = state.announced.find(record.send);
        if (it == state.announced.end()) {
          return ProtocolError(peer, "it took send #" + std::to_string(record.send) +
                                         ", which this rank did not announce or already settled");
        }
        DeviceRequest& send = *it->second;
        state.announced.erase(it);
        send.stage = Stage::kCommitted;
        send.round = record.round;
        state.taken_sends[record.round].push_back(&send);
        return;
      }
      case RecordType::kRefuse: {
        auto it = state.announced.find(record.send);
        if (it == state.announced.end()) return;  // already failed here (peer or abort)
        DeviceRequest& send = *it->second;
        state.announced.erase(it);
        if (record.reason == RefuseReason::kSizeMismatch) {
          Finish(send, Internal("message size mismatch: peer rank " + std::to_string(peer) +
                                " expects " + std::to_string(record.bytes) + " bytes under tag " +
                                TagString(send.tag) + ", " + std::to_string(send.bytes) + " sent"));
        } else if (record.reason == RefuseReason::kCancelled) {
          Finish(send, Aborted("peer rank " + std::to_string(peer) + " cancelled its receive"));
        } else {
          Finish(send, Aborted("cancelled"));  // our own withdrawal, confirmed
        }
        return;
      }
      case RecordType::kWithdraw: {
        auto it = std::find_if(state.announcements.begin(), state.announcements.end(),
                               [&](const Announcement& a) { return a.send == record.send; });
        if (it == state.announcements.end()) return;  // taken or refused already: they say so
        if (it->receive != nullptr) {
          // The receive waits for the next send under its tag, as if this one never came.
          DeviceRequest* receive = it->receive;
          receive->stage = Stage::kPosted;
          --matched_;
          state.announcements.erase(it);
          MatchReceive(peer, *receive);
        } else {
          state.announcements.erase(it);
        }
        state.outbox.push_back(
            {.type = RecordType::kRefuse, .reason = RefuseReason::kWithdrawn, .send = record.send});
        return;
      }
      case RecordType::kRoundEnd: {
        if (record.round != state.heard_round + 1 || record.round > round_ + 1) {
          return ProtocolError(peer, "it ended round " + std::to_string(record.round) +
                                         " after round " + std::to_string(state.heard_round) +
                                         " while this rank is in round " + std::to_string(round_));
        }
        const size_t taken =
            state.taken_sends.count(record.round) == 0 ? 0 : state.taken_sends[record.round].size();
        if (taken != record.count) {
          return ProtocolError(peer, "round " + std::to_string(record.round) + " took " +
                                         std::to_string(record.count) + " sends, " +
                                         std::to_string(taken) + " arrived");
        }
        state.heard_round = record.round;
        return;
      }
      case RecordType::kAborted:
        return AbortDevice("peer rank " + std::to_string(peer) + " aborted its device transfers",
                           /*tell_peers=*/false);
    }
    ProtocolError(peer, "unknown record type " + std::to_string(static_cast<int>(record.type)));
  }

  void ProtocolError(int peer, const std::string& what) {
    AbortDevice("control protocol error with peer rank " + std::to_string(peer) + ": " + what);
  }

  // ---- Rounds ----

  bool AnyPeerAhead() const {
    for (int p = 0; p < num_ranks_; ++p) {
      if (p != rank_ && peers_[p].live && peers_[p].heard_round > round_) return true;
    }
    return false;
  }

  void StartRound() {
    ++round_;
    collecting_ = true;
    size_t total = 0;
    for (int p = 0; p < num_ranks_; ++p) {
      PeerState& state = peers_[p];
      if (p == rank_ || !state.live) continue;
      state.takes.clear();
      for (auto it = state.announcements.begin(); it != state.announcements.end() &&
                                                  state.takes.size() < kMaxTakesPerPeer &&
                                                  total < kMaxTakesPerRound;) {
        if (it->receive == nullptr) {
          ++it;
          continue;
        }
        DeviceRequest& receive = *it->receive;
        receive.stage = Stage::kCommitted;
        receive.round = round_;
        state.takes.push_back(&receive);
        Forget(state.receives, &receive);
        state.outbox.push_back({.type = RecordType::kTake, .send = it->send, .round = round_});
        --matched_;
        ++total;
        it = state.announcements.erase(it);
      }
      state.outbox.push_back(
          {.type = RecordType::kRoundEnd, .round = round_, .count = state.takes.size()});
    }
  }

  bool RoundHeard() const {
    for (int p = 0; p < num_ranks_; ++p) {
      if (p != rank_ && peers_[p].live && peers_[p].heard_round < round_) return false;
    }
    return true;
  }

  void LaunchRound() {
    collecting_ = false;
    std::vector<DeviceOp> ops;
    Group group;
    group.peers.assign(num_ranks_, false);
    for (int p = 0; p < num_ranks_; ++p) {
      PeerState& state = peers_[p];
      if (p == rank_) continue;
      auto sends = state.taken_sends.find(round_);
      std::vector<DeviceRequest*> taken_sends;
      if (sends != state.taken_sends.end()) {
        taken_sends = std::move(sends->second);
        state.taken_sends.erase(sends);
      }
      for (const std::vector<DeviceRequest*>* list : {&taken_sends, &state.takes}) {
        for (DeviceRequest* r : *list) {
          group.requests.push_back(r);
          // An empty message meets nobody on the device; it completes with its group.
          if (r->bytes > 0) {
            ops.push_back({.peer = p, .send = r->send, .data = r->data, .bytes = r->bytes});
            group.peers[p] = true;
          }
        }
      }
      state.takes.clear();
    }
    if (group.requests.empty()) return;
    if (ops.empty()) {
      for (DeviceRequest* r : group.requests) Finish(*r, Status::Ok());
      return;
    }
    for (DeviceRequest* r : group.requests) r->stage = Stage::kLaunched;
    groups_.push_back(std::move(group));
    const Status launched = mover_->Launch(ops);
    if (!launched.ok())
      AbortDevice("launching round " + std::to_string(round_) + ": " + launched.ToString());
  }

  void ReapGroups() {
    if (groups_.empty()) return;
    Result<uint64_t> completed = mover_->Completed();
    if (!completed.ok()) return AbortDevice(completed.status().ToString());
    while (completed_groups_ < *completed && !groups_.empty()) {
      for (DeviceRequest* r : groups_.front().requests) Finish(*r, Status::Ok());
      groups_.pop_front();
      ++completed_groups_;
    }
  }

  // ---- Failures ----

  // The host transport gave up on `peer`: its transfers that are not in a launched group fail;
  // a launched group that waits for it can never complete, so it is aborted with all others.
  void PeerLost(int peer, const Status& why) {
    PeerState& state = peers_[peer];
    if (!state.live) return;
    state.live = false;
    state.failure = why.message();
    const Status failed = PeerFailed(peer);
    for (auto& [sequence, send] : state.announced) Finish(*send, failed);
    state.announced.clear();
    for (auto& [round, sends] : state.taken_sends) {
      for (DeviceRequest* send : sends) Finish(*send, failed);
    }
    state.taken_sends.clear();
    for (DeviceRequest* r : state.receives) {
      if (r->stage == Stage::kMatched) --matched_;
      Finish(*r, failed);
    }
    state.receives.clear();
    for (DeviceRequest* r : state.takes) Finish(*r, failed);
    state.takes.clear();
    state.announcements.clear();
    state.outbox.clear();
    for (const Group& group : groups_) {
      if (group.peers[peer]) {
        AbortDevice(failed.message() + " while a device group with it was in flight");
        return;
      }
    }
  }

  // Stops the device path of this rank for good: the mover aborts (no buffer is touched after
  // this), every device request not yet done fails with `cause`, and the peers are told so they
  // abort theirs instead of waiting for this rank's rounds.
  void AbortDevice(const std::string& cause, bool tell_peers = true) {
    if (!aborted_.ok()) return;
    aborted_ = Aborted(std::string(name()) + " transport on rank " + std::to_string(rank_) +
                       " aborted its device transfers: " + cause);
    mover_->Abort();
    for (auto& [id, entry] : requests_) {
      if (entry.device != nullptr && entry.device->stage != Stage::kDone) {
        Finish(*entry.device, aborted_);
      }
    }
    groups_.clear();
    matched_ = 0;
    collecting_ = false;
    for (int p = 0; p < num_ranks_; ++p) {
      PeerState& state = peers_[p];
      state.announced.clear();
      state.announcements.clear();
      state.receives.clear();
      state.taken_sends.clear();
      state.takes.clear();
      state.outbox.clear();
      if (tell_peers && p != rank_ && state.live) {
        state.outbox.push_back({.type = RecordType::kAborted});
      }
    }
  }

  // ---- Control channel ----

  uint64_t ControlTag(int sender, uint64_t sequence) const {
    return kControlTagBase | (static_cast<uint64_t>(sender) << 40) |
           (sequence & kFrameSequenceMask);
  }

  void PostFrameReceive(int peer, int slot, uint64_t sequence) {
    PeerState& state = peers_[peer];
    Result<RequestId> posted =
        host_->PostRecv(peer, ControlTag(peer, sequence),
                        reinterpret_cast<std::byte*>(&state.inbox[slot]), sizeof(Frame));
    state.inbox_posted[slot] = posted.ok();
    if (!posted.ok()) return PeerLost(peer, posted.status());
    state.inbox_request[slot] = *posted;
  }

  // Processes the peer's frames that landed, in sequence order; true when any did.
  bool ReadFrames(int peer) {
    PeerState& state = peers_[peer];
    bool any = false;
    while (state.live) {
      const int slot = static_cast<int>(state.next_frame_in % kFramesPostedAhead);
      if (!state.inbox_posted[slot]) return any;
      std::optional<Status> done = host_->Test(state.inbox_request[slot]);
      if (!done) return any;
      state.inbox_posted[slot] = false;
      if (!done->ok()) {
        PeerLost(peer, *done);
        return true;
      }
      any = true;
      const Frame frame = state.inbox[slot];
      const uint64_t sequence = state.next_frame_in++;
      PostFrameReceive(peer, slot, sequence + kFramesPostedAhead);
      if (frame.sequence != sequence || frame.sender != static_cast<uint32_t>(peer) ||
          frame.count > kRecordsPerFrame) {
        ProtocolError(peer, "frame " + std::to_string(frame.sequence) + " of rank " +
                                std::to_string(frame.sender) + " with " +
                                std::to_string(frame.count) + " records arrived as frame " +
                                std::to_string(sequence));
        continue;
      }
      // After an abort, frames are still read (so peers' sends complete) but not acted on.
      for (uint32_t i = 0; i < frame.count && aborted_.ok() && state.live; ++i) {
        Handle(peer, frame.records[i]);
      }
    }
    return any;
  }

  bool SendFrames() {
    bool any = false;
    for (int p = 0; p < num_ranks_; ++p) {
      PeerState& state = peers_[p];
      if (p == rank_ || !state.live) continue;
      for (size_t first = 0; first < state.outbox.size() && state.live; first += kRecordsPerFrame) {
        auto frame = std::make_unique<Frame>();
        frame->sequence = state.next_frame_out++;
        frame->sender = static_cast<uint32_t>(rank_);
        frame->count =
            static_cast<uint32_t>(std::min<size_t>(kRecordsPerFrame, state.outbox.size() - first));
        std::copy_n(state.outbox.begin() + first, frame->count, frame->records);
        Result<RequestId> posted =
            host_->PostSend(p, ControlTag(rank_, frame->sequence),
                            reinterpret_cast<const std::byte*>(frame.get()), sizeof(Frame));
        if (!posted.ok()) {
          PeerLost(p, posted.status());
          break;
        }
        out_frames_.push_back({.peer = p, .request = *posted, .frame = std::move(frame)});
        any = true;
      }
      state.outbox.clear();
    }
    return any;
  }

  bool ReapFrames() {
    bool any = false;
    for (auto it = out_frames_.begin(); it != out_frames_.end();) {
      std::optional<Status> done = host_->Test(it->request);
      if (!done) {
        ++it;
        continue;
      }
      any = true;
      const int peer = it->peer;
      it = out_frames_.erase(it);
      if (!done->ok()) PeerLost(peer, *done);
    }
    return any;
  }

  // One pass of the protocol; `mutex_` is held. True when anything moved.
  bool Pump() {
    bool any = ReapFrames();
    for (int p = 0; p < num_ranks_; ++p) {
      if (p != rank_) any |= ReadFrames(p);
    }
    while (aborted_.ok()) {
      if (collecting_ && RoundHeard()) {
        LaunchRound();
        any = true;
        continue;
      }
      if (!collecting_ && (matched_ > 0 || AnyPeerAhead())) {
        StartRound();
        any = true;
        continue;
      }
      break;
    }
    if (aborted_.ok()) ReapGroups();
    any |= SendFrames();
    return any;
  }

  // The progress thread: polls often while device transfers are under way, and backs off to a
  // millisecond while nothing is, because a peer may still start a round at any time.
  void DriveProgress() {
    auto pause = std::chrono::microseconds(20);
    std::unique_lock<std::mutex> lock(mutex_);
    while (!stop_) {
      lock.unlock();
      host_->Progress();
      lock.lock();
      const bool busy = Pump();
      const bool waiting = !groups_.empty() || collecting_ || matched_ > 0;
      if (busy || waiting) {
        pause = std::chrono::microseconds(20);
      } else {
        pause = std::min<std::chrono::microseconds>(2 * pause, std::chrono::milliseconds(1));
      }
      wake_.wait_for(lock, busy ? std::chrono::microseconds(0) : pause);
    }
  }

  std::unique_ptr<Transport> host_;
  std::unique_ptr<DeviceMover> mover_;
  std::shared_ptr<DeviceMemory> memory_;
  const DeviceTransportOptions options_;
  const int rank_;
  const int num_ranks_;

  std::mutex mutex_;  // guards everything below, and every call into host_ and mover_
  RequestId next_id_ = 1;
  std::unordered_map<RequestId, Entry> requests_;
  std::vector<PeerState> peers_;
  std::list<OutFrame> out_frames_;
  size_t matched_ = 0;        // matched receives not yet taken into a round
  uint64_t round_ = 0;        // the last round this rank started or joined
  bool collecting_ = false;   // waiting for every peer's end of round_
  std::deque<Group> groups_;  // launched, not yet completed, in launch order
  uint64_t completed_groups_ = 0;
  Status aborted_;  // not OK once the device path is aborted

  std::condition_variable wake_;
  bool stop_ = false;
  std::thread progress_thread_;  // started last, joined first
};

}  // namespace

Result<std::unique_ptr<Transport>> CreateDeviceTransport(std::unique_ptr<Transport> host,
                                                         std::unique_ptr<DeviceMover> mover,
                                                         std::shared_ptr<DeviceMemory> memory,
                                                         const DeviceTransportOptions& options) {
  if (host == nullptr || mover == nullptr || memory == nullptr) {
    return InvalidArgument(
        "device transport: needs a host transport, a device mover and device memory");
  }
  if (host->num_ranks() > kMaxRanks) {
    return InvalidArgument("device transport: " + std::to_string(host->num_ranks()) +
                           " ranks, at most " + std::to_string(kMaxRanks) +
                           " fit in its control tags");
  }
  if (!(options.cancel_grace_seconds >= 0)) {
    return InvalidArgument("device transport: cancel_grace_seconds must be >= 0, got " +
                           NumberText(options.cancel_grace_seconds));
  }
  return std::unique_ptr<Transport>(std::make_unique<DeviceTransport>(
      std::move(host), std::move(mover), std::move(memory), options));
}

}  // namespace keel
