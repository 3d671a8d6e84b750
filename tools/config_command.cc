// `keel config`: prints the configuration reference (Markdown or plain text), prints a complete
// YAML file of the defaults, or checks a config file and names the first bad key, value and line.
#include <cstdio>
#include <string>
#include <string_view>

#include "common/config.h"
#include "tools/commands.h"

namespace keel::tools {
namespace {

constexpr const char* kConfigUsage = R"(Usage: keel config <flag>

Flags (exactly one):
  --check FILE   check a config file; prints "ok" and exits 0, or prints the first error
                 (file:line: key: value and what is wrong) and exits 2
  --defaults     print a complete config file with every key at its default and its meaning
                 as a comment; a good start for a new config
  --markdown     print the configuration reference in Markdown (the source of docs/config.md)
  --help         print this help and the list of keys

)";

int Usage(const char* problem) {
  std::fprintf(stderr, "keel config: %s\n\n%s", problem, kConfigUsage);
  return 2;
}

int CheckFile(const std::string& path) {
  Result<KeelConfig> config = LoadConfigFile(path);
  if (!config.ok()) {
    std::fprintf(stderr, "keel config: %s\n", config.status().message().c_str());
    return 2;
  }
  std::puts("ok");
  return 0;
}

}  // namespace

int RunConfig(int argc, char** argv) {
  if (argc < 2) return Usage("expected one flag");
  std::string_view flag = argv[1];
  if (flag == "--help" || flag == "-h") {
    if (argc > 2) return Usage("--help takes no arguments");
    std::fputs(kConfigUsage, stdout);
    std::fputs(ConfigHelpText().c_str(), stdout);
    return 0;
  }
  if (flag == "--check") {
    if (argc != 3) return Usage("--check takes exactly one FILE");
    return CheckFile(argv[2]);
  }
  if (flag == "--defaults" || flag == "--markdown") {
    if (argc > 2) return Usage((std::string(flag) + " takes no arguments").c_str());
    std::string text =
        flag == "--defaults" ? ConfigToYaml(KeelConfig{}) : ConfigReferenceMarkdown();
    std::fwrite(text.data(), 1, text.size(), stdout);
    return std::fflush(stdout) == 0 ? 0 : 1;
  }
  return Usage(("unknown flag '" + std::string(flag) + "'").c_str());
}

}  // namespace keel::tools
