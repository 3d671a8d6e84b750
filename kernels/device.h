// Where Keel's kernels run. Every kernel has two host functions with the same arguments: one in
// keel::kernels::cpu (the reference; always built, and what the engine uses without a GPU) and one
// in keel::kernels::gpu (CUDA; built when KEEL_WITH_CUDA is on, asynchronous on a stream).
#pragma once

#include <cstdint>

// CUDA's stream handle type without CUDA's headers: cudaStream_t is `CUstream_st*`.
struct CUstream_st;

namespace keel::kernels {

using Stream = CUstream_st*;  // a cudaStream_t; nullptr is the legacy default stream

// True when Keel was built with CUDA and the CUDA runtime sees at least one GPU.
bool GpuAvailable();

// Element type of hidden-state rows. bf16 is stored as uint16_t (the upper half of an IEEE
// float32); every kernel accumulates in float32 and rounds to bf16 once, to nearest even.
enum class DType { kFloat32, kBFloat16 };

// Bytes of one element of `dtype`.
constexpr int64_t DTypeBytes(DType dtype) { return dtype == DType::kFloat32 ? 4 : 2; }

}  // namespace keel::kernels
