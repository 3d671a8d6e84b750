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

// A buffer of a DeviceMemory that grows to the largest size asked of it; the engine keeps it
// between steps. kDevice: device memory. kPageLockedHost: host memory that device copies read and
// write at full speed (on an H200, 51 GB/s against 13-17 GB/s into pageable memory).
class DeviceBuffer {
 public:
  enum class Kind { kDevice, kPageLockedHost };
  explicit DeviceBuffer(Kind kind = Kind::kDevice) : kind_(kind) {}
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() { Free(); }
  // At least `bytes` bytes of `memory` (the contents are lost when it grows).
  Status Reserve(DeviceMemory& memory, size_t bytes);
  std::byte* data() const { return data_; }

 private:
  void Free();

  Kind kind_;
  DeviceMemory* memory_ = nullptr;
  std::byte* data_ = nullptr;
  size_t size_ = 0;
};

// Waits for the last of a run of device operations (none: nothing to wait for).
inline Status WaitForLast(DeviceMemory& memory, std::optional<uint64_t> last) {
  return last.has_value() ? memory.WaitFor(*last) : Status::Ok();
}

// Slot bytes for each peer (registered buffers, which may be device memory) sent in one
// AllToAllV, and read back per peer front to back, in an order both sides derive from the same
// plan. The engine keeps one and reuses its buffers exchange after exchange: host buffers
// allocated per exchange would be faulted in page by page every time. The send buffer is
// page-locked, so gathering device slots into it runs at the device's full copy speed.
class SlotExchange {
 public:
  // Starts an exchange among `num_ranks` ranks: forgets what was queued and received before.
  void Begin(int num_ranks);
  // Queues `size` bytes at `data` for `peer`; `data` must stay valid until Run returns.
  void Add(int peer, const void* data, size_t size);
  // Gathers the queued bytes through `memory` into the host send buffer and exchanges them.
  Status Run(Communicator& communicator, DeviceMemory& memory);

  // The next `size` bytes received from `peer`, in host memory.
  const std::byte* Next(int peer, size_t size) { return recv_.data() + Advance(peer, size); }
  // Makes everything received readable by `memory`'s operations (NextForDevice): a copy in its
  // device memory when `on_device`, else the received host bytes themselves.
  Status ShareReceived(DeviceMemory& memory, bool on_device);
  // The next `size` bytes from `peer`, where ShareReceived put them.
  const std::byte* NextForDevice(int peer, size_t size) { return shared_ + Advance(peer, size); }

 private:
  struct Part {
    const std::byte* data;
    size_t size;
  };
  size_t Advance(int peer, size_t size) {
    const size_t at = offset_[peer] + consumed_[peer];
    consumed_[peer] += size;
    return at;
  }

  std::vector<std::vector<Part>> parts_;  // [peer]
  DeviceBuffer send_{DeviceBuffer::Kind::kPageLockedHost};
  std::vector<size_t> send_bytes_;  // [peer]
  std::vector<std::byte> recv_;
  std::vector<size_t> recv_bytes_;  // [peer]
  std::vector<size_t> offset_;      // [peer] where its bytes start in recv_
  std::vector<size_t> consumed_;    // [peer] how many of them Next took
  DeviceBuffer received_on_device_;
  const std::byte* shared_ = nullptr;  // recv_ or received_on_device_ (ShareReceived)
};

}  // namespace keel
