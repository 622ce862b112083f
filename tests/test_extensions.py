"""What the layers above the agent plug in: handler scopes and call metadata.

A test extension on the callee enters a scope around every handler (the
handler sees it through a contextvar); one on the caller attaches named
fields to every call it makes; the callee's fields travel back on replies.
Every incoming path is covered: pool threads, thread-driven blocking calls,
``async def``, ``@async_execution``, RRef owners, nested calls.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import ext_funcs as ef
import pytest

import rpcdist
from rpcdist import ConfigError, RpcOptions
from rpcdist._rpc._registry import BaseExtension, CallInfo
from rpcdist._serialization._plugins import register_extension, unregister_extension
from rpcdist.testing import as_current, local_agents

PROBE_CODE = 60


@pytest.fixture
def probe_codec() -> Iterator[None]:
    def decode(structure, ctx):
        ef.SEEN.append(ctx.meta)
        return ef.Probe()

    register_extension(ef.Probe, PROBE_CODE, lambda obj, ctx: 0, decode)
    ef.SEEN.clear()
    yield
    unregister_extension(ef.Probe)


class Tagger(BaseExtension):
    """Binds the caller's tag around each handler; sends this worker's tag on."""

    name = "tagger"

    def __init__(self, agent) -> None:
        self.calls: list[CallInfo] = []
        agent.registry.add_scope(self.scope)
        agent.registry.add_source(self.source)

    @contextlib.contextmanager
    def _bound(self, tag: str) -> Iterator[None]:
        token, token2 = ef.IN_SCOPE.set(tag), ef.TAG.set(tag + "'")
        try:
            yield
        finally:
            ef.TAG.reset(token2)
            ef.IN_SCOPE.reset(token)

    def scope(self, call: CallInfo):
        self.calls.append(call)
        tag = (call.meta or {}).get("tag")
        return None if tag is None else self._bound(str(tag))

    def source(self):
        tag = ef.TAG.get()
        return None if tag is None else {"tag": tag}

    def statistics(self):
        return {"tagger_calls": len(self.calls)}


@pytest.fixture(params=["sync-threads", "loop"])
def tagged(request):
    channels = 4 if request.param == "sync-threads" else 0
    opts = RpcOptions(token=None, sync_channels=channels)
    with local_agents(3, options=opts) as agents:
        exts = [a.extension("tagger", lambda a=a: Tagger(a)) for a in agents]
        yield agents, exts


def _call(agent, fn, *args, to="worker1"):
    with as_current(agent):
        token = ef.TAG.set("A")
        try:
            return rpcdist.rpc_sync(to, fn, args=args, timeout=10)
        finally:
            ef.TAG.reset(token)


@pytest.mark.parametrize("fn", [ef.plain, ef.coroutine, ef.batched], ids=lambda f: f.__name__)
def test_every_handler_kind_runs_inside_the_scope_with_the_callers_fields(tagged, fn):
    (a, b, _), exts = tagged
    assert _call(a, fn) == "A"
    (info,) = [c for c in exts[1].calls if c.method.endswith(fn.__name__)]
    assert info.meta == {"tag": "A"} and info.peer.name == "worker0"
    assert info.agent is b and info.deadline is not None


def test_calls_outside_any_source_carry_no_fields(tagged):
    (a, _, _), exts = tagged
    with as_current(a):
        assert rpcdist.rpc_sync("worker1", ef.plain) is None
    assert exts[1].calls[-1].meta is None
    assert a.statistics()["tagger_calls"] == 0 and exts[1].statistics()["tagger_calls"] == 1


def test_nested_calls_carry_what_the_scope_bound(tagged):
    (a, _, _), exts = tagged
    assert _call(a, ef.nested, "worker2") == "A'"  # worker1 tagged its own call "A'"
    assert exts[2].calls[-1].meta == {"tag": "A'"}


def test_rref_owner_calls_run_inside_the_scope(tagged):
    (a, _, _), exts = tagged
    with as_current(a):
        token = ef.TAG.set("R")
        try:
            box = rpcdist.remote("worker1", ef.make_box)
            assert box.rpc_sync().read() == "R"
            assert box.rpc_async().read().wait(10) == "R"
            assert box.remote().read().to_here() == "R"
        finally:
            ef.TAG.reset(token)
    internal = [c for c in exts[1].calls if c.method.startswith("rref.")]
    assert internal and all(c.meta in (None, {"tag": "R"}) for c in internal)
    # control messages of the RRef protocol never carry the fields
    assert all(c.meta is None for c in internal if c.method.startswith("rref.user_delete"))


def test_replies_carry_the_callees_fields(tagged, probe_codec):
    (a, _, _), _ = tagged
    assert isinstance(_call(a, ef.probe), ef.Probe)
    assert ef.SEEN == [{"tag": "A'"}]  # bound by worker1's scope for "A"


@pytest.fixture
def answered_probe() -> Iterator[None]:
    """A Probe decoded as a call's argument asks for a reply field ``test.seen``."""

    def decode(structure, ctx):
        if ctx.reply_meta is not None:  # a call being handled: its reply answers
            ctx.reply_meta.setdefault("test.seen", []).append(ctx.agent.name)
        return ef.Probe()

    register_extension(ef.Probe, PROBE_CODE, lambda obj, ctx: 0, decode)
    yield
    unregister_extension(ef.Probe)


