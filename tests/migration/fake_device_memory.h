// DeviceMemory for tests without a GPU. "Device" buffers are pages this object maps. With
// `protect`, those pages are inaccessible (PROT_NONE) except inside this object's own operations,
// so code that reads or writes device memory from the CPU instead of through DeviceMemory crashes
// the test, as it would on a GPU. Copies (and adds) are asynchronous: each CompletedCopies() call
// completes at most one more, in start order, so callers see copies in flight.
#pragma once

#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <deque>
#include <mutex>
#include <optional>
#include <span>
#include <vector>

#include "keel/device_memory.hpp"
#include "kernels/add.h"
#include "kernels/checksum.h"

namespace keel::testing {

class FakeDeviceMemory final : public DeviceMemory {
 public:
  explicit FakeDeviceMemory(bool protect = false) : protect_(protect) {}
  ~FakeDeviceMemory() override {
    for (const Block& block : blocks_) munmap(block.base, block.mapped);
  }
  FakeDeviceMemory(const FakeDeviceMemory&) = delete;
  FakeDeviceMemory& operator=(const FakeDeviceMemory&) = delete;

  // [bytes] of zeroed device memory, valid as long as this object.
  std::byte* Allocate(size_t bytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    const size_t mapped = (bytes / page + 1) * page;  // never empty: every block has an address
    void* base = mmap(nullptr, mapped, protect_ ? PROT_NONE : PROT_READ | PROT_WRITE,
                      MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (base == MAP_FAILED) return nullptr;
    blocks_.push_back({static_cast<std::byte*>(base), mapped});
    return static_cast<std::byte*>(base);
  }

  // Gives back a buffer from Allocate.
  void Free(std::byte* data) {
    std::lock_guard<std::mutex> lock(mutex_);
    for (size_t i = 0; i < blocks_.size(); ++i) {
      if (blocks_[i].base != data) continue;
      munmap(blocks_[i].base, blocks_[i].mapped);
      blocks_.erase(blocks_.begin() + static_cast<std::ptrdiff_t>(i));
      return;
    }
  }

  // What tests use to fill and inspect device buffers.
  void Write(std::byte* device, std::span<const std::byte> bytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    Unprotected open(*this, device);
    if (!bytes.empty()) std::memcpy(device, bytes.data(), bytes.size());
  }
  std::vector<std::byte> Read(const std::byte* device, size_t bytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    Unprotected open(*this, device);
    return std::vector<std::byte>(device, device + bytes);
  }

  Result<std::byte*> AllocateDevice(size_t bytes) override {
    std::byte* data = Allocate(bytes);
    if (data == nullptr) return Internal("fake device memory: mmap failed");
    return data;
  }
  void FreeDevice(std::byte* data) override { Free(data); }

  bool IsDeviceMemory(const void* data) override {
    std::lock_guard<std::mutex> lock(mutex_);
    return Contains(data);
  }

  Result<std::byte*> AllocateHost(size_t bytes) override {
    std::lock_guard<std::mutex> lock(mutex_);
    ++host_buffers_;
    return new std::byte[bytes == 0 ? 1 : bytes];
  }
  void FreeHost(std::byte* data) override {
    std::lock_guard<std::mutex> lock(mutex_);
    --host_buffers_;
    delete[] data;
  }

  Result<uint64_t> StartCopy(std::byte* destination, const std::byte* source,
                             size_t bytes) override {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!failure_.ok()) return failure_;
    pending_.push_back({destination, source, bytes, std::nullopt});
    return started_++;
  }

  Result<uint64_t> StartAdd(GradientType type, std::byte* acc, const std::byte* source,
                            size_t bytes) override {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!failure_.ok()) return failure_;
    pending_.push_back({acc, source, bytes, type});
    return started_++;
  }

  Result<uint64_t> CompletedCopies() override {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!pending_.empty()) RunOneLocked();
    if (!failure_.ok()) return failure_;
    return started_ - pending_.size();
  }

  Result<uint64_t> Checksum(const std::byte* data, size_t bytes) override {
    std::lock_guard<std::mutex> lock(mutex_);
    while (!pending_.empty() && failure_.ok()) RunOneLocked();
    if (!failure_.ok()) return failure_;
    if (!Contains(data)) return InvalidArgument("fake device memory: checksum of host memory");
    ++checksums_;
    Unprotected open(*this, data);
    return kernels::cpu::Checksum64({data, bytes});
  }

  // Copy number `copy` (0 for the first started) fails, and so does every later call.
  void FailCopy(uint64_t copy) {
    std::lock_guard<std::mutex> lock(mutex_);
    fail_copy_ = copy;
  }
  // Page-locked buffers handed out and not given back.
  int host_buffers() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return host_buffers_;
  }
  uint64_t copies_started() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return started_;
  }
  int checksums() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return checksums_;
  }

 private:
  struct Block {
    std::byte* base = nullptr;
    size_t mapped = 0;
  };
  struct PendingCopy {
    std::byte* destination = nullptr;
    const std::byte* source = nullptr;
    size_t bytes = 0;
    std::optional<GradientType> add;  // set: destination += source instead of a copy
  };

  // Opens the blocks that hold `a` and `b` to the CPU for this object's own work, and closes
  // them again.
  class Unprotected {
   public:
    Unprotected(FakeDeviceMemory& memory, const void* a, const void* b = nullptr)
        : memory_(memory), a_(memory.Find(a)), b_(memory.Find(b)) {
      Set(PROT_READ | PROT_WRITE);
    }
    ~Unprotected() { Set(PROT_NONE); }

   private:
    void Set(int protection) {
      if (!memory_.protect_) return;
      for (const Block* block : {a_, b_}) {
        if (block != nullptr) mprotect(block->base, block->mapped, protection);
      }
    }
    FakeDeviceMemory& memory_;
    const Block* a_;
    const Block* b_;
  };

  const Block* Find(const void* data) const {
    const auto* p = static_cast<const std::byte*>(data);
    for (const Block& block : blocks_) {
      if (p >= block.base && p < block.base + block.mapped) return &block;
    }
    return nullptr;
  }
  bool Contains(const void* data) const { return Find(data) != nullptr; }

  void RunOneLocked() {
    const uint64_t number = started_ - pending_.size();
    const PendingCopy copy = pending_.front();
    pending_.pop_front();
    if (number >= fail_copy_ && failure_.ok()) {
      failure_ = Internal("fake device memory: copy " + std::to_string(number) + " failed");
    }
    if (!failure_.ok()) return;
    Unprotected open(*this, copy.destination, copy.source);
    if (copy.add.has_value()) {
      failure_ = kernels::cpu::AddInto(*copy.add, copy.destination, copy.source,
                                       static_cast<int64_t>(copy.bytes));
    } else if (copy.bytes > 0) {
      std::memcpy(copy.destination, copy.source, copy.bytes);
    }
  }

  const bool protect_;
  mutable std::mutex mutex_;
  std::vector<Block> blocks_;
  std::deque<PendingCopy> pending_;
  uint64_t started_ = 0;
  uint64_t fail_copy_ = ~uint64_t{0};
  Status failure_;
  int host_buffers_ = 0;
  int checksums_ = 0;
};

}  // namespace keel::testing
