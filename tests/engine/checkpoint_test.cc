// Checkpoints with moving experts: the engine's state and every expert by logical id, saved
// right after a StepEnd that left a migration in flight, are loaded by new engines in a new
// process, which train on to the end with weights and optimizer state bitwise equal to an
// uninterrupted run (the toy trainer's engine-free reference). The same checkpoint loads into a
// job with another number of ranks and another placement. A bad expert file (corrupt, truncated,
// lengthened, another expert's, layer's or shard's) is refused by file and field before any slot
// changes; version-1 files still load; no checkpoint goes to an empty path or the root.
#include <gtest/gtest.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "comm/communicator.h"
#include "common/file.h"
#include "keel/engine.hpp"
#include "keel/local_group.hpp"
#include "tests/common/test_util.h"
#include "tests/engine/toy_trainer.h"

extern char** environ;

namespace keel::toy {
namespace {

constexpr int kSteps = 24;
constexpr int kFirstCheckpointStep = 6;
constexpr int kLastCheckpointStep = 21;
constexpr const char* kStateFile = "/engine_state.json";

KeelConfig CheckpointConfig() {
  KeelConfig config = TestConfig("keel");
  config.policy.replan_interval_steps = 2;
  return config;
}

struct Checkpoint {
  int step = -1;           // the last step trained before it
  bool in_flight = false;  // a migration was running when it was taken
  int64_t epoch = 0;
};

// Whether to checkpoint after `step`: the same answer on every rank.
using CheckpointWhen = std::function<bool(Engine& engine, int step)>;

// From step 6 on, the first StepEnd that leaves a migration in flight after an epoch committed
// (at step 21 at the latest). On a loaded machine the first plans come late, so the first
// migration may still be the one in flight at step 6.
bool MidMigration(Engine& engine, int step) {
  // A migration starts at the same StepEnd on every rank, so every rank stops together.
  const bool wanted = engine.stats().migration_in_flight && engine.epoch() > 0;
  return step >= kFirstCheckpointStep && (wanted || step >= kLastCheckpointStep);
}

// Trains from step 0 and checkpoints into `dir` after the first step `when` names, then stops.
Checkpoint TrainAndCheckpoint(const std::string& dir, const KeelConfig& config = CheckpointConfig(),
                              const CheckpointWhen& when = MidMigration) {
  LocalCommunicatorGroup group(kRanks);
  LocalFabric fabric(kRanks);
  std::vector<RankBuffers> buffers(kRanks);
  std::vector<RankRecord> records(kRanks);
  std::vector<Checkpoint> taken(kRanks);
  std::vector<std::thread> threads;
  for (int r = 0; r < kRanks; ++r) {
    threads.emplace_back([&, r] {
      std::unique_ptr<Communicator> communicator = group.Join(r);
      RunHooks hooks;
      hooks.after_step = [&, r](Engine& engine, int step) -> Result<bool> {
        if (!when(engine, step)) return false;
        KEEL_RETURN_IF_ERROR(engine.SaveExperts(dir));
        if (r == 0) {
          KEEL_RETURN_IF_ERROR(
              WriteFileAtomically(dir + kStateFile, EngineStateToJson(engine.SaveState())));
        }
        taken[r] = {step, engine.stats().migration_in_flight, engine.epoch()};
        return true;
      };
      records[r].status = RunRank(config, kSteps, *communicator, &fabric, buffers[r], records[r],
                                  nullptr, nullptr, hooks);
    });
  }
  for (std::thread& t : threads) t.join();
  for (int r = 0; r < kRanks; ++r) {
    EXPECT_TRUE(records[r].status.ok()) << "rank " << r << ": " << records[r].status.ToString();
    EXPECT_EQ(taken[r].step, taken[0].step) << "rank " << r;
  }
  return taken[0];
}

// The resumed half: new engines restore the state, load the experts and train steps
// [checkpoint + 1, kSteps); every copy must then hold the reference of kSteps steps.
void ResumeAndCheck(const std::string& dir, int checkpoint_step, int64_t epoch,
                    const KeelConfig& config = CheckpointConfig()) {
  Result<std::string> text = ReadFile(dir + kStateFile, {});
  ASSERT_TRUE(text.ok()) << text.status().ToString();
  Result<EngineState> state = EngineStateFromJson(*text);
  ASSERT_TRUE(state.ok()) << state.status().ToString();
  LocalCommunicatorGroup group(kRanks);
  LocalFabric fabric(kRanks);
  std::vector<RankBuffers> buffers(kRanks);
  std::vector<RankRecord> records(kRanks);
  std::vector<int64_t> restored_epoch(kRanks, -1);
  std::vector<std::thread> threads;
  for (int r = 0; r < kRanks; ++r) {
    threads.emplace_back([&, r] {
      std::unique_ptr<Communicator> communicator = group.Join(r);
      RunHooks hooks;
      hooks.first_step = checkpoint_step + 1;
      hooks.before_fill = [&, r](Engine& engine) {
        KEEL_RETURN_IF_ERROR(engine.RestoreState(*state));
        restored_epoch[r] = engine.epoch();
        return Status::Ok();
      };
      hooks.after_register = [&](Engine& engine) { return engine.LoadExperts(dir); };
      records[r].status = RunRank(config, kSteps, *communicator, &fabric, buffers[r], records[r],
                                  nullptr, nullptr, hooks);
    });
  }
  for (std::thread& t : threads) t.join();
  const Reference reference = ComputeReference(kSteps);
  for (int r = 0; r < kRanks; ++r) {
    ASSERT_TRUE(records[r].status.ok()) << "rank " << r << ": " << records[r].status.ToString();
    EXPECT_EQ(restored_epoch[r], epoch) << "rank " << r;
    const Status same = CheckAgainstReference(r, buffers[r], records[r], reference);
    EXPECT_TRUE(same.ok()) << same.ToString();
  }
}

std::string FreshFolder(const std::string& name) {
  const std::string dir =
      ::testing::TempDir() + "/keel_checkpoint_" + name + "_" + std::to_string(getpid());
  std::filesystem::remove_all(dir);
  return dir;
}

// The resumed half in its own process: the parent test below starts this program again with
// only this test selected and the checkpoint named in the environment. Skips when run alone.
TEST(CheckpointTest, ResumesInANewProcess) {
  const char* dir = std::getenv("KEEL_TEST_CHECKPOINT_DIR");
  const char* step = std::getenv("KEEL_TEST_CHECKPOINT_STEP");
  const char* epoch = std::getenv("KEEL_TEST_CHECKPOINT_EPOCH");
  if (dir == nullptr || step == nullptr || epoch == nullptr) {
    GTEST_SKIP() << "the second half of CheckpointTest.MidMigrationCheckpointResumesBitExact";
  }
  ResumeAndCheck(dir, std::atoi(step), std::atoll(epoch));
}

TEST(CheckpointTest, MidMigrationCheckpointResumesBitExact) {
  const std::string dir = FreshFolder("resume");
  const Checkpoint checkpoint = TrainAndCheckpoint(dir);
  ASSERT_GE(checkpoint.step, kFirstCheckpointStep);
  ASSERT_TRUE(checkpoint.in_flight)
      << "no migration was in flight after steps " << kFirstCheckpointStep << " to "
      << kLastCheckpointStep << ": the checkpoint would not test what it should";
  EXPECT_GT(checkpoint.epoch, 0) << "no epoch committed before the checkpoint";

  // A new process: this program again, running only ResumesInANewProcess.
  std::string self = std::filesystem::read_symlink("/proc/self/exe").string();
  std::vector<std::string> env_strings = {
      "KEEL_TEST_CHECKPOINT_DIR=" + dir,
      "KEEL_TEST_CHECKPOINT_STEP=" + std::to_string(checkpoint.step),
      "KEEL_TEST_CHECKPOINT_EPOCH=" + std::to_string(checkpoint.epoch)};
  for (char** e = environ; *e != nullptr; ++e) {
    if (std::strncmp(*e, "KEEL_TEST_CHECKPOINT_", 21) != 0) env_strings.emplace_back(*e);
  }
  std::vector<char*> env;
  for (std::string& e : env_strings) env.push_back(e.data());
  env.push_back(nullptr);
  std::string filter = "--gtest_filter=CheckpointTest.ResumesInANewProcess";
  std::vector<char*> argv = {self.data(), filter.data(), nullptr};
  pid_t child = 0;
  ASSERT_EQ(posix_spawn(&child, self.c_str(), nullptr, nullptr, argv.data(), env.data()), 0);
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
      << "the resumed run failed (wait status " << status << "); its output is above";
  std::filesystem::remove_all(dir);
}

// With policy.keel.shard_experts the state carries every layer's shard counts: a checkpoint taken
// while the hot experts are sharded resumes in new engines (created with no sharded expert) with
// the same shards, each shard's slice in its own file, and training goes on exactly (the resumed
// run joins the shards again as the load drifts).
TEST(CheckpointTest, ShardedExpertsResumeExactly) {
  KeelConfig config = TestConfig("keel");
  config.policy.keel.shard_experts = true;
  config.cost_model.expert_ffn_size = 8192;
  const std::string dir = FreshFolder("sharded");
  const Checkpoint taken = TrainAndCheckpoint(dir, config, [](Engine& engine, int step) {
    return step >= 2 && engine.placement(0).num_experts > kExperts;
  });
  ASSERT_GE(taken.step, 2) << "layer 0 was never sharded";
  const EngineState state = EngineStateFromJson(ReadFile(dir + kStateFile, {}).value()).value();
  ASSERT_EQ(state.shards.size(), static_cast<size_t>(kLayers));
  EXPECT_EQ(state.shards[0][0], 2);
  EXPECT_TRUE(std::filesystem::exists(dir + "/layer-0/expert-0.shard-1-of-2.bin"));
  EXPECT_TRUE(std::filesystem::exists(dir + "/layer-0/expert-1.bin"));
  ResumeAndCheck(dir, taken.step, taken.epoch, config);
  std::filesystem::remove_all(dir);
}

// The same checkpoint in a job of 2 ranks with 5 slots each and the static placement: every copy
// gets its expert's weights and every home its optimizer state, as the reference has them after
// the checkpoint's steps.
TEST(CheckpointTest, LoadsIntoAnotherRankCountAndPlacement) {
  const std::string dir = FreshFolder("reshape");
  const Checkpoint checkpoint = TrainAndCheckpoint(dir);
  ASSERT_GE(checkpoint.step, 0);
  const Reference reference = ComputeReference(checkpoint.step + 1);

  constexpr int kNewRanks = 2;
  KeelConfig config = TestConfig("static");
  config.topology.gpus_per_node = kNewRanks;
  config.slots.persistent_per_rank = 5;
  config.slots.transient_per_rank = 0;
  std::unique_ptr<LocalGroup> group = testing::ValueOrDie(LocalGroup::Create(kNewRanks));
  std::vector<Status> status(kNewRanks);
  std::vector<int> checked(kNewRanks, 0);
  std::vector<std::thread> threads;
  for (int r = 0; r < kNewRanks; ++r) {
    threads.emplace_back([&, r] {
      status[r] = [&]() -> Status {
        KEEL_ASSIGN_OR_RETURN(auto communicator, group->Join(r));
        EngineOptions options = ToyOptions(config, *communicator);
        options.local_group = group.get();
        KEEL_ASSIGN_OR_RETURN(auto engine, Engine::Create(options));
        // A restored state of another shape is refused by name.
        KEEL_ASSIGN_OR_RETURN(std::string text, ReadFile(dir + kStateFile, {}));
        KEEL_ASSIGN_OR_RETURN(EngineState state, EngineStateFromJson(text));
        const Status refused = engine->RestoreState(state);
        if (refused.ok() || refused.message().find("phy2log has 12 slots; this engine has 10") ==
                                std::string::npos) {
          return Internal("a state of 4 ranks x 3 slots was not refused: " + refused.ToString());
        }
        const int spr = engine->slots_per_rank();
        std::vector<std::vector<float>> weights(kLayers * spr, std::vector<float>(kWeightWords));
        std::vector<std::vector<int64_t>> gradients(kLayers * spr,
                                                    std::vector<int64_t>(kWeightWords));
        std::vector<std::vector<double>> optimizer(kLayers * spr,
                                                   std::vector<double>(kWeightWords, -1.0));
        for (int l = 0; l < kLayers; ++l) {
          for (int i = 0; i < spr; ++i) {
            const size_t index = static_cast<size_t>(l) * spr + i;
            KEEL_RETURN_IF_ERROR(engine->RegisterSlot(
                l, i, {weights[index].data(), gradients[index].data(), optimizer[index].data()}));
          }
        }
        KEEL_RETURN_IF_ERROR(engine->LoadExperts(dir));
        for (int l = 0; l < kLayers; ++l) {
          KEEL_ASSIGN_OR_RETURN(const Placement p, ToPlacement(engine->placement(l)));
          for (int i = 0; i < spr; ++i) {
            const int slot = r * spr + i;
            const int e = p.expert_at(slot);
            if (e < 0) continue;
            const size_t index = static_cast<size_t>(l) * spr + i;
            const std::string where = "layer " + std::to_string(l) + " slot " +
                                      std::to_string(slot) + " expert " + std::to_string(e);
            if (weights[index] != reference.weights[l * kExperts + e]) {
              return Internal(where + ": weights differ from the checkpointed expert");
            }
            if (p.home_slot(e) == slot && optimizer[index] != reference.state[l * kExperts + e]) {
              return Internal(where + ": optimizer state differs from the checkpointed expert");
            }
            ++checked[r];
          }
        }
        return Status::Ok();
      }();
    });
  }
  for (std::thread& t : threads) t.join();
  for (int r = 0; r < kNewRanks; ++r) {
    EXPECT_TRUE(status[r].ok()) << "rank " << r << ": " << status[r].ToString();
  }
  EXPECT_EQ(checked[0] + checked[1], kLayers * kExperts) << "every expert has one copy here";
  std::filesystem::remove_all(dir);
}

TEST(CheckpointTest, StateRoundTripsAndBadJsonIsRefusedByField) {
  EngineState state;
  state.epoch = 7;
  state.phy2log = {{0, 1, -1, 2}, {2, 1, 0, -1}};
  state.home = {{0, 0, 1}, {1, 0, 0}};
  Result<EngineState> back = EngineStateFromJson(EngineStateToJson(state));
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->epoch, 7);
  EXPECT_EQ(back->phy2log, state.phy2log);
  EXPECT_EQ(back->home, state.home);
  EXPECT_TRUE(back->shards.empty());
  state.shards = {{1, 2, 1}, {1, 1, 1}};
  back = EngineStateFromJson(EngineStateToJson(state));
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->shards, state.shards);
  const std::pair<const char*, const char*> bad[] = {
      {"[]", "not a JSON object"},
      {R"({"epoch": 1, "phy2log": [], "home": []})", "keel_engine_state must be 1"},
      {R"({"keel_engine_state": 1, "epoch": -2, "phy2log": [], "home": []})",
       "epoch -2 is negative"},
      {R"({"keel_engine_state": 1, "epoch": 0, "phy2log": [[0, "x"]], "home": [[0]]})",
       "phy2log[0][1] must be an integer, got \"x\""},
      {R"({"keel_engine_state": 1, "epoch": 0, "phy2log": [[0]], "home": []})",
       "phy2log has 1 layers, home 0"},
      {R"({"keel_engine_state": 1, "epoch": 0, "phy2log": [[0]], "home": [[0]], "shards": 2})",
       "shards must be an array per layer, as phy2log is"},
      {R"({"keel_engine_state": 1, "epoch": 0, "phy2log": [[0]], "home": [[0]],
           "shards": [[1, -3]]})",
       "shards[0][1] -3 is less than -1"},
  };
  for (const auto& [text, message] : bad) {
    Result<EngineState> parsed = EngineStateFromJson(text);
    ASSERT_FALSE(parsed.ok()) << text;
    EXPECT_NE(parsed.status().message().find(message), std::string::npos)
        << text << " -> " << parsed.status().ToString();
  }
}

