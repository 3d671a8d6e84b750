// RunExchange: one loop per rank that posts chunk sends and receives per peer up to the pipeline
// depth, copies local moves, verifies checksums, and trades verdicts with every peer; then the
// ranks agree on the outcome, so that a rank lost at any point leaves every survivor with the
// same one.
#include "migration/exchange.h"

#include <algorithm>
#include <array>
#include <cstdio>
#include <cstring>
#include <memory>
#include <optional>
#include <thread>

#include "common/number_text.h"
#include "keel/device_memory.hpp"
#include "kernels/checksum.h"

namespace keel {
namespace {

using Clock = std::chrono::steady_clock;

// Tags of agreement messages carry the round as the item and the sender as the chunk.
enum class Kind : uint64_t { kAgreement = 0, kChunk = 1, kChecksum = 2, kVerdict = 3 };

uint64_t MakeTag(ExchangeChannel channel, Kind kind, uint64_t epoch, uint64_t item,
                 uint64_t chunk) {
  const uint64_t head = static_cast<uint64_t>(channel) * 4 + static_cast<uint64_t>(kind);
  return (head << 60) | ((epoch & 0xFFFFF) << 40) | ((item & 0xFFFFF) << 20) | (chunk & 0xFFFFF);
}

// What a rank tells every peer when its part is over: OK, or the error that aborts the epoch.
struct Verdict {
  uint32_t code = 0;
  uint32_t length = 0;
  int32_t lost_peer = -1;  // a rank the sender knows is gone, else -1
  char message[500] = {};
};
static_assert(sizeof(Verdict) == 512);

// A coordinator's view of the outcome: commit, or the error that aborts the epoch.
struct View {
  uint32_t commit = 0;
  Verdict reason;
};

Status StatusOf(const Verdict& v) {
  return Status(static_cast<StatusCode>(v.code),
                std::string(v.message, std::min<size_t>(v.length, sizeof(v.message))));
}

Verdict MakeVerdict(const Status& status, int lost_peer) {
  Verdict v;
  v.lost_peer = lost_peer;
  v.code = static_cast<uint32_t>(status.code());
  v.length = static_cast<uint32_t>(std::min(status.message().size(), sizeof(v.message)));
  std::memcpy(v.message, status.message().data(), v.length);
  return v;
}

struct Chunk {
  int region = 0;
  size_t offset = 0;
  size_t bytes = 0;
};

struct ItemState {
  const ExchangeItem* item = nullptr;
  int index = 0;
  std::vector<Chunk> chunks;
  size_t next_post = 0;                // next chunk to post (send, receive or local copy)
  size_t done = 0;                     // chunks completed
  std::array<uint64_t, 2> checksum{};  // what the source computed (sender, local copy)
  // With chunks on word boundaries, each chunk is hashed as it is sent, copied or lands, while it
  // is still in cache: the sums of their word terms per region (kernels/checksum.h).
  std::array<uint64_t, 2> source_terms{};
  std::array<uint64_t, 2> destination_terms{};
  // Regions of this rank in device memory: the transport's DeviceMemory copies and checksums
  // them, and the CPU never touches them.
  std::array<bool, 2> source_on_device{};
  std::array<bool, 2> destination_on_device{};
  bool checksum_arrived = false;  // receiver: the sender's checksums landed in trailer
  bool trailer_posted = false;
  std::array<uint64_t, 2> trailer{};  // sender: payload of the trailer; receiver: landing buffer
  bool finished = false;
};

struct Pending {
  RequestId id = 0;
  ItemState* item = nullptr;  // nullptr for verdicts and views
  Kind kind = Kind::kChunk;
  bool send = false;
  int peer = 0;
  size_t bytes = 0;
  size_t chunk = 0;  // index into the item's chunks
};

std::string Seconds(double s) {
  char buffer[32];
  std::snprintf(buffer, sizeof(buffer), "%.1f s", s);
  return buffer;
}

class ExchangeLoop {
 public:
  ExchangeLoop(Transport& transport, std::span<const ExchangeItem> items,
               const ExchangeOptions& options, const ExchangeRun& run, MigrationObserver* observer,
               MigrationReport* report)
      : transport_(transport),
        items_(items),
        options_(options),
        run_(run),
        observer_(observer),
        report_(report),
        device_(transport.device_memory()),
        hash_chunks_(options.chunk_bytes % 8 == 0),
        me_(transport.rank()),
        num_ranks_(transport.num_ranks()),
        send_queue_(num_ranks_),
        recv_queue_(num_ranks_),
        send_next_(num_ranks_, 0),
        recv_next_(num_ranks_, 0),
        send_in_flight_(num_ranks_, 0),
        recv_in_flight_(num_ranks_, 0),
        verdicts_(num_ranks_),
        verdict_received_(num_ranks_, false),
        verdict_sent_to_(num_ranks_, false) {}

