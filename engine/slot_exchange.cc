// The engine's slot exchanges (slot_exchange.h).
#include "engine/slot_exchange.h"

#include <numeric>

namespace keel {

Status DeviceBuffer::Reserve(DeviceMemory& memory, size_t bytes) {
  if (data_ != nullptr && bytes <= size_) return Status::Ok();
  if (data_ != nullptr) memory_->FreeDevice(data_);
  data_ = nullptr;
  memory_ = &memory;
  KEEL_ASSIGN_OR_RETURN(data_, memory.AllocateDevice(bytes));
  size_ = bytes;
  return Status::Ok();
}

Result<PeerReader> PeerSends::Exchange(Communicator& communicator, DeviceMemory& memory) const {
  const int size = communicator.size();
  std::vector<size_t> send_bytes(size, 0);
  for (int r = 0; r < size; ++r) {
    for (const Part& part : parts_[r]) send_bytes[r] += part.size;
  }
  std::vector<std::byte> send(std::accumulate(send_bytes.begin(), send_bytes.end(), size_t{0}));
  std::optional<uint64_t> last;
  size_t at = 0;
  for (int r = 0; r < size; ++r) {
    for (const Part& part : parts_[r]) {
      KEEL_ASSIGN_OR_RETURN(last, memory.StartCopy(send.data() + at, part.data, part.size));
      at += part.size;
    }
  }
  KEEL_RETURN_IF_ERROR(WaitForLast(memory, last));
  PeerReader reader;
  KEEL_RETURN_IF_ERROR(communicator.AllToAllV(send, send_bytes, reader.recv_, reader.recv_bytes_));
  reader.offset_.assign(size, 0);
  reader.consumed_.assign(size, 0);
  for (int r = 1; r < size; ++r) {
    reader.offset_[r] = reader.offset_[r - 1] + reader.recv_bytes_[r - 1];
  }
  return reader;
}

}  // namespace keel
