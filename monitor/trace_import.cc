// Importers for routing traces recorded by other systems: SmartMoE's per-rank tables, ESFT's
// per-sequence expert ids, OLMoE's per-domain counts and Megatron-LM's router tracer, one file
// each (trace_import_<format>.cc). Each turns its input into a keel::Trace and names the file,
// line and value it cannot use. This file tells the formats apart.
#include "monitor/trace_import.h"

#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <system_error>

#include "common/file.h"
#include "monitor/trace_files.h"

namespace keel {

using trace_files::EndsWith;
using trace_files::FolderEntry;
using trace_files::IsEsftTaskFolder;
using trace_files::IsFolder;
using trace_files::ListFolder;
namespace fs = std::filesystem;

namespace {

// The first line of a JSON Lines file as JSON (up to 1 MiB of it); null when it is not JSON. A
// file that cannot be read as a trace (a FIFO, a device, one beyond the limit) is an error here,
// before any format is guessed for it.
Result<nlohmann::json> FirstLine(const std::string& path) {
  KEEL_ASSIGN_OR_RETURN(InputFile file,
                        InputFile::Open(path, {.limit = InputLimit::kTraceFileBytes}));
  KEEL_ASSIGN_OR_RETURN(const std::string first, file.ReadFirstLine(1 << 20));
  try {
    return nlohmann::json::parse(first);
  } catch (const nlohmann::json::exception&) {
    return nlohmann::json(nullptr);
  }
}

// True when `first`, a JSON Lines file's first line, is a Keel header.
bool IsKeelHeader(const nlohmann::json& first) {
  return first.is_object() && first.contains("keel_trace");
}

// True when `first` is a Keel step line: a Keel trace that lost its header.
bool IsKeelStep(const nlohmann::json& first) {
  return first.is_object() && first.contains("step") && first.contains("layers") &&
         !first.contains("layer");
}

}  // namespace

Result<TraceFormat> DetectTraceFormat(const std::string& path) {
  std::error_code error;
  if (!fs::exists(path, error)) return NotFound(path + ": no such file or directory");
  if (IsFolder(path)) {
    bool has_tar = false;
    bool has_esft = false;
    bool has_megatron = false;
    bool has_olmoe = false;
    for (const FolderEntry& entry : ListFolder(path)) {
      const std::string& name = entry.name;
      if (name.starts_with("table_iter") && name.find("_rank") != std::string::npos &&
          EndsWith(name, ".log")) {
        return TraceFormat::kSmartMoe;
      }
      if (name == "moe_trace" && entry.is_directory) return TraceFormat::kSmartMoe;
      has_tar |= EndsWith(name, ".tar.xz");
      has_esft |= name.starts_with("expert_weights_") && EndsWith(name, ".txt");
      has_esft |= entry.is_directory && IsEsftTaskFolder(entry.path);
      has_megatron |= name.starts_with("router_trace_rank") && EndsWith(name, ".jsonl");
      has_olmoe |= name == "expert_counts_derived.json";
    }
    if (has_tar) return TraceFormat::kSmartMoe;
    if (has_esft) return TraceFormat::kEsft;
    if (has_megatron) return TraceFormat::kMegatron;
    if (has_olmoe) return TraceFormat::kOlmoe;
  } else {
    std::string name = fs::path(path).filename().string();
    if (EndsWith(name, ".tar.xz")) return TraceFormat::kSmartMoe;
    if (EndsWith(name, ".jsonl")) {
      KEEL_ASSIGN_OR_RETURN(const nlohmann::json first, FirstLine(path));
      if (IsKeelHeader(first)) return TraceFormat::kKeel;
      if (IsKeelStep(first)) {
        return InvalidArgument(path +
                               ": its first line is a Keel trace step (\"step\" and \"layers\") "
                               "but the header line {\"keel_trace\": 1, \"num_layers\": ..., "
                               "\"num_experts\": ..., \"num_sources\": ...} is missing");
      }
      return TraceFormat::kMegatron;
    }
    if (name == "expert_counts_derived.json") return TraceFormat::kOlmoe;
  }
  return InvalidArgument(
      path +
      ": cannot tell the trace format; pass --format with one of keel, smartmoe, esft, "
      "olmoe, megatron (keel: .jsonl with a keel_trace header; smartmoe: folder of "
      "table_iter*_rank*.log or a .tar.xz of it; esft: folder of expert_weights_*.txt; olmoe: "
      "expert_counts_derived.json; megatron: router_trace_rank*.jsonl)");
}

}  // namespace keel