  Status Run() {
    start_ = Clock::now();
    deadline_ = start_ + std::chrono::duration_cast<Clock::duration>(options_.deadline);
    KEEL_RETURN_IF_ERROR(Prepare());
    if (report_ != nullptr) report_->transfers = static_cast<int>(states_.size());
    for (int peer = 0; peer < num_ranks_; ++peer) {
      if (!Peer(peer)) continue;
      Track(transport_.PostRecv(peer, Tag(Kind::kVerdict, peer, 0),
                                reinterpret_cast<std::byte*>(&verdicts_[peer]), sizeof(Verdict)),
            Pending{.item = nullptr, .kind = Kind::kVerdict, .peer = peer});
    }
    int idle = 0;
    while (!failure_) {
      bool busy = PostWork();
      transport_.Progress();
      busy |= Reap();
      if (failure_) break;
      if (!verdict_sent_ && AllMineFinished()) {
        Phase(ExchangePhase::kTransfersDone);
        SendVerdicts(Status::Ok());
      }
      if (verdict_sent_ && pending_.empty() && AllVerdictsReceived()) break;  // all OK
      if (Cancelled()) {
        Fail("cancelled by the caller");
        break;
      }
      if (Clock::now() > deadline_) {
        Fail(Blame());
        break;
      }
      Pause(busy, idle);
    }
    if (failure_) Abort();
    SetInFlight(0);
    Phase(ExchangePhase::kVotesIn);
    Agree();
    Phase(ExchangePhase::kDecided);
    if (!failure_) return Status::Ok();
    return Status(failure_->code(), run_.what + " aborted: " + failure_->message());
  }

 private:
  // A participating rank other than this one.
  bool Peer(int rank) const {
    return rank != me_ && (run_.participants.empty() || run_.participants[rank]);
  }

  uint64_t Tag(Kind kind, uint64_t item, uint64_t chunk) const {
    return MakeTag(run_.channel, kind, run_.epoch, item, chunk);
  }

  void Pause(bool busy, int& idle) const {
    if (busy) {
      idle = 0;
    } else if (++idle > 64) {
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    } else {
      std::this_thread::yield();
    }
  }

  // A peer this rank knows is gone: one whose request failed here, or one a peer's verdict or
  // view named. Verdicts and views carry it, so that nobody waits for a lost coordinator.
  int LostPeer() const {
    for (int rank = 0; rank < num_ranks_; ++rank) {
      if (failed_peers_[rank]) return rank;
    }
    return -1;
  }

  void LearnLostPeer(const Verdict& v) {
    if (v.lost_peer >= 0 && v.lost_peer < num_ranks_ && v.lost_peer != me_) {
      failed_peers_[v.lost_peer] = true;
    }
  }

  bool Cancelled() const {
    return run_.cancel != nullptr && run_.cancel->load(std::memory_order_relaxed);
  }

  void Phase(ExchangePhase phase, int peer = -1) const {
    if (observer_ != nullptr) observer_->OnExchangePhase(phase, peer);
  }

  // The verdicts alone leave the ranks with different outcomes when a rank is lost while it
  // sends its verdict (some peers heard "OK", some did not), so the ranks agree in two rounds.
  // The two lowest participating ranks coordinate one round each: the coordinator sends its
  // view (commit, or why not) to every participant, and each adopts the view it receives, or
  // keeps its own when the coordinator does not answer in time. With one rank lost at any
  // point, at least one coordinator survives; its round reaches every survivor, and from then on
  // they all hold the same view. A rank views the epoch as committed only when every
  // participant said its transfers landed and verified, so adopting "commit" is always safe.
  // A rank the caller cancels still sends its views but waits for nobody: to the others it is a
  // lost rank.
  void Agree() {
    std::vector<int> coordinators;
    for (int rank = 0; rank < num_ranks_ && coordinators.size() < 2; ++rank) {
      if (rank == me_ || Peer(rank)) coordinators.push_back(rank);
    }
    if (coordinators.size() < 2) return;  // a rank alone has nobody to agree with
    // A coordinator may still be waiting out its own verdict deadline; each round waits for it
    // that long plus a grace.
    const auto grace = std::chrono::duration_cast<Clock::duration>(
        std::clamp(options_.deadline * 0.2, std::chrono::duration<double>(0.2),
                   std::chrono::duration<double>(2.0)));
    auto round_deadline = std::max(deadline_, Clock::now());
    for (size_t round = 0; round < coordinators.size(); ++round) {
      round_deadline += grace;
      const int coordinator = coordinators[round];
      if (coordinator == me_) {
        SendView(round, round_deadline);
      } else {
        ReceiveView(round, coordinator, round_deadline);
      }
    }
    if (!failure_ && report_ != nullptr) report_->lost_ranks = lost_;
  }

