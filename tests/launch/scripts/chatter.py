"""Output for the prefixing tests: ``chatter.py LINES``.

Every rank writes LINES lines to stdout and LINES to stderr, each line in
three pieces with a flush after each (so a line reaches the launcher in
parts, while the other ranks write theirs). Then the last rank writes
``tail without newline`` with no newline and dies without flushing anything
(``os._exit``): the launcher must still show that text.
"""

from __future__ import annotations

import os
import sys


def main() -> None:
    lines = int(sys.argv[1])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    for i in range(lines):
        for name, stream in (("out", sys.stdout), ("err", sys.stderr)):
            for piece in (f"{name} {rank} {i} ", "x" * 30, "x" * 30 + "\n"):
                stream.write(piece)
                stream.flush()
    if rank == world - 1:
        os.write(1, b"tail without newline")
        os._exit(0)


if __name__ == "__main__":
    main()
