// The engine's device path against the device's own copy speed. Every slot copy and gradient sum
// of the engine goes through DeviceMemory; this measures, per expert of `bytes` bytes:
//   BM_DeviceCopy       device -> device: the ceiling every other row is compared with;
//   BM_DeviceToHost / BM_HostToDevice: copies to and from pageable host memory;
//   BM_DeviceToPageLockedHost / BM_PageLockedHostToDevice: the same with page-locked memory, what
//                       the staging copies use;
//   BM_SlotExchange     what a transient fill or a replica push costs a rank pair besides the wire:
//                       the engine's SlotExchange gathers the slot into the page-locked send
//                       buffer, the collective moves it (one rank, a communicator that moves host
//                       memory only: a memcpy), what arrived is copied up to the device in one
//                       piece, and the receiver copies it into its slot (engine/slot_exchange.h);
//   BM_GradientSum      acc += source in float32 (kernels::gpu::AddInto on a GPU).
// Memory: KEEL_BENCH_MEMORY = cuda | guarded-host | host; by default CUDA where a GPU is, else
// guarded host memory (the CPU references: their numbers say nothing about a GPU).
#include <benchmark/benchmark.h>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "engine/slot_exchange.h"
#include "keel/device_memory.hpp"
#include "kernels/device.h"

namespace keel {
namespace {

std::string MemoryName() {
  const char* chosen = std::getenv("KEEL_BENCH_MEMORY");
  if (chosen != nullptr && *chosen != '\0') return chosen;
  return kernels::GpuAvailable() ? "cuda" : "guarded-host";
}

DeviceMemory& Memory() {
  static const std::shared_ptr<DeviceMemory> memory = [] {
    const std::string name = MemoryName();
    Result<std::shared_ptr<DeviceMemory>> made =
        name == "cuda"           ? CreateCudaDeviceMemory()
        : name == "guarded-host" ? CreateGuardedHostMemory()
        : name == "host"         ? Result<std::shared_ptr<DeviceMemory>>(CreateHostMemory())
                                 : InvalidArgument("KEEL_BENCH_MEMORY = \"" + name +
                                                   "\" is not one of cuda, guarded-host, host");
    if (!made.ok()) {
      std::fprintf(stderr, "device_bench: %s\n", made.status().ToString().c_str());
      std::exit(2);
    }
    return std::move(made).value();
  }();
  return *memory;
}

// A device buffer for one benchmark, filled with a pattern.
class Buffer {
 public:
  explicit Buffer(size_t bytes) : bytes_(bytes) {
    data_ = Memory().AllocateDevice(bytes).value();
    std::vector<std::byte> pattern(bytes);
    for (size_t i = 0; i < bytes; ++i) pattern[i] = static_cast<std::byte>(i * 7 + 1);
    Check(Memory().Copy(data_, pattern.data(), bytes));
  }
  ~Buffer() { Memory().FreeDevice(data_); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  std::byte* data() const { return data_; }

  static void Check(const Status& status) {
    if (status.ok()) return;
    std::fprintf(stderr, "device_bench: %s\n", status.ToString().c_str());
    std::exit(1);
  }

 private:
  size_t bytes_;
  std::byte* data_ = nullptr;
};

void Finish(benchmark::State& state, size_t bytes) {
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * static_cast<int64_t>(bytes));
  state.SetLabel(MemoryName());
}

void BM_DeviceCopy(benchmark::State& state) {
  const size_t bytes = static_cast<size_t>(state.range(0));
  Buffer from(bytes), to(bytes);
  for (auto _ : state) Buffer::Check(Memory().Copy(to.data(), from.data(), bytes));
  Finish(state, bytes);
}

void BM_DeviceToHost(benchmark::State& state) {
  const size_t bytes = static_cast<size_t>(state.range(0));
  Buffer from(bytes);
  std::vector<std::byte> host(bytes);
  for (auto _ : state) Buffer::Check(Memory().Copy(host.data(), from.data(), bytes));
  Finish(state, bytes);
}

void BM_HostToDevice(benchmark::State& state) {
  const size_t bytes = static_cast<size_t>(state.range(0));
  Buffer to(bytes);
  std::vector<std::byte> host(bytes, std::byte{3});
  for (auto _ : state) Buffer::Check(Memory().Copy(to.data(), host.data(), bytes));
  Finish(state, bytes);
}

// The same two copies with page-locked host memory (DeviceMemory::AllocateHost), which the
// engine's slot exchange and the staged transport use.
void BM_DeviceToPageLockedHost(benchmark::State& state) {
  const size_t bytes = static_cast<size_t>(state.range(0));
  Buffer from(bytes);
  std::byte* host = Memory().AllocateHost(bytes).value();
  for (auto _ : state) Buffer::Check(Memory().Copy(host, from.data(), bytes));
  Memory().FreeHost(host);
  Finish(state, bytes);
}

void BM_PageLockedHostToDevice(benchmark::State& state) {
  const size_t bytes = static_cast<size_t>(state.range(0));
  Buffer to(bytes);
  std::byte* host = Memory().AllocateHost(bytes).value();
  for (auto _ : state) Buffer::Check(Memory().Copy(to.data(), host, bytes));
  Memory().FreeHost(host);
  Finish(state, bytes);
}

void BM_SlotExchange(benchmark::State& state) {
  const size_t bytes = static_cast<size_t>(state.range(0));
  Buffer source(bytes), destination(bytes);
  LocalCommunicatorGroup group(1);
  std::unique_ptr<Communicator> communicator = group.Join(0);
  SlotExchange exchange;  // kept between steps, as the engine keeps its own
  const bool on_device = MemoryName() != "host";
  auto step = [&] {
    exchange.Begin(1);
    exchange.Add(0, source.data(), bytes);
    exchange.Expect(0, bytes);
    Buffer::Check(exchange.Run(*communicator, Memory(), on_device));
    Result<const std::byte*> received = exchange.Received(0, bytes);
    Buffer::Check(received.status());
    Buffer::Check(Memory().Copy(destination.data(), *received, bytes));
  };
  step();  // the first exchange allocates the buffers the others reuse
  for (auto _ : state) step();
  Finish(state, bytes);
}

void BM_GradientSum(benchmark::State& state) {
  const size_t bytes = static_cast<size_t>(state.range(0));
  Buffer acc(bytes), source(bytes);
  for (auto _ : state) {
    Buffer::Check(Memory().Add(GradientType::kFloat32, acc.data(), source.data(), bytes));
  }
  Finish(state, bytes);
}

// 1 MiB (a small expert), 16 MiB, and 67 MB (a 4096 x 4096 x 2 bf16 expert).
#define KEEL_DEVICE_SIZES \
  ->Arg(1 << 20)->Arg(16 << 20)->Arg(67108864)->Unit(benchmark::kMicrosecond)
BENCHMARK(BM_DeviceCopy) KEEL_DEVICE_SIZES;
BENCHMARK(BM_DeviceToHost) KEEL_DEVICE_SIZES;
BENCHMARK(BM_HostToDevice) KEEL_DEVICE_SIZES;
BENCHMARK(BM_DeviceToPageLockedHost) KEEL_DEVICE_SIZES;
BENCHMARK(BM_PageLockedHostToDevice) KEEL_DEVICE_SIZES;
BENCHMARK(BM_SlotExchange) KEEL_DEVICE_SIZES;
BENCHMARK(BM_GradientSum) KEEL_DEVICE_SIZES;

}  // namespace
}  // namespace keel

BENCHMARK_MAIN();
