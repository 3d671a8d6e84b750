// Times every keel::kernels::gpu function at DeepSeek-V3-like sizes (8192 tokens per rank, top-8
// of 256 experts, hidden 7168, 64 ranks x 4 slots + 32 replica slots) against a measured
// device-to-device copy ceiling, and prints a table (and JSON with --json PATH). Standalone: no
// Google Benchmark, so bench/gpu/run.sh can build it on a lent GPU machine.
//   kernels_gpu_bench [--json PATH] [--runs N]
// Each time is the median of N runs (default 50) after warm-up, measured with CUDA events around
// the host function's launches on a stream ("stream"), and around a replay of the same launches
// captured in a CUDA graph ("graph", no launch gaps). Bytes are the fewest a kernel must move
// (each input read once, each output written once).
#include <cuda_runtime.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "keel/status.hpp"
#include "kernels/checksum.h"
#include "kernels/condense.h"
#include "kernels/device.h"
#include "kernels/histogram.h"
#include "kernels/host_device.h"
#include "kernels/permute.h"
#include "kernels/remap.h"

namespace keel::kernels {
namespace {

constexpr int kTokens = 8192;
constexpr int kTopK = 8;
constexpr int kEntries = kTokens * kTopK;
constexpr int kExperts = 256;
constexpr int64_t kHidden = 7168;
constexpr int kRanks = 64;
constexpr int kLocalSlots = 4;
constexpr int kReplicas = 32;  // replica slots for the hottest experts
constexpr int kSlots = kRanks * kLocalSlots + kReplicas;
constexpr int64_t kExpertBytes = 3 * kHidden * 2048 * 2;  // one bf16 expert's three matrices
constexpr int kChecksumSlots = kLocalSlots;
constexpr int64_t kCopyBytes = int64_t{1} << 30;
constexpr int kWarmupRuns = 5;
constexpr double kRemapTargetMicros = 20.0;
constexpr double kRowTargetFraction = 0.70;

void Die(const std::string& message) {
  std::fprintf(stderr, "kernels_gpu_bench: %s\n", message.c_str());
  std::exit(1);
}

void Check(cudaError_t error, const char* call) {
  if (error != cudaSuccess) Die(std::string(call) + ": " + cudaGetErrorString(error));
}
#define CUDA_CHECK(call) Check((call), #call)

void Check(const Status& status) {
  if (!status.ok()) Die(status.ToString());
}

class DeviceMemory {
 public:
  explicit DeviceMemory(int64_t bytes) {
    CUDA_CHECK(cudaMalloc(&data_, std::max<int64_t>(bytes, 1)));
  }
  ~DeviceMemory() { cudaFree(data_); }
  DeviceMemory(DeviceMemory&& other) noexcept : data_(std::exchange(other.data_, nullptr)) {}
  DeviceMemory(const DeviceMemory&) = delete;
  DeviceMemory& operator=(const DeviceMemory&) = delete;

  template <typename T = void>
  T* get() const {
    return static_cast<T*>(data_);
  }
  template <typename T>
  void Upload(const std::vector<T>& host) {
    CUDA_CHECK(cudaMemcpy(data_, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  }

 private:
  void* data_ = nullptr;
};

template <typename T>
DeviceMemory ToDevice(const std::vector<T>& host) {
  DeviceMemory memory(static_cast<int64_t>(host.size() * sizeof(T)));
  memory.Upload(host);
  return memory;
}

class CudaEvent {
 public:
  CudaEvent() { CUDA_CHECK(cudaEventCreate(&event_)); }
  ~CudaEvent() { cudaEventDestroy(event_); }
  CudaEvent(const CudaEvent&) = delete;
  CudaEvent& operator=(const CudaEvent&) = delete;
  cudaEvent_t get() const { return event_; }

 private:
  cudaEvent_t event_ = nullptr;
};

class CudaStream {
 public:
  CudaStream() { CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking)); }
  ~CudaStream() { cudaStreamDestroy(stream_); }
  CudaStream(const CudaStream&) = delete;
  CudaStream& operator=(const CudaStream&) = delete;
  cudaStream_t get() const { return stream_; }

