// CUDA versions of the row movers of kernels/permute.h (PermutationIndex is in remap.cu, with the
// other stable counting sort). One block per token walks the token's row in packs of 16 bytes when
// every row allows it (else one element at a time), and sums over k ascending in float32 with
// separately rounded multiplies and adds (__fmul_rn, __fadd_rn: never fused), which is the CPU
// reference's arithmetic, so the outputs are bit-identical. Positions are trusted to lie in
// [-1, num_rows) (the CPU reference checks them); others are skipped rather than written through.
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/arguments.h"
#include "kernels/cuda_check.h"
#include "kernels/permute.h"
#include "kernels/rows.cuh"

namespace keel::kernels::gpu {
namespace {

constexpr int kThreads = 128;
constexpr int64_t kMaxBlocks = int64_t{1} << 30;
constexpr int kWarp = 32;

__device__ int32_t RoutedRow(const int32_t* position, int64_t entry, int64_t num_rows) {
  const int32_t row = position[entry];
  return row >= 0 && row < num_rows ? row : -1;
}

template <typename T, int V>
__global__ void PermuteKernel(const Pack<T, V>* in, int64_t num_tokens, int top_k,
                              int64_t packs_per_row, const int32_t* position, Pack<T, V>* out,
                              int64_t num_rows) {
  for (int64_t token = blockIdx.x; token < num_tokens; token += gridDim.x) {
    const Pack<T, V>* source = in + token * packs_per_row;
    for (int64_t p = threadIdx.x; p < packs_per_row; p += blockDim.x) {
      const Pack<T, V> value = source[p];
      for (int k = 0; k < top_k; ++k) {
        const int32_t row = RoutedRow(position, token * top_k + k, num_rows);
        if (row >= 0) out[row * packs_per_row + p] = value;
      }
    }
  }
}

template <typename T, int V>
__global__ void UnpermuteCombineKernel(const Pack<T, V>* rows, int64_t num_rows,
                                       const int32_t* position, const float* weights,
                                       int64_t num_tokens, int top_k, int64_t packs_per_row,
                                       Pack<T, V>* out) {
  for (int64_t token = blockIdx.x; token < num_tokens; token += gridDim.x) {
    for (int64_t p = threadIdx.x; p < packs_per_row; p += blockDim.x) {
      float acc[V];
#pragma unroll
      for (int v = 0; v < V; ++v) acc[v] = 0.0f;
      for (int k = 0; k < top_k; ++k) {
        const int32_t row = RoutedRow(position, token * top_k + k, num_rows);
        if (row < 0) continue;
        // Null weights count as 1, which is exact: PermuteBackward.
        const float weight = weights != nullptr ? weights[token * top_k + k] : 1.0f;
        const Pack<T, V> x = rows[row * packs_per_row + p];
#pragma unroll
        for (int v = 0; v < V; ++v) {
          acc[v] = __fadd_rn(acc[v], __fmul_rn(weight, ToFloat(x.value[v])));
        }
      }
      Pack<T, V> result;
#pragma unroll
      for (int v = 0; v < V; ++v) result.value[v] = FromFloat<T>(acc[v]);
      out[token * packs_per_row + p] = result;
    }
  }
}

// Sum over the block in a fixed tree (the same bits on every run); the result is in thread 0.
// Every thread of the block must call it.
__device__ float BlockSum(float value) {
  __shared__ float warp_sums[kThreads / kWarp];
  const int lane = threadIdx.x % kWarp;
  const int warp = threadIdx.x / kWarp;
  value = WarpSum(value);
  if (lane == 0) warp_sums[warp] = value;
  __syncthreads();
  float total = 0.0f;
  if (warp == 0) total = WarpSum(lane < kThreads / kWarp ? warp_sums[lane] : 0.0f);
  __syncthreads();  // warp_sums is reused by the next call
  return total;
}

template <typename T, int V>
__global__ void __launch_bounds__(kThreads)
    UnpermuteCombineBackwardKernel(const Pack<T, V>* grad_out, const Pack<T, V>* rows,
                                   int64_t num_rows, const int32_t* position, const float* weights,
                                   int64_t num_tokens, int top_k, int64_t packs_per_row,
                                   Pack<T, V>* grad_rows, float* grad_weights) {
  for (int64_t token = blockIdx.x; token < num_tokens; token += gridDim.x) {
    const Pack<T, V>* token_grad = grad_out + token * packs_per_row;
    for (int k = 0; k < top_k; ++k) {
      const int64_t entry = token * top_k + k;
      // The same for every thread, so the whole block takes this branch together.
      const int32_t row = RoutedRow(position, entry, num_rows);
      if (row < 0) {
        if (threadIdx.x == 0) grad_weights[entry] = 0.0f;
        continue;
      }
      const float weight = weights[entry];
      float dot = 0.0f;
      for (int64_t p = threadIdx.x; p < packs_per_row; p += blockDim.x) {
        const Pack<T, V> grad = token_grad[p];
        const Pack<T, V> x = rows[row * packs_per_row + p];
        Pack<T, V> grad_row;
#pragma unroll
        for (int v = 0; v < V; ++v) {
          const float g = ToFloat(grad.value[v]);
          grad_row.value[v] = FromFloat<T>(__fmul_rn(weight, g));
          dot = fmaf(g, ToFloat(x.value[v]), dot);
        }
        grad_rows[row * packs_per_row + p] = grad_row;
      }
      dot = BlockSum(dot);
      if (threadIdx.x == 0) grad_weights[entry] = dot;
    }
  }
}

// UnpermuteCombineKernel over checked arguments; null weights count as 1 (PermuteBackward).
Status LaunchCombine(const void* rows, int64_t num_rows, const int32_t* position,
                     const float* weights, int64_t num_tokens, int top_k, int64_t hidden,
                     DType dtype, void* out, Stream stream) {
  if (num_tokens == 0) return Status::Ok();
  return DispatchRows(dtype, hidden, {rows, out}, [&](auto element, auto width) {
    using T = decltype(element);
    constexpr int V = decltype(width)::value;
    UnpermuteCombineKernel<T, V><<<GridSize(num_tokens, 1, kMaxBlocks), kThreads, 0, stream>>>(
        static_cast<const Pack<T, V>*>(rows), num_rows, position, weights, num_tokens, top_k,
        hidden / V, static_cast<Pack<T, V>*>(out));
    KEEL_CUDA_RETURN_IF_LAUNCH_FAILED(UnpermuteCombineKernel);
    return Status::Ok();
  });
}

}  // namespace

Status Permute(const void* in, int64_t num_tokens, int top_k, int64_t hidden, DType dtype,
               const int32_t* position, void* out, int64_t num_rows, Stream stream) {
  KEEL_RETURN_IF_ERROR(
      CheckPermuteArguments(in, num_tokens, top_k, hidden, dtype, position, out, num_rows));
  if (num_tokens == 0) return Status::Ok();
  return DispatchRows(dtype, hidden, {in, out}, [&](auto element, auto width) {
    using T = decltype(element);
    constexpr int V = decltype(width)::value;
    PermuteKernel<T, V><<<GridSize(num_tokens, 1, kMaxBlocks), kThreads, 0, stream>>>(
        static_cast<const Pack<T, V>*>(in), num_tokens, top_k, hidden / V, position,
        static_cast<Pack<T, V>*>(out), num_rows);
    KEEL_CUDA_RETURN_IF_LAUNCH_FAILED(PermuteKernel);
    return Status::Ok();
  });
}

Status PermuteBackward(const void* grad_out, int64_t num_rows, const int32_t* position,
                       int64_t num_tokens, int top_k, int64_t hidden, DType dtype, void* grad_in,
                       Stream stream) {
  KEEL_RETURN_IF_ERROR(CheckPermuteBackwardArguments(grad_out, num_rows, position, num_tokens,
                                                     top_k, hidden, dtype, grad_in));
  return LaunchCombine(grad_out, num_rows, position, nullptr, num_tokens, top_k, hidden, dtype,
                       grad_in, stream);
}

Status UnpermuteCombine(const void* rows, int64_t num_rows, const int32_t* position,
                        const float* weights, int64_t num_tokens, int top_k, int64_t hidden,
                        DType dtype, void* out, Stream stream) {
  KEEL_RETURN_IF_ERROR(CheckUnpermuteCombineArguments(rows, num_rows, position, weights, num_tokens,
                                                      top_k, hidden, dtype, out));
  return LaunchCombine(rows, num_rows, position, weights, num_tokens, top_k, hidden, dtype, out,
                       stream);
}

Status UnpermuteCombineBackward(const void* grad_out, const void* rows, int64_t num_rows,
                                const int32_t* position, const float* weights, int64_t num_tokens,
                                int top_k, int64_t hidden, DType dtype, void* grad_rows,
                                float* grad_weights, Stream stream) {
  KEEL_RETURN_IF_ERROR(CheckUnpermuteCombineBackwardArguments(grad_out, rows, num_rows, position,
                                                              weights, num_tokens, top_k, hidden,
                                                              dtype, grad_rows, grad_weights));
  if (num_tokens == 0) return Status::Ok();
  return DispatchRows(dtype, hidden, {grad_out, rows, grad_rows}, [&](auto element, auto width) {
    using T = decltype(element);
    constexpr int V = decltype(width)::value;
    UnpermuteCombineBackwardKernel<T, V>
        <<<GridSize(num_tokens, 1, kMaxBlocks), kThreads, 0, stream>>>(
            static_cast<const Pack<T, V>*>(grad_out), static_cast<const Pack<T, V>*>(rows),
            num_rows, position, weights, num_tokens, top_k, hidden / V,
            static_cast<Pack<T, V>*>(grad_rows), grad_weights);
    KEEL_CUDA_RETURN_IF_LAUNCH_FAILED(UnpermuteCombineBackwardKernel);
    return Status::Ok();
  });
}

}  // namespace keel::kernels::gpu
