// Importers for routing traces recorded by other systems: SmartMoE's per-rank tables, ESFT's
// per-sequence expert ids, OLMoE's per-domain counts and Megatron-LM's router tracer. Each
// turns its input into a keel::Trace and names the file, line and value it cannot use.
#include "monitor/trace_import.h"

#include "common/file.h"
#include "common/random.h"

#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string_view>
#include <system_error>
#include <tuple>
#include <utility>
#include <vector>

extern char** environ;

namespace keel {
namespace {

namespace fs = std::filesystem;

// Splits text into lines (without '\n' or a trailing '\r'); trailing empty lines are dropped.
std::vector<std::string_view> SplitLines(std::string_view text) {
  std::vector<std::string_view> lines;
  while (!text.empty()) {
    size_t end = text.find('\n');
    std::string_view line = text.substr(0, end);
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    lines.push_back(line);
    if (end == std::string_view::npos) break;
    text.remove_prefix(end + 1);
  }
  while (!lines.empty() && lines.back().find_first_not_of(" \t") == std::string_view::npos) {
    lines.pop_back();
  }
  return lines;
}

bool EndsWith(std::string_view text, std::string_view suffix) {
  return text.size() >= suffix.size() && text.substr(text.size() - suffix.size()) == suffix;
}

// Parses `<prefix><digits><suffix>` and returns the number; nothing when `name` has another
// shape; an error when its digits do not fit in 64 bits (a file that would otherwise be skipped
// without a word).
Result<std::optional<int64_t>> NumberBetween(std::string_view name, std::string_view prefix,
                                             std::string_view suffix) {
  if (!name.starts_with(prefix) || !EndsWith(name, suffix)) return std::optional<int64_t>();
  std::string_view digits = name.substr(prefix.size(), name.size() - prefix.size() - suffix.size());
  int64_t value = 0;
  auto [end, error] = std::from_chars(digits.data(), digits.data() + digits.size(), value);
  if (error == std::errc::result_out_of_range && end == digits.data() + digits.size()) {
    return InvalidArgument(std::string(name) + ": the number " + std::string(digits) +
                           " in the file name does not fit in 64 bits");
  }
  if (digits.empty() || error != std::errc() || end != digits.data() + digits.size()) {
    return std::optional<int64_t>();
  }
  return std::optional<int64_t>(value);
}

// The entries of a folder, without exceptions; an unreadable folder lists as empty.
struct FolderEntry {
  std::string name;
  std::string path;
  bool is_directory = false;
};
std::vector<FolderEntry> ListFolder(const std::string& folder) {
  std::vector<FolderEntry> entries;
  std::error_code error;
  fs::directory_iterator it(folder, error);
  for (; !error && it != fs::directory_iterator(); it.increment(error)) {
    std::error_code type_error;
    entries.push_back(
        {it->path().filename().string(), it->path().string(), it->is_directory(type_error)});
  }
  return entries;
}

bool IsFolder(const std::string& path) {
  std::error_code error;
  return fs::is_directory(path, error);
}

// A folder made with mkdtemp and removed, with everything in it, when this goes out of scope.
class TemporaryFolder {
 public:
  static Result<TemporaryFolder> Create() {
    const char* base = std::getenv("TMPDIR");
    std::string pattern =
        std::string(base != nullptr && *base != '\0' ? base : "/tmp") + "/keel-trace-XXXXXX";
    if (mkdtemp(pattern.data()) == nullptr) {
      return IoError(pattern + ": mkdtemp failed: " + std::generic_category().message(errno));
    }
    return TemporaryFolder(pattern);
  }
  TemporaryFolder(TemporaryFolder&& other) noexcept : path_(std::move(other.path_)) {
    other.path_.clear();
  }
  TemporaryFolder& operator=(TemporaryFolder&&) = delete;
  TemporaryFolder(const TemporaryFolder&) = delete;
  ~TemporaryFolder() {
    if (path_.empty()) return;
    std::error_code ignored;
    fs::remove_all(path_, ignored);
  }
  const std::string& path() const { return path_; }

