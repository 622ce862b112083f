"""Reduction operators, buffer checks and the NumPy/CuPy array adapters.

CuPy is imported only when a CuPy array is seen. :class:`Xp` hides the one
difference the algorithms care about: data crosses processes through host
memory, while reductions run where the buffer lives (on the GPU for CuPy).
"""

from __future__ import annotations

import enum
import logging
import sys
from typing import Any

import msgpack
import numpy as np

from .._errors import CollectiveError, ConfigError

_log = logging.getLogger(__name__)

__all__ = [
    "NUMPY_XP",
    "Meta",
    "ReduceOp",
    "Xp",
    "check_array",
    "check_op",
    "flat",
    "is_cupy",
    "validate",
    "xp_for",
]

_SUPPORTED_KINDS = "biufc"


class ReduceOp(enum.IntEnum):
    """How ``all_reduce``, ``reduce`` and ``reduce_scatter`` combine values.

    ``AVG`` needs a floating or complex dtype; ``BAND``, ``BOR`` and ``BXOR``
    need an integer or bool dtype.
    """

    SUM = 0
    PROD = 1
    MIN = 2
    MAX = 3
    AVG = 4
    BAND = 5
    BOR = 6
    BXOR = 7

    __module__ = "rpcdist.collectives"


_UFUNC = {
    ReduceOp.SUM: "add",
    ReduceOp.PROD: "multiply",
    ReduceOp.MIN: "minimum",
    ReduceOp.MAX: "maximum",
    ReduceOp.AVG: "add",
    ReduceOp.BAND: "bitwise_and",
    ReduceOp.BOR: "bitwise_or",
    ReduceOp.BXOR: "bitwise_xor",
}


def check_op(op: Any, dtype: np.dtype[Any]) -> ReduceOp:
    """``op`` as a :class:`ReduceOp`, checked against ``dtype``.

    Raises:
        ConfigError: not a ReduceOp, or not defined for ``dtype``.
    """
    try:
        rop = ReduceOp(op)
    except ValueError:
        raise ConfigError(f"op must be a ReduceOp, got {op!r}") from None
    if rop in (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR) and dtype.kind not in "biu":
        raise ConfigError(f"ReduceOp.{rop.name} needs an integer or bool dtype, got {dtype}")
    if rop is ReduceOp.AVG and dtype.kind not in "fc":
        raise ConfigError(
            f"ReduceOp.AVG needs a floating or complex dtype, got {dtype} "
            "(use SUM and divide for integers)"
        )
    return rop


def is_cupy(a: Any) -> bool:
    """Whether ``a`` is a CuPy array (without importing CuPy)."""
    return type(a).__module__.partition(".")[0] == "cupy"


def check_array(a: Any, what: str, *, writable: bool = False) -> Any:
    """Check that ``a`` is a NumPy or CuPy array of a numeric dtype.

    Raises:
        ConfigError: another type, an unsupported dtype, or read-only when
            ``writable``.
    """
    if not (isinstance(a, np.ndarray) or is_cupy(a)):
        hint = ""
        if type(a).__module__.partition(".")[0] == "torch":  # (a torch.Tensor: without torch)
            hint = (
                " (for a torch tensor, pass t.numpy() on the CPU or cupy.asarray(t) on a GPU: "
                "both share its memory, so in-place results land in the tensor)"
            )
        raise ConfigError(f"{what} must be a NumPy or CuPy array, got {type(a).__name__}{hint}")
    if a.dtype.kind not in _SUPPORTED_KINDS:
        raise ConfigError(f"{what} has dtype {a.dtype}; collectives need bool or numeric dtypes")
    if writable and isinstance(a, np.ndarray) and not a.flags.writeable:
        raise ConfigError(f"{what} is read-only but the collective writes into it")
    return a


def flat(a: Any) -> tuple[Any, bool]:
    """A 1-D C-contiguous array with ``a``'s data, and whether it is a copy.

    A contiguous ``a`` gives a view (writes go straight to ``a``); otherwise
    the caller copies results back with ``a[...] = out.reshape(a.shape)``.
    """
    if a.flags.c_contiguous:
        return a.reshape(-1), False
    xp = sys.modules["cupy"] if is_cupy(a) else np
    return xp.ascontiguousarray(a).reshape(-1), True


