// The local backend (ranks as threads), the argument checks, error wording and rank-order folds
// every backend shares, and the interface's defaults for AllToAllVKnownSizes and
// AllToAllVDevice. A local collective is two meetings under one mutex: at the first, every rank
// posts pointers to its own buffers; between the two, each rank copies what is meant for it
// straight out of the others' buffers; the second tells every rank that nobody reads its
// buffers any more.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <numeric>
#include <optional>
#include <type_traits>

#include "comm/communicator.h"

namespace keel {

std::string_view ReduceOpName(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return "sum";
    case ReduceOp::kMin:
      return "min";
    case ReduceOp::kMax:
      return "max";
  }
  return "unknown";
}

namespace collective {
namespace {

// "2.0", "0.3", "0.05": one decimal unless that would hide the value.
std::string FormatSeconds(double seconds) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.1f", seconds);
  if (std::abs(std::strtod(text, nullptr) - seconds) > 1e-9) {
    std::snprintf(text, sizeof(text), "%g", seconds);
  }
  return text;
}

template <typename T>
T Combine(ReduceOp op, T acc, T value) {
  switch (op) {
    case ReduceOp::kSum:
      if constexpr (std::is_integral_v<T>) {
        // Wraps like the two's-complement hardware every backend runs on, without the undefined
        // behaviour of signed overflow.
        return static_cast<T>(static_cast<uint64_t>(acc) + static_cast<uint64_t>(value));
      } else {
        return acc + value;
      }
    case ReduceOp::kMin:
      return std::min(acc, value);
    case ReduceOp::kMax:
      return std::max(acc, value);
  }
  return acc;
}

template <typename T>
void Fold(std::span<const T> gathered, ReduceOp op, std::span<T> out) {
  const size_t n = out.size();
  if (n == 0) return;
  std::copy_n(gathered.begin(), n, out.begin());
  for (size_t base = n; base + n <= gathered.size(); base += n) {
    for (size_t i = 0; i < n; ++i) out[i] = Combine(op, out[i], gathered[base + i]);
  }
}

}  // namespace

namespace {

// InvalidArgument unless `sizes` (`buffer`_bytes) has [size] entries, which add up to
// `buffer_size` unless that is unknown (nullopt).
Status CheckSizes(std::string_view backend, std::string_view collective, std::string_view buffer,
                  int size, std::optional<size_t> buffer_size, std::span<const size_t> sizes) {
  const std::string where = std::string(backend) + " " + std::string(collective) + ": ";
  if (sizes.size() != static_cast<size_t>(size)) {
    return InvalidArgument(where + std::string(buffer) + "_bytes.size() " +
                           std::to_string(sizes.size()) + " != communicator size " +
                           std::to_string(size));
  }
  const size_t total = std::accumulate(sizes.begin(), sizes.end(), size_t{0});
  if (buffer_size.has_value() && total != *buffer_size) {
    return InvalidArgument(where + std::string(buffer) + "_bytes add up to " +
                           std::to_string(total) + " but " + std::string(buffer) + ".size() is " +
                           std::to_string(*buffer_size));
  }
  return Status::Ok();
}

}  // namespace

Status CheckAllToAllV(std::string_view backend, int size, size_t send_size,
                      std::span<const size_t> send_bytes) {
  return CheckSizes(backend, "AllToAllV", "send", size, send_size, send_bytes);
}

Status CheckAllToAllVKnownSizes(std::string_view backend, int size, size_t send_size,
                                std::span<const size_t> send_bytes, size_t recv_size,
                                std::span<const size_t> recv_bytes) {
  constexpr std::string_view kName = "AllToAllVKnownSizes";
  KEEL_RETURN_IF_ERROR(CheckSizes(backend, kName, "send", size, send_size, send_bytes));
  return CheckSizes(backend, kName, "recv", size, recv_size, recv_bytes);
}

Status CheckAllToAllVDevice(std::string_view backend, int size, std::span<const size_t> send_bytes,
                            std::span<const size_t> recv_bytes) {
  constexpr std::string_view kName = "AllToAllVDevice";
  KEEL_RETURN_IF_ERROR(CheckSizes(backend, kName, "send", size, std::nullopt, send_bytes));
  return CheckSizes(backend, kName, "recv", size, std::nullopt, recv_bytes);
}

