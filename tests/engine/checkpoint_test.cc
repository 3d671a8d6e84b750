// Checkpoints with moving experts: the engine's state and every expert by logical id, saved
// right after a StepEnd that left a migration in flight, are loaded by new engines in a new
// process, which train on to the end with weights and optimizer state bitwise equal to an
// uninterrupted run (the toy trainer's engine-free reference). The same checkpoint loads into a
// job with another number of ranks and another placement.
#include <gtest/gtest.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "comm/communicator.h"
#include "common/file.h"
#include "keel/engine.hpp"
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
  Result<std::string> text = ReadFile(dir + kStateFile);
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
  const EngineState state = EngineStateFromJson(ReadFile(dir + kStateFile).value()).value();
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
        KEEL_ASSIGN_OR_RETURN(std::string text, ReadFile(dir + kStateFile));
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
       "epoch must be an integer >= 0, got -2"},
      {R"({"keel_engine_state": 1, "epoch": 0, "phy2log": [[0, "x"]], "home": [[0]]})",
       "phy2log[0][1] must be an integer >= -1, got \"x\""},
      {R"({"keel_engine_state": 1, "epoch": 0, "phy2log": [[0]], "home": []})",
       "phy2log has 1 layers, home 0"},
      {R"({"keel_engine_state": 1, "epoch": 0, "phy2log": [[0]], "home": [[0]], "shards": 2})",
       "shards must be an array per layer, as phy2log is"},
      {R"({"keel_engine_state": 1, "epoch": 0, "phy2log": [[0]], "home": [[0]],
           "shards": [[1, -3]]})",
       "shards[0][1] must be an integer >= -1, got -3"},
  };
  for (const auto& [text, message] : bad) {
    Result<EngineState> parsed = EngineStateFromJson(text);
    ASSERT_FALSE(parsed.ok()) << text;
    EXPECT_NE(parsed.status().message().find(message), std::string::npos)
        << text << " -> " << parsed.status().ToString();
  }
}

}  // namespace
}  // namespace keel::toy