class Xp:
    """Array operations the algorithms need, for NumPy buffers.

    Attributes:
        host: Whether buffers live in host memory (so the wire and shared
            memory can use them directly, without staging).
    """

    host = True

    def __init__(self) -> None:
        self.module: Any = np

    def ufunc(self, op: ReduceOp) -> Any:
        return getattr(self.module, _UFUNC[op])

    def reduce_into(
        self, op: ReduceOp, dst: Any, a: Any, b_host: np.ndarray, reverse: bool = False
    ) -> None:
        """``dst = a (op) b_host`` (``b_host (op) a`` when ``reverse``); ``b_host`` is on the host.

        The order matters for bitwise agreement between ranks: MIN of +0.0
        and -0.0, for instance, returns whichever comes first.
        """
        if reverse:
            self.ufunc(op)(b_host, a, out=dst)
        else:
            self.ufunc(op)(a, b_host, out=dst)

    def finish(self, op: ReduceOp, dst: Any, p: int) -> None:
        """Final step of AVG: divide the sum by the number of ranks."""
        if op is ReduceOp.AVG and p > 1 and dst.size:
            self.module.true_divide(dst, p, out=dst)

    def to_host(self, src: Any, out: np.ndarray) -> None:
        """Copy ``src`` into the host array ``out``."""
        np.copyto(out, src)

    def from_host(self, dst: Any, src: np.ndarray) -> None:
        """Copy the host array ``src`` into ``dst``."""
        np.copyto(dst, src)

    def host_view(self, a: Any) -> np.ndarray:
        """``a`` as a host array (a view for NumPy, a copy for device arrays)."""
        return np.asarray(a)

    def empty_host(self, n: int, dtype: np.dtype[Any]) -> np.ndarray:
        return np.empty(n, dtype)

    def copy(self, dst: Any, src: Any) -> None:
        self.module.copyto(dst, src)

    def pin(self, region: np.ndarray) -> bool:
        """Page-lock the host memory under ``region`` for the device's copies
        (False: not applicable, as for NumPy buffers, or refused)."""
        return False

    def unpin(self, region: np.ndarray) -> None:
        """Undo :meth:`pin`."""

    def fence(self, like: Any) -> None:
        """Wait for the copies issued so far on ``like``'s device and stream
        (a copy from page-locked host memory reads it in the background)."""


class _CupyXp(Xp):
    """CuPy buffers: reductions on the GPU, data staged through host memory.

    Copies to the host finish before they return. Copies from the host may
    still be reading their source after they return when it is page-locked
    (:meth:`pin`): an algorithm that reads page-locked slots calls
    :meth:`fence` before it lets their owners rewrite them.
    """

    host = False

    def __init__(self) -> None:
        import cupy

        self.module = cupy

    def reduce_into(
        self, op: ReduceOp, dst: Any, a: Any, b_host: np.ndarray, reverse: bool = False
    ) -> None:
        b = self.module.asarray(b_host)
        if reverse:
            self.ufunc(op)(b, a, out=dst)
        else:
            self.ufunc(op)(a, b, out=dst)

    def to_host(self, src: Any, out: np.ndarray) -> None:
        if src.size:
            src.get(out=out)

    def from_host(self, dst: Any, src: np.ndarray) -> None:
        if dst.size:
            dst.set(src)

    def host_view(self, a: Any) -> np.ndarray:
        return a.get()  # type: ignore[no-any-return]

    def pin(self, region: np.ndarray) -> bool:
        try:  # cudaHostRegisterPortable: page-locked for every device's context
            self.module.cuda.runtime.hostRegister(region.ctypes.data, region.nbytes, 1)
        except Exception as e:  # CUDARuntimeError: not supported, out of resources
            _log.debug("page-locking %d bytes of shared memory failed: %s", region.nbytes, e)
            return False
        return True

    def unpin(self, region: np.ndarray) -> None:
        try:
            self.module.cuda.runtime.hostUnregister(region.ctypes.data)
        except Exception as e:  # the context may be gone at interpreter exit
            _log.debug("unregistering shared memory failed: %s", e)

    def fence(self, like: Any) -> None:
        with like.device:
            self.module.cuda.get_current_stream().synchronize()