 private:
  explicit TemporaryFolder(std::string path) : path_(std::move(path)) {}
  std::string path_;
};

// Runs `tar -xJf archive -C folder` without a shell, so no path needs quoting.
Status ExtractTarXz(const std::string& archive, const std::string& folder) {
  std::vector<std::string> args = {"tar", "-xJf", archive, "-C", folder};
  std::vector<char*> argv;
  for (std::string& arg : args) argv.push_back(arg.data());
  argv.push_back(nullptr);
  pid_t pid = 0;
  int spawn_error = posix_spawnp(&pid, "tar", nullptr, nullptr, argv.data(), environ);
  if (spawn_error != 0) {
    return IoError(archive + ": cannot run tar: " + std::generic_category().message(spawn_error));
  }
  int status = 0;
  while (waitpid(pid, &status, 0) < 0) {
    if (errno != EINTR) return IoError(archive + ": waiting for tar failed");
  }
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    // Almost always a truncated or corrupt archive: bad input, like any other bad trace.
    return InvalidArgument(archive + ": `tar -xJf` failed (exit status " +
                           std::to_string(WIFEXITED(status) ? WEXITSTATUS(status) : -1) +
                           "): the archive is truncated, corrupt or not .tar.xz (or xz is not "
                           "installed)");
  }
  return Status::Ok();
}

// ---------------------------------------------------------------------------------------------
// SmartMoE

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
    if (error != std::errc()) return Error("expected an integer");
    pos_ = end - line_.data();
    return value;
  }
  Result<double> Number() {
    SkipSpace();
    double value = 0;
    auto [end, error] = std::from_chars(line_.data() + pos_, line_.data() + line_.size(), value);
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
  KEEL_ASSIGN_OR_RETURN(std::string first_text, ReadFile(files[0].path));
  std::vector<std::string_view> first_lines = SplitLines(first_text);
  if (first_lines.empty()) return InvalidArgument(files[0].path + ": empty table");
  KEEL_ASSIGN_OR_RETURN(int num_experts, SmartMoeExpertsOf(first_lines[0], files[0].path + ":1"));

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
      KEEL_ASSIGN_OR_RETURN(text, ReadFile(file.path));
    }
    std::vector<std::string_view> lines = SplitLines(text);
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

// ---------------------------------------------------------------------------------------------
// ESFT

// Adds one sequence's expert ids (before the double tab) into counts[layer * E + id].
Status ParseEsftLine(std::string_view line, const std::string& where, int num_experts,
                     double* layer_counts, size_t* ids_read) {
  size_t split = line.find("\t\t");
  if (split == std::string_view::npos) {
    return InvalidArgument(where + ": expected '<expert ids>\\t\\t<gate weights>'");
  }
  std::string_view ids = line.substr(0, split);
  std::string_view weights = line.substr(split + 2);
  size_t num_ids = 0;
  const char* cursor = ids.data();
  const char* end = ids.data() + ids.size();
  while (cursor < end) {
    int id = 0;
    auto [next, error] = std::from_chars(cursor, end, id);
    if (error != std::errc() || (next < end && *next != '\t')) {
      return InvalidArgument(where + ": expert id " + std::to_string(num_ids) + " ('" +
                             std::string(cursor, std::min<size_t>(end - cursor, 12)) +
                             "') is not an integer");
    }
    if (id < 0 || id >= num_experts) {
      return InvalidArgument(where + ": expert id " + std::to_string(id) + " outside 0.." +
                             std::to_string(num_experts - 1));
    }
    layer_counts[id] += 1.0;
    ++num_ids;
    cursor = next < end ? next + 1 : next;
  }
  // The weights are not counted as load, but a file whose weights are not probabilities is not
  // the gate output it claims to be.
  size_t num_weights = 0;
  cursor = weights.data();
  end = weights.data() + weights.size();
  while (cursor < end) {
    double weight = 0;
    auto [next, error] = std::from_chars(cursor, end, weight);
    if (error != std::errc() || (next < end && *next != '\t') || !std::isfinite(weight) ||
        weight < 0) {
      return InvalidArgument(where + ": gate weight " + std::to_string(num_weights) + " ('" +
                             std::string(cursor, std::min<size_t>(end - cursor, 12)) +
                             "') is not a finite non-negative number");
    }
    ++num_weights;
    cursor = next < end ? next + 1 : next;
  }
  if (num_weights != num_ids) {
    return InvalidArgument(where + ": " + std::to_string(num_ids) + " expert ids but " +
                           std::to_string(num_weights) + " gate weights");
  }
  *ids_read = num_ids;
  return Status::Ok();
}

