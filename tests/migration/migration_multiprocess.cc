// Multi-process migration tests over UCX: 4 real processes on loopback, started by mpirun
// (--bootstrap mpi) or by this program itself (--launch N, ranks meet in a directory). Scenarios:
//   random   N random plans, every rank checks its slots byte for byte after each commit
//   killed   rank 1 dies (SIGKILL) mid-transfer: survivors abort within the deadline, keep
//            their old state, then migrate among themselves
//   stalled  rank 1 stops answering past the deadline: same expectations
//   agree    rank --victim dies (SIGKILL) at --phase of an epoch whose transfers all succeed:
//              transfers-done  its moves landed, before it sent any verdict
//              mid-verdict     after its verdict went to one peer, before the others
//              votes-in        every verdict is in, before the ranks agree
//              mid-agreement   a coordinator (rank 0 or 1) after its view went to one peer
//              decided         the outcome is agreed, before the switch (commit or discard)
//   linkcut  --plans epochs in a row over one store, each from the placement in force to a
//            random one, slowed by a bandwidth cap; an outside script cuts a rank's network link
//            mid-run and restores it (tests/migration/netns_hosts.sh). Every rank writes each
//            epoch's outcome to --dir/outcomes.<rank>; epochs must agree everywhere, the last
//            ones must commit, and the slots must end byte-exact for the last placement; after
//            an aborted epoch the ranks wait for --dir/restored before the next one
//   agree    (below)
//            every survivor must end the epoch the same way (the launcher compares), within the
//            deadline and the agreement's grace, naming the victim when it aborts; then the
//            survivors migrate among themselves, byte-exact
//   late-sender  rank 0 dies (SIGKILL) as epoch 1 starts; rank 3 joins epoch 1 half a second
//            late, after rank 2 has aborted it, and sends rank 2 a 4 MB move. Epochs 2 and 3
//            then move 4 MB from rank 2 to rank 3 among the survivors: both must commit,
//            byte-exact (a send rank 2 gave up on must not break the connection between them)
// Exit status 0 when every expectation held; the launcher also checks how each child ended.
// --progress-thread on|off: the UCX transport with or without its own progress thread (default on).
// --device host|fake|cuda: where the random scenario's experts live. fake: in device memory the
// CPU cannot touch (tests/migration/fake_device_memory.h); cuda: in the GPU's memory (every rank
// on the same GPU; needs one). Either is wrapped by the store as the engine wraps a trainer's GPU
// buffers and sent through page-locked staging over UCX (transport_staged.h).
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "keel/device_memory.hpp"
#include "migration/exchange.h"
#include "migration/migrator.h"
#include "migration/transport_staged.h"
#include "migration/transport_ucx.h"
#include "tests/comm/directory_communicator.h"
#include "tests/migration/test_util.h"

#ifdef KEEL_TEST_WITH_MPI
#include <mpi.h>
#endif

