// Tests of the trace importers on small inputs written here (SmartMoE tables and archive, ESFT
// expert ids, OLMoE counts, Megatron-LM router records), and on the shared real traces when the
// folder KEEL_SHARED_TRACES exists.
#include "monitor/trace_import.h"

#include <gtest/gtest.h>
#include <stdlib.h>

#include <cstdlib>
#include <filesystem>
#include <numeric>
#include <string>

#include "monitor/trace.h"
#include "tests/monitor/trace_test_util.h"

namespace keel {
namespace {

using ::keel::testing::ScratchFolder;
using ::keel::testing::SharedTraces;

double Sum(std::span<const double> values) {
  return std::accumulate(values.begin(), values.end(), 0.0);
}

// Two iterations x two ranks, 2 layers, 3 experts, 2 microbatches; the count of (iteration i,
// rank r, layer l, microbatch m, expert e) is i + 10r + 100l + 1000m + e.
void WriteSmartMoeTables(const ScratchFolder& folder, const std::string& sub) {
  for (int iteration : {11, 1}) {
    for (int rank = 0; rank < 2; ++rank) {
      std::string text;
      for (int layer = 1; layer >= 0; --layer) {  // any line order
        text += std::to_string(layer) + ":[";
        for (int microbatch = 0; microbatch < 2; ++microbatch) {
          text += microbatch ? ", [" : "[";
          for (int e = 0; e < 3; ++e) {
            text += (e ? ", " : "") +
                    std::to_string(iteration + 10 * rank + 100 * layer + 1000 * microbatch + e) +
                    ".0";
          }
          text += "]";
        }
        text += "]\n";
      }
      folder.Write(
          sub + "/table_iter" + std::to_string(iteration) + "_rank" + std::to_string(rank) + ".log",
          text);
    }
  }
}

void ExpectSmartMoeSample(const Trace& trace) {
  ASSERT_TRUE(trace.Validate().ok());
  EXPECT_EQ(trace.num_steps(), 2);
  EXPECT_EQ(trace.step_ids, (std::vector<int64_t>{1, 11}));
  EXPECT_EQ(trace.num_layers, 2);
  EXPECT_EQ(trace.num_experts, 3);
  EXPECT_EQ(trace.num_sources, 2);
  for (int step = 0; step < 2; ++step) {
    int iteration = step == 0 ? 1 : 11;
    for (int layer = 0; layer < 2; ++layer) {
      std::span<const double> row = trace.layer_row(step, layer);
      for (int rank = 0; rank < 2; ++rank) {
        for (int e = 0; e < 3; ++e) {
          double one = iteration + 10 * rank + 100 * layer + e;
          EXPECT_EQ(row[rank * 3 + e], one + (one + 1000));
        }
      }
    }
  }
}

TEST(SmartMoeImportTest, ReadsFolderOfTables) {
  ScratchFolder folder;
  WriteSmartMoeTables(folder, "moe_trace");
  Result<Trace> trace = ImportSmartMoeTrace(folder.File("moe_trace"));
  ASSERT_TRUE(trace.ok()) << trace.status().ToString();
  ExpectSmartMoeSample(*trace);
  // The parent folder works too (it holds moe_trace/), and so does auto-detection.
  trace = ReadTrace(folder.path());
  ASSERT_TRUE(trace.ok()) << trace.status().ToString();
  ExpectSmartMoeSample(*trace);
}

TEST(SmartMoeImportTest, ReadsArchiveAndRemovesScratch) {
  ScratchFolder folder;
  WriteSmartMoeTables(folder, "moe_trace");
  std::string command =
      "tar -cJf '" + folder.File("moe_trace.tar.xz") + "' -C '" + folder.path() + "' moe_trace";
  ASSERT_EQ(std::system(command.c_str()), 0);
  std::filesystem::remove_all(folder.File("moe_trace"));
  ScratchFolder tmp;
  const char* old_tmpdir = std::getenv("TMPDIR");
  std::string saved = old_tmpdir ? old_tmpdir : "";
  setenv("TMPDIR", tmp.path().c_str(), 1);
  int progress_calls = 0;
  SmartMoeImportOptions options;
  options.progress = [&](int done, int total) {
    ++progress_calls;
    EXPECT_LE(done, total);
  };
  Result<Trace> trace = ImportSmartMoeTrace(folder.File("moe_trace.tar.xz"), options);
  ASSERT_TRUE(trace.ok()) << trace.status().ToString();
  ExpectSmartMoeSample(*trace);
  EXPECT_GT(progress_calls, 0);
  EXPECT_TRUE(std::filesystem::is_empty(tmp.path()));

  // A folder holding just the archive is read the same way.
  trace = ReadTrace(folder.path(), TraceFormat::kSmartMoe);
  ASSERT_TRUE(trace.ok()) << trace.status().ToString();
  EXPECT_TRUE(std::filesystem::is_empty(tmp.path()));

  // A broken archive fails, and the scratch folder is still removed.
  folder.Write("broken/moe_trace.tar.xz", "not an archive");
  trace = ImportSmartMoeTrace(folder.File("broken/moe_trace.tar.xz"));
  EXPECT_FALSE(trace.ok());
  EXPECT_NE(trace.status().message().find("tar"), std::string::npos);
  EXPECT_TRUE(std::filesystem::is_empty(tmp.path()));

  if (old_tmpdir) {
    setenv("TMPDIR", saved.c_str(), 1);
  } else {
    unsetenv("TMPDIR");
  }
}

TEST(SmartMoeImportTest, ErrorsNameFileAndLine) {
  ScratchFolder folder;
  WriteSmartMoeTables(folder, "t");
  std::filesystem::remove(folder.File("t/table_iter11_rank1.log"));
  Result<Trace> trace = ImportSmartMoeTrace(folder.File("t"));
  ASSERT_FALSE(trace.ok());
  EXPECT_NE(trace.status().message().find("table_iter11_rank1.log is missing"), std::string::npos)
      << trace.status().message();

  WriteSmartMoeTables(folder, "t");
  folder.Write("t/table_iter11_rank1.log", "0:[[1.0, 2.0, 3.0]]\n1:[[1.0, 2.0]]\n");
  trace = ImportSmartMoeTrace(folder.File("t"));
  ASSERT_FALSE(trace.ok());
  EXPECT_NE(trace.status().message().find("table_iter11_rank1.log:2"), std::string::npos)
      << trace.status().message();
  EXPECT_NE(trace.status().message().find("2 experts, expected 3"), std::string::npos);

  folder.Write("t/table_iter11_rank1.log", "0:[[1.0, -2.0, 3.0]]\n1:[[1.0, 2.0, 3.0]]\n");
  trace = ImportSmartMoeTrace(folder.File("t"));
  ASSERT_FALSE(trace.ok());
  EXPECT_NE(trace.status().message().find("table_iter11_rank1.log:1"), std::string::npos);
  EXPECT_NE(trace.status().message().find("negative"), std::string::npos);

  folder.Write("t/table_iter11_rank1.log", "0:[[1.0, 2.0, 3.0]]\n");
  trace = ImportSmartMoeTrace(folder.File("t"));
  ASSERT_FALSE(trace.ok());
  EXPECT_NE(trace.status().message().find("1 layers"), std::string::npos);
}

TEST(EsftImportTest, CountsIdsPerExpertAndGroupsSequences) {
  ScratchFolder folder;
  // 2 layers, 3 sequences of 1, 2 and 1 tokens with top-2 ids over 4 experts.
  folder.Write("task/expert_weights_1.txt",
               "0\t1\t\t0.5\t0.5\n2\t3\t0\t3\t\t0.1\t0.2\t0.3\t0.4\n1\t2\t\t0.5\t0.5\n");
  folder.Write("task/expert_weights_2.txt",
               "3\t3\t\t0.5\t0.5\n1\t1\t1\t2\t\t0.1\t0.2\t0.3\t0.4\n0\t2\t\t0.5\t0.5\n");
  EsftImportOptions options;
  options.num_experts = 4;
  options.top_k = 2;
  Result<Trace> trace = ImportEsftTrace(folder.File("task"), options);
  ASSERT_TRUE(trace.ok()) << trace.status().ToString();
  ASSERT_TRUE(trace->Validate().ok());
  EXPECT_EQ(trace->num_steps(), 3);
  EXPECT_EQ(trace->num_layers, 2);
  EXPECT_EQ(trace->num_experts, 4);
  EXPECT_EQ(trace->num_sources, 0);
  EXPECT_EQ(trace->ExpertCounts(1, 0), (std::vector<double>{1, 0, 1, 2}));
  EXPECT_EQ(trace->ExpertCounts(0, 1), (std::vector<double>{0, 0, 0, 2}));
  // Every step keeps its sequence: the task as group, ids / top_k tokens, counts per layer.
  ASSERT_TRUE(trace->has_sequences());
  ASSERT_EQ(trace->sequences[1].size(), 1u);
  EXPECT_EQ(trace->sequences[1][0].group, "task");
  EXPECT_EQ(trace->sequences[1][0].tokens, 2);
  EXPECT_EQ(trace->sequences[1][0].counts, (std::vector<double>{1, 0, 1, 2, 0, 3, 1, 0}));

  options.sequences_per_step = 2;
  trace = ImportEsftTrace(folder.File("task"), options);
  ASSERT_TRUE(trace.ok()) << trace.status().ToString();
  EXPECT_EQ(trace->num_steps(), 2);
  EXPECT_EQ(trace->step_ids, (std::vector<int64_t>{0, 2}));
  EXPECT_EQ(trace->ExpertCounts(0, 0), (std::vector<double>{2, 1, 1, 2}));
  EXPECT_EQ(trace->ExpertCounts(1, 1), (std::vector<double>{1, 0, 1, 0}));
  ASSERT_EQ(trace->sequences[0].size(), 2u);
  EXPECT_EQ(trace->sequences[0][0].tokens + trace->sequences[0][1].tokens, 3);

  options.top_k = 4;
  EXPECT_NE(ImportEsftTrace(folder.File("task"), options)
                .status()
                .message()
                .find("expert_weights_1.txt:1: 2 expert ids is not a multiple of top_k 4"),
            std::string::npos);
  options.top_k = 2;
  options.sequences_per_step = 0;
  EXPECT_NE(
      ImportEsftTrace(folder.File("task"), options).status().message().find("sequences_per_step 0"),
      std::string::npos);
}

TEST(EsftImportTest, ErrorsNameFileAndLine) {
  ScratchFolder folder;
  folder.Write("a/expert_weights_1.txt", "0\t1\t\t0.5\t0.5\n0\t9\t\t0.5\t0.5\n");
  Result<Trace> trace = ImportEsftTrace(folder.File("a"), {.num_experts = 4, .top_k = 2});
  ASSERT_FALSE(trace.ok());
  EXPECT_NE(trace.status().message().find("expert_weights_1.txt:2"), std::string::npos)
      << trace.status().message();
  EXPECT_NE(trace.status().message().find("expert id 9"), std::string::npos);

  folder.Write("b/expert_weights_1.txt", "0\t1\t\t0.5\n");
  trace = ImportEsftTrace(folder.File("b"));
  ASSERT_FALSE(trace.ok());
  EXPECT_NE(trace.status().message().find("2 expert ids but 1 gate weights"), std::string::npos);

  folder.Write("c/expert_weights_1.txt", "0\t1\t\t0.5\t0.5\n");
  folder.Write("c/expert_weights_3.txt", "0\t1\t\t0.5\t0.5\n");
  trace = ImportEsftTrace(folder.File("c"));
  ASSERT_FALSE(trace.ok());
  EXPECT_NE(trace.status().message().find("expert_weights_2.txt is missing"), std::string::npos);

  folder.Write("d/expert_weights_1.txt", "0\t1\t\t0.5\t0.5\n0\t1\t\t0.5\t0.5\n");
  folder.Write("d/expert_weights_2.txt", "0\t1\t\t0.5\t0.5\n");
  trace = ImportEsftTrace(folder.File("d"), {.top_k = 2});
  ASSERT_FALSE(trace.ok());
  EXPECT_NE(trace.status().message().find("1 sequences"), std::string::npos);

  // A sequence's tokens must agree between layers.
  folder.Write("e/expert_weights_1.txt", "0\t1\t\t0.5\t0.5\n");
  folder.Write("e/expert_weights_2.txt", "0\t1\t2\t3\t\t0.5\t0.5\t0.5\t0.5\n");
  trace = ImportEsftTrace(folder.File("e"), {.num_experts = 4, .top_k = 2});
  ASSERT_FALSE(trace.ok());
  EXPECT_NE(trace.status().message().find("expert_weights_2.txt:1: 2 tokens, but"),
            std::string::npos)
      << trace.status().message();
}

TEST(EsftImportTest, AFolderOfTasksMixesTheirSequences) {
  ScratchFolder folder;
  // Two tasks of one layer, top-1 over 2 experts: task "a" always picks expert 0, "b" expert 1.
  folder.Write("all/a/expert_weights_1.txt", "0\t\t1\n0\t0\t\t1\t1\n0\t\t1\n");
  folder.Write("all/b/expert_weights_1.txt", "1\t1\t1\t\t1\t1\t1\n1\t\t1\n");
  folder.Write("all/SOURCE.md", "not a task");
  ASSERT_EQ(DetectTraceFormat(folder.File("all")).value(), TraceFormat::kEsft);
  EsftImportOptions options{.sequences_per_step = 2, .num_experts = 2, .top_k = 1};
  Result<Trace> trace = ImportEsftTrace(folder.File("all"), options);
  ASSERT_TRUE(trace.ok()) << trace.status().ToString();
  EXPECT_EQ(trace->num_steps(), 3);
  int64_t tokens[2] = {0, 0};
  int sequences[2] = {0, 0};
  for (int step = 0; step < trace->num_steps(); ++step) {
    std::vector<double> summed(2, 0.0);
    for (const TraceSequence& sequence : trace->sequences[step]) {
      const int task = sequence.group == "a" ? 0 : 1;
      ASSERT_TRUE(sequence.group == "a" || sequence.group == "b");
      // A sequence's counts are its own task's expert.
      EXPECT_EQ(sequence.counts[task], static_cast<double>(sequence.tokens));
      EXPECT_EQ(sequence.counts[1 - task], 0.0);
      tokens[task] += sequence.tokens;
      ++sequences[task];
      for (int e = 0; e < 2; ++e) summed[e] += sequence.counts[e];
    }
    // The step's counts are its sequences' sums.
    EXPECT_EQ(trace->ExpertCounts(step, 0), summed);
  }
  EXPECT_EQ(sequences[0], 3);
  EXPECT_EQ(sequences[1], 2);
  EXPECT_EQ(tokens[0], 4);
  EXPECT_EQ(tokens[1], 4);
  EXPECT_NE(trace->description.find("a 3, b 2, mixed with seed 1"), std::string::npos)
      << trace->description;
  // The same seed mixes the same way; the order is a shuffle, not the tasks one after another.
  Result<Trace> again = ImportEsftTrace(folder.File("all"), options);
  ASSERT_TRUE(again.ok());
  std::string order;
  for (int step = 0; step < trace->num_steps(); ++step) {
    for (size_t i = 0; i < trace->sequences[step].size(); ++i) {
      EXPECT_EQ(trace->sequences[step][i].group, again->sequences[step][i].group);
      EXPECT_EQ(trace->sequences[step][i].counts, again->sequences[step][i].counts);
      order += trace->sequences[step][i].group;
    }
  }
  EXPECT_NE(order, "aaabb");
}

constexpr const char* kOlmoeSample = R"({"layers": [0, 7, 15], "models": {
  "olmoe": {"expert_counts": {"github": [[1, 2], [3, 4], [5, 6]], "arxiv": [[7, 8], [9, 10],
            [11, 12]]}, "expert_counts_top1": {"arxiv": [[1, 0], [0, 1], [1, 1]]}},
  "mistral": {"expert_counts": {"c4": [[1, 1], [1, 1]]}}}})";

