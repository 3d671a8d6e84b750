"""The `keel` command of an installed keel package (`pip install .`).

The wheel carries the C++ command-line program as keel/bin/keel, linked to the package's own
libkeel; pip puts this console script on PATH, and it hands the process over to that program
with the same arguments, so `keel plan`, `keel replay`... behave exactly as the C++ build's.
"""

from __future__ import annotations

import os
import sys


def main() -> None:
    program = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bin", "keel")
    if not os.access(program, os.X_OK):
        sys.exit(f"keel: the command-line program {program} is missing from this keel package "
                 "(a build tree's package has none; `pip install .` installs it)")
    os.execv(program, [program, *sys.argv[1:]])


if __name__ == "__main__":
    main()
