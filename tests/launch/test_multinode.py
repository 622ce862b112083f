"""Several launchers on one host form one job through node 0's rendezvous store.

Every launcher is started by the ``launchers`` fixture (own session, killed
on the way out, no process left behind) and given ``--master-port`` (the
launchers' store, a port the OS picked) and the same ``--token``.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import sys
from pathlib import Path

import pytest
from launch_util import (
    CHILD,
    SCRIPTS,
    TRAIN,
    alive,
    node_args,
    read_pid,
    read_starts,
    train_module,
    wait_listening,
)

import rpcdist
from rpcdist.launch import free_port

sys.path.insert(0, str(Path(__file__).parent.parent / "reliability"))
from certs import make_ca, make_cert

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(90)]


def test_two_launchers_on_one_host_form_one_job(tmp_path, launchers, port):
    common = ["--nproc-per-node", "2", *node_args(port, "2"), CHILD, "env", str(tmp_path)]
    node1 = launchers.start("--node-rank", "1", *common)  # before node 0: it waits for it
    node0 = launchers.start("--node-rank", "0", *common)
    for node in (node0, node1):
        rc, out = launchers.finish(node)
        assert rc == 0, out
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    assert [(r["RANK"], r["LOCAL_RANK"]) for r in records] == [
        ("0", "0"),
        ("1", "1"),
        ("2", "0"),
        ("3", "1"),
    ]
    assert {(r["WORLD_SIZE"], r["LOCAL_WORLD_SIZE"], r["MASTER_ADDR"]) for r in records} == {
        ("4", "2", "127.0.0.1")
    }
    # One workers' store port and one job token, both made by node 0 for this job:
    # not the launchers' port, not the launchers' secret.
    ((worker_port, token),) = {(r["MASTER_PORT"], r["RPCDIST_TOKEN"]) for r in records}
    assert worker_port != str(port) and token != "launch-test" and len(token) == 32
    assert {r["RPCDIST_RESTART_COUNT"] for r in records} == {"0"}


def test_rpc_ring_across_two_launchers(launchers, port):
    common = ["--nproc-per-node", "2", *node_args(port, "2"), str(SCRIPTS / "rpc_ring.py")]
    nodes = [launchers.start("--node-rank", str(k), *common) for k in (0, 1)]
    outputs = []
    for node in nodes:
        rc, out = launchers.finish(node, timeout=80)
        assert rc == 0, out
        outputs.append(out)
    for r in range(4):
        line = f"[rank {r}] RING worker{r} -> worker{(r + 1) % 4} value={100 * r + 1} world=4"
        assert line in outputs[r // 2]  # on the node that ran it, prefixed


def test_a_failure_on_one_node_restarts_both_from_the_checkpoint(tmp_path, launchers, port):
    job = [TRAIN, str(tmp_path), "--steps", "6", "--crash", "1:3"]
    common = ["--nproc-per-node", "1", *node_args(port, "2", "--max-restarts", "1"), *job]
    nodes = [launchers.start("--node-rank", str(k), *common) for k in (0, 1)]
    outs = [launchers.finish(node) for node in nodes]
    assert [rc for rc, _ in outs] == [0, 0], outs
    # The round ends at the first failure a launcher reports: rank 1's crash or,
    # when node 0 polls first, rank 0 failing in its all_reduce (its peer is
    # gone). A node that reported no failure of its own names the other's.
    own = [
        bool(re.search(rf"worker rank {k} \(pid \d+\) exited with code -?\d+", out))
        for k, (_, out) in enumerate(outs)
    ]
    assert any(own), outs
    for k, (_, out) in enumerate(outs):
        other = rf"stopping the workers: worker rank {1 - k} on node {1 - k} exited with code -?\d+"
        assert own[k] or re.search(other, out), outs
    assert all("restarting the worker group (1/1)" in out for _, out in outs)
    starts = read_starts(tmp_path)
    assert starts[:2] == [(0, 2, 0, 0), (0, 2, 1, 0)]  # (restart, world, rank, first step)
    assert [s[:3] for s in starts[2:]] == [(1, 2, 0), (1, 2, 1)]
    assert starts[2][3] == starts[3][3] >= 2  # both resumed from the same checkpoint
    final = rpcdist.load(tmp_path / "final")
    assert (final["w"] == train_module().reference(6, 2)).all()  # as if never interrupted


def test_without_restarts_every_node_exits_with_the_failing_child_s_code(tmp_path, launchers, port):
    common = ["--nproc-per-node", "1", *node_args(port, "2"), CHILD, "fail", str(tmp_path)]
    nodes = [launchers.start("--node-rank", str(k), *common) for k in (0, 1)]
    sibling = read_pid(tmp_path, 0)  # rank 0 (node 0) sleeps; rank 1 (node 1) exits 3
    outs = [launchers.finish(node) for node in nodes]
    assert [rc for rc, _ in outs] == [3, 3], outs
    assert "worker rank 1 on node 1 exited with code 3; no restarts left" in outs[0][1]
    assert not alive(sibling)


def test_a_launcher_that_does_not_fit_the_job_is_refused(tmp_path, launchers, port):
    common = [*node_args(port, "2"), CHILD, "env", str(tmp_path)]
    node0 = launchers.start("--nproc-per-node", "1", "--node-rank", "0", *common)
    rc, out = launchers.run("--nproc-per-node", "2", "--node-rank", "1", *common)
    assert rc == 2, out
    assert "node 0 runs the job with --nnodes 2 --nproc-per-node 1" in out
    assert "this launcher was given --nnodes 2 --nproc-per-node 2" in out
    rc, out = launchers.run("--nproc-per-node", "1", "--node-rank", "1", *common)  # fits
    assert rc == 0, out
    assert launchers.finish(node0)[0] == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0.json", "rank1.json"]


def test_duplicate_node_rank_is_refused_and_a_signal_to_node_0_ends_the_job(
    tmp_path, launchers, port
):
    common = ["--nproc-per-node", "1", *node_args(port, "2"), CHILD, "sleep", str(tmp_path)]
    node0 = launchers.start("--node-rank", "0", *common)
    node1 = launchers.start("--node-rank", "1", *common)
    pids = [read_pid(tmp_path, r) for r in range(2)]  # the job runs
    rc, out = launchers.run("--node-rank", "1", *common)
    assert rc == 2, out
    # Which launcher registered first (its number) is a race; the holder is node1.
    taken = re.search(r"node 0 refused this launcher: --node-rank 1 is taken by (.*)", out)
    assert taken, out
    assert "(--node-rank 1)" in taken[1] and f"pid {node1.pid}" in taken[1], out
    node0.send_signal(signal.SIGTERM)
    outs = [launchers.finish(node) for node in (node0, node1)]
    assert [rc for rc, _ in outs] == [128 + signal.SIGTERM] * 2, outs
    assert "received signal 15" in outs[1][1]  # node 1 was told why
    assert not any(alive(p) for p in pids)


def test_a_launcher_without_the_secret_cannot_join(tmp_path, launchers, port):
    job = [CHILD, "env", str(tmp_path)]
    base = ["--nproc-per-node", "1", "--nnodes", "2", "--master-port", str(port)]
    node0 = launchers.start(*base, "--node-rank", "0", "--token", "right", *job)
    rc, out = launchers.run(*base, "--node-rank", "1", "--token", "wrong", *job)
    assert rc == 1, out
    assert "rejected this process's token" in out and "the same --master-addr" in out
    assert launchers.run(*base, "--node-rank", "1", "--token", "right", *job)[0] == 0
    assert launchers.finish(node0)[0] == 0


@pytest.mark.skipif(not shutil.which("openssl"), reason="the openssl command line is missing")
def test_with_certificates_in_the_environment_the_job_runs_over_tls_end_to_end(
    tmp_path, launchers, port
):
    """The launchers' store, the workers' store and their connections all use
    TLS from RPCDIST_TLS_*: the job token never travels in clear."""
    make_ca(tmp_path, "ca")
    files = make_cert(tmp_path, "ca", "node")
    env = {
        "RPCDIST_TLS_CERT": files["tls_cert_file"],
        "RPCDIST_TLS_KEY": files["tls_key_file"],
        "RPCDIST_TLS_CA": files["tls_ca_file"],
    }
    common = ["--nproc-per-node", "1", *node_args(port, "2"), str(SCRIPTS / "tls_probe.py")]
    nodes = [launchers.start("--node-rank", str(k), *common, env=env) for k in (0, 1)]
    for k, node in enumerate(nodes):
        rc, out = launchers.finish(node, timeout=80)
        assert rc == 0, out
        assert f"[rank {k}] TLS store=True link=True" in out, out
    # A launcher without the certificates cannot join: the store speaks only TLS.
    port2 = free_port()
    # (Node 0 waits long for node 1; node 1, 3 s, meets its TLS store, not a closed port.)
    probe = ["--nproc-per-node", "1", str(SCRIPTS / "tls_probe.py")]
    args0 = [*node_args(port2, "2", "--rdzv-timeout", "60"), "--node-rank", "0"]
    node0 = launchers.start(*args0, *probe, env=env)
    wait_listening(port2)
    args1 = [*node_args(port2, "2", "--rdzv-timeout", "3"), "--node-rank", "1"]
    rc, out = launchers.run(*args1, *probe)
    assert rc != 0 and "this rank must have them too" in out, out
    node0.kill()
