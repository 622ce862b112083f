"""What the launchers write in their rendezvous store: keys and records (no I/O).

Every record is a small JSON object. The keys, under ``rpcdist/launch/``:

==========================  =====================================================
``job``                     the job's shape and its workers' token (node 0)
``seq``                     counter: a joining launcher takes the next number
``node/<seq>``              who that launcher is (node rank if fixed, host, pid)
``hb/<seq>``                its heartbeat counter, bumped every interval
``left/<seq>``              set when it leaves on purpose (it was signalled)
``to/<seq>/<i>``            its mailbox: the coordinator's i-th message to it
``round/<r>``               members of attempt ``r`` (in node-rank order), port
``round/<r>/end``           why attempt ``r`` ended; the first writer wins
``round/<r>/done/<seq>``    that node's workers all exited 0
``round/<r>/stopped/<seq>`` that node's workers are stopped and reaped
``bye/<seq>``               that node read the job's closing message
==========================  =====================================================
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from .._errors import ProtocolError

__all__ = [
    "JOB",
    "PEEK",
    "SEQ",
    "End",
    "Job",
    "Message",
    "NodeInfo",
    "Round",
    "bye_key",
    "decode",
    "done_key",
    "encode",
    "end_key",
    "heartbeat_key",
    "inbox_key",
    "left_key",
    "node_key",
    "order_members",
    "round_key",
    "stopped_key",
]

_PREFIX = "rpcdist/launch/"
JOB = _PREFIX + "job"
SEQ = _PREFIX + "seq"
#: compare_set(key, PEEK, PEEK) reads a key without waiting and without changing it.
PEEK = b"\x00peek"


def node_key(seq: int) -> str:
    return f"{_PREFIX}node/{seq}"


def heartbeat_key(seq: int) -> str:
    return f"{_PREFIX}hb/{seq}"


def left_key(seq: int) -> str:
    return f"{_PREFIX}left/{seq}"


def inbox_key(seq: int, index: int) -> str:
    return f"{_PREFIX}to/{seq}/{index}"


def round_key(number: int) -> str:
    return f"{_PREFIX}round/{number}"


def end_key(number: int) -> str:
    return f"{_PREFIX}round/{number}/end"


def done_key(number: int, seq: int) -> str:
    return f"{_PREFIX}round/{number}/done/{seq}"


def stopped_key(number: int, seq: int) -> str:
    return f"{_PREFIX}round/{number}/stopped/{seq}"


def bye_key(seq: int) -> str:
    return f"{_PREFIX}bye/{seq}"


@dataclass(frozen=True)
class Job:
    """The job as node 0 started it; every joining launcher must agree with it."""

    nproc_per_node: int
    min_nodes: int
    max_nodes: int
    fixed: bool  # node ranks given by --node-rank
    max_restarts: int
    token: str  # the workers' RPCDIST_TOKEN


@dataclass(frozen=True)
class NodeInfo:
    """A registered launcher."""

    node_rank: int | None  # fixed-size jobs only
    hostname: str
    pid: int


@dataclass(frozen=True)
class Round:
    """One attempt: its members' sequence numbers in node-rank order, the workers' port."""

    number: int
    members: list[int]
    master_port: int


@dataclass(frozen=True)
class Message:
    """The coordinator to one launcher: ``round`` (you are in round ``number``),
    ``closed`` (the job is over: exit with ``code``) or ``refused`` (you cannot join)."""

    kind: str
    number: int = 0
    code: int = 0
    reason: str = ""


@dataclass(frozen=True)
class End:
    """Why a round ended: ``done``, ``failed``, ``membership`` or ``shutdown``.

    ``code`` is the exit code the job ends with if no restart follows.
    """

    kind: str
    reason: str
    code: int = 0
    lost: list[int] = field(default_factory=list)  # sequence numbers of nodes lost or left


def encode(record: Any) -> bytes:
    """A record as JSON bytes."""
    return json.dumps(asdict(record), sort_keys=True).encode()


def decode(kind: type[Any], raw: bytes, where: str) -> Any:
    """Parse a record of type ``kind`` read from ``where``.

    Raises:
        ProtocolError: ``raw`` is not such a record.
    """
    try:
        return kind(**json.loads(raw))
    except (ValueError, TypeError) as exc:
        raise ProtocolError(
            f"rendezvous key {where!r} holds {raw[:80]!r}, not a {kind.__name__} record"
        ) from exc


def order_members(host: int, previous: list[int], live: list[int], limit: int) -> list[int]:
    """Node order of an elastic round: the host first (it is node 0), then the
    previous round's members in their order, then newcomers by arrival; at most
    ``limit``. Only nodes in ``live`` are kept."""
    alive = set(live)
    order = [host] if host in alive else []
    order += [s for s in previous if s in alive and s not in order]
    order += sorted(s for s in alive if s not in order)
    return order[:limit]