  void SendView(size_t round, Clock::time_point deadline) {
    View view;
    view.commit = failure_ ? 0 : 1;
    view.reason = MakeVerdict(failure_ ? *failure_ : Status::Ok(), LostPeer());
    for (int peer = 0; peer < num_ranks_; ++peer) {
      if (!Peer(peer)) continue;
      Phase(ExchangePhase::kAgreementSend, peer);
      Result<RequestId> posted =
          transport_.PostSend(peer, Tag(Kind::kAgreement, round, me_),
                              reinterpret_cast<const std::byte*>(&view), sizeof(View));
      // A peer that cannot be told keeps its view.
      if (posted.ok()) {
        pending_.push_back(
            Pending{.id = *posted, .kind = Kind::kAgreement, .send = true, .peer = peer});
      }
    }
    // `view` must outlive the sends: wait for them, then cancel what a lost peer left open. A
    // transport may hold a send until the peer posts its receive, which a peer still waiting out
    // its votes does late: the sends stay up as long as the receivers wait.
    WaitForSends(deadline);
    for (const Pending& p : pending_) transport_.Cancel(p.id);
    pending_.clear();
  }

  void ReceiveView(size_t round, int coordinator, Clock::time_point deadline) {
    if (failed_peers_[coordinator]) {  // known to be gone: no wait
      lost_.push_back(coordinator);
      return;
    }
    View view;
    Result<RequestId> posted =
        transport_.PostRecv(coordinator, Tag(Kind::kAgreement, round, coordinator),
                            reinterpret_cast<std::byte*>(&view), sizeof(View));
    std::optional<Status> done;
    if (posted.ok()) {
      int idle = 0;
      while (!(done = transport_.Test(*posted)) && Clock::now() < deadline && !Cancelled()) {
        transport_.Progress();
        Pause(false, idle);
      }
      if (!done) transport_.Cancel(*posted);
    }
    if (!done || !done->ok()) {
      lost_.push_back(coordinator);
      if (failure_ &&
          failure_->message().find("rank " + std::to_string(coordinator)) == std::string::npos) {
        failure_ =
            Status(failure_->code(), failure_->message() + "; rank " + std::to_string(coordinator) +
                                         " was lost while the ranks agreed");
      }
      return;
    }
    LearnLostPeer(view.reason);
    if (view.commit != 0) {
      failure_.reset();
    } else if (!failure_) {
      const Status reason = StatusOf(view.reason);
      failure_ = Status(reason.code(), "rank " + std::to_string(coordinator) +
                                           " saw the epoch fail: " + reason.message());
    }
  }

