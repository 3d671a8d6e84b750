// Measures the expert GEMMs' throughput by inner width, the curve `cost_model.gemm_efficiency`
// wants (docs/strategies.md, "The GEMM efficiency curve"): an expert sharded s ways runs its GEMMs
// expert_ffn_size / s columns wide on all of its rows, and narrower GEMMs run below the full
// width's TFLOP/s. For each width w = ffn / s (s = 1, 2, 4, ... while w >= 64) it times one
// expert's forward and backward GEMMs on `rows` token rows in bf16 with fp32 accumulation
// (cuBLAS): per up matrix (hidden x w) and the down matrix (w x hidden) the forward product, the
// input gradient and the weight gradient, 2·m·n·k FLOPs each. Prints a table, the TFLOP/s at the
// full width (cost_model.expert_tflops) and the curve as a config line; JSON with --json PATH.
//   gemm_width_bench [--hidden H] [--ffn F] [--rows R] [--matrices M] [--runs N] [--json PATH]
// Defaults: the cost model's (hidden 2048, ffn 8192, 2 matrices) and 4096 rows. Each time is the
// median of N runs (default 20) after warm-up, measured with CUDA events. Standalone (CUDA and
// cuBLAS only), so bench/gpu/run.sh can run it on a lent GPU machine.
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

struct Options {
  int64_t hidden = 2048;
  int64_t ffn = 8192;
  int64_t rows = 4096;
  int matrices = 2;
  int runs = 20;
  std::string json_path;
};

// One GEMM, C [m x n] = A [m x k] · B [k x n], column-major.
struct Gemm {
  int64_t m, n, k;
};

void Die(const std::string& message) {
  std::fprintf(stderr, "gemm_width_bench: %s\n", message.c_str());
  std::exit(1);
}

void Check(cudaError_t error, const char* call) {
  if (error != cudaSuccess) Die(std::string(call) + ": " + cudaGetErrorString(error));
}

void Check(cublasStatus_t status, const char* call) {
  if (status != CUBLAS_STATUS_SUCCESS) {
    Die(std::string(call) + " failed with cuBLAS status " + std::to_string(status));
  }
}

int64_t ParsePositive(const char* flag, const char* text) {
  char* end = nullptr;
  const long long value = std::strtoll(text, &end, 10);
  if (end == text || *end != '\0' || value <= 0 || value > (int64_t{1} << 20)) {
    Die(std::string(flag) + " " + text + " is not an integer in [1, 2^20]");
  }
  return value;
}

Options ParseOptions(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--help") {
      std::printf(
          "gemm_width_bench [--hidden H] [--ffn F] [--rows R] [--matrices M] [--runs N] "
          "[--json PATH]\n"
          "Times one expert's forward and backward GEMMs (bf16, fp32 accumulation) at inner\n"
          "widths F, F/2, F/4, ... and prints cost_model.gemm_efficiency for the config.\n"
          "  --hidden H    expert input and output width (default 2048)\n"
          "  --ffn F       the whole expert's inner width (default 8192)\n"
          "  --rows R      token rows the expert (and each of its shards) runs (default 4096)\n"
          "  --matrices M  weight matrices per expert: 2 (FFN) or 3 (gated) (default 2)\n"
          "  --runs N      timed runs per width; the median is reported (default 20)\n"
          "  --json PATH   also write the results as JSON\n");
      std::exit(0);
    }
    if (i + 1 >= argc) Die(flag + " needs a value (see --help)");
    const char* value = argv[++i];
    if (flag == "--hidden") {
      o.hidden = ParsePositive("--hidden", value);
    } else if (flag == "--ffn") {
      o.ffn = ParsePositive("--ffn", value);
    } else if (flag == "--rows") {
      o.rows = ParsePositive("--rows", value);
    } else if (flag == "--matrices") {
      o.matrices = static_cast<int>(ParsePositive("--matrices", value));
      if (o.matrices < 2 || o.matrices > 3) Die("--matrices must be 2 or 3");
    } else if (flag == "--runs") {
      o.runs = static_cast<int>(ParsePositive("--runs", value));
    } else if (flag == "--json") {
      o.json_path = value;
    } else {
      Die("unknown flag " + flag + " (see --help)");
    }
  }
  return o;
}