Status SizeMismatch(std::string_view backend, int from, int to, size_t sent, size_t expected) {
  return InvalidArgument(
      std::string(backend) + " AllToAllVKnownSizes: rank " + std::to_string(from) + " sends " +
      std::to_string(sent) + " bytes to rank " + std::to_string(to) + ", which expects " +
      std::to_string(expected) + " (its recv_bytes[" + std::to_string(from) + "])");
}

Status CheckRoot(std::string_view backend, int size, int root) {
  if (root < 0 || root >= size) {
    return InvalidArgument(std::string(backend) + " Broadcast: root " + std::to_string(root) +
                           " is not a rank in [0, " + std::to_string(size) + ")");
  }
  return Status::Ok();
}

Status TimedOut(std::string_view collective, double seconds, int rank,
                std::span<const int> missing_ranks) {
  std::string message = std::string(collective) + " timed out after " + FormatSeconds(seconds) +
                        " s on rank " + std::to_string(rank);
  if (!missing_ranks.empty()) {
    message += missing_ranks.size() == 1 ? ": rank " : ": ranks ";
    for (size_t i = 0; i < missing_ranks.size(); ++i) {
      if (i > 0) message += ", ";
      message += std::to_string(missing_ranks[i]);
    }
    message += " never arrived";
  }
  return DeadlineExceeded(std::move(message));
}

Status Broken(std::string_view backend, const Status& cause) {
  return Aborted(std::string(backend) + " communicator is broken by an earlier failure (" +
                 cause.ToString() + ")");
}

void FoldInRankOrder(std::span<const int64_t> gathered, ReduceOp op, std::span<int64_t> out) {
  Fold(gathered, op, out);
}

void FoldInRankOrder(std::span<const double> gathered, ReduceOp op, std::span<double> out) {
  Fold(gathered, op, out);
}

}  // namespace collective

// Correct over any backend, at the price of the size exchange inside AllToAllV and one copy.
Status Communicator::AllToAllVKnownSizes(std::span<const std::byte> send,
                                         std::span<const size_t> send_bytes,
                                         std::span<std::byte> recv,
                                         std::span<const size_t> recv_bytes) {
  KEEL_RETURN_IF_ERROR(collective::CheckAllToAllVKnownSizes(name(), size(), send.size(), send_bytes,
                                                            recv.size(), recv_bytes));
  std::vector<std::byte> received;
  std::vector<size_t> received_bytes;
  KEEL_RETURN_IF_ERROR(AllToAllV(send, send_bytes, received, received_bytes));
  for (int r = 0; r < size(); ++r) {
    if (received_bytes[r] != recv_bytes[r]) {
      return collective::SizeMismatch(name(), r, rank(), received_bytes[r], recv_bytes[r]);
    }
  }
  std::copy(received.begin(), received.end(), recv.begin());
  return Status::Ok();
}

Status Communicator::AllToAllVDevice(const std::byte* /*send*/,
                                     std::span<const size_t> /*send_bytes*/, std::byte* /*recv*/,
                                     std::span<const size_t> /*recv_bytes*/) {
  return Unimplemented("the " + std::string(name()) +
                       " communicator does not move device memory (AllToAllVDevice); the "
                       "engine stages device slot buffers through host memory unless "
                       "MovesDeviceMemory() is true");
}

namespace {

enum class Kind {
  kAllGather,
  kBarrier,
  kAllReduceInt64,
  kAllReduceDouble,
  kBroadcast,
  kAllToAllV,
  kAllToAllVKnownSizes
};

std::string_view KindName(Kind kind) {
  switch (kind) {
    case Kind::kAllGather:
      return "AllGather";
    case Kind::kBarrier:
      return "Barrier";
    case Kind::kAllReduceInt64:
    case Kind::kAllReduceDouble:
      return "AllReduce";
    case Kind::kBroadcast:
      return "Broadcast";
    case Kind::kAllToAllV:
      return "AllToAllV";
    case Kind::kAllToAllVKnownSizes:
      return "AllToAllVKnownSizes";
  }
  return "unknown";
}

// Names that tell the two AllReduce overloads apart, for mismatch errors.
std::string_view KindSignature(Kind kind) {
  if (kind == Kind::kAllReduceInt64) return "AllReduce(int64)";
  if (kind == Kind::kAllReduceDouble) return "AllReduce(double)";
  return KindName(kind);
}

// What one rank brings to a collective: pointers into its own buffers, which stay valid and
// unchanged until the collective's second meeting.
struct Posting {
  Kind kind = Kind::kBarrier;
  const void* data = nullptr;            // AllGather: chars; AllReduce: values; Broadcast: bytes;
                                         // AllToAllV: send
  size_t count = 0;                      // elements at `data`
  const size_t* send_bytes = nullptr;    // AllToAllV*: [size] bytes for each rank
  const size_t* send_offsets = nullptr;  // AllToAllV*: [size] where each rank's bytes start
  const size_t* recv_bytes = nullptr;    // AllToAllVKnownSizes: [size] bytes from each rank
  ReduceOp op = ReduceOp::kSum;
  int root = 0;
};

}  // namespace