  Status Prepare() {
    if (static_cast<int>(items_.size()) > kMaxExchangeItems) {
      return InvalidArgument(run_.what + ": " + std::to_string(items_.size()) + " moves, at most " +
                             std::to_string(kMaxExchangeItems));
    }
    if (!run_.participants.empty() && static_cast<int>(run_.participants.size()) != num_ranks_) {
      return InvalidArgument(run_.what + ": participants has " +
                             std::to_string(run_.participants.size()) + " entries, expected " +
                             std::to_string(num_ranks_));
    }
    states_.reserve(items_.size());
    for (size_t i = 0; i < items_.size(); ++i) {
      const ExchangeItem& item = items_[i];
      if (item.src_rank != me_ && item.dst_rank != me_) continue;
      if (item.src_rank < 0 || item.src_rank >= num_ranks_ || item.dst_rank < 0 ||
          item.dst_rank >= num_ranks_) {
        return InvalidArgument(item.label + ": rank out of range [0, " +
                               std::to_string(num_ranks_) + ")");
      }
      if (!Peer(item.src_rank == me_ ? item.dst_rank : item.src_rank) &&
          item.src_rank != item.dst_rank) {
        return InvalidArgument(item.label + ": a rank that does not take part");
      }
      ItemState state;
      state.item = &item;
      state.index = static_cast<int>(i);
      for (int r = 0; r < item.num_regions; ++r) {
        if ((item.src_rank == me_ && item.source[r] == nullptr && item.region_bytes[r] > 0) ||
            (item.dst_rank == me_ && item.destination[r] == nullptr && item.region_bytes[r] > 0)) {
          return InvalidArgument(item.label + ": region " + std::to_string(r) +
                                 " has no buffer on rank " + std::to_string(me_));
        }
        if (device_ != nullptr) {
          state.source_on_device[r] =
              item.src_rank == me_ && device_->IsDeviceMemory(item.source[r]);
          state.destination_on_device[r] =
              item.dst_rank == me_ && device_->IsDeviceMemory(item.destination[r]);
        }
        for (size_t off = 0; off < item.region_bytes[r]; off += options_.chunk_bytes) {
          state.chunks.push_back(
              {r, off, std::min(options_.chunk_bytes, item.region_bytes[r] - off)});
        }
      }
      if (state.chunks.size() > static_cast<size_t>(kMaxChunksPerItem)) {
        return InvalidArgument(item.label + ": " + std::to_string(state.chunks.size()) +
                               " chunks, at most " + std::to_string(kMaxChunksPerItem) +
                               "; raise migration.chunk_bytes");
      }
      states_.push_back(std::move(state));
    }
    for (ItemState& state : states_) {
      const ExchangeItem& item = *state.item;
      if (item.src_rank == me_ && item.dst_rank == me_) {
        local_.push_back(&state);
      } else if (item.src_rank == me_) {
        send_queue_[item.dst_rank].push_back(&state);
      } else {
        recv_queue_[item.src_rank].push_back(&state);
        // The trailer's landing buffer is in the state, which does not move from here on.
        Track(transport_.PostRecv(item.src_rank, Tag(Kind::kChecksum, state.index, 0),
                                  reinterpret_cast<std::byte*>(state.trailer.data()),
                                  sizeof(state.trailer)),
              Pending{.item = &state, .kind = Kind::kChecksum, .peer = item.src_rank});
      }
    }
    return Status::Ok();
  }

  // Adds the word terms of chunk `c` of a buffer whose regions start at `regions`; device
  // regions are hashed whole, on the device, by RegionChecksum.
  void HashChunk(const Chunk& c, const std::byte* const* regions,
                 const std::array<bool, 2>& on_device, std::array<uint64_t, 2>& terms) const {
    if (!hash_chunks_ || on_device[c.region]) return;
    terms[c.region] +=
        kernels::cpu::ChecksumTerms({regions[c.region] + c.offset, c.bytes}, c.offset / 8);
  }

  // The checksum of region `r` of `regions`: on the device for device memory, else from the
  // terms of its chunks, or in one pass over the region when chunks do not start on word
  // boundaries.
  Result<uint64_t> RegionChecksum(const ItemState& state, int r, const std::byte* const* regions,
                                  const std::array<bool, 2>& on_device,
                                  const std::array<uint64_t, 2>& terms) const {
    const size_t bytes = state.item->region_bytes[r];
    if (on_device[r]) return device_->Checksum(regions[r], bytes);
    if (hash_chunks_) return kernels::cpu::ChecksumFromTerms(terms[r], bytes);
    return kernels::cpu::Checksum64({regions[r], bytes});
  }

  // Once every chunk is posted or copied; false (and the exchange failed) when a device
  // checksum failed.
  bool ComputeSourceChecksums(ItemState& state) {
    for (int r = 0; r < state.item->num_regions; ++r) {
      Result<uint64_t> checksum =
          RegionChecksum(state, r, state.item->source, state.source_on_device, state.source_terms);
      if (!checksum.ok()) {
        Fail(state.item->label + ": checksum of source region " + std::to_string(r) + ": " +
                 checksum.status().message(),
             checksum.status().code());
        return false;
      }
      state.checksum[r] = *checksum;
    }
    return true;
  }

  bool CapAllows(size_t bytes) const {
    if (options_.bandwidth_cap_bytes_per_second <= 0) return true;
    const double elapsed = std::chrono::duration<double>(Clock::now() - start_).count();
    const double allowed = options_.bandwidth_cap_bytes_per_second * elapsed +
                           static_cast<double>(options_.chunk_bytes);
    return static_cast<double>(capped_bytes_ + bytes) <= allowed;
  }

  bool PostWork() {
    bool busy = false;
    for (int peer = 0; peer < num_ranks_ && !failure_; ++peer) {
      busy |= PostSends(peer);
      busy |= PostRecvs(peer);
    }
    if (!failure_) busy |= CopyLocal();
    return busy;
  }

