"""The pure parts of rpcdist.parallel: bucket plan, ZeRO partition, bfloat16, PowerSGD algebra."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rpcdist.parallel._bf16 import from_bf16, to_bf16
from rpcdist.parallel._bucket import comm_overlap
from rpcdist.parallel._buckets import BucketPlan, ParamSpec, plan_buckets
from rpcdist.parallel._flat import FlatLayout, shard_ranges
from rpcdist.parallel._powersgd import _orthonormalize

MiB = 1 << 20


def specs(*sizes: int, kind: str = "f4") -> list[ParamSpec]:
    return [ParamSpec(n, 4, kind) for n in sizes]


def test_first_bucket_is_small_and_later_ones_use_the_cap():
    # parameters() order: fc1.w (3 MiB), fc1.b, fc2.w (4 MiB), fc2.b, fc3.w (40 KiB), fc3.b
    ps = specs(784 * 1024, 1024, 1024 * 1024, 1024, 10240, 10)
    plans = plan_buckets(ps, cap_bytes=25 * MiB)
    # Walked backwards: fc3.b, fc3.w, fc2.b, fc2.w passes 1 MiB -> bucket 0.
    assert [p.params for p in plans] == [(5, 4, 3, 2), (1, 0)]
    assert plans[0].offsets == (0, 10, 10 + 10240, 10 + 10240 + 1024)
    assert plans[0].numel == 10 + 10240 + 1024 + 1024 * 1024


def test_a_tiny_cap_gives_one_bucket_per_parameter_in_reverse():
    plans = plan_buckets(specs(5, 6, 7), cap_bytes=1)
    assert [p.params for p in plans] == [(2,), (1,), (0,)]


def test_kinds_never_share_a_bucket():
    ps = [ParamSpec(10, 4, "f4"), ParamSpec(10, 8, "f8"), ParamSpec(10, 4, "f4")]
    plans = plan_buckets(ps, cap_bytes=MiB)
    assert sorted(p.params for p in plans) == [(1,), (2, 0)]
    assert {p.kind for p in plans} == {"f4", "f8"}


def test_bad_caps_raise():
    with pytest.raises(ValueError, match="positive"):
        plan_buckets(specs(1), cap_bytes=0)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 5000), st.sampled_from(["a", "b"])), max_size=30),
    st.integers(1, 20000),
)
def test_every_parameter_lands_in_exactly_one_bucket(entries, cap):
    ps = [ParamSpec(n, 4, k) for n, k in entries]
    plans = plan_buckets(ps, cap_bytes=cap, first_cap_bytes=cap // 2 + 1)
    seen = sorted(i for p in plans for i in p.params)
    assert seen == list(range(len(ps)))
    for p in plans:
        assert isinstance(p, BucketPlan)
        assert len({ps[i].kind for i in p.params}) == 1
        assert p.numel == sum(ps[i].numel for i in p.params)
        # Within a bucket, parameters come in reverse order (as gradients do).
        assert list(p.params) == sorted(p.params, reverse=True)
        # Only the last-closed bucket of a kind can be under the cap.
    assert plan_buckets(ps, cap, cap // 2 + 1) == plans  # deterministic


def test_zero_shards_split_elements_evenly_across_parameter_boundaries():
    # The large MLP: two matrices hold 98% of the elements.
    sizes = [802816, 1024, 1048576, 1024, 10240, 10]
    for world in (2, 3, 4):
        ranges = shard_ranges(sizes, ["f4"] * 6, world)
        owned = [sum(hi - lo for lo, hi in r) for r in ranges]
        layout = FlatLayout(sum(sizes), world)  # FSDP's padded slices: all but the last full
        assert owned[:-1] == [layout.shard] * (world - 1) and sum(owned) == sum(sizes)
        assert layout.shard - owned[-1] == layout.padded - sum(sizes) < world
        for i, n in enumerate(sizes):  # each parameter is cut into adjacent pieces
            pieces = sorted(r[i] for r in ranges if r[i][1] > r[i][0])
            assert pieces[0][0] == 0 and pieces[-1][1] == n
            assert all(a[1] == b[0] for a, b in itertools.pairwise(pieces))
    assert shard_ranges([3, 5], ["a", "b"], 2) == [[(0, 2), (0, 3)], [(2, 3), (3, 5)]]
    assert shard_ranges([0, 4], ["a", "a"], 2) == [[(0, 0), (0, 2)], [(0, 0), (2, 4)]]
    assert [FlatLayout(5, 3).owned(q) for q in range(3)] == [(0, 2), (2, 4), (4, 5)]
    assert [FlatLayout(2, 4).owned(q) for q in range(4)] == [(0, 1), (1, 2), (2, 2), (2, 2)]


def test_bf16_is_the_top_half_of_float32_rounded_to_nearest_even():
    x = np.array([1.0, -2.5, 3.140625, 0.0, np.inf, -np.inf, 2.0**-130], np.float32)
    h = to_bf16(x)
    assert h.dtype == np.uint16 and h.shape == x.shape
    np.testing.assert_array_equal(from_bf16(h), x)  # exactly representable
    np.testing.assert_array_equal(h, x.view(np.uint32) >> 16)
    ulp = np.float32(2.0**-7)  # bfloat16 spacing at 1.0
    below = np.nextafter(np.float32(1 + ulp), np.float32(0))
    assert from_bf16(to_bf16(np.array([below])))[0] == 1 + ulp  # to nearest
    assert from_bf16(to_bf16(np.array([-below])))[0] == -(1 + ulp)
    tie = np.array([1 + ulp / 2, 1 + 3 * ulp / 2], np.float32)  # halfway: to the even one
    np.testing.assert_array_equal(from_bf16(to_bf16(tie)), [1.0, 1 + 2 * ulp])
    assert np.isnan(from_bf16(to_bf16(np.array([np.nan], np.float32))))[0]
    rng = np.random.default_rng(0)
    y = rng.standard_normal((40, 25)).astype(np.float32)
    back = from_bf16(to_bf16(y))
    assert back.shape == y.shape
    assert (np.abs(back - y) / np.abs(y)).max() <= 2.0**-8
    out = np.empty_like(y)
    assert from_bf16(to_bf16(y), out=out) is out


def test_orthonormalize_makes_orthonormal_columns_and_zeroes_dependent_ones():
    rng = np.random.default_rng(1)
    m = rng.standard_normal((20, 4))
    _orthonormalize(m, 0.0)
    np.testing.assert_allclose(m.T @ m, np.eye(4), atol=1e-12)
    low = rng.standard_normal((10, 2)) @ rng.standard_normal((2, 4))  # rank 2
    proj = low.copy()
    _orthonormalize(proj, 0.0)
    assert np.count_nonzero(np.abs(proj).sum(axis=0)) == 2
    np.testing.assert_allclose(proj @ (proj.T @ low), low, atol=1e-12)  # a projection
    zero = np.zeros((5, 2))
    _orthonormalize(zero, 0.0)
    assert not zero.any()


def test_comm_overlap_counts_sequential_reductions_up_to_the_end_of_backward():
    # Bucket 0 runs 1..4; bucket 1 is launched at 2 but waits for it, runs 4..6.
    assert comm_overlap([(1.0, 4.0), (2.0, 6.0)], end_of_backward=5.0) == (5.0, 4.0)
    # The last bucket launched after the last gradient hides nothing.
    assert comm_overlap([(1.0, 2.0), (5.0, 7.0)], end_of_backward=5.0) == (3.0, 1.0)
    assert comm_overlap([], 1.0) == (0.0, 0.0)
