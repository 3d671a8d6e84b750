// Tests of the C API (include/keel/keel.h): every bad argument of every function returns its
// status and a last-error message that names the parameter and its value; the last error is per
// thread; and two ranks as threads route, reduce and end steps through the C API alone, half
// of the steps counting and remapping their entries themselves as a GPU trainer would.
#include "keel/keel.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "keel/version.hpp"
#include "kernels/device.h"
#include "kernels/histogram.h"
#include "kernels/remap.h"

namespace keel {
namespace {

// `status` is `want` and the last error contains every one of `parts`.
::testing::AssertionResult Fails(keel_status_t status, keel_status_t want,
                                 std::initializer_list<std::string> parts) {
  const std::string message = keel_last_error();
  if (status != want) {
    return ::testing::AssertionFailure()
           << "status " << keel_status_name(status) << ", want " << keel_status_name(want)
           << "; last error: \"" << message << "\"";
  }
  for (const std::string& part : parts) {
    if (message.find(part) == std::string::npos) {
      return ::testing::AssertionFailure()
             << "last error \"" << message << "\" lacks \"" << part << "\"";
    }
  }
  return ::testing::AssertionSuccess();
}

::testing::AssertionResult Succeeds(keel_status_t status) {
  if (status == KEEL_OK && std::string(keel_last_error()).empty()) {
    return ::testing::AssertionSuccess();
  }
  return ::testing::AssertionFailure() << keel_status_name(status) << ": " << keel_last_error();
}

// A value of an enum type that is none of its enumerators, written through its bytes (a C
// caller can pass any int; C++ may not form such a value by a cast). Returning it loads it, which
// UBSan's enum check reports when this file is not optimized: the one load made on purpose.
template <typename Enum>
__attribute__((no_sanitize("enum"))) Enum BadEnum(int value) {
  static_assert(sizeof(Enum) == sizeof(int));
  Enum out;
  std::memcpy(&out, &value, sizeof(out));
  return out;
}

TEST(CApiTest, StatusNamesMirrorStatusCodes) {
  EXPECT_STREQ(keel_status_name(KEEL_OK), "OK");
  EXPECT_STREQ(keel_status_name(KEEL_INVALID_ARGUMENT), "INVALID_ARGUMENT");
  EXPECT_STREQ(keel_status_name(KEEL_NOT_FOUND), "NOT_FOUND");
  EXPECT_STREQ(keel_status_name(KEEL_IO_ERROR), "IO_ERROR");
  EXPECT_STREQ(keel_status_name(KEEL_FAILED_PRECONDITION), "FAILED_PRECONDITION");
  EXPECT_STREQ(keel_status_name(KEEL_OUT_OF_RANGE), "OUT_OF_RANGE");
  EXPECT_STREQ(keel_status_name(KEEL_UNIMPLEMENTED), "UNIMPLEMENTED");
  EXPECT_STREQ(keel_status_name(KEEL_INTERNAL), "INTERNAL");
  EXPECT_STREQ(keel_status_name(KEEL_DEADLINE_EXCEEDED), "DEADLINE_EXCEEDED");
  EXPECT_STREQ(keel_status_name(KEEL_ABORTED), "ABORTED");
  EXPECT_STREQ(keel_status_name(BadEnum<keel_status_t>(10)), "UNKNOWN");
  EXPECT_STREQ(keel_status_name(BadEnum<keel_status_t>(-1)), "UNKNOWN");
}

TEST(CApiTest, VersionIsTheLibraryVersion) { EXPECT_STREQ(keel_version(), kVersion); }

TEST(CApiTest, LastErrorIsPerThreadAndClearedBySuccess) {
  keel_group_t* group = nullptr;
  ASSERT_TRUE(Fails(keel_group_create(0, &group), KEEL_INVALID_ARGUMENT,
                    {"keel_group_create: num_ranks = 0"}));
  EXPECT_EQ(group, nullptr);
  std::string other_thread_error = "unset";
  std::thread other([&] {
    other_thread_error = keel_last_error();
    keel_group_t* mine = nullptr;
    EXPECT_EQ(keel_group_create(-2, &mine), KEEL_INVALID_ARGUMENT);
  });
  other.join();
  EXPECT_EQ(other_thread_error, "");
  // The other thread's failure does not show here.
  EXPECT_STREQ(keel_last_error(), "keel_group_create: num_ranks = 0 is not in [1, 4096]");

  ASSERT_TRUE(Succeeds(keel_group_create(1, &group)));
  EXPECT_STREQ(keel_last_error(), "");
  EXPECT_TRUE(Succeeds(keel_group_destroy(group)));
}

TEST(CApiTest, NoErrorFromStaticQueries) {
  keel_group_t* group = nullptr;
  ASSERT_EQ(keel_group_create(0, &group), KEEL_INVALID_ARGUMENT);
  // keel_status_name, keel_version and keel_last_error leave the last error alone.
  keel_status_name(KEEL_OK);
  keel_version();
  EXPECT_STRNE(keel_last_error(), "");
}

TEST(CApiTest, OptionsInitFillsDefaults) {
  keel_engine_options_t options;
  std::memset(&options, 0xab, sizeof(options));
  ASSERT_TRUE(Succeeds(keel_engine_options_init(&options)));
  EXPECT_EQ(options.struct_size, sizeof(keel_engine_options_t));
  EXPECT_EQ(options.config_yaml, nullptr);
  EXPECT_EQ(options.config_path, nullptr);
  EXPECT_EQ(options.num_layers, 1);
  EXPECT_EQ(options.num_experts, 1);
  EXPECT_EQ(options.top_k, 1);
  EXPECT_EQ(options.weight_bytes, 0u);
  EXPECT_EQ(options.gradient_bytes, 0u);
  EXPECT_EQ(options.optimizer_bytes, 0u);
  EXPECT_EQ(options.gradient_type, KEEL_GRADIENT_FLOAT32);
  EXPECT_EQ(options.memory, KEEL_MEMORY_HOST);
  EXPECT_EQ(options.comm, nullptr);
  EXPECT_EQ(options.group, nullptr);
  EXPECT_EQ(options.mp_group_size, 0);
}

// A caller compiled against the first keel.h, which ended at `group`: the library takes
// mp_group_size as 0 (no MP groups) and creates the engine.
TEST(CApiTest, FirstVersionOfTheOptionsHasNoMpGroups) {
  keel_group_t* group = nullptr;
  keel_comm_t* comm = nullptr;
  ASSERT_TRUE(Succeeds(keel_group_create(1, &group)));
  ASSERT_TRUE(Succeeds(keel_comm_create_local(group, 0, &comm)));
  keel_engine_options_t options;
  const size_t first_version = offsetof(keel_engine_options_t, group) + sizeof(keel_group_t*);
  ASSERT_TRUE(Succeeds(keel_engine_options_init_sized(&options, first_version)));
  options.num_layers = 1;
  options.num_experts = 2;
  options.weight_bytes = 4;
  options.gradient_bytes = 4;
  options.comm = comm;
  options.mp_group_size = 7;  // past struct_size: the library must not read it
  keel_engine_t* engine = nullptr;
  EXPECT_TRUE(Succeeds(keel_engine_create(&options, &engine)));
  EXPECT_TRUE(Succeeds(keel_engine_destroy(engine)));
  EXPECT_TRUE(Succeeds(keel_comm_destroy(comm)));
  EXPECT_TRUE(Succeeds(keel_group_destroy(group)));
}

TEST(CApiTest, OptionsInitRejectsBadArguments) {
  EXPECT_TRUE(Fails(keel_engine_options_init(nullptr), KEEL_INVALID_ARGUMENT,
                    {"keel_engine_options_init_sized", "options = NULL"}));
  keel_engine_options_t options;
  EXPECT_TRUE(Fails(keel_engine_options_init_sized(&options, 8), KEEL_INVALID_ARGUMENT,
                    {"struct_size = 8", "first version"}));
  EXPECT_TRUE(Fails(keel_engine_options_init_sized(&options, 1 << 20), KEEL_INVALID_ARGUMENT,
                    {"struct_size = 1048576", "plausible"}));
}

TEST(CApiTest, OptionsInitZeroesFieldsOfANewerHeader) {
  // A caller compiled against a newer keel.h whose struct has one more field.
  struct Newer {
    keel_engine_options_t v1;
    int64_t appended;
  } newer;
  std::memset(&newer, 0xab, sizeof(newer));
  ASSERT_TRUE(Succeeds(keel_engine_options_init_sized(&newer.v1, sizeof(newer))));
  EXPECT_EQ(newer.v1.struct_size, sizeof(newer));
  EXPECT_EQ(newer.appended, 0);
  EXPECT_EQ(newer.v1.top_k, 1);
}

TEST(CApiTest, GroupRejectsBadArguments) {
  keel_group_t* group = nullptr;
  EXPECT_TRUE(Fails(keel_group_create(2, nullptr), KEEL_INVALID_ARGUMENT,
                    {"keel_group_create", "group_out = NULL"}));
  EXPECT_TRUE(Fails(keel_group_create(-3, &group), KEEL_INVALID_ARGUMENT, {"num_ranks = -3"}));
  EXPECT_TRUE(Succeeds(keel_group_destroy(nullptr)));

  ASSERT_TRUE(Succeeds(keel_group_create(2, &group)));
  keel_comm_t* comm = nullptr;
  ASSERT_TRUE(Succeeds(keel_comm_create_local(group, 1, &comm)));
  EXPECT_TRUE(Fails(keel_group_destroy(group), KEEL_FAILED_PRECONDITION,
                    {"keel_group_destroy", "1 comm(s)"}));
  EXPECT_TRUE(Succeeds(keel_comm_destroy(comm)));
  EXPECT_TRUE(Succeeds(keel_group_destroy(group)));
}

TEST(CApiTest, CommRejectsBadArguments) {
  keel_group_t* group = nullptr;
  ASSERT_TRUE(Succeeds(keel_group_create(2, &group)));
  keel_comm_t* comm = nullptr;
  EXPECT_TRUE(Fails(keel_comm_create_local(nullptr, 0, &comm), KEEL_INVALID_ARGUMENT,
                    {"keel_comm_create_local", "group = NULL"}));
  EXPECT_TRUE(
      Fails(keel_comm_create_local(group, 0, nullptr), KEEL_INVALID_ARGUMENT, {"comm_out = NULL"}));
  EXPECT_TRUE(Fails(keel_comm_create_local(group, 2, &comm), KEEL_INVALID_ARGUMENT,
                    {"rank = 2 is not in [0, 2)"}));
  EXPECT_TRUE(Fails(keel_comm_create_local(group, -1, &comm), KEEL_INVALID_ARGUMENT,
                    {"rank = -1 is not in [0, 2)"}));
  EXPECT_EQ(comm, nullptr);

  ASSERT_TRUE(Succeeds(keel_comm_create_local(group, 1, &comm)));
  keel_comm_t* twice = nullptr;
  EXPECT_TRUE(Fails(keel_comm_create_local(group, 1, &twice), KEEL_INVALID_ARGUMENT,
                    {"rank = 1 has already joined"}));
  int rank = -1;
  int size = -1;
  EXPECT_TRUE(Succeeds(keel_comm_rank(comm, &rank)));
  EXPECT_TRUE(Succeeds(keel_comm_size(comm, &size)));
  EXPECT_EQ(rank, 1);
  EXPECT_EQ(size, 2);
  EXPECT_TRUE(Fails(keel_comm_rank(nullptr, &rank), KEEL_INVALID_ARGUMENT,
                    {"keel_comm_rank: comm = NULL"}));
  EXPECT_TRUE(Fails(keel_comm_rank(comm, nullptr), KEEL_INVALID_ARGUMENT, {"rank_out = NULL"}));
  EXPECT_TRUE(Fails(keel_comm_size(nullptr, &size), KEEL_INVALID_ARGUMENT,
                    {"keel_comm_size: comm = NULL"}));
  EXPECT_TRUE(Fails(keel_comm_size(comm, nullptr), KEEL_INVALID_ARGUMENT, {"size_out = NULL"}));

  // A destroyed comm's rank can join again.
  EXPECT_TRUE(Succeeds(keel_comm_destroy(comm)));
  ASSERT_TRUE(Succeeds(keel_comm_create_local(group, 1, &comm)));
  EXPECT_TRUE(Succeeds(keel_comm_destroy(comm)));
  EXPECT_TRUE(Succeeds(keel_comm_destroy(nullptr)));
  EXPECT_TRUE(Succeeds(keel_group_destroy(group)));
}

TEST(CApiTest, MpiCommNeedsMpi) {
  EXPECT_TRUE(Fails(keel_comm_create_mpi(nullptr), KEEL_INVALID_ARGUMENT,
                    {"keel_comm_create_mpi: comm_out = NULL"}));
  keel_comm_t* comm = nullptr;
  const keel_status_t status = keel_comm_create_mpi(&comm);
  // Without MPI in the build: unimplemented. With it: this test never called MPI_Init.
  EXPECT_NE(status, KEEL_OK);
  if (!kWithMpi) {
    EXPECT_TRUE(Fails(status, KEEL_UNIMPLEMENTED, {"keel_comm_create_mpi", "MPI"}));
  } else {
    EXPECT_TRUE(Fails(status, KEEL_FAILED_PRECONDITION, {"keel_comm_create_mpi", "MPI"}));
  }
  EXPECT_EQ(comm, nullptr);
}

// Buffers of every slot of every layer of one rank, filled with a pattern per expert.
class RankBuffers {
 public:
  static constexpr int kFloats = 16;

