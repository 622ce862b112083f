"""Shared helpers for benchmark scripts: timing statistics and the report file.

Each benchmark owns one section of ``docs/benchmarks.md``, delimited by HTML
comments, and rewrites only that section, so benchmarks can be re-run one at
a time without losing the others' tables.
"""

from __future__ import annotations

import os
import platform
import re
import shlex
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

REPORT = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"

_HEADER = """# Benchmarks

Produced by `make bench` (each script under `benchmarks/` rewrites its own
section). Every row is a median over repeated runs measured in the same run as
its baselines; ratios compare rpcdist with the baseline on the same machine.
"""


def byte_compile() -> None:
    """Compile rpcdist's sources to .pyc files, as an installed package has
    them, for the benchmarks that time whole processes: an editable install
    under ``PYTHONDONTWRITEBYTECODE`` would otherwise compile ~100 modules in
    every process (~0.1 s each here), which the baselines' wheels never do."""
    import compileall

    compileall.compile_dir(str(REPORT.parent.parent / "rpcdist"), quiet=1, workers=0)


def machine() -> str:
    """A one-line description of this machine and the library versions used."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    import numpy

    parts = [
        f"{os.cpu_count()} cores ({cpu})",
        f"Python {platform.python_version()}",
        f"NumPy {numpy.__version__}",
    ]
    try:
        import grpc

        parts.append(f"grpcio {grpc.__version__}")
    except ImportError:
        pass
    try:
        import torch

        parts.append(f"torch {torch.__version__}")
    except ImportError:
        parts.append("torch not installed")
    return ", ".join(parts)


def free_port() -> int:
    """A loopback port the OS has just handed out (for a baseline's own rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def have_torch_distributed() -> bool:
    """Whether PyTorch with ``torch.distributed`` is installed (the baselines)."""
    try:
        import torch.distributed as tdist

        return bool(tdist.is_available())
    except Exception:
        return False


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def time_steps(step: Callable[[], object], warmup: int, steps: int) -> list[float]:
    """Seconds per call of ``step``, ``steps`` times after ``warmup`` untimed calls."""
    for _ in range(warmup):
        step()
    out = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        out.append(time.perf_counter() - t0)
    return out


def percentile(xs: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) by nearest rank."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = max(0, min(len(s) - 1, round(q / 100 * (len(s) - 1))))
    return s[k]


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A Markdown table."""

    def fmt(v: object) -> str:
        if isinstance(v, float):
            if v != v:
                return "n/a"
            if abs(v) >= 100:
                return f"{v:,.0f}"
            if abs(v) >= 10:
                return f"{v:.1f}"
            return f"{v:.2f}"
        return str(v)

    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(fmt(v) for v in r) + " |" for r in rows]
    return "\n".join(out)


def invocation(python: str = "python") -> str:
    """How this benchmark was run: ``python benchmarks/<script>`` and the
    options it was given, as the docs' "Command" line records them."""
    script = f"benchmarks/{os.path.basename(sys.argv[0])}"
    return shlex.join([python, script, *sys.argv[1:]])


def write_section(name: str, title: str, body: str, command: str | None = None) -> None:
    """Replace (or append) the section ``name`` of docs/benchmarks.md.

    ``command`` is the "Command" line (default: :func:`invocation`, the
    options this run was given).

    The commit named is ``git rev-parse HEAD``'s, or ``RPCDIST_BENCH_COMMIT``
    where the tree measured is a copy whose git metadata is not its own.
    """
    rev = os.environ.get("RPCDIST_BENCH_COMMIT", "")
    try:
        rev = (
            rev
            or subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"],
                capture_output=True,
                text=True,
                check=False,
                cwd=REPORT.parent,
            ).stdout.strip()
        )
    except OSError:
        rev = ""
    start, end = f"<!-- bench:{name}:start -->", f"<!-- bench:{name}:end -->"
    section = (
        f"{start}\n## {title}\n\n"
        f"Command: `{command or invocation()}`  \nMachine: {machine()}  \n"
        f"Commit: {rev or 'unknown'}\n\n{body.strip()}\n{end}"
    )
    text = REPORT.read_text() if REPORT.exists() else _HEADER
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.S)
    if pattern.search(text):
        text = pattern.sub(lambda _m: section, text)
    else:
        text = text.rstrip() + "\n\n" + section + "\n"
    REPORT.parent.mkdir(parents=True, exist_ok=True)
    REPORT.write_text(text)
    print(section, file=sys.stderr)
