"""Every collective backend under the real launcher, ranks from its environment.

``scripts/collectives_env.py`` gets nothing but a backend and a mode: rank,
world size, address, port and token come from ``rpcdist-run``. Each worker
checks all_reduce, broadcast, all_gather and barrier against NumPy and
prints the engine it ran on. Every launcher is started by the ``launchers``
fixture (own session, killed on the way out, no process left behind).

Across two network namespaces of one host (same hostname and boot id, one
``/dev/shm``, separate abstract sockets) ``auto`` must see, by probing the
doorbells, that shared memory cannot work, and take the message ring.
"""

from __future__ import annotations

import random
import re
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from launch_util import SCRIPTS, Launchers, node_args

sys.path.insert(0, str(Path(__file__).parent.parent / "reliability"))
import netlab

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]

SCRIPT = str(SCRIPTS / "collectives_env.py")
#: The engine each backend must end up on when every rank shares one host.
ONE_HOST = {"ring": "ring", "shm": "shm", "auto": "shm"}


def ok_lines(out: str, ranks: range, engine: str, world: int) -> None:
    """Each of ``ranks`` printed its OK line (with the launcher's prefix)."""
    for r in ranks:
        assert f"[rank {r}] OK backend={engine} world={world}" in out, out
    assert not re.search(r"\[rank \d+\] Traceback", out), out


def run_one_node(
    launchers: Launchers, nproc: int, *args: str, env: dict[str, str] | None = None
) -> str:
    proc = launchers.start("--nproc-per-node", str(nproc), SCRIPT, *args, env=env)
    rc, out = launchers.finish(proc, timeout=90)
    assert rc == 0, out
    return out


@pytest.mark.parametrize("nproc", [2, 3])
@pytest.mark.parametrize("mode", ["pg", "rpc"])
@pytest.mark.parametrize("backend", ["ring", "shm", "auto"])
def test_every_backend_with_ranks_from_the_launcher(launchers, backend, mode, nproc):
    out = run_one_node(launchers, nproc, backend, mode)
    ok_lines(out, range(nproc), ONE_HOST[backend], nproc)


@pytest.mark.parametrize("backend", ["ring", "auto"])
def test_explicit_tcp_init_method_with_ranks_from_the_launcher(launchers, backend):
    out = run_one_node(launchers, 2, backend, "tcp")
    ok_lines(out, range(2), ONE_HOST[backend], 2)


@pytest.mark.parametrize("backend", ["ring", "shm"])
def test_init_rpc_adopts_the_process_group_s_agent(launchers, backend):
    out = run_one_node(launchers, 3, backend, "adopt")
    ok_lines(out, range(3), backend, 3)


@pytest.mark.parametrize("nproc", [2, 3])
@pytest.mark.parametrize(
    "links", [{"RPCDIST_LOCAL_SOCKETS": "0"}, {"RPCDIST_TRANSPORT": "grpc"}], ids=["tcp", "grpc"]
)
def test_ring_over_other_links_with_ranks_from_the_launcher(launchers, links, nproc):
    """The ring over TCP sockets instead of Unix ones, and over gRPC streams."""
    out = run_one_node(launchers, nproc, "ring", "pg", env=links)
    ok_lines(out, range(nproc), "ring", nproc)


@pytest.mark.parametrize("backend", ["ring", "auto"])
def test_two_launchers_as_two_nodes_on_loopback(launchers, port, backend):
    common = ["--nproc-per-node", "2", "--master-addr", "127.0.0.1", *node_args(port, "2")]
    nodes = [
        launchers.start("--node-rank", str(k), *common, SCRIPT, backend, "rpc") for k in (0, 1)
    ]
    for k, node in enumerate(nodes):
        rc, out = launchers.finish(node, timeout=90)
        assert rc == 0, out
        ok_lines(out, range(2 * k, 2 * k + 2), ONE_HOST[backend], 4)


@pytest.fixture
def lab() -> Iterator[netlab.Lab]:
    why = netlab.cannot_build() if shutil.which("ip") else "no `ip` command"
    if why is not None:
        pytest.skip(f"no network namespaces here: {why}")
    try:
        made = netlab.Lab("bridge")
    except Exception as e:  # e.g. no veth or bridge support in a container
        pytest.skip(f"cannot build the bridge topology: {e}")
    try:
        yield made
    finally:
        made.close()


@pytest.mark.parametrize(("backend", "mode"), [("auto", "pg"), ("auto", "rpc"), ("ring", "pg")])
def test_two_launchers_in_two_network_namespaces_take_the_ring(launchers, lab, backend, mode):
    """One hostname and boot id, one /dev/shm, but the doorbells are apart:
    ``auto`` probes them, finds them unreachable and runs on the ring."""
    port = str(random.randrange(20000, 60000))  # fresh namespaces: every port is free
    nodes = []
    for k in (0, 1):
        env = {"RPCDIST_HOST": lab.ips[k]}  # workers listen on their namespace's address
        argv = ["--nproc-per-node", "1", "--nnodes", "2", "--node-rank", str(k)]
        argv += ["--master-addr", lab.ips[0], "--master-port", port, "--token", "launch-test"]
        nodes.append(
            launchers.start(*argv, SCRIPT, backend, mode, env=env, netns=lab.namespaces[k])
        )
    for k, node in enumerate(nodes):
        rc, out = launchers.finish(node, timeout=90)
        assert rc == 0, out
        ok_lines(out, range(k, k + 1), "ring", 2)
        if backend == "auto":  # the fallback says why
            assert "cannot reach the shared-memory doorbell of rank" in out, out
