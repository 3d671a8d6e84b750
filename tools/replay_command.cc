// PLACEHOLDER: replaced by the real `keel replay`.
#include <cstdio>
#include "tools/commands.h"
namespace keel::tools {
int RunReplay(int, char**) { std::fputs("keel replay: not built yet\n", stderr); return 1; }
}  // namespace keel::tools
