"""bfloat16 without a bfloat16 dtype: the top 16 bits of float32, in uint16 arrays.

NumPy has no bfloat16. A bfloat16 number is a float32 whose low 16 mantissa
bits are dropped, so it is stored here as the float32's top 16 bits in a
``uint16`` array. :func:`to_bf16` *truncates* (rounds toward zero, relative
error below 2**-7; hardware conversions round to nearest instead, which
costs several more passes over the data here); NaN and infinity stay
non-finite. :func:`from_bf16` widens exactly by appending 16 zero bits.
"""

from __future__ import annotations

import sys
from typing import Any

from ._arrays import xp_of

__all__ = ["from_bf16", "to_bf16"]

_LITTLE = sys.byteorder == "little"


def to_bf16(x: Any) -> Any:
    """``x`` (float32) truncated to bfloat16, as a ``uint16`` array of the same shape."""
    xp = xp_of(x)
    f = xp.ascontiguousarray(x, dtype=xp.float32)
    if _LITTLE:  # the high half of each float32 is its second uint16
        return f.reshape(-1).view(xp.uint16)[1::2].reshape(f.shape).copy()
    return (f.view(xp.uint32) >> 16).astype(xp.uint16)  # pragma: no cover


def from_bf16(h: Any, out: Any = None) -> Any:
    """``uint16`` bfloat16 bit patterns widened to float32 (exact), into ``out`` if given."""
    xp = xp_of(h)
    if out is None:
        out = xp.empty(h.shape, xp.float32)
    if _LITTLE:
        halves = out.reshape(-1).view(xp.uint16)
        halves[0::2] = 0
        halves[1::2] = h.reshape(-1)
    else:  # pragma: no cover
        out[...] = (h.astype(xp.uint32) << 16).view(xp.float32)
    return out