  bool PostSends(int peer) {
    bool busy = false;
    auto& queue = send_queue_[peer];
    while (send_next_[peer] < queue.size() && send_in_flight_[peer] < options_.pipeline_depth) {
      ItemState& state = *queue[send_next_[peer]];
      const ExchangeItem& item = *state.item;
      if (state.next_post < state.chunks.size()) {
        const Chunk& c = state.chunks[state.next_post];
        if (!CapAllows(c.bytes)) return busy;
        HashChunk(c, item.source, state.source_on_device, state.source_terms);
        Track(transport_.PostSend(peer, Tag(Kind::kChunk, state.index, state.next_post),
                                  item.source[c.region] + c.offset, c.bytes),
              Pending{.item = &state,
                      .kind = Kind::kChunk,
                      .send = true,
                      .peer = peer,
                      .bytes = c.bytes,
                      .chunk = state.next_post});
        if (failure_) return true;
        capped_bytes_ += c.bytes;
        ++state.next_post;
        ++send_in_flight_[peer];
        busy = true;
        continue;
      }
      // Every chunk is posted: the checksums follow on the same peer.
      if (!ComputeSourceChecksums(state)) return true;
      state.trailer = state.checksum;
      Track(transport_.PostSend(peer, Tag(Kind::kChecksum, state.index, 0),
                                reinterpret_cast<const std::byte*>(state.trailer.data()),
                                sizeof(state.trailer)),
            Pending{.item = &state, .kind = Kind::kChecksum, .send = true, .peer = peer});
      state.trailer_posted = true;
      ++send_next_[peer];
      busy = true;
    }
    return busy;
  }

  bool PostRecvs(int peer) {
    bool busy = false;
    auto& queue = recv_queue_[peer];
    // Receives are posted ahead of the sender's window so eager chunks land in place.
    while (recv_next_[peer] < queue.size() && recv_in_flight_[peer] < 2 * options_.pipeline_depth) {
      ItemState& state = *queue[recv_next_[peer]];
      const ExchangeItem& item = *state.item;
      if (state.next_post == state.chunks.size()) {
        ++recv_next_[peer];
        continue;
      }
      const Chunk& c = state.chunks[state.next_post];
      Track(transport_.PostRecv(peer, Tag(Kind::kChunk, state.index, state.next_post),
                                item.destination[c.region] + c.offset, c.bytes),
            Pending{.item = &state,
                    .kind = Kind::kChunk,
                    .peer = peer,
                    .bytes = c.bytes,
                    .chunk = state.next_post});
      if (failure_) return true;
      ++state.next_post;
      ++recv_in_flight_[peer];
      busy = true;
    }
    return busy;
  }

  // One chunk of local copy per call, so remote work keeps progressing in between.
  bool CopyLocal() {
    while (local_next_ < local_.size()) {
      ItemState& state = *local_[local_next_];
      const ExchangeItem& item = *state.item;
      if (state.next_post < state.chunks.size()) {
        const Chunk& c = state.chunks[state.next_post];
        if (!CapAllows(c.bytes)) return false;
        HashChunk(c, item.source, state.source_on_device, state.source_terms);
        std::byte* to = item.destination[c.region] + c.offset;
        const std::byte* from = item.source[c.region] + c.offset;
        if (state.source_on_device[c.region] || state.destination_on_device[c.region]) {
          const Status copied = device_->Copy(to, from, c.bytes);
          if (!copied.ok()) {
            Fail(item.label + ": device copy: " + copied.message(), copied.code());
            return true;
          }
        } else {
          std::memcpy(to, from, c.bytes);
        }
        HashChunk(c, item.destination, state.destination_on_device, state.destination_terms);
        capped_bytes_ += c.bytes;
        ++state.next_post;
        ++state.done;
        if (report_ != nullptr) report_->bytes_copied_locally += c.bytes;
        if (observer_ != nullptr) {
          observer_->OnBytes(transport_.name(), ByteDirection::kCopiedLocally, c.bytes);
        }
        return true;
      }
      if (!ComputeSourceChecksums(state)) return true;
      state.trailer = state.checksum;
      state.checksum_arrived = true;
      Verify(state);
      ++local_next_;
      if (failure_) return true;
    }
    return false;
  }

  void Verify(ItemState& state) {
    const ExchangeItem& item = *state.item;
    for (int r = 0; r < item.num_regions; ++r) {
      const Result<uint64_t> checksum = RegionChecksum(
          state, r, item.destination, state.destination_on_device, state.destination_terms);
      if (!checksum.ok()) {
        Fail(item.label + ": checksum of destination region " + std::to_string(r) + ": " +
                 checksum.status().message(),
             checksum.status().code());
        return;
      }
      const uint64_t got = *checksum;
      if (got != state.trailer[r]) {
        char buffer[96];
        std::snprintf(buffer, sizeof(buffer),
                      "checksum mismatch in region %d (source %016llx, destination %016llx)", r,
                      static_cast<unsigned long long>(state.trailer[r]),
                      static_cast<unsigned long long>(got));
        Fail(item.label + ": " + buffer, StatusCode::kInternal);
        return;
      }
    }
    state.finished = true;
  }