  RankBuffers(int num_layers, int local_slots, int persistent)
      : local_slots_(local_slots),
        persistent_(persistent),
        weights_(static_cast<size_t>(num_layers) * local_slots * kFloats, 0.0f),
        gradients_(weights_.size(), 0.0f),
        optimizer_(static_cast<size_t>(num_layers) * local_slots * 2 * kFloats, 0.0f) {}

  float* weights(int layer, int slot) { return &weights_[Index(layer, slot) * kFloats]; }
  float* gradients(int layer, int slot) { return &gradients_[Index(layer, slot) * kFloats]; }
  float* optimizer(int layer, int slot) {
    return slot < persistent_ ? &optimizer_[Index(layer, slot) * 2 * kFloats] : nullptr;
  }

  static float Pattern(int layer, int expert, int i) {
    return static_cast<float>(layer * 1000 + expert * 10 + i);
  }

 private:
  size_t Index(int layer, int slot) const {
    return static_cast<size_t>(layer) * local_slots_ + slot;
  }
  int local_slots_;
  int persistent_;
  std::vector<float> weights_;
  std::vector<float> gradients_;
  std::vector<float> optimizer_;
};

constexpr int kLayers = 4;
constexpr int kExperts = 6;
constexpr int kTopK = 2;

void FillShape(keel_engine_options_t& options) {
  options.num_layers = kLayers;
  options.num_experts = kExperts;
  options.top_k = kTopK;
  options.weight_bytes = RankBuffers::kFloats * sizeof(float);
  options.gradient_bytes = RankBuffers::kFloats * sizeof(float);
  options.optimizer_bytes = 2 * RankBuffers::kFloats * sizeof(float);
}

constexpr const char* kOneRankYaml =
    "topology:\n  num_nodes: 1\n  gpus_per_node: 1\n"
    "slots:\n  persistent_per_rank: 6\n  transient_per_rank: 1\n";

// One rank in one thread: enough to reach every argument check of the engine functions.
class CApiEngineTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(Succeeds(keel_group_create(1, &group_)));
    ASSERT_TRUE(Succeeds(keel_comm_create_local(group_, 0, &comm_)));
    ASSERT_TRUE(Succeeds(keel_engine_options_init(&options_)));
    FillShape(options_);
    options_.config_yaml = kOneRankYaml;
    options_.comm = comm_;
  }
  void TearDown() override {
    EXPECT_TRUE(Succeeds(keel_engine_destroy(engine_)));
    EXPECT_TRUE(Succeeds(keel_comm_destroy(comm_)));
    EXPECT_TRUE(Succeeds(keel_group_destroy(group_)));
  }
  // Creation with options_ must fail with `want` and a message holding `parts`.
  ::testing::AssertionResult CreateFails(keel_status_t want,
                                         std::initializer_list<std::string> parts) {
    keel_engine_t* engine = nullptr;
    const keel_status_t status = keel_engine_create(&options_, &engine);
    if (engine != nullptr) {
      (void)keel_engine_destroy(engine);
      return ::testing::AssertionFailure() << "created an engine";
    }
    std::vector<std::string> with_function = {"keel_engine_create: "};
    with_function.insert(with_function.end(), parts.begin(), parts.end());
    const std::string message = keel_last_error();
    if (status != want) {
      return ::testing::AssertionFailure() << keel_status_name(status) << ": " << message;
    }
    for (const std::string& part : with_function) {
      if (message.find(part) == std::string::npos) {
        return ::testing::AssertionFailure() << "\"" << message << "\" lacks \"" << part << "\"";
      }
    }
    return ::testing::AssertionSuccess();
  }
  void CreateAndRegister() {
    ASSERT_TRUE(Succeeds(keel_engine_create(&options_, &engine_)));
    int persistent = 0;
    int transient = 0;
    ASSERT_TRUE(Succeeds(keel_engine_slots_per_rank(engine_, &persistent)));
    ASSERT_TRUE(Succeeds(keel_engine_transient_per_rank(engine_, &transient)));
    EXPECT_EQ(persistent, 6);
    EXPECT_EQ(transient, 1);
    buffers_ = std::make_unique<RankBuffers>(kLayers, persistent + transient, persistent);
    for (int l = 0; l < kLayers; ++l) {
      for (int s = 0; s < persistent + transient; ++s) {
        ASSERT_TRUE(Succeeds(keel_engine_register_slot(engine_, l, s, buffers_->weights(l, s),
                                                       buffers_->gradients(l, s),
                                                       buffers_->optimizer(l, s))));
      }
    }
  }

