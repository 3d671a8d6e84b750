// libFuzzer target: the trace readers. The first byte picks the format (keel, megatron, olmoe,
// esft, smartmoe); the rest becomes the file that format reads, in a folder of this process's
// own. Any input must come back as a trace or as an error; a trace must pass Validate, and a Keel
// trace must read back the same after it is written.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>

#include "keel/trace.hpp"
#include "monitor/trace.h"
#include "monitor/trace_import.h"

namespace {

namespace fs = std::filesystem;

// A scratch folder per process, emptied for every input and removed when the run ends.
const fs::path& Scratch() {
  static const fs::path folder = [] {
    std::string pattern = (fs::temp_directory_path() / "keel-trace-fuzz-XXXXXX").string();
    if (::mkdtemp(pattern.data()) == nullptr) std::abort();
    std::atexit([] {
      std::error_code ignored;
      fs::remove_all(Scratch(), ignored);
    });
    return fs::path(pattern);
  }();
  return folder;
}

void Write(const fs::path& path, const uint8_t* data, size_t size) {
  std::FILE* file = std::fopen(path.c_str(), "wb");
  if (file == nullptr) std::abort();
  if (size > 0 && std::fwrite(data, 1, size, file) != size) std::abort();
  std::fclose(file);
}

keel::Result<keel::Trace> Read(uint8_t format, const uint8_t* data, size_t size) {
  const fs::path& folder = Scratch();
  switch (format % 5) {
    case 0:
      Write(folder / "t.jsonl", data, size);
      return keel::ReadKeelTrace((folder / "t.jsonl").string());
    case 1:
      Write(folder / "router_trace_rank0.jsonl", data, size);
      return keel::ImportMegatronTrace((folder / "router_trace_rank0.jsonl").string());
    case 2:
      Write(folder / "expert_counts_derived.json", data, size);
      return keel::ImportOlmoeTrace((folder / "expert_counts_derived.json").string());
    case 3:
      Write(folder / "expert_weights_1.txt", data, size);
      return keel::ImportEsftTrace(folder.string());
    default:
      Write(folder / "table_iter1_rank0.log", data, size);
      return keel::ImportSmartMoeTrace(folder.string());
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  std::error_code ignored;
  for (const auto& entry : fs::directory_iterator(Scratch(), ignored)) fs::remove(entry, ignored);
  keel::Result<keel::Trace> trace = Read(data[0], data + 1, size - 1);
  if (!trace.ok()) return 0;
  if (!trace->Validate().ok()) std::abort();
  if (data[0] % 5 == 0) {
    const std::string copy = (Scratch() / "copy.jsonl").string();
    if (!keel::WriteKeelTrace(*trace, copy).ok()) std::abort();
    keel::Result<keel::Trace> again = keel::ReadKeelTrace(copy);
    if (!again.ok() || again->steps != trace->steps || again->step_ids != trace->step_ids) {
      std::abort();
    }
  }
  return 0;
}
