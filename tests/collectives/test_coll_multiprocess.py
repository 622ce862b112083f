"""Collectives across spawned processes: both backends, failures, init orders.

Each test launches its processes once and runs many cases inside them.
"""

from __future__ import annotations

import coll_workers as cw
import pytest

from rpcdist.testing import run_workers

pytestmark = pytest.mark.multiprocess


@pytest.mark.timeout(150)
@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
def test_all_reduce_matches_numpy_on_both_backends(world):
    results = run_workers(cw.allreduce_matrix, world, args=(1234 + world, 25), timeout=120)
    for r in results:
        assert r["checked"] > 250
        assert r["stats"]["collectives_queued"] == r["stats"]["collectives_inflight"] == 0
        assert r["stats"]["collectives_failed"] == 0
    # Every rank got bitwise the same result (one reducer per element).
    assert len({tuple(r["digests"]) for r in results}) == 1


@pytest.mark.timeout(150)
def test_other_collectives_ordering_barrier_and_cleanup():
    results = run_workers(cw.everything_else, 3, timeout=120)
    for rank, r in enumerate(results):
        # The segments are unlinked as soon as every member mapped them.
        assert r["shm_files_while_running"] == [] and r["shm_files_after"] == []
        for backend in ("shm", "ring"):
            if rank != 0:
                assert r[f"{backend}_barrier_wait"] > 0.4, (backend, r)
        stats = r["stats"]
        assert stats["collectives_queued"] == stats["collectives_inflight"] == 0
        assert stats["p2p_posted"] == 0


@pytest.mark.timeout(150)
def test_mismatch_and_killed_rank_fail_every_rank_within_the_timeout():
    results = run_workers(cw.failures, 4, timeout=120, allow_exit={2, 3})
    survivors = results[:2]
    mismatch_ranks = [results[0], results[1]]
    for r in mismatch_ranks:
        for backend in ("shm", "ring"):
            first, second = r[f"{backend}_mismatch"]
            assert first != "no error" and "#0" in first, r
            assert "unusable" in second or "failed on rank" in second, r
    for r in survivors:
        for backend in ("shm", "ring"):
            message, elapsed = r[f"{backend}_kill"]
            assert message != "no error"
            assert "died" in message or "left" in message or "failed" in message, message
            assert elapsed < 10, (backend, elapsed, message)


@pytest.mark.timeout(120)
def test_rpc_first_then_process_group_share_one_agent():
    results = run_workers(cw.init_orders, 2, timeout=90)
    for rank, r in enumerate(results):
        assert r[1::2][:3] == [1.0, 3.0, 5.0]  # all_reduce between the RPCs
        assert r[0::2][:3] == [k + rank for k in range(3)]  # the RPCs
        assert r[-1] == 2  # RPC still works after destroy_process_group


@pytest.mark.timeout(120)
def test_process_group_first_then_rpc_adopts_the_agent():
    results = run_workers(cw.init_pg_then_rpc, 2, timeout=90)
    assert results == [[1, 1.0], [2, 1.0]]


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_eight_processes():
    results = run_workers(cw.eight, 8, timeout=120)
    expected = [0, 3 * 36, 1001 * 36, 35] * 2
    assert all(r == expected for r in results)