TEST(OlmoeImportTest, OneStepPerDomainInSortedOrder) {
  ScratchFolder folder;
  std::string path = folder.Write("expert_counts_derived.json", kOlmoeSample);
  Result<Trace> trace = ImportOlmoeTrace(path);
  ASSERT_TRUE(trace.ok()) << trace.status().ToString();
  ASSERT_TRUE(trace->Validate().ok());
  EXPECT_EQ(trace->num_steps(), 2);
  EXPECT_EQ(trace->num_layers, 3);
  EXPECT_EQ(trace->num_experts, 2);
  EXPECT_EQ(trace->num_sources, 0);
  EXPECT_EQ(trace->ExpertCounts(0, 2), (std::vector<double>{11, 12}));  // arxiv first
  EXPECT_EQ(trace->ExpertCounts(1, 0), (std::vector<double>{1, 2}));    // then github
  EXPECT_NE(trace->description.find("arxiv,github"), std::string::npos) << trace->description;

  trace = ImportOlmoeTrace(folder.path(), {.model = "mistral", .kind = "expert_counts"});
  ASSERT_TRUE(trace.ok()) << trace.status().ToString();
  EXPECT_EQ(trace->num_layers, 2);

  trace = ImportOlmoeTrace(path, {.model = "gpt"});
  ASSERT_FALSE(trace.ok());
  EXPECT_NE(trace.status().message().find("models: mistral, olmoe"), std::string::npos)
      << trace.status().message();
  trace = ImportOlmoeTrace(path, {.model = "olmoe", .kind = "top9"});
  ASSERT_FALSE(trace.ok());
  EXPECT_NE(trace.status().message().find("kinds: expert_counts, expert_counts_top1"),
            std::string::npos);
}