 private:
  cudaStream_t stream_ = nullptr;
};

class CudaGraph {
 public:
  // Captures what `enqueue` puts on `stream` into an executable graph.
  CudaGraph(cudaStream_t stream, const std::function<void()>& enqueue) {
    CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    enqueue();
    CUDA_CHECK(cudaStreamEndCapture(stream, &graph_));
    CUDA_CHECK(cudaGraphInstantiate(&exec_, graph_, 0));
  }
  ~CudaGraph() {
    cudaGraphExecDestroy(exec_);
    cudaGraphDestroy(graph_);
  }
  CudaGraph(const CudaGraph&) = delete;
  CudaGraph& operator=(const CudaGraph&) = delete;
  void Launch(cudaStream_t stream) const { CUDA_CHECK(cudaGraphLaunch(exec_, stream)); }

 private:
  cudaGraph_t graph_ = nullptr;
  cudaGraphExec_t exec_ = nullptr;
};

// Median over `runs` of the time between events around `enqueue`, after warm-up runs.
double MedianMicros(cudaStream_t stream, int runs, const std::function<void()>& enqueue) {
  CudaEvent start;
  CudaEvent stop;
  for (int i = 0; i < kWarmupRuns; ++i) enqueue();
  CUDA_CHECK(cudaStreamSynchronize(stream));
  std::vector<double> micros;
  for (int i = 0; i < runs; ++i) {
    CUDA_CHECK(cudaEventRecord(start.get(), stream));
    enqueue();
    CUDA_CHECK(cudaEventRecord(stop.get(), stream));
    CUDA_CHECK(cudaEventSynchronize(stop.get()));
    float ms = 0.0f;
    CUDA_CHECK(cudaEventElapsedTime(&ms, start.get(), stop.get()));
    micros.push_back(1000.0 * ms);
  }
  std::sort(micros.begin(), micros.end());
  return runs % 2 == 1 ? micros[runs / 2] : 0.5 * (micros[runs / 2 - 1] + micros[runs / 2]);
}

struct Result {
  std::string kernel;
  std::string dtype;
  double stream_micros = 0;
  double graph_micros = 0;
  double bytes = 0;
};

double GigabytesPerSecond(double bytes, double micros) { return bytes / (micros * 1e3); }

class Bench {
 public:
  Bench(cudaStream_t stream, int runs) : stream_(stream), runs_(runs) {}

  // Times `enqueue` both on the stream and as a graph replay.
  void Time(const std::string& kernel, const std::string& dtype, double bytes,
            const std::function<void()>& enqueue) {
    Result result{kernel, dtype, 0, 0, bytes};
    result.stream_micros = MedianMicros(stream_, runs_, enqueue);
    const CudaGraph graph(stream_, enqueue);
    result.graph_micros = MedianMicros(stream_, runs_, [&] { graph.Launch(stream_); });
    CUDA_CHECK(cudaGetLastError());
    std::printf("  timed %-28s %-5s %10.1f us\n", kernel.c_str(), dtype.c_str(),
                result.stream_micros);
    std::fflush(stdout);
    results_.push_back(result);
  }

  const std::vector<Result>& results() const { return results_; }
  const Result& Find(const std::string& kernel, const std::string& dtype) const {
    for (const Result& r : results_) {
      if (r.kernel == kernel && r.dtype == dtype) return r;
    }
    Die("no result for " + kernel + " " + dtype);
    return results_.front();
  }