// Numbers are read exactly: an id beyond 64 bits' signed range was wrapped to -1 (an empty slot)
// and accepted, a repeated key kept its last value, a float or quoted number passed for an
// integer. One case per field.
TEST(CheckpointTest, StateNumbersAreExactAndKeysOnce) {
  const std::pair<const char*, const char*> bad[] = {
      {R"({"keel_engine_state": 1, "epoch": 0, "phy2log": [[0, 18446744073709551615]],
           "home": [[0]]})",
       "engine state: phy2log[0][1] 18446744073709551615 is more than 2147483647"},
      {R"({"keel_engine_state": 1, "epoch": 0, "phy2log": [[0]], "home": [[4294967295]]})",
       "engine state: home[0][0] 4294967295 is more than 2147483647"},
      {R"({"keel_engine_state": 1, "epoch": 0, "phy2log": [[0]], "home": [[0]],
           "shards": [[18446744073709551615]]})",
       "engine state: shards[0][0] 18446744073709551615 is more than 2147483647"},
      {R"({"keel_engine_state": 1, "epoch": 18446744073709551615, "phy2log": [], "home": []})",
       "engine state: epoch 18446744073709551615 is more than 9223372036854775807"},
      {R"({"keel_engine_state": 1, "epoch": "3", "phy2log": [], "home": []})",
       "engine state: epoch must be an integer, got \"3\""},
      {R"({"keel_engine_state": 1.0, "epoch": 0, "phy2log": [], "home": []})",
       "engine state: keel_engine_state must be an integer, got 1.0"},
      {R"({"keel_engine_state": 1, "epoch": 0, "phy2log": [[0, 1.5]], "home": [[0]]})",
       "engine state: phy2log[0][1] must be an integer, got 1.5"},
      {R"({"keel_engine_state": 1, "epoch": 0, "epoch": 7, "phy2log": [], "home": []})",
       "engine state: key \"epoch\" appears twice in one object at line 1, column 38"},
      {R"({"keel_engine_state": 1, "epoch": 0, "phy2log": [[0]], "home": [[0]], "epoch": 0})",
       "engine state: key \"epoch\" appears twice in one object"},
  };
  for (const auto& [text, message] : bad) {
    Result<EngineState> parsed = EngineStateFromJson(text);
    ASSERT_FALSE(parsed.ok()) << text;
    EXPECT_EQ(parsed.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(parsed.status().message().find(message), std::string::npos)
        << text << " -> " << parsed.status().ToString();
  }
}