TEST(OlmoeImportTest, RejectsRaggedLayers) {
  ScratchFolder folder;
  std::string path =
      folder.Write("expert_counts_derived.json",
                   R"({"models": {"olmoe": {"expert_counts": {"a": [[1, 2], [3]]}}}})");
  Result<Trace> trace = ImportOlmoeTrace(path);
  ASSERT_FALSE(trace.ok());
  EXPECT_NE(trace.status().message().find("models.olmoe.expert_counts.a: layer 1 has 1 counts"),
            std::string::npos)
      << trace.status().message();
}

TEST(MegatronImportTest, AggregatesRecordsIntoSteps) {
  ScratchFolder folder;
  // Rank 0: step 0 layer 3 in two microbatches, step 0 layer 1, step 1 layer 1; an MTP record.
  folder.Write(
      "run/router_trace_rank0.jsonl",
      R"({"step": 0, "stage": "pre_dispatch", "block": "decoder", "layer": 3, "rank": 0, "num_tokens": 2, "topk": 2, "top_indices": [[0, 1], [1, 2]]}
{"step": 0, "block": "decoder", "layer": 3, "rank": 0, "num_tokens": 1, "topk": 2, "top_indices": [[2, 3]]}
{"step": 0, "block": "decoder", "layer": 1, "rank": 0, "num_tokens": 1, "topk": 2, "top_indices": [[0, 3]]}
{"step": 1, "block": "decoder", "layer": 1, "rank": 0, "num_tokens": 1, "topk": 2, "top_indices": [[3, 2]]}
{"step": 0, "block": "mtp", "mtp_idx": 0, "layer": 1, "rank": 0, "num_tokens": 1, "topk": 2, "top_indices": [[0, 1]]}
)");
  folder.Write(
      "run/router_trace_rank1.jsonl",
      R"({"step": 0, "block": "decoder", "layer": 1, "rank": 1, "num_tokens": 1, "topk": 2, "top_indices": [[1, 2]]}
{"step": 1, "layer": 3, "rank": 1, "expert_counts": [0, 5, 0, 1]}
)");
  Result<Trace> trace = ReadTrace(folder.File("run"));
  ASSERT_TRUE(trace.ok()) << trace.status().ToString();
  ASSERT_TRUE(trace->Validate().ok());
  EXPECT_EQ(trace->num_steps(), 2);
  EXPECT_EQ(trace->step_ids, (std::vector<int64_t>{0, 1}));
  EXPECT_EQ(trace->num_layers, 2);  // model layers 1 and 3
  EXPECT_EQ(trace->num_experts, 4);
  EXPECT_EQ(trace->num_sources, 2);
  auto row = [&](int step, int layer) {
    std::span<const double> values = trace->layer_row(step, layer);
    return std::vector<double>(values.begin(), values.end());
  };
  EXPECT_EQ(row(0, 0), (std::vector<double>{1, 0, 0, 1, 0, 1, 1, 0}));
  EXPECT_EQ(row(0, 1), (std::vector<double>{1, 2, 2, 1, 0, 0, 0, 0}));
  EXPECT_EQ(row(1, 1), (std::vector<double>{0, 0, 0, 0, 0, 5, 0, 1}));
  EXPECT_NE(trace->description.find("model layers [1,3]"), std::string::npos);

  MegatronImportOptions options;
  options.per_source = false;
  options.include_mtp = true;
  options.num_experts = 8;
  trace = ImportMegatronTrace(folder.File("run"), options);
  ASSERT_TRUE(trace.ok()) << trace.status().ToString();
  EXPECT_EQ(trace->num_sources, 0);
  EXPECT_EQ(trace->num_layers, 3);  // 1, 3, mtp0.1
  EXPECT_EQ(trace->num_experts, 8);
  EXPECT_EQ(Sum(trace->layer_row(0, 2)), 2.0);
  EXPECT_EQ(Sum(trace->layer_row(0, 0)), 4.0);

  options.num_experts = 3;
  EXPECT_FALSE(ImportMegatronTrace(folder.File("run"), options).ok());
}