class LocalCommunicatorGroup::Rendezvous {
 public:
  explicit Rendezvous(int size) : size_(size), present_(size, 0), postings_(size) {}

  int size() const { return size_; }

  // The first meeting: posts `posting` as `rank`'s part and waits until every rank has posted
  // or `timeout_seconds` (<= 0: no limit) pass. A timeout breaks the group for every rank.
  Status Meet(int rank, const Posting& posting, double timeout_seconds) {
    std::unique_lock<std::mutex> lock(mutex_);
    if (!failure_.ok()) return collective::Broken("local", failure_);
    postings_[rank] = posting;
    const uint64_t generation = generation_;
    if (Arrive(rank)) return Status::Ok();
    const auto done = [&] { return generation_ != generation || !failure_.ok(); };
    // Beyond about 30 years the deadline arithmetic would overflow; that is "forever" too.
    if (timeout_seconds <= 0 || timeout_seconds > 1e9) {
      changed_.wait(lock, done);
    } else if (!changed_.wait_for(lock, std::chrono::duration<double>(timeout_seconds), done)) {
      std::vector<int> missing;
      for (int r = 0; r < size_; ++r) {
        if (!present_[r]) missing.push_back(r);
      }
      failure_ = collective::TimedOut(KindName(posting.kind), timeout_seconds, rank, missing);
      changed_.notify_all();
      return failure_;
    }
    if (generation_ != generation) return Status::Ok();
    return failure_;  // another rank gave up waiting for this same meeting
  }

  // The second meeting: returns once every rank has finished reading the others' postings. No
  // timeout: a rank between the meetings only copies memory, it never waits for anything.
  void Release(int rank) {
    std::unique_lock<std::mutex> lock(mutex_);
    const uint64_t generation = generation_;
    if (Arrive(rank)) return;
    changed_.wait(lock, [&] { return generation_ != generation; });
  }

  // Rank `rank`'s posting, between the two meetings.
  const Posting& posting(int rank) const { return postings_[rank]; }

  // Later calls fail with Aborted naming `cause`.
  void Break(const Status& cause) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (failure_.ok()) failure_ = cause;
    changed_.notify_all();
  }

 private:
  // Counts `rank` in; the last rank to arrive completes the meeting and returns true.
  bool Arrive(int rank) {
    present_[rank] = 1;
    if (++arrived_ < size_) return false;
    arrived_ = 0;
    std::fill(present_.begin(), present_.end(), 0);
    ++generation_;
    changed_.notify_all();
    return true;
  }

  const int size_;
  std::mutex mutex_;
  std::condition_variable changed_;
  uint64_t generation_ = 0;  // completed meetings
  int arrived_ = 0;
  std::vector<char> present_;      // [size] arrived at the current meeting
  std::vector<Posting> postings_;  // [size]
  Status failure_;                 // not OK once the group is broken
};

class LocalCommunicator final : public Communicator {
 public:
  using Rendezvous = LocalCommunicatorGroup::Rendezvous;

