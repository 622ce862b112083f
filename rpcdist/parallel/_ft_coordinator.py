"""The coordinator of the fault-tolerant mode: per-step quorum and commit.

One small TCP server (threads, no asyncio) that outlives the ranks: the
launcher, a test or a script that starts its own ranks runs it. Each rank
holds one connection to it. A *round* is one training step:

* every member votes (``ok``: its gradient all-reduce succeeded; the batch
  indices it trained on ride along, so the coordinator can account for
  every sample of an epoch);
* a member whose connection closes (``kill -9``) is lost at once; one that
  has not voted ``timeout`` seconds after the round's first vote (a stopped
  process) is declared lost and its connection closed;
* when every member still alive has voted, the round is decided: it
  commits only if every member of the round voted ``ok`` and none was lost
  (otherwise the survivors redo the step at the new membership); the next
  round's members are the survivors plus the ranks waiting to join, and the
  joiners are told which healthy member sends them the live state.

See ``docs/fault-tolerance.md``.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections import defaultdict
from typing import Any

from ._ft_wire import recv_frame, send_frame

__all__ = ["FaultToleranceCoordinator"]

_log = logging.getLogger(__name__)
_TICK = 0.05


class FaultToleranceCoordinator:
    """Decides each step's membership and whether it commits (see the module doc).

    Args:
        world_size: Ranks that must join before the first step.
        host: Interface to listen on.
        port: Port (0: a free one).
        timeout: Seconds a member may take to vote after the round's first
            vote before it is declared lost.

    Attributes:
        address: ``host:port`` to give the ranks (``RPCDIST_FT_ADDR``).
        events: ``(time, kind, detail)`` of losses, joins and decisions.
        commits: Per committed step, the epoch and each member's batch.
    """

    __module__ = "rpcdist.parallel"

    def __init__(
        self, world_size: int, host: str = "127.0.0.1", port: int = 0, timeout: float = 30.0
    ) -> None:
        self.world_size = world_size
        self.timeout = timeout
        self._server = socket.create_server((host, port), backlog=64)
        self.address = f"{host}:{self._server.getsockname()[1]}"
        self._cv = threading.Condition()
        self._conns: dict[int, socket.socket] = {}
        self._addrs: dict[int, str] = {}
        self._members: list[int] = []
        self._joiners: list[int] = []
        self._votes: dict[int, dict[str, Any]] = {}
        self._round_lost = False
        self._deadline: float | None = None
        self._qid = 0
        self.step = 0
        self._seen: dict[int, defaultdict[int, int]] = defaultdict(lambda: defaultdict(int))
        self.events: list[tuple[float, str, Any]] = []
        #: Per committed step: ``(epoch, [(member, batch indices)])`` in member order.
        self.commits: list[tuple[int, list[tuple[int, list[int]]]]] = []
        self._closed = False
        self._threads = [
            threading.Thread(target=self._accept, name="ft-coord-accept", daemon=True),
            threading.Thread(target=self._ticker, name="ft-coord-tick", daemon=True),
        ]
        for t in self._threads:
            t.start()

    # -- what tests and benchmarks read ------------------------------------------------

    def members(self) -> list[int]:
        """The current round's members."""
        with self._cv:
            return list(self._members)

    def seen(self, epoch: int) -> dict[int, int]:
        """How many times each sample index was in a committed batch in ``epoch``."""
        with self._cv:
            return dict(self._seen[epoch])

    def wait_for(self, predicate: Any, timeout: float) -> bool:
        """Wait until ``predicate(self)`` holds (checked at each event); whether it did."""
        end = time.monotonic() + timeout
        with self._cv:
            while not predicate(self):
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(min(left, _TICK))
        return True

    def close(self) -> None:
        """Stop serving and close every connection."""
        with self._cv:
            self._closed = True
            conns = list(self._conns.values())
            self._cv.notify_all()
        for s in [self._server, *conns]:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def __enter__(self) -> FaultToleranceCoordinator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- serving ----------------------------------------------------------------------

    def _accept(self) -> None:
        while not self._closed:
            try:
                sock, _ = self._server.accept()
            except OSError:
                return
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._serve, args=(sock,), daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
        rid: int | None = None
        try:
            while True:
                msg, _ = recv_frame(sock)
                with self._cv:
                    if msg["op"] == "join":
                        rid = int(msg["id"])
                        self._join(rid, sock, str(msg["addr"]))
                    elif rid is None or self._conns.get(rid) is not sock:
                        pass  # not (or no longer) a member: a lost rank's last words
                    elif msg["op"] == "done":
                        self._done(msg)
                    elif int(msg.get("step", self.step)) < self.step:
                        self._late_vote(rid, bool(msg.get("ok")))
                    else:
                        self._votes[rid] = msg
                        if self._deadline is None:
                            self._deadline = time.monotonic() + self.timeout
                    self._decide()
        except (OSError, ValueError, KeyError, RuntimeError):
            pass
        with self._cv:
            if rid is not None and self._conns.get(rid) is sock:
                self._lose(rid, "connection closed")
                self._decide()
        sock.close()

    def _ticker(self) -> None:
        while not self._closed:
            time.sleep(_TICK)
            with self._cv:
                if self._deadline is not None and time.monotonic() > self._deadline:
                    for rid in [m for m in self._members if m not in self._votes]:
                        self._lose(rid, "no vote in time")
                    self._decide()

    def _join(self, rid: int, sock: socket.socket, addr: str) -> None:
        old = self._conns.get(rid)
        if old is not None:  # a replacement with the id of one not yet noticed as lost
            self._lose(rid, "replaced")
        self._conns[rid], self._addrs[rid] = sock, addr
        self._joiners.append(rid)
        self._note("join", rid)
        for m in self._members:  # members that commit in shared memory come to vote
            with contextlib.suppress(OSError, KeyError):
                send_frame(self._conns[m], {"note": "join"})

    def _done(self, msg: dict[str, Any]) -> None:
        """A step the members committed among themselves (their shared-memory vote)."""
        if int(msg["step"]) != self.step:
            return  # another member's record of it came first
        self._record(int(msg.get("epoch", 0)), [(int(m), b) for m, b in msg["batches"]])
        self._note("commit", (self.step, list(self._members)))
        voters = [m for m in self._members if m in self._votes]
        self._votes, self._deadline = {}, None
        if voters:  # their vote's sync timed out, yet every member voted in the end
            self._reply(self._members, voters[0], dict.fromkeys(voters, True), [], to=voters)

    def _late_vote(self, rid: int, ok: bool) -> None:
        """A vote on a step the others committed in shared memory: this rank's vote sync
        timed out after its all-reduce finished, so it has the average and commits too."""
        if ok:
            self._reply(self._members, rid, {rid: True}, [], to=[rid])
        else:  # cannot happen (no member passes the vote without this one's): drop it
            self._lose(rid, "voted against a committed step")

    def _record(self, epoch: int, batches: list[tuple[int, list[int]]]) -> None:
        self.step += 1
        self.commits.append((epoch, [(m, [int(i) for i in b]) for m, b in batches]))
        seen = self._seen[epoch]
        for _, b in batches:
            for i in b:
                seen[int(i)] += 1

    def _lose(self, rid: int, why: str) -> None:
        sock = self._conns.pop(rid, None)
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        if rid in self._members:
            self._members.remove(rid)
            self._round_lost = True
        if rid in self._joiners:
            self._joiners.remove(rid)
        self._votes.pop(rid, None)
        self._note("lost", (rid, why))

    def _note(self, kind: str, detail: Any) -> None:
        self.events.append((time.monotonic(), kind, detail))
        self._cv.notify_all()

    def _decide(self) -> None:
        if not self._members:
            if len(self._joiners) < (self.world_size if self.step == 0 else 1):
                return
            members = sorted(self._joiners)
            self._joiners = []
            self._qid += 1
            self._members = members
            src = members[0]
            self._reply(members, src, {m: False for m in members}, joiners=members)
            return
        if any(m not in self._votes for m in self._members):
            return
        votes = self._votes
        commit = not self._round_lost and all(bool(v.get("ok")) for v in votes.values())
        if commit:
            batches = [(m, list(votes[m].get("samples", ()))) for m in self._members]
            self._record(int(votes[self._members[0]].get("epoch", 0)), batches)
        survivors = sorted(self._members)
        joiners = sorted(self._joiners)
        members = sorted(survivors + joiners)
        if members != survivors or not commit:  # a new mesh after every failed round
            self._qid += 1
        self._members, self._joiners = members, []
        self._votes, self._round_lost, self._deadline = {}, False, None
        self._note("commit" if commit else "redo", (self.step, list(members)))
        self._reply(members, survivors[0], {m: commit for m in survivors}, joiners=joiners)

    def _reply(
        self,
        members: list[int],
        src: int,
        commits: dict[int, bool],
        joiners: list[int],
        to: list[int] | None = None,
    ) -> None:
        base = {
            "step": self.step,
            "qid": self._qid,
            "members": [[m, self._addrs[m]] for m in members],
        }
        for m in members if to is None else to:
            msg = dict(base, commit=commits.get(m, False))
            if m in joiners:
                msg["heal_from"] = src
            if m == src:
                msg["send_to"] = [j for j in joiners if j != src]
            try:
                send_frame(self._conns[m], msg)
            except OSError:
                _log.debug("fault tolerance: could not answer rank %d", m)
