// `keel trace`: converts recorded routing traces to the Keel format, generates synthetic ones and
// summarizes a trace (shape, tokens, imbalance under the static placement).
// Formats and flags are documented in docs/traces.md.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/file.h"
#include "keel/limits.hpp"
#include "keel/status.hpp"
#include "monitor/trace.h"
#include "monitor/trace_import.h"
#include "tools/commands.h"
#include "tools/flags.h"

namespace keel::tools {
namespace {

constexpr int kExitOk = 0;
constexpr int kExitFailure = 1;
constexpr int kExitUsage = 2;

constexpr const char* kTraceUsage = R"(keel trace - routing traces: convert, generate, inspect

Usage:
  keel trace convert --input PATH --output OUT.jsonl [--format F] [importer flags]
  keel trace generate --output OUT.jsonl [generator flags]
  keel trace info PATH [--format F] [--ranks N]

Run `keel trace <subcommand> --help` for every flag. Formats: keel, smartmoe, esft, olmoe,
megatron (auto guesses from the path). See docs/traces.md.
)";

// Appended to convert's and info's help: what each format's input looks like.
constexpr const char* kFormatsEpilogue = R"(Formats (--format; auto guesses from the path):
  keel      .jsonl whose first line is a Keel header
  smartmoe  folder of table_iter{N}_rank{R}.log, a folder holding moe_trace/ or a .tar.xz of
            it, or the .tar.xz itself (extracted to a temporary folder, removed afterwards)
  esft      one task folder of expert_weights_{1..L}.txt, or the folder of several task
            folders (their sequences mixed; every step keeps its sequences)
  olmoe     expert_counts_derived.json (or its folder)
  megatron  router_trace_rank{R}.jsonl of Megatron-LM's router tracer, or the folder of them
See docs/traces.md for how each maps to steps, layers, experts and sources.)";

int Usage(const char* command, const Status& status) {
  std::fprintf(stderr, "keel trace %s: %s\n", command, status.message().c_str());
  return kExitUsage;
}

// Parses flags; returns the exit code to stop with (help printed or a usage error), or nothing.
std::optional<int> ParseOrExit(FlagParser& parser, const char* command, int argc, char** argv) {
  if (Status status = parser.Parse(argc, argv); !status.ok()) return Usage(command, status);
  if (parser.help_requested()) {
    std::fputs(parser.HelpText().c_str(), stdout);
    return kExitOk;
  }
  return std::nullopt;
}

Result<TraceFormat> FormatFlag(const std::string& name) {
  Result<TraceFormat> format = ParseTraceFormat(name);
  if (!format.ok()) return format.status().WithContext("flag --format");
  return format;
}

// Bad input (an invalid or missing trace) exits 2, as everywhere in keel; anything else 1.
int Fail(const char* command, const Status& status) {
  std::fprintf(stderr, "keel trace %s: %s\n", command, status.ToString().c_str());
  const bool bad_input =
      status.code() == StatusCode::kInvalidArgument || status.code() == StatusCode::kNotFound;
  return bad_input ? kExitUsage : kExitFailure;
}

double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// Options of every importer, filled from convert's and info's flags.
struct ImportFlags {
  EsftImportOptions esft;
  OlmoeImportOptions olmoe;
  MegatronImportOptions megatron;
  bool quiet = false;
};

Result<Trace> ImportTraceAs(const std::string& path, TraceFormat format, ImportFlags flags) {
  if (!flags.quiet) {
    std::fprintf(stderr, "keel trace: reading %s as %s\n", path.c_str(),
                 std::string(TraceFormatName(format)).c_str());
  }
  switch (format) {
    case TraceFormat::kKeel:
      return ReadKeelTrace(path);
    case TraceFormat::kSmartMoe: {
      SmartMoeImportOptions options;
      if (!flags.quiet) {
        options.progress = [](int done, int total) {
          if (done % 2000 == 0 || done == total) {
            std::fprintf(stderr, "keel trace: %d/%d tables read\n", done, total);
          }
        };
      }
      return ImportSmartMoeTrace(path, options);
    }
    case TraceFormat::kEsft:
      return ImportEsftTrace(path, flags.esft);
    case TraceFormat::kOlmoe:
      return ImportOlmoeTrace(path, flags.olmoe);
    case TraceFormat::kMegatron: {
      if (!flags.quiet) {
        flags.megatron.progress = [](int done, int) {
          if (done % 10000 == 0) std::fprintf(stderr, "keel trace: %d records read\n", done);
        };
      }
      return ImportMegatronTrace(path, flags.megatron);
    }
    case TraceFormat::kAuto:
      break;
  }
  return Internal("unhandled trace format");
}