TEST(MegatronImportTest, ErrorsNameFileAndLine) {
  ScratchFolder folder;
  std::string path = folder.Write("r.jsonl",
                                  "{\"step\": 0, \"layer\": 1, \"top_indices\": [[0, 1]]}\n"
                                  "{\"step\": 0, \"layer\": 1, \"top_indices\": [[0, \"a\"]]}\n");
  Result<Trace> trace = ImportMegatronTrace(path);
  ASSERT_FALSE(trace.ok());
  EXPECT_NE(trace.status().message().find("r.jsonl:2"), std::string::npos)
      << trace.status().message();
  path = folder.Write("s.jsonl", "{\"step\": 0, \"top_indices\": [[0, 1]]}\n");
  trace = ImportMegatronTrace(path);
  ASSERT_FALSE(trace.ok());
  EXPECT_NE(trace.status().message().find("s.jsonl:1: record has no \"layer\""), std::string::npos)
      << trace.status().message();
  path = folder.Write("t.jsonl", "{\"step\": 0, \"layer\": 1, \"top_indices\": [[0, 1]]\n");
  EXPECT_NE(ImportMegatronTrace(path).status().message().find("t.jsonl:1"), std::string::npos);
}

// Importers that expand their input into dense counts check the expansion before they allocate
// it: sparse ids of steps, layers, ranks and experts (Megatron), blank lines that count as layers
// (SmartMoE) or sequences (ESFT). Each input is a few kilobytes; each used to take gigabytes.
TEST(TraceImportBoundsTest, ExpansionsBeyondTheCountsATraceHoldsAreRefused) {
  ScratchFolder folder;
  std::string sparse;
  for (int i = 0; i < 20; ++i) {
    sparse += "{\"step\": " + std::to_string(1000000 * i) +
              ", \"layer\": " + std::to_string(1000 * i) +
              ", \"rank\": " + std::to_string(100 * i) + ", \"top_indices\": [[65535]]}\n";
  }
  std::string experts = "1";  // a first layer of 16,384 experts
  for (int e = 1; e < 16384; ++e) experts += ",1";
  struct Case {
    std::string name;
    Result<Trace> (*import)(const std::string&);
    std::string path;
    std::string expected;
  };
  const Case cases[] = {
      {"megatron sparse ids", [](const std::string& path) { return ImportMegatronTrace(path); },
       folder.Write("sparse.jsonl", sparse),
       "sparse.jsonl: 20 steps of num_layers x num_sources x num_experts = 20 x 20 x 65536 counts, "
       "more than the 67108864 counts (512 MiB) a trace may hold"},
      {"smartmoe blank layers", [](const std::string& path) { return ImportSmartMoeTrace(path); },
       (folder.Write("blank/table_iter0_rank0.log",
                     "0:[[" + experts + "]]\n" + std::string(60000, '\n') + "1:[[1]]\n"),
        folder.File("blank")),
       "table_iter0_rank0.log: num_layers x num_sources x num_experts = 60002 x 1 x "},
      {"esft blank sequences",
       [](const std::string& path) {
         EsftImportOptions options;
         options.num_experts = 65536;
         return ImportEsftTrace(path, options);
       },
       (folder.Write("task/expert_weights_1.txt", std::string(40000, '\n') + "1\t2\t3\t4\t5\t6\n"),
        folder.File("task")),
       "40001 sequences of 1 layers x 65536 experts hold more counts than the 67108864 counts (512 "
       "MiB) a trace may hold"},
  };
  for (const Case& c : cases) {
    Result<Trace> trace = c.import(c.path);
    ASSERT_FALSE(trace.ok()) << c.name;
    EXPECT_EQ(trace.status().code(), StatusCode::kInvalidArgument) << c.name;
    EXPECT_NE(trace.status().message().find(c.expected), std::string::npos)
        << c.name << ": " << trace.status().message();
  }
  // Records of distinct steps, each a row up to expert 65535: refused at the record that takes
  // them past the limit, before the rows of the rest are allocated.
  std::string rows;
  for (int step = 0; step < 1100; ++step) {
    rows += "{\"step\": " + std::to_string(step) + ", \"layer\": 0, \"top_indices\": [[65535]]}\n";
  }
  Result<Trace> trace = ImportMegatronTrace(folder.Write("rows.jsonl", rows));
  ASSERT_FALSE(trace.ok());
  EXPECT_NE(trace.status().message().find("rows.jsonl:1025: expert id 65535 takes the records' "
                                          "counts"),
            std::string::npos)
      << trace.status().message();
}