// Two ranks' engines with host slot buffers, created together (Engine::Create is collective),
// then driven from the test's thread: SaveExperts and LoadExperts are not collective. Layer 1's
// expert 2 is sharded in two, so its files are expert-2.shard-{0,1}-of-2.bin.
struct TwoRankJob {
  static constexpr int kRanks = 2;
  std::unique_ptr<LocalGroup> group;
  std::vector<std::unique_ptr<Communicator>> communicators{kRanks};
  std::vector<RankBuffers> buffers{kRanks};
  std::vector<std::unique_ptr<Engine>> engines{kRanks};  // destroyed first

  int slots() const { return engines[0]->slots_per_rank(); }
  size_t index(int layer, int local_slot) const {
    return static_cast<size_t>(layer) * slots() + local_slot;
  }
  // The unit rank `r`'s local slot `i` holds in `layer` (-1: none).
  int unit_at(int r, int layer, int i) const {
    return engines[r]->placement(layer).phy2log[r * slots() + i];
  }
};

// What a checkpointed copy of `unit` holds in word `j`.
float SavedWeight(int layer, int unit, int j) { return 1000.0f * layer + 10.0f * unit + j; }
double SavedState(int layer, int unit, int j) { return -(1000.0 * layer + 10.0 * unit + j); }

