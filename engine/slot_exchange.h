// How the engine moves slot bytes between ranks outside migration (transient fills, weight
// pushes, replica gradients, resharding): gathered from the registered buffers through
// DeviceMemory, exchanged in one collective whose sizes both sides derive from the same plan (so
// no sizes travel first), and read back per peer in that plan's order. With device slot buffers
// and a communicator that moves device memory, the bytes go device to device; otherwise they are
// staged through page-locked host memory. Device memory is only ever reached through DeviceMemory.
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

// One exchange of slot bytes among all ranks, collective. Between Begin and Run each rank queues
// what it sends (Add) and declares what it will read (Expect), both per peer in the order the
// plan gives, which every rank derives alike: what rank a Adds for rank b is exactly what b
// Expects from a. After Run, Received hands out the declared pieces in the declared order.
//
// The engine keeps one and reuses its buffers exchange after exchange: host buffers allocated
// per exchange would be faulted in page by page every time, and the host buffers are
// page-locked, so copies between them and device slots run at the device's full speed.
class SlotExchange {
 public:
  // Starts an exchange among `num_ranks` ranks: forgets what was queued, expected and received.
  void Begin(int num_ranks);
  // Queues `size` bytes at `data` (slot memory) for `peer`; `data` must stay valid until Run
  // returns.
  void Add(int peer, const void* data, size_t size);
  // Declares that the next piece read from `peer` has `size` bytes.
  void Expect(int peer, size_t size);

  // Gathers the queued bytes through `memory` and exchanges them. `on_device`: the slot buffers
  // are device memory, so Received must return device memory. With a communicator that moves
  // device memory the sends are gathered into a device buffer and received straight into
  // another; otherwise both sides are staged through page-locked host memory, and on a device the
  // whole received buffer is copied up in one piece.
  Status Run(Communicator& communicator, DeviceMemory& memory, bool on_device);

  // The next piece Expect declared for `peer`, which must have `size` bytes: memory that
  // `memory`'s operations (StartCopy, StartAdd) read, device memory when Run was `on_device`.
  // Internal when it is not the piece Expect declared next, so a read loop that strays from its
  // Expect pre-pass fails instead of reading another piece's bytes.
  Result<const std::byte*> Received(int peer, size_t size);

 private:
  struct Part {
    const std::byte* data;
    size_t size;
  };

  std::vector<std::vector<Part>> parts_;       // [peer] what this rank sends, in order
  std::vector<std::vector<size_t>> expected_;  // [peer] the sizes it reads, in order
  std::vector<size_t> send_bytes_;             // [peer]
  std::vector<size_t> recv_bytes_;             // [peer]
  std::vector<size_t> offset_;                 // [peer] where the next piece from it starts
  std::vector<size_t> pieces_read_;            // [peer] how many of expected_ Received took
  DeviceBuffer send_staging_{DeviceBuffer::Kind::kPageLockedHost};
  DeviceBuffer recv_staging_{DeviceBuffer::Kind::kPageLockedHost};
  DeviceBuffer send_on_device_;
  DeviceBuffer recv_on_device_;
  const std::byte* received_ = nullptr;  // recv_staging_ or recv_on_device_
};

}  // namespace keel