  keel_group_t* group_ = nullptr;
  keel_comm_t* comm_ = nullptr;
  keel_engine_t* engine_ = nullptr;
  keel_engine_options_t options_;
  std::unique_ptr<RankBuffers> buffers_;
};

// Shapes within each size's own bound whose products are beyond the limits of a job
// (docs/config.md, "Limits"): refused by keel_engine_create before it allocates, naming the product
// and the limit.
TEST_F(CApiEngineTest, CreateRefusesProductsOfSizesBeyondTheLimits) {
  struct Case {
    const char* config_yaml;
    int num_layers;
    int num_experts;
    const char* part;
  };
  const Case cases[] = {
      {"topology:\n  num_nodes: 1\n  gpus_per_node: 1\nslots:\n  persistent_per_rank: 512\n", 65536,
       256, "num_layers x slots per layer (513) = 33619968 is more than 16777216"},
      {"topology:\n  num_nodes: 1\n  gpus_per_node: 1\nslots:\n  persistent_per_rank: 4096\n"
       "estimator:\n  kind: window\n  window_steps: 1000\n",
       64, 4096,
       "num_layers x ranks x num_experts x (estimator.window_steps + 1) = 64 x 1 x 4096 x 1001 "
       "load counts, more than the 2^26"},
      {"topology:\n  num_nodes: 256\n  gpus_per_node: 256\n", 1, 1,
       "65536 ranks, more than the 4096 Keel supports"},
  };
  for (const Case& c : cases) {
    options_.config_yaml = c.config_yaml;
    options_.num_layers = c.num_layers;
    options_.num_experts = c.num_experts;
    EXPECT_TRUE(CreateFails(KEEL_INVALID_ARGUMENT, {c.part})) << c.config_yaml;
  }
  keel_group_t* group = nullptr;
  for (const int ranks : {4097, 2147483647}) {
    EXPECT_TRUE(Fails(
        keel_group_create(ranks, &group), KEEL_INVALID_ARGUMENT,
        {"keel_group_create: num_ranks = " + std::to_string(ranks) + " is not in [1, 4096]"}));
  }
}

TEST_F(CApiEngineTest, CreateRejectsNullsAndStructSizes) {
  keel_engine_t* engine = nullptr;
  EXPECT_TRUE(Fails(keel_engine_create(nullptr, &engine), KEEL_INVALID_ARGUMENT,
                    {"keel_engine_create: options = NULL"}));
  EXPECT_TRUE(Fails(keel_engine_create(&options_, nullptr), KEEL_INVALID_ARGUMENT,
                    {"keel_engine_create: engine_out = NULL"}));
  options_.struct_size = 16;
  EXPECT_TRUE(CreateFails(KEEL_INVALID_ARGUMENT, {"options->struct_size = 16", "first version"}));

  // A newer caller's struct: unknown bytes must be zero, or an option would be ignored.
  struct Newer {
    keel_engine_options_t v1;
    int64_t appended;
  } newer;
  std::memset(&newer, 0, sizeof(newer));
  newer.v1 = options_;
  newer.v1.struct_size = sizeof(newer);
  newer.appended = 5;
  EXPECT_TRUE(
      Fails(keel_engine_create(&newer.v1, &engine), KEEL_INVALID_ARGUMENT,
            {"options->struct_size = " + std::to_string(sizeof(newer)),
             "byte " + std::to_string(sizeof(keel_engine_options_t)) + " is set", "newer"}));
  EXPECT_EQ(engine, nullptr);

  options_.struct_size = size_t{1} << 40;  // uninitialized memory
  EXPECT_TRUE(
      CreateFails(KEEL_INVALID_ARGUMENT, {"options->struct_size = 1099511627776", "plausible"}));

  options_.struct_size = sizeof(options_);
  options_.comm = nullptr;
  EXPECT_TRUE(CreateFails(KEEL_INVALID_ARGUMENT, {"options->comm = NULL"}));
}

TEST_F(CApiEngineTest, CreateRejectsBadConfigs) {
  options_.config_path = "/nonexistent/keel.yaml";
  EXPECT_TRUE(CreateFails(KEEL_INVALID_ARGUMENT,
                          {"options->config_yaml and options->config_path are both set"}));
  options_.config_yaml = nullptr;
  EXPECT_TRUE(CreateFails(KEEL_NOT_FOUND, {"/nonexistent/keel.yaml"}));

  options_.config_path = nullptr;
  options_.config_yaml = "topology:\n  gpus_per_node: 1\nslots:\n  persistent_per_rank: zero\n";
  EXPECT_TRUE(CreateFails(KEEL_INVALID_ARGUMENT,
                          {"options->config_yaml:4", "slots.persistent_per_rank", "zero"}));
  options_.config_yaml = "topology:\n  gpus_per_node: 1\n  num_gpus: 3\n";
  EXPECT_TRUE(CreateFails(KEEL_INVALID_ARGUMENT, {"options->config_yaml:3", "num_gpus"}));
  options_.config_yaml = "topology: [1, 2\n";
  EXPECT_TRUE(CreateFails(KEEL_INVALID_ARGUMENT, {"options->config_yaml", "YAML"}));

  options_.config_yaml = "topology:\n  gpus_per_node: 4\n";
  EXPECT_TRUE(CreateFails(KEEL_INVALID_ARGUMENT,
                          {"options->comm has 1 ranks", "topology.gpus_per_node = 4"}));
  // Sharded experts need LayerRoute::row_entry, which the C API does not carry.
  options_.config_yaml =
      "topology:\n  gpus_per_node: 1\nslots:\n  persistent_per_rank: 6\npolicy:\n  keel:\n    "
      "shard_experts: true\n";
  EXPECT_TRUE(CreateFails(KEEL_INVALID_ARGUMENT,
                          {"policy.keel.shard_experts = true", "the C API routes one row"}));
}

TEST_F(CApiEngineTest, DefaultConfigFitsTheCommunicator) {
  options_.config_yaml = nullptr;
  options_.num_experts = 2;
  options_.top_k = 1;
  ASSERT_TRUE(Succeeds(keel_engine_create(&options_, &engine_)));
  int num_ranks = 0;
  EXPECT_TRUE(Succeeds(keel_engine_num_ranks(engine_, &num_ranks)));
  EXPECT_EQ(num_ranks, 1);
}

TEST_F(CApiEngineTest, CreateRejectsBadShapes) {
  const keel_engine_options_t good = options_;
  options_.num_layers = 0;
  EXPECT_TRUE(CreateFails(KEEL_INVALID_ARGUMENT, {"options->num_layers = 0"}));
  options_ = good;
  options_.num_experts = -1;
  EXPECT_TRUE(CreateFails(KEEL_INVALID_ARGUMENT, {"options->num_experts = -1"}));
  options_ = good;
  options_.top_k = 0;
  EXPECT_TRUE(CreateFails(KEEL_INVALID_ARGUMENT, {"options->top_k = 0"}));
  options_.top_k = kExperts + 1;
  EXPECT_TRUE(CreateFails(KEEL_INVALID_ARGUMENT, {"options->top_k = 7", "num_experts = 6"}));
  options_ = good;
  options_.gradient_type = BadEnum<keel_gradient_type_t>(7);
  EXPECT_TRUE(CreateFails(KEEL_INVALID_ARGUMENT, {"options->gradient_type = 7"}));
  options_.gradient_type = BadEnum<keel_gradient_type_t>(KEEL_GRADIENT_FLOAT16 + 1);
  EXPECT_TRUE(CreateFails(KEEL_INVALID_ARGUMENT,
                          {"options->gradient_type = 5", "KEEL_GRADIENT_FLOAT16 = 4"}));
  options_ = good;
  options_.memory = BadEnum<keel_memory_kind_t>(-4);
  EXPECT_TRUE(CreateFails(KEEL_INVALID_ARGUMENT, {"options->memory = -4"}));
  options_ = good;
  options_.weight_bytes = 0;
  EXPECT_TRUE(CreateFails(KEEL_INVALID_ARGUMENT, {"options->weight_bytes = 0"}));
  options_ = good;
  options_.gradient_bytes = 10;
  EXPECT_TRUE(CreateFails(KEEL_INVALID_ARGUMENT, {"options->gradient_bytes = 10", "4"}));
  options_.gradient_type = KEEL_GRADIENT_FIXED_INT64;
  options_.gradient_bytes = 12;
  EXPECT_TRUE(CreateFails(KEEL_INVALID_ARGUMENT, {"options->gradient_bytes = 12", "8"}));
  options_.gradient_type = KEEL_GRADIENT_BFLOAT16;
  options_.gradient_bytes = 11;
  EXPECT_TRUE(CreateFails(KEEL_INVALID_ARGUMENT,
                          {"options->gradient_bytes = 11", "multiple of 2 (the size"}));
}

// 16-bit gradients take any even gradient_bytes.
TEST_F(CApiEngineTest, CreatesWithSixteenBitGradients) {
  for (keel_gradient_type_t type : {KEEL_GRADIENT_BFLOAT16, KEEL_GRADIENT_FLOAT16}) {
    options_.gradient_type = type;
    options_.gradient_bytes = 6;
    ASSERT_TRUE(Succeeds(keel_engine_create(&options_, &engine_))) << type;
    ASSERT_TRUE(Succeeds(keel_engine_destroy(engine_)));
    engine_ = nullptr;
  }
}