Result<std::unique_ptr<TwoRankJob>> CreateTwoRankJob() {
  auto job = std::make_unique<TwoRankJob>();
  KEEL_ASSIGN_OR_RETURN(job->group, LocalGroup::Create(TwoRankJob::kRanks));
  KeelConfig config = TestConfig("static");
  config.topology.gpus_per_node = TwoRankJob::kRanks;
  config.slots.persistent_per_rank = 5;
  config.slots.transient_per_rank = 0;
  std::vector<Status> status(TwoRankJob::kRanks);
  std::vector<std::thread> threads;
  for (int r = 0; r < TwoRankJob::kRanks; ++r) {
    threads.emplace_back([&, r] {
      status[r] = [&]() -> Status {
        KEEL_ASSIGN_OR_RETURN(job->communicators[r], job->group->Join(r));
        EngineOptions options = ToyOptions(config, *job->communicators[r]);
        options.local_group = job->group.get();
        options.sharded_experts = {{1, 2, 2}};
        KEEL_ASSIGN_OR_RETURN(job->engines[r], Engine::Create(options));
        const int slots = job->engines[r]->slots_per_rank();
        RankBuffers& b = job->buffers[r];
        b.weights.assign(kLayers * slots, std::vector<float>(kWeightWords));
        b.gradients.assign(kLayers * slots, std::vector<int64_t>(kWeightWords));
        b.optimizer.assign(kLayers * slots, std::vector<double>(kWeightWords));
        for (int l = 0; l < kLayers; ++l) {
          for (int i = 0; i < slots; ++i) {
            const size_t index = static_cast<size_t>(l) * slots + i;
            KEEL_RETURN_IF_ERROR(job->engines[r]->RegisterSlot(
                l, i,
                {b.weights[index].data(), b.gradients[index].data(), b.optimizer[index].data()}));
          }
        }
        return Status::Ok();
      }();
    });
  }
  for (std::thread& t : threads) t.join();
  for (const Status& s : status) KEEL_RETURN_IF_ERROR(s);
  return job;
}

