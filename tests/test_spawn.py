"""rpcdist.spawn: N processes that form a job from the environment, and a
failure in one that stops the rest and is raised in the parent."""

from __future__ import annotations

import os

import pytest
import spawn_funcs

import rpcdist

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]


def _gone(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_ranks_form_a_job_from_the_environment(tmp_path):
    rpcdist.spawn(spawn_funcs.rpc_job, 3, args=(str(tmp_path),))
    got = {p.name: p.read_text() for p in tmp_path.iterdir()}
    assert got == {f"rank{r}": f"{r} {r} 3 {2 * r}" for r in range(3)}


def test_a_raising_rank_stops_the_others_and_is_raised(tmp_path):
    with pytest.raises(rpcdist.ProcessFailedError, match="process 1 exited with code 1") as info:
        rpcdist.spawn(spawn_funcs.fail_on_one, 3, args=(str(tmp_path),))
    assert info.value.rank == 1
    assert "ValueError: rank one gives up" in info.value.remote_traceback
    assert "fail_on_one" in str(info.value)  # the child's frames are shown
    pids = [int(p.read_text()) for p in tmp_path.glob("pid[0-9]")]
    assert all(_gone(pid) for pid in pids)


def test_a_killed_rank_is_named_with_its_signal(tmp_path):
    with pytest.raises(rpcdist.ProcessFailedError, match="process 1 was killed by SIGKILL"):
        rpcdist.spawn(spawn_funcs.die_on_one, 2, args=(str(tmp_path),))
    assert all(_gone(int(p.read_text())) for p in tmp_path.glob("pid[0-9]"))


@pytest.mark.parametrize("n", [0, -1, 1.5, True])
def test_bad_nprocs(n):
    with pytest.raises(rpcdist.ConfigError, match="nprocs must be a positive integer"):
        rpcdist.spawn(spawn_funcs.double, n)