// Device buffers are CUDA memory through the C API; without a GPU the error says what is missing.
TEST_F(CApiEngineTest, DeviceMemoryNeedsAGpu) {
  if (kernels::GpuAvailable()) GTEST_SKIP() << "a GPU is present";
  options_.memory = KEEL_MEMORY_DEVICE;
  EXPECT_TRUE(CreateFails(kWithCuda ? KEEL_FAILED_PRECONDITION : KEEL_UNIMPLEMENTED,
                          {"shape.memory = device needs a GPU"}));
}

TEST_F(CApiEngineTest, CreateRejectsAForeignGroup) {
  keel_group_t* other = nullptr;
  ASSERT_TRUE(Succeeds(keel_group_create(1, &other)));
  options_.group = other;
  EXPECT_TRUE(CreateFails(KEEL_INVALID_ARGUMENT,
                          {"options->group is not the group options->comm was created from"}));
  EXPECT_TRUE(Succeeds(keel_group_destroy(other)));
}

TEST_F(CApiEngineTest, CommAndEngineLifetimes) {
  CreateAndRegister();
  EXPECT_TRUE(Fails(keel_comm_destroy(comm_), KEEL_FAILED_PRECONDITION,
                    {"keel_comm_destroy", "1 engine(s)"}));
  EXPECT_TRUE(Fails(keel_group_destroy(group_), KEEL_FAILED_PRECONDITION, {"1 comm(s)"}));
  EXPECT_TRUE(Succeeds(keel_engine_destroy(nullptr)));
}

TEST_F(CApiEngineTest, RegisterSlotRejectsBadArguments) {
  ASSERT_TRUE(Succeeds(keel_engine_create(&options_, &engine_)));
  RankBuffers buffers(kLayers, 7, 6);
  float* w = buffers.weights(0, 0);
  float* g = buffers.gradients(0, 0);
  float* o = buffers.optimizer(0, 0);
  EXPECT_TRUE(Fails(keel_engine_register_slot(nullptr, 0, 0, w, g, o), KEEL_INVALID_ARGUMENT,
                    {"keel_engine_register_slot: engine = NULL"}));
  EXPECT_TRUE(Fails(keel_engine_register_slot(engine_, kLayers, 0, w, g, o), KEEL_INVALID_ARGUMENT,
                    {"keel_engine_register_slot: layer = 4 is not in [0, 4)"}));
  EXPECT_TRUE(Fails(keel_engine_register_slot(engine_, -1, 0, w, g, o), KEEL_INVALID_ARGUMENT,
                    {"layer = -1 is not in [0, 4)"}));
  EXPECT_TRUE(Fails(keel_engine_register_slot(engine_, 0, 7, w, g, o), KEEL_INVALID_ARGUMENT,
                    {"local_slot = 7 is not in [0, 7)"}));
  EXPECT_TRUE(Fails(keel_engine_register_slot(engine_, 0, -2, w, g, o), KEEL_INVALID_ARGUMENT,
                    {"local_slot = -2 is not in [0, 7)"}));
  EXPECT_TRUE(Fails(keel_engine_register_slot(engine_, 0, 0, nullptr, g, o), KEEL_INVALID_ARGUMENT,
                    {"weights = NULL"}));
  EXPECT_TRUE(Fails(keel_engine_register_slot(engine_, 0, 0, w, nullptr, o), KEEL_INVALID_ARGUMENT,
                    {"gradients = NULL"}));
  EXPECT_TRUE(Fails(keel_engine_register_slot(engine_, 0, 0, w, g, nullptr), KEEL_INVALID_ARGUMENT,
                    {"optimizer = NULL", "local_slot = 0"}));
  EXPECT_TRUE(Fails(keel_engine_register_slot(engine_, 0, 6, w, g, o), KEEL_INVALID_ARGUMENT,
                    {"optimizer is set for transient local_slot = 6"}));
  EXPECT_TRUE(Succeeds(keel_engine_register_slot(engine_, 0, 6, w, g, nullptr)));
}

TEST_F(CApiEngineTest, RouteRejectsBadArguments) {
  CreateAndRegister();
  std::vector<int32_t> ids = {0, 1, 2, 3};
  std::vector<int32_t> slots(ids.size());
  std::vector<int64_t> send(1);
  EXPECT_TRUE(Fails(
      keel_engine_route(nullptr, 0, ids.data(), 2, slots.data(), send.data(), nullptr, nullptr),
      KEEL_INVALID_ARGUMENT, {"keel_engine_route: engine = NULL"}));
  EXPECT_TRUE(Fails(
      keel_engine_route(engine_, 7, ids.data(), 2, slots.data(), send.data(), nullptr, nullptr),
      KEEL_INVALID_ARGUMENT, {}));
  EXPECT_STREQ(keel_last_error(), "keel_engine_route: layer = 7 is not in [0, 4)");
  EXPECT_TRUE(Fails(
      keel_engine_route(engine_, 0, ids.data(), -1, slots.data(), send.data(), nullptr, nullptr),
      KEEL_INVALID_ARGUMENT, {"num_tokens = -1"}));
  EXPECT_TRUE(Fails(keel_engine_route(engine_, 0, ids.data(), int64_t{1} << 40, slots.data(),
                                      send.data(), nullptr, nullptr),
                    KEEL_INVALID_ARGUMENT, {"num_tokens = 1099511627776"}));
  EXPECT_TRUE(
      Fails(keel_engine_route(engine_, 0, nullptr, 2, slots.data(), send.data(), nullptr, nullptr),
            KEEL_INVALID_ARGUMENT, {"topk_ids = NULL with num_tokens = 2"}));
  EXPECT_TRUE(
      Fails(keel_engine_route(engine_, 0, ids.data(), 2, nullptr, send.data(), nullptr, nullptr),
            KEEL_INVALID_ARGUMENT, {"slot_out = NULL with num_tokens = 2"}));
  EXPECT_TRUE(
      Fails(keel_engine_route(engine_, 0, ids.data(), 2, slots.data(), nullptr, nullptr, nullptr),
            KEEL_INVALID_ARGUMENT, {"send_counts = NULL"}));
  ids[3] = 40;
  EXPECT_TRUE(Fails(
      keel_engine_route(engine_, 0, ids.data(), 2, slots.data(), send.data(), nullptr, nullptr),
      KEEL_INVALID_ARGUMENT, {"keel_engine_route: ", "topk_ids[3] = 40"}));
  ids[3] = -2;
  EXPECT_TRUE(Fails(
      keel_engine_route(engine_, 0, ids.data(), 2, slots.data(), send.data(), nullptr, nullptr),
      KEEL_INVALID_ARGUMENT, {"topk_ids[3] = -2"}));
}

