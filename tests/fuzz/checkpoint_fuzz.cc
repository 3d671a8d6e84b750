// libFuzzer target: the checkpoint readers. The first byte picks one:
// - the engine's state (EngineStateFromJson): a state that parses must write back as JSON that
//   parses to the same state;
// - an expert file (CheckExpertFile), checked against the fields a slot expects, taken from the
//   next bytes: a file that is accepted as version 2 must be exactly a header for those fields
//   followed by the payload (its header rewritten for the same fields gives the same bytes), and
//   one flipped bit in its header must be refused.
#include <fuzzer/FuzzedDataProvider.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <span>
#include <string>
#include <string_view>

#include "engine/expert_file.h"
#include "keel/engine.hpp"

namespace {

void CheckState(std::string_view text) {
  keel::Result<keel::EngineState> state = keel::EngineStateFromJson(text);
  if (!state.ok()) return;
  keel::Result<keel::EngineState> again =
      keel::EngineStateFromJson(keel::EngineStateToJson(*state));
  if (!again.ok() || again->epoch != state->epoch || again->phy2log != state->phy2log ||
      again->home != state->home || again->shards != state->shards) {
    std::abort();
  }
}

void CheckExpert(FuzzedDataProvider& in) {
  keel::ExpertFileFields expected;
  expected.layer = in.ConsumeIntegralInRange<int32_t>(-1, 3);
  expected.expert = in.ConsumeIntegralInRange<int32_t>(-1, 3);
  expected.shards = in.ConsumeIntegralInRange<int32_t>(1, 3);
  expected.shard = in.ConsumeIntegralInRange<int32_t>(0, expected.shards - 1);
  expected.weight_element_bytes = in.ConsumeIntegralInRange<uint32_t>(0, 4);
  expected.weight_bytes = in.ConsumeIntegralInRange<uint64_t>(0, 64);
  expected.optimizer_bytes = in.ConsumeIntegralInRange<uint64_t>(0, 64);
  const bool well_formed = in.ConsumeBool();
  std::string file = in.ConsumeRemainingBytesAsString();
  if (well_formed) {
    // A header written for the expected fields over the input's payload: reaches the checks
    // past the checksum, which random bytes never pass.
    file.resize(keel::kExpertFileHeaderBytes + expected.weight_bytes + expected.optimizer_bytes);
    keel::WriteExpertFileHeader(expected, std::as_writable_bytes(std::span(file)));
  }
  keel::Result<keel::ExpertFilePayload> payload = keel::CheckExpertFile("fuzz", file, expected);
  if (!payload.ok()) return;
  if (payload->offset > file.size()) std::abort();
  if (payload->version != 2) return;
  std::string rewritten = file;
  keel::WriteExpertFileHeader(expected, std::as_writable_bytes(std::span(rewritten)));
  if (rewritten != file) std::abort();
  // A flipped bit of the header is caught: a field that differs from the expected one, or the
  // recorded checksum. (Flips in the payload are caught by the checksum, which is not a proof
  // against every pattern: kernels/checksum.h.)
  for (size_t bit = 0; bit < keel::kExpertFileHeaderBytes * 8; ++bit) {
    std::string flipped = file;
    flipped[bit / 8] = static_cast<char>(flipped[bit / 8] ^ (1 << (bit % 8)));
    if (keel::CheckExpertFile("fuzz", flipped, expected).ok()) std::abort();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  if (data[0] % 2 == 0) {
    CheckState(std::string_view(reinterpret_cast<const char*>(data + 1), size - 1));
  } else {
    FuzzedDataProvider in(data + 1, size - 1);
    CheckExpert(in);
  }
  return 0;
}
