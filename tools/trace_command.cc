// PLACEHOLDER: replaced by the real `keel trace`.
#include <cstdio>
#include "tools/commands.h"
namespace keel::tools {
int RunTrace(int, char**) { std::fputs("keel trace: not built yet\n", stderr); return 1; }
}  // namespace keel::tools
