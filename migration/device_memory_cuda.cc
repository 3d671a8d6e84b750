// CreateCudaDeviceMemory for builds with CUDA: copies and adds (kernels::gpu::AddInto) on a
// non-blocking stream of their own with one event each (reused), checksums with
// kernels::gpu::SlotChecksums on the same stream.
#include <deque>
#include <mutex>
#include <string>
#include <vector>

#include "comm/cuda_common.h"
#include "keel/device_memory.hpp"
#include "kernels/add.h"
#include "kernels/checksum.h"

namespace keel {
namespace {

using cuda::CudaError;
using cuda::CudaEvent;
using cuda::CudaStream;

class CudaDeviceMemory final : public DeviceMemory {
 public:
  CudaDeviceMemory(int device, std::unique_ptr<CudaStream> stream, uint64_t* device_sum,
                   uint64_t* host_sum)
      : device_(device), stream_(std::move(stream)), device_sum_(device_sum), host_sum_(host_sum) {}

  ~CudaDeviceMemory() override {
    cudaSetDevice(device_);
    cudaStreamSynchronize(stream_->get());
    cudaFree(device_sum_);
    cudaFreeHost(host_sum_);
    (void)cudaGetLastError();
  }

  bool IsDeviceMemory(const void* data) override {
    if (data == nullptr) return false;
    std::lock_guard<std::mutex> lock(mutex_);
    // On a thread that never chose a device, the query would create a context on device 0.
    cudaSetDevice(device_);
    cudaPointerAttributes attributes{};
    if (cudaPointerGetAttributes(&attributes, data) != cudaSuccess) {
      // Not memory CUDA knows: host memory. Clear the error so the next CUDA call does not
      // report it as its own.
      (void)cudaGetLastError();
      return false;
    }
    return attributes.type == cudaMemoryTypeDevice || attributes.type == cudaMemoryTypeManaged;
  }

  Result<std::byte*> AllocateHost(size_t bytes) override {
    std::lock_guard<std::mutex> lock(mutex_);
    KEEL_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    void* data = nullptr;
    KEEL_CUDA_RETURN_IF_ERROR(cudaHostAlloc(&data, bytes == 0 ? 1 : bytes, cudaHostAllocDefault));
    return static_cast<std::byte*>(data);
  }

  void FreeHost(std::byte* data) override {
    std::lock_guard<std::mutex> lock(mutex_);
    cudaSetDevice(device_);
    cudaFreeHost(data);
  }

  Result<std::byte*> AllocateDevice(size_t bytes) override {
    std::lock_guard<std::mutex> lock(mutex_);
    KEEL_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    void* data = nullptr;
    KEEL_CUDA_RETURN_IF_ERROR(cudaMalloc(&data, bytes == 0 ? 1 : bytes));
    return static_cast<std::byte*>(data);
  }

  void FreeDevice(std::byte* data) override {
    std::lock_guard<std::mutex> lock(mutex_);
    cudaSetDevice(device_);
    cudaFree(data);
  }

  Result<uint64_t> StartCopy(std::byte* destination, const std::byte* source,
                             size_t bytes) override {
    std::lock_guard<std::mutex> lock(mutex_);
    KEEL_RETURN_IF_ERROR(failure_);
    KEEL_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    if (bytes > 0) {
      Remember(cudaMemcpyAsync(destination, source, bytes, cudaMemcpyDefault, stream_->get()),
               "cudaMemcpyAsync");
    }
    return RecordLocked();
  }

  Result<uint64_t> StartAdd(GradientType type, std::byte* acc, const std::byte* source,
                            size_t bytes) override {
    std::lock_guard<std::mutex> lock(mutex_);
    KEEL_RETURN_IF_ERROR(failure_);
    KEEL_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    KEEL_RETURN_IF_ERROR(
        kernels::gpu::AddInto(type, acc, source, static_cast<int64_t>(bytes), stream_->get()));
    return RecordLocked();
  }