TEST_F(CApiEngineTest, PlanSequencesAnswersAndRejectsBadArguments) {
  CreateAndRegister();
  // Two sequences of 8 tokens over 2 planned layers; one rank, so both stay.
  const std::vector<int64_t> tokens = {8, 8};
  std::vector<int32_t> rows(2 * 2 * kExperts, 0);
  for (size_t i = 0; i < rows.size(); i += 3) rows[i] = 4;
  std::vector<int32_t> origin(2, -1), index(2, -1), rank(2, -1);
  int64_t total = -1;
  int used = -1;
  ASSERT_TRUE(Succeeds(keel_engine_plan_sequences(engine_, 1, 2, 2, tokens.data(), rows.data(), 1.1,
                                                  2, origin.data(), index.data(), rank.data(),
                                                  &total, &used)));
  EXPECT_EQ(total, 2);
  EXPECT_EQ(used, 0);
  EXPECT_EQ(origin, (std::vector<int32_t>{0, 0}));
  EXPECT_EQ(index, (std::vector<int32_t>{0, 1}));
  EXPECT_EQ(rank, (std::vector<int32_t>{0, 0}));
  // Too small a capacity: the total is still written.
  total = -1;
  EXPECT_TRUE(
      Fails(keel_engine_plan_sequences(engine_, 0, 2, 2, tokens.data(), rows.data(), 1.1, 1,
                                       origin.data(), index.data(), rank.data(), &total, nullptr),
            KEEL_OUT_OF_RANGE, {"capacity = 1 is below the 2 sequences of all ranks"}));
  EXPECT_EQ(total, 2);
  auto plan = [&](keel_engine_t* engine, int first, int layers, int64_t count, const int64_t* t,
                  const int32_t* r, double bound, int64_t capacity, int64_t* total_out) {
    return keel_engine_plan_sequences(engine, first, layers, count, t, r, bound, capacity,
                                      origin.data(), index.data(), rank.data(), total_out, nullptr);
  };
  EXPECT_TRUE(Fails(plan(nullptr, 0, 2, 2, tokens.data(), rows.data(), 1.1, 2, &total),
                    KEEL_INVALID_ARGUMENT, {"keel_engine_plan_sequences: engine = NULL"}));
  EXPECT_TRUE(Fails(plan(engine_, 0, 5, 2, tokens.data(), rows.data(), 1.1, 2, &total),
                    KEEL_INVALID_ARGUMENT, {"num_planned_layers = 5 is not in [1, 4]"}));
  EXPECT_TRUE(Fails(plan(engine_, 3, 2, 2, tokens.data(), rows.data(), 1.1, 2, &total),
                    KEEL_INVALID_ARGUMENT, {"covering layers from 3 to at most 3"}));
  EXPECT_TRUE(Fails(plan(engine_, 0, 2, -1, tokens.data(), rows.data(), 1.1, 2, &total),
                    KEEL_INVALID_ARGUMENT, {"num_sequences = -1"}));
  EXPECT_TRUE(Fails(plan(engine_, 0, 2, 2, nullptr, rows.data(), 1.1, 2, &total),
                    KEEL_INVALID_ARGUMENT, {"tokens = NULL"}));
  EXPECT_TRUE(Fails(plan(engine_, 0, 2, 2, tokens.data(), nullptr, 1.1, 2, &total),
                    KEEL_INVALID_ARGUMENT, {"expert_rows = NULL"}));
  EXPECT_TRUE(Fails(plan(engine_, 0, 2, 2, tokens.data(), rows.data(), 1.1, 2, nullptr),
                    KEEL_INVALID_ARGUMENT, {"total_out = NULL"}));
  EXPECT_TRUE(Fails(plan(engine_, 0, 2, 2, tokens.data(), rows.data(), 0.5, 2, &total),
                    KEEL_INVALID_ARGUMENT, {"max_token_imbalance"}));
  rows[5] = -3;
  EXPECT_TRUE(Fails(plan(engine_, 0, 2, 2, tokens.data(), rows.data(), 1.1, 2, &total),
                    KEEL_INVALID_ARGUMENT, {"sequence 0 expert_rows[5] = -3 is negative"}));
  // No sequences on this rank: nothing to plan, and no pointer is needed.
  EXPECT_TRUE(Succeeds(keel_engine_plan_sequences(engine_, 0, 1, 0, nullptr, nullptr, 1.1, 0,
                                                  nullptr, nullptr, nullptr, &total, nullptr)));
  EXPECT_EQ(total, 0);
}

TEST_F(CApiEngineTest, RouteCountsRejectsBadArguments) {
  CreateAndRegister();
  constexpr int kPhysical = 7;  // 1 rank x (6 persistent + 1 transient)
  std::vector<int32_t> counts = {3, 0, 1, 0, 0, 2};
  std::vector<int64_t> send(1);
  std::vector<int32_t> begin(kExperts + 1), slot(kPhysical), quota(kPhysical), rank_of(kPhysical);
  int32_t copies = 0;
  auto call = [&](keel_engine_t* engine, int layer, const int32_t* c, int64_t* s, int32_t* b,
                  int32_t* sl, int32_t* q, int32_t capacity, int32_t* n, int32_t* r) {
    return keel_engine_route_counts(engine, layer, c, s, nullptr, nullptr, b, sl, q, capacity, n,
                                    r);
  };
  int32_t* b = begin.data();
  int32_t* sl = slot.data();
  int32_t* q = quota.data();
  int32_t* r = rank_of.data();
  EXPECT_TRUE(Fails(call(nullptr, 0, counts.data(), send.data(), b, sl, q, kPhysical, &copies, r),
                    KEEL_INVALID_ARGUMENT, {"keel_engine_route_counts: engine = NULL"}));
  EXPECT_TRUE(Fails(call(engine_, 4, counts.data(), send.data(), b, sl, q, kPhysical, &copies, r),
                    KEEL_INVALID_ARGUMENT, {"layer = 4 is not in [0, 4)"}));
  EXPECT_TRUE(Fails(call(engine_, 0, nullptr, send.data(), b, sl, q, kPhysical, &copies, r),
                    KEEL_INVALID_ARGUMENT, {"expert_counts = NULL"}));
  EXPECT_TRUE(Fails(call(engine_, 0, counts.data(), nullptr, b, sl, q, kPhysical, &copies, r),
                    KEEL_INVALID_ARGUMENT, {"send_counts = NULL"}));
  EXPECT_TRUE(
      Fails(call(engine_, 0, counts.data(), send.data(), nullptr, sl, q, kPhysical, &copies, r),
            KEEL_INVALID_ARGUMENT, {"copy_begin_out = NULL"}));
  EXPECT_TRUE(
      Fails(call(engine_, 0, counts.data(), send.data(), b, nullptr, q, kPhysical, &copies, r),
            KEEL_INVALID_ARGUMENT, {"copy_slot_out = NULL"}));
  EXPECT_TRUE(
      Fails(call(engine_, 0, counts.data(), send.data(), b, sl, nullptr, kPhysical, &copies, r),
            KEEL_INVALID_ARGUMENT, {"copy_quota_out = NULL"}));
  EXPECT_TRUE(Fails(call(engine_, 0, counts.data(), send.data(), b, sl, q, kPhysical, nullptr, r),
                    KEEL_INVALID_ARGUMENT, {"num_copies_out = NULL"}));
  EXPECT_TRUE(
      Fails(call(engine_, 0, counts.data(), send.data(), b, sl, q, kPhysical, &copies, nullptr),
            KEEL_INVALID_ARGUMENT, {"slot_rank_out = NULL"}));
  EXPECT_TRUE(Fails(call(engine_, 0, counts.data(), send.data(), b, sl, q, 6, &copies, r),
                    KEEL_INVALID_ARGUMENT,
                    {"copy_capacity = 6 is smaller than num_ranks * (slots_per_rank + "
                     "transient_per_rank) = 1 * 7"}));
  EXPECT_TRUE(Fails(call(engine_, 0, counts.data(), send.data(), b, sl, q, -1, &copies, r),
                    KEEL_INVALID_ARGUMENT, {"copy_capacity = -1"}));
  counts[4] = -5;
  EXPECT_TRUE(Fails(call(engine_, 0, counts.data(), send.data(), b, sl, q, kPhysical, &copies, r),
                    KEEL_INVALID_ARGUMENT, {"expert_counts[4] = -5 is negative"}));
  // The errors left the layer routable: the call goes through and describes one rank.
  counts[4] = 0;
  ASSERT_TRUE(
      Succeeds(call(engine_, 0, counts.data(), send.data(), b, sl, q, kPhysical, &copies, r)));
  EXPECT_EQ(send[0], 6);
  EXPECT_EQ(begin[kExperts], copies);
  for (int i = 0; i < kPhysical; ++i) EXPECT_EQ(rank_of[i], 0) << "slot " << i;
}

TEST_F(CApiEngineTest, RouteNeedsEverySlotRegistered) {
  ASSERT_TRUE(Succeeds(keel_engine_create(&options_, &engine_)));
  std::vector<int32_t> ids = {0, 1};
  std::vector<int32_t> slots(2);
  std::vector<int64_t> send(1);
  EXPECT_TRUE(Fails(
      keel_engine_route(engine_, 0, ids.data(), 1, slots.data(), send.data(), nullptr, nullptr),
      KEEL_FAILED_PRECONDITION, {"keel_engine_route: ", "registered"}));
}

