"""Shared oracles and Hypothesis strategies for the codec tests."""

from __future__ import annotations

import dataclasses
import math
import operator
import struct
from typing import Any, NamedTuple

import numpy as np
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from rpcdist._serialization import decode, encode, register_type
from rpcdist._worker import WorkerInfo


@register_type
@dataclasses.dataclass
class Point:
    """A registered dataclass (fields may hold any encodable value)."""

    x: Any
    y: Any = 0


@register_type(name="tests.Pair")
class Pair(NamedTuple):
    """A registered NamedTuple under an explicit wire name."""

    left: Any
    right: Any


class Helpers:
    """Functions with importable names: a static method and a class method."""

    @staticmethod
    def static(x: int) -> int:
        return x + 1

    @classmethod
    def klass(cls, x: int) -> int:
        return x + 2

    def method(self) -> int:
        return 0


def module_function(x: int) -> int:
    """A plain module-level function."""
    return x * 2


FUNCTIONS = [module_function, Helpers.static, Helpers.klass, operator.add, math.sqrt, len, np.add]


def roundtrip(value: object, **kw: Any) -> object:
    """Encode then decode ``value`` as the transport would (bytearray-backed buffers)."""
    header, buffers = encode(value, **kw)
    return decode(header, [memoryview(bytearray(b)) for b in buffers], **kw)


def same(a: Any, b: Any) -> bool:
    """Exact equality: same types all the way down, bitwise-equal floats and arrays."""
    if type(a) is not type(b):
        return False
    if isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray)
        return (
            a.dtype == b.dtype
            and a.shape == b.shape
            and np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes()
        )
    if isinstance(a, np.generic):
        assert isinstance(b, np.generic)
        return a.dtype == b.dtype and a.tobytes() == b.tobytes()
    if type(a) is float:
        return struct.pack("<d", a) == struct.pack("<d", b)
    if type(a) is complex:
        return same(a.real, b.real) and same(a.imag, b.imag)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(map(same, a, b))
    if isinstance(a, dict):
        assert isinstance(b, dict)
        return len(a) == len(b) and all(
            same(ka, kb) and same(va, vb)
            for (ka, va), (kb, vb) in zip(a.items(), b.items(), strict=True)
        )
    if dataclasses.is_dataclass(a):
        return all(same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    if isinstance(a, BaseException):
        assert isinstance(b, BaseException)
        return same(a.args, b.args)
    return a == b


# -------------------------------------------------------------- strategies

DTYPES = (
    hnp.boolean_dtypes()
    | hnp.integer_dtypes(endianness="?")
    | hnp.unsigned_integer_dtypes(endianness="?")
    | hnp.floating_dtypes(endianness="?")
    | hnp.complex_number_dtypes(endianness="?")
    | hnp.datetime64_dtypes(endianness="?")
    | hnp.timedelta64_dtypes(endianness="?")
    | hnp.byte_string_dtypes(endianness="?")
    | hnp.unicode_string_dtypes(endianness="?")
)


@st.composite
def arrays(draw: st.DrawFn) -> Any:
    """Arrays of every supported dtype and byte order, including 0-d, empty and views."""
    shape = hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4)
    a = draw(hnp.arrays(dtype=DTYPES, shape=shape))
    how = draw(st.sampled_from(["plain", "transpose", "fortran", "index"]))
    if how == "transpose":
        return a.T
    if how == "fortran":
        return np.asfortranarray(a)
    if how == "index" and a.ndim:
        return a[draw(hnp.basic_indices(a.shape, allow_newaxis=True))]
    return a


numpy_scalars = hnp.arrays(dtype=DTYPES, shape=()).map(lambda a: a[()])
hashables = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=5) | st.binary(max_size=5),
    lambda inner: st.lists(inner, max_size=3).map(tuple) | st.frozensets(inner, max_size=3),
    max_leaves=6,
)
leaves = (
    hashables
    | st.floats()
    | st.complex_numbers()
    | arrays()
    | numpy_scalars
    | st.builds(
        WorkerInfo, st.from_regex(r"[A-Za-z0-9_:-]{1,8}", fullmatch=True), st.integers(0, 2**31)
    )
    | st.sampled_from(FUNCTIONS)
    | st.builds(ValueError, st.text(max_size=8))
    | st.builds(KeyError, st.integers())
)
values = st.recursive(
    leaves,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.lists(inner, max_size=4).map(tuple)
        | st.dictionaries(hashables, inner, max_size=4)
        | st.sets(hashables, max_size=4)
        | st.builds(Point, inner, inner)
        | st.builds(Pair, inner, inner)
    ),
    max_leaves=16,
)