// Every reader reads numbers exactly: an integer beyond its field's range is named with the value
// as written (never wrapped to a negative one), a repeated JSON key is refused with its place
// (nlohmann kept the last), a quoted number is a string. One case per reader and field.
TEST(TraceReadersTest, NumbersAreReadExactlyAndKeysOnce) {
  struct Case {
    TraceFormat format;
    const char* file;  // written with `text`; the reader gets its folder's path for folder formats
    std::string text;
    const char* message;
  };
  const std::string keel_header =
      "{\"keel_trace\": 1, \"num_layers\": 1, \"num_experts\": 2, \"num_sources\": 0}\n";
  const std::string megatron = "{\"step\": 0, \"layer\": 0, \"expert_counts\": [1, 2]}\n";
  const Case cases[] = {
      // Keel traces: the header's integers and the step id.
      {TraceFormat::kKeel, "k.jsonl",
       "{\"keel_trace\": 1, \"num_layers\": 18446744073709551615, \"num_experts\": 2, "
       "\"num_sources\": 0}\n",
       "k.jsonl:1: header \"num_layers\" 18446744073709551615 is more than 1073741824"},
      {TraceFormat::kKeel, "k.jsonl",
       "{\"keel_trace\": 1, \"num_layers\": 2000000000, \"num_experts\": 2, "
       "\"num_sources\": 0}\n",
       "k.jsonl:1: header \"num_layers\" 2000000000 is more than 1073741824"},
      {TraceFormat::kKeel, "k.jsonl",
       "{\"keel_trace\": 1, \"num_layers\": 1, \"num_experts\": \"2\", \"num_sources\": 0}\n",
       "k.jsonl:1: header \"num_experts\" must be an integer, got \"2\""},
      {TraceFormat::kKeel, "k.jsonl",
       "{\"keel_trace\": 1, \"num_layers\": 1, \"num_layers\": 4, \"num_experts\": 2, "
       "\"num_sources\": 0}\n",
       "k.jsonl:1: key \"num_layers\" appears twice in one object at line 1, column 36"},
      {TraceFormat::kKeel, "k.jsonl",
       keel_header + "{\"step\": 18446744073709551615, \"layers\": [[1, 2]]}\n",
       "k.jsonl:2: step 18446744073709551615 is more than 9223372036854775807"},
      {TraceFormat::kKeel, "k.jsonl",
       keel_header + "{\"step\": 18446744073709551616, \"layers\": [[1, 2]]}\n",
       "k.jsonl:2: step 18446744073709551616 is more than 9223372036854775807"},
      {TraceFormat::kKeel, "k.jsonl", keel_header + "{\"step\": \"0\", \"layers\": [[1, 2]]}\n",
       "k.jsonl:2: step must be an integer, got \"0\""},
      {TraceFormat::kKeel, "k.jsonl",
       keel_header + "{\"step\": 0, \"layers\": [[1, 2]], \"layers\": [[3, 4]]}\n",
       "k.jsonl:2: key \"layers\" appears twice in one object at line 1, column 33"},
      // Megatron-LM router records: step, layer, rank, MTP head, expert ids.
      {TraceFormat::kMegatron, "m.jsonl",
       "{\"step\": 18446744073709551615, \"layer\": 0, \"expert_counts\": [1, 2]}\n",
       "m.jsonl:1: \"step\" 18446744073709551615 is more than 9223372036854775807"},
      {TraceFormat::kMegatron, "m.jsonl",
       "{\"iteration\": -1, \"layer\": 0, \"expert_counts\": [1, 2]}\n",
       "m.jsonl:1: \"iteration\" -1 is negative"},
      {TraceFormat::kMegatron, "m.jsonl",
       "{\"step\": 0, \"layer\": \"3\", \"expert_counts\": [1, 2]}\n",
       "m.jsonl:1: \"layer\" must be an integer, got \"3\""},
      {TraceFormat::kMegatron, "m.jsonl",
       "{\"step\": 0, \"layer\": 0, \"rank\": 18446744073709551615, \"expert_counts\": [1]}\n",
       "m.jsonl:1: \"rank\" 18446744073709551615 is more than 9223372036854775807"},
      {TraceFormat::kMegatron, "m.jsonl",
       "{\"step\": 0, \"layer\": 0, \"block\": 1, \"expert_counts\": [1]}\n",
       "m.jsonl:1: \"block\" must be a string, got 1"},
      {TraceFormat::kMegatron, "m.jsonl",
       "{\"step\": 0, \"layer\": 0, \"top_indices\": [[1, 18446744073709551615]]}\n",
       "m.jsonl:1: top_indices[0]: expert id 18446744073709551615 is more than 65535"},
      {TraceFormat::kMegatron, "m.jsonl",
       megatron + "{\"step\": 1, \"step\": 0, \"layer\": 0, \"expert_counts\": [1, 2]}\n",
       "m.jsonl:2: key \"step\" appears twice in one object at line 1, column 13"},
      // OLMoE's counts file.
      {TraceFormat::kOlmoe, "expert_counts_derived.json",
       "{\"models\": {\"olmoe\": {\"top8\": {\"law\": [[1, 2]],\n\"law\": [[3, 4]]}}}}",
       "expert_counts_derived.json: key \"law\" appears twice in one object at line 2, column 1"},
      // ESFT expert ids and SmartMoE layer numbers, beyond 64 bits.
      {TraceFormat::kEsft, "esft/expert_weights_1.txt", "1\t18446744073709551616\t\t0.5\t0.5\n",
       "expert_weights_1.txt:1: expert id 18446744073709551616 outside 0..63"},
      {TraceFormat::kSmartMoe, "sm/table_iter1_rank0.log", "99999999999999999999:[[1.0, 2.0]]\n",
       "table_iter1_rank0.log:1: column 1: integer 99999999999999999999 does not fit in 64 bits"},
  };
  for (const Case& c : cases) {
    ScratchFolder folder;
    const std::string path = folder.Write(c.file, c.text);
    const bool folder_format = c.format == TraceFormat::kEsft || c.format == TraceFormat::kSmartMoe;
    Result<Trace> trace = ReadTrace(
        folder_format ? std::filesystem::path(path).parent_path().string() : path, c.format);
    ASSERT_FALSE(trace.ok()) << c.text;
    EXPECT_EQ(trace.status().code(), StatusCode::kInvalidArgument) << trace.status().ToString();
    EXPECT_NE(trace.status().message().find(c.message), std::string::npos)
        << c.text << "\n-> " << trace.status().message();
  }
  // Multi-token-prediction heads, read when asked for.
  ScratchFolder folder;
  const std::string path = folder.Write(
      "m.jsonl", "{\"step\": 0, \"layer\": 0, \"mtp_idx\": -2, \"expert_counts\": [1]}\n");
  MegatronImportOptions options;
  options.include_mtp = true;
  Result<Trace> trace = ImportMegatronTrace(path, options);
  ASSERT_FALSE(trace.ok());
  EXPECT_NE(trace.status().message().find("m.jsonl:1: \"mtp_idx\" -2 is negative"),
            std::string::npos)
      << trace.status().message();
}

