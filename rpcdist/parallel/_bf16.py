"""16-bit floats on the wire: bfloat16 and float16 bit patterns in ``uint16`` arrays.

Collectives carry plain NumPy dtypes, so both formats travel as ``uint16``
bit patterns. Every conversion rounds to nearest, ties to even, as hardware
and PyTorch do, and writes into a caller's array when given one (no
temporaries of the input's size beyond the scratch named below):

* bfloat16 (the top 16 bits of a float32): through ``ml_dtypes.bfloat16``
  for NumPy arrays (one vectorised pass, the scale multiplied in the same
  pass); with integer arithmetic for CuPy arrays. Widening is exact.
* float16: NumPy's own float32 to float16 cast is a scalar loop (about 4 ns
  a value here, 30 times more for subnormals). Where PyTorch is installed,
  its casts do it on NumPy's memory (the CPU's F16C instructions: about
  0.1 ns a value); else :func:`to_fp16` computes the bits with a few
  vectorised integer passes (about 1.7 ns a value) and :func:`from_fp16`
  widens the same way (1.1 ns). Subnormals round exactly; values beyond
  float16's range become infinity and NaN stays NaN, as in a cast.
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Any

import ml_dtypes
import numpy as np

from ._arrays import xp_of

__all__ = ["from_bf16", "from_fp16", "to_bf16", "to_fp16"]

_BF16 = np.dtype(ml_dtypes.bfloat16)
_F16_MIN_NORMAL = 113 << 23  # float32 bits of 2**-14, float16's smallest normal
_F16_OVERFLOW = 0x477FF000  # float32 bits of 65520: rounds to float16 infinity
_F32_EXP = 0x7F800000
#: Values converted per block: the scratch arrays of a block stay in the
#: CPU's cache through the dozen passes a conversion takes.
_BLOCK = 1 << 16


def _is_numpy(x: Any) -> bool:
    return isinstance(x, np.ndarray)


@functools.cache
def _torch() -> Any:
    """PyTorch for the float16 casts of NumPy arrays, if it is installed (imported on first use)."""
    if importlib.util.find_spec("torch") is None:
        return None
    import torch

    return torch


def _torch_ok(a: Any) -> bool:
    return bool(a.flags.writeable and a.flags.c_contiguous)


def _torch_view(a: Any, torch: Any) -> Any:
    """``a`` (writable NumPy memory) as a tensor; ``uint16`` bits as ``float16``."""
    if a.dtype == np.uint16:
        return torch.from_numpy(a.view(np.int16)).view(torch.float16)
    return torch.from_numpy(a)


def to_bf16(x: Any, out: Any = None, scale: float = 1.0) -> Any:
    """``x * scale`` (float32) rounded to bfloat16, as ``uint16`` bits (into ``out`` if given)."""
    xp = xp_of(x)
    if out is None:
        out = xp.empty(x.shape, xp.uint16)
    if _is_numpy(x):
        o = out.view(_BF16)
        if scale == 1.0:
            np.copyto(o, x, casting="unsafe")
        else:
            np.multiply(x, np.float32(scale), out=o, dtype=np.float32, casting="unsafe")
        return out
    f = xp.multiply(x, scale, dtype=xp.float32)  # CuPy: one fused kernel would do; rare path
    u = f.view(xp.uint32)
    r = (u + (0x7FFF + ((u >> 16) & 1))) >> 16
    nan = xp.isnan(f)
    out[...] = xp.where(nan, (u >> 16) | 0x40, r).astype(xp.uint16)
    return out


def from_bf16(h: Any, out: Any = None) -> Any:
    """``uint16`` bfloat16 bit patterns widened to float32 (exact), into ``out`` if given."""
    xp = xp_of(h)
    if out is None:
        out = xp.empty(h.shape, xp.float32)
    if _is_numpy(h):
        np.copyto(out, h.view(_BF16), casting="unsafe")
    else:
        out[...] = (h.astype(xp.uint32) << 16).view(xp.float32)
    return out


def to_fp16(x: Any, out: Any = None, scale: float = 1.0) -> Any:
    """``x * scale`` (float32) rounded to float16, as ``uint16`` bits (into ``out`` if given)."""
    xp = xp_of(x)
    if out is None:
        out = xp.empty(x.shape, xp.uint16)
    if not _is_numpy(x):
        out[...] = xp.multiply(x, scale, dtype=xp.float32).astype(xp.float16).view(xp.uint16)
        return out
    torch = _torch()
    if torch is not None and _torch_ok(x) and _torch_ok(out) and x.dtype == np.float32:
        # (the product in float32, then one rounding: as below)
        torch.mul(_torch_view(x, torch), scale, out=_torch_view(out, torch))
        return out
    flat_in, flat_out = x.reshape(-1), out.reshape(-1)
    n = flat_in.size
    f = np.empty(min(n, _BLOCK), np.float32)
    mag, r = np.empty_like(f, np.uint32), np.empty_like(f, np.uint32)
    for i in range(0, n, _BLOCK):  # blocks that stay in cache through the passes
        k = min(_BLOCK, n - i)
        _fp16_block(flat_in[i : i + k], flat_out[i : i + k], scale, f[:k], mag[:k], r[:k])
    return out


def _fp16_block(x: Any, out: Any, scale: float, f: Any, mag: Any, r: Any) -> None:
    """:func:`to_fp16` of one block, with scratch arrays ``f``, ``mag`` and ``r``."""
    np.multiply(x, np.float32(scale), out=f, dtype=np.float32)
    u = f.view(np.uint32)
    np.bitwise_and(u, 0x7FFFFFFF, out=mag)
    np.right_shift(mag, 13, out=r)
    np.bitwise_and(r, 1, out=r)
    np.add(r, (0xFFF - (112 << 23)) & 0xFFFFFFFF, out=r)  # round half even, rebias
    np.add(r, mag, out=r)
    np.right_shift(r, 13, out=r)
    if mag.min() < _F16_MIN_NORMAL or mag.max() >= _F16_OVERFLOW:
        _fp16_edges(mag, r)
    np.right_shift(u, 16, out=mag)
    np.bitwise_and(mag, 0x8000, out=mag)
    np.bitwise_or(r, mag, out=r)
    np.copyto(out, r, casting="unsafe")


def _fp16_edges(mag: Any, r: Any) -> None:
    """Fix the float16 bits ``r`` of magnitudes ``mag`` that are subnormal, too large or NaN."""
    sub = np.less(mag, _F16_MIN_NORMAL)
    if sub.any():  # zeros, subnormals: adding 0.5 rounds at their spacing, 2**-24
        low = np.add(mag.view(np.float32), np.float32(0.5)).view(np.uint32)
        np.subtract(low, 0x3F000000, out=low)
        np.copyto(r, low, where=sub)
    big = mag >= _F16_OVERFLOW
    if big.any():
        nan = mag > _F32_EXP
        r[big] = 0x7C00
        r[nan] = 0x7E00


def from_fp16(h: Any, out: Any = None, scale: float = 1.0) -> Any:
    """``uint16`` float16 bit patterns widened to float32 and times ``scale`` (into ``out``)."""
    xp = xp_of(h)
    if out is None:
        out = xp.empty(h.shape, xp.float32)
    if not _is_numpy(h):
        xp.multiply(h.view(xp.float16), scale, out=out, dtype=xp.float32)
        return out
    torch = _torch()
    if torch is not None and _torch_ok(h) and _torch_ok(out) and out.dtype == np.float32:
        wide = _torch_view(out, torch)
        wide.copy_(_torch_view(h, torch))  # exact
        if scale != 1.0:
            wide.mul_(scale)  # (in float32)
        return out
    flat_in, flat_out = h.reshape(-1), out.reshape(-1)
    n = flat_in.size
    w, sign = np.empty(min(n, _BLOCK), np.uint32), np.empty(min(n, _BLOCK), np.uint32)
    for i in range(0, n, _BLOCK):  # blocks that stay in cache through the passes
        k = min(_BLOCK, n - i)
        _widen_block(flat_in[i : i + k], flat_out[i : i + k], scale, w[:k], sign[:k])
    return out


def _widen_block(h: Any, out: Any, scale: float, w: Any, sign: Any) -> None:
    """:func:`from_fp16` of one block, with scratch arrays ``w`` and ``sign``."""
    np.copyto(w, h)
    np.bitwise_and(w, 0x8000, out=sign)
    np.left_shift(sign, 16, out=sign)
    np.bitwise_and(w, 0x7FFF, out=w)
    big = w >= 0x7C00 if w.max() >= 0x7C00 else None  # infinity, NaN
    np.left_shift(w, 13, out=w)
    f = w.view(np.float32)
    np.multiply(f, np.float32(2.0**112), out=f)  # exact, subnormals included
    if big is not None:  # their exponent must not scale
        w[big] = ((h[big].astype(np.uint32) & 0x3FF) << 13) | _F32_EXP
    np.bitwise_or(w, sign, out=w)
    if scale == 1.0:
        np.copyto(out, f)
    elif big is None:
        np.multiply(f, np.float32(scale), out=out)
    else:
        with np.errstate(invalid="ignore"):  # (a signalling NaN stays a NaN)
            np.multiply(f, np.float32(scale), out=out)
