// Expert checkpoint files field by field: a written file checks against the fields it was written
// with; the weight element size is compared only when both sides know it; a file of the wrong
// magic names what it found.
#include "engine/expert_file.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace keel {
namespace {

std::string FileOf(const ExpertFileFields& fields) {
  std::vector<std::byte> file(kExpertFileHeaderBytes + fields.weight_bytes +
                              fields.optimizer_bytes);
  for (size_t i = kExpertFileHeaderBytes; i < file.size(); ++i) {
    file[i] = static_cast<std::byte>(i * 7);
  }
  WriteExpertFileHeader(fields, file);
  return std::string(reinterpret_cast<const char*>(file.data()), file.size());
}

ExpertFileFields Fields() {
  ExpertFileFields fields;
  fields.layer = 3;
  fields.expert = 17;
  fields.shard = 1;
  fields.shards = 2;
  fields.weight_element_bytes = 2;
  fields.weight_bytes = 40;
  fields.optimizer_bytes = 24;
  return fields;
}

TEST(ExpertFileTest, AWrittenFileChecksAgainstItsFields) {
  const Result<ExpertFilePayload> payload = CheckExpertFile("f.bin", FileOf(Fields()), Fields());
  ASSERT_TRUE(payload.ok()) << payload.status().ToString();
  EXPECT_EQ(payload->version, 2);
  EXPECT_EQ(payload->offset, kExpertFileHeaderBytes);
}

TEST(ExpertFileTest, WeightElementSizeIsComparedWhenBothSidesKnowIt) {
  ExpertFileFields expected = Fields();
  expected.weight_element_bytes = 4;
  const Result<ExpertFilePayload> refused = CheckExpertFile("f.bin", FileOf(Fields()), expected);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().message(), "f.bin: weight_element_bytes: expected 4, found 2");
  expected.weight_element_bytes = 0;  // an engine without a shard layout
  EXPECT_TRUE(CheckExpertFile("f.bin", FileOf(Fields()), expected).ok());
  ExpertFileFields unknown = Fields();
  unknown.weight_element_bytes = 0;  // a file saved by one
  EXPECT_TRUE(CheckExpertFile("f.bin", FileOf(unknown), Fields()).ok());
}

TEST(ExpertFileTest, ForeignFilesAndShardCountsAreNamed) {
  const Result<ExpertFilePayload> text =
      CheckExpertFile("f.bin", std::string("{\"a\": 1}\n\x01", 10), Fields());
  ASSERT_FALSE(text.ok());
  EXPECT_EQ(text.status().message(),
            "f.bin: magic: expected \"KEELEXP2\" (a Keel expert file), found \"{\"a\": 1}\"");
  ExpertFileFields expected = Fields();
  expected.shards = 4;
  const Result<ExpertFilePayload> shards = CheckExpertFile("f.bin", FileOf(Fields()), expected);
  ASSERT_FALSE(shards.ok());
  EXPECT_EQ(shards.status().message(), "f.bin: shards: expected 4, found 2");
  const Result<ExpertFilePayload> empty = CheckExpertFile("f.bin", "", Fields());
  ASSERT_FALSE(empty.ok());
  EXPECT_EQ(empty.status().message(),
            "f.bin: file length: expected 120 bytes (56 of header, 40 of weights, 24 of optimizer "
            "state), found 0 (truncated)");
}

}  // namespace
}  // namespace keel