 private:
  cudaStream_t stream_;
  int runs_;
  std::vector<Result> results_;
};

// Router output with DeepSeek-like skew: each token's top-8 are distinct experts drawn with
// probability ~ 1 / (rank + 10), the ranks of the experts shuffled.
std::vector<int32_t> RouterIds(std::mt19937_64& rng) {
  std::vector<double> weight(kExperts);
  std::vector<int> order(kExperts);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  for (int e = 0; e < kExperts; ++e) weight[order[e]] = 1.0 / (e + 10);
  std::discrete_distribution<int> pick(weight.begin(), weight.end());
  std::vector<int32_t> ids(kEntries);
  for (int t = 0; t < kTokens; ++t) {
    for (int k = 0; k < kTopK; ++k) {
      int expert;
      do {
        expert = pick(rng);
      } while (std::find(&ids[t * kTopK], &ids[t * kTopK + k], expert) != &ids[t * kTopK + k]);
      ids[t * kTopK + k] = expert;
    }
  }
  return ids;
}

// Expert e's home is slot e on rank e / 4; the 32 hottest experts get a replica slot on another
// node's rank, and their quota is split in half between the two copies.
struct HostQuotas {
  std::vector<int32_t> copy_begin{0};
  std::vector<int32_t> copy_slot;
  std::vector<int32_t> copy_quota;
  std::vector<int32_t> slot_rank;
};

HostQuotas Quotas(const std::vector<int32_t>& ids) {
  std::vector<int32_t> load(kExperts, 0);
  for (int32_t id : ids) ++load[id];
  std::vector<int> hottest(kExperts);
  std::iota(hottest.begin(), hottest.end(), 0);
  std::stable_sort(hottest.begin(), hottest.end(), [&](int a, int b) { return load[a] > load[b]; });
  std::vector<int> replica_of(kExperts, -1);
  for (int r = 0; r < kReplicas; ++r) replica_of[hottest[r]] = r;

  HostQuotas quotas;
  quotas.slot_rank.resize(kSlots);
  for (int s = 0; s < kRanks * kLocalSlots; ++s) quotas.slot_rank[s] = s / kLocalSlots;
  for (int e = 0; e < kExperts; ++e) {
    const int home = e;
    if (replica_of[e] < 0) {
      quotas.copy_slot.push_back(home);
      quotas.copy_quota.push_back(load[e]);
    } else {
      const int replica = kRanks * kLocalSlots + replica_of[e];
      quotas.slot_rank[replica] = (quotas.slot_rank[home] + kRanks / 2) % kRanks;
      quotas.copy_slot.insert(quotas.copy_slot.end(), {home, replica});
      quotas.copy_quota.insert(quotas.copy_quota.end(), {load[e] / 2, load[e] - load[e] / 2});
    }
    quotas.copy_begin.push_back(static_cast<int32_t>(quotas.copy_slot.size()));
  }
  return quotas;
}

// One bucket per slot, ordered by (rank, slot): every rank's rows are contiguous.
std::vector<int32_t> BucketOfSlot(const std::vector<int32_t>& slot_rank) {
  std::vector<int> slots(kSlots);
  std::iota(slots.begin(), slots.end(), 0);
  std::stable_sort(slots.begin(), slots.end(),
                   [&](int a, int b) { return slot_rank[a] < slot_rank[b]; });
  std::vector<int32_t> bucket(kSlots);
  for (int b = 0; b < kSlots; ++b) bucket[slots[b]] = b;
  return bucket;
}

std::vector<unsigned char> RandomBytes(int64_t bytes, std::mt19937_64& rng) {
  std::vector<unsigned char> data(bytes);
  for (int64_t i = 0; i + 8 <= bytes; i += 8) {
    const uint64_t word = rng();
    std::memcpy(&data[i], &word, 8);
  }
  return data;
}

// Random finite rows of `dtype` (uniform in [-2, 2)).
std::vector<unsigned char> RandomRows(int64_t elements, DType dtype, std::mt19937_64& rng) {
  std::uniform_real_distribution<float> value(-2.0f, 2.0f);
  std::vector<unsigned char> rows(elements * DTypeBytes(dtype));
  for (int64_t i = 0; i < elements; ++i) {
    const float x = value(rng);
    if (dtype == DType::kFloat32) {
      std::memcpy(&rows[4 * i], &x, 4);
    } else {
      const uint16_t bf16 = FloatToBf16(x);
      std::memcpy(&rows[2 * i], &bf16, 2);
    }
  }
  return rows;
}

void WriteJson(const char* path, const std::string& device, double ceiling,
               const std::vector<Result>& results) {
  FILE* file = std::fopen(path, "w");
  if (file == nullptr) Die(std::string("cannot write ") + path + ": " + std::strerror(errno));
  std::fprintf(file, "{\n  \"device\": \"%s\",\n  \"copy_ceiling_gb_per_s\": %.1f,\n",
               device.c_str(), ceiling);
  std::fprintf(file, "  \"results\": [\n");
  for (size_t i = 0; i < results.size(); ++i) {
    const Result& r = results[i];
    const double rate = GigabytesPerSecond(r.bytes, r.stream_micros);
    std::fprintf(file,
                 "    {\"kernel\": \"%s\", \"dtype\": \"%s\", \"median_us\": %.2f, "
                 "\"graph_median_us\": %.2f, \"bytes\": %.0f, \"gb_per_s\": %.1f, "
                 "\"fraction_of_copy\": %.3f}%s\n",
                 r.kernel.c_str(), r.dtype.c_str(), r.stream_micros, r.graph_micros, r.bytes, rate,
                 rate / ceiling, i + 1 < results.size() ? "," : "");
  }
  std::fprintf(file, "  ]\n}\n");
  std::fclose(file);
}

int Main(int argc, char** argv) {
  const char* json_path = nullptr;
  int runs = 50;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--json" && i + 1 < argc) {
      json_path = argv[++i];
    } else if (arg == "--runs" && i + 1 < argc) {
      runs = std::max(1, std::atoi(argv[++i]));
    } else {
      Die("usage: kernels_gpu_bench [--json PATH] [--runs N]");
    }
  }
  if (!GpuAvailable()) Die("no GPU: the CUDA runtime sees no device, nothing to time");