@pytest.mark.parametrize("channels", [4, 0], ids=["sync-threads", "loop"])
def test_reply_fields_reach_the_callers_handler_on_every_reply_path(answered_probe, channels):
    got: list[tuple[str, str, object]] = []
    with local_agents(2, options=RpcOptions(token=None, sync_channels=channels)) as (a, _):
        a.registry.add_reply_field(
            "test.seen", lambda ag, src, v: got.append((ag.name, src.name, v))
        )
        with as_current(a):
            assert isinstance(rpcdist.rpc_sync("worker1", ef.echo, args=(ef.Probe(),)), ef.Probe)
            assert isinstance(
                rpcdist.rpc_async("worker1", ef.echo, args=(ef.Probe(),)).wait(10), ef.Probe
            )
            with pytest.raises(KeyError, match="on purpose"):  # an error reply carries it too
                rpcdist.rpc_sync("worker1", ef.fail, args=(ef.Probe(),))
            assert rpcdist.rpc_sync("worker1", ef.echo, args=(1,)) == 1  # no field: no call
    assert got == [("worker0", "worker1", ["worker1"])] * 3


@pytest.mark.parametrize("channels", [4, 0], ids=["sync-threads", "loop"])
def test_a_none_reply_with_fields_still_runs_them(answered_probe, channels):
    """A ``None`` reply (the codec's constant header, which the caller
    completes without decoding) still hands its fields to their handler."""
    got: list[tuple[str, str, object]] = []
    with local_agents(2, options=RpcOptions(token=None, sync_channels=channels)) as (a, _):
        a.registry.add_reply_field(
            "test.seen", lambda ag, src, v: got.append((ag.name, src.name, v))
        )
        with as_current(a):
            assert rpcdist.rpc_sync("worker1", ef.ignore, args=(ef.Probe(),)) is None
            assert rpcdist.rpc_async("worker1", ef.ignore, args=(ef.Probe(),)).wait(10) is None
            window = [rpcdist.rpc_async("worker1", ef.echo, args=(None,)) for _ in range(64)]
            assert [f.wait(10) for f in window] == [None] * 64  # no fields: no call
    assert got == [("worker0", "worker1", ["worker1"])] * 2


def test_reply_fields_are_registered_once():
    with local_agents(1) as (a,):

        def h(agent, src, value):
            return None

        a.registry.add_reply_field("test.field", h)
        a.registry.add_reply_field("test.field", h)  # the same one again: fine
        with pytest.raises(ConfigError, match="already registered"):
            a.registry.add_reply_field("test.field", lambda *x: None)


def test_internal_methods_are_registered_once():
    with local_agents(1) as (a,):

        async def h(agent, src, payload):
            return payload

        a.registry.add_handler("test.echo", h)
        a.registry.add_handler("test.echo", h)  # the same one again: fine
        with pytest.raises(ConfigError, match="already registered"):
            a.registry.add_handler("test.echo", lambda *x: None)
        assert a.call(0, "test.echo", [1, 2], deadline=None, internal=True).wait(10) == [1, 2]
        with pytest.raises(rpcdist.ProtocolError, match="unknown internal method"):
            a.call(0, "test.nope", 1, deadline=None, internal=True).wait(10)


def test_public_statistics_of_the_current_agent():
    with pytest.raises(rpcdist.NotInitializedError):
        rpcdist.statistics()
    with local_agents(2) as (a, _), as_current(a):
        assert rpcdist.rpc_sync("worker1", ef.plain) is None
        stats = rpcdist.statistics()
        for key in ("pending_calls", "outgoing_streams", "rref_owners", "rref_pending_users"):
            assert stats[key] == 0 or key == "outgoing_streams"
        assert stats["calls_sent"] >= 1
