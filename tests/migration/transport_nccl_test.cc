// The nccl transport on real GPUs: two ranks as threads, one GPU each (NCCL allows one rank per
// device), device buffers moved with ncclSend/ncclRecv in random post orders and checked byte for
// byte, host buffers mixed in. Built wherever NCCL is; skips, saying why, without two GPUs. On
// any host it also checks that CreateTransport("nccl") fails cleanly when it cannot work.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <thread>

#include "comm/communicator.h"
#include "keel/version.hpp"
#include "migration/transport_factory.h"
#include "migration/transport_local.h"

#if KEEL_MIGRATION_NCCL
#include <cuda_runtime.h>

#include "migration/transport_nccl.h"
#include "tests/migration/cuda_test_util.h"
#endif

namespace keel {
namespace {

// Without NCCL in the build, or without a usable GPU, asking for the nccl transport is a clear
// error on every rank, never a crash or a hang.
TEST(NcclTransportTest, FactoryFailsCleanlyWhereNcclCannotRun) {
  constexpr int kRanks = 2;
  LocalCommunicatorGroup group(kRanks);
  LocalFabric fabric(kRanks);
  MigrationConfig config;
  config.transport = "nccl";
  config.nccl_host_transport = "local";
  std::vector<Result<std::unique_ptr<Transport>>> created;
  for (int r = 0; r < kRanks; ++r) created.emplace_back(InvalidArgument("not run"));
  std::vector<std::thread> threads;
  for (int r = 0; r < kRanks; ++r) {
    threads.emplace_back([&, r] {
      std::unique_ptr<Communicator> communicator = group.Join(r);
      communicator->set_timeout_seconds(60);
      created[r] = CreateTransport(config, *communicator, &fabric);
    });
  }
  for (auto& t : threads) t.join();
  if (created[0].ok()) GTEST_SKIP() << "NCCL runs here; the GPU test below covers it";
  for (int r = 0; r < kRanks; ++r) {
    ASSERT_FALSE(created[r].ok());
    const Status& s = created[r].status();
    if constexpr (!kWithNccl) {
      EXPECT_EQ(s.code(), StatusCode::kUnimplemented) << s.ToString();
      EXPECT_NE(s.message().find("KEEL_WITH_NCCL"), std::string::npos) << s.ToString();
    } else {
      // One GPU for two ranks is refused by NCCL; no GPU is FailedPrecondition.
      EXPECT_NE(s.code(), StatusCode::kOk);
      EXPECT_NE(s.message().find("nccl transport"), std::string::npos) << s.ToString();
    }
  }
  config.nccl_host_transport = "local";
  LocalCommunicatorGroup single(1);
  std::unique_ptr<Communicator> alone = single.Join(0);
  const Result<std::unique_ptr<Transport>> no_fabric = CreateTransport(config, *alone, nullptr);
  if constexpr (kWithNccl) {
    EXPECT_EQ(no_fabric.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(no_fabric.status().message().find("nccl_host_transport"), std::string::npos)
        << no_fabric.status().ToString();
  }
}

#if KEEL_MIGRATION_NCCL

using testing::DeviceBuffer;

struct Message {
  int src = 0;
  uint64_t tag = 0;
  bool device = false;
  std::vector<std::byte> payload;
  std::vector<std::byte> host_in;
  std::unique_ptr<DeviceBuffer> device_out;
  std::unique_ptr<DeviceBuffer> device_in;
};

TEST(NcclTransportTest, MovesDeviceBuffersBetweenTwoGpusByteExact) {
  int devices = 0;
  const cudaError_t counted = cudaGetDeviceCount(&devices);
  if (counted != cudaSuccess) {
    (void)cudaGetLastError();
    GTEST_SKIP() << "no CUDA device: cudaGetDeviceCount says " << cudaGetErrorString(counted);
  }
  if (devices < 2) {
    GTEST_SKIP() << "needs 2 CUDA devices (NCCL allows one rank per device), found " << devices;
  }
  constexpr int kRanks = 2;
  constexpr int kMessages = 200;
  std::mt19937_64 rng(2024);
  std::vector<Message> messages(kMessages);
  for (int i = 0; i < kMessages; ++i) {
    Message& m = messages[i];
    m.src = static_cast<int>(rng() % kRanks);
    m.device = rng() % 4 != 0;
    m.tag = m.device ? 10 + rng() % 3 : 100000 + i;  // device tags repeat: order per tag
    const size_t bytes = rng() % 8 == 0 ? (8u << 20) + rng() % 4096 : rng() % 100000;
    m.payload.resize(bytes);
    for (auto& b : m.payload) b = static_cast<std::byte>(rng());
    if (m.device) {
      m.device_out = std::make_unique<DeviceBuffer>(m.src, bytes);
      m.device_in = std::make_unique<DeviceBuffer>(1 - m.src, bytes);
      ASSERT_CUDA(cudaSetDevice(m.src));
      ASSERT_CUDA(cudaMemcpy(m.device_out->get(), m.payload.data(), bytes, cudaMemcpyHostToDevice));
      ASSERT_CUDA(cudaSetDevice(1 - m.src));
      ASSERT_CUDA(cudaMemset(m.device_in->get(), 0xee, bytes + 1));
    } else {
      m.host_in.assign(bytes, std::byte{0xee});
    }
  }
  LocalCommunicatorGroup group(kRanks);
  LocalFabric fabric(kRanks);
  std::vector<Status> failures(kRanks);
  std::vector<std::thread> threads;
  for (int r = 0; r < kRanks; ++r) {
    threads.emplace_back([&, r] {
      std::unique_ptr<Communicator> communicator = group.Join(r);
      communicator->set_timeout_seconds(120);
      Result<std::unique_ptr<Transport>> created =
          CreateNcclTransport(*communicator, fabric.Connect(r), {.device = r, .protocol = {}});
      if (!created.ok()) {
        failures[r] = created.status();
        return;
      }
      Transport& t = **created;
      // Sends and receives each in message order, interleaved at random: messages that share a
      // device tag meet in that order.
      std::vector<RequestId> ids;
      std::mt19937_64 order(r + 1);
      std::vector<int> sends, receives;
      for (int i = 0; i < kMessages; ++i) (messages[i].src == r ? sends : receives).push_back(i);
      size_t s = 0, q = 0;
      while (s < sends.size() || q < receives.size()) {
        const bool send = q == receives.size() || (s < sends.size() && order() % 2 == 0);
        Message& m = messages[send ? sends[s++] : receives[q++]];
        const size_t bytes = m.payload.size();
        Result<RequestId> posted =
            send
                ? t.PostSend(1 - r, m.tag, m.device ? m.device_out->get() : m.payload.data(), bytes)
                : t.PostRecv(1 - r, m.tag, m.device ? m.device_in->get() : m.host_in.data(), bytes);
        if (!posted.ok()) {
          failures[r] = posted.status();
          return;
        }
        ids.push_back(*posted);
      }
      const auto limit = std::chrono::steady_clock::now() + std::chrono::seconds(120);
      for (RequestId id : ids) {
        std::optional<Status> done;
        while (!(done = t.Test(id)) && std::chrono::steady_clock::now() < limit) t.Progress();
        if (!done) {
          failures[r] = DeadlineExceeded("request did not complete within 120 s");
          return;
        }
        if (!done->ok()) {
          failures[r] = *done;
          return;
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < kRanks; ++r)
    EXPECT_TRUE(failures[r].ok()) << "rank " << r << ": " << failures[r].ToString();
  for (int i = 0; i < kMessages; ++i) {
    Message& m = messages[i];
    std::vector<std::byte> got = m.host_in;
    if (m.device) {
      got.resize(m.payload.size());
      ASSERT_CUDA(cudaSetDevice(1 - m.src));
      ASSERT_CUDA(cudaMemcpy(got.data(), m.device_in->get(), got.size(), cudaMemcpyDeviceToHost));
    }
    EXPECT_TRUE(got == m.payload) << "message " << i << " (" << (m.device ? "device" : "host")
                                  << ", rank " << m.src << " -> " << 1 - m.src << ", tag " << m.tag
                                  << ", " << m.payload.size() << " bytes) arrived wrong";
  }
}

#else  // !KEEL_MIGRATION_NCCL

TEST(NcclTransportTest, MovesDeviceBuffersBetweenTwoGpusByteExact) {
  GTEST_SKIP() << "built without NCCL (KEEL_WITH_NCCL)";
}

#endif  // KEEL_MIGRATION_NCCL

}  // namespace
}  // namespace keel