  Result<uint64_t> CompletedCopies() override {
    std::lock_guard<std::mutex> lock(mutex_);
    KEEL_RETURN_IF_ERROR(failure_);
    cudaSetDevice(device_);
    while (!in_flight_.empty()) {
      const cudaError_t query = cudaEventQuery(in_flight_.front()->get());
      if (query == cudaErrorNotReady) break;
      Remember(query, "cudaEventQuery");
      KEEL_RETURN_IF_ERROR(failure_);
      free_events_.push_back(std::move(in_flight_.front()));
      in_flight_.pop_front();
    }
    return started_ - in_flight_.size();
  }

  Result<uint64_t> Checksum(const std::byte* data, size_t bytes) override {
    std::lock_guard<std::mutex> lock(mutex_);
    KEEL_RETURN_IF_ERROR(failure_);
    KEEL_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    const auto size = static_cast<int64_t>(bytes);
    KEEL_RETURN_IF_ERROR(
        kernels::gpu::SlotChecksums(data, 1, size, size, 0, device_sum_, stream_->get()));
    KEEL_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(host_sum_, device_sum_, sizeof(uint64_t),
                                              cudaMemcpyDeviceToHost, stream_->get()));
    Remember(cudaStreamSynchronize(stream_->get()), "cudaStreamSynchronize");
    KEEL_RETURN_IF_ERROR(failure_);
    return *host_sum_;
  }

 private:
  // The number of the operation just enqueued: an event recorded after it on the stream.
  Result<uint64_t> RecordLocked() {
    KEEL_RETURN_IF_ERROR(failure_);
    if (free_events_.empty()) {
      auto event = std::make_unique<CudaEvent>();
      KEEL_RETURN_IF_ERROR(event->Create());
      free_events_.push_back(std::move(event));
    }
    std::unique_ptr<CudaEvent> event = std::move(free_events_.back());
    free_events_.pop_back();
    Remember(cudaEventRecord(event->get(), stream_->get()), "cudaEventRecord");
    KEEL_RETURN_IF_ERROR(failure_);
    in_flight_.push_back(std::move(event));
    return started_++;
  }

  // A failed copy leaves the stream's later work undefined: every later call reports it.
  void Remember(cudaError_t code, const char* call) {
    if (code != cudaSuccess && failure_.ok()) {
      failure_ = Internal(std::string("CUDA device ") + std::to_string(device_) + ": " + call +
                          " failed: " + cudaGetErrorString(code));
    }
  }

  const int device_;
  std::mutex mutex_;  // guards everything below and orders the calls on the stream
  std::unique_ptr<CudaStream> stream_;
  uint64_t* const device_sum_;  // [1] device memory, the checksum kernel's output
  uint64_t* const host_sum_;    // [1] page-locked, where the checksum lands
  uint64_t started_ = 0;
  std::deque<std::unique_ptr<CudaEvent>> in_flight_;  // one per copy not known to be complete
  std::vector<std::unique_ptr<CudaEvent>> free_events_;
  Status failure_;
};

}  // namespace

Result<std::shared_ptr<DeviceMemory>> CreateCudaDeviceMemory(int device) {
  KEEL_ASSIGN_OR_RETURN(device, cuda::ChooseDevice("CUDA device memory", device));
  KEEL_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
  auto stream = std::make_unique<CudaStream>();
  KEEL_RETURN_IF_ERROR(stream->Create());
  void* device_sum = nullptr;
  KEEL_CUDA_RETURN_IF_ERROR(cudaMalloc(&device_sum, sizeof(uint64_t)));
  void* host_sum = nullptr;
  const cudaError_t allocated = cudaHostAlloc(&host_sum, sizeof(uint64_t), cudaHostAllocDefault);
  if (allocated != cudaSuccess) {
    cudaFree(device_sum);
    return CudaError("cudaHostAlloc", allocated, __FILE__, __LINE__);
  }
  return std::shared_ptr<DeviceMemory>(std::make_shared<CudaDeviceMemory>(
      device, std::move(stream), static_cast<uint64_t*>(device_sum),
      static_cast<uint64_t*>(host_sum)));
}

}  // namespace keel
