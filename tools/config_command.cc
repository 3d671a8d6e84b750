// PLACEHOLDER: replaced by the real `keel config`.
#include <cstdio>
#include "tools/commands.h"
namespace keel::tools {
int RunConfig(int, char**) { std::fputs("keel config: not built yet\n", stderr); return 1; }
}  // namespace keel::tools