// Every copy holds its unit's saved words.
void FillSaved(TwoRankJob& job) {
  for (int r = 0; r < TwoRankJob::kRanks; ++r) {
    for (int l = 0; l < kLayers; ++l) {
      for (int i = 0; i < job.slots(); ++i) {
        const int unit = job.unit_at(r, l, i);
        for (int j = 0; j < kWeightWords; ++j) {
          job.buffers[r].weights[job.index(l, i)][j] = SavedWeight(l, unit, j);
          job.buffers[r].optimizer[job.index(l, i)][j] = SavedState(l, unit, j);
        }
      }
    }
  }
}

// Every slot holds what no checkpoint does.
void FillOther(TwoRankJob& job) {
  for (RankBuffers& b : job.buffers) {
    for (auto& words : b.weights) std::fill(words.begin(), words.end(), -7.5f);
    for (auto& words : b.optimizer) std::fill(words.begin(), words.end(), 3.25);
  }
}

// Whether every copy of rank `r` holds its unit's saved weights, and every home its saved state.
bool HoldsSaved(const TwoRankJob& job, int r) {
  for (int l = 0; l < kLayers; ++l) {
    for (int i = 0; i < job.slots(); ++i) {
      const int unit = job.unit_at(r, l, i);
      if (unit < 0) continue;
      for (int j = 0; j < kWeightWords; ++j) {
        if (job.buffers[r].weights[job.index(l, i)][j] != SavedWeight(l, unit, j)) return false;
      }
    }
    for (const HomeSlot& home : job.engines[r]->HomeSlots(l)) {
      const int unit = job.unit_at(r, l, home.local_slot);
      for (int j = 0; j < kWeightWords; ++j) {
        if (job.buffers[r].optimizer[job.index(l, home.local_slot)][j] != SavedState(l, unit, j)) {
          return false;
        }
      }
    }
  }
  return true;
}

