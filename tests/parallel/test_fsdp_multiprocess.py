"""FullyShardedDataParallel across spawned processes, against one-process training.

The oracle (``ddp_workers.oracle``) trains one float64 model on the global
batch. Each test launches its ranks once and runs many cases inside
(``fsdp_workers``).
"""

from __future__ import annotations

from typing import Any

import ddp_workers as dw
import fsdp_workers as fw
import numpy as np
import pytest

from rpcdist.testing import run_workers

pytestmark = pytest.mark.multiprocess

TOL = {"rtol": 1e-10, "atol": 1e-12}


def same(a: dict[str, Any], b: dict[str, Any], **tol: float) -> None:
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_allclose(a[k], b[k], err_msg=k, **(tol or TOL))


def identical(results: list[dict[str, Any]], key: str) -> None:
    for r in results[1:]:
        for k, v in results[0][key].items():
            assert np.array_equal(v, r[key][k]), (key, k)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("world", [2, 3])
def test_every_strategy_matches_one_process_training(world):
    results = run_workers(fw.training_cases, world, timeout=130)
    r0 = results[0]
    for name, make_opt in fw.OPTS.items():
        want = dw.oracle(3, world, opt=make_opt)[0].state_dict()
        for strategy in fw.STRATEGIES:
            key = f"{strategy}_{name}"
            identical(results, key)
            same(r0[key], want)
    adam = dw.oracle(3, world, opt=fw.OPTS["adam"])[0].state_dict()
    same(r0["one_unit"], adam)
    same(r0["by_size"], adam)
    assert r0["one_unit_units"] == 1  # the root alone
    assert r0["by_size_units"] == 3  # root + the two 16x16/6x16 layers (112 and 272 params)
    same(r0["no_sync"], dw.oracle(2, world, micro=3)[0].state_dict())
    assert r0["no_sync_reductions"] == 2 * 3  # one per unit with parameters per step
    assert r0["rank0_only"].keys() == r0["no_sync"].keys()
    assert all(r["rank0_only"] == {} for r in results[1:])
    check_memory_is_one_over_p(results, world)


def check_memory_is_one_over_p(results: list[dict[str, Any]], world: int) -> None:
    full = results[0]["unsharded_bytes"]
    full_optim = results[0]["unsharded_optim_bytes"]
    for r in results:
        for strategy in ("full_shard", "shard_grad_op"):
            stats = r[f"{strategy}_adam_stats"]
            # padding adds at most world-1 elements per unit (8 bytes each)
            pad = 4 * (world - 1) * 8
            assert full / world <= stats["shard_bytes"] <= full / world + pad
            assert full / world <= stats["grad_bytes"] <= full / world + pad
            assert stats["transient_bytes"] == 0  # everything gathered was freed
            optim_bytes = r[f"{strategy}_adam_optim_bytes"]
            assert full_optim / world <= optim_bytes <= full_optim / world + 2 * pad
        unsharded = r["no_shard_adam_stats"]
        assert unsharded["shard_bytes"] == full and r["no_shard_adam_optim_bytes"] == full_optim
        # full_shard gathers each unit twice per step (forward, backward), except the
        # last, which stays gathered from its forward to its backward; ZeRO-2 once
        steps, units = 3, 3
        assert r["shard_grad_op_adam_stats"]["gathers"] == steps * units
        assert r["full_shard_adam_stats"]["gathers"] == steps * (2 * units - 1)
        # every gather is started ahead, by the unit before (the root, which has no
        # parameters of its own here, starts the first layer's)
        for strategy in ("full_shard", "shard_grad_op"):
            stats = r[f"{strategy}_adam_stats"]
            assert stats["prefetches"] == stats["gathers"] > 0


@pytest.mark.timeout(200)
def test_state_dicts_round_trip_and_reshard_from_three_ranks_to_two(tmp_path):
    path = str(tmp_path / "fsdp.ckpt")
    results = run_workers(fw.checkpoint_cases, 3, args=(path,), timeout=90)
    r0 = results[0]
    want2 = dw.oracle(2, 3, opt=fw.OPTS["adam"])[0].state_dict()
    same(r0["full"], want2)
    for r in results:
        same(r["sharded_round_trip"], r0["full"])
        same(r["full_round_trip"], r0["full"])
        same(r["into_plain_module"], r0["full"])
        assert "saved at" not in r["wrong_rank"] and r["wrong_rank"].startswith("ConfigError")
        assert "rank" in r["wrong_rank"] and "full state dict" in r["wrong_rank"]
        assert r["empty_full"].startswith("ConfigError") and "missing keys" in r["empty_full"]
        same(r["resumed_same_p"], r["continued"])
    assert all(r["others_empty"] for r in results[1:])
    want_pair = dw.oracle(3, 2, opt=fw.OPTS["adam"])[0].state_dict()
    same(results[0]["subgroup"], want_pair)
    same(results[1]["subgroup"], want_pair)
    assert "not a member" in results[2]["non_member"]
    # Resume at p=2: steps 0-1 on 3 ranks' data, steps 2-3 on 2 ranks' data.
    m, o = dw.oracle(2, 3, opt=fw.OPTS["adam"])
    m, o = dw.oracle(4, 2, model=m, optimizer=o, start=2)
    resumed = run_workers(fw.resume_cases, 2, args=(path,), timeout=90)
    for r in resumed:
        same(r["resumed"], m.state_dict())


@pytest.mark.timeout(150)
@pytest.mark.parametrize("world", [2, 3])
def test_mixed_precision_join_and_errors(world):
    results = run_workers(fw.misc_cases, world, timeout=130)
    r0 = results[0]
    sgd = dw.oracle(3, world)[0].state_dict()
    for mp, tol in (("float16", 2e-3), ("bfloat16", 2e-2)):
        identical(results, mp)
        same(r0[mp], sgd, rtol=tol, atol=tol)
        assert max(np.max(np.abs(r0[mp][k] - sgd[k])) for k in sgd) > 0  # it did round
    batches = [2, 4, 3][:world]
    want = dw.oracle(max(batches), world, batches=batches)[0].state_dict()
    for strategy in fw.STRATEGIES:
        identical(results, f"join_{strategy}")
        same(r0[f"join_{strategy}"], want)
    mean = dw.oracle(max(batches), world, batches=batches, divide_by_world=False)[0]
    same(r0["join_active_mean"], mean.state_dict())
    same(r0["with_buffer"], dw.oracle(3, world, make=dw.WithBuffer)[0].state_dict())
    assert "scale" in r0["with_buffer"]
    x, _ = dw.batch(0, 0)
    np.testing.assert_allclose(r0["eval"], dw.mlp(1)(dw.rt.tensor(x)).numpy(), rtol=1e-12)
    assert r0["eval_freed"] == 0
    np.testing.assert_allclose(r0["after_load"], dw.mlp(33)(dw.rt.tensor(x)).numpy(), rtol=1e-12)
    assert "optimizer" in r0["join_needs_optimizer"]
    assert "sharding_strategy" in r0["bad_strategy"] and "zero4" in r0["bad_strategy"]
    assert "int8" in r0["bad_mp"]
    assert "already wrapped" in r0["twice"]
