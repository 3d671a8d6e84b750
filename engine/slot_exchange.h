// How the engine moves slot bytes between ranks outside migration (transient fills, weight
// pushes, replica gradients): gathered from the registered buffers through DeviceMemory into one
// host buffer, exchanged with one AllToAllV, and read back per peer in the order both sides derive
// from the same plan. Device memory is only ever reached through DeviceMemory.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

#include "keel/communicator.hpp"
#include "keel/device_memory.hpp"
#include "keel/status.hpp"

namespace keel {

// A device buffer that grows to the largest size asked of it; the engine keeps it between steps.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() {
    if (data_ != nullptr) memory_->FreeDevice(data_);
  }
  // At least `bytes` bytes of `memory` (the contents are lost when it grows).
  Status Reserve(DeviceMemory& memory, size_t bytes);
  std::byte* data() const { return data_; }

 private:
  DeviceMemory* memory_ = nullptr;
  std::byte* data_ = nullptr;
  size_t size_ = 0;
};

// Waits for the last of a run of device operations (none: nothing to wait for).
inline Status WaitForLast(DeviceMemory& memory, std::optional<uint64_t> last) {
  return last.has_value() ? memory.WaitFor(*last) : Status::Ok();
}

// What every rank received from every peer in one AllToAllV, consumed front to back per peer.
class PeerReader {
 public:
  // The next `size` bytes from `peer`, in host memory.
  const std::byte* Next(int peer, size_t size) { return recv_.data() + Advance(peer, size); }
  // The same bytes in the device copy of everything received (CopyToDevice).
  const std::byte* NextOnDevice(int peer, size_t size) { return device_ + Advance(peer, size); }
  // Copies everything received into `buffer` (device memory, resized to fit) for NextOnDevice.
  Status CopyToDevice(DeviceMemory& memory, DeviceBuffer& buffer) {
    KEEL_RETURN_IF_ERROR(buffer.Reserve(memory, recv_.size()));
    device_ = buffer.data();
    return memory.Copy(device_, recv_.data(), recv_.size());
  }

  std::vector<std::byte> recv_;
  std::vector<size_t> recv_bytes_;
  std::vector<size_t> offset_;
  std::vector<size_t> consumed_;

 private:
  size_t Advance(int peer, size_t size) {
    const size_t at = offset_[peer] + consumed_[peer];
    consumed_[peer] += size;
    return at;
  }
  std::byte* device_ = nullptr;
};

// Slot bytes for each peer (registered buffers, which may be device memory), sent in one
// AllToAllV in an order both sides derive from the same plan.
class PeerSends {
 public:
  explicit PeerSends(int num_ranks) : parts_(num_ranks) {}
  void Add(int peer, const void* data, size_t size) {
    parts_[peer].push_back({static_cast<const std::byte*>(data), size});
  }

  // Gathers the parts into one host buffer through `memory` and exchanges it.
  Result<PeerReader> Exchange(Communicator& communicator, DeviceMemory& memory) const;

 private:
  struct Part {
    const std::byte* data;
    size_t size;
  };
  std::vector<std::vector<Part>> parts_;  // [peer]
};

}  // namespace keel
