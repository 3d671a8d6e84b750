// The MPI communicator: MPI_Allgather of sizes, then MPI_Allgatherv of the bytes.
#include <mpi.h>

#include <numeric>

#include "migration/communicator.h"

namespace keel {
namespace {

Status MpiError(const char* call, int code) {
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  MPI_Error_string(code, text, &length);
  return Internal(std::string(call) + " failed: " + std::string(text, length));
}

class MpiCommunicator final : public Communicator {
 public:
  MpiCommunicator(int rank, int size) : rank_(rank), size_(size) {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }

  Result<std::vector<std::string>> AllGather(std::string_view mine) override {
    int length = static_cast<int>(mine.size());
    std::vector<int> lengths(size_);
    int rc = MPI_Allgather(&length, 1, MPI_INT, lengths.data(), 1, MPI_INT, MPI_COMM_WORLD);
    if (rc != MPI_SUCCESS) return MpiError("MPI_Allgather", rc);
    std::vector<int> offsets(size_, 0);
    std::exclusive_scan(lengths.begin(), lengths.end(), offsets.begin(), 0);
    std::string all(static_cast<size_t>(offsets.back() + lengths.back()), '\0');
    rc = MPI_Allgatherv(mine.data(), length, MPI_CHAR, all.data(), lengths.data(), offsets.data(),
                        MPI_CHAR, MPI_COMM_WORLD);
    if (rc != MPI_SUCCESS) return MpiError("MPI_Allgatherv", rc);
    std::vector<std::string> out(size_);
    for (int r = 0; r < size_; ++r) out[r] = all.substr(offsets[r], lengths[r]);
    return out;
  }

  Status Barrier() override {
    const int rc = MPI_Barrier(MPI_COMM_WORLD);
    return rc == MPI_SUCCESS ? Status::Ok() : MpiError("MPI_Barrier", rc);
  }

 private:
  int rank_;
  int size_;
};

}  // namespace

Result<std::unique_ptr<Communicator>> CreateMpiCommunicator() {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) return FailedPrecondition("MPI is not initialized (call MPI_Init first)");
  int rank = 0;
  int size = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  return std::unique_ptr<Communicator>(new MpiCommunicator(rank, size));
}

}  // namespace keel
