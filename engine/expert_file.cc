// Expert checkpoint files: the version-2 header, written and checked field by field.
#include "engine/expert_file.h"

#include <cstdio>
#include <cstring>

#include "kernels/checksum.h"

namespace keel {
namespace {

// The version-2 header, every integer little-endian:
//   offset size field
//    0      8   magic "KEELEXP2"
//    8      4   version (2)
//   12      4   layer
//   16      4   expert (logical id)
//   20      4   shard (0 for a whole expert)
//   24      4   shards (1 for a whole expert)
//   28      4   weight_element_bytes (0: not known)
//   32      8   weight_bytes
//   40      8   optimizer_bytes
//   48      8   checksum: Checksum64 of the payload, seeded with Checksum64 of bytes [0, 48)
constexpr char kMagic[8] = {'K', 'E', 'E', 'L', 'E', 'X', 'P', '2'};
constexpr char kMagicV1[8] = {'K', 'E', 'E', 'L', 'E', 'X', 'P', '1'};
constexpr uint32_t kVersion = 2;
constexpr size_t kChecksumOffset = 48;
static_assert(kChecksumOffset + 8 == kExpertFileHeaderBytes);

void Put(std::span<std::byte> out, size_t offset, uint64_t value, size_t bytes) {
  for (size_t i = 0; i < bytes; ++i) out[offset + i] = static_cast<std::byte>(value >> (8 * i));
}

uint64_t Get(std::string_view in, size_t offset, size_t bytes) {
  uint64_t value = 0;
  for (size_t i = 0; i < bytes; ++i) {
    value |= static_cast<uint64_t>(static_cast<unsigned char>(in[offset + i])) << (8 * i);
  }
  return value;
}

std::span<const std::byte> Bytes(std::string_view text) {
  return {reinterpret_cast<const std::byte*>(text.data()), text.size()};
}

// The checksum of a file whose header (checksum field aside) and payload are given.
uint64_t FileChecksum(std::span<const std::byte> header, std::span<const std::byte> payload) {
  return kernels::cpu::Checksum64(payload, kernels::cpu::Checksum64(header.first(kChecksumOffset)));
}

std::string Hex(uint64_t value) {
  char text[24];
  std::snprintf(text, sizeof(text), "0x%016llx", static_cast<unsigned long long>(value));
  return text;
}

// The magic as found, printable bytes as they are and the others as \xNN.
std::string Printable(std::string_view bytes) {
  std::string text;
  for (char c : bytes) {
    if (c >= 0x20 && c < 0x7f) {
      text += c;
    } else {
      char escaped[8];
      std::snprintf(escaped, sizeof(escaped), "\\x%02x", static_cast<unsigned char>(c));
      text += escaped;
    }
  }
  return text;
}

Status Mismatch(const std::string& path, const char* field, const std::string& expected,
                const std::string& found) {
  return InvalidArgument(path + ": " + field + ": expected " + expected + ", found " + found);
}

// Exactly `header` bytes plus the payload's sizes.
Status CheckLength(const std::string& path, size_t header, const ExpertFileFields& expected,
                   size_t found) {
  const uint64_t length = header + expected.weight_bytes + expected.optimizer_bytes;
  if (found == length) return Status::Ok();
  return Mismatch(path, "file length",
                  std::to_string(length) + " bytes (" + std::to_string(header) + " of header, " +
                      std::to_string(expected.weight_bytes) + " of weights, " +
                      std::to_string(expected.optimizer_bytes) + " of optimizer state)",
                  std::to_string(found) + (found < length ? " (truncated)" : " (trailing bytes)"));
}

Result<ExpertFilePayload> CheckVersion1(const std::string& path, std::string_view contents,
                                        const ExpertFileFields& expected) {
  if (contents.size() < kExpertFileV1HeaderBytes) {
    return CheckLength(path, kExpertFileV1HeaderBytes, expected, contents.size());
  }
  const uint64_t weights = Get(contents, 8, 8);
  const uint64_t optimizer = Get(contents, 16, 8);
  if (weights != expected.weight_bytes) {
    return Mismatch(path, "weight_bytes", std::to_string(expected.weight_bytes),
                    std::to_string(weights));
  }
  if (optimizer != expected.optimizer_bytes) {
    return Mismatch(path, "optimizer_bytes", std::to_string(expected.optimizer_bytes),
                    std::to_string(optimizer));
  }
  KEEL_RETURN_IF_ERROR(CheckLength(path, kExpertFileV1HeaderBytes, expected, contents.size()));
  return ExpertFilePayload{1, kExpertFileV1HeaderBytes};
}

}  // namespace

void WriteExpertFileHeader(const ExpertFileFields& fields, std::span<std::byte> file) {
  std::memcpy(file.data(), kMagic, sizeof(kMagic));
  Put(file, 8, kVersion, 4);
  Put(file, 12, static_cast<uint32_t>(fields.layer), 4);
  Put(file, 16, static_cast<uint32_t>(fields.expert), 4);
  Put(file, 20, static_cast<uint32_t>(fields.shard), 4);
  Put(file, 24, static_cast<uint32_t>(fields.shards), 4);
  Put(file, 28, fields.weight_element_bytes, 4);
  Put(file, 32, fields.weight_bytes, 8);
  Put(file, 40, fields.optimizer_bytes, 8);
  Put(file, kChecksumOffset,
      FileChecksum(file.first(kExpertFileHeaderBytes), file.subspan(kExpertFileHeaderBytes)), 8);
}

Result<ExpertFilePayload> CheckExpertFile(const std::string& path, std::string_view contents,
                                          const ExpertFileFields& expected) {
  const std::string magic(kMagic, sizeof(kMagic));
  if (contents.size() < sizeof(kMagic)) {
    return CheckLength(path, kExpertFileHeaderBytes, expected, contents.size());
  }
  if (contents.substr(0, sizeof(kMagicV1)) == std::string_view(kMagicV1, sizeof(kMagicV1))) {
    return CheckVersion1(path, contents, expected);
  }
  if (contents.substr(0, sizeof(kMagic)) != magic) {
    return Mismatch(path, "magic", "\"" + magic + "\" (a Keel expert file)",
                    "\"" + Printable(contents.substr(0, sizeof(kMagic))) + "\"");
  }
  if (contents.size() < kExpertFileHeaderBytes) {
    return CheckLength(path, kExpertFileHeaderBytes, expected, contents.size());
  }
  const uint64_t version = Get(contents, 8, 4);
  if (version != kVersion) {
    return Mismatch(path, "version", std::to_string(kVersion), std::to_string(version));
  }
  // Signed fields as int32, so that a flipped sign bit reads as the negative number it makes.
  const std::pair<const char*, int64_t> identity[] = {
      {"layer", expected.layer},
      {"expert", expected.expert},
      {"shard", expected.shard},
      {"shards", expected.shards},
  };
  for (size_t i = 0; i < std::size(identity); ++i) {
    const auto found = static_cast<int32_t>(static_cast<uint32_t>(Get(contents, 12 + 4 * i, 4)));
    if (found != identity[i].second) {
      return Mismatch(path, identity[i].first, std::to_string(identity[i].second),
                      std::to_string(found));
    }
  }
  const uint64_t element_bytes = Get(contents, 28, 4);
  if (element_bytes != 0 && expected.weight_element_bytes != 0 &&
      element_bytes != expected.weight_element_bytes) {
    return Mismatch(path, "weight_element_bytes", std::to_string(expected.weight_element_bytes),
                    std::to_string(element_bytes));
  }
  const uint64_t weights = Get(contents, 32, 8);
  if (weights != expected.weight_bytes) {
    return Mismatch(path, "weight_bytes", std::to_string(expected.weight_bytes),
                    std::to_string(weights));
  }
  const uint64_t optimizer = Get(contents, 40, 8);
  if (optimizer != expected.optimizer_bytes) {
    return Mismatch(path, "optimizer_bytes", std::to_string(expected.optimizer_bytes),
                    std::to_string(optimizer));
  }
  KEEL_RETURN_IF_ERROR(CheckLength(path, kExpertFileHeaderBytes, expected, contents.size()));
  const uint64_t recorded = Get(contents, kChecksumOffset, 8);
  const uint64_t computed = FileChecksum(Bytes(contents.substr(0, kExpertFileHeaderBytes)),
                                         Bytes(contents.substr(kExpertFileHeaderBytes)));
  if (recorded != computed) {
    return Mismatch(
        path, "checksum", Hex(recorded) + " (recorded in the header)",
        Hex(computed) + " (computed over the header and contents): the file is corrupt");
  }
  return ExpertFilePayload{2, kExpertFileHeaderBytes};
}

}  // namespace keel
