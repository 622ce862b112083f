"""DDP, Join, comm hooks and ZeRO across spawned processes, against one-process oracles.

The oracle trains one model on the global batch (float64); DDP must match it
to rounding and be bit-identical across ranks. Each test launches its ranks
once and runs many cases inside (see ``ddp_workers``).
"""

from __future__ import annotations

from typing import Any

import ddp_workers as dw
import numpy as np
import pytest

from rpcdist import optim
from rpcdist.testing import run_workers

pytestmark = pytest.mark.multiprocess

TOL = {"rtol": 1e-10, "atol": 1e-12}


def same(a: dict[str, Any], b: dict[str, Any], **tol: float) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if a[k] is None or b[k] is None:
            assert a[k] is None and b[k] is None, k
        else:
            np.testing.assert_allclose(a[k], b[k], err_msg=k, **(tol or TOL))


def identical(results: list[dict[str, Any]], key: str) -> None:
    first = results[0][key]
    for r in results[1:]:
        for k in first:
            assert np.array_equal(first[k], r[key][k]), (key, k)


def oracle_grads(world: int, make: Any = dw.mlp, flags: list[bool] | None = None) -> dict:
    m = make(1)
    total = None
    for r in range(world):
        if flags is not None:
            m.use_extra = flags[r]
        x, y = dw.batch(0, r)
        part = dw.loss_of(m, x, y)
        total = part if total is None else total + part
    (total * (1.0 / world)).backward()
    return dw.grads(m)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [1, 2, 3])
def test_ddp_matches_one_process_training(world):
    results = run_workers(dw.training_cases, world, timeout=100)
    identical(results, "plain")
    identical(results, "no_sync")
    want = dw.oracle(4, world)[0].state_dict()
    same(results[0]["plain"], want)
    # Bucket sizes and views-or-copies do not change the result.
    assert results[0]["tiny_buckets_buckets"] >= 5
    same(results[0]["tiny_buckets_copies"], want)
    same(results[0]["one_bucket"], want)
    if world == 2:  # two addends: the same sum in any order, to the bit
        for k in want:
            assert np.array_equal(results[0]["tiny_buckets_copies"][k], results[0]["plain"][k])
    # no_sync: three micro-batches accumulated, one all-reduce.
    same(results[0]["no_sync"], dw.oracle(3, world, micro=3)[0].state_dict())
    assert all(r["grad_is_view"] for r in results)
    for r in results:
        same(r["external"], oracle_grads(world))
        assert r["external_left_grad_alone"]


@pytest.mark.timeout(120)
def test_comm_hooks():
    results = run_workers(dw.hook_cases, 2, timeout=100)
    r0, r1 = results
    exact = oracle_grads(2)
    same(r0["none"], exact)
    same(r0["allreduce"], exact)
    for r in results:
        same(r["double"], {k: 2 * v for k, v in exact.items()})
        same(r["new_array"], {k: v - 1 for k, v in exact.items()})
        scale = max(float(np.abs(v).max()) for v in exact.values())
        same(r["fp16"], exact, rtol=0, atol=2e-3 * scale)
        same(r["bf16"], exact, rtol=0, atol=1e-2 * scale)
        same(r["powersgd_exact"], exact, rtol=1e-8, atol=1e-10)
        same(r["powersgd_before_start"], exact)
        assert r["powersgd_feedback_residual"] < 1e-12
        rate, raw, packed = r["powersgd_stats"]
        assert rate > 1 and raw > packed > 0
        assert r["powersgd_iter"] == 1
        assert r["powersgd_warm"]
        assert "callable" in r["bad_hook"]
    for key in ("fp16", "bf16", "powersgd_rank1"):
        for k in r0[key]:
            assert np.array_equal(r0[key][k], r1[key][k]), (key, k)
    identical(results, "bf16_train")
    identical(results, "powersgd_train")
    # The compressed runs still learn roughly what the exact one does.
    same(r0["bf16_train"], dw.oracle(3, 2)[0].state_dict(), rtol=0, atol=2e-2)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", ["shm", "ring"])
def test_compressing_hooks_per_backend(backend):
    results = run_workers(dw.hook_wire_cases, 2, args=(backend,), timeout=100)
    r0, r1 = results
    exact = oracle_grads(2)
    scale = max(float(np.abs(v).max()) for v in exact.values())
    for r in results:
        assert r["backend"] == backend
        if backend == "shm":  # the plain float32 all-reduce: no cast, no all-to-all
            assert r["wire_dtypes"] == []
            same(r["fp16"], exact)
            same(r["bf16"], exact)
        else:  # 16-bit values on the wire, summed in float32
            assert r["wire_dtypes"] == ["<u2"]
            same(r["fp16"], exact, rtol=0, atol=2e-3 * scale)
            same(r["bf16"], exact, rtol=0, atol=1e-2 * scale)
    for key in ("fp16", "bf16"):
        for k in r0[key]:
            assert np.array_equal(r0[key][k], r1[key][k]), (key, k)
    identical(results, "bf16_train")
    same(r0["bf16_train"], dw.oracle(3, 2)[0].state_dict(), rtol=0, atol=2e-2)