  cudaDeviceProp properties;
  CUDA_CHECK(cudaGetDeviceProperties(&properties, 0));
  std::printf("device: %s (%d SMs, %.0f MB L2)\n", properties.name, properties.multiProcessorCount,
              properties.l2CacheSize / 1e6);
  const CudaStream stream_owner;
  const cudaStream_t stream = stream_owner.get();
  Bench bench(stream, runs);
  std::mt19937_64 rng(2024);

  {
    const DeviceMemory source(kCopyBytes);
    const DeviceMemory target(kCopyBytes);
    CUDA_CHECK(cudaMemset(source.get(), 0x3c, kCopyBytes));
    bench.Time("copy (ceiling)", "-", 2.0 * kCopyBytes, [&] {
      CUDA_CHECK(cudaMemcpyAsync(target.get(), source.get(), kCopyBytes, cudaMemcpyDeviceToDevice,
                                 stream));
    });
  }
  const Result copy = bench.Find("copy (ceiling)", "-");
  const double ceiling = GigabytesPerSecond(copy.bytes, copy.stream_micros);

  // ---- Routing: histograms, remap, permutation index.
  const std::vector<int32_t> ids = RouterIds(rng);
  const HostQuotas quotas = Quotas(ids);
  const std::vector<int32_t> bucket_of_slot = BucketOfSlot(quotas.slot_rank);
  std::vector<int32_t> rank_of_expert(kExperts);
  for (int e = 0; e < kExperts; ++e) rank_of_expert[e] = e / (kExperts / kRanks);

  const DeviceMemory device_ids = ToDevice(ids);
  const DeviceMemory device_rank_of = ToDevice(rank_of_expert);
  const DeviceMemory copy_begin = ToDevice(quotas.copy_begin);
  const DeviceMemory copy_slot = ToDevice(quotas.copy_slot);
  const DeviceMemory copy_quota = ToDevice(quotas.copy_quota);
  const DeviceMemory slot_rank = ToDevice(quotas.slot_rank);
  const DeviceMemory device_bucket_of_slot = ToDevice(bucket_of_slot);
  QuotaTable table;
  table.copy_begin = copy_begin.get<int32_t>();
  table.copy_slot = copy_slot.get<int32_t>();
  table.copy_quota = copy_quota.get<int32_t>();
  table.slot_rank = slot_rank.get<int32_t>();
  table.num_experts = kExperts;
  table.num_copies = static_cast<int>(quotas.copy_slot.size());
  table.num_slots = kSlots;
  table.num_ranks = kRanks;

  const DeviceMemory counts(4 * kExperts);
  const DeviceMemory entries_per_rank(4 * kRanks);
  const DeviceMemory tokens_per_rank(4 * kRanks);
  const DeviceMemory invalid(4);
  const DeviceMemory slot(4 * kEntries);
  const DeviceMemory send_counts(4 * kRanks);
  const DeviceMemory position(4 * kEntries);
  const DeviceMemory bucket_begin(4 * (kSlots + 1));
  const DeviceMemory remap_workspace(gpu::RemapWorkspaceBytes(kEntries, kExperts));
  CUDA_CHECK(cudaMemset(remap_workspace.get(), 0, gpu::RemapWorkspaceBytes(kEntries, kExperts)));
  const DeviceMemory index_workspace(gpu::PermutationWorkspaceBytes(kEntries, kSlots));
  const DeviceMemory histogram_workspace(gpu::HistogramWorkspaceBytes(kExperts));
  CUDA_CHECK(cudaMemset(histogram_workspace.get(), 0, gpu::HistogramWorkspaceBytes(kExperts)));