  void Track(Result<RequestId> posted, Pending pending) {
    if (!posted.ok()) {
      Fail(Label(pending) + posted.status().message(), posted.status().code());
      return;
    }
    pending.id = *posted;
    pending_.push_back(pending);
    if (pending.kind == Kind::kChunk) SetInFlight(in_flight_ + 1);
  }

  std::string Label(const Pending& pending) const {
    if (pending.item != nullptr) return pending.item->item->label + ": ";
    return "";
  }

  bool Reap() {
    bool busy = false;
    for (size_t i = 0; i < pending_.size() && !failure_;) {
      Pending& p = pending_[i];
      std::optional<Status> done = transport_.Test(p.id);
      if (!done) {
        ++i;
        continue;
      }
      busy = true;
      const Pending finished = p;
      pending_[i] = pending_.back();
      pending_.pop_back();
      if (!done->ok()) {
        failed_peers_[finished.peer] = true;
        Fail(Label(finished) + done->message(), done->code());
        break;
      }
      Complete(finished);
    }
    return busy;
  }

  void Complete(const Pending& p) {
    if (p.kind == Kind::kVerdict) {
      if (p.send) return;
      verdict_received_[p.peer] = true;
      const Verdict& v = verdicts_[p.peer];
      LearnLostPeer(v);
      if (v.code != 0) {
        const Status reason = StatusOf(v);
        Fail("rank " + std::to_string(p.peer) + " reported: " + reason.message(), reason.code());
      }
      return;
    }
    ItemState& state = *p.item;
    if (p.kind == Kind::kChunk) {
      SetInFlight(in_flight_ - 1);
      ++state.done;
      if (p.send) {
        --send_in_flight_[p.peer];
        if (report_ != nullptr) report_->bytes_sent += p.bytes;
        if (observer_ != nullptr)
          observer_->OnBytes(transport_.name(), ByteDirection::kSent, p.bytes);
      } else {
        --recv_in_flight_[p.peer];
        HashChunk(state.chunks[p.chunk], state.item->destination, state.destination_on_device,
                  state.destination_terms);
        if (report_ != nullptr) report_->bytes_received += p.bytes;
        if (observer_ != nullptr) {
          observer_->OnBytes(transport_.name(), ByteDirection::kReceived, p.bytes);
        }
      }
    } else if (p.send) {
      state.checksum_arrived = true;  // the trailer left: the sender's part is over
    } else {
      state.checksum_arrived = true;
    }
    if (state.done == state.chunks.size() && state.checksum_arrived && !state.finished) {
      if (state.item->dst_rank == me_) {
        Verify(state);
      } else {
        state.finished = true;
      }
    }
  }

  bool AllMineFinished() const {
    return std::all_of(states_.begin(), states_.end(),
                       [](const ItemState& s) { return s.finished; });
  }

  bool AllVerdictsReceived() const {
    for (int peer = 0; peer < num_ranks_; ++peer) {
      if (Peer(peer) && !verdict_received_[peer]) return false;
    }
    return true;
  }

  void SendVerdicts(const Status& status) {
    my_verdict_ = MakeVerdict(status, LostPeer());
    verdict_sent_ = true;
    for (int peer = 0; peer < num_ranks_; ++peer) {
      if (!Peer(peer) || verdict_sent_to_[peer]) continue;
      verdict_sent_to_[peer] = true;
      Phase(ExchangePhase::kVerdictSend, peer);
      Result<RequestId> posted =
          transport_.PostSend(peer, Tag(Kind::kVerdict, me_, 0),
                              reinterpret_cast<const std::byte*>(&my_verdict_), sizeof(Verdict));
      // A peer that cannot be told will find out by its own deadline.
      if (posted.ok()) {
        pending_.push_back(
            Pending{.id = *posted, .kind = Kind::kVerdict, .send = true, .peer = peer});
      }
    }
  }

  void Fail(std::string message, StatusCode code = StatusCode::kAborted) {
    if (failure_) return;
    failure_ = Status(code, std::move(message));
  }

