"""The hang doctor: a snapshot of what one worker has outstanding.

:func:`snapshot` is what ``rpcdist.debug_info()`` returns, and what every
``RpcTimeoutError`` the agent raises carries (``.snapshot``, with a one-line
:func:`summary` in its message): the calls pending per peer (oldest first,
with their age), blocking calls and handlers running, the links, the lost
workers, and what each extension reports (collective sequence numbers per
group, live RRefs, autograd contexts). Comparing the snapshots of two
workers usually shows who waits for whom: a call pending on one side with
no handler running on the other, or collective sequence numbers that
differ between ranks.

Taking one reads the tables under their locks and costs nothing until then.
:func:`statistics` is the flat dict of counters ``rpcdist.statistics()`` returns.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._agent_view import AgentView

__all__ = ["snapshot", "statistics", "summary"]

#: Calls listed per peer (the oldest); the rest are counted.
_SHOWN = 5


def snapshot(agent: AgentView) -> dict[str, Any]:
    """What ``agent`` has outstanding now (any thread; plain data)."""
    now = time.monotonic()
    workers = agent.workers

    def name(rank: int) -> str:
        try:  # (a dynamic group's table also names the workers that departed)
            return workers[rank].name
        except IndexError:
            return f"rank {rank}"

    pending: dict[str, dict[str, Any]] = {}
    for dst, label, started, deadline in sorted(agent.calls.outstanding(), key=lambda c: c[2]):
        entry = pending.setdefault(name(dst), {"count": 0, "oldest": []})
        entry["count"] += 1
        if len(entry["oldest"]) < _SHOWN:
            entry["oldest"].append(
                {
                    "call": label,
                    "age_s": round(now - started, 3),
                    "deadline_in_s": None if deadline is None else round(deadline - now, 3),
                }
            )
    blocking = [
        {"to": name(dst), "call": label, "age_s": round(now - started, 3)}
        for dst, label, started in agent.sync.outstanding()
    ]
    info: dict[str, Any] = {
        "worker": agent.name,
        "rank": agent.rank,
        "pending_calls": pending,
        "blocking_calls": blocking,
        "handlers_running": agent.activity.inflight,
        "handler_pool": agent.executor.debug_info(),
        "calls_sent": agent.activity.sent,
        "calls_handled": agent.activity.handled,
        "lost_workers": {name(r): why for r, why in sorted(agent.liveness.lost.items())},
        "links": agent.links.statistics(),
    }
    for ext_name, ext in sorted(agent.registry.extensions.items()):
        debug = getattr(ext, "debug_info", None)
        try:
            part = debug() if debug is not None else dict(ext.statistics())
        except Exception as e:  # a snapshot must never fail
            part = {"error": f"{type(e).__name__}: {e}"}
        info[ext_name] = part
    return info


def summary(info: dict[str, Any]) -> str:
    """One line from a :func:`snapshot`: what was outstanding."""
    parts: list[str] = []
    pool = info.get("handler_pool", {})
    if pool.get("exhausted"):
        parts.append(pool["exhausted"])
    elif pool.get("blocked"):
        parts.append(
            f"handlers blocked in nested calls: {len(pool['blocked'])} "
            f"({pool['threads']} pool threads, {pool['queued']} calls queued)"
        )
    calls = []
    for peer, entry in info.get("pending_calls", {}).items():
        oldest = entry["oldest"][0] if entry["oldest"] else None
        detail = f" (oldest {oldest['call']!r}, {oldest['age_s']:.3g} s)" if oldest else ""
        calls.append(f"{entry['count']} to {peer!r}{detail}")
    parts.append("pending calls: " + (", ".join(calls) if calls else "none"))
    blocking = info.get("blocking_calls") or []
    if blocking:
        parts.append(
            "blocking calls: " + ", ".join(f"{b['call']!r} to {b['to']!r}" for b in blocking[:3])
        )
    parts.append(f"handlers running: {info.get('handlers_running', 0)}")
    coll = info.get("collectives", {}).get("collectives", {})
    for group, g in coll.items():
        running = f", running {g['running']}" if g.get("running") else ""
        parts.append(f"{group}: {g['issued']} collectives issued{running}")
    rref = info.get("rref", {})
    if rref.get("rref_owners") or rref.get("rref_users"):
        parts.append(f"RRefs: {rref.get('rref_owners', 0)} owned, {rref.get('rref_users', 0)} held")
    contexts = info.get("autograd", {}).get("autograd_contexts")
    if contexts:
        parts.append(f"autograd contexts: {contexts}")
    lost = info.get("lost_workers") or {}
    if lost:
        parts.append("lost: " + ", ".join(repr(w) for w in lost))
    return "outstanding on " + repr(info.get("worker", "?")) + ": " + "; ".join(parts)


def statistics(agent: AgentView) -> dict[str, int]:
    """``Agent.statistics()``: counters for tests and debugging; every gauge
    is 0 when idle."""
    activity = agent.activity
    stats = {
        # (calls handed to the loop count from the moment they are made)
        "pending_calls": len(agent.calls) + agent.calls.queued + agent.sync.inflight,
        "inflight_handlers": activity.inflight,
        "calls_sent": activity.sent,
        "calls_handled": activity.handled,
        "direct_sync_calls": agent.sync.calls,
        "busy_polls": agent.busy_poll.polls,
        "busy_poll_hits": agent.busy_poll.hits,
        "busy_poll_yields": agent.busy_poll.yields,
    }
    stats.update(agent.links.statistics())
    stats.update(agent.mailbox.statistics())
    stats.update(agent.liveness.statistics())
    for ext in list(agent.registry.extensions.values()):
        stats.update(ext.statistics())
    return stats
