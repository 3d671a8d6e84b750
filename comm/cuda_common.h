// What the CUDA backends of comm/ and migration/ share (*_cuda.cc, *_nccl.cc): CUDA return
// codes turned into Status with file:line, RAII owners of a stream and an event, and the choice of
// a rank's device. Includes CUDA's runtime header: only files built with CUDA include it.
#pragma once

#include <cuda_runtime.h>

#include <string>
#include <string_view>

#include "keel/status.hpp"

namespace keel::cuda {

inline Status CudaError(const char* call, cudaError_t code, const char* file, int line) {
  return Internal(std::string(file) + ":" + std::to_string(line) + ": " + call +
                  " failed: " + cudaGetErrorString(code));
}

// Returns Internal from the enclosing function when the CUDA call `call` fails.
#define KEEL_CUDA_RETURN_IF_ERROR(call)                                         \
  do {                                                                          \
    const cudaError_t keel_cuda_rc_ = (call);                                   \
    if (keel_cuda_rc_ != cudaSuccess) {                                         \
      return ::keel::cuda::CudaError(#call, keel_cuda_rc_, __FILE__, __LINE__); \
    }                                                                           \
  } while (0)

// A non-blocking CUDA stream (it never synchronizes with the legacy default stream).
class CudaStream {
 public:
  CudaStream() = default;
  ~CudaStream() {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }
  CudaStream(const CudaStream&) = delete;
  CudaStream& operator=(const CudaStream&) = delete;

  Status Create() {
    KEEL_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    return Status::Ok();
  }
  cudaStream_t get() const { return stream_; }

 private:
  cudaStream_t stream_ = nullptr;
};

// A CUDA event without timing, for telling when the work before it on a stream is done.
class CudaEvent {
 public:
  CudaEvent() = default;
  ~CudaEvent() {
    if (event_ != nullptr) cudaEventDestroy(event_);
  }
  CudaEvent(const CudaEvent&) = delete;
  CudaEvent& operator=(const CudaEvent&) = delete;

  Status Create() {
    KEEL_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming));
    return Status::Ok();
  }
  cudaEvent_t get() const { return event_; }

 private:
  cudaEvent_t event_ = nullptr;
};

// The CUDA device this rank uses: `device`, or the current one when `device` < 0. A host
// without a usable device is FailedPrecondition; `what` names the caller in errors.
inline Result<int> ChooseDevice(std::string_view what, int device) {
  int count = 0;
  const cudaError_t rc = cudaGetDeviceCount(&count);
  if (rc == cudaErrorNoDevice || rc == cudaErrorInsufficientDriver ||
      (rc == cudaSuccess && count == 0)) {
    (void)cudaGetLastError();
    return FailedPrecondition(std::string(what) + ": no usable CUDA device (" +
                              cudaGetErrorString(rc == cudaSuccess ? cudaErrorNoDevice : rc) + ")");
  }
  KEEL_CUDA_RETURN_IF_ERROR(rc);
  if (device < 0) KEEL_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  if (device >= count) {
    return InvalidArgument(std::string(what) + ": device " + std::to_string(device) +
                           " is not a CUDA device in [0, " + std::to_string(count) + ")");
  }
  return device;
}

}  // namespace keel::cuda
