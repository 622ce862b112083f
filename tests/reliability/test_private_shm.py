"""Two workers on one host (same hostname and boot id) whose /dev/shm are
not the same file system, as two containers with host networking and their
own /dev/shm each: a large array between them must not go through a
shared-memory segment the other cannot open (the message was dropped and
the call waited out its timeout). Rank 1 runs in a mount namespace with a
fresh tmpfs on /dev/shm; skipped, saying why, where that cannot be made."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rpcdist.launch._hosting import free_port

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]

TESTS = Path(__file__).resolve().parent.parent
WORKER = r"""
import os, sys, time
import numpy as np
import rpcdist
import rpc_funcs as rf

rank = int(sys.argv[1])
rpcdist.init_rpc(f"w{rank}", rank, 2, init_method=sys.argv[2], rpc_timeout=20,
                 options=rpcdist.RpcOptions(token="private-shm"))
if rank == 0:
    x = np.arange(1 << 20, dtype=np.float32)  # 4 MB: over the shared-memory threshold
    t = time.monotonic()
    y = rpcdist.rpc_sync("w1", rf.echo, args=(x,))
    assert np.array_equal(x, y)
    print(f"echo ok in {time.monotonic() - t:.2f} s", flush=True)
rpcdist.shutdown()
"""


def _private_shm_prefix() -> list[str]:
    """The command prefix that runs a program with its own /dev/shm, or skip."""
    if os.geteuid() != 0:
        pytest.skip("mounting a private /dev/shm needs root")
    if shutil.which("unshare") is None:
        pytest.skip("the unshare command is missing")
    prefix = ["unshare", "-m", "--propagation", "private", "sh", "-c"]
    probe = subprocess.run(
        [*prefix, "mount -t tmpfs tmpfs /dev/shm && stat -c %d /dev/shm"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a private /dev/shm: {probe.stderr.strip()}")
    assert int(probe.stdout) != os.stat("/dev/shm").st_dev  # (another file system)
    return [*prefix, 'mount -t tmpfs tmpfs /dev/shm && exec "$@"', "sh"]


def test_a_large_array_reaches_a_worker_whose_dev_shm_is_not_ours():
    private = _private_shm_prefix()
    init = f"tcp://127.0.0.1:{free_port()}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), str(TESTS.parent)])}
    cmd = [sys.executable, "-c", WORKER]
    procs = [
        subprocess.Popen(
            [*(private if r == 1 else []), *cmd, str(r), init],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        for r in (0, 1)
    ]
    try:
        outs = [p.communicate(timeout=90)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(outs)
    assert "echo ok" in outs[0], outs
