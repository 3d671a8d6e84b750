// A Communicator for tests that launch their own processes: ranks exchange files in a shared
// directory (write, then rename into place; readers poll). No socket service and no launcher
// that tears the job down when one rank dies, which the fault-injection tests need.
#pragma once

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "comm/communicator.h"

namespace keel::testing {

class DirectoryCommunicator final : public Communicator {
 public:
  DirectoryCommunicator(std::string directory, int rank, int size, double timeout_seconds = 30)
      : directory_(std::move(directory)), rank_(rank), size_(size) {
    set_timeout_seconds(timeout_seconds);
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string_view name() const override { return "directory"; }

  Result<std::vector<std::string>> AllGather(std::string_view mine) override {
    const int round = round_++;
    const std::string base = directory_ + "/round" + std::to_string(round) + ".rank";
    {
      const std::string tmp = base + std::to_string(rank_) + ".tmp";
      std::ofstream out(tmp, std::ios::binary);
      out.write(mine.data(), static_cast<std::streamsize>(mine.size()));
      out.close();
      if (!out) return IoError("cannot write " + tmp);
      std::filesystem::rename(tmp, base + std::to_string(rank_));
    }
    std::vector<std::string> all(size_);
    const auto limit = std::chrono::steady_clock::now() +
                       std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                           std::chrono::duration<double>(timeout_seconds()));
    for (int r = 0; r < size_; ++r) {
      const std::string path = base + std::to_string(r);
      while (!std::filesystem::exists(path)) {
        if (std::chrono::steady_clock::now() > limit) {
          return DeadlineExceeded("rank " + std::to_string(r) + " did not join all-gather round " +
                                  std::to_string(round) + " in " + directory_);
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      std::ifstream in(path, std::ios::binary);
      std::stringstream content;
      content << in.rdbuf();
      all[r] = content.str();
    }
    return all;
  }

  Status Barrier() override { return AllGather("").status(); }

  // The other collectives ride on AllGather: slow, but these tests move little through them.
  Status AllReduce(std::span<int64_t> values, ReduceOp op) override { return Reduce(values, op); }
  Status AllReduce(std::span<double> values, ReduceOp op) override { return Reduce(values, op); }

  Status Broadcast(std::string& bytes, int root) override {
    KEEL_RETURN_IF_ERROR(collective::CheckRoot(name(), size_, root));
    KEEL_ASSIGN_OR_RETURN(auto all, AllGather(rank_ == root ? bytes : std::string()));
    bytes = std::move(all[root]);
    return Status::Ok();
  }

  // Every rank gathers every send buffer, prefixed by its [size] slice lengths.
  Status AllToAllV(std::span<const std::byte> send, std::span<const size_t> send_bytes,
                   std::vector<std::byte>& recv, std::vector<size_t>& recv_bytes) override {
    KEEL_RETURN_IF_ERROR(collective::CheckAllToAllV(name(), size_, send.size(), send_bytes));
    std::string mine(send_bytes.size_bytes() + send.size(), '\0');
    std::memcpy(mine.data(), send_bytes.data(), send_bytes.size_bytes());
    if (!send.empty()) std::memcpy(mine.data() + send_bytes.size_bytes(), send.data(), send.size());
    KEEL_ASSIGN_OR_RETURN(auto all, AllGather(mine));
    recv.clear();
    recv_bytes.assign(size_, 0);
    for (int r = 0; r < size_; ++r) {
      std::vector<size_t> lengths(size_);
      std::memcpy(lengths.data(), all[r].data(), sizeof(size_t) * size_);
      size_t offset = sizeof(size_t) * size_;
      for (int to = 0; to < rank_; ++to) offset += lengths[to];
      const auto* slice = reinterpret_cast<const std::byte*>(all[r].data()) + offset;
      recv.insert(recv.end(), slice, slice + lengths[rank_]);
      recv_bytes[r] = lengths[rank_];
    }
    return Status::Ok();
  }

 private:
  template <typename T>
  Status Reduce(std::span<T> values, ReduceOp op) {
    KEEL_ASSIGN_OR_RETURN(auto all,
                          AllGather(std::string_view(reinterpret_cast<const char*>(values.data()),
                                                     values.size_bytes())));
    std::vector<T> gathered(values.size() * size_);
    for (int r = 0; r < size_; ++r) {
      if (all[r].size() != values.size_bytes()) {
        return InvalidArgument("directory AllReduce: values.size() is " +
                               std::to_string(all[r].size() / sizeof(T)) + " on rank " +
                               std::to_string(r) + " but " + std::to_string(values.size()) +
                               " on rank " + std::to_string(rank_));
      }
      if (!values.empty()) {
        std::memcpy(gathered.data() + values.size() * r, all[r].data(), all[r].size());
      }
    }
    collective::FoldInRankOrder(gathered, op, values);
    return Status::Ok();
  }

  std::string directory_;
  int rank_;
  int size_;
  int round_ = 0;
};

}  // namespace keel::testing
