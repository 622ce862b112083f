"""Distributed autograd contexts: identities, send and receive functions, gradients.

A context id and an autograd message id are 64-bit: the 16 high bits are the
rank of the worker that made them, the 48 low bits a counter there, so they
are unique across the job without coordination. The counter starts at a
random point of its lower half (and so has 2**47 ids ahead of it): a worker
restarted with the rank of a lost one (a dynamic group) does not make the
ids of contexts its predecessor left on other workers.

A :class:`DistContext` lives on every worker that took part in a forward
pass: it holds the :class:`DistSend` functions of tensors that left this
worker and the :class:`DistRecv` functions of tensors that arrived, both
keyed by message id, the gradients of this worker's leaves accumulated by
backward passes, the workers it exchanged messages with (so that its
release reaches them) and the state of backward passes (:class:`PassState`,
run by :mod:`._backward`).

The bottom of this package: the backward pass, the tensor codec and the
extension (:mod:`._extension`, which composes them) import this module, and
it imports none of them; they see the extension as a :class:`ContextTable`.
"""

from __future__ import annotations

import asyncio
import contextvars
import itertools
import secrets
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from .._errors import AutogradError, ConfigError
from ..tensor import AccumulateGrad, GraphTask, Node, RecvFunction, SendFunction

if TYPE_CHECKING:
    from ..tensor import Tensor

__all__ = [
    "CURRENT",
    "ContextTable",
    "DistContext",
    "DistRecv",
    "DistSend",
    "IdMaker",
    "Key",
    "PassState",
    "creator_of",
]

#: A backward pass: ``(root rank, pass number)``.
Key = tuple[int, int]
_COUNTER_BITS = 48
_MAX_RANK = (1 << 16) - 1

#: The context calls made from this thread or task travel in (its id).
CURRENT: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "rpcdist_autograd_context", default=None
)


def creator_of(context_id: int) -> int:
    """The rank of the worker that made ``context_id`` (or a message id)."""
    return context_id >> _COUNTER_BITS


class IdMaker:
    """Context and message ids of one worker (thread-safe)."""

    def __init__(self, rank: int) -> None:
        if not 0 <= rank <= _MAX_RANK:
            raise ConfigError(
                f"distributed autograd supports ranks 0..{_MAX_RANK}, this worker is rank {rank}"
            )
        self._base = rank << _COUNTER_BITS
        # (a fresh start per process: see the module docstring)
        self._counter = itertools.count(1 + secrets.randbelow(1 << (_COUNTER_BITS - 1)))

    def new(self) -> int:
        return self._base | next(self._counter)  # next() on a count is atomic in CPython


class DistSend(SendFunction):
    """Tensors that left this worker in one message; their gradients come back to it.

    Grows one output per tensor as the message is encoded.
    """

    __module__ = "rpcdist.autograd"
    __slots__ = ("context_id", "message_id", "peer")

    def __init__(self, context_id: int, message_id: int, peer: int) -> None:
        super().__init__(())
        self.context_id = context_id
        self.message_id = message_id
        self.peer = peer

    def add(self, tensor: Tensor) -> int:
        """Record one more sent tensor; its index in this message."""
        self.next_edges = (*self.next_edges, tensor.gradient_edge())
        self.num_outputs += 1
        return self.num_outputs - 1

    def name(self) -> str:
        return f"SendFunction(message {self.message_id} to rank {self.peer})"


class DistRecv(RecvFunction):
    """The ``grad_fn`` of tensors that arrived in one message.

    Backward hands its gradients to the pass, which sends them to ``peer``.
    """

    __module__ = "rpcdist.autograd"
    __slots__ = ("context_id", "message_id", "peer")

    def __init__(self, context_id: int, message_id: int, peer: int) -> None:
        super().__init__(0)
        self.context_id = context_id
        self.message_id = message_id
        self.peer = peer

    def grow(self, index: int) -> None:
        """Make room for output ``index`` (tensors are decoded one at a time)."""
        if index >= self.num_outputs:
            self.num_outputs = index + 1

    def name(self) -> str:
        return f"RecvFunction(message {self.message_id} from rank {self.peer})"


