// Migration benchmarks. Without flags: Google Benchmark over in-process paths (memcpy and
// checksum ceilings, a 16-expert plan over the local transport). With --ucx: forks processes
// that meet in a temporary directory and measure UCX (set UCX_TLS, e.g. sm):
//   pair  64 MiB transfers between 2 processes, raw and chunked+verified, vs memcpy in-process
//   plan  a chunked, pipelined 16-expert plan across 4 processes: aggregate GB/s, time to ready
// --ucx --no-progress-thread: the same with migration.ucx_progress_thread off.
// --ucx --device: the pair in GPU memory (needs a GPU; both processes on it): the transport stages
// through page-locked host buffers, and the ceiling is a device-to-device copy in the same run.
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <thread>
#include <vector>

#include <benchmark/benchmark.h>

#include "keel/device_memory.hpp"
#include "kernels/checksum.h"
#include "migration/exchange.h"
#include "migration/migrator.h"
#include "migration/transport_factory.h"
#include "migration/transport_local.h"
#include "tests/comm/directory_communicator.h"

namespace keel {
namespace {

using Clock = std::chrono::steady_clock;
constexpr size_t kExpertBytes = 64 << 20;
bool progress_thread = true;  // migration.ucx_progress_thread of the --ucx runs
bool on_device = false;       // --ucx --device: the pair's buffers in the transport's device memory

double Seconds(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

void BM_Memcpy64MiB(benchmark::State& state) {
  std::vector<std::byte> a(kExpertBytes, std::byte{1});
  std::vector<std::byte> b(kExpertBytes);
  for (auto _ : state) {
    std::memcpy(b.data(), a.data(), a.size());
    benchmark::DoNotOptimize(b.data());
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * kExpertBytes));
}
BENCHMARK(BM_Memcpy64MiB)->Unit(benchmark::kMillisecond);

void BM_Checksum64MiB(benchmark::State& state) {
  std::vector<std::byte> a(kExpertBytes, std::byte{1});
  for (auto _ : state) benchmark::DoNotOptimize(kernels::cpu::Checksum64(a));
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * kExpertBytes));
}
BENCHMARK(BM_Checksum64MiB)->Unit(benchmark::kMillisecond);

// The 16-expert rotation used by both plan benchmarks: 4 ranks x 8 slots; every rank keeps its
// 4 experts and receives replicas of its right neighbour's 4.
struct RotationPlan {
  std::vector<Placement> from;
  std::vector<Placement> to;
  std::shared_ptr<const TransferPlan> plan;
};

RotationPlan MakeRotation(size_t expert_bytes) {
  std::vector<int> before(32, kEmptySlot);
  std::vector<int> after(32, kEmptySlot);
  for (int r = 0; r < 4; ++r) {
    for (int i = 0; i < 4; ++i) {
      before[r * 8 + i] = after[r * 8 + i] = r * 4 + i;
      after[r * 8 + 4 + i] = ((r + 1) % 4) * 4 + i;
    }
  }
  RotationPlan rotation;
  rotation.from.push_back(*Placement::Create(16, 4, before));
  rotation.to.push_back(*Placement::CreateKeepingHomes(rotation.from[0], after));
  TopologyConfig topology_config;
  topology_config.num_nodes = 1;
  topology_config.gpus_per_node = 4;
  rotation.plan = std::make_shared<TransferPlan>(
      *PlanTransfers(rotation.from, rotation.to, *Topology::Create(topology_config),
                     ExpertLayout{.weight_bytes = expert_bytes, .optimizer_bytes = 0}));
  return rotation;
}

void BM_LocalTransport16ExpertPlan(benchmark::State& state) {
  const size_t expert_bytes = 16 << 20;
  RotationPlan rotation = MakeRotation(expert_bytes);
  LocalFabric fabric(4);
  std::vector<std::unique_ptr<Transport>> transports;
  std::vector<std::unique_ptr<ExpertStore>> stores;
  std::vector<std::unique_ptr<Migrator>> migrators;
  MigrationConfig config;
  for (int r = 0; r < 4; ++r) {
    transports.push_back(fabric.Connect(r));
    stores.push_back(std::make_unique<ExpertStore>(*ExpertStore::Create(
        r, rotation.from, ExpertLayout{.weight_bytes = expert_bytes, .optimizer_bytes = 0})));
    migrators.push_back(Migrator::Create(*transports[r], *stores[r], config).value());
  }
  uint64_t epoch = 0;
  for (auto _ : state) {
    ++epoch;
    for (auto& m : migrators) (void)m->Start(epoch, rotation.plan);
    for (auto& m : migrators) {
      if (!m->Wait().ok()) state.SkipWithError("epoch failed");
    }
    for (auto& m : migrators) m->Discard();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * rotation.plan->total_bytes()));
}
BENCHMARK(BM_LocalTransport16ExpertPlan)->Unit(benchmark::kMillisecond)->UseRealTime();

