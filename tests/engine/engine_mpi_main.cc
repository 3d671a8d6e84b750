// The engine across real processes: 4 Open MPI ranks, the MPI communicator and the UCX
// transport. Every rank trains the toy model, then the ranks compare notes: epochs switched at
// the same steps, every row sent where its owner expected it, every copy and home exactly the
// reference. Exit status 0 only when every check passed on this rank. With "guarded" as the third
// argument every slot buffer lives in guarded device memory (CreateGuardedHostMemory).
//
// Flags after the three arguments, for the multi-host test (tests/engine/netns_engine.sh):
//   --deadline S       migration.deadline_seconds (default 10)
//   --step-seconds S   sleep after each StepEnd, as a real step's compute would take
//   --marks DIR        rank 0 creates DIR/step.<step> after each StepEnd, for a script that
//                      cuts a link at a given step
//   --expect-abort     at least one epoch must abort, and a later one commit
//   --sharded          shard experts as ToyShardedExperts says (the shards train their slices)
//   --mp-group M       MP groups of M ranks hold the same tokens; each routes its share
//   --spare-slots      policy.keel.spare_slots: per_step and no transient slots: every transient
//                      fills a persistent slot the placement leaves empty
#include <mpi.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <thread>

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

struct Flags {
  double deadline = 10;
  double step_seconds = 0;
  std::string marks;
  bool expect_abort = false;
  bool sharded = false;
  bool spare_slots = false;
  int mp_group_size = 1;
};

Status Main(const std::string& policy, int steps, const std::string& memory, const Flags& flags) {
  KEEL_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> communicator, CreateMpiCommunicator());
  if (communicator->size() != kRanks) {
    return InvalidArgument("run with mpirun -np " + std::to_string(kRanks));
  }
  const int rank = communicator->rank();
  KeelConfig config = TestConfig(policy);
  config.migration.transport = "ucx";
  config.migration.deadline_seconds = flags.deadline;
  if (flags.spare_slots) {
    config.policy.keel.spare_slots = "per_step";
    config.slots.transient_per_rank = 0;
  }
  std::shared_ptr<DeviceMemory> device;
  if (memory == "guarded") {
    KEEL_ASSIGN_OR_RETURN(device, CreateGuardedHostMemory());
  } else if (memory != "host") {
    return InvalidArgument("memory \"" + memory + "\" is not one of host, guarded");
  }
  RankBuffers buffers;
  RankRecord record;
  RunHooks hooks;
  if (flags.sharded) hooks.sharded_experts = ToyShardedExperts();
  hooks.mp_group_size = flags.mp_group_size;
  std::optional<int64_t> committed_at_abort;  // epochs committed when the first one aborted
  hooks.after_step = [&](Engine& engine, int step) -> Result<bool> {
    const EngineStats stats = engine.stats();
    if (rank == 0 && !flags.marks.empty()) {
      std::FILE* mark = std::fopen((flags.marks + "/step." + std::to_string(step)).c_str(), "w");
      if (mark != nullptr) std::fclose(mark);
    }
    if (stats.epochs_aborted > 0 && !committed_at_abort) {
      committed_at_abort = stats.epochs_committed;
    }
    std::this_thread::sleep_for(std::chrono::duration<double>(flags.step_seconds));
    return false;
  };
  KEEL_RETURN_IF_ERROR(
      RunRank(config, steps, *communicator, nullptr, buffers, record, nullptr, device, hooks));
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
    const EngineStats& stats = record.stats;
    return Internal("the keel policy committed no epoch on the skewed load (" +
                    std::to_string(stats.epochs_aborted) +
                    " aborted, last: " + stats.last_abort.ToString() + "; plans unchanged " +
                    std::to_string(stats.plans_unchanged) + ", failed " +
                    std::to_string(stats.plans_failed) + ")");
  }
  if (flags.expect_abort) {
    if (record.stats.epochs_aborted < 1) return Internal("no epoch aborted");
    if (record.stats.epochs_committed <= committed_at_abort.value_or(0)) {
      return Internal("no epoch committed after the aborted one");
    }
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
  keel::toy::Flags flags;
  for (int i = 4; i < argc; ++i) {
    const std::string flag = argv[i];
    const char* value = i + 1 < argc ? argv[i + 1] : "";
    if (flag == "--sharded") {
      flags.sharded = true;
      continue;
    }
    if (flag == "--spare-slots") {
      flags.spare_slots = true;
      continue;
    }
    if (flag == "--expect-abort") {
      flags.expect_abort = true;
      continue;
    }
    if (flag == "--deadline") {
      flags.deadline = std::atof(value);
    } else if (flag == "--step-seconds") {
      flags.step_seconds = std::atof(value);
    } else if (flag == "--marks") {
      flags.marks = value;
    } else if (flag == "--mp-group") {
      flags.mp_group_size = std::atoi(value);
    } else {
      std::fprintf(stderr, "engine_mpi: unknown flag %s\n", flag.c_str());
      MPI_Finalize();
      return 2;
    }
    ++i;
  }
  const keel::Status status = keel::toy::Main(policy, steps, memory, flags);
  if (!status.ok()) std::fprintf(stderr, "engine_mpi: %s\n", status.ToString().c_str());
  MPI_Finalize();
  return status.ok() ? 0 : 1;
}
