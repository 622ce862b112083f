"""The examples run end to end: ``examples/demo.py`` and ``examples/batching_rpc.py``.

Each runs as a subprocess in its own session (the example launches its own
workers), under a hard timeout; on the way out the whole session is killed, so
no worker outlives a failing test. Only exit codes and output lines are
checked: speed is measured by benchmarks, not asserted here.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]


def run_example(name: str, *args: str, timeout: float = 100) -> str:
    """Run ``examples/NAME ARGS``; assert it exits 0 and return its output."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    proc = subprocess.Popen(
        [sys.executable, str(EXAMPLES / name), *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 0, out
    return out


def test_demo_trains_the_parameter_server_example():
    out = run_example("demo.py", "--epochs", "2")
    assert "[ps] epoch 1:" in out and "[ps] epoch 2:" in out
    accuracy = float(re.search(r"test accuracy:\s+([0-9.]+)", out).group(1))
    assert accuracy >= 0.9
    assert re.search(r"throughput:\s+[0-9.]+ steps/s", out)
    assert "result:          OK" in out


def test_batching_example_reports_both_modes():
    out = run_example("batching_rpc.py", "--requests", "300")
    assert re.search(r"unbatched: 600 requests in [0-9.]+ s = [0-9]+ req/s", out)
    batched = re.search(r"batched:   600 requests .* \((\d+) batches, mean size ([0-9.]+)\)", out)
    assert batched and int(batched.group(1)) < 600  # requests really were batched
    assert "speedup:" in out
