// Tests of the Keel trace format: writer/reader round trips, reader errors that name the line,
// format names, format guessing and Trace's own helpers.
#include "monitor/trace.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <string>

#include "monitor/trace_import.h"
#include "tests/common/test_util.h"
#include "tests/monitor/trace_test_util.h"

namespace keel {
namespace {

using ::keel::testing::ReadText;
using ::keel::testing::ScopedEnvironment;
using ::keel::testing::ScratchFolder;

Trace SmallTrace(int num_sources) {
  Trace trace;
  trace.description = "unit \"test\" trace";
  trace.num_layers = 2;
  trace.num_experts = 3;
  trace.num_sources = num_sources;
  const int row = trace.row_size();
  for (int step = 0; step < 3; ++step) {
    trace.step_ids.push_back(10 * step + 1);
    std::vector<double> values;
    for (int i = 0; i < 2 * row; ++i) values.push_back(step * 100 + i);
    trace.steps.push_back(values);
  }
  trace.steps[1][2] = 2.5;   // a fractional count (an averaged load) survives exactly
  trace.steps[2][0] = 1e15;  // the largest count a trace may hold, written exactly
  return trace;
}

void ExpectSameTrace(const Trace& a, const Trace& b) {
  EXPECT_EQ(a.description, b.description);
  EXPECT_EQ(a.num_layers, b.num_layers);
  EXPECT_EQ(a.num_experts, b.num_experts);
  EXPECT_EQ(a.num_sources, b.num_sources);
  EXPECT_EQ(a.step_ids, b.step_ids);
  EXPECT_EQ(a.steps, b.steps);
  ASSERT_EQ(a.sequences.size(), b.sequences.size());
  for (size_t step = 0; step < a.sequences.size(); ++step) {
    ASSERT_EQ(a.sequences[step].size(), b.sequences[step].size());
    for (size_t i = 0; i < a.sequences[step].size(); ++i) {
      EXPECT_EQ(a.sequences[step][i].group, b.sequences[step][i].group);
      EXPECT_EQ(a.sequences[step][i].tokens, b.sequences[step][i].tokens);
      EXPECT_EQ(a.sequences[step][i].counts, b.sequences[step][i].counts);
    }
  }
}

TEST(KeelTraceTest, RoundTripWithSources) {
  ScratchFolder folder;
  Trace trace = SmallTrace(2);
  ASSERT_TRUE(WriteKeelTrace(trace, folder.File("t.jsonl")).ok());
  Result<Trace> read = ReadKeelTrace(folder.File("t.jsonl"));
  ASSERT_TRUE(read.ok()) << read.status().ToString();
  ExpectSameTrace(trace, *read);
  EXPECT_FALSE(std::filesystem::exists(folder.File("t.jsonl.tmp")));
}

TEST(KeelTraceTest, RoundTripPerExpertAndEmpty) {
  ScratchFolder folder;
  Trace trace = SmallTrace(0);
  ASSERT_TRUE(WriteKeelTrace(trace, folder.File("t.jsonl")).ok());
  Result<Trace> read = ReadTrace(folder.File("t.jsonl"));  // auto-detected as keel
  ASSERT_TRUE(read.ok()) << read.status().ToString();
  ExpectSameTrace(trace, *read);

  trace.steps.clear();
  trace.step_ids.clear();
  ASSERT_TRUE(WriteKeelTrace(trace, folder.File("empty.jsonl")).ok());
  read = ReadKeelTrace(folder.File("empty.jsonl"));
  ASSERT_TRUE(read.ok()) << read.status().ToString();
  EXPECT_EQ(read->num_steps(), 0);
}

TEST(KeelTraceTest, RoundTripWithSequences) {
  ScratchFolder folder;
  Trace trace = SmallTrace(0);
  // Step 0 has two sequences, step 1 none, step 2 one with a group that needs escaping.
  trace.sequences = {{{"law", 3, {1, 2, 0, 0, 0, 6}}, {"", 1, {0, 0, 2, 1, 1, 0}}},
                     {},
                     {{"a \"quoted\" task", 7, {2.5, 0, 0, 1e15, 0, 0}}}};
  ASSERT_TRUE(WriteKeelTrace(trace, folder.File("t.jsonl")).ok());
  Result<Trace> read = ReadKeelTrace(folder.File("t.jsonl"));
  ASSERT_TRUE(read.ok()) << read.status().ToString();
  ExpectSameTrace(trace, *read);

  // A sequence of the wrong shape is refused by Validate, so by the writer too.
  trace.sequences[0][1].counts.pop_back();
  EXPECT_NE(WriteKeelTrace(trace, folder.File("u.jsonl"))
                .message()
                .find("step 0 sequence 1 has 5 counts, expected 6"),
            std::string::npos);
}

TEST(KeelTraceTest, WriterFormatsIntegersWithoutFraction) {
  ScratchFolder folder;
  Trace trace = SmallTrace(0);
  ASSERT_TRUE(WriteKeelTrace(trace, folder.File("t.jsonl")).ok());
  std::string text = ReadText(folder.File("t.jsonl"));
  EXPECT_NE(text.find("{\"step\": 1, \"layers\": [[0, 1, 2], [3, 4, 5]]}\n"), std::string::npos)
      << text;
  EXPECT_NE(text.find("2.5"), std::string::npos);
  EXPECT_NE(text.find("[[1000000000000000, 201, 202]"), std::string::npos) << text;
  EXPECT_EQ(text.find(".0,"), std::string::npos);
  EXPECT_EQ(text.rfind("{\"keel_trace\": 1", 0), 0u) << text;
}

TEST(KeelTraceTest, FailedWriteLeavesExistingFile) {
  ScratchFolder folder;
  std::string path = folder.Write("t.jsonl", "precious");
  Trace bad = SmallTrace(0);
  bad.steps[1].pop_back();  // ragged: Validate fails before anything is written
  Status status = WriteKeelTrace(bad, path);
  EXPECT_FALSE(status.ok());
  EXPECT_NE(status.message().find("step 1"), std::string::npos) << status.message();
  EXPECT_EQ(ReadText(path), "precious");
  EXPECT_FALSE(std::filesystem::exists(path + ".tmp"));

  status = WriteKeelTrace(SmallTrace(0), folder.File("no/such/folder/t.jsonl"));
  EXPECT_EQ(status.code(), StatusCode::kIoError);
}

constexpr const char* kHeader =
    "{\"keel_trace\": 1, \"description\": \"d\", \"num_layers\": 2, \"num_experts\": 3, "
    "\"num_sources\": 0}\n";

TEST(KeelTraceTest, ReaderErrorsNameLineAndProblem) {
  struct Case {
    std::string text;
    std::string line;
    std::string words;
  };
  const std::string good = "{\"step\": 0, \"layers\": [[1, 2, 3], [4, 5, 6]]}\n";
  const Case cases[] = {
      {std::string(kHeader) + good + "{\"step\": 1, \"layers\": [[1, 2, 3], [4, 5]]}\n",
       ":3:", "layer 1 has 2 counts, expected 3"},
      {std::string(kHeader) + "{\"step\": 0, \"layers\": [[1, -2, 3], [4, 5, 6]]}\n",
       ":2:", "entry 1 is not a count in [0, 1e15]: -2"},
      {std::string(kHeader) + "{\"step\": 0, \"layers\": [[1, 2, 3]]}\n",
       ":2:", "1 layers, header says num_layers 2"},
      {std::string(kHeader) + good + "{\"step\": 1, \"layers\": [[1, 2, 3], [4,",
       ":3:", "truncated"},
      {std::string(kHeader) + "{\"step\": 0, \"layers\": [[1, \"x\", 3], [4, 5, 6]]}\n",
       ":2:", "not a number"},
      {std::string(kHeader) + "{\"layers\": [[1, 2, 3], [4, 5, 6]]}\n", ":2:", "\"step\""},
      {"{\"keel_trace\": 1, \"num_layers\": 2, \"num_sources\": 0}\n", ":1:", "\"num_experts\""},
      {"{\"keel_trace\": 1, \"num_layers\": -2, \"num_experts\": 3, \"num_sources\": 0}\n",
       ":1:", "\"num_layers\" -2"},
      {"{\"step\": 1}\n", ":1:", "Keel header"},
      {"{\"keel_trace\": 1, \"num_layers\": 1000000, \"num_experts\": 1000000, "
       "\"num_sources\": 1000000}\n",
       ":1:", "num_layers 1000000 is more than 65536"},
      {"{\"keel_trace\": 1, \"num_layers\": 64, \"num_experts\": 2048, \"num_sources\": 1024}\n",
       ":1:",
       "num_layers x num_sources x num_experts = 64 x 1024 x 2048 counts per step, more than the "
       "67108864 counts (512 MiB) a trace may hold"},
      {"", "", "empty file"},
      {"{\"keel_trace\": 7}\n", ":1:", "version 7"},
      {"\n\n{\"keel_trace\": 1,\n", ":3:", "header is not JSON"},
      {std::string(kHeader) + good +
           "{\"step\": 1, \"layers\": [[1, 2, 3], [4, 5, 6]], \"sequences\": []}\n",
       ":3:", "not on the steps before"},
      {std::string(kHeader) +
           "{\"step\": 0, \"layers\": [[1, 2, 3], [4, 5, 6]], \"sequences\": []}\n" +
           "{\"step\": 1, \"layers\": [[1, 2, 3], [4, 5, 6]]}\n",
       ":3:", "\"sequences\" is missing"},
      {std::string(kHeader) +
           "{\"step\": 0, \"layers\": [[1, 2, 3], [4, 5, 6]], \"sequences\": [{\"tokens\": "
           "-1, \"layers\": [[1, 2, 3], [4, 5, 6]]}]}\n",
       ":2:", "sequence 0: \"tokens\" is missing or not an integer"},
      {std::string(kHeader) +
           "{\"step\": 0, \"layers\": [[1, 2, 3], [4, 5, 6]], \"sequences\": [{\"tokens\": "
           "2, \"layers\": [[1, 2, 3], [4, 5]]}]}\n",
       ":2:", "sequence 0: layer 1 must hold 3 counts"},
      {std::string(kHeader) +
           "{\"step\": 0, \"layers\": [[1, 2, 3], [4, 5, 6]], \"sequences\": [{\"tokens\": "
           "2, \"layers\": [[1, 2, 3], [4, \"x\", 6]]}]}\n",
       ":2:", "sequence 0: layer 1 expert 1 is not a count"},
  };
  for (const Case& c : cases) {
    ScratchFolder folder;
    std::string path = folder.Write("bad.jsonl", c.text);
    Result<Trace> read = ReadKeelTrace(path);
    ASSERT_FALSE(read.ok()) << c.text;
    EXPECT_NE(read.status().message().find("bad.jsonl" + c.line), std::string::npos)
        << read.status().message();
    EXPECT_NE(read.status().message().find(c.words), std::string::npos) << read.status().message();
  }
}

TEST(KeelTraceTest, MissingFileIsNotFound) {
  Result<Trace> read = ReadKeelTrace("/nonexistent/keel/trace.jsonl");
  ASSERT_FALSE(read.ok());
  EXPECT_EQ(read.status().code(), StatusCode::kNotFound);
  EXPECT_NE(read.status().message().find("/nonexistent/keel/trace.jsonl"), std::string::npos);
}

TEST(TraceFormatTest, NamesRoundTrip) {
  for (TraceFormat format : {TraceFormat::kAuto, TraceFormat::kKeel, TraceFormat::kSmartMoe,
                             TraceFormat::kEsft, TraceFormat::kOlmoe, TraceFormat::kMegatron}) {
    Result<TraceFormat> parsed = ParseTraceFormat(TraceFormatName(format));
    ASSERT_TRUE(parsed.ok());
    EXPECT_EQ(*parsed, format);
  }
  Result<TraceFormat> bad = ParseTraceFormat("csv");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("'csv'"), std::string::npos);
  EXPECT_NE(bad.status().message().find("smartmoe"), std::string::npos);
}

TEST(TraceFormatTest, DetectsEachFormat) {
  ScratchFolder folder;
  ASSERT_TRUE(WriteKeelTrace(SmallTrace(0), folder.File("k.jsonl")).ok());
  folder.Write("m.jsonl", "{\"step\": 0, \"layer\": 1, \"top_indices\": [[0]]}\n");
  folder.Write("smart/table_iter1_rank0.log", "0:[[1.0]]\n");
  folder.Write("esft/expert_weights_1.txt", "0\t\t1.0\n");
  folder.Write("olmoe/expert_counts_derived.json", "{}");
  folder.Write("mega/router_trace_rank0.jsonl", "");
  folder.Write("archive/moe_trace.tar.xz", "");
  folder.Write("other/readme.txt", "");
  auto detect = [&](const std::string& name) { return DetectTraceFormat(folder.File(name)); };
  EXPECT_EQ(*detect("k.jsonl"), TraceFormat::kKeel);
  EXPECT_EQ(*detect("m.jsonl"), TraceFormat::kMegatron);
  EXPECT_EQ(*detect("smart"), TraceFormat::kSmartMoe);
  EXPECT_EQ(*detect("archive"), TraceFormat::kSmartMoe);
  EXPECT_EQ(*detect("archive/moe_trace.tar.xz"), TraceFormat::kSmartMoe);
  EXPECT_EQ(*detect("esft"), TraceFormat::kEsft);
  EXPECT_EQ(*detect("olmoe"), TraceFormat::kOlmoe);
  EXPECT_EQ(*detect("olmoe/expert_counts_derived.json"), TraceFormat::kOlmoe);
  EXPECT_EQ(*detect("mega"), TraceFormat::kMegatron);
  Result<TraceFormat> unknown = detect("other");
  ASSERT_FALSE(unknown.ok());
  EXPECT_NE(unknown.status().message().find("keel, smartmoe, esft, olmoe, megatron"),
            std::string::npos);
  EXPECT_EQ(detect("missing").status().code(), StatusCode::kNotFound);
}

TEST(TraceTest, ExpertCountsSumsSources) {
  Trace trace = SmallTrace(2);
  // Step 0, layer 1: values 6..11, sources [6 7 8] and [9 10 11].
  EXPECT_EQ(trace.ExpertCounts(0, 1), (std::vector<double>{15, 17, 19}));
  Trace flat = SmallTrace(0);
  EXPECT_EQ(flat.ExpertCounts(0, 1), (std::vector<double>{3, 4, 5}));
}

// The steps multiply a step's counts: a trace of many small steps is bounded as one of few large
// ones, before a reader allocates them.
TEST(TraceTest, TheWholeTraceIsBoundedNotOnlyAStep) {
  EXPECT_TRUE(CheckTraceShape(1, 65536, 0, 1024).ok());
  const Status status = CheckTraceShape(1, 65536, 0, 1025);
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find(
                "1025 steps of num_layers x num_sources x num_experts = 1 x 0 x "
                "65536 counts, more than the 67108864 counts (512 MiB) a trace may hold"),
            std::string::npos)
      << status.message();
  EXPECT_NE(CheckTraceShape(1, 1, 4097, 1).message().find("num_sources 4097 is more than 4096"),
            std::string::npos);
  // Validate checks the shape before it looks at any step.
  Trace trace;
  trace.num_layers = 1;
  trace.num_experts = 65536;
  trace.steps.resize(1025);
  trace.step_ids.resize(1025);
  EXPECT_NE(trace.Validate().message().find("1025 steps of"), std::string::npos)
      << trace.Validate().message();
}