  LocalCommunicator(std::shared_ptr<Rendezvous> rendezvous, int rank)
      : rendezvous_(std::move(rendezvous)), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return rendezvous_->size(); }
  std::string_view name() const override { return "local"; }

  Result<std::vector<std::string>> AllGather(std::string_view mine) override {
    std::vector<std::string> all(size());
    KEEL_RETURN_IF_ERROR(
        Run({.kind = Kind::kAllGather, .data = mine.data(), .count = mine.size()}, [&] {
          for (int r = 0; r < size(); ++r) {
            const Posting& theirs = rendezvous_->posting(r);
            all[r].assign(static_cast<const char*>(theirs.data), theirs.count);
          }
        }));
    return all;
  }

  Status Barrier() override {
    return Run({.kind = Kind::kBarrier}, [] {});
  }

  Status AllReduce(std::span<int64_t> values, ReduceOp op) override {
    return Reduce(Kind::kAllReduceInt64, values, op);
  }
  Status AllReduce(std::span<double> values, ReduceOp op) override {
    return Reduce(Kind::kAllReduceDouble, values, op);
  }

  Status Broadcast(std::string& bytes, int root) override {
    KEEL_RETURN_IF_ERROR(collective::CheckRoot(name(), size(), root));
    // Only the root's bytes are read, so the others may overwrite theirs between the meetings.
    return Run(
        {.kind = Kind::kBroadcast, .data = bytes.data(), .count = bytes.size(), .root = root}, [&] {
          if (rank_ == root) return;
          const Posting& theirs = rendezvous_->posting(root);
          bytes.assign(static_cast<const char*>(theirs.data), theirs.count);
        });
  }

  Status AllToAllV(std::span<const std::byte> send, std::span<const size_t> send_bytes,
                   std::vector<std::byte>& recv, std::vector<size_t>& recv_bytes) override {
    KEEL_RETURN_IF_ERROR(collective::CheckAllToAllV(name(), size(), send.size(), send_bytes));
    std::vector<size_t> send_offsets(size());
    std::exclusive_scan(send_bytes.begin(), send_bytes.end(), send_offsets.begin(), size_t{0});
    const Posting mine{.kind = Kind::kAllToAllV,
                       .data = send.data(),
                       .count = send.size(),
                       .send_bytes = send_bytes.data(),
                       .send_offsets = send_offsets.data()};
    return Run(mine, [&] {
      recv_bytes.resize(size());
      size_t total = 0;
      for (int r = 0; r < size(); ++r) {
        recv_bytes[r] = rendezvous_->posting(r).send_bytes[rank_];
        total += recv_bytes[r];
      }
      recv.resize(total);
      size_t offset = 0;
      for (int r = 0; r < size(); ++r) {
        const Posting& theirs = rendezvous_->posting(r);
        if (recv_bytes[r] > 0) {
          std::memcpy(recv.data() + offset,
                      static_cast<const std::byte*>(theirs.data) + theirs.send_offsets[rank_],
                      recv_bytes[r]);
        }
        offset += recv_bytes[r];
      }
    });
  }

  // No sizes travel: each rank posts what it expects next to what it sends, and the postings
  // check reads both, so every rank reaches the same verdict on a mismatch.
  Status AllToAllVKnownSizes(std::span<const std::byte> send, std::span<const size_t> send_bytes,
                             std::span<std::byte> recv,
                             std::span<const size_t> recv_bytes) override {
    KEEL_RETURN_IF_ERROR(collective::CheckAllToAllVKnownSizes(name(), size(), send.size(),
                                                              send_bytes, recv.size(), recv_bytes));
    std::vector<size_t> send_offsets(size());
    std::exclusive_scan(send_bytes.begin(), send_bytes.end(), send_offsets.begin(), size_t{0});
    const Posting mine{.kind = Kind::kAllToAllVKnownSizes,
                       .data = send.data(),
                       .count = send.size(),
                       .send_bytes = send_bytes.data(),
                       .send_offsets = send_offsets.data(),
                       .recv_bytes = recv_bytes.data()};
    return Run(mine, [&] {
      size_t offset = 0;
      for (int r = 0; r < size(); ++r) {
        const Posting& theirs = rendezvous_->posting(r);
        if (recv_bytes[r] > 0) {
          std::memcpy(recv.data() + offset,
                      static_cast<const std::byte*>(theirs.data) + theirs.send_offsets[rank_],
                      recv_bytes[r]);
        }
        offset += recv_bytes[r];
      }
    });
  }

 private:
  // One collective: meet, check that the postings match, run `copy` (which reads the others'
  // postings), meet again. Every rank sees the same postings, so every rank reaches the same
  // verdict on a mismatch.
  template <typename Copy>
  Status Run(const Posting& mine, Copy&& copy) {
    KEEL_RETURN_IF_ERROR(rendezvous_->Meet(rank_, mine, timeout_seconds()));
    bool order_differs = false;
    Status status = CheckPostings(order_differs);
    if (status.ok()) copy();
    rendezvous_->Release(rank_);
    // The ranks disagree on which collective comes next: nothing after this can be trusted.
    if (order_differs) rendezvous_->Break(status);
    return status;
  }

  template <typename T>
  Status Reduce(Kind kind, std::span<T> values, ReduceOp op) {
    // The others read `values` until the second meeting, so the result waits in `reduced`.
    std::vector<T> reduced(values.size());
    KEEL_RETURN_IF_ERROR(
        Run({.kind = kind, .data = values.data(), .count = values.size(), .op = op}, [&] {
          for (int r = 0; r < size(); ++r) {
            std::span<const T> theirs(static_cast<const T*>(rendezvous_->posting(r).data),
                                      values.size());
            if (r == 0) {
              std::copy(theirs.begin(), theirs.end(), reduced.begin());
              continue;
            }
            for (size_t i = 0; i < reduced.size(); ++i) {
              reduced[i] = collective::Combine(op, reduced[i], theirs[i]);
            }
          }
        }));
    std::copy(reduced.begin(), reduced.end(), values.begin());
    return Status::Ok();
  }

  // Compares every rank's posting with rank 0's; the same answer on every rank.
  Status CheckPostings(bool& order_differs) const {
    const Posting& first = rendezvous_->posting(0);
    for (int r = 1; r < size(); ++r) {
      const Posting& theirs = rendezvous_->posting(r);
      const std::string where = " on rank " + std::to_string(r) + " but ";
      if (theirs.kind != first.kind) {
        order_differs = true;
        return Internal("local collectives out of order: rank " + std::to_string(r) + " called " +
                        std::string(KindSignature(theirs.kind)) + " while rank 0 called " +
                        std::string(KindSignature(first.kind)));
      }
      if ((first.kind == Kind::kAllReduceInt64 || first.kind == Kind::kAllReduceDouble)) {
        if (theirs.count != first.count) {
          return InvalidArgument("local AllReduce: values.size() is " +
                                 std::to_string(theirs.count) + where +
                                 std::to_string(first.count) + " on rank 0");
        }
        if (theirs.op != first.op) {
          return InvalidArgument("local AllReduce: op is " + std::string(ReduceOpName(theirs.op)) +
                                 where + std::string(ReduceOpName(first.op)) + " on rank 0");
        }
      }
      if (first.kind == Kind::kBroadcast && theirs.root != first.root) {
        return InvalidArgument("local Broadcast: root is " + std::to_string(theirs.root) + where +
                               std::to_string(first.root) + " on rank 0");
      }
    }
    if (first.kind == Kind::kAllToAllVKnownSizes) {
      for (int to = 0; to < size(); ++to) {
        for (int from = 0; from < size(); ++from) {
          const size_t sent = rendezvous_->posting(from).send_bytes[to];
          const size_t expected = rendezvous_->posting(to).recv_bytes[from];
          if (sent != expected) return collective::SizeMismatch(name(), from, to, sent, expected);
        }
      }
    }
    return Status::Ok();
  }

  std::shared_ptr<Rendezvous> rendezvous_;
  const int rank_;
};