class DistContext:
    """One distributed autograd context on one worker (see the module docstring)."""

    def __init__(self, context_id: int, me: int) -> None:
        self.id = context_id
        self.creator = creator_of(context_id)
        self.me = me
        self.lock = threading.Lock()
        self.sends: dict[int, DistSend] = {}
        self.recvs: dict[int, DistRecv] = {}
        #: Leaf gradients of backward passes, keyed by the leaf tensor.
        self.grads: dict[Tensor, Any] = {}
        #: Workers this context exchanged messages with (its release reaches them).
        self.known: set[int] = set()
        #: Backward passes, by ``(root rank, pass number)``.
        self.passes: dict[Key, PassState] = {}
        self._pass_numbers = itertools.count(1)
        #: Set once a pass ran without ``retain_graph``: the graph is freed.
        self.freed_by: str | None = None
        self.released = False
        #: When its creator was found lost (``time.monotonic()``), for the lease.
        self.orphaned_at: float | None = None
        #: DDP reducers whose forward ran in this context here: a backward
        #: pass rooted here feeds them the parameters' gradients as they
        #: become final and has them write the averages into ``grads``.
        self.reducers: list[Any] = []
        #: State of other layers' autograd over this context (``rpcdist.torch``
        #: keeps its torch send/receive records and gradients here), by name.
        self.extras: dict[str, Any] = {}

    def next_pass(self) -> int:
        return next(self._pass_numbers)

    def send_for(self, message_id: int, peer: int) -> DistSend:
        with self.lock:
            self.known.add(peer)
            fn = self.sends.get(message_id)
            if fn is None:
                fn = self.sends[message_id] = DistSend(self.id, message_id, peer)
            return fn

    def recv_for(self, message_id: int, peer: int) -> DistRecv:
        with self.lock:
            self.known.add(peer)
            fn = self.recvs.get(message_id)
            if fn is None:
                fn = self.recvs[message_id] = DistRecv(self.id, message_id, peer)
            return fn

    def touch(self, peer: int) -> None:
        with self.lock:
            self.known.add(peer)
            if peer == self.creator:
                self.orphaned_at = None  # the creator is back: no lease

    def check_usable(self, what: str) -> None:
        """Raises: AutogradError: the context was released."""
        if self.released:
            raise AutogradError(f"{what}: distributed autograd context {self.id} was released")

    def orphan(self) -> None:
        if self.orphaned_at is None:
            self.orphaned_at = time.monotonic()

    def __repr__(self) -> str:
        return (
            f"<DistContext {self.id} creator={self.creator} sends={len(self.sends)} "
            f"recvs={len(self.recvs)} known={sorted(self.known)}>"
        )


class PassState:
    """One backward pass on one worker."""

    def __init__(self, key: Key, roots: Sequence[Node] = (), retain: bool = False) -> None:
        self.key = key
        self.roots = list(roots)
        self.retain = retain
        self.lock = threading.Lock()
        self.task: GraphTask | None = None
        #: Set once the first gradient message here has set the task up.
        self.ready: threading.Event | None = None
        self.failed: BaseException | None = None
        #: Receive function -> the start nodes from which it is reached.
        self._reached_from: dict[Node, set[Node]] | None = None
        self._overlapping: set[Node] = set()
        #: Answers of ``autograd.reach`` here, by message id.
        self.answers: dict[int, asyncio.Future[bool]] = {}

    def analyse(self, ctx: DistContext) -> tuple[dict[Node, set[Node]], set[Node]]:
        """``(receive function -> start nodes reaching it, overlapping start nodes)``."""
        with self.lock:
            if self._reached_from is None:
                starts = [*self.roots, *ctx.sends.values()]
                self._reached_from, self._overlapping = _analyse(starts)
            return self._reached_from, self._overlapping


def _analyse(starts: Sequence[Node]) -> tuple[dict[Node, set[Node]], set[Node]]:
    """Walk from each start node: which receive functions it reaches, and
    which start nodes share a non-leaf node with another (a pure function)."""
    owner: dict[Node, Node] = {}
    overlapping: set[Node] = set()
    reached_from: dict[Node, set[Node]] = {}
    for start in starts:
        seen = {start}
        stack = [start]
        while stack:
            node = stack.pop()
            if isinstance(node, DistRecv):
                reached_from.setdefault(node, set()).add(start)
                continue
            for edge in node.next_edges:
                if edge is None or edge[0] in seen:
                    continue
                child = edge[0]
                seen.add(child)
                if type(child) is AccumulateGrad:
                    continue  # summed as gradients arrive: never waits
                first = owner.setdefault(child, start)
                if first is not start:
                    overlapping.update((first, start))
                stack.append(child)
    return reached_from, overlapping


class ContextTable(Protocol):
    """What this package's parts use of the agent's autograd extension
    (``_extension.AutogradExtension``)."""

    ids: IdMaker

    def context(self, context_id: int) -> DistContext:
        """Context ``context_id``, made here on first sight."""
        ...

    def get(self, context_id: int, what: str) -> DistContext:
        """Raises: AutogradError: no such context on this worker."""
        ...

    def forget_send(self, context_id: int, message_id: int) -> None:
        """A message recorded in a send function was never sent (undo)."""
        ...