// True for a folder that holds expert_weights_1.txt: one ESFT task.
bool IsEsftTaskFolder(const std::string& path) {
  std::error_code error;
  return fs::is_regular_file(fs::path(path) / "expert_weights_1.txt", error);
}

// The ESFT task folders inside `path` (results/expert_scores/), sorted by name.
std::vector<FolderEntry> EsftTaskFolders(const std::string& path) {
  std::vector<FolderEntry> tasks;
  for (const FolderEntry& entry : ListFolder(path)) {
    if (entry.is_directory && IsEsftTaskFolder(entry.path)) tasks.push_back(entry);
  }
  std::sort(tasks.begin(), tasks.end(),
            [](const FolderEntry& a, const FolderEntry& b) { return a.name < b.name; });
  return tasks;
}

// One ESFT task: every sequence with its counts per (layer, expert) and its tokens.
Result<std::vector<TraceSequence>> ReadEsftTask(const std::string& path, const std::string& group,
                                                const EsftImportOptions& options, int* num_layers) {
  std::map<int64_t, std::string> layer_files;
  for (const FolderEntry& entry : ListFolder(path)) {
    KEEL_ASSIGN_OR_RETURN(std::optional<int64_t> layer,
                          NumberBetween(entry.name, "expert_weights_", ".txt"));
    if (layer) layer_files[*layer] = entry.path;
  }
  if (layer_files.empty()) return NotFound(path + ": no expert_weights_{layer}.txt files");
  int64_t expected_layer = 1;
  for (const auto& [layer, file] : layer_files) {
    if (layer != expected_layer) {
      return NotFound(path + ": expert_weights_" + std::to_string(expected_layer) +
                      ".txt is missing (MoE layers must be numbered 1..L without gaps)");
    }
    ++expected_layer;
  }
  const int layers = static_cast<int>(layer_files.size());
  if (*num_layers != 0 && *num_layers != layers) {
    return InvalidArgument(path + ": " + std::to_string(layers) +
                           " layers, the tasks before have " + std::to_string(*num_layers));
  }
  *num_layers = layers;
  const size_t layer_stride = static_cast<size_t>(options.num_experts);
  std::vector<TraceSequence> sequences;
  std::string first_file;
  for (const auto& [layer, file] : layer_files) {
    KEEL_ASSIGN_OR_RETURN(std::string text, ReadFile(file));
    std::vector<std::string_view> lines = SplitLines(text);
    if (layer == 1) {
      first_file = file;
      if (lines.empty()) return InvalidArgument(file + ": no sequences");
      sequences.resize(lines.size());
      for (TraceSequence& sequence : sequences) {
        sequence.group = group;
        sequence.counts.assign(layer_stride * layers, 0.0);
      }
    } else if (lines.size() != sequences.size()) {
      return InvalidArgument(file + ": " + std::to_string(lines.size()) + " sequences, but " +
                             first_file + " has " + std::to_string(sequences.size()));
    }
    for (size_t i = 0; i < lines.size(); ++i) {
      const std::string where = file + ":" + std::to_string(i + 1);
      size_t ids = 0;
      KEEL_RETURN_IF_ERROR(ParseEsftLine(lines[i], where, options.num_experts,
                                         sequences[i].counts.data() + (layer - 1) * layer_stride,
                                         &ids));
      if (ids % static_cast<size_t>(options.top_k) != 0) {
        return InvalidArgument(where + ": " + std::to_string(ids) +
                               " expert ids is not a multiple of top_k " +
                               std::to_string(options.top_k));
      }
      const auto tokens = static_cast<int64_t>(ids / options.top_k);
      if (layer == 1) {
        sequences[i].tokens = tokens;
      } else if (tokens != sequences[i].tokens) {
        return InvalidArgument(where + ": " + std::to_string(tokens) + " tokens, but " +
                               first_file + " line " + std::to_string(i + 1) + " has " +
                               std::to_string(sequences[i].tokens));
      }
    }
  }
  return sequences;
}

// ---------------------------------------------------------------------------------------------
// Megatron-LM

// Decoder layers first (by number), then multi-token-prediction layers by (head, layer).
struct MegatronLayerKey {
  int block = 0;  // 0 decoder, 1 mtp
  int64_t mtp_index = 0;
  int64_t layer = 0;
  auto operator<=>(const MegatronLayerKey&) const = default;
  std::string Name() const {
    return block == 0 ? std::to_string(layer)
                      : "mtp" + std::to_string(mtp_index) + "." + std::to_string(layer);
  }
};