#: The adapter of host (NumPy) buffers.
NUMPY_XP = Xp()


def xp_for(a: Any) -> Xp:
    """The adapter for ``a``'s array library."""
    return _CupyXp() if is_cupy(a) else NUMPY_XP


def as_bytes(a: np.ndarray) -> memoryview:
    """A byte view of a contiguous host array (any dtype, any shape)."""
    return a.reshape(-1).view(np.uint8).data


class Meta:
    """What one rank says about a collective, compared across ranks.

    ``wire`` (kind, sequence number, op, root, dtype and, where buffers must
    agree, the shape) must be identical on every rank; the gRPC engine sends
    it with every message. ``ins`` and ``outs`` are the element counts of the
    pieces this rank sends to and expects from each rank, for the rooted and
    all-to-all collectives; the shared-memory engine compares them across
    ranks (:func:`validate`), the gRPC one lets the receive sizes tell.
    """

    __slots__ = ("full", "kind", "wire")

    def __init__(
        self,
        kind: str,
        seq: int,
        op: int,
        root: int,
        dtype: Any,
        shape: Any,
        ins: Any = (),
        outs: Any = (),
    ) -> None:
        self.kind = kind
        common = [kind, seq, int(op), root, np.dtype(dtype).str, [int(s) for s in shape]]
        self.wire: bytes = msgpack.packb(common)
        self.full: bytes = msgpack.packb([common, [int(n) for n in ins], [int(n) for n in outs]])

    def check(self, other: bytes, peer: int, where: str) -> None:
        """Compare with a peer's :attr:`wire` bytes.

        Raises:
            CollectiveError: they differ (the message shows both sides).
        """
        if other != self.wire:
            raise CollectiveError(
                f"{where}: rank {peer} called {describe(other)} but this rank called "
                f"{describe(self.wire)}; every rank must make the same collective call "
                "with the same dtype and shape"
            )


def validate(fulls: list[bytes], where: str) -> None:
    """Check every rank's :attr:`Meta.full` against every other's (a pure function).

    Every rank runs it on the same list, so every rank reaches the same verdict.

    Raises:
        CollectiveError: the calls differ, or piece sizes do not pair up.
    """
    decoded = [msgpack.unpackb(f) for f in fulls]
    commons = [msgpack.packb(d[0]) for d in decoded]
    for q, c in enumerate(commons):
        if c != commons[0]:
            raise CollectiveError(
                f"{where}: rank {q} called {describe(c)} but rank 0 called "
                f"{describe(commons[0])}; every rank must make the same collective call "
                "with the same dtype and shape"
            )
    kind, root = decoded[0][0][0], decoded[0][0][3]
    p = len(decoded)
    for q in range(p):
        for r in range(p):
            if kind == "all_to_all":
                sent, expected = decoded[q][1][r], decoded[r][2][q]
            elif kind == "gather" and r == root:
                sent, expected = decoded[q][1][0], decoded[root][2][q]
            elif kind == "scatter" and q == root:
                sent, expected = decoded[root][1][r], decoded[r][2][0]
            else:
                continue
            if sent != expected:
                raise CollectiveError(
                    f"{where}: rank {q} sends {sent} elements to rank {r}, which expects "
                    f"{expected}; shapes differ across ranks"
                )


def describe(wire: bytes) -> str:
    """A readable form of a :class:`Meta` wire string."""
    try:
        kind, seq, op, root, dtype, shape = msgpack.unpackb(wire)
        text = f"{kind} #{seq} on {np.dtype(dtype).name}{list(shape)}"
        if kind in ("all_reduce", "reduce", "reduce_scatter"):
            text += f" op {ReduceOp(op).name}"
        if root >= 0:
            text += f" root {root}"
        return text
    except Exception:
        return f"<unreadable metadata {wire[:40]!r}>"
