// The engine's slot exchanges (slot_exchange.h).
#include "engine/slot_exchange.h"

#include <numeric>
#include <string>

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
  expected_.resize(num_ranks);
  for (std::vector<size_t>& sizes : expected_) sizes.clear();
  received_ = nullptr;
}

void SlotExchange::Add(int peer, const void* data, size_t size) {
  parts_[peer].push_back({static_cast<const std::byte*>(data), size});
}

void SlotExchange::Expect(int peer, size_t size) { expected_[peer].push_back(size); }

Status SlotExchange::Run(Communicator& communicator, DeviceMemory& memory, bool on_device) {
  const int size = communicator.size();
  send_bytes_.assign(size, 0);
  recv_bytes_.assign(size, 0);
  for (int r = 0; r < size; ++r) {
    for (const Part& part : parts_[r]) send_bytes_[r] += part.size;
    for (size_t piece : expected_[r]) recv_bytes_[r] += piece;
  }
  const size_t send_total = std::accumulate(send_bytes_.begin(), send_bytes_.end(), size_t{0});
  const size_t recv_total = std::accumulate(recv_bytes_.begin(), recv_bytes_.end(), size_t{0});
  offset_.assign(size, 0);
  pieces_read_.assign(size, 0);
  std::exclusive_scan(recv_bytes_.begin(), recv_bytes_.end(), offset_.begin(), size_t{0});

  // Device to device when the communicator can; the host staging otherwise.
  const bool direct = on_device && communicator.MovesDeviceMemory();
  DeviceBuffer& send = direct ? send_on_device_ : send_staging_;
  KEEL_RETURN_IF_ERROR(send.Reserve(memory, send_total));
  std::optional<uint64_t> last;
  size_t at = 0;
  for (int r = 0; r < size; ++r) {
    for (const Part& part : parts_[r]) {
      KEEL_ASSIGN_OR_RETURN(last, memory.StartCopy(send.data() + at, part.data, part.size));
      at += part.size;
    }
  }
  KEEL_RETURN_IF_ERROR(WaitForLast(memory, last));
  if (direct) {
    KEEL_RETURN_IF_ERROR(recv_on_device_.Reserve(memory, recv_total));
    KEEL_RETURN_IF_ERROR(communicator.AllToAllVDevice(send.data(), send_bytes_,
                                                      recv_on_device_.data(), recv_bytes_));
    received_ = recv_on_device_.data();
    return Status::Ok();
  }
  KEEL_RETURN_IF_ERROR(recv_staging_.Reserve(memory, recv_total));
  KEEL_RETURN_IF_ERROR(communicator.AllToAllVKnownSizes(
      std::span<const std::byte>(send.data(), send_total), send_bytes_,
      std::span<std::byte>(recv_staging_.data(), recv_total), recv_bytes_));
  if (!on_device) {
    received_ = recv_staging_.data();
    return Status::Ok();
  }
  // One copy up for everything received: the readers' copies and sums then run device to
  // device, and sums (StartAdd) read device memory only.
  KEEL_RETURN_IF_ERROR(recv_on_device_.Reserve(memory, recv_total));
  received_ = recv_on_device_.data();
  return recv_total == 0 ? Status::Ok()
                         : memory.Copy(recv_on_device_.data(), recv_staging_.data(), recv_total);
}

Result<const std::byte*> SlotExchange::Received(int peer, size_t size) {
  if (received_ == nullptr) return Internal("slot exchange: Received before a successful Run");
  const std::vector<size_t>& expected = expected_[peer];
  const size_t piece = pieces_read_[peer];
  if (piece < expected.size() && expected[piece] == size) {
    ++pieces_read_[peer];
    const size_t at = offset_[peer];
    offset_[peer] += size;
    return received_ + at;
  }
  return Internal("slot exchange: piece " + std::to_string(piece) + " from rank " +
                  std::to_string(peer) + " read as " + std::to_string(size) +
                  " bytes, but Expect declared " +
                  (piece < expected.size() ? std::to_string(expected[piece]) + " bytes"
                                           : std::to_string(expected.size()) + " pieces"));
}

}  // namespace keel
