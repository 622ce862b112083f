"""``FaultTolerance``: data-parallel training that goes on when a rank dies.

Per step (see ``docs/fault-tolerance.md``)::

    idx = ft.start_step()    # heal a joiner / send live state; this rank's batch
    ... forward, backward (local gradients only) ...
    if ft.commit():          # average over this step's members, then vote
        opt.step()

The gradients are averaged over a full mesh of TCP connections between this
step's members (``_ft_mesh.py``) (reduce-scatter then all-gather: each chunk is summed by one
owner, in member order, so every member gets the same bits), outside the
agent and its process groups, whose world is fixed: the membership here
changes from step to step. A failed all-reduce (a peer's connection reset,
or no data within ``timeout``) closes the mesh, so the other members fail
too, and votes ``ok=False``; the coordinator (:class:`FaultToleranceCoordinator`)
then has every survivor redo the step at the smaller world, the sampler
re-sharded over the samples not yet committed.

Where every member is on this host, the all-reduce runs in shared memory
instead (``_ft_shm.py``; the mesh then only sets it up and tells a peer's
death), and its last synchronisation is the vote: a step in which nothing
happened commits without a round trip to the coordinator, which gets the
step's record from the first member. A member that needs the coordinator
(a rank waits to join) says so in its header, and every member then votes.

A fault-tolerant ``ZeroRedundancyOptimizer`` or ``FullyShardedDataParallel``
takes part through :meth:`FaultTolerance._add_sharded` (``_zero_ft.py``,
``_fsdp_ft.py``): its gradients join the average, it may act between the
average and the vote (ZeRO's step), and at the first step of each new
membership every member re-shards it (``_ft_shard.py``). Joiners take the
live state from one member (``_ft_heal.py``).
"""

from __future__ import annotations

import contextlib
import functools
import os
import select
import socket
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from .._errors import ConfigError, WorkerLostError
from ..tensor import Tensor
from ._ft_heal import LiveState
from ._ft_mesh import Mesh
from ._ft_shm import HEAD_WORDS, MAX_SAMPLES, ShmGroup, StalledError, setup, sweep
from ._ft_wire import connect, pack, recv_frame, send_frame, unpack

__all__ = ["FaultTolerance"]

_FAILURES = (OSError, WorkerLostError)


