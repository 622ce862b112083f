"""Fault-tolerant ZeRO and FSDP: a rank killed (-9) mid-step, the shards re-formed.

The ranks are ``ft_worker.py`` processes with ``FT_MODE=zero`` (DDP with a
fault-tolerant ``ZeroRedundancyOptimizer``) or ``FT_MODE=fsdp`` (a
fault-tolerant ``FullyShardedDataParallel``), started as in
``test_fault_tolerant_ddp.py`` (``RANK``, ``RPCDIST_FT_ADDR`` in the
environment); faults come from outside (SIGKILL at a marker file). The
oracle replays the coordinator's record of the committed steps in one
process: the survivors' full parameters must equal it bit for bit, and each
rank's shards (its own slice and its successor's, of the padded flat
layout at the final world size) must hold the oracle's parameters and
momentum at exactly those elements. FSDP is also run with mixed precision
(``FT_MP``; against an oracle that rounds as FSDP does, and against FSDP
over a process group) and with ``no_shard`` (``FT_STRATEGY``; every rank
holds the whole vector).
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import ft_worker as fw
import ml_dtypes
import numpy as np
import pytest
from test_fault_tolerant_ddp import (
    check_replacement,
    check_survivors,
    job,
    kill_one_of_three,
    replay_with_optim,
)

import rpcdist
import rpcdist.tensor as rt
from rpcdist.parallel._flat import FlatLayout, shard_ranges
from rpcdist.testing import run_workers

pytestmark = pytest.mark.multiprocess


def expected_zero_pieces(sizes: list[int], world: int, rank: int) -> list[tuple[int, int, int]]:
    ranges = shard_ranges(sizes, ["one kind"] * len(sizes), world)
    ranks = [rank] if world == 1 else [rank, (rank + 1) % world]
    return [
        (i, *r[i]) for q in ranks for i in range(len(sizes)) if (r := ranges[q])[i][1] > r[i][0]
    ]


def check_shards(
    out: Path,
    mode: str,
    ranks: list[int],
    oracle: Any,
    opt: Any,
    key: str = "momentum_buffer",
    whole: bool = False,
) -> None:
    params = list(oracle.parameters())
    sizes = [p.data.size for p in params]
    moms = [opt.state[p][key].ravel() for p in params]
    seen_ranks = []
    for r in ranks:
        f = rpcdist.load(str(out / f"rank{r}.npz"))
        world, rank = int(f["world"]), int(f["rank"])
        assert world == len(ranks)
        seen_ranks.append(rank)
        if mode == "zero":
            pieces = [tuple(int(x) for x in row) for row in f["pieces"]]
            assert sorted(pieces) == sorted(expected_zero_pieces(sizes, world, rank))
            want = np.concatenate([moms[i][lo:hi] for i, lo, hi in pieces])
        else:
            layout = FlatLayout(sum(sizes), 1 if whole else world)
            held = [0] if whole else [rank, (rank + 1) % world]  # no_shard: the whole vector
            slices = [layout.bounds(q) for q in held]
            flat_p = np.zeros(layout.padded)
            flat_p[: layout.numel] = np.concatenate([p.data.ravel() for p in params])
            flat_m = np.zeros(layout.padded)
            flat_m[: layout.numel] = np.concatenate(moms)
            np.testing.assert_array_equal(
                f["shard"], np.concatenate([flat_p[a:b] for a, b in slices])
            )
            want = np.concatenate([flat_m[a:b] for a, b in slices])
        np.testing.assert_array_equal(f["momentum"], want)
    assert sorted(seen_ranks) == list(range(len(ranks)))
    if mode == "zero":
        check_consolidated(out, ranks, opt)


def check_consolidated(out: Path, ranks: list[int], opt: Any) -> None:
    """ZeRO's ``consolidate_state_dict`` over the final members: on the last member
    only, equal to the oracle's unsharded optimizer state dict, bit for bit."""
    saved = [rpcdist.load(str(out / f"rank{r}.npz")) for r in ranks]
    got = [f["consolidated"] for f in saved if "consolidated" in f]
    assert len(got) == 1
    want = opt.state_dict()
    assert sorted(int(k) for k in got[0]["state"]) == sorted(want["state"])
    for i, st in want["state"].items():
        mine = got[0]["state"][i] if i in got[0]["state"] else got[0]["state"][str(i)]
        assert sorted(mine) == sorted(st)
        for k, v in st.items():
            np.testing.assert_array_equal(np.asarray(mine[k]), np.asarray(v), err_msg=f"{i}/{k}")
    for g, w in zip(got[0]["param_groups"], want["param_groups"], strict=True):
        assert {k: v for k, v in g.items() if k != "params"} == {
            k: v for k, v in w.items() if k != "params"
        }
        assert list(g["params"]) == list(w["params"])


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("mode", "point"),
    [
        ("zero", "mid_allreduce"),
        ("zero", "after_commit"),  # dies before its slice's all-gather: survivors refresh
        ("fsdp", "before_allreduce"),
        ("fsdp", "mid_allreduce"),
    ],
)
def test_kill_one_of_three_mid_step_reshards(tmp_path, monkeypatch, mode, point):
    monkeypatch.setenv("FT_MODE", mode)
    coord = kill_one_of_three(tmp_path, 10, 4, point)
    assert len(coord.commits) == 10
    assert [m for m, _ in coord.commits[-1][1]] == [0, 2]
    assert all(len(b) == 3 for _, b in coord.commits[:4])
    assert sum(e[1] == "redo" for e in coord.events) == 1
    check_survivors(tmp_path, [0, 2], coord)  # full parameters: the oracle's, bit for bit
    oracle, opt = replay_with_optim(coord.commits)
    check_shards(tmp_path, mode, [0, 2], oracle, opt)  # re-formed at world 2, same values


