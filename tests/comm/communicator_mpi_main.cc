// The MPI communicator across processes, run by tests.cmake under `mpirun -np 4`:
//   --scenario collectives  every collective for many rounds back to back (double sums bitwise
//                           equal to a rank-order fold, uneven and empty all-to-all slices, with
//                           and without known sizes, broadcast from every root) and the argument
//                           errors, a known size that differs from what is sent among them;
//   --scenario timeout      the last rank sleeps instead of calling; the others must get
//                           DeadlineExceeded within about the timeout, then Aborted.
// Exits 0 when every rank saw what it expected.
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "comm/communicator.h"
#include "tests/comm/collective_data.h"

namespace keel {
namespace {

using namespace collective_data;  // NOLINT(build/namespaces): the seeded inputs

using Clock = std::chrono::steady_clock;

int failures = 0;

void Expect(const Communicator& comm, bool ok, const std::string& what) {
  if (ok) return;
  std::fprintf(stderr, "rank %d: FAILED: %s\n", comm.rank(), what.c_str());
  ++failures;
}

void ExpectError(const Communicator& comm, const Status& status, StatusCode code,
                 const std::string& part) {
  Expect(comm, status.code() == code && status.message().find(part) != std::string::npos,
         "expected " + std::string(StatusCodeName(code)) + " containing \"" + part + "\", got " +
             status.ToString());
}

template <typename T>
T Combine(ReduceOp op, T a, T b) {
  if (op == ReduceOp::kSum) return a + b;
  return op == ReduceOp::kMin ? std::min(a, b) : std::max(a, b);
}

template <typename T>
void CheckAllReduce(Communicator& comm, int round, ReduceOp op,
                    std::vector<T> (*values_of)(int, int, size_t)) {
  const size_t n = 1 + round % 37;
  std::vector<T> values = values_of(round, comm.rank(), n);
  const Status status = comm.AllReduce(std::span<T>(values), op);
  Expect(comm, status.ok(), "AllReduce: " + status.ToString());
  std::vector<T> expected = values_of(round, 0, n);
  for (int r = 1; r < comm.size(); ++r) {
    const std::vector<T> theirs = values_of(round, r, n);
    for (size_t i = 0; i < n; ++i) expected[i] = Combine(op, expected[i], theirs[i]);
  }
  Expect(comm, std::memcmp(values.data(), expected.data(), n * sizeof(T)) == 0,
         "AllReduce " + std::string(ReduceOpName(op)) + " round " + std::to_string(round) +
             " differs from the rank-order fold");
}

void CheckRound(Communicator& comm, int round) {
  const std::string mine(static_cast<size_t>(comm.rank() * 5 + round % 11), 'a' + comm.rank());
  Result<std::vector<std::string>> all = comm.AllGather(mine);
  Expect(comm, all.ok(), "AllGather: " + all.status().ToString());
  if (all.ok()) {
    for (int r = 0; r < comm.size(); ++r) {
      Expect(comm, (*all)[r] == std::string(static_cast<size_t>(r * 5 + round % 11), 'a' + r),
             "AllGather contribution of rank " + std::to_string(r));
    }
  }
  Expect(comm, comm.Barrier().ok(), "Barrier");
  for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMin, ReduceOp::kMax}) {
    CheckAllReduce<int64_t>(comm, round, op, IntValues);
    CheckAllReduce<double>(comm, round, op, DoubleValues);
  }
  for (int root = 0; root < comm.size(); ++root) {
    std::string bytes = comm.rank() == root ? BroadcastPayload(round, root) : "stale";
    const Status status = comm.Broadcast(bytes, root);
    Expect(comm, status.ok() && bytes == BroadcastPayload(round, root),
           "Broadcast from root " + std::to_string(root) + ": " + status.ToString());
  }
  std::vector<std::byte> send;
  std::vector<size_t> send_bytes;
  for (int to = 0; to < comm.size(); ++to) {
    const std::vector<std::byte> slice = Slice(round, comm.rank(), to, 50000);
    send.insert(send.end(), slice.begin(), slice.end());
    send_bytes.push_back(slice.size());
  }
  std::vector<std::byte> recv(3);
  std::vector<size_t> recv_bytes(1);
  const Status status = comm.AllToAllV(send, send_bytes, recv, recv_bytes);
  Expect(comm, status.ok(), "AllToAllV: " + status.ToString());
  std::vector<std::byte> expected;
  for (int from = 0; from < comm.size(); ++from) {
    const std::vector<std::byte> slice = Slice(round, from, comm.rank(), 50000);
    Expect(
        comm,
        recv_bytes.size() == static_cast<size_t>(comm.size()) && recv_bytes[from] == slice.size(),
        "AllToAllV bytes from rank " + std::to_string(from));
    expected.insert(expected.end(), slice.begin(), slice.end());
  }
  Expect(comm, recv == expected, "AllToAllV contents in round " + std::to_string(round));

