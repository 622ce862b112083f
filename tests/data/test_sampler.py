"""rpcdist.data.DistributedSampler: PyTorch's semantics, and re-dealing the
unseen samples when the world changes mid-epoch."""

from __future__ import annotations

import collections
import random
import re

import pytest

import rpcdist
from rpcdist.data import DistributedSampler


def _shares(n, world, **kw):
    return [list(DistributedSampler(n, world, r, **kw)) for r in range(world)]


@pytest.mark.parametrize("n", [0, 1, 7, 10, 11, 64])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("shuffle", [False, True])
def test_matches_pytorch_sizes_and_unshuffled_order(n, world, drop_last, shuffle):
    torch = pytest.importorskip("torch.utils.data")
    for rank in range(world):
        ours = DistributedSampler(n, world, rank, shuffle=shuffle, seed=3, drop_last=drop_last)
        theirs = torch.DistributedSampler(
            range(n), world, rank, shuffle=shuffle, seed=3, drop_last=drop_last
        )
        assert len(ours) == len(theirs) == len(list(ours))
        if not shuffle:  # without a permutation the two orders are the same
            assert list(ours) == list(theirs)


@pytest.mark.parametrize("n,world", [(10, 3), (12, 4), (5, 8)])
def test_every_sample_once_padding_by_wraparound(n, world):
    shares = _shares(n, world, seed=1)
    seen = collections.Counter(i for s in shares for i in s)
    assert set(seen) == set(range(n))
    assert {len(s) for s in shares} == {-(-n // world)}
    assert sum(seen.values()) - n == (-n) % world  # only the padding repeats


def test_same_order_on_every_rank_and_new_order_per_epoch():
    a, b = DistributedSampler(100, 2, 0, seed=5), DistributedSampler(100, 2, 1, seed=5)
    first = list(a) + list(b)
    a.set_epoch(1)
    b.set_epoch(1)
    second = list(a) + list(b)
    assert sorted(first) == sorted(second) == list(range(100))
    assert first != second
    assert list(DistributedSampler(100, 2, 0, seed=5)) == first[:50]


def test_ranks_from_the_launcher_environment(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "2")
    s = DistributedSampler(9, shuffle=False)
    assert (s.num_replicas, s.rank, list(s)) == (3, 2, [2, 5, 8])


@pytest.mark.parametrize(
    "kw, needle",
    [
        ({"dataset": 4, "num_replicas": 2, "rank": 2}, "rank must be in [0, 1]"),
        ({"dataset": 4, "num_replicas": 0, "rank": 0}, "num_replicas must be >= 1"),
        ({"dataset": object(), "num_replicas": 1, "rank": 0}, "must have len() or be an int"),
    ],
)
def test_bad_arguments_say_what_was_wrong(kw, needle):
    with pytest.raises(rpcdist.ConfigError, match=re.escape(needle)):
        DistributedSampler(**kw)


def test_no_rank_anywhere_names_the_variable(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(rpcdist.ConfigError, match="no RANK"):
        DistributedSampler(10)


def _run_epoch_with_world_changes(n, worlds, steps, seed):
    """Lockstep ranks take ``steps[i]`` samples each at world size ``worlds[i]``,
    then the world changes; the last world runs the epoch out."""
    seen: list[int] = []
    samplers = [DistributedSampler(n, worlds[0], r, seed=seed) for r in range(worlds[0])]
    for i in range(len(worlds)):
        iters = [iter(s) for s in samplers]
        last = i == len(worlds) - 1
        budget = len(samplers[0]) if last else min(steps[i], len(samplers[0]))
        for _ in range(budget):
            seen.extend(next(it) for it in iters)
        if last:
            assert all(next(it, None) is None for it in iters)
            break
        state = samplers[0].state_dict()  # what a survivor hands a newcomer
        nxt = worlds[i + 1]
        new = []
        for r in range(nxt):
            s = samplers[r] if r < len(samplers) else DistributedSampler(n, nxt, r, seed=seed)
            if r >= len(samplers):
                s.load_state_dict(state)
                s.reshard(nxt, r, consumed=state["taken"])
            else:
                s.reshard(nxt, r)
            new.append(s)
        samplers = new
    return seen


def test_world_changes_mid_epoch_lose_and_repeat_nothing():
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randrange(1, 80)
        worlds = [rng.randrange(1, 6) for _ in range(rng.randrange(2, 5))]
        steps = [rng.randrange(0, 12) for _ in worlds]
        seen = _run_epoch_with_world_changes(n, worlds, steps, seed=rng.randrange(100))
        counts = collections.Counter(seen)
        assert set(counts) == set(range(n)), (n, worlds, steps)
        # the only repeats are one round's padding, at the end of the order
        assert sum(counts.values()) - n < max(worlds), (n, worlds, steps)


def test_state_travels_to_a_replacement_rank():
    old = [DistributedSampler(20, 2, r, seed=9) for r in range(2)]
    its = [iter(s) for s in old]
    head = [next(it) for _ in range(3) for it in its]
    replacement = DistributedSampler(20, 2, 1, seed=9)
    replacement.load_state_dict(old[0].state_dict())
    assert len(replacement) == 10 - 3
    assert list(replacement) == list(its[1])  # rank 1's rest, as if it never died
    assert sorted(head + list(its[0]) + list(replacement)) == list(range(20))


def test_a_state_for_another_dataset_is_refused():
    s = DistributedSampler(20, 2, 0)
    with pytest.raises(rpcdist.ConfigError, match="dataset_size is 21"):
        s.load_state_dict(DistributedSampler(21, 2, 0).state_dict())
    with pytest.raises(rpcdist.ConfigError, match="consumed=11"):
        s.reshard(3, 0, consumed=11)
