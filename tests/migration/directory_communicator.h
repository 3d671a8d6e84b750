// A Communicator for tests that launch their own processes: ranks exchange files in a shared
// directory (write, then rename into place; readers poll). No socket service and no launcher
// that tears the job down when one rank dies, which the fault-injection tests need.
#pragma once

#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "migration/communicator.h"

namespace keel::testing {

class DirectoryCommunicator final : public Communicator {
 public:
  DirectoryCommunicator(std::string directory, int rank, int size, double timeout_seconds = 30)
      : directory_(std::move(directory)), rank_(rank), size_(size), timeout_(timeout_seconds) {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }

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
                           std::chrono::duration<double>(timeout_));
    for (int r = 0; r < size_; ++r) {
      const std::string path = base + std::to_string(r);
      while (!std::filesystem::exists(path)) {
        if (std::chrono::steady_clock::now() > limit) {
          return Status(StatusCode::kDeadlineExceeded,
                        "rank " + std::to_string(r) + " did not join all-gather round " +
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

 private:
  std::string directory_;
  int rank_;
  int size_;
  double timeout_;
  int round_ = 0;
};

}  // namespace keel::testing