// One expert's GEMMs at inner width w, forward and backward: each up matrix (hidden x w) and the
// down matrix (w x hidden) gives the forward product, the input gradient and the weight
// gradient.
std::vector<Gemm> ExpertGemms(const Options& o, int64_t w) {
  const int64_t r = o.rows;
  const int64_t h = o.hidden;
  std::vector<Gemm> gemms;
  for (int up = 0; up < o.matrices - 1; ++up) {
    gemms.push_back({r, w, h});  // x · W_up
    gemms.push_back({r, h, w});  // d_up · W_upᵀ
    gemms.push_back({h, w, r});  // xᵀ · d_up
  }
  gemms.push_back({r, h, w});  // a · W_down
  gemms.push_back({r, w, h});  // d_out · W_downᵀ
  gemms.push_back({w, h, r});  // aᵀ · d_out
  return gemms;
}

double Flops(const std::vector<Gemm>& gemms) {
  double flops = 0;
  for (const Gemm& g : gemms) flops += 2.0 * g.m * g.n * g.k;
  return flops;
}

struct WidthResult {
  int shards = 1;
  int64_t width = 0;
  double milliseconds = 0;  // median of the runs, all the expert's GEMMs
  double tflops = 0;
  double efficiency = 0;  // relative to the whole expert's width
};

}  // namespace