// KEEL_MAX_TRACE_COUNT_BYTES moves the bound (8 bytes a count) for every reader; a value that is
// not a size is refused by name, never ignored.
TEST(TraceTest, TheCountsLimitFollowsItsVariable) {
  {
    ScopedEnvironment limit("KEEL_MAX_TRACE_COUNT_BYTES", "1K");
    const Status status = CheckTraceShape(1, 100, 0, 2);
    EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(status.message().find("2 steps of num_layers x num_sources x num_experts = 1 x 0 x "
                                    "100 counts, more than the 128 counts (1 KiB) a trace may "
                                    "hold (set KEEL_MAX_TRACE_COUNT_BYTES to raise it)"),
              std::string::npos)
        << status.message();
    ScratchFolder folder;
    std::string text =
        "{\"keel_trace\": 1, \"num_layers\": 1, \"num_experts\": 100, \"num_sources\": 0}\n";
    for (int step = 0; step < 2; ++step) {
      text += "{\"step\": " + std::to_string(step) + ", \"layers\": [[";
      for (int e = 0; e < 100; ++e) text += (e > 0 ? ",1" : "1");
      text += "]]}\n";
    }
    const std::string path = folder.Write("t.jsonl", text);
    Result<Trace> read = ReadKeelTrace(path);
    ASSERT_FALSE(read.ok());
    EXPECT_NE(read.status().message().find("a trace may hold (set KEEL_MAX_TRACE_COUNT_BYTES"),
              std::string::npos)
        << read.status().message();
  }
  {
    ScopedEnvironment limit("KEEL_MAX_TRACE_COUNT_BYTES", "4G");
    EXPECT_TRUE(CheckTraceShape(1, 65536, 0, 4096).ok());  // 2^28 counts: beyond the default
  }
  ScopedEnvironment bad("KEEL_MAX_TRACE_COUNT_BYTES", "lots");
  const Status status = CheckTraceShape(1, 1, 0, 1);
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("KEEL_MAX_TRACE_COUNT_BYTES='lots'"), std::string::npos)
      << status.message();
}

TEST(TraceTest, ValidateNamesStepAndLayer) {
  Trace trace = SmallTrace(2);
  EXPECT_TRUE(trace.Validate().ok());
  trace.steps[2][7] = -1;
  Status status = trace.Validate();
  ASSERT_FALSE(status.ok());
  EXPECT_NE(status.message().find("step 2 layer 1 entry 1"), std::string::npos) << status.message();
  trace.steps[2][7] = 1e15 + 2;  // beyond the largest count
  EXPECT_NE(trace.Validate().message().find("is not a count in [0, 1e15]"), std::string::npos)
      << trace.Validate().message();
  trace = SmallTrace(2);
  trace.step_ids.pop_back();
  EXPECT_FALSE(trace.Validate().ok());
  trace = SmallTrace(2);
  trace.num_experts = 0;
  EXPECT_NE(trace.Validate().message().find("num_experts 0"), std::string::npos);
}

}  // namespace
}  // namespace keel
