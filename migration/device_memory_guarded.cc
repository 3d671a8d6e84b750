// CreateGuardedHostMemory: "device" buffers that the CPU cannot touch. Each allocation is a
// memory file (memfd) mapped twice: the PROT_NONE view is the address callers get, the read-write
// view is reached only by translating an address inside this object's calls. A stray host access
// to a device buffer anywhere in Keel therefore faults at once, as it would on a GPU, instead of
// silently working on a machine without one.
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <map>
#include <mutex>
#include <string>

#include "keel/device_memory.hpp"
#include "kernels/add.h"
#include "kernels/checksum.h"

namespace keel {
namespace {

class GuardedHostMemory final : public DeviceMemory {
 public:
  ~GuardedHostMemory() override {
    for (const auto& [guarded, block] : blocks_) Unmap(guarded, block);
  }

  bool IsDeviceMemory(const void* data) override {
    std::lock_guard<std::mutex> lock(mutex_);
    return Find(data) != nullptr;
  }

  Result<std::byte*> AllocateDevice(size_t bytes) override {
    const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    // Never empty, so every buffer has an address of its own.
    const size_t mapped = (bytes / page + 1) * page;
    const int fd = memfd_create("keel-guarded-device", MFD_CLOEXEC);
    if (fd < 0) return SystemError("memfd_create");
    if (ftruncate(fd, static_cast<off_t>(mapped)) != 0) {
      close(fd);
      return SystemError("ftruncate of a " + std::to_string(mapped) + "-byte memory file");
    }
    void* guarded = mmap(nullptr, mapped, PROT_NONE, MAP_SHARED, fd, 0);
    void* open = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    const Status failed = guarded == MAP_FAILED || open == MAP_FAILED
                              ? SystemError("mmap of a " + std::to_string(mapped) + "-byte buffer")
                              : Status::Ok();
    close(fd);  // the mappings keep the file
    if (!failed.ok()) {
      if (guarded != MAP_FAILED) munmap(guarded, mapped);
      if (open != MAP_FAILED) munmap(open, mapped);
      return failed;
    }
    std::lock_guard<std::mutex> lock(mutex_);
    blocks_[static_cast<std::byte*>(guarded)] = {static_cast<std::byte*>(open), bytes, mapped};
    return static_cast<std::byte*>(guarded);
  }

  void FreeDevice(std::byte* data) override {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = blocks_.find(data);
    if (it == blocks_.end()) return;
    Unmap(it->first, it->second);
    blocks_.erase(it);
  }

  Result<std::byte*> AllocateHost(size_t bytes) override {
    return new std::byte[bytes == 0 ? 1 : bytes];
  }
  void FreeHost(std::byte* data) override { delete[] data; }

  Result<uint64_t> StartCopy(std::byte* destination, const std::byte* source,
                             size_t bytes) override {
    std::lock_guard<std::mutex> lock(mutex_);
    KEEL_ASSIGN_OR_RETURN(std::byte * to, Translate(destination, bytes, "destination", false));
    KEEL_ASSIGN_OR_RETURN(std::byte * from, Translate(source, bytes, "source", false));
    if (bytes > 0) std::memmove(to, from, bytes);
    return started_++;
  }

  Result<uint64_t> StartAdd(GradientType type, std::byte* acc, const std::byte* source,
                            size_t bytes) override {
    std::lock_guard<std::mutex> lock(mutex_);
    KEEL_ASSIGN_OR_RETURN(std::byte * to, Translate(acc, bytes, "acc", true));
    KEEL_ASSIGN_OR_RETURN(std::byte * from, Translate(source, bytes, "source", true));
    KEEL_RETURN_IF_ERROR(kernels::cpu::AddInto(type, to, from, static_cast<int64_t>(bytes)));
    return started_++;
  }

  Result<uint64_t> CompletedCopies() override {
    std::lock_guard<std::mutex> lock(mutex_);
    return started_;
  }

  Result<uint64_t> Checksum(const std::byte* data, size_t bytes) override {
    std::lock_guard<std::mutex> lock(mutex_);
    KEEL_ASSIGN_OR_RETURN(std::byte * open, Translate(data, bytes, "data", true));
    return kernels::cpu::Checksum64({open, bytes});
  }

 private:
  struct Block {
    std::byte* open = nullptr;  // the read-write view
    size_t bytes = 0;           // as allocated
    size_t mapped = 0;          // whole pages
  };

  static Status SystemError(const std::string& what) {
    return Internal("guarded host memory: " + what + " failed: " + std::strerror(errno));
  }
  static void Unmap(std::byte* guarded, const Block& block) {
    munmap(guarded, block.mapped);
    munmap(block.open, block.mapped);
  }

  // The block whose guarded view holds `data`, or null.
  const std::pair<std::byte* const, Block>* Find(const void* data) const {
    const auto* p = static_cast<const std::byte*>(data);
    auto it = blocks_.upper_bound(const_cast<std::byte*>(p));
    if (it == blocks_.begin()) return nullptr;
    --it;
    return p < it->first + it->second.mapped ? &*it : nullptr;
  }

  // Where the CPU may access [data, data + bytes): the read-write view for device memory, `data`
  // itself for host memory (unless `device_only`).
  Result<std::byte*> Translate(const std::byte* data, size_t bytes, const char* name,
                               bool device_only) const {
    const auto* block = Find(data);
    if (block == nullptr) {
      if (device_only) {
        return InvalidArgument(std::string("guarded host memory: ") + name +
                               " is not device memory of this object");
      }
      return const_cast<std::byte*>(data);
    }
    const size_t offset = static_cast<size_t>(data - block->first);
    if (offset > block->second.bytes || bytes > block->second.bytes - offset) {
      return InvalidArgument(std::string("guarded host memory: ") + name + " + " +
                             std::to_string(bytes) + " bytes runs past the end of its buffer");
    }
    return block->second.open + offset;
  }

  std::mutex mutex_;                    // guards everything below
  std::map<std::byte*, Block> blocks_;  // by the guarded view's address
  uint64_t started_ = 0;
};

}  // namespace

Result<std::shared_ptr<DeviceMemory>> CreateGuardedHostMemory() {
  return std::shared_ptr<DeviceMemory>(std::make_shared<GuardedHostMemory>());
}

}  // namespace keel
