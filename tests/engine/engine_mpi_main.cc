// The engine across real processes: 4 Open MPI ranks, the MPI communicator and the UCX
// transport. Every rank trains the toy model, then the ranks compare notes: epochs switched at
// the same steps, every row sent where its owner expected it, every copy and home exactly the
// reference. Exit status 0 only when every check passed on this rank. With "guarded" as the third
// argument every slot buffer lives in guarded device memory (CreateGuardedHostMemory).
#include <mpi.h>

#include <cstdio>
#include <cstring>

#include "tests/engine/toy_trainer.h"

namespace keel::toy {
namespace {

std::string AsBytes(const std::vector<int64_t>& values) {
  return std::string(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(int64_t));
}

std::vector<int64_t> FromBytes(const std::string& bytes) {
  std::vector<int64_t> values(bytes.size() / sizeof(int64_t));
  std::memcpy(values.data(), bytes.data(), values.size() * sizeof(int64_t));
  return values;
}

Status Main(const std::string& policy, int steps, const std::string& memory) {
  KEEL_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> communicator, CreateMpiCommunicator());
  if (communicator->size() != kRanks) {
    return InvalidArgument("run with mpirun -np " + std::to_string(kRanks));
  }
  const int rank = communicator->rank();
  KeelConfig config = TestConfig(policy);
  config.migration.transport = "ucx";
  std::shared_ptr<DeviceMemory> device;
  if (memory == "guarded") {
    KEEL_ASSIGN_OR_RETURN(device, CreateGuardedHostMemory());
  } else if (memory != "host") {
    return InvalidArgument("memory \"" + memory + "\" is not one of host, guarded");
  }
  RankBuffers buffers;
  RankRecord record;
  KEEL_RETURN_IF_ERROR(
      RunRank(config, steps, *communicator, nullptr, buffers, record, nullptr, device));
  KEEL_RETURN_IF_ERROR(CheckAgainstReference(rank, buffers, record, ComputeReference(steps)));

  KEEL_ASSIGN_OR_RETURN(std::vector<std::string> epochs,
                        communicator->AllGather(AsBytes(record.epoch_after_step)));
  for (int r = 0; r < kRanks; ++r) {
    if (epochs[r] != epochs[0]) {
      return Internal("rank " + std::to_string(r) + " switched epochs at other steps than rank 0");
    }
  }
  KEEL_ASSIGN_OR_RETURN(std::vector<std::string> sent,
                        communicator->AllGather(AsBytes(FlattenSent(record))));
  for (int src = 0; src < kRanks; ++src) {
    KEEL_RETURN_IF_ERROR(CheckRoutingAgrees(src, FromBytes(sent[src]), rank, record));
  }
  if (policy == "keel" && record.stats.epochs_committed < 1) {
    return Internal("the keel policy committed no epoch on the skewed load");
  }
  std::printf(
      "rank %d (%s memory): %d steps, epoch %lld, %lld committed, %lld aborted, %llu bytes moved\n",
      rank, memory.c_str(), steps, static_cast<long long>(record.stats.epoch),
      static_cast<long long>(record.stats.epochs_committed),
      static_cast<long long>(record.stats.epochs_aborted),
      static_cast<unsigned long long>(record.stats.bytes_moved));
  return communicator->Barrier();
}

}  // namespace
}  // namespace keel::toy

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  const std::string policy = argc > 1 ? argv[1] : "keel";
  const int steps = argc > 2 ? std::atoi(argv[2]) : 24;
  const std::string memory = argc > 3 ? argv[3] : "host";
  const keel::Status status = keel::toy::Main(policy, steps, memory);
  if (!status.ok()) std::fprintf(stderr, "engine_mpi: %s\n", status.ToString().c_str());
  MPI_Finalize();
  return status.ok() ? 0 : 1;
}
