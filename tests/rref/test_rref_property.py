"""Property: over random create / fork / move / delete sequences across 3 workers,
a value is alive exactly while some reference to it exists, and freed after."""

from __future__ import annotations

import gc
import itertools
import time

import rref_funcs as rf
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    rule,
    run_state_machine_as_test,
)

import rpcdist
from rpcdist.testing import as_current

_tokens = itertools.count(1_000_000)
_QUIET = ("rref_pending_users", "rref_pending_children", "rref_outbox", "pending_calls")
workers = st.integers(0, 2)


def quiesce(agents, timeout: float = 30.0) -> None:
    """Wait until no RRef control traffic or call is pending anywhere."""
    end = time.monotonic() + timeout
    while True:
        gc.collect()
        busy = {a.name: {k: v for k in _QUIET if (v := a.statistics().get(k, 0))} for a in agents}
        if not any(busy.values()):
            return
        assert time.monotonic() < end, f"still busy after {timeout} s: {busy}"
        time.sleep(0.002)


def state(agents) -> str:
    """What each agent knows, for a failure's message."""
    keys = ("lost_workers", "rref_owners", "rref_forks", "rref_control_failures")
    parts = []
    for a in agents:
        stats = a.statistics()
        parts.append(f"{a.name}: {dict((k, stats.get(k)) for k in keys)}")
    return "; ".join(parts)


class RRefProtocol(RuleBasedStateMachine):
    agents: list = []
    refs = Bundle("refs")

    def __init__(self) -> None:
        super().__init__()
        self.model: dict[tuple[int, int], int] = {}  # (worker, handle) -> token
        self.created: set[int] = set()
        self.seen: set[int] = set()

    def _call(self, worker: int, fn, *args):
        return rpcdist.rpc_sync(f"worker{worker}", fn, args=args, timeout=20)

    @rule(target=refs, owner=workers, creator=workers, local=st.booleans())
    def create(self, owner, creator, local):
        token = next(_tokens)
        self.created.add(token)
        if local:
            where, h = owner, self._call(owner, rf.keep_local, token)
        else:
            where, h = creator, self._call(creator, rf.keep_remote, f"worker{owner}", token)
        self.model[(where, h)] = token
        return (where, h)

    @rule(target=refs, ref=refs, to=workers)
    def fork(self, ref, to):
        h = self._call(ref[0], rf.pass_on, ref[1], f"worker{to}")
        self.model[(to, h)] = self.model[ref]
        return (to, h)

    @rule(target=refs, ref=consumes(refs), to=workers)
    def move(self, ref, to):
        h = self._call(ref[0], rf.pass_on, ref[1], f"worker{to}")
        self.model[(to, h)] = self.model.pop(ref)
        self._call(ref[0], rf.drop, ref[1])
        return (to, h)

    @rule(ref=consumes(refs))
    def delete(self, ref):
        self._call(ref[0], rf.drop, ref[1])
        del self.model[ref]

    @rule(ref=refs)
    def use(self, ref):
        assert self._call(ref[0], rf.stash_token, ref[1]) == self.model[ref]

    @invariant()
    def alive_exactly_while_referenced(self):
        held = set(self.model.values())
        # (values made by remote() exist only once created, hence ``seen``)
        gone = [t for t in held & self.seen if not rf.alive(t)]
        assert not gone, f"referenced values {gone} were freed ({state(self.agents)})"
        quiesce(self.agents)
        gone = [t for t in held if not rf.alive(t)]
        assert not gone, f"referenced values {gone} were freed ({state(self.agents)})"
        self.seen |= held
        leaked = [t for t in self.created - held if rf.alive(t)]
        assert not leaked, f"values {leaked} outlived every reference ({state(self.agents)})"

    def teardown(self) -> None:
        for w, h in list(self.model):
            self._call(w, rf.drop, h)
        self.model.clear()
        quiesce(self.agents)
        assert not [t for t in self.created if rf.alive(t)]


def test_values_live_exactly_while_referenced(rrefs3):
    RRefProtocol.agents = rrefs3
    with as_current(rrefs3[0]):
        run_state_machine_as_test(
            RRefProtocol,
            settings=settings(
                max_examples=30,
                stateful_step_count=15,
                deadline=None,
                database=None,
                suppress_health_check=list(HealthCheck),
            ),
        )