// ---- Real traces (skipped where the shared folder is absent) ----

TEST(SharedTraceTest, SmartMoe) {
  std::string shared = SharedTraces();
  if (shared.empty() || !std::filesystem::exists(shared + "/smartmoe-ae/moe_trace.tar.xz")) {
    GTEST_SKIP() << "no shared SmartMoE trace";
  }
  Result<Trace> trace = ReadTrace(shared + "/smartmoe-ae");
  ASSERT_TRUE(trace.ok()) << trace.status().ToString();
  ASSERT_TRUE(trace->Validate().ok());
  EXPECT_EQ(trace->num_steps(), 501);
  EXPECT_EQ(trace->num_layers, 24);
  EXPECT_EQ(trace->num_experts, 32);
  EXPECT_EQ(trace->num_sources, 16);
  EXPECT_EQ(trace->step_ids.front(), 1);
  EXPECT_EQ(trace->step_ids.back(), 5001);
  for (int step = 0; step < trace->num_steps(); ++step) {
    for (int layer = 0; layer < trace->num_layers; ++layer) {
      std::span<const double> row = trace->layer_row(step, layer);
      for (int source = 0; source < 16; ++source) {
        ASSERT_EQ(Sum(row.subspan(source * 32, 32)), 4.0 * 4096)
            << "step " << step << " layer " << layer << " source " << source;
      }
    }
  }
}