def replace_rank_two(tmp_path: Path) -> Any:
    """Ranks 0-2 train 16 steps; rank 2 is killed (-9) mid-step 4 and replaced (at step 9)."""
    with job(tmp_path, 3, steps=16) as ranks:
        for r in range(3):
            ranks.start(r, kill="4:mid_allreduce" if r == 2 else None, hold=9 if r == 0 else -1)
        ranks.marker(2, 4)
        ranks.signal(2, signal.SIGKILL)
        ranks.replace(2, survivors=[0, 1])  # rank 0 holds the job at step 9 until it joins
        ranks.wait([0, 1, 2])
        return ranks.coord


@pytest.mark.timeout(240)
@pytest.mark.parametrize("opt_name", ["sgd", "adam"])  # Adam: its scalar step re-sharded too
@pytest.mark.parametrize("mode", ["zero", "fsdp"])
def test_a_replacement_receives_its_shards_from_the_survivors(
    tmp_path, monkeypatch, mode, opt_name
):
    """FSDP's module also has buffers (``FT_BUFFERS``): the replacement takes them with
    the live state, bit for bit (the count of committed steps it missed included),
    and at the first quorum ranks 1 and 2 take rank 0's (each drew its own)."""
    monkeypatch.setenv("FT_MODE", mode)
    monkeypatch.setenv("FT_OPT", opt_name)
    monkeypatch.setenv("FT_BUFFERS", "1")
    coord = replace_rank_two(tmp_path)
    # Full parameters (and FSDP's buffers): bit for bit.
    a, b = check_replacement(tmp_path, coord, 3, [0, 1, 2], 2, opt_name)
    if mode == "fsdp":
        first = np.random.default_rng(0).standard_normal(5)  # rank 0's, as drawn
        for saved in (a, b):
            np.testing.assert_array_equal(saved["params"]["stats"], first)
            np.testing.assert_array_equal(saved["params"]["tracked"], [len(coord.commits)])
    oracle, opt = replay_with_optim(coord.commits, opt_name)
    check_shards(tmp_path, mode, [0, 1, 2], oracle, opt, fw.OPTIMIZERS[opt_name][2])


def replay_mixed(commits: list[Any], mp: str) -> tuple[Any, Any]:
    """:func:`replay_with_optim` with FSDP's mixed precision, written out independently.

    Forward and backward on the parameters rounded to ``mp``; each member's
    gradient rounded to ``mp`` (float16: divided by the member count
    first); summed in member order and divided in float64 (the commit's
    average); then float16 multiplied back and rounded once (the
    reduce-scatter's float16 sum), bfloat16 rounded to float32 (its float32
    sum); SGD on the float64 parameters.
    """

    def rounded(x: np.ndarray) -> np.ndarray:
        low = np.float16 if mp == "float16" else ml_dtypes.bfloat16
        return x.astype(low).astype(np.float32 if mp == "bfloat16" else np.float16)

    master, work = fw.model(1), fw.model(1)
    params, views = list(master.parameters()), list(work.parameters())
    opt_class, options, _ = fw.OPTIMIZERS["sgd"]
    opt = opt_class(params, **options)
    for _, batches in commits:
        n = len(batches)
        for v, p in zip(views, params, strict=True):
            v.data = rounded(p.data).astype(np.float64)
        total = [np.zeros(p.data.shape) for p in params]
        for _, idx in batches:
            work.zero_grad()
            fw.loss_of(work, np.asarray(idx)).backward()
            for t, v in zip(total, views, strict=True):
                g = v.grad.data * (1.0 / n) if mp == "float16" else v.grad.data
                t += rounded(g)
        for t, p in zip(total, params, strict=True):
            avg = t / n
            red = (avg * n).astype(np.float16) if mp == "float16" else avg.astype(np.float32)
            p.grad = rt.Tensor(red.astype(np.float64))
        opt.step()
    return master, opt