  // The same slices with every size known on both sides: one MPI_Ialltoallv, no counts first.
  std::vector<size_t> known_bytes;
  for (int from = 0; from < comm.size(); ++from) {
    known_bytes.push_back(Slice(round, from, comm.rank(), 50000).size());
  }
  std::vector<std::byte> known(expected.size(), std::byte{0xee});
  const Status known_status = comm.AllToAllVKnownSizes(send, send_bytes, known, known_bytes);
  Expect(comm, known_status.ok(), "AllToAllVKnownSizes: " + known_status.ToString());
  Expect(comm, known == expected, "AllToAllVKnownSizes contents in round " + std::to_string(round));
}

void CheckArgumentErrors(Communicator& comm) {
  std::vector<std::byte> send(10);
  std::vector<std::byte> recv;
  std::vector<size_t> recv_bytes;
  ExpectError(comm, comm.AllToAllV(send, std::vector<size_t>(comm.size() + 1), recv, recv_bytes),
              StatusCode::kInvalidArgument, "send_bytes.size() " + std::to_string(comm.size() + 1));
  std::vector<size_t> wrong_sum(comm.size(), 0);
  wrong_sum[0] = 11;
  ExpectError(comm, comm.AllToAllV(send, wrong_sum, recv, recv_bytes), StatusCode::kInvalidArgument,
              "send_bytes add up to 11 but send.size() is 10");
  std::vector<std::byte> known(3);
  ExpectError(comm,
              comm.AllToAllVKnownSizes(send, wrong_sum, known, std::vector<size_t>(comm.size())),
              StatusCode::kInvalidArgument, "send_bytes add up to 11 but send.size() is 10");
  std::vector<size_t> known_sum(comm.size(), 0);
  ExpectError(comm, comm.AllToAllVKnownSizes({}, known_sum, known, known_sum),
              StatusCode::kInvalidArgument, "recv_bytes add up to 0 but recv.size() is 3");
  std::string bytes = "x";
  ExpectError(comm, comm.Broadcast(bytes, comm.size()), StatusCode::kInvalidArgument,
              "root " + std::to_string(comm.size()));
  // Mismatches only visible across ranks: every rank reports them, and the communicator stays
  // usable because every rank stopped at the same point.
  std::vector<int64_t> values(comm.rank() == 1 ? 3 : 4, 1);
  ExpectError(comm, comm.AllReduce(std::span<int64_t>(values), ReduceOp::kSum),
              StatusCode::kInvalidArgument, "values.size() differs between ranks (3 to 4;");
  std::vector<double> doubles(2, 1.0);
  ExpectError(comm,
              comm.AllReduce(std::span<double>(doubles),
                             comm.rank() == 1 ? ReduceOp::kMax : ReduceOp::kSum),
              StatusCode::kInvalidArgument, "op differs between ranks");
  ExpectError(comm, comm.Broadcast(bytes, comm.rank() == 1 ? 1 : 0), StatusCode::kInvalidArgument,
              "root differs between ranks (0 to 1;");
  // Rank 1 expects a byte more from rank 0 than rank 0 sends: the length that travels with the
  // slice tells rank 1; the others got what they expected.
  std::vector<std::byte> eights(8 * comm.size());
  std::vector<size_t> expected_bytes(comm.size(), 8);
  if (comm.rank() == 1) expected_bytes[0] = 9;
  std::vector<std::byte> received(8 * comm.size() + (comm.rank() == 1 ? 1 : 0));
  const Status mismatch = comm.AllToAllVKnownSizes(eights, std::vector<size_t>(comm.size(), 8),
                                                   received, expected_bytes);
  if (comm.rank() == 1) {
    ExpectError(comm, mismatch, StatusCode::kInvalidArgument,
                "mpi AllToAllVKnownSizes: rank 0 sends 8 bytes to rank 1, which expects 9");
  } else {
    Expect(comm, mismatch.ok(), "AllToAllVKnownSizes beside a mismatch: " + mismatch.ToString());
  }
  Expect(comm, comm.Barrier().ok(), "Barrier after argument errors");
}