struct MegatronRecordKey {
  int64_t step = 0;
  MegatronLayerKey layer;
  int64_t rank = 0;
  auto operator<=>(const MegatronRecordKey&) const = default;
};

Result<int64_t> RecordInt(const nlohmann::json& record, const char* key, const std::string& where,
                          std::optional<int64_t> fallback) {
  auto it = record.find(key);
  if (it == record.end()) {
    if (fallback) return *fallback;
    return InvalidArgument(where + ": record has no \"" + key + "\"");
  }
  if (!it->is_number_integer()) {
    return InvalidArgument(where + ": \"" + key + "\" must be an integer, got " + it->dump());
  }
  return it->get<int64_t>();
}

// Adds one record's selections into `counts`, growing it to the largest expert id seen.
Status AddMegatronRecord(const nlohmann::json& record, const std::string& where,
                         std::vector<double>& counts) {
  auto add = [&](int64_t expert, double value) -> Status {
    if (expert < 0 || expert >= kMaxExperts) {
      return InvalidArgument(where + ": expert id " + std::to_string(expert) +
                             " is out of range [0, " + std::to_string(kMaxExperts) + ")");
    }
    if (static_cast<size_t>(expert) >= counts.size()) counts.resize(expert + 1, 0.0);
    counts[expert] += value;
    return Status::Ok();
  };
  auto top_indices = record.find("top_indices");
  if (top_indices != record.end()) {
    if (!top_indices->is_array()) {
      return InvalidArgument(where + ": \"top_indices\" must be [num_tokens][topk] integers");
    }
    size_t token = 0;
    for (const nlohmann::json& choices : *top_indices) {
      if (!choices.is_array()) {
        return InvalidArgument(where + ": top_indices[" + std::to_string(token) +
                               "] is not a list of expert ids");
      }
      for (const nlohmann::json& expert : choices) {
        if (!expert.is_number_integer()) {
          return InvalidArgument(where + ": top_indices[" + std::to_string(token) +
                                 "] holds a non-integer " + expert.dump());
        }
        KEEL_RETURN_IF_ERROR(add(expert.get<int64_t>(), 1.0));
      }
      ++token;
    }
    return Status::Ok();
  }
  auto expert_counts = record.find("expert_counts");
  if (expert_counts != record.end()) {
    if (!expert_counts->is_array()) {
      return InvalidArgument(where + ": \"expert_counts\" must be a list of numbers");
    }
    int64_t expert = 0;
    for (const nlohmann::json& count : *expert_counts) {
      if (!count.is_number() || !(count.get<double>() >= 0.0) ||
          !std::isfinite(count.get<double>())) {
        return InvalidArgument(where + ": expert_counts[" + std::to_string(expert) +
                               "] is not a non-negative number: " + count.dump());
      }
      KEEL_RETURN_IF_ERROR(add(expert, count.get<double>()));
      ++expert;
    }
    return Status::Ok();
  }
  return InvalidArgument(where + ": record has neither \"top_indices\" nor \"expert_counts\"");
}