TEST_F(CApiEngineTest, QueriesRejectBadArguments) {
  CreateAndRegister();
  int32_t experts[6];
  int32_t local_slots[6];
  int32_t count = -1;
  EXPECT_TRUE(Fails(keel_engine_home_slots(nullptr, 0, experts, local_slots, 6, &count),
                    KEEL_INVALID_ARGUMENT, {"keel_engine_home_slots: engine = NULL"}));
  EXPECT_TRUE(Fails(keel_engine_home_slots(engine_, 0, experts, local_slots, 6, nullptr),
                    KEEL_INVALID_ARGUMENT, {"count_out = NULL"}));
  EXPECT_TRUE(Fails(keel_engine_home_slots(engine_, 9, experts, local_slots, 6, &count),
                    KEEL_INVALID_ARGUMENT, {"layer = 9 is not in [0, 4)"}));
  EXPECT_TRUE(Fails(keel_engine_home_slots(engine_, 0, nullptr, local_slots, 6, &count),
                    KEEL_INVALID_ARGUMENT, {"experts_out = NULL with capacity = 6"}));
  EXPECT_TRUE(Fails(keel_engine_home_slots(engine_, 0, experts, nullptr, 6, &count),
                    KEEL_INVALID_ARGUMENT, {"local_slots_out = NULL with capacity = 6"}));
  EXPECT_TRUE(Fails(keel_engine_home_slots(engine_, 0, experts, local_slots, -1, &count),
                    KEEL_INVALID_ARGUMENT, {"capacity = -1"}));
  // One rank is home of every expert; a small capacity still reports how many there are.
  EXPECT_TRUE(Fails(keel_engine_home_slots(engine_, 0, nullptr, nullptr, 0, &count),
                    KEEL_INVALID_ARGUMENT, {"capacity = 0 is smaller than 6"}));
  EXPECT_EQ(count, kExperts);
  ASSERT_TRUE(Succeeds(keel_engine_home_slots(engine_, 0, experts, local_slots, 6, &count)));
  EXPECT_EQ(count, kExperts);

  int32_t phy2log[6];
  EXPECT_TRUE(Fails(keel_engine_placement(nullptr, 0, phy2log, 6), KEEL_INVALID_ARGUMENT,
                    {"keel_engine_placement: engine = NULL"}));
  EXPECT_TRUE(Fails(keel_engine_placement(engine_, 0, nullptr, 6), KEEL_INVALID_ARGUMENT,
                    {"phy2log_out = NULL"}));
  EXPECT_TRUE(Fails(keel_engine_placement(engine_, 4, phy2log, 6), KEEL_INVALID_ARGUMENT,
                    {"layer = 4 is not in [0, 4)"}));
  EXPECT_TRUE(Fails(keel_engine_placement(engine_, 0, phy2log, 5), KEEL_INVALID_ARGUMENT,
                    {"capacity = 5 is smaller than 6", "num_ranks * slots_per_rank = 1 * 6"}));
  EXPECT_TRUE(Succeeds(keel_engine_placement(engine_, 0, phy2log, 6)));

  int32_t home[6];
  EXPECT_TRUE(Fails(keel_engine_homes(nullptr, 0, home, 6), KEEL_INVALID_ARGUMENT,
                    {"keel_engine_homes: engine = NULL"}));
  EXPECT_TRUE(
      Fails(keel_engine_homes(engine_, 0, nullptr, 6), KEEL_INVALID_ARGUMENT, {"home_out = NULL"}));
  EXPECT_TRUE(Fails(keel_engine_homes(engine_, -1, home, 6), KEEL_INVALID_ARGUMENT,
                    {"layer = -1 is not in [0, 4)"}));
  EXPECT_TRUE(Fails(keel_engine_homes(engine_, 0, home, 2), KEEL_INVALID_ARGUMENT,
                    {"capacity = 2 is smaller than 6", "num_experts"}));
  ASSERT_TRUE(Succeeds(keel_engine_homes(engine_, 0, home, 6)));
  for (int e = 0; e < kExperts; ++e) EXPECT_EQ(home[e], 0);

  int value = -1;
  int64_t epoch = -1;
  EXPECT_TRUE(Fails(keel_engine_rank(nullptr, &value), KEEL_INVALID_ARGUMENT,
                    {"keel_engine_rank: engine = NULL"}));
  EXPECT_TRUE(
      Fails(keel_engine_rank(engine_, nullptr), KEEL_INVALID_ARGUMENT, {"rank_out = NULL"}));
  EXPECT_TRUE(Fails(keel_engine_num_ranks(nullptr, &value), KEEL_INVALID_ARGUMENT,
                    {"keel_engine_num_ranks: engine = NULL"}));
  EXPECT_TRUE(Fails(keel_engine_num_ranks(engine_, nullptr), KEEL_INVALID_ARGUMENT,
                    {"num_ranks_out = NULL"}));
  EXPECT_TRUE(Fails(keel_engine_slots_per_rank(nullptr, &value), KEEL_INVALID_ARGUMENT,
                    {"keel_engine_slots_per_rank: engine = NULL"}));
  EXPECT_TRUE(Fails(keel_engine_slots_per_rank(engine_, nullptr), KEEL_INVALID_ARGUMENT,
                    {"slots_out = NULL"}));
  EXPECT_TRUE(Fails(keel_engine_transient_per_rank(nullptr, &value), KEEL_INVALID_ARGUMENT,
                    {"keel_engine_transient_per_rank: engine = NULL"}));
  EXPECT_TRUE(Fails(keel_engine_transient_per_rank(engine_, nullptr), KEEL_INVALID_ARGUMENT,
                    {"slots_out = NULL"}));
  EXPECT_TRUE(Fails(keel_engine_epoch(nullptr, &epoch), KEEL_INVALID_ARGUMENT,
                    {"keel_engine_epoch: engine = NULL"}));
  EXPECT_TRUE(
      Fails(keel_engine_epoch(engine_, nullptr), KEEL_INVALID_ARGUMENT, {"epoch_out = NULL"}));
  EXPECT_TRUE(Succeeds(keel_engine_rank(engine_, &value)));
  EXPECT_EQ(value, 0);
  EXPECT_TRUE(Succeeds(keel_engine_epoch(engine_, &epoch)));
  EXPECT_EQ(epoch, 0);

  int32_t held[7];
  EXPECT_TRUE(Fails(keel_engine_local_experts(nullptr, 0, held, 7), KEEL_INVALID_ARGUMENT,
                    {"keel_engine_local_experts: engine = NULL"}));
  EXPECT_TRUE(Fails(keel_engine_local_experts(engine_, 0, nullptr, 7), KEEL_INVALID_ARGUMENT,
                    {"experts_out = NULL"}));
  EXPECT_TRUE(Fails(keel_engine_local_experts(engine_, 5, held, 7), KEEL_INVALID_ARGUMENT,
                    {"layer = 5 is not in [0, 4)"}));
  EXPECT_TRUE(Fails(keel_engine_local_experts(engine_, 0, held, 7), KEEL_FAILED_PRECONDITION,
                    {"layer = 0 has not been routed yet"}));
  std::vector<int32_t> ids = {0, 1, 5, -1};
  std::vector<int32_t> slots(ids.size());
  int64_t send = 0;
  ASSERT_TRUE(Succeeds(
      keel_engine_route(engine_, 0, ids.data(), 2, slots.data(), &send, nullptr, nullptr)));
  EXPECT_EQ(send, 3);
  EXPECT_TRUE(Fails(keel_engine_local_experts(engine_, 0, held, 6), KEEL_INVALID_ARGUMENT,
                    {"capacity = 6 is smaller than 7", "slots_per_rank + transient_per_rank"}));
  ASSERT_TRUE(Succeeds(keel_engine_local_experts(engine_, 0, held, 7)));
  for (int s = 0; s < 6; ++s) EXPECT_EQ(held[s], phy2log[s]);

  EXPECT_TRUE(Fails(keel_engine_reduce_gradients(nullptr), KEEL_INVALID_ARGUMENT,
                    {"keel_engine_reduce_gradients: engine = NULL"}));
  EXPECT_TRUE(Fails(keel_engine_step_end(nullptr), KEEL_INVALID_ARGUMENT,
                    {"keel_engine_step_end: engine = NULL"}));
}

TEST_F(CApiEngineTest, StatsRejectsBadArgumentsAndZeroesUnknownFields) {
  CreateAndRegister();
  keel_engine_stats_t stats;
  std::memset(&stats, 0, sizeof(stats));
  stats.struct_size = sizeof(stats);
  EXPECT_TRUE(Fails(keel_engine_stats(nullptr, &stats), KEEL_INVALID_ARGUMENT,
                    {"keel_engine_stats: engine = NULL"}));
  EXPECT_TRUE(Fails(keel_engine_stats(engine_, nullptr), KEEL_INVALID_ARGUMENT, {"stats = NULL"}));
  stats.struct_size = 4;
  EXPECT_TRUE(Fails(keel_engine_stats(engine_, &stats), KEEL_INVALID_ARGUMENT,
                    {"keel_engine_stats: stats->struct_size = 4"}));
  stats.struct_size = 0xababababababababull;  // uninitialized memory
  EXPECT_TRUE(Fails(keel_engine_stats(engine_, &stats), KEEL_INVALID_ARGUMENT,
                    {"stats->struct_size = " + std::to_string(stats.struct_size), "plausible"}));

  struct Newer {
    keel_engine_stats_t v1;
    int64_t appended;
  } newer;
  std::memset(&newer, 0xab, sizeof(newer));
  newer.v1.struct_size = sizeof(newer);
  ASSERT_TRUE(Succeeds(keel_engine_stats(engine_, &newer.v1)));
  EXPECT_EQ(newer.v1.struct_size, sizeof(newer));
  EXPECT_EQ(newer.appended, 0);
  EXPECT_EQ(newer.v1.steps, 0);
  EXPECT_EQ(newer.v1.last_abort_status, KEEL_OK);
  EXPECT_STREQ(newer.v1.last_abort_message, "");
}

// Everything one rank saw in the end-to-end test, compared across ranks afterwards.
struct RankLog {
  std::vector<std::vector<int64_t>> send_counts;    // [steps * layers][num_ranks]
  std::vector<std::vector<int64_t>> recv_totals;    // [steps * layers][num_ranks]
  std::vector<std::vector<int32_t>> phy2log;        // [steps * layers][num_slots]
  std::vector<std::vector<int32_t>> local_experts;  // [steps * layers][local_slots]
  // [steps * layers][num_ranks * transient_per_rank]: the expert this rank sent to each
  // transient slot, -1 where it sent none.
  std::vector<std::vector<int32_t>> transient_experts;
  std::vector<int64_t> epochs;  // [steps]
  keel_engine_stats_t stats{};
  bool finished = false;
};