// `format`, or the format guessed from the path (then an error says it was a guess).
Result<Trace> ImportTrace(const std::string& path, TraceFormat format, const ImportFlags& flags) {
  if (format != TraceFormat::kAuto) return ImportTraceAs(path, format, flags);
  KEEL_ASSIGN_OR_RETURN(const TraceFormat guessed, DetectTraceFormat(path));
  Result<Trace> trace = ImportTraceAs(path, guessed, flags);
  if (!trace.ok()) return trace.status().WithContext(GuessedFormatContext(guessed));
  return trace;
}

// Convert's importer flags, each read by one format's importer only.
struct ImporterFlag {
  const char* name;
  TraceFormat format;
};
constexpr ImporterFlag kImporterFlags[] = {
    {"esft-group", TraceFormat::kEsft},           {"esft-experts", TraceFormat::kEsft},
    {"esft-top-k", TraceFormat::kEsft},           {"esft-mix-seed", TraceFormat::kEsft},
    {"olmoe-model", TraceFormat::kOlmoe},         {"olmoe-kind", TraceFormat::kOlmoe},
    {"megatron-experts", TraceFormat::kMegatron}, {"megatron-sum-ranks", TraceFormat::kMegatron},
    {"megatron-mtp", TraceFormat::kMegatron},
};

// An importer flag given for a trace another importer reads would do nothing: refused by name.
Status CheckImporterFlags(const FlagParser& parser, const std::string& input, TraceFormat format,
                          bool guessed) {
  for (const ImporterFlag& flag : kImporterFlags) {
    if (!parser.IsSet(flag.name) || flag.format == format) continue;
    return InvalidArgument("--" + std::string(flag.name) + " is for " +
                           std::string(TraceFormatName(flag.format)) + " traces, but " + input +
                           " is read as " + std::string(TraceFormatName(format)) +
                           (guessed ? " (guessed from the path; --format chooses another)" : ""));
  }
  return Status::Ok();
}

