"""Collectives over same-host shared memory (see :mod:`._shm` for the protocol).

All-reduce, per round of at most ``round_bytes`` of the buffer:

* **A** (in): rank ``r`` copies every slice of the block but its own into
  its slot;
* **B** (reduce): after a sync, rank ``r`` reduces slice ``r`` of the block,
  reading its own input and its peers' slots (``ufunc(..., out=)``), into its
  own slot, dividing for AVG;
* **C** (out): after the next sync, every rank copies all ``p`` reduced
  slices into its output.

Rounds pipeline: the sync that ends round ``j`` also publishes A of round
``j + 1``, so a round costs one sync (``K`` rounds: ``K + 1`` syncs), and a
rank signals it before copying round ``j - 1`` out, so the copy overlaps
the peers' next phase (four slots make that safe: see :mod:`._shm`).
Copies per byte of the buffer, per rank: ``(p - 1)/p`` (A) + ``1`` (C), plus
one reduction pass over ``1/p`` of it that reads ``p`` inputs: about 2
memory copies per byte (1.5 at p=2, 1.75 at p=4) against about 5 for the
gRPC path (pack, socket send, socket receive, gRPC's buffer, unpack).

A device (CuPy) buffer of a group of two is staged piece by piece through
the slots: each piece's copy and each reduction is a device operation the
rank waits for, about ``4p`` a round. Up to ``HOST_REDUCE_BYTES``, and at
every size in larger groups, the buffer is instead copied down whole (a host
copy of it for the call's length), reduced by the host algorithm and copied
back: two device operations (``reduces_on_host``; the copies are
``HostEngine``'s). Where processes share one GPU, each device
operation also waits its turn on it. How the two paths compare, by size
and group, is in docs/benchmarks.md ("Figures behind the code's choices").

The other collectives are one-phase rounds: writers copy their pieces into
their slots, a sync, readers copy them out; the next round's writes ride
before the same sync.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .._errors import CollectiveError
from ._ops import Meta, ReduceOp, Xp
from ._ring import split
from ._shm import Segments

__all__ = ["HOST_REDUCE_BYTES", "ShmEngine"]

#: Device buffers up to this size are reduced on the host: one copy down,
#: the host algorithm, one copy up. Below it, the staged path's many small
#: copies and kernel launches (each waited for) cost more than the data.
#: Groups of more than two ranks take the host path at every size.
HOST_REDUCE_BYTES = 256 << 10


def _rounds_for(sizes: Sequence[int], per: int) -> int:
    return max(1, max((-(-n // per) for n in sizes), default=1))


def _chunk(n: int, per: int, j: int) -> tuple[int, int]:
    a = min(n, j * per)
    return a, min(n, a + per)


class ShmEngine:
    """The collectives of one group over its :class:`Segments`."""

    name = "shm"

    def __init__(self, seg: Segments) -> None:
        self.seg = seg
        self.rank = seg.rank
        self.size = seg.size

    def close(self) -> None:
        """Unmap the segments and close the doorbell."""
        self.seg.close()

    def _view(self, q: int, g: int, offset: int, n: int, dtype: np.dtype[Any]) -> np.ndarray:
        u8 = self.seg.slot(q, g)
        return u8[offset : offset + n * dtype.itemsize].view(dtype)

    def _start(self, seq: int, meta: Meta, where: str) -> list[Any] | None:
        self.seg.sync()
        return self.seg.check_meta(seq, where)

    def interrupt(self) -> None:
        """Wake a waiting collective so it notices an abort or shutdown (any thread)."""
        self.seg.interrupt()

    def reduces_on_host(self, nbytes: int) -> bool:
        """Whether a device buffer of ``nbytes`` is better reduced on the host
        (``HostEngine`` copies it down whole and back) than staged piece by piece."""
        return self.size > 2 or nbytes <= HOST_REDUCE_BYTES

    # ------------------------------------------------------------ reductions

    def _reduce_rounds(
        self, seq: int, xp: Xp, src: Any, op: ReduceOp, meta: Meta, out: Any | None, root: int
    ) -> None:
        """Reduce ``src`` over the group into ``out`` on every rank (``root < 0``) or at ``root``."""
        seg, p, r = self.seg, self.size, self.rank
        seg.pin(xp)
        dtype = src.dtype
        per = max(1, seg.round_bytes // dtype.itemsize)
        n = src.size
        count = _rounds_for([n], per)
        g0 = seg.round
        seg.round += count
        where = f"{meta.kind} #{seq}"
        parts = [split(b - a, p) for a, b in (_chunk(n, per, j) for j in range(count))]
        scratch = None if xp.host else xp.module.empty(split(min(n, per), p)[0][1], dtype)

        def a_phase(j: int) -> None:
            base = j * per
            for q, (s, e) in enumerate(parts[j]):
                if q != r and e > s:
                    xp.to_host(
                        src[base + s : base + e],
                        self._view(r, g0 + j, s * dtype.itemsize, e - s, dtype),
                    )

        def b_phase(j: int) -> None:
            base = j * per
            s, e = parts[j][r]
            if e == s:
                return
            mine = self._view(r, g0 + j, s * dtype.itemsize, e - s, dtype)
            acc = mine if xp.host else scratch[: e - s]  # type: ignore[index]
            first = src[base + s : base + e]
            for i in range(1, p):
                q = (r + i) % p
                xp.reduce_into(
                    op, acc, first, self._view(q, g0 + j, s * dtype.itemsize, e - s, dtype)
                )
                first = acc
            xp.finish(op, acc, p)
            if not xp.host:
                xp.to_host(acc, mine)

        def c_phase(j: int) -> None:
            if out is None or (root >= 0 and r != root):
                return
            base = j * per
            for q, (s, e) in enumerate(parts[j]):
                if e > s:
                    xp.from_host(
                        out[base + s : base + e],
                        self._view(q, g0 + j, s * dtype.itemsize, e - s, dtype),
                    )

        seg.put_meta(seq, meta.full)
        a_phase(0)
        self._start(seq, meta, where)
        for j in range(count):
            b_phase(j)
            if j + 1 < count:
                a_phase(j + 1)
            xp.fence(src)  # device copies from peers' slots are done before we sync
            n = seg.signal()  # peers may go on while this rank copies out
            if j >= 1:
                c_phase(j - 1)
            seg.wait(n)
        c_phase(count - 1)
        xp.fence(src)  # ... also before the next collective's first sync

    def all_reduce(self, seq: int, xp: Xp, src: Any, dst: Any, op: ReduceOp, meta: Meta) -> None:
        """Shared-memory all-reduce of the 1-D ``src`` into ``dst`` (may be ``src``)."""
        self._reduce_rounds(seq, xp, src, op, meta, dst, -1)

    def reduce(
        self, seq: int, xp: Xp, src: Any, dst: Any | None, root: int, op: ReduceOp, meta: Meta
    ) -> None:
        """Shared-memory reduce to ``root``; other ranks' buffers are left alone."""
        self._reduce_rounds(seq, xp, src, op, meta, dst, root)

    # ------------------------------------------------------ one-phase rounds

    def _rounds(
        self,
        seq: int,
        meta: Meta,
        count_of: Callable[[list[Any] | None], int],
        write: Callable[[int, int], None],
        read: Callable[[int, int], None],
    ) -> None:
        seg = self.seg
        g0 = seg.round
        seg.put_meta(seq, meta.full)
        write(g0, 0)
        metas = self._start(seq, meta, f"{meta.kind} #{seq}")
        count = count_of(metas)
        seg.round += count
        for j in range(count):
            if j + 1 < count:
                write(g0 + j + 1, j + 1)
            read(g0 + j, j)
            if j + 1 < count:
                seg.sync()

    def _piece_bytes(self) -> int:
        return (self.seg.round_bytes // self.size) & ~63

    def broadcast(self, seq: int, buf: np.ndarray, root: int, meta: Meta) -> None:
        """Root writes each block once; everyone else copies it out."""
        dt, r = buf.dtype, self.rank
        per = max(1, self.seg.round_bytes // dt.itemsize)

        def write(g: int, j: int) -> None:
            a, b = _chunk(buf.size, per, j)
            if r == root and b > a:
                np.copyto(self._view(r, g, 0, b - a, dt), buf[a:b])

        def read(g: int, j: int) -> None:
            a, b = _chunk(buf.size, per, j)
            if r != root and b > a:
                np.copyto(buf[a:b], self._view(root, g, 0, b - a, dt))

        self._rounds(seq, meta, lambda _m: _rounds_for([buf.size], per), write, read)

    def all_gather(self, seq: int, src: np.ndarray, outs: Sequence[np.ndarray], meta: Meta) -> None:
        """Each rank publishes its piece; everyone copies every piece out."""
        self._gather(seq, src, outs, -1, meta)

    def gather(
        self, seq: int, src: np.ndarray, outs: Sequence[np.ndarray] | None, root: int, meta: Meta
    ) -> None:
        """Each rank publishes its piece; ``root`` copies them out."""
        self._gather(seq, src, outs, root, meta)

    def _gather(
        self, seq: int, src: np.ndarray, outs: Sequence[np.ndarray] | None, root: int, meta: Meta
    ) -> None:
        dt, r, p = src.dtype, self.rank, self.size
        per = max(1, self.seg.round_bytes // dt.itemsize)
        reading = root < 0 or r == root
        if reading:
            assert outs is not None
            np.copyto(outs[r], src)

        def write(g: int, j: int) -> None:
            a, b = _chunk(src.size, per, j)
            if b > a:
                np.copyto(self._view(r, g, 0, b - a, dt), src[a:b])

        def read(g: int, j: int) -> None:
            if not reading:
                return
            assert outs is not None
            for q in range(p):
                a, b = _chunk(outs[q].size, per, j)
                if q != r and b > a:
                    np.copyto(outs[q][a:b], self._view(q, g, 0, b - a, dt))

        def count_of(metas: list[Any] | None) -> int:
            if outs is not None and root < 0:
                return _rounds_for([o.size for o in outs], per)
            if metas is None:
                raise CollectiveError(f"gather #{seq}: too many ranks for shared memory")
            return _rounds_for([m[1][0] for m in metas], per)

        self._rounds(seq, meta, count_of, write, read)

    def scatter(
        self, seq: int, out: np.ndarray, ins: Sequence[np.ndarray] | None, root: int, meta: Meta
    ) -> None:
        """Root publishes every rank's piece; each copies its own out."""
        dt, r, p = out.dtype, self.rank, self.size
        pb = self._piece_bytes()
        per = max(1, pb // dt.itemsize)
        if r == root:
            assert ins is not None
            np.copyto(out, ins[root])

        def write(g: int, j: int) -> None:
            if r != root:
                return
            assert ins is not None
            for q in range(p):
                a, b = _chunk(ins[q].size, per, j)
                if q != r and b > a:
                    np.copyto(self._view(r, g, q * pb, b - a, dt), ins[q][a:b])

        def read(g: int, j: int) -> None:
            a, b = _chunk(out.size, per, j)
            if r != root and b > a:
                np.copyto(out[a:b], self._view(root, g, r * pb, b - a, dt))

        def count_of(metas: list[Any] | None) -> int:
            if metas is None:
                raise CollectiveError(f"scatter #{seq}: too many ranks for shared memory")
            return _rounds_for(metas[root][1], per)

        self._rounds(seq, meta, count_of, write, read)

    def all_to_all(
        self, seq: int, outs: Sequence[np.ndarray], ins: Sequence[np.ndarray], meta: Meta
    ) -> None:
        """Each rank publishes one piece per peer; each copies its pieces out."""
        r, p = self.rank, self.size
        dt = ins[r].dtype
        pb = self._piece_bytes()
        per = max(1, pb // dt.itemsize)
        np.copyto(outs[r], ins[r])

        def write(g: int, j: int) -> None:
            for q in range(p):
                a, b = _chunk(ins[q].size, per, j)
                if q != r and b > a:
                    np.copyto(self._view(r, g, q * pb, b - a, dt), ins[q][a:b])

        def read(g: int, j: int) -> None:
            for q in range(p):
                a, b = _chunk(outs[q].size, per, j)
                if q != r and b > a:
                    np.copyto(outs[q][a:b], self._view(q, g, r * pb, b - a, dt))

        def count_of(metas: list[Any] | None) -> int:
            if metas is None:
                raise CollectiveError(f"all_to_all #{seq}: too many ranks for shared memory")
            return _rounds_for([n for m in metas for n in m[1]], per)

        self._rounds(seq, meta, count_of, write, read)

    def reduce_scatter(
        self, seq: int, xp: Xp, ins: Sequence[Any], out: Any, op: ReduceOp, meta: Meta
    ) -> None:
        """Each rank publishes its contribution to every piece; rank ``r`` reduces piece ``r``."""
        dt, r, p = out.dtype, self.rank, self.size
        self.seg.pin(xp)
        pb = self._piece_bytes()
        per = max(1, pb // dt.itemsize)

        def write(g: int, j: int) -> None:
            for q in range(p):
                a, b = _chunk(ins[q].size, per, j)
                if q != r and b > a:
                    xp.to_host(ins[q][a:b], self._view(r, g, q * pb, b - a, dt))

        def read(g: int, j: int) -> None:
            a, b = _chunk(out.size, per, j)
            if b == a:
                return
            acc, first = out[a:b], ins[r][a:b]
            for i in range(1, p):
                q = (r + i) % p
                xp.reduce_into(op, acc, first, self._view(q, g, r * pb, b - a, dt))
                first = acc
            xp.finish(op, acc, p)
            xp.fence(out)  # the copies from peers' slots are done before the next sync

        self._rounds(seq, meta, lambda _m: _rounds_for([x.size for x in ins], per), write, read)

    def barrier(self, seq: int, meta: Meta) -> None:
        """One sync: every rank has arrived."""
        self.seg.put_meta(seq, meta.full)
        self._start(seq, meta, f"barrier #{seq}")
