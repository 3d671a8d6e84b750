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

void SlotExchange::Begin(int num_ranks) {
  parts_.resize(num_ranks);
  for (std::vector<Part>& parts : parts_) parts.clear();
}

void SlotExchange::Add(int peer, const void* data, size_t size) {
  parts_[peer].push_back({static_cast<const std::byte*>(data), size});
}

Status SlotExchange::Run(Communicator& communicator, DeviceMemory& memory) {
  const int size = communicator.size();
  send_bytes_.assign(size, 0);
  for (int r = 0; r < size; ++r) {
    for (const Part& part : parts_[r]) send_bytes_[r] += part.size;
  }
  send_.resize(std::accumulate(send_bytes_.begin(), send_bytes_.end(), size_t{0}));
  std::optional<uint64_t> last;
  size_t at = 0;
  for (int r = 0; r < size; ++r) {
    for (const Part& part : parts_[r]) {
      KEEL_ASSIGN_OR_RETURN(last, memory.StartCopy(send_.data() + at, part.data, part.size));
      at += part.size;
    }
  }
  KEEL_RETURN_IF_ERROR(WaitForLast(memory, last));
  KEEL_RETURN_IF_ERROR(communicator.AllToAllV(send_, send_bytes_, recv_, recv_bytes_));
  offset_.assign(size, 0);
  consumed_.assign(size, 0);
  for (int r = 1; r < size; ++r) offset_[r] = offset_[r - 1] + recv_bytes_[r - 1];
  return Status::Ok();
}

Status SlotExchange::ShareReceived(DeviceMemory& memory, bool on_device) {
  if (!on_device) {
    shared_ = recv_.data();
    return Status::Ok();
  }
  KEEL_RETURN_IF_ERROR(received_on_device_.Reserve(memory, recv_.size()));
  shared_ = received_on_device_.data();
  return memory.Copy(received_on_device_.data(), recv_.data(), recv_.size());
}

}  // namespace keel
