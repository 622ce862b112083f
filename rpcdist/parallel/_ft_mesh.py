"""The fault-tolerant mode's peer connections: a listener, and a full mesh per quorum.

Each rank listens on one port. A peer's first frame says what the
connection is for: a *heal* (the live state for a joiner) or a *mesh* link
of quorum ``qid`` from member ``id``; the accepting thread files it in an
inbox that :meth:`Mesh.take` waits on. :meth:`Mesh.peers` connects to the
members with lower ids and takes the links of those with higher ids, so
every pair has exactly one connection per quorum; :meth:`Mesh.drop` closes
them (and any an older quorum left), which makes every peer blocked on one
fail at once. See ``docs/fault-tolerance.md``.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from .._errors import WorkerLostError
from ._ft_wire import connect, listen, recv_frame, recv_into, send_frame

__all__ = ["Mesh"]

_FAILURES = (OSError, WorkerLostError)


class Mesh:
    """This rank's listener and its connections to the members of the current quorum.

    Args:
        host: The interface to listen on.
        timeout: Seconds a peer may stay silent before an operation fails.
    """

    def __init__(self, host: str, timeout: float) -> None:
        self.timeout = timeout
        self.listener = listen(host)
        self._cv = threading.Condition()
        self._inbox: dict[tuple[Any, ...], tuple[socket.socket, bytearray]] = {}
        self._conns: dict[int, socket.socket] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._pool_size = 0
        self._closed = False
        threading.Thread(target=self._accept, name="ft-accept", daemon=True).start()

    @property
    def address(self) -> str:
        """``host:port`` of the listener."""
        host, port = self.listener.getsockname()[:2]
        return f"{host}:{port}"

    def _accept(self) -> None:
        while not self._closed:
            try:
                sock, _ = self.listener.accept()
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                sock.settimeout(self.timeout)
                hello, payload = recv_frame(sock)
            except _FAILURES:
                if self._closed:
                    return
                continue
            key: tuple[Any, ...] = (
                ("heal",) if hello["kind"] == "heal" else ("mesh", hello["qid"], hello["id"])
            )
            with self._cv:
                self._inbox[key] = (sock, payload)
                self._cv.notify_all()

    def take(self, key: tuple[Any, ...]) -> tuple[socket.socket, bytearray]:
        """The connection filed under ``key`` and its first frame's payload.

        Raises:
            WorkerLostError: none came within ``timeout``.
        """
        with self._cv:
            if not self._cv.wait_for(lambda: key in self._inbox, self.timeout):
                raise WorkerLostError(f"fault tolerance: no {key[0]} connection in time")
            return self._inbox.pop(key)

    def peers(
        self, me: int, qid: int, members: list[int], addrs: dict[int, str]
    ) -> dict[int, socket.socket]:
        """The connections to the other ``members`` of quorum ``qid`` (made on first use).

        Raises:
            WorkerLostError, OSError: a member could not be reached in time.
        """
        if self._conns:
            return self._conns
        conns: dict[int, socket.socket] = {}
        try:
            for rid in members:
                if rid < me:
                    sock = connect(addrs[rid], self.timeout)
                    send_frame(sock, {"kind": "mesh", "qid": qid, "id": me})
                    conns[rid] = sock
            for rid in members:
                if rid > me:
                    conns[rid] = self.take(("mesh", qid, rid))[0]
        except BaseException:
            for s in conns.values():
                s.close()
            raise
        for s in conns.values():
            s.settimeout(self.timeout)
        self._conns = conns
        if self._pool is None or self._pool_size < len(conns):
            if self._pool is not None:
                self._pool.shutdown(wait=False)
            self._pool_size = len(conns)
            self._pool = ThreadPoolExecutor(len(conns), thread_name_prefix="ft-send")
        return conns

    def drop(self, qid: int) -> None:
        """Close this quorum's connections and those filed for quorums before ``qid``."""
        with self._cv:  # connections of an older quorum nobody will take
            stale = [k for k in self._inbox if k[0] == "mesh" and k[1] < qid]
            socks = [self._inbox.pop(k)[0] for k in stale]
        socks += list(self._conns.values())
        self._conns = {}
        for s in socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def exchange(
        self,
        conns: dict[int, socket.socket],
        outgoing: dict[int, np.ndarray[Any, Any]],
        shapes: dict[int, int],
        into: dict[int, np.ndarray[Any, Any]] | None = None,
    ) -> dict[int, np.ndarray[Any, Any]]:
        """Send ``outgoing[peer]`` to each peer while receiving ``shapes[peer]`` floats from
        each (into ``into[peer]``, a contiguous float64 view, where given)."""
        jobs = [
            (conns[rid].sendall, (np.ascontiguousarray(arr).data.cast("B"),))
            for rid, arr in outgoing.items()
        ]
        got = {}
        with self.sending(jobs):
            for rid, n in shapes.items():
                buf = np.empty(n, np.float64) if into is None else into[rid]
                recv_into(conns[rid], buf.data.cast("B"))
                got[rid] = buf
        return got

    def all_reduce(
        self,
        conns: dict[int, socket.socket],
        members: list[int],
        me: int,
        flat: np.ndarray[Any, Any],
        point: Callable[[str], None],
    ) -> None:
        """The average over ``members`` (``me`` among them), in place in ``flat``:
        reduce-scatter, each chunk summed by one owner in member order (so every member
        gets the same bits), ``point("mid_allreduce")``, then all-gather."""
        n = len(members)
        bounds = np.linspace(0, flat.size, n + 1).astype(int)
        chunk = [flat[bounds[i] : bounds[i + 1]] for i in range(n)]
        mine = members.index(me)
        idx = {m: members.index(m) for m in members if m != me}
        got = self.exchange(
            conns, {m: chunk[q] for m, q in idx.items()}, dict.fromkeys(idx, chunk[mine].size)
        )
        total = np.zeros(chunk[mine].size, np.float64)
        for m in members:  # member order: the same sum on whichever owner
            total += chunk[mine] if m == me else got[m]
        total /= n
        point("mid_allreduce")
        chunk[mine][...] = total  # the others' averages land straight in their chunks
        into = {m: chunk[q] for m, q in idx.items()}
        self.exchange(conns, dict.fromkeys(idx, total), {m: c.size for m, c in into.items()}, into)

    @contextlib.contextmanager
    def sending(self, jobs: list[tuple[Callable[..., Any], tuple[Any, ...]]]) -> Iterator[None]:
        """Run the sends on the pool while the body receives; then wait for them (raising
        a send's error only if the body did not raise its own)."""
        assert self._pool is not None
        sends = [self._pool.submit(fn, *args) for fn, args in jobs]
        try:
            yield
        finally:
            for f in sends:
                with contextlib.suppress(Exception):
                    f.result(timeout=self.timeout)
        for f in sends:
            f.result(timeout=0)

    def close(self, qid: int) -> None:
        """Close every connection and the listener."""
        self._closed = True
        self.drop(qid)
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        if self._pool is not None:
            self._pool.shutdown(wait=False)