int RunConvert(int argc, char** argv) {
  std::string input;
  std::string output;
  std::string format_name = "auto";
  ImportFlags import;
  bool sum_ranks = false;
  FlagParser parser("keel trace convert",
                    "Converts a recorded routing trace to the Keel format. The output is written "
                    "to OUT.tmp and renamed,\nso a failure leaves an existing OUT untouched.");
  parser.Add("input", "PATH", &input, "trace to read: a file or folder",
             FlagRequirement::kRequired);
  parser.Add("output", "OUT", &output, "Keel trace (.jsonl) to write", FlagRequirement::kRequired);
  parser.Add("format", "F", &format_name, "auto, keel, smartmoe, esft, olmoe or megatron");
  parser.Add("esft-group", "K", &import.esft.sequences_per_step, "esft: sequences per step");
  parser.Add("esft-experts", "N", &import.esft.num_experts,
             "esft: routed experts per layer, at most 65536");
  parser.Add("esft-top-k", "K", &import.esft.top_k,
             "esft: expert ids per token (6 for DeepSeek-V2-Lite); a sequence's tokens are its "
             "ids / K");
  parser.Add("esft-mix-seed", "N", &import.esft.mix_seed,
             "esft: seed of the shuffle that mixes the sequences of several tasks");
  parser.Add("olmoe-model", "M", &import.olmoe.model,
             "olmoe: model (olmoe, mistral, olmoe-sft, olmoe-dpo)");
  parser.Add("olmoe-kind", "K", &import.olmoe.kind, "olmoe: expert_counts or expert_counts_top1");
  parser.Add("megatron-experts", "N", &import.megatron.num_experts,
             "megatron: experts per layer, at most 65536; 0 = largest id seen + 1");
  parser.AddBool("megatron-sum-ranks", &sum_ranks,
                 "megatron: add all ranks together instead of one source per rank");
  parser.AddBool("megatron-mtp", &import.megatron.include_mtp,
                 "megatron: keep multi-token-prediction layers");
  parser.AddBool("quiet", &import.quiet, "no progress messages on stderr");
  parser.SetEpilogue(kFormatsEpilogue);
  if (std::optional<int> exit_code = ParseOrExit(parser, "convert", argc, argv)) {
    return *exit_code;
  }
  Result<TraceFormat> format = FormatFlag(format_name);
  if (!format.ok()) return Usage("convert", format.status());
  if (import.esft.sequences_per_step < 1) {
    return Usage("convert", InvalidArgument("flag --esft-group: " +
                                            std::to_string(import.esft.sequences_per_step) +
                                            " must be at least 1"));
  }
  if (import.esft.num_experts < 1 || import.esft.num_experts > kMaxExperts) {
    return Usage("convert",
                 InvalidArgument("flag --esft-experts: " + std::to_string(import.esft.num_experts) +
                                 " must be in [1, " + std::to_string(kMaxExperts) + "]"));
  }
  if (import.megatron.num_experts < 0 || import.megatron.num_experts > kMaxExperts) {
    return Usage(
        "convert",
        InvalidArgument("flag --megatron-experts: " + std::to_string(import.megatron.num_experts) +
                        " must be 0 (infer) or in [1, " + std::to_string(kMaxExperts) + "]"));
  }
  import.megatron.per_source = !sum_ranks;
  if (Status apart = CheckOutputsApart({{"--input", input}}, {{"--output", output}}); !apart.ok()) {
    return Usage("convert", apart);
  }
  const bool guessed = *format == TraceFormat::kAuto;
  if (guessed) {
    format = DetectTraceFormat(input);
    if (!format.ok()) return Fail("convert", format.status());
  }
  if (Status applies = CheckImporterFlags(parser, input, *format, guessed); !applies.ok()) {
    return Usage("convert", applies);
  }

  auto start = std::chrono::steady_clock::now();
  Result<Trace> trace = ImportTrace(input, *format, import);
  if (!trace.ok()) {
    return Fail("convert", guessed ? trace.status().WithContext(GuessedFormatContext(*format))
                                   : trace.status());
  }
  double read_seconds = SecondsSince(start);
  start = std::chrono::steady_clock::now();
  if (Status written = WriteKeelTrace(*trace, output); !written.ok()) {
    return Fail("convert", written);
  }
  if (!import.quiet) {
    std::fprintf(stderr,
                 "keel trace: wrote %s: %d steps, %d layers, %d experts, %d sources "
                 "(read %.2f s, write %.2f s)\n",
                 output.c_str(), trace->num_steps(), trace->num_layers, trace->num_experts,
                 trace->num_sources, read_seconds, SecondsSince(start));
  }
  return kExitOk;
}

int RunGenerate(int argc, char** argv) {
  std::string output;
  SyntheticTraceOptions options;
  FlagParser parser(
      "keel trace generate",
      "Writes a seeded synthetic trace. Each layer ranks experts by a Zipf law over a random\n"
      "permutation that drifts by neighbour swaps; bursts multiply one expert's weight for a few\n"
      "steps; every source routes its tokens to top-k distinct experts drawn from the weights.\n"
      "The same flags give the same trace on every machine.");
  parser.Add("output", "OUT", &output, "Keel trace (.jsonl) to write (atomically, via OUT.tmp)",
             FlagRequirement::kRequired);
  parser.Add("seed", "N", &options.seed, "random seed");
  parser.Add("steps", "N", &options.num_steps, "steps");
  parser.Add("layers", "N", &options.num_layers, "MoE layers");
  parser.Add("experts", "N", &options.num_experts, "experts per layer");
  parser.Add("sources", "N", &options.num_sources,
             "source ranks of the traffic matrix; 0 = per-expert counts only");
  parser.Add("tokens", "N", &options.tokens_per_source,
             "tokens each source routes per step and layer");
  parser.Add("top-k", "N", &options.top_k, "distinct experts per token");
  parser.Add("zipf", "X", &options.zipf_exponent,
             "Zipf exponent of expert popularity; 0 = uniform, larger = more skewed");
  parser.Add("drift", "X", &options.drift_swaps_per_step,
             "mean neighbour popularity swaps per layer per step");
  parser.Add("burst-prob", "X", &options.burst_probability,
             "probability per layer per step that a burst starts");
  parser.Add("burst-factor", "X", &options.burst_factor, "weight multiplier of a bursting expert");
  parser.Add("burst-steps", "N", &options.burst_steps, "steps a burst lasts");
  parser.SetEpilogue("See docs/traces.md (\"Synthetic traces\").");
  if (std::optional<int> exit_code = ParseOrExit(parser, "generate", argc, argv)) {
    return *exit_code;
  }

  auto start = std::chrono::steady_clock::now();
  Result<Trace> trace = GenerateSyntheticTrace(options);
  // Option errors are the caller's input: report them as usage errors.
  if (!trace.ok()) return Usage("generate", trace.status());
  if (Status written = WriteKeelTrace(*trace, output); !written.ok()) {
    return Fail("generate", written);
  }
  std::fprintf(stderr,
               "keel trace: wrote %s: %d steps, %d layers, %d experts, %d sources (%.2f s)\n",
               output.c_str(), trace->num_steps(), trace->num_layers, trace->num_experts,
               trace->num_sources, SecondsSince(start));
  return kExitOk;
}

