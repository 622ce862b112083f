"""Elastic jobs (``--nnodes MIN:MAX``): nodes lost and nodes joining restart the job.

Each "node" is a launcher on loopback with one worker running
``scripts/train.py``, which checkpoints every step and resumes from the
checkpoint with whatever world size it is given. A worker told to
``--hold`` blocks at a step on the first attempt, so that the test can
change the membership while the job is certainly running.
"""

from __future__ import annotations

import importlib.util
import signal

import numpy as np
import pytest
from launch_util import SCRIPTS, TRAIN, node_args, read_json, read_starts, running, train_module

import rpcdist

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(90)]

STEPS = 6


def _elastic(port: int, tmp_path, opts: tuple[str, ...] = (), hold: str | None = None) -> list[str]:
    opts = ("--max-restarts", "2", "--node-timeout", "2", *opts)
    job = [TRAIN, str(tmp_path), "--steps", str(STEPS), *(["--hold", hold] if hold else [])]
    return ["--nproc-per-node", "1", *node_args(port, "2:3", *opts), *job]


def test_three_nodes_lose_one_and_finish_on_two_from_the_checkpoint(tmp_path, launchers, port):
    argv = _elastic(port, tmp_path, ("--rdzv-last-call", "30"), hold="2:2")
    nodes = [launchers.start(*argv) for _ in range(3)]
    holder = read_json(tmp_path / "holding.json")  # rank 2 holds at step 2, all 3 in the job
    assert holder["world"] == 3
    doomed = next(p for p in nodes if p.pid == holder["launcher"])
    doomed.kill()  # SIGKILL: no goodbye, only missing heartbeats tell
    doomed.wait(timeout=30)
    survivors = [p for p in nodes if p is not doomed]
    outs = [launchers.finish(p) for p in survivors]
    assert [rc for rc, _ in outs] == [0, 0], outs
    assert any("lost: no heartbeat" in out for _, out in outs)
    assert not running(holder["pid"])  # its worker died with its launcher
    starts = read_starts(tmp_path)
    assert [s[:3] for s in starts] == [(0, 3, 0), (0, 3, 1), (0, 3, 2), (1, 2, 0), (1, 2, 1)]
    assert starts[3][3] == starts[4][3] >= 1  # resumed from the checkpoint
    final = rpcdist.load(tmp_path / "final")
    assert (final["world"], final["restart"]) == (2, 1)
    np.testing.assert_allclose(final["w"], train_module().reference(STEPS, 3), rtol=1e-12)


def _fsdp_argv(
    port: int, tmp_path, last_call: str, hold: str, *extra: str
) -> tuple[str, list[str]]:
    script = str(SCRIPTS / "train_fsdp.py")
    opts = ("--max-restarts", "2", "--node-timeout", "2", "--rdzv-last-call", last_call)
    job = [script, str(tmp_path), "--steps", str(STEPS), "--hold", hold, *extra]
    return script, ["--nproc-per-node", "1", *node_args(port, "2:3", *opts), *job]


