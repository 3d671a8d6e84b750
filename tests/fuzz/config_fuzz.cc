// libFuzzer target: the YAML config loader. Any input must come back as a config or as an error,
// never a crash, hang or sanitizer report; a config that loads must survive its own round trip
// (ConfigToYaml, then ParseConfig again, gives the same YAML).
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include "common/config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  keel::Result<keel::KeelConfig> config = keel::ParseConfig(text, "fuzz.yaml");
  if (!config.ok()) return 0;
  const std::string yaml = keel::ConfigToYaml(*config);
  keel::Result<keel::KeelConfig> again = keel::ParseConfig(yaml, "round-trip.yaml");
  if (!again.ok() || keel::ConfigToYaml(*again) != yaml) std::abort();
  return 0;
}