def check_slices(out: Path, ranks: list[int]) -> None:
    """Every committed step, both holders of each slice logged the same digest."""
    by_step: dict[tuple[int, str], set[str]] = {}
    for r in ranks:
        lines = (out / f"slices{r}.log").read_text().split()
        assert lines
        for step, held in zip(lines[::2], lines[1::2], strict=True):
            for part in held.split(","):
                q, digest = part.split(":")
                by_step.setdefault((int(step), q), set()).add(digest)
    assert all(len(d) == 1 for d in by_step.values()), "a slice differs between its holders"


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("mp", "point"), [("float16", "mid_allreduce"), ("bfloat16", "before_allreduce")]
)
def test_mixed_precision_kill_one_of_three_mid_step(tmp_path, monkeypatch, mp, point):
    """Parameters gathered and gradients reduced in 16 bits survive a kill -9: bit-identical
    slices every step, and the mixed-precision oracle's values and momentum at the end."""
    monkeypatch.setenv("FT_MODE", "fsdp")
    monkeypatch.setenv("FT_MP", mp)
    coord = kill_one_of_three(tmp_path, 10, 4, point)
    assert len(coord.commits) == 10
    assert [m for m, _ in coord.commits[-1][1]] == [0, 2]
    assert sum(e[1] == "redo" for e in coord.events) == 1
    check_slices(tmp_path, [0, 2])
    oracle, opt = replay_mixed(coord.commits, mp)
    exact, _ = replay_with_optim(coord.commits)
    finals = [rpcdist.load(str(tmp_path / f"rank{r}.npz")) for r in (0, 2)]
    for k, v in oracle.state_dict().items():
        for f in finals:
            np.testing.assert_array_equal(f["params"][k], v, err_msg=k)
        assert not np.array_equal(exact.state_dict()[k], v)  # the rounding did something
    check_shards(tmp_path, "fsdp", [0, 2], oracle, opt)


@pytest.mark.timeout(180)
def test_no_shard_kill_one_of_three_mid_step(tmp_path, monkeypatch):
    """``no_shard``: every member holds the whole model; a kill -9 mid-step leaves the
    survivors bit-identical every step and equal to the oracle, momentum included."""
    monkeypatch.setenv("FT_MODE", "fsdp")
    monkeypatch.setenv("FT_STRATEGY", "no_shard")
    coord = kill_one_of_three(tmp_path, 10, 4, "mid_allreduce")
    assert len(coord.commits) == 10
    assert [m for m, _ in coord.commits[-1][1]] == [0, 2]
    assert sum(e[1] == "redo" for e in coord.events) == 1
    check_slices(tmp_path, [0, 2])
    check_survivors(tmp_path, [0, 2], coord)
    oracle, opt = replay_with_optim(coord.commits)
    check_shards(tmp_path, "fsdp", [0, 2], oracle, opt, whole=True)


@pytest.mark.timeout(240)
def test_no_shard_replacement_receives_the_whole_model(tmp_path, monkeypatch):
    monkeypatch.setenv("FT_MODE", "fsdp")
    monkeypatch.setenv("FT_STRATEGY", "no_shard")
    monkeypatch.setenv("FT_OPT", "adam")
    coord = replace_rank_two(tmp_path)
    check_slices(tmp_path, [0, 1, 2])
    check_replacement(tmp_path, coord, 3, [0, 1, 2], 2, "adam")
    oracle, opt = replay_with_optim(coord.commits, "adam")
    check_shards(tmp_path, "fsdp", [0, 1, 2], oracle, opt, fw.OPTIMIZERS["adam"][2], whole=True)


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("mp", "strategy"),
    [("float16", "full_shard"), ("bfloat16", "full_shard"), ("float16", "no_shard")],
)
def test_mixed_precision_rounds_as_over_a_process_group(tmp_path, monkeypatch, mp, strategy):
    """Two ranks, no fault: the same batches through FSDP over a process group, in the same
    mixed precision, give the same parameters bit for bit (two 16-bit values sum exactly)."""
    monkeypatch.setenv("FT_MODE", "fsdp")
    monkeypatch.setenv("FT_MP", mp)
    monkeypatch.setenv("FT_STRATEGY", strategy)
    with job(tmp_path, 2, steps=5) as ranks:
        for r in range(2):
            ranks.start(r)
        ranks.wait([0, 1])
        coord = ranks.coord
    assert [len(b) for _, b in coord.commits] == [2] * 5
    commits = [(s, [(m, list(map(int, idx))) for m, idx in b]) for s, b in coord.commits]
    want = run_workers(fw.process_group_run, 2, args=(commits, mp, strategy), timeout=120)
    exact, _ = replay_with_optim(coord.commits)
    for r in range(2):
        got = rpcdist.load(str(tmp_path / f"rank{r}.npz"))["params"]
        for k, v in want[r].items():
            np.testing.assert_array_equal(got[k], v, err_msg=k)
            assert not np.array_equal(exact.state_dict()[k], v)  # the rounding did something