std::string ReadBytes(const std::string& path) { return testing::ValueOrDie(ReadFile(path, {})); }
void WriteBytes(const std::string& path, const std::string& bytes) {
  ASSERT_TRUE(WriteFileAtomically(path, bytes).ok()) << path;
}

// Each bad file is refused by the rank that needs it, naming the file and the field (expected and
// found), and that rank's slots keep every byte they held; no rank loads a bad file. The bad files
// are of layer 1 (or stand for a file of layer 1), which a rank reads after its layer-0 files: a
// load that copied each file as it read it would already have changed layer 0's slots.
TEST(CheckpointTest, BadExpertFilesAreRefusedBeforeAnySlotChanges) {
  auto created = CreateTwoRankJob();
  ASSERT_TRUE(created.ok()) << created.status().ToString();
  TwoRankJob& job = **created;
  const std::string dir = FreshFolder("bad_files");
  FillSaved(job);
  for (const auto& engine : job.engines) ASSERT_TRUE(engine->SaveExperts(dir).ok());
  ASSERT_TRUE(std::filesystem::exists(dir + "/layer-1/expert-2.shard-1-of-2.bin"));

  using Mutation = std::function<void(const std::string& case_dir)>;
  const auto flip = [](const char* file, size_t offset, unsigned char mask) -> Mutation {
    return [=](const std::string& d) {
      std::string bytes = ReadBytes(d + file);
      bytes[offset] = static_cast<char>(bytes[offset] ^ mask);
      WriteBytes(d + file, bytes);
    };
  };
  const auto copy = [](const char* from, const char* to) -> Mutation {
    return [=](const std::string& d) { WriteBytes(d + to, ReadBytes(d + from)); };
  };
  constexpr size_t kHeader = 56;  // the version-2 header
  struct Case {
    const char* name;
    Mutation mutate;
    const char* file;  // the file the error names
    const char* text;  // what follows "<file>: "
  };
  const Case cases[] = {
      {"flipped payload bit", flip("/layer-1/expert-4.bin", kHeader + 9, 0x10),
       "/layer-1/expert-4.bin", "checksum: expected 0x"},
      {"flipped optimizer-state bit", flip("/layer-1/expert-6.bin", kHeader + 256 + 100, 0x01),
       "/layer-1/expert-6.bin", "checksum: expected 0x"},
      {"flipped magic byte", flip("/layer-1/expert-4.bin", 3, 0x20), "/layer-1/expert-4.bin",
       "magic: expected \"KEELEXP2\" (a Keel expert file), found \"KEElEXP2\""},
      {"flipped version byte", flip("/layer-1/expert-4.bin", 8, 0x01), "/layer-1/expert-4.bin",
       "version: expected 2, found 3"},
      {"flipped layer byte", flip("/layer-1/expert-4.bin", 13, 0x01), "/layer-1/expert-4.bin",
       "layer: expected 1, found 257"},
      {"flipped weight_bytes byte", flip("/layer-1/expert-4.bin", 33, 0x80),
       "/layer-1/expert-4.bin", "weight_bytes: expected 256, found 33024"},
      {"flipped checksum byte", flip("/layer-1/expert-4.bin", 50, 0x04), "/layer-1/expert-4.bin",
       "checksum: expected 0x"},
      {"truncated",
       [](const std::string& d) {
         std::string bytes = ReadBytes(d + "/layer-1/expert-4.bin");
         bytes.pop_back();
         WriteBytes(d + "/layer-1/expert-4.bin", bytes);
       },
       "/layer-1/expert-4.bin",
       "file length: expected 824 bytes (56 of header, 256 of weights, 512 of optimizer state), "
       "found 823 (truncated)"},
      {"truncated inside the header",
       [](const std::string& d) {
         WriteBytes(d + "/layer-1/expert-4.bin",
                    ReadBytes(d + "/layer-1/expert-4.bin").substr(0, 20));
       },
       "/layer-1/expert-4.bin", "file length: expected 824 bytes"},
      // Read no further than a file of this engine's shape goes: refused before it is read.
      {"trailing bytes",
       [](const std::string& d) {
         WriteBytes(d + "/layer-1/expert-4.bin", ReadBytes(d + "/layer-1/expert-4.bin") + "x");
       },
       "/layer-1/expert-4.bin",
       "825 bytes is more than 824 bytes, the size of an expert file of this engine (56 of "
       "header, 256 of weights, 512 of optimizer state)"},
      {"a 2 GiB file (sparse)",
       [](const std::string& d) {
         std::filesystem::resize_file(d + "/layer-1/expert-4.bin", uint64_t{2} << 30);
       },
       "/layer-1/expert-4.bin", "2 GiB is more than 824 bytes, the size of an expert file"},
      {"a FIFO with no writer",
       [](const std::string& d) {
         std::filesystem::remove(d + "/layer-1/expert-4.bin");
         ASSERT_EQ(::mkfifo((d + "/layer-1/expert-4.bin").c_str(), 0600), 0);
       },
       "/layer-1/expert-4.bin", "is a FIFO (named pipe), not a regular file"},
      {"a link to /dev/zero",
       [](const std::string& d) {
         std::filesystem::remove(d + "/layer-1/expert-4.bin");
         std::filesystem::create_symlink("/dev/zero", d + "/layer-1/expert-4.bin");
       },
       "/layer-1/expert-4.bin", "is a character device, not a regular file"},
      {"a folder",
       [](const std::string& d) {
         std::filesystem::remove(d + "/layer-1/expert-4.bin");
         std::filesystem::create_directory(d + "/layer-1/expert-4.bin");
       },
       "/layer-1/expert-4.bin", "is a folder, expected a file"},
      {"expert 3's file over expert 5's", copy("/layer-1/expert-3.bin", "/layer-1/expert-5.bin"),
       "/layer-1/expert-5.bin", "expert: expected 5, found 3"},
      {"layer 1's file over layer 0's", copy("/layer-1/expert-7.bin", "/layer-0/expert-7.bin"),
       "/layer-0/expert-7.bin", "layer: expected 0, found 1"},
      {"shard 1's file over shard 0's",
       copy("/layer-1/expert-2.shard-1-of-2.bin", "/layer-1/expert-2.shard-0-of-2.bin"),
       "/layer-1/expert-2.shard-0-of-2.bin", "shard: expected 0, found 1"},
      {"missing file",
       [](const std::string& d) { std::filesystem::remove(d + "/layer-1/expert-6.bin"); },
       "/layer-1/expert-6.bin", "cannot open"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const std::string case_dir = FreshFolder("bad_case");
    std::filesystem::copy(dir, case_dir, std::filesystem::copy_options::recursive);
    c.mutate(case_dir);
    FillOther(job);
    std::vector<RankBuffers> before = job.buffers;
    int refused = 0;
    for (int r = 0; r < TwoRankJob::kRanks; ++r) {
      const Status loaded = job.engines[r]->LoadExperts(case_dir);
      if (loaded.ok()) {
        EXPECT_TRUE(HoldsSaved(job, r)) << "rank " << r << " loaded, but not the saved experts";
        continue;
      }
      ++refused;
      EXPECT_NE(loaded.message().find(case_dir + c.file + ": " + c.text), std::string::npos)
          << "rank " << r << ": " << loaded.ToString();
      EXPECT_EQ(job.buffers[r].weights, before[r].weights) << "rank " << r << " changed weights";
      EXPECT_EQ(job.buffers[r].optimizer, before[r].optimizer)
          << "rank " << r << " changed optimizer state";
    }
    EXPECT_GE(refused, 1) << "no rank refused the bad file";
    std::filesystem::remove_all(case_dir);
  }

  // The intact checkpoint loads on every rank.
  FillOther(job);
  for (int r = 0; r < TwoRankJob::kRanks; ++r) {
    const Status loaded = job.engines[r]->LoadExperts(dir);
    ASSERT_TRUE(loaded.ok()) << "rank " << r << ": " << loaded.ToString();
    EXPECT_TRUE(HoldsSaved(job, r)) << "rank " << r;
  }
  std::filesystem::remove_all(dir);
}

// Files of version 1 (magic "KEELEXP1", then weight_bytes and optimizer_bytes, then the payload)
// load as before: without an identity or checksum to check, only their sizes and length.
TEST(CheckpointTest, Version1FilesLoadUnverified) {
  auto created = CreateTwoRankJob();
  ASSERT_TRUE(created.ok()) << created.status().ToString();
  TwoRankJob& job = **created;
  const std::string dir = FreshFolder("version1");
  FillSaved(job);
  for (const auto& engine : job.engines) ASSERT_TRUE(engine->SaveExperts(dir).ok());
  // Every file rewritten as version 1.
  for (const auto& entry : std::filesystem::recursive_directory_iterator(dir)) {
    if (!entry.is_regular_file()) continue;
    const std::string v2 = ReadBytes(entry.path().string());
    std::string v1 = "KEELEXP1" + v2.substr(32, 16) + v2.substr(56);
    WriteBytes(entry.path().string(), v1);
  }
  FillOther(job);
  for (int r = 0; r < TwoRankJob::kRanks; ++r) {
    const Status loaded = job.engines[r]->LoadExperts(dir);
    ASSERT_TRUE(loaded.ok()) << "rank " << r << ": " << loaded.ToString();
    EXPECT_TRUE(HoldsSaved(job, r)) << "rank " << r;
  }
  // Their length is still checked, before any slot changes.
  const std::string file = dir + "/layer-1/expert-4.bin";
  WriteBytes(file, ReadBytes(file) + "xy");
  FillOther(job);
  const std::vector<RankBuffers> before = job.buffers;
  int refused = 0;
  for (int r = 0; r < TwoRankJob::kRanks; ++r) {
    const Status loaded = job.engines[r]->LoadExperts(dir);
    if (loaded.ok()) continue;
    ++refused;
    EXPECT_NE(loaded.message().find(file + ": file length: expected 792 bytes"), std::string::npos)
        << loaded.ToString();
    EXPECT_EQ(job.buffers[r].weights, before[r].weights);
  }
  EXPECT_EQ(refused, 1);
  std::filesystem::remove_all(dir);
}

// An empty folder would put the files at the filesystem root ("/layer-0/..."), and the root is no
// checkpoint's folder: both refused by argument, nothing written.
TEST(CheckpointTest, CheckpointFolderIsNeitherEmptyNorTheRoot) {
  auto created = CreateTwoRankJob();
  ASSERT_TRUE(created.ok()) << created.status().ToString();
  Engine& engine = *(*created)->engines[0];
  const bool root_had_layer0 = std::filesystem::exists("/layer-0");
  const Status empty = engine.SaveExperts("");
  ASSERT_FALSE(empty.ok());
  EXPECT_EQ(empty.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(empty.message().find("SaveExperts: dir is empty"), std::string::npos)
      << empty.ToString();
  for (const char* root : {"/", "/tmp/..", "//."}) {
    const Status status = engine.SaveExperts(root);
    ASSERT_FALSE(status.ok()) << root;
    EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(status.message(), std::string("SaveExperts: dir '") + root +
                                    "' is the filesystem root: name a folder of its own");
  }
  EXPECT_EQ(std::filesystem::exists("/layer-0"), root_had_layer0) << "/layer-0 was written";
  const Status load = engine.LoadExperts("");
  ASSERT_FALSE(load.ok());
  EXPECT_EQ(load.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(load.message().find("LoadExperts: dir is empty"), std::string::npos);
}

}  // namespace
}  // namespace keel::toy