int RunCollectives(Communicator& comm) {
  Expect(comm, comm.name() == "mpi", "name() is " + std::string(comm.name()));
  comm.set_timeout_seconds(60);
  for (int round = 0; round < 30; ++round) CheckRound(comm, round);
  CheckArgumentErrors(comm);
  // Everyone learns whether anyone failed.
  std::vector<int64_t> total = {failures};
  Expect(comm, comm.AllReduce(std::span<int64_t>(total), ReduceOp::kSum).ok(), "final AllReduce");
  if (comm.rank() == 0)
    std::printf("%lld failures over %d ranks\n", (long long)total[0], comm.size());
  return total[0] == 0 ? 0 : 1;
}

constexpr double kTimeoutSeconds = 1.0;

int RunTimeout(Communicator& comm) {
  const int missing = comm.size() - 1;
  Expect(comm, comm.Barrier().ok(), "Barrier before the timeout");
  comm.set_timeout_seconds(kTimeoutSeconds);
  if (comm.rank() == missing) {
    // Sleeps through the others' timeout, then leaves without calling.
    std::this_thread::sleep_for(std::chrono::duration<double>(3 * kTimeoutSeconds));
    return failures == 0 ? 0 : 1;
  }
  std::vector<std::byte> send(comm.size());
  std::vector<std::byte> recv;
  std::vector<size_t> recv_bytes;
  const auto start = Clock::now();
  const Status status = comm.AllToAllV(send, std::vector<size_t>(comm.size(), 1), recv, recv_bytes);
  const double waited = std::chrono::duration<double>(Clock::now() - start).count();
  std::printf("rank %d after %.2f s: %s\n", comm.rank(), waited, status.ToString().c_str());
  ExpectError(comm, status, StatusCode::kDeadlineExceeded,
              "AllToAllV timed out after 1.0 s on rank " + std::to_string(comm.rank()));
  Expect(comm, waited >= 0.9 * kTimeoutSeconds && waited < 5 * kTimeoutSeconds,
         "waited " + std::to_string(waited) + " s");
  const Status later = comm.Barrier();
  std::printf("rank %d then: %s\n", comm.rank(), later.ToString().c_str());
  ExpectError(comm, later, StatusCode::kAborted, "mpi communicator is broken");
  // Every rank then finalizes as usual, the abandoned collective still posted on ranks 0..2:
  // Open MPI 4.1 finalizes cleanly and mpirun reports success (no _Exit or MPI_Abort needed).
  return failures == 0 ? 0 : 1;
}

}  // namespace
}  // namespace keel

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  std::string scenario = "collectives";
  for (int i = 1; i + 1 < argc; ++i) {
    if (std::strcmp(argv[i], "--scenario") == 0) scenario = argv[i + 1];
  }
  int rc = 2;
  {
    keel::Result<std::unique_ptr<keel::Communicator>> comm = keel::CreateMpiCommunicator();
    if (!comm.ok()) {
      std::fprintf(stderr, "%s\n", comm.status().ToString().c_str());
    } else if (scenario == "collectives") {
      rc = keel::RunCollectives(**comm);
    } else if (scenario == "timeout") {
      rc = keel::RunTimeout(**comm);
    } else {
      std::fprintf(stderr, "unknown scenario %s\n", scenario.c_str());
    }
  }
  MPI_Finalize();
  return rc;
}