LocalCommunicatorGroup::LocalCommunicatorGroup(int size)
    : rendezvous_(std::make_shared<Rendezvous>(size)) {}

LocalCommunicatorGroup::~LocalCommunicatorGroup() = default;

std::unique_ptr<Communicator> LocalCommunicatorGroup::Join(int rank) {
  if (rank < 0 || rank >= rendezvous_->size()) return nullptr;
  return std::make_unique<LocalCommunicator>(rendezvous_, rank);
}

// Backends this build lacks: communicator_mpi.cc and communicator_nccl.cc define them otherwise.
#if !KEEL_COMM_MPI
Result<std::unique_ptr<Communicator>> CreateMpiCommunicator() {
  return Unimplemented(
      "this build of keel has no MPI (KEEL_WITH_MPI=OFF); use LocalGroup (keel_comm_create_local) "
      "for ranks as threads, or rebuild with MPI");
}
#endif
#if !KEEL_COMM_NCCL
Result<std::unique_ptr<Communicator>> CreateNcclCommunicator(Communicator& /*bootstrap*/,
                                                             int /*device*/) {
  return Unimplemented(
      "this build of keel has no NCCL (KEEL_WITH_NCCL=OFF); rebuild on a machine "
      "with CUDA and NCCL");
}
#endif

}  // namespace keel
