"""bfloat16 without a bfloat16 dtype: the top 16 bits of float32, in uint16 arrays.

NumPy has no bfloat16. A bfloat16 number is a float32 with the low 16
mantissa bits dropped, so it is stored here as the float32's top 16 bits in
a ``uint16`` array: :func:`to_bf16` rounds to the nearest (ties to even,
as hardware conversions do; NaN stays NaN) and :func:`from_bf16` widens by
appending 16 zero bits. Sums are taken in float32 after widening.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._arrays import xp_of

__all__ = ["bf16_sum", "from_bf16", "to_bf16"]

_QUIET_NAN = 0x7FC0


def to_bf16(x: Any) -> Any:
    """``x`` (float32) rounded to bfloat16, as a ``uint16`` array of the same shape."""
    xp = xp_of(x)
    bits = xp.ascontiguousarray(x, dtype=xp.float32).view(xp.uint32)
    rounding = ((bits >> 16) & 1) + 0x7FFF
    out = ((bits + rounding) >> 16).astype(xp.uint16)
    nan = xp.isnan(x)
    if nan.any():
        out[nan] = _QUIET_NAN
    return out


def from_bf16(h: Any) -> Any:
    """``uint16`` bfloat16 bit patterns widened to float32 (exactly)."""
    xp = xp_of(h)
    return (h.astype(xp.uint32) << 16).view(xp.float32)


def bf16_sum(parts: list[Any], out_dtype: Any = np.float32) -> Any:
    """The float32 sum of bfloat16 arrays, added in list order (the same on every rank)."""
    acc = from_bf16(parts[0]).astype(out_dtype)
    for p in parts[1:]:
        acc += from_bf16(p)
    return acc