  const auto expert_histogram = [&] {
    Check(gpu::ExpertHistogram(device_ids.get<int32_t>(), kEntries, kExperts, counts.get<int32_t>(),
                               invalid.get<int32_t>(), histogram_workspace.get(), stream));
  };
  const auto remap = [&] {
    Check(gpu::RemapWithQuotas(device_ids.get<int32_t>(), kEntries, table, slot.get<int32_t>(),
                               send_counts.get<int32_t>(), invalid.get<int32_t>(),
                               remap_workspace.get(), stream));
  };
  const double id_bytes = 4.0 * kEntries;
  bench.Time("ExpertHistogram", "int32", id_bytes + 4.0 * kExperts, expert_histogram);
  bench.Time("RankHistogram", "int32", id_bytes + 4.0 * kExperts + 8.0 * kRanks, [&] {
    Check(gpu::RankHistogram(device_ids.get<int32_t>(), kTokens, kTopK,
                             device_rank_of.get<int32_t>(), kExperts, kRanks,
                             entries_per_rank.get<int32_t>(), tokens_per_rank.get<int32_t>(),
                             invalid.get<int32_t>(), stream));
  });
  bench.Time("RemapWithQuotas", "int32", 2 * id_bytes + 4.0 * kRanks, remap);
  bench.Time("histogram + remap", "int32", 3 * id_bytes + 4.0 * (kExperts + kRanks), [&] {
    expert_histogram();
    remap();
  });
  bench.Time("PermutationIndex", "int32", 2 * id_bytes + 4.0 * (kSlots + 1), [&] {
    Check(gpu::PermutationIndex(slot.get<int32_t>(), kEntries, device_bucket_of_slot.get<int32_t>(),
                                kSlots, kSlots, position.get<int32_t>(),
                                bucket_begin.get<int32_t>(), invalid.get<int32_t>(),
                                index_workspace.get(), stream));
  });
  CUDA_CHECK(cudaStreamSynchronize(stream));
  int32_t num_rows = 0;
  CUDA_CHECK(
      cudaMemcpy(&num_rows, bucket_begin.get<int32_t>() + kSlots, 4, cudaMemcpyDeviceToHost));

  // ---- Rows: permute, combine, their backward, condensation.
  std::vector<float> weights(kEntries);
  std::uniform_real_distribution<float> weight(0.0f, 0.25f);
  for (float& w : weights) w = weight(rng);
  const DeviceMemory device_weights = ToDevice(weights);
  const DeviceMemory grad_weights(4 * kEntries);
  const DeviceMemory representative(4 * int64_t{num_rows});
  const DeviceMemory kept(4 * kSlots);
  // A quarter of the rows are represented by an earlier row (what ExpandCondensed copies).
  std::vector<int32_t> synthetic_representative(num_rows);
  int64_t copied_rows = 0;
  for (int32_t i = 0; i < num_rows; ++i) {
    const bool copy_row = i % 4 == 3;
    synthetic_representative[i] = copy_row ? i - 1 : i;
    copied_rows += copy_row;
  }
  const DeviceMemory expand_representative = ToDevice(synthetic_representative);
  const double positions = 4.0 * kEntries;

  for (DType dtype : {DType::kBFloat16, DType::kFloat32}) {
    const char* name = dtype == DType::kFloat32 ? "fp32" : "bf16";
    const int64_t token_bytes = int64_t{kTokens} * kHidden * DTypeBytes(dtype);
    const int64_t row_bytes = int64_t{num_rows} * kHidden * DTypeBytes(dtype);
    DeviceMemory tokens(token_bytes);
    DeviceMemory grad_tokens(token_bytes);
    DeviceMemory rows(row_bytes);
    DeviceMemory grad_rows(row_bytes);
    tokens.Upload(RandomRows(int64_t{kTokens} * kHidden, dtype, rng));
    grad_tokens.Upload(RandomRows(int64_t{kTokens} * kHidden, dtype, rng));
    // Permute's output is the expert input: real rows for the kernels that read them.
    Check(gpu::Permute(tokens.get(), kTokens, kTopK, kHidden, dtype, position.get<int32_t>(),
                       rows.get(), num_rows, stream));
    CUDA_CHECK(cudaStreamSynchronize(stream));

    bench.Time("Permute", name, token_bytes + row_bytes + positions, [&] {
      Check(gpu::Permute(tokens.get(), kTokens, kTopK, kHidden, dtype, position.get<int32_t>(),
                         grad_rows.get(), num_rows, stream));
    });
    bench.Time("PermuteBackward", name, row_bytes + token_bytes + positions, [&] {
      Check(gpu::PermuteBackward(rows.get(), num_rows, position.get<int32_t>(), kTokens, kTopK,
                                 kHidden, dtype, grad_tokens.get(), stream));
    });
    bench.Time("UnpermuteCombine", name, row_bytes + token_bytes + 2 * positions, [&] {
      Check(gpu::UnpermuteCombine(rows.get(), num_rows, position.get<int32_t>(),
                                  device_weights.get<float>(), kTokens, kTopK, kHidden, dtype,
                                  tokens.get(), stream));
    });
    bench.Time("UnpermuteCombineBackward", name, token_bytes + 2 * row_bytes + 3 * positions, [&] {
      Check(gpu::UnpermuteCombineBackward(grad_tokens.get(), rows.get(), num_rows,
                                          position.get<int32_t>(), device_weights.get<float>(),
                                          kTokens, kTopK, kHidden, dtype, grad_rows.get(),
                                          grad_weights.get<float>(), stream));
    });
    bench.Time("CondenseRows (all distinct)", name, row_bytes + 4.0 * num_rows, [&] {
      Check(gpu::CondenseRows(rows.get(), num_rows, kHidden, dtype, bucket_begin.get<int32_t>(),
                              kSlots, 0.9f, 32, representative.get<int32_t>(), kept.get<int32_t>(),
                              stream));
    });
    bench.Time("ExpandCondensed (1/4 copied)", name,
               2.0 * copied_rows * kHidden * DTypeBytes(dtype) + 4.0 * num_rows, [&] {
                 Check(gpu::ExpandCondensed(grad_rows.get(), num_rows, kHidden, dtype,
                                            expand_representative.get<int32_t>(), stream));
               });
  }

