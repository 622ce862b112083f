"""Collectives over point-to-point messages: the general path, across hosts.

The algorithms talk to a :class:`~._link.Link` (send a byte view to a
group rank; post a receive, optionally straight into a destination buffer),
so the same code runs over the agent's gRPC streams and over an in-memory
fake in tests. Message keys are ``<group prefix><seq>/<step>``:
collectives are matched by their per-group sequence number, never by
arrival order. Every message carries the sender's :class:`Meta`, compared on
arrival, so a rank whose call differs is found by its neighbours.

Copies per byte (NumPy): sending packs each byte into a stream message once
(the transport), receiving writes it once into the posted destination; the
ring reduces in place (``ufunc(src, incoming, out=acc)``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import numpy as np

from .._errors import CollectiveError
from .._rpc._p2p import Message as InMessage
from ._link import Link, run_all
from ._link import Sends as _Sends
from ._link import recv_checked as _recv
from ._ops import Meta, ReduceOp, Xp, as_bytes
from ._ring import ag_step, chain_neighbours, lane_count, rs_step, split, tree_children, tree_parent

__all__ = ["RingEngine"]

#: Lane (chunk) size of the pipelined ring and chain algorithms, chosen by
#: measurement on the TCP transport against smaller and larger lanes, as
#: reducing on the loop was against handing each chunk to a thread
#: (docs/design.md).
CHUNK_BYTES = 4 << 20
#: Lanes in flight at once.
LANES_IN_FLIGHT = 4
#: Rooted collectives up to this size use a binomial tree (latency), above
#: it a pipelined chain (bandwidth); all-reduce uses recursive doubling
#: (log2 p exchanges of the whole buffer) up to it, the ring above.
TREE_MAX_BYTES = 64 << 10


class RingEngine:
    """Ring, tree and chain collectives over a :class:`Link`."""

    name = "ring"

    def __init__(
        self,
        link: Link,
        prefix: str,
        chunk_bytes: int = CHUNK_BYTES,
        small_bytes: int = TREE_MAX_BYTES,
    ) -> None:
        self.link = link
        self.prefix = prefix
        self.rank = link.rank
        self.size = link.size
        self.chunk_bytes = chunk_bytes
        self.small_bytes = small_bytes

        self._pool: dict[object, np.ndarray] = {}

    def close(self) -> None:
        """Drop the scratch buffers; the agent owns the streams."""
        self._pool.clear()

    def reduces_on_host(self, nbytes: int) -> bool:
        """Always: ``HostEngine`` copies a device buffer down whole, this
        reduces it, and it is copied back (staged piece by piece instead, it
        was slower at every size measured), so all-reduce and reduce only ever
        see host buffers; reduce-scatter still stages device buffers."""
        return True

    def scratch(self, slot: object, n: int, dtype: np.dtype[Any]) -> np.ndarray:
        """A reusable 1-D scratch array of ``n`` items (fresh pages fault slowly)."""
        need = n * dtype.itemsize
        raw = self._pool.get(slot)
        if raw is None or raw.nbytes < need:
            raw = self._pool[slot] = np.empty(max(need, 64), np.uint8)
        return raw[:need].view(dtype)

    def _post(self, src: int, key: str, out: memoryview | None) -> asyncio.Future[InMessage]:
        """Post a receive; a size mismatch found at once fails the future, not the caller."""
        try:
            return self.link.post(src, key, out)
        except CollectiveError as e:
            fut: asyncio.Future[InMessage] = asyncio.get_running_loop().create_future()
            fut.set_exception(e)
            return fut

    def _key(self, seq: int, *parts: object) -> str:
        return f"{self.prefix}{seq}/" + "/".join(map(str, parts))

    # ------------------------------------------------------------ the ring

    async def _ring(
        self,
        seq: int,
        xp: Xp,
        src: Sequence[Any],
        acc: Sequence[Any | None],
        op: ReduceOp,
        meta: Meta,
        gather: bool,
    ) -> None:
        """Reduce-scatter (then all-gather) segment ``q`` = ``src[q]`` into ``acc[q]``.

        ``acc[q] is None`` (only without ``gather``) reduces into scratch.
        Afterwards ``acc[rank]`` holds segment ``rank`` reduced over all ranks
        and, with ``gather``, every ``acc[q]`` holds segment ``q``.
        """
        itemsize = src[0].dtype.itemsize
        count = lane_count([s.size * itemsize for s in src], self.chunk_bytes)
        bounds = [split(s.size, count) for s in src]
        width = min(LANES_IN_FLIGHT, count)

        async def worker(w: int) -> None:
            for k in range(w, count, width):
                await self._ring_lane(seq, xp, src, acc, op, meta, gather, k, bounds, w)

        await run_all([worker(w) for w in range(width)])

    async def _ring_lane(
        self,
        seq: int,
        xp: Xp,
        src: Sequence[Any],
        acc: Sequence[Any | None],
        op: ReduceOp,
        meta: Meta,
        gather: bool,
        k: int,
        bounds: list[list[tuple[int, int]]],
        w: int,
    ) -> None:
        p, r, link = self.size, self.rank, self.link
        right, left = (r + 1) % p, (r - 1) % p
        where = f"{meta.kind} #{seq}"

        def piece(arrs: Sequence[Any], q: int) -> Any:
            a, b = bounds[q][k]
            return arrs[q][a:b]

        longest = max(b - a for a, b in (bq[k] for bq in bounds))
        dtype = src[0].dtype
        # Three buffers: one receiving, one being reduced, one being sent.
        scratch = [self.scratch(("ring", w, i), longest, dtype) for i in range(3)]
        async with _Sends() as track:
            partial: Any = None  # what to send at the next step
            fut = None
            for s in range(p - 1):
                send_q, recv_q = rs_step(r, p, s)
                n = bounds[recv_q][k][1] - bounds[recv_q][k][0]
                buf = scratch[s % 3][:n]
                key = self._key(seq, k, "r", s)
                if fut is None:
                    fut = self._post(left, key, as_bytes(buf))
                data = piece(src, send_q) if s == 0 else partial
                sent = track(link.send(right, key, as_bytes(xp.host_view(data)), meta.wire))
                msg_fut, fut = fut, None
                await _recv(msg_fut, meta, left, where)
                if s + 1 < p - 1:  # post the next receive before reducing
                    nq = rs_step(r, p, s + 1)[1]
                    nn = bounds[nq][k][1] - bounds[nq][k][0]
                    fut = self._post(
                        left, self._key(seq, k, "r", s + 1), as_bytes(scratch[(s + 1) % 3][:nn])
                    )
                target = acc[recv_q]
                dst = buf if target is None else piece(acc, recv_q)
                if not xp.host and target is None:
                    dst = xp.module.asarray(buf)
                xp.reduce_into(op, dst, piece(src, recv_q), buf)
                await sent
                partial = dst
            mine = piece(acc, r)
            xp.finish(op, mine, p)
            if not gather:
                return
            # The all-gather half: only all_reduce gathers, and it is given host
            # buffers (``reduces_on_host``), so pieces go out and land in place.
            futs = [
                self._post(
                    left, self._key(seq, k, "g", s), as_bytes(piece(acc, ag_step(r, p, s)[1]))
                )
                for s in range(p - 1)
            ]
            for s in range(p - 1):
                if s > 0:
                    await _recv(futs[s - 1], meta, left, where)
                data = piece(acc, ag_step(r, p, s)[0])
                track(link.send(right, self._key(seq, k, "g", s), as_bytes(data), meta.wire))
            await _recv(futs[p - 2], meta, left, where)

    # ---------------------------------------------------------- collectives

    async def all_reduce(
        self, seq: int, xp: Xp, src: Any, dst: Any, op: ReduceOp, meta: Meta
    ) -> None:
        """All-reduce of the 1-D ``src`` into ``dst`` (may be ``src``): ring, or
        recursive doubling for small buffers."""
        if src.nbytes <= self.small_bytes:
            await self._doubling(seq, xp, src, dst, op, meta)
            return
        segs = split(src.size, self.size)
        await self._ring(
            seq, xp, [src[a:b] for a, b in segs], [dst[a:b] for a, b in segs], op, meta, True
        )

    async def _doubling(
        self, seq: int, xp: Xp, src: Any, dst: Any, op: ReduceOp, meta: Meta
    ) -> None:
        """Recursive doubling over the largest power of two ``q <= p``; ranks
        ``q..p-1`` first fold into ``r - q`` and get the result back at the end.
        Every exchange combines the lower rank's value first, so all ranks
        compute bitwise the same result. Host buffers (see :meth:`reduces_on_host`)."""
        p, r = self.size, self.rank
        q = 1 << (p.bit_length() - 1)
        where = f"all_reduce #{seq}"
        n, dtype = src.size, src.dtype
        if dst is not src:
            xp.copy(dst, src)
        tmp = self.scratch(("rd",), n, dtype)
        async with _Sends() as track:
            if r >= q:  # fold in, then wait for the result
                track(self.link.send(r - q, self._key(seq, "x"), as_bytes(dst), meta.wire))
                await _recv(
                    self._post(r - q, self._key(seq, "y"), as_bytes(dst)), meta, r - q, where
                )
                return
            if r + q < p:
                await _recv(
                    self._post(r + q, self._key(seq, "x"), as_bytes(tmp)), meta, r + q, where
                )
                xp.reduce_into(op, dst, dst, tmp)
            d = 1
            while d < q:
                partner = r ^ d
                fut = self._post(partner, self._key(seq, "d", d), as_bytes(tmp))
                sent = track(
                    self.link.send(partner, self._key(seq, "d", d), as_bytes(dst), meta.wire)
                )
                await _recv(fut, meta, partner, where)
                await sent  # ``dst`` is about to change
                xp.reduce_into(op, dst, dst, tmp, reverse=partner < r)
                d <<= 1
            xp.finish(op, dst, p)
            if r + q < p:
                track(self.link.send(r + q, self._key(seq, "y"), as_bytes(dst), meta.wire))

    async def reduce_scatter(
        self, seq: int, xp: Xp, ins: Sequence[Any], out: Any, op: ReduceOp, meta: Meta
    ) -> None:
        """Ring reduce-scatter: ``out`` = reduction of every rank's ``ins[rank]``."""
        acc: list[Any | None] = [None] * self.size
        acc[self.rank] = out
        await self._ring(seq, xp, ins, acc, op, meta, False)

    def _topology(self, rel: int, nbytes: int) -> tuple[int, list[int], int]:
        """(parent, children, chunk count) of relative rank ``rel`` for a rooted op:
        a binomial tree for small payloads, a pipelined chain for large ones."""
        if nbytes <= TREE_MAX_BYTES:
            return tree_parent(rel), tree_children(rel, self.size), 1
        prev, nxt = chain_neighbours(rel, self.size)
        return prev, ([nxt] if nxt >= 0 else []), lane_count([nbytes], self.chunk_bytes)

    async def broadcast(self, seq: int, buf: np.ndarray, root: int, meta: Meta) -> None:
        """Tree (small) or pipelined chain (large) broadcast of the 1-D host ``buf``."""
        p = self.size
        rel = (self.rank - root) % p
        parent, children, count = self._topology(rel, buf.nbytes)
        where = f"broadcast #{seq}"
        chunks = split(buf.size, count)
        futs = []
        if parent >= 0:
            src = (parent + root) % p
            futs = [
                self._post(src, self._key(seq, k), as_bytes(buf[a:b]))
                for k, (a, b) in enumerate(chunks)
            ]
        async with _Sends() as track:
            for k, (a, b) in enumerate(chunks):
                if futs:
                    await _recv(futs[k], meta, (parent + root) % p, where)
                for c in children:
                    dst = (c + root) % p
                    track(self.link.send(dst, self._key(seq, k), as_bytes(buf[a:b]), meta.wire))

    async def reduce(
        self, seq: int, xp: Xp, src: Any, dst: Any | None, root: int, op: ReduceOp, meta: Meta
    ) -> None:
        """Tree (small) or pipelined chain (large) reduce of ``src`` into ``dst`` at ``root``."""
        p = self.size
        rel = (self.rank - root) % p
        parent, children, count = self._topology(rel, src.nbytes)
        chunks = split(src.size, count)
        width = min(LANES_IN_FLIGHT, count)
        acc_all = dst if dst is not None else (xp.module.empty_like(src) if children else None)

        async def lane(k: int, w: int) -> None:
            a, b = chunks[k]
            mine = src[a:b]
            acc = acc_all[a:b] if acc_all is not None else mine
            futs = []
            bufs = []
            for i, c in enumerate(children):
                scratch = self.scratch(("reduce", w, i), b - a, src.dtype)
                bufs.append(scratch)
                futs.append(self._post((c + root) % p, self._key(seq, k, c), as_bytes(scratch)))
            first = True
            for c, fut, scratch in zip(children, futs, bufs):
                await _recv(fut, meta, (c + root) % p, f"reduce #{seq}")
                xp.reduce_into(op, acc, mine if first else acc, scratch)
                first = False
            if parent >= 0:
                data = mine if first else acc
                async with _Sends() as track:
                    track(
                        self.link.send(
                            (parent + root) % p,
                            self._key(seq, k, rel),
                            as_bytes(xp.host_view(data)),
                            meta.wire,
                        )
                    )
            else:
                if first and acc is not mine:
                    xp.copy(acc, mine)
                xp.finish(op, acc, p)

        async def worker(w: int) -> None:
            for k in range(w, count, width):
                await lane(k, w)

        await run_all([worker(w) for w in range(width)])

    async def all_gather(
        self, seq: int, src: np.ndarray, outs: Sequence[np.ndarray], meta: Meta
    ) -> None:
        """Ring all-gather(v): ``outs[q]`` (1-D, host) receives rank ``q``'s ``src``."""
        p, r, link = self.size, self.rank, self.link
        np.copyto(outs[r], src)
        if p == 1:
            return
        right, left = (r + 1) % p, (r - 1) % p
        count = lane_count([o.nbytes for o in outs], self.chunk_bytes)
        bounds = [split(o.size, count) for o in outs]
        where = f"all_gather #{seq}"
        width = min(LANES_IN_FLIGHT, count)

        async def lane(k: int) -> None:
            def piece(q: int) -> np.ndarray:
                a, b = bounds[q][k]
                return outs[q][a:b]

            futs = [
                self._post(left, self._key(seq, k, s), as_bytes(piece(ag_step(r, p, s)[1])))
                for s in range(p - 1)
            ]
            async with _Sends() as track:
                for s in range(p - 1):
                    if s > 0:
                        await _recv(futs[s - 1], meta, left, where)
                    view = as_bytes(piece(ag_step(r, p, s)[0]))
                    track(link.send(right, self._key(seq, k, s), view, meta.wire))
                await _recv(futs[-1], meta, left, where)

        async def worker(w: int) -> None:
            for k in range(w, count, width):
                await lane(k)

        await run_all([worker(w) for w in range(width)])

    async def gather(
        self, seq: int, src: np.ndarray, outs: Sequence[np.ndarray] | None, root: int, meta: Meta
    ) -> None:
        """Every rank sends ``src`` to ``root``, which receives into ``outs``."""
        if self.rank != root:
            async with _Sends() as track:
                track(self.link.send(root, self._key(seq), as_bytes(src), meta.wire))
            return
        assert outs is not None
        np.copyto(outs[root], src)
        await run_all(
            [
                _recv(self._post(q, self._key(seq), as_bytes(outs[q])), meta, q, f"gather #{seq}")
                for q in range(self.size)
                if q != root
            ]
        )

    async def scatter(
        self, seq: int, out: np.ndarray, ins: Sequence[np.ndarray] | None, root: int, meta: Meta
    ) -> None:
        """``root`` sends ``ins[q]`` to every rank ``q``, which receives into ``out``."""
        if self.rank != root:
            fut = self._post(root, self._key(seq), as_bytes(out))
            await _recv(fut, meta, root, f"scatter #{seq}")
            return
        assert ins is not None
        order = [(root + i) % self.size for i in range(1, self.size)]
        async with _Sends() as track:
            for q in order:
                track(self.link.send(q, self._key(seq), as_bytes(ins[q]), meta.wire))
            np.copyto(out, ins[root])

    async def all_to_all(
        self, seq: int, outs: Sequence[np.ndarray], ins: Sequence[np.ndarray], meta: Meta
    ) -> None:
        """Rank ``r`` sends ``ins[q]`` to ``q`` and receives ``outs[q]`` from it."""
        p, r = self.size, self.rank
        peers = [(r + i) % p for i in range(1, p)]
        recvs = [
            _recv(self._post(q, self._key(seq), as_bytes(outs[q])), meta, q, f"all_to_all #{seq}")
            for q in reversed(peers)
        ]
        async with _Sends() as track:
            for q in peers:
                track(self.link.send(q, self._key(seq), as_bytes(ins[q]), meta.wire))
            np.copyto(outs[r], ins[r])
            await run_all(recvs)

    async def barrier(self, seq: int, meta: Meta) -> None:
        """Dissemination barrier: ``ceil(log2 p)`` rounds of empty messages."""
        p, r = self.size, self.rank
        dist, step = 1, 0
        while dist < p:
            key = self._key(seq, step)
            fut = self._post((r - dist) % p, key, None)
            async with _Sends() as track:
                track(self.link.send((r + dist) % p, key, memoryview(b""), meta.wire))
                await _recv(fut, meta, (r - dist) % p, f"barrier #{seq}")
            dist <<= 1
            step += 1
