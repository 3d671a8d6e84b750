// SmartMoE's per-rank tables (table_iter{N}_rank{R}.log: per layer, every microbatch's count per
// expert), as a folder, a moe_trace/ folder or a .tar.xz of it, into a keel::Trace.
#include "monitor/trace_import.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <filesystem>
#include <optional>
#include <string_view>
#include <system_error>
#include <tuple>
#include <utility>
#include <vector>

#include "monitor/trace_archive.h"
#include "monitor/trace_files.h"

namespace keel {

using trace_files::EndsWith;
using trace_files::ExtractTarXz;
using trace_files::FolderEntry;
using trace_files::IsFolder;
using trace_files::ListFolder;
using trace_files::NumberBetween;
using trace_files::ReadTraceFile;
using trace_files::SplitLines;
using trace_files::TemporaryFolder;
namespace fs = std::filesystem;

namespace {

struct SmartMoeFile {
  int64_t iteration = 0;
  int64_t rank = 0;
  std::string path;
};

Result<std::vector<SmartMoeFile>> ListSmartMoeFiles(const std::string& folder) {
  std::vector<SmartMoeFile> files;
  for (const FolderEntry& entry : ListFolder(folder)) {
    const std::string& name = entry.name;
    size_t split = name.find("_rank");
    if (split == std::string::npos) continue;
    KEEL_ASSIGN_OR_RETURN(std::optional<int64_t> iteration,
                          NumberBetween(std::string_view(name).substr(0, split), "table_iter", ""));
    KEEL_ASSIGN_OR_RETURN(std::optional<int64_t> rank,
                          NumberBetween(std::string_view(name).substr(split), "_rank", ".log"));
    if (iteration && rank) files.push_back({*iteration, *rank, entry.path});
  }
  return files;
}

// A folder with a file that fails to list counts as SmartMoE, so that importing it says why.
bool HasSmartMoeFiles(const std::string& folder) {
  Result<std::vector<SmartMoeFile>> files = ListSmartMoeFiles(folder);
  return !files.ok() || !files->empty();
}

// A cursor over one SmartMoE table file; errors name the file, line and column.
class SmartMoeLineParser {
 public:
  SmartMoeLineParser(std::string_view line, std::string where)
      : line_(line), where_(std::move(where)) {}

  void SkipSpace() {
    while (pos_ < line_.size() && (line_[pos_] == ' ' || line_[pos_] == '\t')) ++pos_;
  }
  bool Consume(char c) {
    SkipSpace();
    if (pos_ < line_.size() && line_[pos_] == c) {
      ++pos_;
      return true;
    }
    return false;
  }
  Status Expect(char c) {
    if (Consume(c)) return Status::Ok();
    return Error(std::string("expected '") + c + "'");
  }
  Result<int64_t> Integer() {
    SkipSpace();
    int64_t value = 0;
    auto [end, error] = std::from_chars(line_.data() + pos_, line_.data() + line_.size(), value);
    if (error == std::errc::result_out_of_range) {
      return Error("integer " + std::string(line_.substr(pos_, end - line_.data() - pos_)) +
                   " does not fit in 64 bits");
    }
    if (error != std::errc()) return Error("expected an integer");
    pos_ = end - line_.data();
    return value;
  }
  Result<double> Number() {
    SkipSpace();
    double value = 0;
    auto [end, error] = std::from_chars(line_.data() + pos_, line_.data() + line_.size(), value);
    if (error == std::errc::result_out_of_range) {
      return Error("count " + std::string(line_.substr(pos_, end - line_.data() - pos_)) +
                   " is outside a double's range");
    }
    if (error != std::errc()) return Error("expected a number");
    if (!(value >= 0.0) || !std::isfinite(value)) {
      return Error("count " + std::string(line_.substr(pos_, end - line_.data() - pos_)) +
                   " is negative or not finite");
    }
    pos_ = end - line_.data();
    return value;
  }
  bool AtEnd() {
    SkipSpace();
    return pos_ == line_.size();
  }
  Status Error(const std::string& what) const {
    std::string near(line_.substr(pos_, 16));
    return InvalidArgument(where_ + ": column " + std::to_string(pos_ + 1) + ": " + what +
                           (near.empty() ? " at end of line" : " near '" + near + "'"));
  }

