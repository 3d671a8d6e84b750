// Keel's configuration (docs/config.md) behind an opaque handle: read from YAML text or a file,
// checked against the one table of documented keys (unknown keys and bad values are errors that
// name the key, the value and the line), and printed back as YAML.
#pragma once

#include <memory>
#include <string>
#include <string_view>

#include "keel/status.hpp"

namespace keel {

// The typed configuration inside the library (common/config.h).
struct KeelConfig;

class Config {
 public:
  // Every key at its documented default.
  Config();
  // Parses and validates YAML text; `source` names it in errors ("<source>:12: ...").
  static Result<Config> FromYaml(std::string_view yaml, std::string_view source = "<config>");
  // Reads and validates a YAML file. NotFound when it does not exist, IoError when unreadable.
  static Result<Config> FromFile(const std::string& path);
  // Every key with its type, default and meaning, as plain text (`keel config --help`).
  static std::string Reference();

  Config(const Config& other);
  Config& operator=(const Config& other);
  Config(Config&& other) noexcept;
  Config& operator=(Config&& other) noexcept;
  ~Config();

  // A complete YAML document with every key, each documented in a comment; FromYaml reads it
  // back to an equal config.
  std::string ToYaml() const;
  // topology.num_nodes x topology.gpus_per_node: the ranks an engine with this config needs.
  int num_ranks() const;
  // policy.name.
  std::string policy() const;

  friend bool operator==(const Config& a, const Config& b) { return a.ToYaml() == b.ToYaml(); }

 private:
  explicit Config(std::unique_ptr<KeelConfig> typed);
  friend const KeelConfig& TypedConfig(const Config& config);
  friend Config MakeConfig(KeelConfig typed);

  std::unique_ptr<KeelConfig> typed_;  // never null
};

}  // namespace keel
