"""Two workers on one host (same hostname and boot id) as two containers
with host networking run them: each with its own /dev/shm, or its own pid
namespace. A large array between them must not go through a shared-memory
segment the other cannot open (the message was dropped and the call waited
out its timeout), and neither may judge the other's process by a pid of
another namespace: they count as two hosts. Rank 1 runs in a mount
namespace with a fresh tmpfs on /dev/shm, or in a pid namespace of its
own; skipped, saying why, where that cannot be made."""

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
    from rpcdist._rpc._context import current_agent
    hosts = current_agent().hosts
    print("one host" if hosts[0] == hosts[1] else "two hosts", flush=True)
rpcdist.shutdown()
"""


def _isolated(what: str) -> list[str]:
    """The command prefix that runs a program with its own /dev/shm
    (``"shm"``) or pid namespace (``"pid"``), or skip."""
    if os.geteuid() != 0:
        pytest.skip("making namespaces needs root")
    if shutil.which("unshare") is None:
        pytest.skip("the unshare command is missing")
    if what == "shm":
        prefix = ["unshare", "-m", "--propagation", "private", "sh", "-c"]
        setup, probe_path = "mount -t tmpfs tmpfs /dev/shm", "/dev/shm"
    else:
        prefix = ["unshare", "--pid", "--fork", "--mount-proc", "sh", "-c"]
        setup, probe_path = "true", "/proc/self/ns/pid"
    probe = subprocess.run(
        [*prefix, f"{setup} && stat -L -c %d:%i {probe_path}"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if probe.returncode != 0:
        pytest.skip(f"cannot isolate {what}: {probe.stderr.strip()}")
    st = os.stat(probe_path)
    assert probe.stdout.strip() != f"{st.st_dev}:{st.st_ino}"  # (isolated indeed)
    return [*prefix, f'{setup} && exec "$@"', "sh"]


@pytest.mark.parametrize("what", ["shm", "pid"])
def test_a_worker_with_its_own_dev_shm_or_pids_is_another_host(what):
    isolated = _isolated(what)
    init = f"tcp://127.0.0.1:{free_port()}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), str(TESTS.parent)])}
    cmd = [sys.executable, "-c", WORKER]
    procs = [
        subprocess.Popen(
            [*(isolated if r == 1 else []), *cmd, str(r), init],
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
    assert "echo ok" in outs[0] and "two hosts" in outs[0], outs