// --- multi-process UCX measurements ---

bool WaitAll(Transport& transport, std::vector<RequestId> ids) {
  while (!ids.empty()) {
    transport.Progress();
    for (size_t i = 0; i < ids.size();) {
      auto done = transport.Test(ids[i]);
      if (!done) {
        ++i;
        continue;
      }
      if (!done->ok()) {
        std::fprintf(stderr, "%s\n", done->ToString().c_str());
        return false;
      }
      ids.erase(ids.begin() + i);
    }
  }
  return true;
}

int UcxPair(const std::string& dir, int rank) {
  testing::DirectoryCommunicator comm(dir, rank, 2);
  MigrationConfig config;
  config.transport = "ucx";
  config.ucx_progress_thread = progress_thread;
  auto transport = CreateTransport(config, comm);
  if (!transport.ok()) {
    std::fprintf(stderr, "%s\n", transport.status().ToString().c_str());
    return 1;
  }
  Transport& t = **transport;
  std::vector<std::byte> host_buffer(kExpertBytes, std::byte(rank + 1));
  std::vector<std::byte> host_scratch(kExpertBytes, std::byte{0});
  std::byte* buffer = host_buffer.data();
  std::byte* scratch = host_scratch.data();
  DeviceMemory* device = t.device_memory();
  if (on_device) {
    if (device == nullptr) {
      std::fprintf(stderr, "--device: the transport has no device memory (no GPU here)\n");
      return 1;
    }
    buffer = *device->AllocateDevice(kExpertBytes);
    scratch = *device->AllocateDevice(kExpertBytes);
    if (!device->Copy(buffer, host_buffer.data(), kExpertBytes).ok()) return 1;
  }
  // The copy the transfers are compared with: memcpy, or a device-to-device copy.
  auto copy = [&] {
    if (on_device) return device->Copy(scratch, buffer, kExpertBytes).ok();
    std::memcpy(scratch, buffer, kExpertBytes);
    benchmark::DoNotOptimize(scratch);
    return true;
  };
  uint64_t ack = 0;
  const int reps = 10;
  std::vector<double> raw;
  for (int i = 0; i < reps + 2; ++i) {
    const auto start = Clock::now();
    if (rank == 0) {
      if (!WaitAll(t, {*t.PostSend(1, 100 + i, buffer, kExpertBytes)})) return 1;
      if (!WaitAll(t, {*t.PostRecv(1, 1000 + i, reinterpret_cast<std::byte*>(&ack), 8)})) return 1;
      if (i >= 2) raw.push_back(Seconds(start));
    } else {
      if (!WaitAll(t, {*t.PostRecv(0, 100 + i, buffer, kExpertBytes)})) return 1;
      if (!WaitAll(t, {*t.PostSend(0, 1000 + i, reinterpret_cast<std::byte*>(&ack), 8)})) return 1;
    }
  }
  // Chunked, pipelined and verified: the migrator's path for one 64 MiB expert.
  auto options = *ExchangeOptions::FromConfig(MigrationConfig());
  std::vector<double> verified;
  for (int i = 0; i < reps + 2; ++i) {
    ExchangeItem item;
    item.src_rank = 0;
    item.dst_rank = 1;
    item.label = "bench";
    item.num_regions = 1;
    item.region_bytes[0] = kExpertBytes;
    if (rank == 0) item.source[0] = buffer;
    if (rank == 1) item.destination[0] = scratch;
    ExchangeRun run;
    run.epoch = static_cast<uint64_t>(i + 1);
    run.what = "bench";
    const auto start = Clock::now();
    Status s = RunExchange(t, std::span(&item, 1), options, run, nullptr, nullptr);
    if (!s.ok()) {
      std::fprintf(stderr, "%s\n", s.ToString().c_str());
      return 1;
    }
    if (i >= 2) verified.push_back(Seconds(start));
  }
  if (rank == 0) {
    std::vector<double> copies;
    for (int i = 0; i < reps; ++i) {
      const auto start = Clock::now();
      if (!copy()) return 1;
      copies.push_back(Seconds(start));
    }
    const double gb = kExpertBytes / 1e9;
    const double memcpy_gbs = gb / Median(copies);
    const double raw_gbs = gb / Median(raw);
    const double verified_gbs = gb / Median(verified);
    std::printf(
        "{\"bench\": \"ucx_pair_64MiB\", \"memory\": \"%s\", \"memcpy_gb_per_s\": %.2f, "
        "\"ucx_raw_gb_per_s\": %.2f, \"ucx_raw_vs_memcpy\": %.2f, "
        "\"ucx_chunked_verified_gb_per_s\": %.2f, \"chunked_verified_vs_memcpy\": %.2f, "
        "\"progress_thread\": %s}\n",
        on_device ? "device (memcpy: device to device)" : "host", memcpy_gbs, raw_gbs,
        raw_gbs / memcpy_gbs, verified_gbs, verified_gbs / memcpy_gbs,
        progress_thread ? "true" : "false");
  }
  if (on_device) {
    device->FreeDevice(buffer);
    device->FreeDevice(scratch);
  }
  return comm.Barrier().ok() ? 0 : 1;
}

