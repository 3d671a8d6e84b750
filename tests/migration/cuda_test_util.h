// CUDA helpers for the migration tests that run on a GPU: ASSERT_CUDA and an owned device
// buffer. Includes CUDA's runtime header: only tests built with CUDA include it.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include <gtest/gtest.h>

#define ASSERT_CUDA(call)                                                                    \
  do {                                                                                       \
    const cudaError_t keel_error_ = (call);                                                  \
    ASSERT_EQ(keel_error_, cudaSuccess) << #call << ": " << cudaGetErrorString(keel_error_); \
  } while (0)

namespace keel::testing {

// Device memory on `device`, freed with the object.
class DeviceBuffer {
 public:
  DeviceBuffer(int device, size_t bytes) : device_(device) {
    cudaSetDevice(device);
    if (cudaMalloc(&data_, bytes + 1) != cudaSuccess) ADD_FAILURE() << "cudaMalloc failed";
  }
  ~DeviceBuffer() {
    cudaSetDevice(device_);
    if (data_ != nullptr) cudaFree(data_);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  std::byte* get() const { return static_cast<std::byte*>(data_); }

 private:
  int device_;
  void* data_ = nullptr;
};

}  // namespace keel::testing
