"""A pre-imported parent that forks one child per suite test (``run_suite``'s default start).

Started once per flavor by ``run_suite.Zygote``: it imports torch, the swap
and PyTorch's test modules (``torch_suite_classes``) once, then reads one
JSON request a line on stdin (``{"test": "Class.test", "timeout": s}``) and
for each forks a child in its own session that runs that one test (its
workers are forked from it too, ``RPCDIST_TORCH_SUITE_START=fork``), with
its output in a file. Past the timeout the child's whole process group is
killed; it is killed when the test is done too (whatever the test left
behind). One JSON line answers each request on stdout, prefixed
``ZYGOTE ``: the child's exit code (``None``: hung), its output's tail and
its seconds.

Nothing in this process may start a thread before a fork (a thread's locks
would be copied held): checked before each fork, and the zygote exits
with an error when it is not so.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import threading
import time
import unittest

PREFIX = "ZYGOTE "
TAIL = 4000


def _child(name: str, out_fd: int) -> None:
    """In the forked child: run ``name`` with its output in ``out_fd``; never returns."""
    code = 1
    try:
        os.setsid()
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(out_fd, 1)
        os.dup2(out_fd, 2)
        os.environ["RPCDIST_TORCH_SUITE_START"] = "fork"
        import torch_suite_classes

        suite = unittest.defaultTestLoader.loadTestsFromName(name, torch_suite_classes)
        result = unittest.TextTestRunner(stream=sys.stderr, verbosity=2).run(suite)
        code = 0 if result.wasSuccessful() else 1
    except BaseException:  # the child reports whatever stopped it
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _wait(pid: int, timeout: float) -> int | None:
    """``pid``'s exit code, or ``None`` when it is still running at ``timeout``."""
    deadline = time.monotonic() + timeout
    delay = 0.01
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() >= deadline:
            return None
        time.sleep(delay)  # polling a child's exit (no thread may wait for it)
        delay = min(delay * 2, 0.2)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run(name: str, timeout: float) -> dict[str, object]:
    """Fork a child that runs ``name``; wait for it (at most ``timeout`` s)."""
    threads = threading.active_count()
    if threads != 1:
        names = [t.name for t in threading.enumerate()]
        raise SystemExit(f"zygote: {threads} threads before a fork ({names}); refusing to fork")
    with tempfile.TemporaryFile() as out:
        sys.stdout.flush()
        sys.stderr.flush()
        start = time.monotonic()
        pid = os.fork()
        if pid == 0:
            _child(name, out.fileno())
        rc = _wait(pid, timeout)
        _kill_group(pid)  # the child's session: its workers and what they left
        if rc is None:
            os.waitpid(pid, 0)
        seconds = time.monotonic() - start
        out.seek(0, os.SEEK_END)
        size = out.tell()
        out.seek(max(0, size - 4 * TAIL))
        output = out.read().decode(errors="replace")
    return {"test": name, "rc": rc, "seconds": round(seconds, 1), "output": output[-TAIL:]}


def main() -> int:
    import torch_suite_classes  # noqa: F401 (torch, the swap and the tests, once)

    print(PREFIX + json.dumps({"ready": os.getpid()}), flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        reply = run(str(request["test"]), float(request["timeout"]))
        print(PREFIX + json.dumps(reply), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
