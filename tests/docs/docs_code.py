"""The code blocks of the documentation, and how each one is checked.

A Python block whose first line names a file and the command that runs it,

    # scale.py — run with:  python -m rpcdist.launch --nproc-per-node 2 scale.py

is a complete program: the tests write it to that file and run that command.
A ``text`` block with ``title="output"`` right after it holds lines the run
must print: each of its lines must be a line of the output, in any order,
where ``...`` inside a line stands for any text (a figure that changes from
run to run) and a line ``...`` alone for lines left out. A ``text`` block
titled ``sample output`` is not checked. Every other Python block is a
fragment: it must at least compile.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"

#: ``# name.py — run with:  python [-m rpcdist.launch --nproc-per-node N] name.py [args]``
RUN_LINE = re.compile(
    r"^#\s*(?P<file>[\w.-]+\.py)\s*(?:—|-|--)\s*run with:\s+(?P<cmd>python\s.*?)\s*$"
)
_FENCE = re.compile(r"^(?P<indent>\s*)(?P<ticks>`{3,})(?P<info>[^`]*)$")


@dataclass(frozen=True)
class Block:
    """One fenced code block of a page."""

    page: str  # path relative to the repository
    line: int  # 1-based line of the opening fence
    lang: str
    title: str
    code: str

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


@dataclass(frozen=True)
class Program:
    """A block that is a whole program, with its command and expected output."""

    block: Block
    file: str
    argv: list[str]  # after "python"
    expected: list[str]  # lines the output must contain ("..." dropped)

    @property
    def id(self) -> str:
        return f"{self.block.id}({self.file})"

    @property
    def uses_torch(self) -> bool:
        """A PyTorch program (the other side of a comparison): needs torch."""
        return bool(re.search(r"^\s*(import|from) torch\b", self.block.code, re.MULTILINE))


def blocks(path: Path) -> list[Block]:
    """The fenced code blocks of a Markdown file, in order."""
    lines = path.read_text(encoding="utf-8").splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, ticks, info = len(m["indent"]), m["ticks"], m["info"].strip()
        lang = info.split()[0] if info else ""
        title_m = re.search(r'title="([^"]*)"', info)
        body: list[str] = []
        j = i + 1
        while j < len(lines) and lines[j].strip() != ticks:
            line = lines[j]
            body.append(line[indent:] if line[:indent].strip() == "" else line.lstrip())
            j += 1
        if j == len(lines):
            raise ValueError(f"{path}:{i + 1}: code fence never closed")
        page = str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)
        title = title_m.group(1) if title_m else ""
        out.append(Block(page, i + 1, lang, title, "\n".join(body) + "\n"))
        i = j + 1
    return out


def programs(path: Path) -> tuple[list[Program], list[Block]]:
    """The page's whole programs, and its other Python blocks (fragments)."""
    found = blocks(path)
    progs: list[Program] = []
    fragments: list[Block] = []
    for k, b in enumerate(found):
        if b.lang not in ("python", "py"):
            continue
        first = b.code.splitlines()[0] if b.code.strip() else ""
        m = RUN_LINE.match(first)
        if not m:
            fragments.append(b)
            continue
        argv = shlex.split(m["cmd"])[1:]
        if m["file"] not in argv:
            raise ValueError(f"{b.id}: the command {m['cmd']!r} does not run {m['file']}")
        expected: list[str] = []
        nxt = found[k + 1] if k + 1 < len(found) else None
        if nxt is not None and nxt.lang == "text" and nxt.title == "output":
            expected = [ln.rstrip() for ln in nxt.code.splitlines()]
            expected = [ln for ln in expected if ln.strip() and ln.strip() != "..."]
        progs.append(Program(b, m["file"], argv, expected))
    return progs, fragments


def missing_lines(expected: list[str], output: str) -> list[str]:
    """The expected lines that match no line of ``output`` (trailing spaces
    ignored; ``...`` in an expected line matches any text)."""
    have = [ln.rstrip() for ln in output.splitlines()]
    missing = []
    for want in expected:
        pattern = re.compile(".*?".join(re.escape(part) for part in want.split("...")))
        if not any(pattern.fullmatch(line) for line in have):
            missing.append(want)
    return missing