TEST(SharedTraceTest, EsftIntent) {
  std::string shared = SharedTraces();
  std::string task = shared + "/esft-dsv2lite/intent";
  if (shared.empty() || !std::filesystem::is_directory(task)) GTEST_SKIP() << "no ESFT trace";
  Result<Trace> trace = ReadTrace(task);
  ASSERT_TRUE(trace.ok()) << trace.status().ToString();
  ASSERT_TRUE(trace->Validate().ok());
  EXPECT_EQ(trace->num_steps(), 127);
  EXPECT_EQ(trace->num_layers, 26);
  EXPECT_EQ(trace->num_experts, 64);
  EXPECT_EQ(trace->num_sources, 0);
  // Tokens of each sequence from layer 1's file: ids / 6. Every layer routes them all, top-6.
  std::string text = ::keel::testing::ReadText(task + "/expert_weights_1.txt");
  std::vector<double> tokens;
  size_t start = 0;
  while (start < text.size()) {
    size_t end = text.find('\n', start);
    std::string line = text.substr(start, end - start);
    start = end == std::string::npos ? text.size() : end + 1;
    if (line.empty()) continue;
    std::string ids = line.substr(0, line.find("\t\t"));
    tokens.push_back((std::count(ids.begin(), ids.end(), '\t') + 1) / 6.0);
  }
  ASSERT_EQ(tokens.size(), 127u);
  double all_tokens = 0.0;
  for (int step = 0; step < 127; ++step) {
    for (int layer = 0; layer < 26; ++layer) {
      ASSERT_EQ(Sum(trace->layer_row(step, layer)), tokens[step] * 6)
          << "step " << step << " layer " << layer;
    }
    all_tokens += tokens[step];
  }
  EXPECT_GT(all_tokens, 8000);

  Result<Trace> grouped = ImportEsftTrace(task, {.sequences_per_step = 8});
  ASSERT_TRUE(grouped.ok());
  EXPECT_EQ(grouped->num_steps(), 16);
}

