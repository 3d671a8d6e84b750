// Importers that turn routing traces recorded by other systems (SmartMoE's artifact, ESFT's expert
// scores, OLMoE's routing statistics, Megatron-LM's router tracer) into a keel::Trace.
// ReadTrace (monitor/trace.h) calls them with default options; docs/traces.md maps each format.
#pragma once

#include <functional>
#include <string>

#include "keel/status.hpp"
#include "monitor/trace.h"

namespace keel {

// Guesses the format of `path` (a file or a directory) from its name and first line; fails with
// the list of formats when nothing fits.
Result<TraceFormat> DetectTraceFormat(const std::string& path);

// Progress of a long import: `done` of `total` units (files, lines) read so far.
using TraceImportProgress = std::function<void(int done, int total)>;

// SmartMoE artifact (thu-pacman/SmartMoE-AE, moe_trace/): `path` is the folder of
// table_iter{N}_rank{R}.log files, a folder holding moe_trace/ or a single *.tar.xz of it, or the
// .tar.xz itself (extracted with `tar -xJf` into a fresh temporary folder, always removed).
// One step per iteration N (ascending; step_ids = N), one source per rank R, and
// row[source][expert] = that rank's selections of the expert summed over its microbatches.
struct SmartMoeImportOptions {
  TraceImportProgress progress;  // called with (files read, files in all); may be empty
};
Result<Trace> ImportSmartMoeTrace(const std::string& path,
                                  const SmartMoeImportOptions& options = {});

// ESFT expert scores (deepseek-ai/ESFT, results/expert_scores/<task>/): `path` is one task's
// folder of expert_weights_{1..L}.txt, or the folder of several tasks' folders. Line i of every
// file is sequence i; file N is MoE layer N, stored as layer N-1. A step groups
// `sequences_per_step` consecutive sequences (the last step may hold fewer; step_ids = index of
// its first sequence). Counts are expert ids per expert. Every step keeps its sequences
// (Trace::sequences: the task as group, ids / top_k tokens). Several tasks are mixed, as real
// batches are: their sequences (tasks in name order) are shuffled with `mix_seed`.
struct EsftImportOptions {
  int sequences_per_step = 1;
  int num_experts = 64;  // DeepSeek-V2-Lite routes over 64 experts; larger ids are an error
  int top_k = 6;         // ids per token; a line whose ids are not a multiple is an error
  bool keep_sequences = true;
  uint64_t mix_seed = 1;
};
Result<Trace> ImportEsftTrace(const std::string& path, const EsftImportOptions& options = {});

// OLMoE routing statistics, as converted to expert_counts_derived.json
// (models[model][kind][domain] = [[count per expert] per recorded layer]). `path` is the file or
// its folder. One step per domain, in sorted order (the description lists them); no sources.
struct OlmoeImportOptions {
  std::string model = "olmoe";         // "olmoe", "mistral", "olmoe-sft", "olmoe-dpo"
  std::string kind = "expert_counts";  // or "expert_counts_top1"
};
Result<Trace> ImportOlmoeTrace(const std::string& path, const OlmoeImportOptions& options = {});

// Megatron-LM router tracer (megatron/core/transformer/moe/router_trace.py, enabled with
// --moe-routing-trace-path): one router_trace_rank{R}.jsonl per rank, one record per
// (step, layer, rank) with "top_indices" [num_tokens][topk]. `path` is one such file or the
// folder of them. Records with "expert_counts" [num_experts] instead of "top_indices" are also
// accepted. Records of the same (step, layer, rank) add up (microbatches). Layers are the
// distinct "layer" values in ascending order; sources are the distinct ranks in ascending order.
struct MegatronImportOptions {
  int num_experts = 0;       // 0: largest expert id seen + 1
  bool per_source = true;    // false: sum over ranks (num_sources 0)
  bool include_mtp = false;  // multi-token-prediction records (block "mtp") are skipped unless set
  TraceImportProgress progress;  // (records read, 0)
};
Result<Trace> ImportMegatronTrace(const std::string& path,
                                  const MegatronImportOptions& options = {});

}  // namespace keel