class FaultTolerance:
    """This rank's side of fault-tolerant data parallelism.

    Args:
        sampler: An :class:`rpcdist.data.DistributedSampler` to draw batches
            from (re-sharded at each change of membership), or None to feed
            batches yourself.
        batch_size: Samples per rank and step (with ``sampler``).
        address: The coordinator's ``host:port`` (default: ``RPCDIST_FT_ADDR``).
        replica_id: This rank's id (default: ``RANK``); a replacement reuses
            the id of the rank it replaces, or takes a new one.
        timeout: Seconds a peer may stay silent during an all-reduce or a
            state transfer before the step fails.
        hook: Called as ``hook(point)`` at ``"before_allreduce"``,
            ``"mid_allreduce"`` (between the reduce-scatter and the
            all-gather), ``"after_allreduce"`` and ``"after_commit"``, and
            at ``"shm_created"`` (a quorum's first all-reduce on one host:
            this rank's shared-memory file exists, its name not yet sent)
            (tests time faults with it).

    Attributes:
        step: Steps committed so far (the same on every member).
        rank: This rank's index among the current members.
        world_size: Number of current members.
        members: The current members' ids.
        recoveries: Steps redone or membership changes seen, as ``(step, members)``.
    """

    __module__ = "rpcdist.parallel"

    def __init__(
        self,
        sampler: Any = None,
        batch_size: int | None = None,
        address: str | None = None,
        replica_id: int | None = None,
        timeout: float = 30.0,
        hook: Callable[[str], None] | None = None,
    ) -> None:
        if sampler is not None and (not isinstance(batch_size, int) or batch_size < 1):
            raise ConfigError(f"FaultTolerance: batch_size must be >= 1, got {batch_size!r}")
        address = address or os.environ.get("RPCDIST_FT_ADDR")
        if not address:
            raise ConfigError("FaultTolerance: pass address= or set RPCDIST_FT_ADDR")
        self.id = int(os.environ.get("RANK", "0")) if replica_id is None else int(replica_id)
        self.sampler, self.batch_size = sampler, batch_size
        self.timeout, self.hook = timeout, hook
        self.step, self.rank, self.world_size = 0, -1, 0
        self.members: list[int] = []
        self.recoveries: list[tuple[int, list[int]]] = []
        self._live = LiveState()  # what joiners are sent (_ft_heal.py)
        self._params: list[Tensor] = []
        self._sharded: list[Any] = []  # ZeRO / FSDP objects in this mode
        self._synced_qid = -1
        self._sizes: list[int] = []
        # This step's communication failed already (the vote will be ok=False).
        self._failed = False
        self._coord = connect(address, None)
        self._mesh = Mesh(self._coord.getsockname()[0], timeout)
        self._qid = -1
        self._shm: ShmGroup | None = None
        self._shm_qid = -1  # the quorum whose shared-memory setup ran (_shm None: TCP mesh)
        self._heads: list[list[int]] = []  # every member's header of this step (shared memory)
        self._last: dict[str, Any] | None = None  # the last step committed in shared memory
        self._addrs: dict[int, str] = {}
        self._send_to: list[int] = []
        self._heal_from: int | None = None
        self._iter: Iterator[int] | None = None
        self._committed = 0  # samples per rank committed in the sampler's segment
        self._batch: np.ndarray[Any, Any] | None = None
        send_frame(self._coord, {"op": "join", "id": self.id, "addr": self._mesh.address})
        self._joined = False

    # -- what the training loop calls -------------------------------------------------

    def register_state(self, name: str, obj: Any) -> None:
        """Carry ``obj.state_dict()`` to replacements (a module, an optimizer).

        An optimizer over a ``FullyShardedDataParallel`` model's shards (or a
        ``ZeroRedundancyOptimizer``) has sharded state: it is re-sharded from
        the members' slices, and only its options travel this way. So is the
        fault-tolerant FSDP model itself; its buffers travel with the live
        state whether it is registered or not.

        Raises:
            ConfigError: ``obj`` has no ``state_dict``/``load_state_dict``.
        """
        self._live.register(name, obj, self._sharded)

    def _add_sharded(self, obj: Any) -> None:
        """Take part ``obj`` (a ``ZeroRedundancyOptimizer`` or ``FullyShardedDataParallel``).

        Its ``_ft_grads()`` are averaged with the attached gradients and
        handed back to ``_ft_write``, then ``_ft_prepare()`` runs before the
        vote and ``_ft_finish(committed)`` after it; ``_ft_reshard()`` runs
        on every member at the first step after each change of membership.
        ``_ft_live()`` goes with the live state to a joiner, whose object
        takes it in ``_ft_take_live()``.
        """
        self._sharded.append(obj)
        self._live.adopt(obj)

    def attach(self, params: list[Tensor]) -> None:
        """The parameters whose gradients :meth:`commit` averages (DDP calls this)."""
        self._params = list(params)

    def start_step(self) -> np.ndarray[Any, Any] | None:
        """Begin a step: join (and heal) if new, send the live state to joiners.

        Returns:
            This rank's batch indices for the step (with a sampler), else None.

        Raises:
            WorkerLostError: the coordinator went away.
        """
        if not self._joined:
            self._apply(self._coord_reply())
            self._joined = True
        if self._heal_from is not None:
            self._receive_state()
        for rid in self._send_to:
            with contextlib.suppress(*_FAILURES):  # a joiner that died is the coordinator's
                self._send_state(rid)
        self._send_to = []
        if self._qid != self._synced_qid:
            self._reshard_objects()
        if self.sampler is None:
            return None
        self._batch = self._next_batch()
        return self._batch

    def commit(self) -> bool:
        """Average the attached gradients over this step's members and vote.

        Returns:
            Whether the step committed everywhere: then ``.grad`` holds the
            average and the caller steps its optimizer. If not, the step is
            to be redone (the membership changed; call :meth:`start_step`).

        Raises:
            WorkerLostError: the coordinator went away.
        """
        ok = not self._failed
        self._point("before_allreduce")
        self._heads = []
        stalled: StalledError | None = None
        flat = np.zeros(0)
        if ok:
            try:
                flat = self._flat_grads()
                self._write_grads(self._allreduce(flat))
                for obj in self._sharded:  # e.g. ZeRO's step and all-gather, undone if no commit
                    obj._ft_prepare()
            except StalledError as e:
                stalled = e
            except _FAILURES:
                ok = False
                self._fail()
        self._point("after_allreduce")
        batch = self._batch if self._batch is not None else np.zeros(0, np.int64)
        if stalled is not None and self._sharded:
            ok = False  # the others stepped their shards already: this rank cannot catch up
            self._fail()
        if ok and stalled is None and self._heads and not any(h[0] for h in self._heads):
            # Every member passed the vote in shared memory: committed, no coordinator. The
            # first member sends the record; the others' next vote (or close) carries it too.
            self._last = self._record()
            if self.rank == 0:
                send_frame(self._coord, {"op": "done", **self._last})
            self.step += 1
            self._committed += len(batch)
            committed = True
        else:

            def finish() -> None:  # the others passed the vote this rank timed out in
                if stalled is not None:
                    stalled.finish()
                    self._write_grads(flat)

            committed = self._coord_vote(ok and not self._failed, batch, finish)
        self._failed = False
        self._point("after_commit")
        return committed

    def _coord_vote(
        self, ok: bool, batch: np.ndarray[Any, Any], finish: Callable[[], None]
    ) -> bool:
        """Vote with the coordinator and apply its decision (``finish()`` first if it
        commits); whether the step committed."""
        epoch = getattr(self.sampler, "epoch", 0)
        vote = {"op": "vote", "ok": ok, "step": self.step, "epoch": epoch}
        send_frame(self._coord, dict(vote, samples=batch.tolist(), last=self._last))
        reply = self._coord_reply()
        committed = bool(reply["commit"])
        if committed:
            finish()
            self._committed += len(batch)  # before _apply re-shards the sampler past it
        for obj in self._sharded:
            obj._ft_finish(committed)
        self._apply(reply)
        return committed

    def _record(self) -> dict[str, Any]:
        """The step's record for the coordinator: the epoch and every member's batch."""
        batches = [[m, h[HEAD_WORDS:]] for m, h in zip(self.members, self._heads, strict=True)]
        return {"step": self.step, "epoch": self._heads[0][1], "batches": batches}

    def _header(self) -> list[int]:
        """This step's header in shared memory: ``[wants the coordinator, epoch, count,
        batch...]``. The coordinator is wanted when it has something to say (a rank
        waits to join), or the step has a sharded object or a batch too long to carry."""
        batch = self._batch if self._batch is not None else np.zeros(0, np.int64)
        want = bool(self._sharded) or batch.size > MAX_SAMPLES
        if not want:
            readable, _, _ = select.select([self._coord], [], [], 0)
            want = bool(readable)
        epoch = int(getattr(self.sampler, "epoch", 0))
        return [int(want), epoch, int(batch.size), *batch.tolist()[:MAX_SAMPLES]]

    def _fail(self) -> None:
        """Mark this step failed (it votes ``ok=False``) and close the mesh, so peers fail too."""
        self._failed = True
        self._drop_mesh()

    def _all_gather_frames(
        self, header: dict[str, Any], arrays: list[np.ndarray[Any, Any]]
    ) -> dict[int, tuple[dict[str, Any], list[np.ndarray[Any, Any]]]]:
        """Every member's ``(header, arrays)``, by id, this rank's included (collective).

        Raises:
            WorkerLostError, OSError: a member failed, or this step already had.
        """
        got = {self.id: (header, list(arrays))}
        if self.world_size == 1:
            return got
        self._check_failed()
        specs, payload = pack(arrays)
        mesh = self._peers()
        head = dict(header, _arrays=specs)
        with self._mesh.sending([(send_frame, (sock, head, payload)) for sock in mesh.values()]):
            for rid, sock in mesh.items():
                theirs, data = recv_frame(sock)
                got[rid] = (theirs, unpack(theirs.pop("_arrays"), data))
        return got

    def _all_gather(
        self, outgoing: np.ndarray[Any, Any], size: int
    ) -> dict[int, np.ndarray[Any, Any]]:
        """All-gather: send ``outgoing`` (float64) to every member, ``size`` floats from each.

        Raises:
            WorkerLostError, OSError: a member failed, or this step already had.
        """
        if self.world_size == 1:
            return {self.id: outgoing}
        self._check_failed()
        others = [m for m in self.members if m != self.id]
        got = self._exchange({m: outgoing for m in others}, {m: size for m in others})
        got[self.id] = outgoing
        return got

    def _check_failed(self) -> None:
        if self._failed:
            raise WorkerLostError("fault tolerance: this step's communication failed already")

    def _reshard_objects(self) -> None:
        try:
            for obj in self._sharded:
                obj._ft_reshard()
        except _FAILURES:
            self._fail()  # the step votes ok=False; the next membership reshards again
        else:
            self._synced_qid = self._qid

    def close(self) -> None:
        """Leave: close the connections (the others go on without this rank)."""
        self._drop_mesh()
        sweep()  # shared-memory files of members that died before sharing them
        self._mesh.close(self._qid)
        with contextlib.suppress(*_FAILURES):
            if self._last is not None:  # in case the first member died before sending it
                send_frame(self._coord, {"op": "done", **self._last})
            # Once the coordinator answers, it has the records sent before (in order).
            self._coord.settimeout(self.timeout)
            send_frame(self._coord, {"op": "bye"})
            while "bye" not in recv_frame(self._coord)[0]:
                pass  # notes
        with contextlib.suppress(OSError):
            self._coord.shutdown(socket.SHUT_RDWR)
        self._coord.close()

    # -- membership --------------------------------------------------------------------

    def _point(self, name: str) -> None:
        if self.hook is not None:
            self.hook(name)

    def _coord_reply(self) -> dict[str, Any]:
        """The coordinator's next decision (its notes, that a rank waits to join, skipped)."""
        try:
            while True:
                reply, _ = recv_frame(self._coord)
                if "note" not in reply:
                    return reply
        except OSError as e:
            raise WorkerLostError("fault tolerance: the coordinator went away") from e

    def _apply(self, reply: dict[str, Any]) -> None:
        members = [int(m) for m, _ in reply["members"]]
        self._addrs = {int(m): str(a) for m, a in reply["members"]}
        self.step = int(reply["step"])
        self._send_to = [int(r) for r in reply.get("send_to", ())]
        heal = reply.get("heal_from")
        self._heal_from = int(heal) if heal is not None and int(heal) != self.id else None
        changed = int(reply["qid"]) != self._qid
        if changed or not reply["commit"]:
            if self._qid >= 0:
                self.recoveries.append((self.step, members))
            self._reshard(len(members), members.index(self.id))
        if changed:
            self._drop_mesh()
            self._qid = int(reply["qid"])
        self.members, self.world_size = members, len(members)
        self.rank = members.index(self.id)

    def _reshard(self, world: int, rank: int) -> None:
        if self.sampler is not None and self._joined:
            self.sampler.reshard(world, rank, consumed=self._committed)
        elif self.sampler is not None:
            self.sampler.reshard(world, rank, consumed=0)
        self._committed, self._iter = 0, None

    def _next_batch(self) -> np.ndarray[Any, Any]:
        assert self.batch_size is not None
        for _ in range(2):
            if self._iter is None:
                self._iter = iter(self.sampler)
            out = [i for _, i in zip(range(self.batch_size), self._iter, strict=False)]
            if out:
                return np.asarray(out, np.int64)
            self.sampler.set_epoch(self.sampler.epoch + 1)
            self._committed, self._iter = 0, None
        raise ConfigError("FaultTolerance: the sampler yields no samples")

    # -- live state --------------------------------------------------------------------

    def _send_state(self, rid: int) -> None:
        payload = self._live.pack(self.step, self.sampler, self._sharded)
        sock = connect(self._addrs[rid], self.timeout)
        with sock:
            send_frame(sock, {"kind": "heal", "id": self.id, "step": self.step}, payload)
            recv_frame(sock)  # the joiner's acknowledgement

    def _receive_state(self) -> None:
        sock, payload = self._take(("heal",))
        if self._live.unpack(bytes(payload), self.sampler, self._sharded):
            self.sampler.reshard(self.world_size, self.rank, consumed=0)
            self._iter, self._committed = None, 0
        with sock:
            send_frame(sock, {"ok": True})
        self._heal_from = None

    # -- the mesh (_ft_mesh.py) -------------------------------------------------------

    def _take(self, key: tuple[Any, ...]) -> tuple[socket.socket, bytearray]:
        return self._mesh.take(key)

    def _peers(self) -> dict[int, socket.socket]:
        return self._mesh.peers(self.id, self._qid, self.members, self._addrs)

    def _drop_mesh(self) -> None:
        if self._shm is not None:
            self._shm.close()
            self._shm = None
        self._mesh.drop(self._qid)

    def _exchange(
        self,
        outgoing: dict[int, np.ndarray[Any, Any]],
        shapes: dict[int, int],
        into: dict[int, np.ndarray[Any, Any]] | None = None,
    ) -> dict[int, np.ndarray[Any, Any]]:
        return self._mesh.exchange(self._peers(), outgoing, shapes, into)

    def _allreduce(self, flat: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        """The average over the members, in place in ``flat`` (returned): in shared
        memory where every member is on this host (``_ft_shm.py``), else over the mesh."""
        n = self.world_size
        if n == 1:
            return flat
        mesh = self._peers()
        if self._shm_qid != self._qid:
            self._shm_qid = self._qid
            socks = {self.members.index(m): s for m, s in mesh.items()}
            gather = self._gather_infos
            self._shm = setup(gather, self.rank, socks, flat.nbytes, self.timeout, self._point)
        if self._shm is not None:
            mid = functools.partial(self._point, "mid_allreduce")
            self._heads = self._shm.all_reduce(flat, self._header(), mid)
            return flat
        self._mesh.all_reduce(mesh, self.members, self.id, flat, self._point)
        return flat

    def _gather_infos(self, info: dict[str, Any]) -> list[dict[str, Any]]:
        got = self._all_gather_frames(info, [])
        return [got[m][0] for m in self.members]

    def _flat_grads(self) -> np.ndarray[Any, Any]:
        """A new float64 vector of this rank's gradients: one copy of each (the average is
        made in place in it, and the parameters' ``.grad`` views it where dtypes agree)."""
        extra = [obj._ft_grads() for obj in self._sharded]
        self._sizes = [a.size for a in extra]
        flat = np.empty(sum(self._sizes) + sum(p.data.size for p in self._params), np.float64)
        at = 0
        for a in extra:
            flat[at : at + a.size] = a
            at += a.size
        for p in self._params:
            size, g = p.data.size, p.grad
            if g is None:
                flat[at : at + size] = 0
            else:
                flat[at : at + size] = g.data.reshape(-1)
            at += size
        return flat

    def _write_grads(self, avg: np.ndarray[Any, Any]) -> None:
        at = 0
        for obj, size in zip(self._sharded, self._sizes, strict=True):
            obj._ft_write(avg[at : at + size])
            at += size
        for p in self._params:
            size = p.data.size
            view = avg[at : at + size].reshape(p.data.shape)
            p.grad = Tensor._wrap(view.astype(p.data.dtype, copy=False))
            at += size