// Imbalance (max rank load / mean rank load) of each (step, layer) with experts placed
// contiguously: rank g holds experts [g*E/G, (g+1)*E/G), the first E % G ranks one more. Ranks
// beyond the experts hold none and load nothing, so the work is the experts', whatever the ranks.
std::vector<double> StaticImbalances(const Trace& trace, int num_ranks) {
  const int base = trace.num_experts / num_ranks;
  const int extra = trace.num_experts % num_ranks;
  std::vector<double> imbalances;
  for (int step = 0; step < trace.num_steps(); ++step) {
    for (int layer = 0; layer < trace.num_layers; ++layer) {
      const std::vector<double> counts = trace.ExpertCounts(step, layer);
      double total = 0.0;
      double most = 0.0;
      int expert = 0;
      for (int rank = 0; rank < num_ranks && expert < trace.num_experts; ++rank) {
        double load = 0.0;
        for (int i = 0; i < base + (rank < extra ? 1 : 0); ++i) load += counts[expert++];
        most = std::max(most, load);
        total += load;
      }
      if (total <= 0.0) continue;
      imbalances.push_back(most / (total / num_ranks));
    }
  }
  return imbalances;
}

int RunInfo(int argc, char** argv) {
  // The trace path may come first or last as a plain argument; the parser sees only flags.
  std::string path;
  std::vector<char*> flag_args = {argv[0]};
  for (int i = 1; i < argc; ++i) {
    std::string_view arg = argv[i];
    if (!arg.starts_with("-") && path.empty()) {
      path = argv[i];
      continue;
    }
    flag_args.push_back(argv[i]);
    if ((arg == "--format" || arg == "--ranks" || arg == "--input") && i + 1 < argc) {
      flag_args.push_back(argv[++i]);
    }
  }
  std::string input;
  std::string format_name = "auto";
  int ranks = 0;
  FlagParser parser("keel trace info PATH",
                    "Prints steps, layers, experts, sources, tokens per step and layer, and the "
                    "imbalance\n(max rank load / mean rank load) of the static contiguous "
                    "placement.");
  parser.Add("input", "PATH", &input, "the trace (instead of the plain PATH argument)");
  parser.Add("format", "F", &format_name, "auto, keel, smartmoe, esft, olmoe or megatron");
  parser.Add("ranks", "N", &ranks,
             "ranks for the imbalance line, at most " + std::to_string(kMaxRanks) +
                 "; 0 = the trace's sources, or 8 without sources");
  parser.SetEpilogue(kFormatsEpilogue);
  if (std::optional<int> exit_code =
          ParseOrExit(parser, "info", static_cast<int>(flag_args.size()), flag_args.data())) {
    return *exit_code;
  }
  if (!input.empty()) {
    if (!path.empty()) return Usage("info", InvalidArgument("give the trace PATH only once"));
    path = input;
  }
  if (path.empty()) return Usage("info", InvalidArgument("missing the trace PATH"));
  Result<TraceFormat> parsed_format = FormatFlag(format_name);
  if (!parsed_format.ok()) return Usage("info", parsed_format.status());
  TraceFormat format = *parsed_format;
  if (ranks < 0 || ranks > kMaxRanks) {
    return Usage("info", InvalidArgument("flag --ranks: " + std::to_string(ranks) +
                                         " must be 0 (default) or in [1, " +
                                         std::to_string(kMaxRanks) + "]"));
  }
  ImportFlags import;
  import.quiet = true;
  const bool guessed = format == TraceFormat::kAuto;
  if (guessed) {
    Result<TraceFormat> detected = DetectTraceFormat(path);
    if (!detected.ok()) return Fail("info", detected.status());
    format = *detected;
  }
  Result<Trace> trace = ImportTrace(path, format, import);
  if (!trace.ok()) {
    return Fail("info", guessed ? trace.status().WithContext(GuessedFormatContext(format))
                                : trace.status());
  }
  if (Status valid = trace->Validate(); !valid.ok()) return Fail("info", valid);
  if (ranks == 0) ranks = trace->num_sources > 0 ? trace->num_sources : 8;

  std::printf("trace:       %s (%s)\n", path.c_str(), std::string(TraceFormatName(format)).c_str());
  std::printf("description: %s\n", trace->description.c_str());
  if (trace->num_steps() > 0) {
    std::printf("steps:       %d (step ids %lld .. %lld)\n", trace->num_steps(),
                static_cast<long long>(trace->step_ids.front()),
                static_cast<long long>(trace->step_ids.back()));
  } else {
    std::printf("steps:       0\n");
  }
  std::printf("layers:      %d\n", trace->num_layers);
  std::printf("experts:     %d\n", trace->num_experts);
  std::printf("sources:     %d%s\n", trace->num_sources,
              trace->num_sources == 0 ? " (per-expert counts only)" : "");
  if (trace->num_steps() == 0) return kExitOk;

  // Tokens are counted as routed selections (a token sent to k experts counts k times).
  double min_tokens = 0.0, max_tokens = 0.0, sum_tokens = 0.0;
  int cells = 0;
  for (int step = 0; step < trace->num_steps(); ++step) {
    for (int layer = 0; layer < trace->num_layers; ++layer) {
      double total = 0.0;
      for (double count : trace->layer_row(step, layer)) total += count;
      min_tokens = cells == 0 ? total : std::min(min_tokens, total);
      max_tokens = cells == 0 ? total : std::max(max_tokens, total);
      sum_tokens += total;
      ++cells;
    }
  }
  std::printf("tokens per step and layer (selections): mean %.1f, min %.0f, max %.0f\n",
              sum_tokens / cells, min_tokens, max_tokens);
  std::vector<double> imbalances = StaticImbalances(*trace, ranks);
  if (imbalances.empty()) {
    std::printf("imbalance:   no tokens routed\n");
    return kExitOk;
  }
  std::sort(imbalances.begin(), imbalances.end());
  double mean = 0.0;
  for (double value : imbalances) mean += value;
  mean /= static_cast<double>(imbalances.size());
  auto quantile = [&](double q) {
    return imbalances[static_cast<size_t>(q * static_cast<double>(imbalances.size() - 1))];
  };
  std::printf(
      "imbalance:   static contiguous placement on %d ranks: mean %.3f, p50 %.3f, p95 %.3f, "
      "max %.3f over %zu step-layers\n",
      ranks, mean, quantile(0.5), quantile(0.95), imbalances.back(), imbalances.size());
  return kExitOk;
}

}  // namespace

int RunTrace(int argc, char** argv) {
  // argv[0] is "trace".
  if (argc < 2) {
    std::fputs(kTraceUsage, stderr);
    return kExitUsage;
  }
  std::string_view subcommand = argv[1];
  if (subcommand == "--help" || subcommand == "-h" || subcommand == "help") {
    std::fputs(kTraceUsage, stdout);
    return kExitOk;
  }
  // Each subcommand gets its own name as argv[0].
  if (subcommand == "convert") return RunConvert(argc - 1, argv + 1);
  if (subcommand == "generate") return RunGenerate(argc - 1, argv + 1);
  if (subcommand == "info") return RunInfo(argc - 1, argv + 1);
  std::fprintf(stderr, "keel trace: unknown subcommand '%s'\n\n%s", argv[1], kTraceUsage);
  return kExitUsage;
}

}  // namespace keel::tools