int UcxPlan(const std::string& dir, int rank) {
  testing::DirectoryCommunicator comm(dir, rank, 4);
  MigrationConfig config;
  config.transport = "ucx";
  config.ucx_progress_thread = progress_thread;
  auto transport = CreateTransport(config, comm);
  if (!transport.ok()) return 1;
  const size_t expert_bytes = 32 << 20;
  RotationPlan rotation = MakeRotation(expert_bytes);
  ExpertStore store = *ExpertStore::Create(
      rank, rotation.from, ExpertLayout{.weight_bytes = expert_bytes, .optimizer_bytes = 0});
  auto migrator = Migrator::Create(**transport, store, config).value();
  std::vector<double> ready;
  for (int epoch = 1; epoch <= 6; ++epoch) {
    if (!comm.Barrier().ok()) return 1;
    const auto start = Clock::now();
    Status s = migrator->Start(epoch, rotation.plan);
    if (s.ok()) s = migrator->Wait();
    if (!s.ok()) {
      std::fprintf(stderr, "%s\n", s.ToString().c_str());
      return 1;
    }
    migrator->Discard();
    if (epoch > 1) ready.push_back(Seconds(start));
  }
  auto all = comm.AllGather(std::to_string(Median(ready)));
  if (rank == 0 && all.ok()) {
    double slowest = 0;
    for (const std::string& v : *all) slowest = std::max(slowest, std::stod(v));
    std::printf(
        "{\"bench\": \"ucx_plan_16_experts_4_procs\", \"expert_mib\": %zu, \"chunk_bytes\": %d, "
        "\"pipeline_depth\": %d, \"bytes\": %zu, \"time_to_ready_s\": %.3f, "
        "\"aggregate_gb_per_s\": %.2f, \"progress_thread\": %s}\n",
        expert_bytes >> 20, config.chunk_bytes, config.pipeline_depth, rotation.plan->total_bytes(),
        slowest, rotation.plan->total_bytes() / 1e9 / slowest, progress_thread ? "true" : "false");
  }
  return 0;
}

int RunProcesses(int n, int (*body)(const std::string&, int)) {
  char pattern[] = "/tmp/keel-bench-XXXXXX";
  const char* dir = mkdtemp(pattern);
  if (dir == nullptr) return 1;
  std::vector<pid_t> pids;
  for (int r = 0; r < n; ++r) {
    const pid_t pid = fork();
    if (pid == 0) {
      const int rc = body(dir, r);
      std::fflush(stdout);
      _exit(rc);
    }
    pids.push_back(pid);
  }
  int failed = 0;
  for (pid_t pid : pids) {
    int status = 0;
    waitpid(pid, &status, 0);
    failed += !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  }
  std::filesystem::remove_all(dir);
  return failed == 0 ? 0 : 1;
}

}  // namespace
}  // namespace keel

int main(int argc, char** argv) {
  if (argc > 1 && std::strcmp(argv[1], "--ucx") == 0) {
    keel::progress_thread = !(argc > 2 && std::strcmp(argv[2], "--no-progress-thread") == 0);
    keel::on_device = argc > 2 && std::strcmp(argv[2], "--device") == 0;
    const int pair = keel::RunProcesses(2, keel::UcxPair);
    if (keel::on_device) return pair;
    const int plan = keel::RunProcesses(4, keel::UcxPlan);
    return pair | plan;
  }
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