  // Names what the deadline caught unfinished: the first move still waiting on a peer.
  std::string Blame() const {
    const std::string limit = " within the deadline (" + Seconds(options_.deadline.count()) + ")";
    for (const ItemState& s : states_) {
      if (s.finished) continue;
      const ExchangeItem& item = *s.item;
      if (item.dst_rank == me_ && item.src_rank != me_) {
        return item.label + ": peer rank " + std::to_string(item.src_rank) + " did not answer" +
               limit;
      }
    }
    for (const ItemState& s : states_) {
      if (s.finished) continue;
      const ExchangeItem& item = *s.item;
      if (item.src_rank == me_ && item.dst_rank != me_) {
        return item.label + ": peer rank " + std::to_string(item.dst_rank) +
               " did not take the data" + limit;
      }
      return item.label + ": local copy did not finish" + limit;
    }
    for (int peer = 0; peer < num_ranks_; ++peer) {
      if (Peer(peer) && !verdict_received_[peer]) {
        return "peer rank " + std::to_string(peer) + " did not report its transfers" + limit;
      }
    }
    return "the transport did not finish its requests" + limit;
  }

  // Ends a failed exchange without breaking a connection under a live peer. A transport may
  // only be able to stop a send by closing the connection under it (UCX cannot cancel a send,
  // and one sent by rendezvous waits for its receiver to take it), and the peer keeps its end:
  // what the peer has sent over that end by then, such as the first chunks of its next epoch
  // when it aborted sooner, is refused here, and that epoch fails. So the ranks take each
  // other's sends instead of cancelling them. A rank's verdict is the last message it sends a
  // peer, and one peer's messages arrive in order (UCX keeps them so), so once a peer's verdict
  // is in, everything it sent has arrived, and receives posted for every chunk still expected
  // from it take what it sent; this rank's own sends are taken the same way once its peers have
  // its verdict. That may take until the deadline, or 200 ms once the deadline has passed or
  // when the caller cancelled; then whatever is left is cancelled, so that no buffer is touched
  // after we return.
  void Abort() {
    if (!verdict_sent_) SendVerdicts(*failure_);
    const auto grace = Clock::now() + std::chrono::milliseconds(200);
    const auto until = std::max(deadline_, grace);
    for (int peer = 0; peer < num_ranks_; ++peer) {
      if (verdict_received_[peer] && !failed_peers_[peer]) PostRemainingRecvs(peer);
    }
    int idle = 0;
    while (!Released() && Clock::now() < (Cancelled() ? grace : until)) {
      transport_.Progress();
      Pause(ReapAborted(), idle);
    }
    for (const Pending& p : pending_) transport_.Cancel(p.id);
    pending_.clear();
  }

  // Posts a receive for every chunk of `peer` that has none yet: once its verdict is in, what
  // it sent and no receive took waits on this rank's side, and its sender with it.
  void PostRemainingRecvs(int peer) {
    for (ItemState* state : recv_queue_[peer]) {
      const ExchangeItem& item = *state->item;
      for (; state->next_post < state->chunks.size(); ++state->next_post) {
        const Chunk& c = state->chunks[state->next_post];
        Result<RequestId> posted =
            transport_.PostRecv(peer, Tag(Kind::kChunk, state->index, state->next_post),
                                item.destination[c.region] + c.offset, c.bytes);
        if (!posted.ok()) return;  // the peer cannot be reached: nothing of it can be taken
        pending_.push_back(
            Pending{.id = *posted, .item = state, .kind = Kind::kChunk, .peer = peer});
      }
    }
  }

  // Drops what completed while the exchange aborts (the data of an aborted epoch is not used).
  // A peer's verdict lets this rank take the rest of its chunks; a failed request marks its
  // peer gone, so nobody waits for it.
  bool ReapAborted() {
    bool busy = false;
    for (size_t i = 0; i < pending_.size();) {
      std::optional<Status> done = transport_.Test(pending_[i].id);
      if (!done) {
        ++i;
        continue;
      }
      const Pending p = pending_[i];
      pending_[i] = pending_.back();
      pending_.pop_back();
      busy = true;
      if (!done->ok()) {
        failed_peers_[p.peer] = true;
      } else if (p.kind == Kind::kVerdict && !p.send) {
        verdict_received_[p.peer] = true;
        LearnLostPeer(verdicts_[p.peer]);
        PostRemainingRecvs(p.peer);
      }
    }
    return busy;
  }

  // Every live peer has taken this rank's chunks and checksums, and has sent its verdict, after
  // which nothing more comes from it. Waiting for every verdict, not only those of the peers
  // that owe this rank chunks, also leaves none behind for a later exchange under the same tags
  // (the engine retries an aborted epoch under its number), where it would fail the exchange at
  // once. This rank's own verdicts are not waited for: its peers wait for them.
  bool Released() const {
    for (const Pending& p : pending_) {
      if (p.send && p.kind != Kind::kVerdict && !failed_peers_[p.peer]) return false;
    }
    for (int peer = 0; peer < num_ranks_; ++peer) {
      if (Peer(peer) && !failed_peers_[peer] && !verdict_received_[peer]) return false;
    }
    return true;
  }

