// The engine's slot exchanges (slot_exchange.h).
#include "engine/slot_exchange.h"

#include <numeric>

namespace keel {

Status DeviceBuffer::Reserve(DeviceMemory& memory, size_t bytes) {
  if (data_ != nullptr && bytes <= size_ && memory_ == &memory) return Status::Ok();
  Free();
  memory_ = &memory;
  KEEL_ASSIGN_OR_RETURN(
      data_, kind_ == Kind::kDevice ? memory.AllocateDevice(bytes) : memory.AllocateHost(bytes));
  size_ = bytes;
  return Status::Ok();
}

void DeviceBuffer::Free() {
  if (data_ == nullptr) return;
  if (kind_ == Kind::kDevice) {
    memory_->FreeDevice(data_);
  } else {
    memory_->FreeHost(data_);
  }
  data_ = nullptr;
  size_ = 0;
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
  const size_t total = std::accumulate(send_bytes_.begin(), send_bytes_.end(), size_t{0});
  KEEL_RETURN_IF_ERROR(send_.Reserve(memory, total));
  std::optional<uint64_t> last;
  size_t at = 0;
  for (int r = 0; r < size; ++r) {
    for (const Part& part : parts_[r]) {
      KEEL_ASSIGN_OR_RETURN(last, memory.StartCopy(send_.data() + at, part.data, part.size));
      at += part.size;
    }
  }
  KEEL_RETURN_IF_ERROR(WaitForLast(memory, last));
  KEEL_RETURN_IF_ERROR(communicator.AllToAllV(std::span<const std::byte>(send_.data(), total),
                                              send_bytes_, recv_, recv_bytes_));
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