def _fsdp_reference(script: str) -> dict[str, np.ndarray]:
    spec = importlib.util.spec_from_file_location("launch_train_fsdp", script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.reference(STEPS)  # type: ignore[no-any-return]


def _same_model(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert got.keys() == want.keys()
    for k, v in want.items():
        np.testing.assert_allclose(got[k], v, rtol=1e-9, atol=1e-12, err_msg=k)


@pytest.mark.parametrize("wrapper", ["fsdp", "ddp"])
def test_a_data_parallel_job_loses_a_node_and_resumes_its_checkpoint_on_two(
    tmp_path, launchers, port, wrapper
):
    """FSDP's full checkpoint (model and Adam state) saved at p=3 resumes at p=2; DDP's too."""
    extra = ("--ddp",) if wrapper == "ddp" else ()
    script, argv = _fsdp_argv(port, tmp_path, "30", "2:2", *extra)
    nodes = [launchers.start(*argv) for _ in range(3)]
    holder = read_json(tmp_path / "holding.json")
    assert holder["world"] == 3
    doomed = next(p for p in nodes if p.pid == holder["launcher"])
    doomed.kill()
    doomed.wait(timeout=30)
    outs = [launchers.finish(p) for p in nodes if p is not doomed]
    assert [rc for rc, _ in outs] == [0, 0], outs
    starts = read_starts(tmp_path)
    assert [s[:3] for s in starts] == [(0, 3, 0), (0, 3, 1), (0, 3, 2), (1, 2, 0), (1, 2, 1)]
    assert starts[3][3] == starts[4][3] == 2  # resumed from the step-2 checkpoint
    final = rpcdist.load(tmp_path / "final")
    assert (final["world"], final["restart"]) == (2, 1)
    _same_model(final["model"], _fsdp_reference(script))


def test_an_fsdp_job_admits_a_late_node_and_reshards_onto_three(tmp_path, launchers, port):
    """The p=2 checkpoint of an FSDP job resumes at p=3 once a third node joins."""
    script, argv = _fsdp_argv(port, tmp_path, "0.2", "1:2")
    first = [launchers.start(*argv) for _ in range(2)]
    holder = read_json(tmp_path / "holding.json")
    assert holder["world"] == 2
    late = launchers.start(*argv)
    outs = [launchers.finish(p) for p in [*first, late]]
    assert [rc for rc, _ in outs] == [0, 0, 0], outs
    starts = read_starts(tmp_path)
    assert [s[:3] for s in starts] == [(0, 2, 0), (0, 2, 1), (1, 3, 0), (1, 3, 1), (1, 3, 2)]
    assert {s[3] for s in starts[2:]} == {2}
    final = rpcdist.load(tmp_path / "final")
    assert (final["world"], final["restart"]) == (3, 1)
    _same_model(final["model"], _fsdp_reference(script))


def test_a_node_that_joins_later_is_admitted_at_the_next_restart(tmp_path, launchers, port):
    argv = _elastic(port, tmp_path, ("--rdzv-last-call", "0.2"), hold="1:2")
    first = [launchers.start(*argv) for _ in range(2)]
    holder = read_json(tmp_path / "holding.json")  # the job runs on two nodes
    assert holder["world"] == 2
    late = launchers.start(*argv)
    outs = [launchers.finish(p) for p in [*first, late]]
    assert [rc for rc, _ in outs] == [0, 0, 0], outs
    assert any("joined; restarting to admit it" in out for _, out in outs)
    assert "joining the job at restart 1/2" in outs[2][1]
    starts = read_starts(tmp_path)
    assert [s[:3] for s in starts] == [(0, 2, 0), (0, 2, 1), (1, 3, 0), (1, 3, 1), (1, 3, 2)]
    assert len({s[3] for s in starts[2:]}) == 1 and starts[2][3] >= 1
    final = rpcdist.load(tmp_path / "final")
    assert (final["world"], final["restart"]) == (3, 1)
    np.testing.assert_allclose(final["w"], train_module().reference(STEPS, 2), rtol=1e-12)


def test_too_few_nodes_within_the_rendezvous_timeout_exit_1(tmp_path, launchers, port):
    rc, out = launchers.run(*_elastic(port, tmp_path, ("--rdzv-timeout", "0.5")))
    assert rc == 1, out
    assert "only 1 of the 2 node(s) needed joined within --rdzv-timeout 0.5 s" in out


def test_a_signalled_node_stops_its_worker_and_leaves_the_others_to_go_on(
    tmp_path, launchers, port
):
    argv = _elastic(port, tmp_path, ("--rdzv-last-call", "30"), hold="2:2")
    nodes = [launchers.start(*argv) for _ in range(3)]
    holder = read_json(tmp_path / "holding.json")
    leaver = next(p for p in nodes if p.pid == holder["launcher"])
    leaver.send_signal(signal.SIGTERM)
    rc, out = launchers.finish(leaver)
    assert rc == 128 + signal.SIGTERM, out
    assert not running(holder["pid"]), out  # stopped and reaped before its launcher left
    outs = [launchers.finish(p) for p in nodes if p is not leaver]
    assert [rc for rc, _ in outs] == [0, 0], outs
    assert all("received signal 15 and left" in out for _, out in outs), outs
    starts = read_starts(tmp_path)
    assert [s[:2] for s in starts][3:] == [(1, 2), (1, 2)], (starts, outs)


def test_when_node_0_is_lost_the_others_stop_their_workers_and_exit_1(tmp_path, launchers, port):
    argv = _elastic(port, tmp_path, ("--rdzv-last-call", "30"), hold="0:2")
    nodes = [launchers.start(*argv) for _ in range(3)]
    holder = read_json(tmp_path / "holding.json")  # rank 0: on the node serving the store
    host = next(p for p in nodes if p.pid == holder["launcher"])
    host.kill()
    host.wait(timeout=30)
    outs = [launchers.finish(p) for p in nodes if p is not host]
    assert [rc for rc, _ in outs] == [1, 1], outs
    assert all("no answer from the launchers' store" in out for _, out in outs), outs