  // Gives the sends in pending_ until `until` to finish, or until the caller cancels, dropping
  // those that did.
  void WaitForSends(Clock::time_point until) {
    int idle = 0;
    while (Clock::now() < until && !Cancelled()) {
      transport_.Progress();
      bool open = false;
      bool busy = false;
      for (size_t i = 0; i < pending_.size();) {
        if (pending_[i].send && transport_.Test(pending_[i].id)) {
          pending_[i] = pending_.back();
          pending_.pop_back();
          busy = true;
          continue;
        }
        open |= pending_[i].send;
        ++i;
      }
      if (!open) return;
      Pause(busy, idle);
    }
  }

  void SetInFlight(int n) {
    if (n == in_flight_) return;
    in_flight_ = n;
    if (observer_ != nullptr) observer_->OnInFlight(n);
  }

  Transport& transport_;
  std::span<const ExchangeItem> items_;
  const ExchangeOptions& options_;
  const ExchangeRun& run_;
  MigrationObserver* observer_;
  MigrationReport* report_;
  DeviceMemory* const device_;  // the transport's, or nullptr: every buffer is host memory
  const bool hash_chunks_;      // chunks start on word boundaries: hash each as it passes
  const int me_;
  const int num_ranks_;
  Clock::time_point start_;
  Clock::time_point deadline_;

  std::vector<ItemState> states_;
  std::vector<ItemState*> local_;
  size_t local_next_ = 0;
  std::vector<std::vector<ItemState*>> send_queue_;  // [peer] items this rank sends, in order
  std::vector<std::vector<ItemState*>> recv_queue_;  // [peer] items this rank receives
  std::vector<size_t> send_next_;
  std::vector<size_t> recv_next_;
  std::vector<int> send_in_flight_;
  std::vector<int> recv_in_flight_;
  std::vector<Pending> pending_;
  size_t capped_bytes_ = 0;
  int in_flight_ = 0;

  std::vector<Verdict> verdicts_;  // [peer] landing buffers
  std::vector<bool> verdict_received_;
  std::vector<bool> verdict_sent_to_;
  Verdict my_verdict_;
  bool verdict_sent_ = false;
  std::optional<Status> failure_;
  std::vector<int> lost_;  // coordinators that did not answer while the ranks agreed
  // [rank] known to be gone: a request with it failed, or a verdict or view named it
  std::vector<bool> failed_peers_ = std::vector<bool>(num_ranks_);
};

}  // namespace

Result<ExchangeOptions> ExchangeOptions::FromConfig(const MigrationConfig& config) {
  if (config.chunk_bytes < 1) {
    return InvalidArgument("migration.chunk_bytes must be >= 1, got " +
                           std::to_string(config.chunk_bytes));
  }
  if (config.pipeline_depth < 1) {
    return InvalidArgument("migration.pipeline_depth must be >= 1, got " +
                           std::to_string(config.pipeline_depth));
  }
  if (!(config.bandwidth_cap_gb_per_s >= 0)) {
    return InvalidArgument("migration.bandwidth_cap_gb_per_s must be >= 0, got " +
                           NumberText(config.bandwidth_cap_gb_per_s));
  }
  if (!(config.deadline_seconds > 0)) {
    return InvalidArgument("migration.deadline_seconds must be > 0, got " +
                           NumberText(config.deadline_seconds));
  }
  ExchangeOptions options;
  options.chunk_bytes = static_cast<size_t>(config.chunk_bytes);
  options.pipeline_depth = config.pipeline_depth;
  options.bandwidth_cap_bytes_per_second = config.bandwidth_cap_gb_per_s * 1e9;
  options.deadline = std::chrono::duration<double>(config.deadline_seconds);
  return options;
}

Status RunExchange(Transport& transport, std::span<const ExchangeItem> items,
                   const ExchangeOptions& options, const ExchangeRun& run,
                   MigrationObserver* observer, MigrationReport* report) {
  const auto start = Clock::now();
  ExchangeLoop loop(transport, items, options, run, observer, report);
  Status status = loop.Run();
  if (report != nullptr) {
    report->epoch = run.epoch;
    report->transport = transport.name();
    report->status = status;
    report->seconds = std::chrono::duration<double>(Clock::now() - start).count();
  }
  return status;
}

}  // namespace keel
