"""The NCCL backend: CuPy buffers on one GPU per rank, through ``cupy.cuda.nccl``.

NCCL is the established engine for multi-GPU collectives; this module only
decides when to use it and translates calls. The decision is collective:
at a group's first CuPy collective every member reports whether it has
CuPy with NCCL and which device it uses (through the store); NCCL is used
only if all have it and no two share a GPU. Rank 0 then makes the NCCL
unique id and shares it through the store.

What NCCL cannot do (bitwise ops, bool, int16 and complex products or
extrema, uneven all-gather or reduce-scatter pieces, gather, scatter,
all-to-all, barrier) falls back to the CPU engines with host staging; the
choice depends only on what every rank agrees on (dtype, op, sizes), so all
ranks choose alike.

Untested here (no GPU): the selection logic is unit-tested with fakes; the
real runs are marked ``gpu``.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Sequence
from typing import Any

import msgpack
import numpy as np

from .._errors import CollectiveError, ConfigError, RpcTimeoutError
from ._ops import ReduceOp

__all__ = [
    "NcclEngine",
    "nccl_supports",
    "probe",
    "setup_nccl",
    "usable",
    "use_nccl",
]

_log = logging.getLogger(__name__)

_NCCL_TYPES = {
    "int8": "NCCL_INT8",
    "uint8": "NCCL_UINT8",
    "int32": "NCCL_INT32",
    "uint32": "NCCL_UINT32",
    "int64": "NCCL_INT64",
    "uint64": "NCCL_UINT64",
    "float16": "NCCL_FLOAT16",
    "float32": "NCCL_FLOAT32",
    "float64": "NCCL_FLOAT64",
}
_NCCL_OPS = {
    ReduceOp.SUM: "NCCL_SUM",
    ReduceOp.PROD: "NCCL_PROD",
    ReduceOp.MAX: "NCCL_MAX",
    ReduceOp.MIN: "NCCL_MIN",
    ReduceOp.AVG: "NCCL_SUM",  # then divided on the GPU (portable across versions)
}
_COMPLEX = {"complex64": "float32", "complex128": "float64"}


def probe(device: int) -> list[Any]:
    """This rank's ``[has_nccl, device_key]`` for CUDA ``device`` (key: host/PCI bus id)."""
    try:
        import cupy
        from cupy.cuda import nccl  # noqa: F401

        dev = cupy.cuda.Device(device)
        key = f"{socket.gethostname()}/{dev.pci_bus_id}"
        return [True, key]
    except Exception as e:  # no CuPy, no NCCL, no device: all mean "no"
        return [False, f"{type(e).__name__}: {e}"]


def usable(infos: Sequence[Sequence[Any]]) -> bool:
    """Whether every rank has NCCL and its own GPU (a pure function)."""
    if not infos or not all(ok for ok, _ in infos):
        return False
    keys = [k for _, k in infos]
    return len(set(keys)) == len(keys)


def use_nccl(requested: str, buffer_is_cupy: bool, nccl_ok: bool) -> bool:
    """Whether a collective on a buffer goes to NCCL (a pure function).

    Raises:
        ConfigError: ``backend="nccl"`` was asked for a CuPy buffer but NCCL
            is not usable on every rank.
    """
    if not buffer_is_cupy or requested in ("ring", "shm"):
        return False
    if requested == "nccl" and not nccl_ok:
        raise ConfigError("backend='nccl' needs CuPy with NCCL on every rank and one GPU per rank")
    return nccl_ok


def nccl_supports(
    kind: str, dtype: np.dtype[Any], op: ReduceOp | None, sizes: Sequence[int] = ()
) -> bool:
    """Whether NCCL runs this collective (else the CPU engines do; a pure function)."""
    if kind not in ("all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter"):
        return False
    name = dtype.name
    if name in _COMPLEX:
        if op not in (None, ReduceOp.SUM, ReduceOp.AVG):
            return False
        name = _COMPLEX[name]
    if name not in _NCCL_TYPES:
        return False
    if op is not None and op not in _NCCL_OPS:
        return False
    return not (sizes and len(set(sizes)) > 1)


