#!/usr/bin/env bash
# Copies googletest's sources (Debian's /usr/src/googletest) into .gpu-deps/googletest, which the
# device tool carries to the lent GPU machine, where bench/gpu/run.sh builds them: that machine has
# no gtest and no network. Adds .gpu-deps/ and run.sh's default output folder bench/gpu/out/ to
# .git/info/exclude, so git ignores both.
# Usage: bench/gpu/prepare.sh   (once per checkout, on this machine)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
source=${GOOGLETEST_SOURCE:-/usr/src/googletest}
if [ ! -f "$source/CMakeLists.txt" ]; then
  echo "prepare.sh: no googletest sources at $source (apt-get install googletest)" >&2
  exit 1
fi
exclude=$(git -C "$root" rev-parse --git-path info/exclude)
case $exclude in /*) ;; *) exclude=$root/$exclude ;; esac
mkdir -p "$(dirname "$exclude")"
for pattern in /.gpu-deps/ /bench/gpu/out/; do
  grep -qxF "$pattern" "$exclude" 2>/dev/null || echo "$pattern" >>"$exclude"
done
rm -rf "$root/.gpu-deps/googletest"
mkdir -p "$root/.gpu-deps"
cp -a "$source" "$root/.gpu-deps/googletest"
echo "prepare.sh: $(du -sh "$root/.gpu-deps" | cut -f1) in $root/.gpu-deps; carry \".gpu-deps\""