// keel_engine_route's answer for `ids` the way a GPU trainer gets it: the kernels' histogram,
// keel_engine_route_counts, then the remap kernel (their CPU references here) with the quota
// table it returned.
void RouteByCounts(keel_engine_t* engine, int layer, const std::vector<int32_t>& ids,
                   int num_physical, std::vector<int32_t>& slot, std::vector<int64_t>& send,
                   std::vector<int64_t>& recv, std::vector<int64_t>& recv_totals) {
  std::vector<int32_t> counts(kExperts);
  int32_t invalid = -1;
  ASSERT_TRUE(kernels::cpu::ExpertHistogram(ids.data(), static_cast<int64_t>(ids.size()), kExperts,
                                            counts.data(), &invalid)
                  .ok());
  ASSERT_EQ(invalid, 0);
  std::vector<int32_t> copy_begin(kExperts + 1);
  std::vector<int32_t> copy_slot(num_physical);
  std::vector<int32_t> copy_quota(num_physical);
  std::vector<int32_t> slot_rank(num_physical);
  int32_t num_copies = -1;
  ASSERT_TRUE(Succeeds(keel_engine_route_counts(
      engine, layer, counts.data(), send.data(), recv.data(), recv_totals.data(), copy_begin.data(),
      copy_slot.data(), copy_quota.data(), num_physical, &num_copies, slot_rank.data())));
  ASSERT_EQ(copy_begin.back(), num_copies);
  copy_slot.resize(num_copies);
  copy_quota.resize(num_copies);
  const int num_ranks = static_cast<int>(send.size());
  const kernels::QuotaTable table =
      kernels::MakeQuotaTable(copy_begin, copy_slot, copy_quota, slot_rank, num_ranks);
  std::vector<int32_t> remap_send(num_ranks);
  ASSERT_TRUE(kernels::cpu::RemapWithQuotas(ids.data(), static_cast<int64_t>(ids.size()), table,
                                            slot.data(), remap_send.data(), &invalid)
                  .ok());
  ASSERT_EQ(invalid, 0);
  // The splits keel_engine_route_counts returned are the ones the remap produced.
  EXPECT_EQ(send, std::vector<int64_t>(remap_send.begin(), remap_send.end()));
}

// Rank `rank` of `num_ranks` routes `steps` steps of every layer through the C API, checking
// each answer against the placement; `log` records what must agree across ranks.
void RunRank(keel_group_t* group, int rank, int num_ranks, int steps, RankLog& log) {
  keel_comm_t* comm = nullptr;
  ASSERT_TRUE(Succeeds(keel_comm_create_local(group, rank, &comm)));
  keel_engine_options_t options;
  ASSERT_TRUE(Succeeds(keel_engine_options_init(&options)));
  FillShape(options);
  const std::string yaml =
      "topology:\n  num_nodes: 1\n  gpus_per_node: " + std::to_string(num_ranks) +
      "\nslots:\n  persistent_per_rank: 4\n  transient_per_rank: 1\n"
      "cost_model:\n  expert_tflops: 0.01\n"
      // Epochs at the same steps however busy the machine is.
      "policy:\n  plan_adoption: next_step\n"
      "engine:\n  collective_timeout_seconds: 60\n";
  options.config_yaml = yaml.c_str();
  options.comm = comm;
  keel_engine_t* engine = nullptr;
  ASSERT_TRUE(Succeeds(keel_engine_create(&options, &engine)));

  int persistent = 0;
  int transient = 0;
  int engine_rank = -1;
  int engine_ranks = -1;
  ASSERT_TRUE(Succeeds(keel_engine_slots_per_rank(engine, &persistent)));
  ASSERT_TRUE(Succeeds(keel_engine_transient_per_rank(engine, &transient)));
  ASSERT_TRUE(Succeeds(keel_engine_rank(engine, &engine_rank)));
  ASSERT_TRUE(Succeeds(keel_engine_num_ranks(engine, &engine_ranks)));
  EXPECT_EQ(engine_rank, rank);
  EXPECT_EQ(engine_ranks, num_ranks);
  const int local_slots = persistent + transient;
  const int num_slots = num_ranks * persistent;

  // Home slots start with their expert's pattern; StepEnd copies it to every replica.
  RankBuffers buffers(kLayers, local_slots, persistent);
  for (int l = 0; l < kLayers; ++l) {
    for (int s = 0; s < local_slots; ++s) {
      ASSERT_TRUE(Succeeds(keel_engine_register_slot(
          engine, l, s, buffers.weights(l, s), buffers.gradients(l, s), buffers.optimizer(l, s))));
    }
    std::vector<int32_t> experts(persistent);
    std::vector<int32_t> home_slots(persistent);
    int32_t count = 0;
    ASSERT_TRUE(Succeeds(
        keel_engine_home_slots(engine, l, experts.data(), home_slots.data(), persistent, &count)));
    for (int i = 0; i < count; ++i) {
      for (int j = 0; j < RankBuffers::kFloats; ++j) {
        buffers.weights(l, home_slots[i])[j] = RankBuffers::Pattern(l, experts[i], j);
      }
    }
  }

  const int64_t num_tokens = 64;
  std::vector<int32_t> ids(num_tokens * kTopK);
  std::vector<int32_t> slot(ids.size());
  std::vector<int64_t> send(num_ranks);
  std::vector<int64_t> recv(static_cast<size_t>(num_ranks) * local_slots);
  std::vector<int64_t> recv_totals(num_ranks);
  std::vector<int32_t> phy2log(num_slots);
  for (int step = 0; step < steps; ++step) {
    for (int l = 0; l < kLayers; ++l) {
      // Two thirds of the tokens pick expert 0 first; two distinct experts per token; some
      // dropped choices.
      int64_t valid = 0;
      for (int64_t t = 0; t < num_tokens; ++t) {
        const int first = t % 3 != 0 ? 0 : static_cast<int>((t + rank + step) % kExperts);
        const int second = (first + 1 + static_cast<int>(t % 2)) % kExperts;
        ids[t * kTopK] = first;
        ids[t * kTopK + 1] = t % 5 == 0 ? -1 : second;
        valid += ids[t * kTopK + 1] == -1 ? 1 : 2;
      }
      if (step % 2 == 0) {
        ASSERT_TRUE(Succeeds(keel_engine_route(engine, l, ids.data(), num_tokens, slot.data(),
                                               send.data(), recv.data(), recv_totals.data())));
      } else {
        RouteByCounts(engine, l, ids, num_ranks * local_slots, slot, send, recv, recv_totals);
      }
      ASSERT_TRUE(Succeeds(keel_engine_placement(engine, l, phy2log.data(), num_slots)));
      std::vector<int32_t> local_experts(local_slots);
      ASSERT_TRUE(
          Succeeds(keel_engine_local_experts(engine, l, local_experts.data(), local_slots)));
      for (int s = 0; s < persistent; ++s) {
        EXPECT_EQ(local_experts[s], phy2log[rank * persistent + s]) << "local slot " << s;
      }
      std::vector<int32_t> transient_experts(static_cast<size_t>(num_ranks) * transient, -1);
      std::vector<int64_t> per_rank(num_ranks, 0);
      for (size_t i = 0; i < ids.size(); ++i) {
        if (ids[i] == -1) {
          EXPECT_EQ(slot[i], -1) << "pair " << i;
          continue;
        }
        ASSERT_GE(slot[i], 0) << "pair " << i;
        if (slot[i] < num_slots) {
          EXPECT_EQ(phy2log[slot[i]], ids[i]) << "pair " << i << " slot " << slot[i];
          ++per_rank[slot[i] / persistent];
        } else {
          ASSERT_LT(slot[i], num_slots + num_ranks * transient) << "pair " << i;
          ++per_rank[(slot[i] - num_slots) / transient];
          int32_t& expert = transient_experts[slot[i] - num_slots];
          EXPECT_TRUE(expert == -1 || expert == ids[i]) << "transient slot " << slot[i];
          expert = ids[i];
        }
      }
      EXPECT_EQ(std::accumulate(send.begin(), send.end(), int64_t{0}), valid);
      EXPECT_EQ(send, per_rank);
      for (int g = 0; g < num_ranks; ++g) {
        const auto row = recv.begin() + static_cast<ptrdiff_t>(g) * local_slots;
        EXPECT_EQ(std::accumulate(row, row + local_slots, int64_t{0}), recv_totals[g]);
      }
      log.send_counts.push_back(send);
      log.recv_totals.push_back(recv_totals);
      log.phy2log.push_back(phy2log);
      log.local_experts.push_back(local_experts);
      log.transient_experts.push_back(transient_experts);
    }
    ASSERT_TRUE(Succeeds(keel_engine_reduce_gradients(engine)));
    ASSERT_TRUE(Succeeds(keel_engine_step_end(engine)));
    int64_t epoch = -1;
    ASSERT_TRUE(Succeeds(keel_engine_epoch(engine, &epoch)));
    log.epochs.push_back(epoch);
    // Every persistent copy holds its expert's weights once the step has ended.
    for (int l = 0; l < kLayers; ++l) {
      ASSERT_TRUE(Succeeds(keel_engine_placement(engine, l, phy2log.data(), num_slots)));
      for (int s = 0; s < persistent; ++s) {
        const int expert = phy2log[rank * persistent + s];
        if (expert < 0) continue;
        for (int j = 0; j < RankBuffers::kFloats; ++j) {
          ASSERT_EQ(buffers.weights(l, s)[j], RankBuffers::Pattern(l, expert, j))
              << "step " << step << " layer " << l << " slot " << s << " expert " << expert;
        }
      }
    }
  }
  log.stats.struct_size = sizeof(log.stats);
  ASSERT_TRUE(Succeeds(keel_engine_stats(engine, &log.stats)));
  ASSERT_TRUE(Succeeds(keel_engine_destroy(engine)));
  ASSERT_TRUE(Succeeds(keel_comm_destroy(comm)));
  log.finished = true;
}