namespace keel {
namespace {

using Clock = std::chrono::steady_clock;
using testing::CheckStore;
using testing::DeviceSlots;
using testing::FakeDeviceMemory;
using testing::FillStore;
using testing::LiveChecksum;
using testing::RandomPlacement;
using testing::ValueOrDie;

struct Args {
  std::string scenario = "random";
  std::string bootstrap = "mpi";
  std::string dir;
  int rank = -1;
  int size = -1;
  int launch = 0;
  int plans = 100;
  double deadline = 2.0;
  int victim = 1;               // --victim, for the agree scenario
  std::string phase;            // --phase, for the agree scenario
  bool progress_thread = true;  // the UCX transport's own progress thread
  std::string device = "host";  // --device
  std::vector<std::string> raw;
};

int failures = 0;

void Check(bool ok, const std::string& what, int rank) {
  if (ok) return;
  ++failures;
  std::fprintf(stderr, "rank %d: FAILED: %s\n", rank, what.c_str());
}

double Since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

Topology MakeTopology(int num_ranks) {
  TopologyConfig config;
  config.num_nodes = num_ranks % 2 == 0 ? 2 : 1;
  config.gpus_per_node = num_ranks / config.num_nodes;
  return ValueOrDie(Topology::Create(config));
}

int RunRandom(Transport& transport, Communicator& comm, const Args& args) {
  const int me = transport.rank();
  const Topology topology = MakeTopology(transport.num_ranks());
  std::mt19937_64 rng(2024);  // same sequence on every rank: the plans agree
  const auto start = Clock::now();
  size_t bytes = 0;
  for (int p = 0; p < args.plans; ++p) {
    const int layers = 1 + static_cast<int>(rng() % 2);
    const int experts = 4 + static_cast<int>(rng() % 5);
    const int slots_per_rank = 3;
    ExpertLayout layout;
    layout.weight_bytes = 1 + rng() % 300000;
    layout.optimizer_bytes = rng() % 4 == 0 ? 0 : rng() % 500000;
    std::vector<Placement> from;
    std::vector<Placement> to;
    for (int l = 0; l < layers; ++l) {
      from.push_back(RandomPlacement(rng, experts, transport.num_ranks(), slots_per_rank));
      to.push_back(RandomPlacement(rng, experts, transport.num_ranks(), slots_per_rank));
    }
    MigrationConfig config;
    const int chunks[] = {4096, 65536, 1 << 20};
    config.chunk_bytes = chunks[rng() % 3];
    config.pipeline_depth = 1 + static_cast<int>(rng() % 4);
    config.deadline_seconds = 30;
    auto plan =
        std::make_shared<TransferPlan>(ValueOrDie(PlanTransfers(from, to, topology, layout)));
    bytes += plan->total_bytes();
    // With --device fake or cuda the slots live in the transport's device memory.
    DeviceMemory* device = transport.device_memory();
    std::optional<DeviceSlots> slots;
    if (device != nullptr) {
      slots.emplace(*device, me, layers, slots_per_rank, layout);
      slots->Fill(from);
    }
    ExpertStore store =
        slots ? slots->Wrap(device) : ValueOrDie(ExpertStore::Create(me, from, layout));
    if (!slots) FillStore(store, from);
    auto migrator = ValueOrDie(Migrator::Create(transport, store, config));
    Status status = migrator->Start(p + 1, plan);
    if (status.ok()) status = migrator->Wait();
    Check(status.ok(), "plan " + std::to_string(p) + ": " + status.ToString(), me);
    if (!status.ok()) break;
    Check(migrator->Commit(to).ok(), "commit", me);
    const std::string diff = slots ? slots->Check(to) : CheckStore(store, to);
    Check(diff.empty(), "plan " + std::to_string(p) + ": " + diff, me);
  }
  auto verdicts = comm.AllGather(failures == 0 ? "ok" : "failed");
  Check(verdicts.ok(), "final all-gather", me);
  if (me == 0 && verdicts.ok()) {
    int ok = 0;
    for (const std::string& v : *verdicts) ok += v == "ok";
    std::printf("random: %d plans, %zu bytes planned, %.2f s, %d/%d ranks byte-exact\n", args.plans,
                bytes, Since(start), ok, transport.num_ranks());
    if (ok != transport.num_ranks()) ++failures;
  }
  return failures == 0 ? 0 : 1;
}

// Rank 1 sends and receives a lot in this plan, slowly (bandwidth cap), so the fault lands
// mid-transfer.
struct FaultSetup {
  std::vector<Placement> from;
  std::vector<Placement> to;
  std::shared_ptr<const TransferPlan> plan;
  ExpertLayout layout{.weight_bytes = 2 << 20, .optimizer_bytes = 3 << 20};
};

FaultSetup MakeFaultSetup(const Topology& topology) {
  std::mt19937_64 rng(77);
  for (;;) {
    FaultSetup s;
    s.from = {RandomPlacement(rng, 6, topology.num_ranks(), 3)};
    s.to = {RandomPlacement(rng, 6, topology.num_ranks(), 3)};
    s.plan =
        std::make_shared<TransferPlan>(ValueOrDie(PlanTransfers(s.from, s.to, topology, s.layout)));
    int sends = 0;
    int receives = 0;
    for (const Transfer& t : s.plan->transfers) {
      sends += t.src_rank == 1 && t.dst_rank != 1;
      receives += t.dst_rank == 1 && t.src_rank != 1;
    }
    if (sends >= 1 && receives >= 1) return s;
  }
}

// A swap between two slots on different ranks, neither of them `lost`, that needs nothing from
// `lost`.
std::pair<std::vector<Placement>, std::shared_ptr<const TransferPlan>> SurvivorPlan(
    const std::vector<Placement>& from, const ExpertLayout& layout, const Topology& topology,
    int lost) {
  const int spr = from[0].slots_per_rank();
  for (int a = 0; a < from[0].num_slots(); ++a) {
    for (int b = a + 1; b < from[0].num_slots(); ++b) {
      if (a / spr == lost || b / spr == lost || a / spr == b / spr) continue;
      std::vector<int> phy2log = from[0].phy2log();
      if (phy2log[a] == phy2log[b]) continue;
      std::swap(phy2log[a], phy2log[b]);
      auto swapped = Placement::CreateKeepingHomes(from[0], phy2log);
      if (!swapped.ok()) continue;
      std::vector<Placement> to{*swapped};
      auto plan =
          std::make_shared<TransferPlan>(ValueOrDie(PlanTransfers(from, to, topology, layout)));
      bool touches = plan->transfers.empty();
      for (const Transfer& t : plan->transfers) touches |= t.src_rank == lost || t.dst_rank == lost;
      if (!touches) return {to, plan};
    }
  }
  return {{}, nullptr};
}

// The survivors of `lost` keep working: a new epoch among themselves, byte-exact.
void RunSurvivorEpoch(Transport& transport, ExpertStore& store, const std::vector<Placement>& from,
                      const ExpertLayout& layout, const Topology& topology, int lost,
                      uint64_t epoch) {
  const int me = transport.rank();
  auto [to, plan] = SurvivorPlan(from, layout, topology, lost);
  Check(plan != nullptr, "a survivor plan exists", me);
  if (plan == nullptr) return;
  std::vector<bool> survivors(transport.num_ranks(), true);
  survivors[lost] = false;
  MigrationConfig fast;
  fast.deadline_seconds = 20;
  auto next = ValueOrDie(Migrator::Create(transport, store, fast));
  Status status = next->Start(epoch, plan, survivors);
  if (status.ok()) status = next->Wait();
  Check(status.ok(), "survivor epoch: " + status.ToString(), me);
  if (!status.ok()) return;
  Check(next->Commit(to).ok(), "survivor commit", me);
  const std::string diff = CheckStore(store, to);
  Check(diff.empty(), "survivor epoch: " + diff, me);
  std::printf("rank %d: survivor epoch %llu committed, %zu bytes planned, byte-exact\n", me,
              static_cast<unsigned long long>(epoch), plan->total_bytes());
}

// This rank's slots of `setup`'s starting placement, filled.
ExpertStore FaultStore(int me, const FaultSetup& setup) {
  ExpertStore store = ValueOrDie(ExpertStore::Create(me, setup.from, setup.layout));
  FillStore(store, setup.from);
  return store;
}

int RunFault(Transport& transport, const Args& args) {
  const int me = transport.rank();
  const Topology topology = MakeTopology(transport.num_ranks());
  FaultSetup setup = MakeFaultSetup(topology);
  ExpertStore store = FaultStore(me, setup);
  const uint64_t before = LiveChecksum(store);
  MigrationConfig config;
  config.chunk_bytes = 256 << 10;
  config.pipeline_depth = 2;
  config.bandwidth_cap_gb_per_s = 0.02;  // 20 MB/s per rank: rank 1's part takes ~0.5 s or more
  config.deadline_seconds = args.deadline;
  auto migrator = ValueOrDie(Migrator::Create(transport, store, config));
  const bool killed = args.scenario == "killed";
  if (me == 1 && !killed) {
    // The stalled rank: alive, but it does not touch UCX until well past everyone's deadline.
    std::this_thread::sleep_for(std::chrono::duration<double>(args.deadline * 2 + 1));
  }
  const auto start = Clock::now();
  Status status = migrator->Start(1, setup.plan);
  if (me == 1 && killed) {
    std::this_thread::sleep_for(std::chrono::milliseconds(150));
    std::fflush(stdout);
    raise(SIGKILL);
  }
  if (status.ok()) status = migrator->Wait();
  const double seconds = Since(start);
  Check(!status.ok(), "the epoch must abort", me);
  if (me == 1) {
    std::printf("rank 1 (stalled) gave up: %s\n", status.ToString().c_str());
    return failures == 0 ? 0 : 1;
  }
  std::printf("rank %d aborted after %.2f s: %s\n", me, seconds, status.ToString().c_str());
  Check(seconds < args.deadline + 1.5, "abort took " + std::to_string(seconds) + " s", me);
  Check(status.message().rfind("migration epoch 1 aborted: ", 0) == 0, "error prefix", me);
  Check(status.message().find("rank 1") != std::string::npos, "error names rank 1", me);
  Check(!store.has_staged(), "staged buffers discarded", me);
  Check(LiveChecksum(store) == before, "old state intact", me);

  RunSurvivorEpoch(transport, store, setup.from, setup.layout, topology, /*lost=*/1, 2);
  return failures == 0 ? 0 : 1;
}

// The linkcut scenario: epochs over one store until --plans ran; an epoch that aborts keeps
// the placement in force, one that commits moves to its target. The rank announces each epoch's
// start in `dir` (started.<epoch>) so that the script can cut a link mid-run.
int RunLinkCut(Transport& transport, const Args& args) {
  const int me = transport.rank();
  const Topology topology = MakeTopology(transport.num_ranks());
  std::mt19937_64 rng(99);  // the same on every rank: the plans agree
  const ExpertLayout layout{.weight_bytes = 1 << 20, .optimizer_bytes = 1 << 20};
  std::vector<Placement> now = {RandomPlacement(rng, 8, transport.num_ranks(), 3)};
  ExpertStore store = ValueOrDie(ExpertStore::Create(me, now, layout));
  FillStore(store, now);
  MigrationConfig config;
  config.chunk_bytes = 256 << 10;
  config.bandwidth_cap_gb_per_s = 0.02;  // about 0.2 s per epoch
  config.deadline_seconds = args.deadline;
  std::FILE* outcomes = std::fopen((args.dir + "/outcomes." + std::to_string(me)).c_str(), "w");
  Check(outcomes != nullptr, "outcomes file", me);
  if (outcomes == nullptr) return 1;
  int trailing_commits = 0;
  for (int epoch = 1; epoch <= args.plans; ++epoch) {
    std::vector<Placement> to = {RandomPlacement(rng, 8, transport.num_ranks(), 3)};
    auto plan =
        std::make_shared<TransferPlan>(ValueOrDie(PlanTransfers(now, to, topology, layout)));
    if (me == 0) {
      std::FILE* started =
          std::fopen((args.dir + "/started." + std::to_string(epoch)).c_str(), "w");
      if (started != nullptr) std::fclose(started);
    }
    auto migrator = ValueOrDie(Migrator::Create(transport, store, config));
    const auto start = Clock::now();
    Status status = migrator->Start(static_cast<uint64_t>(epoch), plan);
    if (status.ok()) status = migrator->Wait();
    const double seconds = Since(start);
    // The deadline, the abort's 0.2 s wait for its verdicts to leave, the agreement's two graces
    // (2 x 0.4 s at a 2 s deadline), and a second for a loaded or sanitized run. The cut-off rank
    // took a second more while UCX connected to hosts it cannot reach with a blocking connect();
    // the transport now connects without blocking.
    Check(seconds < args.deadline + 2.0,
          "epoch " + std::to_string(epoch) + " took " + std::to_string(seconds) + " s", me);
    if (status.ok()) {
      Check(migrator->Commit(to).ok(), "commit", me);
      now = to;
      ++trailing_commits;
    } else {
      trailing_commits = 0;
      Check(CheckStore(store, now).empty(), "an aborted epoch changed the slots", me);
      // The next epoch waits for the script to bring the link back (it creates `restored`):
      // UCX 1.13 aborts a process whose TCP connection breaks while it is being wired up
      // (wireup_ep.c:241, "pending_count == 0"), which a new epoch's reconnect to the cut-off
      // host could hit while the link comes and goes.
      for (int i = 0; i < 600 && !std::filesystem::exists(args.dir + "/restored"); ++i) {
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
      }
    }
    std::fprintf(outcomes, "%d %s %.2f %s\n", epoch, status.ok() ? "commit" : "abort", seconds,
                 status.ok() ? "" : status.message().c_str());
    std::fflush(outcomes);
    // Let the network settle between epochs, as training steps would.
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  std::fclose(outcomes);
  const std::string diff = CheckStore(store, now);
  Check(diff.empty(), "final slots: " + diff, me);
  Check(trailing_commits >= 3,
        "the last 3 epochs must commit, " + std::to_string(trailing_commits) + " did", me);
  return failures == 0 ? 0 : 1;
}

// Kills this process at the `nth` time its exchange reaches `phase`.
class KillAt : public MigrationObserver {
 public:
  KillAt(ExchangePhase phase, int nth) : phase_(phase), nth_(nth) {}
  void OnExchangePhase(ExchangePhase phase, int /*peer*/) override {
    if (phase != phase_ || ++seen_ != nth_) return;
    std::fflush(stdout);
    raise(SIGKILL);
  }

 private:
  ExchangePhase phase_;
  int nth_;
  int seen_ = 0;
};

std::optional<KillAt> KillPoint(const std::string& phase) {
  if (phase == "transfers-done") return KillAt(ExchangePhase::kTransfersDone, 1);
  if (phase == "mid-verdict") return KillAt(ExchangePhase::kVerdictSend, 2);
  if (phase == "votes-in") return KillAt(ExchangePhase::kVotesIn, 1);
  if (phase == "mid-agreement") return KillAt(ExchangePhase::kAgreementSend, 2);
  if (phase == "decided") return KillAt(ExchangePhase::kDecided, 1);
  return std::nullopt;
}

int RunAgree(Transport& transport, const Args& args) {
  const int me = transport.rank();
  const Topology topology = MakeTopology(transport.num_ranks());
  FaultSetup setup = MakeFaultSetup(topology);
  ExpertStore store = FaultStore(me, setup);
  MigrationConfig config;
  config.chunk_bytes = 1 << 20;
  config.deadline_seconds = args.deadline;
  std::optional<KillAt> kill;
  if (me == args.victim) kill = KillPoint(args.phase);
  auto migrator = ValueOrDie(Migrator::Create(transport, store, config, kill ? &*kill : nullptr));
  const auto start = Clock::now();
  Status status = migrator->Start(1, setup.plan);
  if (status.ok()) status = migrator->Wait();
  const double seconds = Since(start);
  const MigrationReport report = migrator->last_report();
  if (me == args.victim) {  // its phase never came (e.g. mid-agreement on a non-coordinator)
    Check(false, "rank " + std::to_string(me) + " was to die at " + args.phase, me);
    return 1;
  }
  const std::string victim = "rank " + std::to_string(args.victim);
  std::vector<Placement> now = setup.from;
  if (status.ok()) {
    Check(migrator->Commit(setup.to).ok(), "commit", me);
    const std::string diff = CheckStore(store, setup.to);
    Check(diff.empty(), "committed epoch: " + diff, me);
    now = setup.to;
    std::string lost;
    for (int r : report.lost_ranks) lost += " " + std::to_string(r);
    std::printf("rank %d committed after %.2f s (lost:%s)\n", me, seconds,
                lost.empty() ? " none seen" : lost.c_str());
  } else {
    std::printf("rank %d aborted after %.2f s: %s\n", me, seconds, status.ToString().c_str());
    Check(status.message().find(victim) != std::string::npos, "error names " + victim, me);
    Check(!store.has_staged(), "staged buffers discarded", me);
    migrator->Discard();
  }
  Check(seconds < args.deadline + 1.5, "the epoch took " + std::to_string(seconds) + " s", me);
  {
    std::FILE* out = std::fopen((args.dir + "/outcome." + std::to_string(me)).c_str(), "w");
    Check(out != nullptr, "outcome file", me);
    if (out != nullptr) {
      std::fputs(status.ok() ? "commit" : "abort", out);
      std::fclose(out);
    }
  }
  RunSurvivorEpoch(transport, store, now, setup.layout, topology, args.victim, 2);
  return failures == 0 ? 0 : 1;
}

// The late-sender scenario (see the top of the file). Runs the exchange itself, so that the
// moves, their sizes and who takes part are exactly these.
int RunLateSender(Transport& transport, const Args& args) {
  const int me = transport.rank();
  if (transport.num_ranks() != 4) {
    std::fprintf(stderr, "late-sender needs 4 ranks\n");
    return 2;
  }
  if (me == 0) {  // every connection is up (CreateUcxTransport): its peers see it die
    std::fflush(stdout);
    raise(SIGKILL);
  }
  // Chunks sent by rendezvous, which UCX cannot cancel once the receiver has given up on them.
  constexpr size_t kBytes = 4 << 20;
  ExchangeOptions options;
  options.chunk_bytes = 1 << 20;
  options.pipeline_depth = 2;
  options.deadline = std::chrono::duration<double>(args.deadline);
  std::vector<std::byte> source(kBytes);
  std::vector<std::byte> destination(kBytes);
  auto move = [&](int from, int to) {
    ExchangeItem item;
    item.src_rank = from;
    item.dst_rank = to;
    item.label = "move rank " + std::to_string(from) + " -> rank " + std::to_string(to);
    item.num_regions = 1;
    item.region_bytes[0] = kBytes;
    if (me == from) item.source[0] = source.data();
    if (me == to) item.destination[0] = destination.data();
    return item;
  };
  auto fill = [&](uint64_t epoch) {
    for (size_t i = 0; i < kBytes; ++i) source[i] = static_cast<std::byte>((i * 131 + epoch) % 251);
  };

  // Epoch 1, all four ranks: rank 2 aborts at once (rank 0 is gone) and cancels its receives;
  // rank 3 posts its sends only afterwards.
  fill(1);
  const ExchangeItem first = move(3, 2);
  if (me == 3) std::this_thread::sleep_for(std::chrono::milliseconds(500));
  const auto start = Clock::now();
  ExchangeRun run;
  run.epoch = 1;
  run.what = "epoch 1";
  Status status = RunExchange(transport, {&first, 1}, options, run, nullptr, nullptr);
  const double seconds = Since(start);
  std::printf("rank %d: epoch 1 ended after %.2f s: %s\n", me, seconds, status.ToString().c_str());
  Check(!status.ok(), "epoch 1 must abort", me);
  Check(status.message().find("rank 0") != std::string::npos, "epoch 1's error names rank 0", me);
  Check(seconds < args.deadline + 1.5, "epoch 1 took " + std::to_string(seconds) + " s", me);

  // Epochs 2 and 3 among the survivors, over the connection between ranks 2 and 3.
  const ExchangeItem next = move(2, 3);
  options.deadline = std::chrono::duration<double>(10.0);
  run.participants = {false, true, true, true};
  for (uint64_t epoch = 2; epoch <= 3; ++epoch) {
    fill(epoch);
    std::fill(destination.begin(), destination.end(), std::byte{0});
    run.epoch = epoch;
    run.what = "epoch " + std::to_string(epoch);
    status = RunExchange(transport, {&next, 1}, options, run, nullptr, nullptr);
    Check(status.ok(), run.what + ": " + status.ToString(), me);
    if (!status.ok()) continue;
    if (me == 3) Check(destination == source, run.what + ": the bytes differ", me);
    std::printf("rank %d: %s committed\n", me, run.what.c_str());
  }
  return failures == 0 ? 0 : 1;
}

// Every survivor's outcome of the agree scenario, from the files they left in `dir`; empty
// when they differ or one is missing.
std::string AgreedOutcome(const std::string& dir, const Args& args) {
  std::string agreed;
  for (int r = 0; r < args.launch; ++r) {
    if (r == args.victim) continue;
    std::FILE* in = std::fopen((dir + "/outcome." + std::to_string(r)).c_str(), "r");
    char text[16] = {};
    if (in != nullptr) {
      (void)std::fread(text, 1, sizeof(text) - 1, in);
      std::fclose(in);
    }
    std::fprintf(stderr, "launcher: rank %d: %s\n", r, in != nullptr ? text : "no outcome");
    if (in == nullptr || (!agreed.empty() && agreed != text)) return "";
    agreed = text;
  }
  return agreed;
}

// Starts `args.launch` copies of this program that meet in a fresh directory; checks that each
// ended as the scenario expects.
int Launch(const char* self, const Args& args) {
  char pattern[] = "/tmp/keel-migration-XXXXXX";
  const char* dir = mkdtemp(pattern);
  if (dir == nullptr) {
    std::perror("mkdtemp");
    return 1;
  }
  std::vector<pid_t> children;
  for (int r = 0; r < args.launch; ++r) {
    const pid_t pid = fork();
    if (pid == 0) {
      std::vector<std::string> argv_strings{self,
                                            "--bootstrap",
                                            "dir",
                                            "--dir",
                                            dir,
                                            "--rank",
                                            std::to_string(r),
                                            "--size",
                                            std::to_string(args.launch)};
      for (const std::string& a : args.raw) argv_strings.push_back(a);
      std::vector<char*> argv;
      for (std::string& a : argv_strings) argv.push_back(a.data());
      argv.push_back(nullptr);
      execv(self, argv.data());
      std::perror("execv");
      _exit(127);
    }
    children.push_back(pid);
  }
  const auto limit = Clock::now() + std::chrono::seconds(120);
  std::vector<int> statuses(args.launch, -1);
  int running = args.launch;
  while (running > 0) {
    for (int r = 0; r < args.launch; ++r) {
      if (statuses[r] != -1) continue;
      int status = 0;
      if (waitpid(children[r], &status, WNOHANG) == children[r]) {
        statuses[r] = status;
        --running;
      }
    }
    if (Clock::now() > limit) {
      std::fprintf(stderr, "launcher: children still running after 120 s, killing them\n");
      for (int r = 0; r < args.launch; ++r) {
        if (statuses[r] == -1) kill(children[r], SIGKILL);
      }
      ++failures;
      for (int r = 0; r < args.launch; ++r) {
        if (statuses[r] == -1) waitpid(children[r], &statuses[r], 0);
      }
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  if (args.scenario == "agree") {
    const std::string outcome = AgreedOutcome(dir, args);
    if (outcome.empty()) {
      ++failures;
      std::fprintf(stderr, "launcher: the survivors did not end epoch 1 the same way\n");
    } else {
      std::printf("launcher: rank %d killed at %s; every survivor: %s\n", args.victim,
                  args.phase.c_str(), outcome.c_str());
    }
  }
  std::filesystem::remove_all(dir);
  for (int r = 0; r < args.launch; ++r) {
    const int s = statuses[r];
    const bool expect_killed = (args.scenario == "killed" && r == 1) ||
                               (args.scenario == "agree" && r == args.victim) ||
                               (args.scenario == "late-sender" && r == 0);
    const bool ok = expect_killed ? (WIFSIGNALED(s) && WTERMSIG(s) == SIGKILL)
                                  : (WIFEXITED(s) && WEXITSTATUS(s) == 0);
    if (!ok) {
      ++failures;
      std::fprintf(stderr, "launcher: rank %d ended with wait status %d, expected %s\n", r, s,
                   expect_killed ? "SIGKILL" : "exit 0");
    }
  }
  std::printf("launcher: scenario %s with %d processes: %s\n", args.scenario.c_str(), args.launch,
              failures == 0 ? "PASSED" : "FAILED");
  return failures == 0 ? 0 : 1;
}

Args Parse(int argc, char** argv) {
  Args args;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    const std::string value = i + 1 < argc ? argv[i + 1] : "";
    bool forward = true;
    if (flag == "--scenario") {
      args.scenario = value;
    } else if (flag == "--bootstrap") {
      args.bootstrap = value;
      forward = false;
    } else if (flag == "--dir") {
      args.dir = value;
      forward = false;
    } else if (flag == "--rank") {
      args.rank = std::stoi(value);
      forward = false;
    } else if (flag == "--size") {
      args.size = std::stoi(value);
      forward = false;
    } else if (flag == "--launch") {
      args.launch = std::stoi(value);
      forward = false;
    } else if (flag == "--plans") {
      args.plans = std::stoi(value);
    } else if (flag == "--deadline") {
      args.deadline = std::stod(value);
    } else if (flag == "--victim") {
      args.victim = std::stoi(value);
    } else if (flag == "--phase" && KillPoint(value)) {
      args.phase = value;
    } else if (flag == "--progress-thread" && (value == "on" || value == "off")) {
      args.progress_thread = value == "on";
    } else if (flag == "--device" && (value == "host" || value == "fake" || value == "cuda")) {
      args.device = value;
    } else {
      std::fprintf(stderr, "unknown flag %s\n", flag.c_str());
      std::exit(2);
    }
    if (forward) {
      args.raw.push_back(flag);
      args.raw.push_back(value);
    }
    ++i;
  }
  return args;
}

int Main(int argc, char** argv) {
  Args args = Parse(argc, argv);
  if (args.launch > 0) return Launch(argv[0], args);
  std::unique_ptr<Communicator> comm;
  if (args.bootstrap == "dir") {
    comm = std::make_unique<testing::DirectoryCommunicator>(args.dir, args.rank, args.size);
  } else {
#ifdef KEEL_TEST_WITH_MPI
    comm = ValueOrDie(CreateMpiCommunicator());
#else
    std::fprintf(stderr, "built without MPI: use --launch N\n");
    return 2;
#endif
  }
  UcxTransportOptions options;
  options.progress_thread = args.progress_thread;
  auto transport = CreateUcxTransport(*comm, options);
  if (transport.ok() && args.device != "host") {
    Result<std::shared_ptr<DeviceMemory>> device =
        args.device == "fake"
            ? Result<std::shared_ptr<DeviceMemory>>(std::make_shared<FakeDeviceMemory>(true))
            : CreateCudaDeviceMemory();
    transport = device.ok() ? CreateStagedTransport(std::move(*transport), std::move(*device))
                            : Result<std::unique_ptr<Transport>>(device.status());
  }
  if (!transport.ok()) {
    std::fprintf(stderr, "rank %d: %s\n", comm->rank(), transport.status().ToString().c_str());
    return 1;
  }
  if (args.scenario == "random") return RunRandom(**transport, *comm, args);
  if (args.scenario == "killed" || args.scenario == "stalled") return RunFault(**transport, args);
  if (args.scenario == "agree") return RunAgree(**transport, args);
  if (args.scenario == "linkcut") return RunLinkCut(**transport, args);
  if (args.scenario == "late-sender") return RunLateSender(**transport, args);
  std::fprintf(stderr, "unknown scenario %s\n", args.scenario.c_str());
  return 2;
}

}  // namespace
}  // namespace keel

int main(int argc, char** argv) {
#ifdef KEEL_TEST_WITH_MPI
  bool use_mpi = true;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--launch") == 0 || std::strcmp(argv[i], "dir") == 0) use_mpi = false;
  }
  if (use_mpi) MPI_Init(&argc, &argv);
  const int rc = keel::Main(argc, argv);
  if (use_mpi) MPI_Finalize();
  return rc;
#else
  return keel::Main(argc, argv);
#endif
}
