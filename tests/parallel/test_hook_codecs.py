"""The 16-bit wire formats of the compressing comm hooks, bit for bit against references."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rpcdist.parallel._bf16 import from_bf16, from_fp16, to_bf16, to_fp16
from rpcdist.parallel.comm_hooks import _Bf16, _Fp16

EDGES = np.array(
    [
        0.0,
        -0.0,
        1.0,
        65504.0,  # float16's largest
        65519.0,  # rounds down to it
        65520.0,  # rounds up to infinity
        -1e9,
        np.inf,
        -np.inf,
        2.0**-14,  # float16's smallest normal
        2.0**-14 - 2.0**-25,  # rounds up to it
        2.0**-24,  # its smallest subnormal
        2.0**-25,  # a tie: to zero (even)
        3 * 2.0**-25,  # a tie: to 2 * 2**-24 (even)
        1 + 2.0**-11,  # a tie at 1: to 1 (even)
        1 + 3 * 2.0**-11,  # to 1 + 2**-9
        -1e-30,
        1 + 2.0**-8,  # bfloat16 ties
        1 + 3 * 2.0**-8,
        3.0e38,
    ],
    np.float32,
)

finite32 = st.floats(width=32, allow_nan=False, allow_infinity=False)


@pytest.fixture(autouse=True, params=["torch", "numpy"])
def fp16_engine(request, monkeypatch):
    """Every test twice: float16 casts through PyTorch (where installed) and
    through the integer passes that run without it."""
    from rpcdist.parallel import _bf16

    if request.param == "torch":
        pytest.importorskip("torch")
        assert _bf16._torch() is not None
    else:
        monkeypatch.setattr(_bf16, "_torch", lambda: None)
    return request.param


def _same_bits_or_both_nan(got: np.ndarray, want: np.ndarray, dtype: object) -> None:
    g, w = got.view(dtype), want.view(dtype)  # type: ignore[arg-type]
    nan = np.isnan(w.astype(np.float32))
    assert (np.isnan(g.astype(np.float32)) == nan).all()
    np.testing.assert_array_equal(got[~nan], want[~nan])


@pytest.mark.parametrize("scale", [1.0, 0.5, 1 / 3])
def test_fp16_rounds_as_an_ieee_cast(scale):
    x = np.concatenate([EDGES, -EDGES, np.float32([np.nan])])
    rng = np.random.default_rng(0)
    x = np.concatenate([x, (rng.standard_normal(5000) * 10.0 ** rng.integers(-9, 6, 5000))])
    x = x.astype(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        want = (x * np.float32(scale)).astype(np.float16).view(np.uint16)
    out = np.empty(x.shape, np.uint16)
    assert to_fp16(x, out, scale) is out
    _same_bits_or_both_nan(out, want, np.float16)


@settings(max_examples=200, deadline=None)
@given(st.lists(finite32, min_size=1, max_size=50))
def test_fp16_matches_numpy_cast_on_any_float32(values):
    x = np.array(values, np.float32)
    with np.errstate(over="ignore"):
        want = x.astype(np.float16).view(np.uint16)
    np.testing.assert_array_equal(to_fp16(x), want)


def test_fp16_widens_every_bit_pattern_exactly():
    h = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    want = h.view(np.float16).astype(np.float32)
    got = from_fp16(h)
    nan = np.isnan(want)
    assert (np.isnan(got) == nan).all()
    np.testing.assert_array_equal(got[~nan], want[~nan])
    np.testing.assert_array_equal(from_fp16(h[~nan], scale=0.25), want[~nan] * np.float32(0.25))


def test_fp16_matches_torch_cast():
    torch = pytest.importorskip("torch")
    x = np.concatenate([EDGES, -EDGES]).astype(np.float32)
    want = torch.from_numpy(x).to(torch.float16).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(to_fp16(x), want)


@pytest.mark.parametrize("scale", [1.0, 0.5, 1 / 3])
def test_bf16_rounds_as_ml_dtypes(scale):
    rng = np.random.default_rng(1)
    x = np.concatenate([EDGES, -EDGES, rng.standard_normal(5000).astype(np.float32)])
    x = np.concatenate([x, np.float32([np.nan])])
    want = (x * np.float32(scale)).astype(ml_dtypes.bfloat16).view(np.uint16)
    _same_bits_or_both_nan(to_bf16(x, scale=scale), want, ml_dtypes.bfloat16)
    np.testing.assert_array_equal(from_bf16(want[:-1]), want[:-1].view(ml_dtypes.bfloat16))


@settings(max_examples=200, deadline=None)
@given(st.lists(finite32, min_size=1, max_size=50))
def test_bf16_matches_ml_dtypes_on_any_float32(values):
    x = np.array(values, np.float32)
    want = x.astype(ml_dtypes.bfloat16).view(np.uint16)
    np.testing.assert_array_equal(to_bf16(x), want)


def _round_trip(codec: object, x: np.ndarray) -> np.ndarray:
    wire = np.empty(x.size + codec.header, np.uint16)  # type: ignore[attr-defined]
    codec.encode(x, wire, 1.0)  # type: ignore[attr-defined]
    back = np.empty_like(x)
    codec.decode(wire, back)  # type: ignore[attr-defined]
    return back


def test_fp16_block_scale_keeps_large_and_tiny_gradients():
    # PyTorch's fp16 hook turns 1e6 into infinity and 1e-9 into zero; the
    # per-block power-of-two scale keeps both to float16's 11 bits.
    for x in (np.float32([1e6, -3e5, 7.0]), np.float32([1e-9, -3e-10, 2e-12])):
        back = _round_trip(_Fp16(), x)
        np.testing.assert_allclose(back, x, rtol=2.0**-11, atol=0)


def test_fp16_and_bf16_blocks_keep_infinity_and_nan():
    # As with PyTorch's hooks, a non-finite gradient stays non-finite, so a
    # gradient scaler still sees the overflow.
    x = np.float32([np.inf, 1.0, -np.inf, np.nan, 1e-3])
    for codec in (_Fp16(), _Bf16()):
        back = _round_trip(codec, x)
        assert back[0] == np.inf and back[2] == -np.inf and np.isnan(back[3])
        np.testing.assert_allclose(back[[1, 4]], x[[1, 4]], rtol=2.0**-8)


def test_fp16_of_several_blocks_and_two_dimensions():
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((300, 700)) * 1e3).astype(np.float32)  # > 3 blocks of 2**16
    x[::7, ::3] = 0.0
    x[5, 5], x[299, 699] = np.inf, 1e-7
    with np.errstate(over="ignore"):
        want = x.astype(np.float16).view(np.uint16)
    got = to_fp16(x)
    assert got.shape == x.shape
    np.testing.assert_array_equal(got, want)


def test_fp16_widens_several_blocks_and_two_dimensions():
    h = np.random.default_rng(4).integers(0, 1 << 16, (300, 700)).astype(np.uint16)
    with np.errstate(invalid="ignore"):
        want = h.view(np.float16).astype(np.float32) * np.float32(0.5)
    with np.errstate(invalid="raise"):
        got = from_fp16(h, scale=0.5)
    assert got.shape == h.shape
    nan = np.isnan(want)
    assert (np.isnan(got) == nan).all()
    np.testing.assert_array_equal(got[~nan], want[~nan])