TEST(CApiEndToEndTest, TwoRanksAsThreadsRouteReduceAndStep) {
  constexpr int kRanks = 2;
  constexpr int kSteps = 12;
  keel_group_t* group = nullptr;
  ASSERT_TRUE(Succeeds(keel_group_create(kRanks, &group)));
  std::vector<RankLog> logs(kRanks);
  std::vector<std::thread> threads;
  for (int r = 0; r < kRanks; ++r) {
    threads.emplace_back([&, r] { RunRank(group, r, kRanks, kSteps, logs[r]); });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_TRUE(Succeeds(keel_group_destroy(group)));
  for (int r = 0; r < kRanks; ++r) ASSERT_TRUE(logs[r].finished) << "rank " << r;

  // The placement and epochs agree; what rank a sends to rank b is what b receives from a.
  for (int r = 1; r < kRanks; ++r) {
    EXPECT_EQ(logs[r].phy2log, logs[0].phy2log);
    EXPECT_EQ(logs[r].epochs, logs[0].epochs);
  }
  for (size_t i = 0; i < logs[0].send_counts.size(); ++i) {
    for (int a = 0; a < kRanks; ++a) {
      for (int b = 0; b < kRanks; ++b) {
        EXPECT_EQ(logs[a].send_counts[i][b], logs[b].recv_totals[i][a])
            << "route " << i << " from rank " << a << " to rank " << b;
      }
    }
  }
  // A transient slot holds the expert that every rank routed to it.
  const size_t routes = logs[0].transient_experts.size();
  for (size_t i = 0; i < routes; ++i) {
    for (int a = 0; a < kRanks; ++a) {
      const std::vector<int32_t>& sent = logs[a].transient_experts[i];
      const int transient = static_cast<int>(sent.size()) / kRanks;
      for (size_t t = 0; t < sent.size(); ++t) {
        if (sent[t] == -1) continue;
        const int g = static_cast<int>(t) / transient;
        const std::vector<int32_t>& held = logs[g].local_experts[i];
        const size_t local = held.size() - transient + t % transient;
        EXPECT_EQ(held[local], sent[t]) << "route " << i << " transient slot " << t;
      }
    }
  }
  // The config makes expert compute slow, so that replicas pay: the run must have used transient
  // slots and committed an epoch, or it did not test the paths above.
  int transient_uses = 0;
  for (const RankLog& log : logs) {
    for (const std::vector<int32_t>& sent : log.transient_experts) {
      transient_uses += static_cast<int>(
          std::count_if(sent.begin(), sent.end(), [](int32_t e) { return e != -1; }));
    }
  }
  EXPECT_GT(transient_uses, 0);
  for (const RankLog& log : logs) {
    EXPECT_GE(log.stats.epochs_committed, 1);
    EXPECT_EQ(log.stats.epochs_aborted, 0);
    EXPECT_EQ(log.stats.steps, kSteps);
    EXPECT_EQ(log.stats.epoch, log.epochs.back());
    EXPECT_GE(log.stats.route_seconds, 0.0);
  }
}

// The slots keel_engine_route gives each of two thread ranks on one step of layer 0 under the
// static placement: with mp_group_size 2 every rank passes both ranks' tokens (the pair's), else
// each passes its own. `ids_of(rank)` gives a rank's own [kTokens * kTopK] ids.
template <typename IdsOf>
std::vector<std::vector<int32_t>> RoutePair(int mp_group_size, IdsOf ids_of,
                                            std::vector<std::vector<int64_t>>& send) {
  constexpr int kRanks = 2;
  keel_group_t* group = nullptr;
  EXPECT_TRUE(Succeeds(keel_group_create(kRanks, &group)));
  std::vector<std::vector<int32_t>> slots(kRanks);
  send.assign(kRanks, std::vector<int64_t>(kRanks));
  std::vector<std::thread> threads;
  for (int r = 0; r < kRanks; ++r) {
    threads.emplace_back([&, r] {
      keel_comm_t* comm = nullptr;
      ASSERT_TRUE(Succeeds(keel_comm_create_local(group, r, &comm)));
      keel_engine_options_t options;
      ASSERT_TRUE(Succeeds(keel_engine_options_init(&options)));
      FillShape(options);
      options.config_yaml =
          "topology:\n  num_nodes: 1\n  gpus_per_node: 2\n"
          "slots:\n  persistent_per_rank: 4\n  transient_per_rank: 0\n"
          "policy:\n  name: static\n";
      options.comm = comm;
      options.mp_group_size = mp_group_size;
      keel_engine_t* engine = nullptr;
      ASSERT_TRUE(Succeeds(keel_engine_create(&options, &engine)));
      RankBuffers buffers(kLayers, 4, 4);
      for (int l = 0; l < kLayers; ++l) {
        for (int s = 0; s < 4; ++s) {
          ASSERT_TRUE(Succeeds(keel_engine_register_slot(engine, l, s, buffers.weights(l, s),
                                                         buffers.gradients(l, s),
                                                         buffers.optimizer(l, s))));
        }
      }
      std::vector<int32_t> ids;
      for (int member = 0; member < kRanks; ++member) {
        if (mp_group_size < 2 && member != r) continue;
        const std::vector<int32_t> own = ids_of(member);
        ids.insert(ids.end(), own.begin(), own.end());
      }
      const int64_t tokens = static_cast<int64_t>(ids.size()) / kTopK;
      slots[r].assign(ids.size(), -2);
      std::vector<int64_t> recv(static_cast<size_t>(kRanks) * 4);
      std::vector<int64_t> recv_totals(kRanks);
      ASSERT_TRUE(Succeeds(keel_engine_route(engine, 0, ids.data(), tokens, slots[r].data(),
                                             send[r].data(), recv.data(), recv_totals.data())));
      ASSERT_TRUE(Succeeds(keel_engine_destroy(engine)));
      ASSERT_TRUE(Succeeds(keel_comm_destroy(comm)));
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_TRUE(Succeeds(keel_group_destroy(group)));
  return slots;
}

// Parm's de-duplicated dispatch through the C API: a pair passes the pair's tokens and each
// member routes its half, exactly as if each passed only its own tokens; the other half's
// entries get slot -1.
TEST(CApiEndToEndTest, MpPairRoutesItsSharesAsWithoutGroups) {
  constexpr int kTokens = 16;
  const auto ids_of = [](int rank) {
    std::vector<int32_t> ids(kTokens * kTopK);
    for (int t = 0; t < kTokens; ++t) {
      ids[t * kTopK] = (t * 5 + rank) % kExperts;
      ids[t * kTopK + 1] = t % 7 == 0 ? -1 : (t * 5 + rank + 1 + t % 3) % kExperts;
    }
    return ids;
  };
  std::vector<std::vector<int64_t>> plain_send;
  std::vector<std::vector<int64_t>> pair_send;
  const std::vector<std::vector<int32_t>> plain = RoutePair(0, ids_of, plain_send);
  const std::vector<std::vector<int32_t>> pair = RoutePair(2, ids_of, pair_send);
  const size_t share = static_cast<size_t>(kTokens) * kTopK;
  for (int r = 0; r < 2; ++r) {
    ASSERT_EQ(plain[r].size(), share);
    ASSERT_EQ(pair[r].size(), 2 * share);
    const std::vector<int32_t> own(pair[r].begin() + r * share, pair[r].begin() + (r + 1) * share);
    EXPECT_EQ(own, plain[r]) << "rank " << r;
    const std::vector<int32_t> other(pair[r].begin() + (1 - r) * share,
                                     pair[r].begin() + (2 - r) * share);
    EXPECT_EQ(other, std::vector<int32_t>(share, -1)) << "rank " << r;
    EXPECT_EQ(pair_send[r], plain_send[r]) << "rank " << r;
  }
}

TEST_F(CApiEngineTest, CreateRejectsABadMpGroupSize) {
  options_.mp_group_size = -1;
  EXPECT_TRUE(CreateFails(KEEL_INVALID_ARGUMENT, {"options->mp_group_size = -1", ">= 0"}));
  options_.mp_group_size = 2;  // one rank
  EXPECT_TRUE(CreateFails(KEEL_INVALID_ARGUMENT,
                          {"mp_group_size = 2", "does not divide topology.gpus_per_node = 1"}));
}

}  // namespace
}  // namespace keel