  // ---- Checksums of four bf16 experts' slots.
  {
    const DeviceMemory slots(kChecksumSlots * kExpertBytes);
    std::mt19937_64 fill(7);
    std::vector<unsigned char> bytes = RandomBytes(kExpertBytes, fill);
    for (int s = 0; s < kChecksumSlots; ++s) {
      CUDA_CHECK(cudaMemcpy(slots.get<unsigned char>() + s * kExpertBytes, bytes.data(),
                            kExpertBytes, cudaMemcpyHostToDevice));
    }
    const DeviceMemory checksums(8 * kChecksumSlots);
    bench.Time("SlotChecksums", "bytes", double{kChecksumSlots} * kExpertBytes, [&] {
      Check(gpu::SlotChecksums(slots.get(), kChecksumSlots, kExpertBytes, kExpertBytes, 1,
                               checksums.get<uint64_t>(), stream));
    });
  }
  CUDA_CHECK(cudaDeviceSynchronize());

  std::printf("\n%d tokens x top-%d, %d experts, hidden %lld, %d slots (%d replicas), %d rows\n",
              kTokens, kTopK, kExperts, static_cast<long long>(kHidden), kSlots, kReplicas,
              num_rows);
  std::printf("copy ceiling: %.0f GB/s (%lld MiB device to device, read + write)\n\n", ceiling,
              static_cast<long long>(kCopyBytes >> 20));
  std::printf("%-30s %-5s %11s %11s %12s %8s %8s\n", "kernel", "dtype", "median_us", "graph_us",
              "bytes", "GB/s", "%copy");
  for (const Result& r : bench.results()) {
    const double rate = GigabytesPerSecond(r.bytes, r.stream_micros);
    std::printf("%-30s %-5s %11.1f %11.1f %12.0f %8.0f %7.0f%%\n", r.kernel.c_str(),
                r.dtype.c_str(), r.stream_micros, r.graph_micros, r.bytes, rate,
                100.0 * rate / ceiling);
  }

  std::printf("\ntargets:\n");
  const Result& routing = bench.Find("histogram + remap", "int32");
  std::printf("  histogram + remap <= %.0f us: %.1f us (stream), %.1f us (graph) %s\n",
              kRemapTargetMicros, routing.stream_micros, routing.graph_micros,
              routing.stream_micros <= kRemapTargetMicros ? "(met)" : "(missed)");
  for (const char* kernel : {"Permute", "UnpermuteCombine"}) {
    for (const char* dtype : {"bf16", "fp32"}) {
      const Result& r = bench.Find(kernel, dtype);
      const double fraction = GigabytesPerSecond(r.bytes, r.stream_micros) / ceiling;
      std::printf("  %s %s >= %.0f%% of copy: %.0f%% %s\n", kernel, dtype, 100 * kRowTargetFraction,
                  100 * fraction, fraction >= kRowTargetFraction ? "(met)" : "(missed)");
    }
  }
  if (json_path != nullptr) WriteJson(json_path, properties.name, ceiling, bench.results());
  return 0;
}

}  // namespace
}  // namespace keel::kernels

int main(int argc, char** argv) { return keel::kernels::Main(argc, argv); }