class NcclEngine:
    """Collectives of one group through an ``NcclCommunicator``."""

    name = "nccl"

    def __init__(self, comm: Any, nccl: Any, cupy: Any, size: int, rank: int) -> None:
        self.comm = comm
        self._nccl = nccl
        self._cupy = cupy
        self.size = size
        self.rank = rank
        self._running = False

    def interrupt(self) -> None:
        """A member was lost or the group broke (any thread): abort the
        communicator if a collective waits on it (its kernels would wait
        for the lost member forever)."""
        if self._running:
            try:
                self.comm.abort()
            except Exception as e:  # already torn down
                _log.debug("aborting the NCCL communicator: %s", e)

    def close(self) -> None:
        """Destroy the communicator."""
        try:
            self.comm.destroy()
        except Exception as e:  # a communicator already torn down by a failure
            _log.warning("destroying the NCCL communicator failed: %s", e)

    def _type(self, a: Any) -> tuple[int, int]:
        """``(nccl datatype, element count)``; complex travels as float pairs."""
        name = a.dtype.name
        count = a.size
        if name in _COMPLEX:
            name, count = _COMPLEX[name], count * 2
        return getattr(self._nccl, _NCCL_TYPES[name]), count

    async def _wait(self, stream: Any, timeout: float | None, what: str) -> None:
        event = self._cupy.cuda.Event(disable_timing=True)
        event.record(stream)
        loop = asyncio.get_running_loop()
        try:
            await asyncio.wait_for(loop.run_in_executor(None, event.synchronize), timeout)
        except TimeoutError:
            self.comm.abort()
            raise RpcTimeoutError(f"{what}: NCCL did not finish within {timeout} s") from None
        except Exception as e:
            raise CollectiveError(f"{what}: NCCL failed: {e}") from e

    async def run(
        self, kind: str, args: dict[str, Any], stream: Any, timeout: float | None, what: str
    ) -> None:
        """Enqueue one collective on ``stream`` and wait for it.

        Raises:
            CollectiveError: NCCL reported an error.
            RpcTimeoutError: it did not finish in time (the communicator is aborted).
        """
        c, s = self.comm, stream.ptr
        op = args.get("op")
        nop = getattr(self._nccl, _NCCL_OPS[op]) if op is not None else 0
        try:
            with self._cupy.cuda.Device(args["device"]):
                if kind == "all_reduce":
                    src, dst = args["src"], args["dst"]
                    dt, n = self._type(src)
                    c.allReduce(src.data.ptr, dst.data.ptr, n, dt, nop, s)
                elif kind == "broadcast":
                    buf = args["buf"]
                    dt, n = self._type(buf)
                    c.broadcast(buf.data.ptr, buf.data.ptr, n, dt, args["root"], s)
                elif kind == "reduce":
                    src, dst = args["src"], args["dst"]
                    dt, n = self._type(src)
                    c.reduce(src.data.ptr, dst.data.ptr, n, dt, nop, args["root"], s)
                elif kind == "all_gather":
                    src, out = args["src"], args["out"]
                    dt, n = self._type(src)
                    c.allGather(src.data.ptr, out.data.ptr, n, dt, s)
                elif kind == "reduce_scatter":
                    src, out = args["src"], args["out"]
                    dt, n = self._type(out)
                    c.reduceScatter(src.data.ptr, out.data.ptr, n, dt, nop, s)
                else:
                    raise CollectiveError(f"{what}: NCCL does not run {kind}")
                if op is ReduceOp.AVG:
                    target = args.get("dst", args.get("out"))
                    if target is not None and (kind != "reduce" or self.rank == args["root"]):
                        target /= self.size
        except CollectiveError:
            raise
        except Exception as e:
            raise CollectiveError(f"{what}: NCCL call failed: {e}") from e
        self._running = True
        try:
            await self._wait(stream, timeout, what)
        finally:
            self._running = False


async def setup_nccl(
    store: Any, key: str, ranks: Sequence[int], rank: int, timeout: float, device: int
) -> NcclEngine | None:
    """Decide on NCCL for a group and create its communicator (collective, on the loop).

    Returns ``None`` when NCCL is not usable on every member.

    Raises:
        CollectiveError: creating the communicator failed.
    """
    me = ranks[rank]
    info = probe(device)
    await store.set(f"{key}/probe/{me}", msgpack.packb(info))
    infos = [
        msgpack.unpackb(b)
        for b in await asyncio.gather(*(store.get(f"{key}/probe/{r}", timeout) for r in ranks))
    ]
    if not usable(infos):
        return None
    import cupy
    from cupy.cuda import nccl

    if rank == 0:
        uid = nccl.get_unique_id()
        await store.set(
            f"{key}/uid",
            msgpack.packb([isinstance(uid, bytes), uid if isinstance(uid, bytes) else list(uid)]),
        )
    is_bytes, raw = msgpack.unpackb(await store.get(f"{key}/uid", timeout))
    uid = raw if is_bytes else tuple(raw)

    def make() -> Any:
        with cupy.cuda.Device(device):
            return nccl.NcclCommunicator(len(ranks), uid, rank)

    try:
        comm = await asyncio.wait_for(
            asyncio.get_running_loop().run_in_executor(None, make), timeout
        )
    except Exception as e:
        raise CollectiveError(f"creating the NCCL communicator failed: {e}") from e
    return NcclEngine(comm, nccl, cupy, len(ranks), rank)