// The first line of a JSON Lines file as JSON (up to 1 MiB of it); null when it is not JSON.
nlohmann::json FirstLine(const std::string& path) {
  std::FILE* file = std::fopen(path.c_str(), "rb");
  if (file == nullptr) return nullptr;
  std::string first;
  int c = 0;
  while ((c = std::fgetc(file)) != EOF && c != '\n' && first.size() < (1 << 20)) {
    first.push_back(static_cast<char>(c));
  }
  std::fclose(file);
  try {
    return nlohmann::json::parse(first);
  } catch (const nlohmann::json::exception&) {
    return nullptr;
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
      const nlohmann::json first = FirstLine(path);
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

Result<Trace> ImportEsftTrace(const std::string& path, const EsftImportOptions& options) {
  if (options.sequences_per_step < 1) {
    return InvalidArgument("esft: sequences_per_step " +
                           std::to_string(options.sequences_per_step) + " must be at least 1");
  }
  if (options.num_experts < 1 || options.num_experts > kMaxExperts) {
    return InvalidArgument("esft: num_experts " + std::to_string(options.num_experts) +
                           " must be in [1, " + std::to_string(kMaxExperts) + "]");
  }
  if (options.top_k < 1 || options.top_k > options.num_experts) {
    return InvalidArgument("esft: top_k " + std::to_string(options.top_k) + " must be in [1, " +
                           std::to_string(options.num_experts) + "]");
  }
  if (!IsFolder(path)) {
    return NotFound(path + ": not a folder of expert_weights_{layer}.txt files (ESFT trace)");
  }
  // One task's folder, or the folder of every task: then the tasks' sequences are mixed.
  std::vector<FolderEntry> tasks;
  const bool mixed = !IsEsftTaskFolder(path) && !EsftTaskFolders(path).empty();
  if (mixed) {
    tasks = EsftTaskFolders(path);
  } else {
    tasks.push_back({fs::path(path).filename().string(), path, true});
  }
  Trace trace;
  trace.num_experts = options.num_experts;
  trace.num_sources = 0;
  std::vector<TraceSequence> sequences;
  std::string names;
  for (const FolderEntry& task : tasks) {
    KEEL_ASSIGN_OR_RETURN(std::vector<TraceSequence> read,
                          ReadEsftTask(task.path, task.name, options, &trace.num_layers));
    names += (names.empty() ? "" : ", ") + task.name + " " + std::to_string(read.size());
    for (TraceSequence& sequence : read) sequences.push_back(std::move(sequence));
  }
  if (mixed) {
    // Real batches mix tasks: a seeded Fisher-Yates shuffle (splitmix64), the same everywhere.
    uint64_t state = options.mix_seed;
    for (size_t i = sequences.size(); i > 1; --i) {
      std::swap(sequences[i - 1], sequences[SplitMix64(state) % i]);
    }
  }
  const size_t per_step = static_cast<size_t>(options.sequences_per_step);
  const size_t row = static_cast<size_t>(trace.num_layers) * trace.num_experts;
  for (size_t first = 0; first < sequences.size(); first += per_step) {
    std::vector<double> counts(row, 0.0);
    std::vector<TraceSequence> step;
    for (size_t i = first; i < std::min(sequences.size(), first + per_step); ++i) {
      for (size_t c = 0; c < row; ++c) counts[c] += sequences[i].counts[c];
      step.push_back(std::move(sequences[i]));
    }
    trace.step_ids.push_back(static_cast<int64_t>(first));
    trace.steps.push_back(std::move(counts));
    if (options.keep_sequences) trace.sequences.push_back(std::move(step));
  }
  trace.description =
      "esft: " + path + " (" + std::to_string(sequences.size()) + " sequences" +
      (mixed ? " of " + names + ", mixed with seed " + std::to_string(options.mix_seed)
             : std::string()) +
      ", " + std::to_string(options.sequences_per_step) + " per step; layer l = MoE layer l+1)";
  KEEL_RETURN_IF_ERROR(trace.Validate());
  return trace;
}

Result<Trace> ImportOlmoeTrace(const std::string& path, const OlmoeImportOptions& options) {
  std::string file = path;
  if (IsFolder(path)) {
    file = (fs::path(path) / "expert_counts_derived.json").string();
  }
  KEEL_ASSIGN_OR_RETURN(std::string text, ReadFile(file));
  nlohmann::json root;
  try {
    root = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& parse_error) {
    return InvalidArgument(file + ": not valid JSON: " + parse_error.what());
  }
  auto list_keys = [](const nlohmann::json& object) {
    std::string keys;
    for (auto it = object.begin(); it != object.end(); ++it) {
      keys += (keys.empty() ? "" : ", ") + it.key();
    }
    return keys;
  };
  if (!root.is_object() || !root.contains("models") || !root["models"].is_object()) {
    return InvalidArgument(file + ": expected an object with \"models\"");
  }
  const nlohmann::json& models = root["models"];
  if (!models.contains(options.model)) {
    return NotFound(file + ": model '" + options.model +
                    "' not found; models: " + list_keys(models));
  }
  const nlohmann::json& kinds = models[options.model];
  if (!kinds.is_object() || !kinds.contains(options.kind)) {
    return NotFound(file + ": model '" + options.model + "' has no kind '" + options.kind +
                    "'; kinds: " + (kinds.is_object() ? list_keys(kinds) : std::string()));
  }
  const nlohmann::json& domains = kinds[options.kind];
  if (!domains.is_object() || domains.empty()) {
    return InvalidArgument(file + ": models." + options.model + "." + options.kind +
                           " must map domains to [[count per expert] per layer]");
  }
  std::string layer_names;
  if (root.contains("layers") && root["layers"].is_array()) {
    for (const nlohmann::json& layer : root["layers"]) {
      layer_names += (layer_names.empty() ? "" : ",") + layer.dump();
    }
  }
  Trace trace;
  trace.num_sources = 0;
  // nlohmann::json keeps object keys sorted, so domains come in sorted order.
  for (auto it = domains.begin(); it != domains.end(); ++it) {
    const std::string where =
        file + ": models." + options.model + "." + options.kind + "." + it.key();
    const nlohmann::json& layers = it.value();
    if (!layers.is_array() || layers.empty() || !layers[0].is_array() || layers[0].empty()) {
      return InvalidArgument(where + " must be [[count per expert] per layer]");
    }
    if (trace.steps.empty()) {
      trace.num_layers = static_cast<int>(layers.size());
      trace.num_experts = static_cast<int>(layers[0].size());
    }
    if (static_cast<int>(layers.size()) != trace.num_layers) {
      return InvalidArgument(where + " has " + std::to_string(layers.size()) +
                             " layers, expected " + std::to_string(trace.num_layers));
    }
    std::vector<double> counts;
    counts.reserve(static_cast<size_t>(trace.num_layers) * trace.num_experts);
    for (size_t layer = 0; layer < layers.size(); ++layer) {
      const nlohmann::json& row = layers[layer];
      if (!row.is_array() || static_cast<int>(row.size()) != trace.num_experts) {
        return InvalidArgument(where + ": layer " + std::to_string(layer) + " has " +
                               std::to_string(row.is_array() ? row.size() : 0) +
                               " counts, expected " + std::to_string(trace.num_experts));
      }
      for (size_t expert = 0; expert < row.size(); ++expert) {
        const nlohmann::json& count = row[expert];
        if (!count.is_number() || !(count.get<double>() >= 0.0)) {
          return InvalidArgument(where + ": layer " + std::to_string(layer) + " expert " +
                                 std::to_string(expert) +
                                 " is not a non-negative number: " + count.dump());
        }
        counts.push_back(count.get<double>());
      }
    }
    trace.step_ids.push_back(trace.num_steps());
    trace.steps.push_back(std::move(counts));
    trace.description += (trace.description.empty() ? "" : ",") + it.key();
  }
  trace.description = "olmoe: " + options.model + " " + options.kind + " from " + file +
                      "; model layers [" + layer_names +
                      "]; one step per domain: " + trace.description;
  KEEL_RETURN_IF_ERROR(trace.Validate());
  return trace;
}

Result<Trace> ImportMegatronTrace(const std::string& path, const MegatronImportOptions& options) {
  if (options.num_experts < 0 || options.num_experts > kMaxExperts) {
    return InvalidArgument("megatron: num_experts " + std::to_string(options.num_experts) +
                           " must be 0 (infer) or in [1, " + std::to_string(kMaxExperts) + "]");
  }
  std::vector<std::string> files;
  if (IsFolder(path)) {
    for (const FolderEntry& entry : ListFolder(path)) {
      if (entry.name.starts_with("router_trace_rank") && EndsWith(entry.name, ".jsonl")) {
        files.push_back(entry.path);
      }
    }
    std::sort(files.begin(), files.end());
    if (files.empty()) return NotFound(path + ": no router_trace_rank*.jsonl files");
  } else {
    files.push_back(path);
  }

  std::map<MegatronRecordKey, std::vector<double>> records;
  int records_read = 0;
  // Records of counts must all count the same experts; where the first of them is.
  std::optional<std::pair<size_t, std::string>> counts_length;
  for (const std::string& file : files) {
    KEEL_ASSIGN_OR_RETURN(std::string text, ReadFile(file));
    std::vector<std::string_view> lines = SplitLines(text);
    for (size_t line = 0; line < lines.size(); ++line) {
      if (lines[line].find_first_not_of(" \t") == std::string_view::npos) continue;
      const std::string where = file + ":" + std::to_string(line + 1);
      nlohmann::json record;
      try {
        record = nlohmann::json::parse(lines[line].begin(), lines[line].end());
      } catch (const nlohmann::json::exception& parse_error) {
        return InvalidArgument(where +
                               ": not a JSON object (truncated file?): " + parse_error.what());
      }
      if (!record.is_object()) return InvalidArgument(where + ": a record must be an object");
      MegatronRecordKey key;
      // "iteration" is accepted as a synonym of "step" for hand-written traces.
      auto step_field = record.contains("step") ? "step" : "iteration";
      KEEL_ASSIGN_OR_RETURN(key.step, RecordInt(record, step_field, where, std::nullopt));
      KEEL_ASSIGN_OR_RETURN(key.layer.layer, RecordInt(record, "layer", where, std::nullopt));
      KEEL_ASSIGN_OR_RETURN(key.rank, RecordInt(record, "rank", where, int64_t{0}));
      if (key.rank < 0) {
        return InvalidArgument(where + ": rank " + std::to_string(key.rank) + " is negative");
      }
      std::string block = "decoder";
      if (auto it = record.find("block"); it != record.end() && it->is_string()) {
        block = it->get<std::string>();
      }
      if (block == "mtp" || record.contains("mtp_idx")) {
        if (!options.include_mtp) continue;
        key.layer.block = 1;
        KEEL_ASSIGN_OR_RETURN(key.layer.mtp_index, RecordInt(record, "mtp_idx", where, 0));
      }
      if (!options.per_source) key.rank = 0;
      if (auto counts = record.find("expert_counts");
          !record.contains("top_indices") && counts != record.end() && counts->is_array()) {
        if (!counts_length) counts_length.emplace(counts->size(), where);
        if (counts->size() != counts_length->first) {
          return InvalidArgument(where + ": expert_counts has " + std::to_string(counts->size()) +
                                 " entries, the record at " + counts_length->second + " has " +
                                 std::to_string(counts_length->first));
        }
      }
      KEEL_RETURN_IF_ERROR(AddMegatronRecord(record, where, records[key]));
      ++records_read;
      if (options.progress && records_read % 1000 == 0) options.progress(records_read, 0);
    }
  }
  if (records.empty()) return InvalidArgument(path + ": no router records");

  std::map<int64_t, int> step_index;
  std::map<MegatronLayerKey, int> layer_index;
  std::map<int64_t, int> rank_index;
  size_t max_experts = 0;
  for (const auto& [key, counts] : records) {
    step_index.emplace(key.step, 0);
    layer_index.emplace(key.layer, 0);
    rank_index.emplace(key.rank, 0);
    max_experts = std::max(max_experts, counts.size());
  }
  if (options.num_experts > 0 && max_experts > static_cast<size_t>(options.num_experts)) {
    return InvalidArgument(path + ": expert id " + std::to_string(max_experts - 1) +
                           " is not below num_experts " + std::to_string(options.num_experts));
  }
  auto number = [](auto& index) {
    int next = 0;
    for (auto& [key, value] : index) value = next++;
  };
  number(step_index);
  number(layer_index);
  number(rank_index);

  Trace trace;
  trace.num_layers = static_cast<int>(layer_index.size());
  trace.num_experts = options.num_experts > 0 ? options.num_experts : static_cast<int>(max_experts);
  trace.num_sources = options.per_source ? static_cast<int>(rank_index.size()) : 0;
  for (const auto& [step, index] : step_index) trace.step_ids.push_back(step);
  const size_t row_size = static_cast<size_t>(trace.row_size());
  trace.steps.assign(step_index.size(), std::vector<double>(row_size * trace.num_layers, 0.0));
  for (const auto& [key, counts] : records) {
    double* row =
        trace.steps[step_index[key.step]].data() +
        static_cast<size_t>(layer_index[key.layer]) * row_size +
        (options.per_source ? static_cast<size_t>(rank_index[key.rank]) : 0) * trace.num_experts;
    for (size_t expert = 0; expert < counts.size(); ++expert) row[expert] += counts[expert];
  }
  std::string layers;
  for (const auto& [key, index] : layer_index) layers += (layers.empty() ? "" : ",") + key.Name();
  std::string ranks;
  for (const auto& [rank, index] : rank_index) {
    ranks += (ranks.empty() ? "" : ",") + std::to_string(rank);
  }
  trace.description = "megatron: " + path + "; model layers [" + layers + "]" +
                      (options.per_source ? "; sources = ranks [" + ranks + "]" : "; ranks summed");
  KEEL_RETURN_IF_ERROR(trace.Validate());
  return trace;
}

}  // namespace keel