TEST(SharedTraceTest, Olmoe) {
  std::string shared = SharedTraces();
  std::string file = shared + "/olmoe-mixtral-routing/expert_counts_derived.json";
  if (shared.empty() || !std::filesystem::exists(file)) GTEST_SKIP() << "no OLMoE counts";
  Result<Trace> trace = ReadTrace(file);
  ASSERT_TRUE(trace.ok()) << trace.status().ToString();
  ASSERT_TRUE(trace->Validate().ok());
  EXPECT_EQ(trace->num_steps(), 6);  // arxiv, book, c4, github, tulu, wikipedia
  EXPECT_EQ(trace->num_layers, 3);
  EXPECT_EQ(trace->num_experts, 64);
  // arxiv: 208,896 tokens x top-8 at every recorded layer.
  for (int layer = 0; layer < 3; ++layer) {
    EXPECT_EQ(Sum(trace->layer_row(0, layer)), 208896.0 * 8);
  }
  Result<Trace> mixtral = ImportOlmoeTrace(file, {.model = "mistral", .kind = "expert_counts"});
  ASSERT_TRUE(mixtral.ok());
  EXPECT_EQ(mixtral->num_steps(), 5);
  EXPECT_EQ(mixtral->num_experts, 8);
  EXPECT_EQ(Sum(mixtral->layer_row(4, 2)), 208896.0 * 2);
}

}  // namespace
}  // namespace keel