 private:
  std::string_view line_;
  std::string where_;
  size_t pos_ = 0;
};

// Parses `<layer>:[[c_0, ..., c_E-1], ...]` and adds its microbatches into
// counts[layer * stride + e].
Status ParseSmartMoeLine(std::string_view line, const std::string& where, int num_layers,
                         int num_experts, size_t stride, double* counts,
                         std::vector<bool>& seen_layers) {
  SmartMoeLineParser parser(line, where);
  KEEL_ASSIGN_OR_RETURN(int64_t layer, parser.Integer());
  if (layer < 0 || layer >= num_layers) {
    return parser.Error("layer " + std::to_string(layer) + " outside 0.." +
                        std::to_string(num_layers - 1));
  }
  if (seen_layers[layer]) return parser.Error("layer " + std::to_string(layer) + " repeated");
  seen_layers[layer] = true;
  KEEL_RETURN_IF_ERROR(parser.Expect(':'));
  KEEL_RETURN_IF_ERROR(parser.Expect('['));
  double* row = counts + static_cast<size_t>(layer) * stride;
  int microbatch = 0;
  do {
    KEEL_RETURN_IF_ERROR(parser.Expect('['));
    int expert = 0;
    if (!parser.Consume(']')) {
      do {
        KEEL_ASSIGN_OR_RETURN(double value, parser.Number());
        if (expert >= num_experts) {
          return parser.Error("microbatch " + std::to_string(microbatch) + " has more than " +
                              std::to_string(num_experts) + " experts");
        }
        row[expert++] += value;
      } while (parser.Consume(','));
      KEEL_RETURN_IF_ERROR(parser.Expect(']'));
    }
    if (expert != num_experts) {
      return parser.Error("microbatch " + std::to_string(microbatch) + " has " +
                          std::to_string(expert) + " experts, expected " +
                          std::to_string(num_experts));
    }
    ++microbatch;
  } while (parser.Consume(','));
  KEEL_RETURN_IF_ERROR(parser.Expect(']'));
  if (!parser.AtEnd()) return parser.Error("unexpected text after the lists");
  return Status::Ok();
}

// Learns the number of experts from the first list of the first line of `text`.
Result<int> SmartMoeExpertsOf(std::string_view first_line, const std::string& where) {
  size_t open = first_line.find("[[");
  if (open == std::string_view::npos) {
    return InvalidArgument(where + ": expected '<layer>:[[counts], ...]'");
  }
  size_t close = first_line.find(']', open);
  if (close == std::string_view::npos) return InvalidArgument(where + ": unterminated list");
  std::string_view list = first_line.substr(open + 2, close - open - 2);
  if (list.find_first_not_of(" \t") == std::string_view::npos) {
    return InvalidArgument(where + ": empty expert list");
  }
  return static_cast<int>(std::count(list.begin(), list.end(), ',') + 1);
}

Result<Trace> ImportSmartMoeFolder(const std::string& folder, const std::string& origin,
                                   const SmartMoeImportOptions& options) {
  KEEL_ASSIGN_OR_RETURN(std::vector<SmartMoeFile> files, ListSmartMoeFiles(folder));
  if (files.empty()) {
    return NotFound(folder + ": no table_iter{N}_rank{R}.log files (SmartMoE trace)");
  }
  std::sort(files.begin(), files.end(), [](const SmartMoeFile& a, const SmartMoeFile& b) {
    return std::tie(a.iteration, a.rank) < std::tie(b.iteration, b.rank);
  });
  std::vector<int64_t> iterations;
  int64_t max_rank = 0;
  for (const SmartMoeFile& file : files) {
    if (iterations.empty() || iterations.back() != file.iteration) {
      iterations.push_back(file.iteration);
    }
    max_rank = std::max(max_rank, file.rank);
  }
  const int num_sources = static_cast<int>(max_rank + 1);
  // Every iteration needs a table from every rank 0..max_rank.
  size_t index = 0;
  for (int64_t iteration : iterations) {
    for (int64_t rank = 0; rank <= max_rank; ++rank, ++index) {
      if (index >= files.size() || files[index].iteration != iteration ||
          files[index].rank != rank) {
        return NotFound(folder + ": table_iter" + std::to_string(iteration) + "_rank" +
                        std::to_string(rank) + ".log is missing (ranks 0.." +
                        std::to_string(max_rank) + " are expected for every iteration)");
      }
    }
  }

  // The first file fixes the number of layers (lines) and experts (entries per list).
  KEEL_ASSIGN_OR_RETURN(std::string first_text, ReadTraceFile(files[0].path));
  KEEL_ASSIGN_OR_RETURN(std::vector<std::string_view> first_lines,
                        SplitLines(first_text, files[0].path));
  if (first_lines.empty()) return InvalidArgument(files[0].path + ": empty table");
  KEEL_ASSIGN_OR_RETURN(int num_experts, SmartMoeExpertsOf(first_lines[0], files[0].path + ":1"));

  // Every table holds the first one's layers (lines, blank ones too) and experts, for every
  // rank and iteration: checked before the steps are allocated.
  KEEL_RETURN_IF_ERROR(CheckTraceShape(static_cast<int64_t>(first_lines.size()), num_experts,
                                       num_sources, static_cast<int64_t>(iterations.size()))
                           .WithContext(files[0].path));
  Trace trace;
  trace.num_layers = static_cast<int>(first_lines.size());
  trace.num_experts = num_experts;
  trace.num_sources = num_sources;
  trace.description = "smartmoe: " + origin + " (" + std::to_string(iterations.size()) +
                      " iterations " + std::to_string(iterations.front()) + ".." +
                      std::to_string(iterations.back()) + ", " + std::to_string(num_sources) +
                      " ranks as sources, microbatches summed)";
  trace.step_ids = iterations;
  const size_t stride = static_cast<size_t>(trace.row_size());
  trace.steps.assign(iterations.size(),
                     std::vector<double>(stride * static_cast<size_t>(trace.num_layers), 0.0));

  std::vector<bool> seen_layers;
  std::string text;
  for (size_t i = 0; i < files.size(); ++i) {
    const SmartMoeFile& file = files[i];
    if (i == 0) {
      text = std::move(first_text);
    } else {
      KEEL_ASSIGN_OR_RETURN(text, ReadTraceFile(file.path));
    }
    KEEL_ASSIGN_OR_RETURN(std::vector<std::string_view> lines, SplitLines(text, file.path));
    if (static_cast<int>(lines.size()) != trace.num_layers) {
      return InvalidArgument(file.path + ": " + std::to_string(lines.size()) + " layers, but " +
                             files[0].path + " has " + std::to_string(trace.num_layers));
    }
    const size_t step = i / static_cast<size_t>(num_sources);
    double* counts = trace.steps[step].data() + static_cast<size_t>(file.rank) * num_experts;
    seen_layers.assign(trace.num_layers, false);
    for (size_t line = 0; line < lines.size(); ++line) {
      KEEL_RETURN_IF_ERROR(
          ParseSmartMoeLine(lines[line], file.path + ":" + std::to_string(line + 1),
                            trace.num_layers, num_experts, stride, counts, seen_layers));
    }
    if (options.progress && ((i + 1) % 500 == 0 || i + 1 == files.size())) {
      options.progress(static_cast<int>(i + 1), static_cast<int>(files.size()));
    }
  }
  KEEL_RETURN_IF_ERROR(trace.Validate());
  return trace;
}

}  // namespace

Result<Trace> ImportSmartMoeTrace(const std::string& path, const SmartMoeImportOptions& options) {
  std::error_code error;
  if (!fs::exists(path, error)) return NotFound(path + ": no such file or directory");
  std::string archive;
  if (IsFolder(path)) {
    if (HasSmartMoeFiles(path)) return ImportSmartMoeFolder(path, path, options);
    std::string inner = (fs::path(path) / "moe_trace").string();
    if (IsFolder(inner) && HasSmartMoeFiles(inner)) {
      return ImportSmartMoeFolder(inner, inner, options);
    }
    std::vector<std::string> archives;
    for (const FolderEntry& entry : ListFolder(path)) {
      if (EndsWith(entry.name, ".tar.xz")) archives.push_back(entry.path);
    }
    if (archives.size() != 1) {
      return NotFound(path + ": expected table_iter{N}_rank{R}.log files, a moe_trace/ folder " +
                      "or exactly one .tar.xz of them (found " + std::to_string(archives.size()) +
                      " archives)");
    }
    archive = archives[0];
  } else {
    archive = path;
  }
  KEEL_ASSIGN_OR_RETURN(TemporaryFolder scratch, TemporaryFolder::Create());
  KEEL_RETURN_IF_ERROR(ExtractTarXz(archive, scratch.path()));
  // The archive holds moe_trace/ (or, from other packers, the tables at its top level).
  std::string folder = scratch.path();
  if (!HasSmartMoeFiles(folder)) {
    for (const FolderEntry& entry : ListFolder(scratch.path())) {
      if (entry.is_directory && HasSmartMoeFiles(entry.path)) {
        folder = entry.path;
        break;
      }
    }
  }
  Result<Trace> trace = ImportSmartMoeFolder(folder, archive, options);
  if (!trace.ok()) return trace.status().WithContext(archive);
  return trace;
}

}  // namespace keel