int main(int argc, char** argv) {
  const Options o = ParseOptions(argc, argv);
  int device = 0;
  Check(cudaGetDevice(&device), "cudaGetDevice");
  cudaDeviceProp properties{};
  Check(cudaGetDeviceProperties(&properties, device), "cudaGetDeviceProperties");

  std::vector<int> shard_counts;
  for (int s = 1; o.ffn / s >= 64 && o.ffn % s == 0; s *= 2) shard_counts.push_back(s);
  // Buffers large enough for every GEMM's operands at the whole width (the widest).
  size_t most = 0;
  for (const Gemm& g : ExpertGemms(o, o.ffn)) {
    most = std::max({most, static_cast<size_t>(g.m * g.k), static_cast<size_t>(g.k * g.n),
                     static_cast<size_t>(g.m * g.n)});
  }
  __nv_bfloat16* buffers[3] = {};
  for (__nv_bfloat16*& buffer : buffers) {
    Check(cudaMalloc(&buffer, most * sizeof(__nv_bfloat16)), "cudaMalloc");
    // Small values (each bf16 0x3c3c, about 0.0115), so the sums stay finite.
    Check(cudaMemset(buffer, 0x3c, most * sizeof(__nv_bfloat16)), "cudaMemset");
  }
  cublasHandle_t handle = nullptr;
  Check(cublasCreate(&handle), "cublasCreate");
  cudaStream_t stream = nullptr;
  Check(cudaStreamCreate(&stream), "cudaStreamCreate");
  Check(cublasSetStream(handle, stream), "cublasSetStream");
  cudaEvent_t start = nullptr;
  cudaEvent_t stop = nullptr;
  Check(cudaEventCreate(&start), "cudaEventCreate");
  Check(cudaEventCreate(&stop), "cudaEventCreate");

  const float alpha = 1.0f;
  const float beta = 0.0f;
  auto run_gemms = [&](const std::vector<Gemm>& gemms) {
    for (const Gemm& g : gemms) {
      Check(cublasGemmEx(handle, CUBLAS_OP_N, CUBLAS_OP_N, static_cast<int>(g.m),
                         static_cast<int>(g.n), static_cast<int>(g.k), &alpha, buffers[0],
                         CUDA_R_16BF, static_cast<int>(g.m), buffers[1], CUDA_R_16BF,
                         static_cast<int>(g.k), &beta, buffers[2], CUDA_R_16BF,
                         static_cast<int>(g.m), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
            "cublasGemmEx");
    }
  };

  std::vector<WidthResult> results;
  for (const int s : shard_counts) {
    WidthResult result;
    result.shards = s;
    result.width = o.ffn / s;
    const std::vector<Gemm> gemms = ExpertGemms(o, result.width);
    for (int i = 0; i < 3; ++i) run_gemms(gemms);  // warm-up: cuBLAS picks its kernels
    std::vector<double> times;
    for (int run = 0; run < o.runs; ++run) {
      Check(cudaEventRecord(start, stream), "cudaEventRecord");
      run_gemms(gemms);
      Check(cudaEventRecord(stop, stream), "cudaEventRecord");
      Check(cudaEventSynchronize(stop), "cudaEventSynchronize");
      float milliseconds = 0;
      Check(cudaEventElapsedTime(&milliseconds, start, stop), "cudaEventElapsedTime");
      times.push_back(milliseconds);
    }
    std::sort(times.begin(), times.end());
    result.milliseconds = times[times.size() / 2];
    result.tflops = Flops(gemms) / (result.milliseconds * 1e-3) / 1e12;
    results.push_back(result);
  }
  for (WidthResult& result : results) result.efficiency = result.tflops / results.front().tflops;

  std::printf(
      "%s: one expert's forward + backward GEMMs, %lld rows, hidden %lld, %d matrices, "
      "bf16 with fp32 accumulation, median of %d runs\n",
      properties.name, static_cast<long long>(o.rows), static_cast<long long>(o.hidden), o.matrices,
      o.runs);
  std::printf("%8s %8s %10s %9s %11s\n", "shards", "width", "ms", "TFLOP/s", "efficiency");
  for (const WidthResult& r : results) {
    std::printf("%8d %8lld %10.4f %9.1f %11.3f\n", r.shards, static_cast<long long>(r.width),
                r.milliseconds, r.tflops, r.efficiency);
  }
  // The curve, columns ascending, relative to the whole width's throughput (expert_tflops).
  std::string curve;
  for (auto r = results.rbegin(); r != results.rend(); ++r) {
    char point[64];
    std::snprintf(point, sizeof(point), "%s%lld:%.3g", curve.empty() ? "" : ", ",
                  static_cast<long long>(r->width), r->efficiency);
    curve += point;
  }
  std::printf("cost_model.expert_tflops: %.1f\n", results.front().tflops);
  std::printf("cost_model.gemm_efficiency: \"%s\"\n", curve.c_str());

  if (!o.json_path.empty()) {
    FILE* file = std::fopen(o.json_path.c_str(), "w");
    if (file == nullptr) Die("cannot write " + o.json_path + ": " + std::strerror(errno));
    std::fprintf(file,
                 "{\"device\": \"%s\", \"rows\": %lld, \"hidden\": %lld, \"ffn\": %lld, "
                 "\"matrices\": %d, \"runs\": %d, \"expert_tflops\": %.3f, "
                 "\"gemm_efficiency\": \"%s\", \"widths\": [",
                 properties.name, static_cast<long long>(o.rows), static_cast<long long>(o.hidden),
                 static_cast<long long>(o.ffn), o.matrices, o.runs, results.front().tflops,
                 curve.c_str());
    for (size_t i = 0; i < results.size(); ++i) {
      const WidthResult& r = results[i];
      std::fprintf(file,
                   "%s{\"shards\": %d, \"width\": %lld, \"milliseconds\": %.6f, \"tflops\": %.3f, "
                   "\"efficiency\": %.4f}",
                   i == 0 ? "" : ", ", r.shards, static_cast<long long>(r.width), r.milliseconds,
                   r.tflops, r.efficiency);
    }
    std::fprintf(file, "]}\n");
    std::fclose(file);
  }

  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  cublasDestroy(handle);
  cudaStreamDestroy(stream);
  for (__nv_bfloat16* buffer : buffers) cudaFree(buffer);
  return 0;
}