@pytest.mark.timeout(120)
def test_unused_parameters_misuse_and_buffers():
    results = run_workers(dw.unused_and_errors, 2, timeout=100)
    r0, r1 = results
    for r in results:
        msg = r["strict"]
        assert msg.startswith("AutogradError"), msg
        for name in ("extra.weight", "never.bias", "find_unused_parameters", "rank 0", "rank 1"):
            assert name in msg, (name, msg)
        assert r["after_error"].startswith("AutogradError")
    assert (
        "on this rank (0) no gradient reached ['extra.weight', 'extra.bias', 'never" in r0["strict"]
    )
    assert "on this rank (1) no gradient reached ['never.weight'" in r1["strict"]
    assert "rank 1: no gradient for ['never.weight', 'never.bias']" in r0["strict"]
    # find_unused_parameters / static_graph: partial use averages with zeros,
    # a parameter nobody used keeps grad None.
    want = oracle_grads(2, dw.Branchy, flags=[False, True])
    assert want["never.weight"] is None
    acc = dw.Branchy(1)
    for micro in (0, 1):
        for r in range(2):
            acc.use_extra = r == 1 and micro == 0
            x, y = dw.batch(0, r, micro)
            (dw.loss_of(acc, x, y) * 0.5).backward()
    want_acc = dw.grads(acc)
    assert want_acc["extra.weight"] is not None and want_acc["never.weight"] is None
    for r in results:
        same(r["lenient_no_sync_grads"], want_acc)
        same(r["lenient_grads"], want)
        same(r["static_grads"], want)
        assert "no DistributedDataParallel forward is waiting" in r["backward_twice"]
        assert "no DistributedDataParallel forward is waiting" in r["through_module"]
        same(r["forward_without_backward_ok"], oracle_grads(2))
        assert r["mismatch"].startswith("ConfigError") and "differs across ranks" in r["mismatch"]
        assert "(16, 6)" in r["mismatch"] and "(17, 6)" in r["mismatch"]
        assert r["mismatch_count"].startswith("ConfigError")
        assert (
            "requires_grad=True" in r["mismatch_frozen"]
            and "requires_grad=False" in r["mismatch_frozen"]
        )
        assert "bucket_cap_mb" in r["bad_cap"]
    for rank, r in enumerate(results):
        np.testing.assert_array_equal(r["buffer_True"], [2.0] * 3)
        np.testing.assert_array_equal(r["buffer_False"], [rank + 2.0] * 3)


@pytest.mark.timeout(150)
def test_join_zero_and_checkpoint_across_world_sizes(tmp_path):
    ckpt = str(tmp_path / "ckpt.npz")
    results = run_workers(dw.join_cases, 3, args=(ckpt,), timeout=130)
    sgd = lambda ps: optim.SGD(ps, lr=0.1)  # noqa: E731
    momentum = lambda ps: optim.SGD(ps, lr=0.1, momentum=0.9)  # noqa: E731
    for key, want in [
        ("join_246", dw.oracle(6, 3, opt=sgd, batches=[2, 4, 6])),
        (
            "join_246_active_mean",
            dw.oracle(6, 3, opt=sgd, batches=[2, 4, 6], divide_by_world=False),
        ),
        ("join_246_zero", dw.oracle(6, 3, opt=momentum, batches=[2, 4, 6])),
    ]:
        identical(results, key)
        same(results[0][key], want[0].state_dict())
    identical(results, "join_246_bf16")
    same(
        results[0]["join_246_bf16"],
        dw.oracle(6, 3, opt=sgd, batches=[2, 4, 6])[0].state_dict(),
        rtol=0,
        atol=2e-2,
    )
    pair = results[:2]
    identical(pair, "join_35")
    same(pair[0]["join_35"], dw.oracle(5, 2, opt=sgd, batches=[3, 5])[0].state_dict())
    assert "not a member" in results[2]["non_member"]
    for r in results:
        assert "ran out of inputs" in r["throw"], r["throw"]
    assert results[1]["state_dict_elsewhere"].startswith("ConfigError")
    # Two Adam steps on 2 ranks, checkpoint, two more on 3 ranks.
    adam = lambda ps: optim.Adam(ps, lr=0.01)  # noqa: E731
    model, opt = dw.oracle(2, 2, opt=adam)
    model, opt = dw.oracle(4, 3, model=model, optimizer=opt, start=2)
    identical(results, "resumed")
    same(results[0]["resumed"], model.state_dict())
    got, want = results[2]["resumed_optim"], opt.state_dict()
    assert got["param_groups"] == want["param_groups"]
    assert got["state"].keys() == want["state"].keys()
    for i in want["state"]:
        same(got["state"][i], want["state"][i])
    owned = [r["zero_stats"]["zero_elements_owned"] for r in results]
    assert sum(owned) == results[0]["zero_stats"]["zero_elements_total"]
    assert max(owned) - min(owned) <= 1  # an even split of the elements


@pytest.mark.timeout(120)
def test_zero_matches_the_unsharded_optimizer():
    results = run_workers(dw.zero_cases, 2, timeout=100)
    adam = lambda ps: optim.Adam(ps, lr=0.01)  # noqa: E731
    model, opt = dw.oracle(3, 2, opt=adam)
    for views in (False, True):
        identical(results, f"adam_views_{views}")
        same(results[0][f"adam_views_{views}"], model.state_dict())
        stats = [r[f"owned_{views}"] for r in results]
        assert sum(s["zero_elements_owned"] for s in stats) == stats[0]["zero_elements_total"]
        # Adam keeps two moments per owned element (float64), plus a step count.
        assert all(s["zero_state_bytes"] == 16 * s["zero_elements_owned"] for s in stats)
    got, want = results[1]["consolidated"], opt.state_dict()
    assert got["param_groups"] == want["param_groups"]
    for i in want["state"]:
        same(got["state"][i], want["state"][i])
    assert all(r["lr_zero_keeps_params"] for r in results)
