"""The same behaviour on every transport, and fault injection on every sending path.

Each test takes the transport as a fixture parameter: plain sockets (TCP
and same-host Unix sockets, with and without thread-driven blocking calls),
gRPC streams and the in-memory transport.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
import rpc_funcs as rf

import rpcdist
from rpcdist import RpcOptions, RpcTimeoutError, TransportError, WorkerLostError
from rpcdist.testing import FaultInjector, as_current, local_agents

TRANSPORTS = {
    "tcp": RpcOptions(token="t", transport="tcp", local_sockets=False, sync_channels=0),
    "unix": RpcOptions(token="t", transport="tcp", local_sockets=True),
    "grpc": RpcOptions(token="t", transport="grpc"),
    "inproc": RpcOptions(token="t", transport="inproc"),
}


@pytest.fixture(params=sorted(TRANSPORTS))
def transport(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _opts(transport: str, **kw: object) -> RpcOptions:
    import dataclasses

    return dataclasses.replace(TRANSPORTS[transport], **kw)  # type: ignore[arg-type]


def test_calls_errors_and_large_arrays(transport):
    with local_agents(2, options=_opts(transport)) as (a, b):
        assert a.links.transport.name == ("tcp" if transport == "unix" else transport)
        with as_current(a):
            assert rpcdist.rpc_sync("worker1", rf.add, args=(2, 3)) == 5
            assert rpcdist.rpc_async("worker1", rf.add, args=(4, 5)).wait(10) == 9
            big = np.arange(1_500_000, dtype=np.float64)  # 12 MB, several chunks
            assert np.array_equal(rpcdist.rpc_sync("worker1", rf.echo, args=(big,)), big)
            with pytest.raises(rf.CustomError, match="custom failure"):
                rpcdist.rpc_sync("worker1", rf.raise_custom)

            async def many() -> list[int]:
                futs = [rpcdist.rpc_async("worker1", rf.add, args=(i, i)) for i in range(50)]
                return list(await asyncio.gather(*futs))

            assert asyncio.run(many()) == [2 * i for i in range(50)]
        with as_current(b):  # and the other way, on the link b opens
            assert rpcdist.rpc_sync("worker0", rf.echo, args=("back",)) == "back"
        assert a.statistics()["pending_calls"] == 0


def test_a_lost_peer_fails_pending_calls_with_worker_lost(transport):
    rf.release.clear()
    try:
        with local_agents(2, options=_opts(transport)) as (a, b):
            with as_current(a):
                assert rpcdist.rpc_sync("worker1", rf.no_args) == "ok"
                fut = rpcdist.rpc_async("worker1", rf.held, args=("late",), timeout=None)
                while b.statistics()["inflight_handlers"] == 0:
                    time.sleep(0.01)
                b.shutdown(graceful=False)
                with pytest.raises((WorkerLostError, rpcdist.ConnectError)):
                    fut.wait(20)
    finally:
        rf.release.set()  # the handler still running on worker1's pool thread


@pytest.mark.parametrize("path", ["loop", "thread", "blocking"])
def test_faults_apply_on_every_sending_path(transport, path):
    """Drop, delay and fail a call whether the loop, the calling thread
    (``rpc_async`` on an idle link) or a thread-driven blocking call sends it."""
    if path == "blocking" and transport != "unix":
        pytest.skip("thread-driven blocking calls are a plain-socket path")
    faults = FaultInjector()
    with local_agents(2, options=_opts(transport, faults=faults)) as (a, _):

        def call(timeout: float) -> object:
            with as_current(a):
                if path == "blocking":
                    return rpcdist.rpc_sync("worker1", rf.add, args=(1, 2), timeout=timeout)
                if path == "loop":  # something in flight: the loop sends it
                    slow = rpcdist.rpc_async("worker1", rf.sleep_then, args=(0.5, 0))
                    got = rpcdist.rpc_async("worker1", rf.add, args=(1, 2), timeout=timeout)
                    slow.wait(10)
                    return got.wait(10)
                return rpcdist.rpc_async("worker1", rf.add, args=(1, 2), timeout=timeout).wait(10)

        assert call(10) == 3
        kind = "rpc_funcs:add"
        faults.add(kind, "drop")
        with pytest.raises(RpcTimeoutError):
            call(0.5)
        faults.clear()
        faults.add(kind, "fail")
        with pytest.raises(TransportError, match="injected"):
            call(5)
        faults.clear()
        faults.add(kind, "delay", delay=0.3)
        started = time.monotonic()
        assert call(10) == 3
        assert time.monotonic() - started >= 0.25  # held back (timers may fire a little early)
        assert [k for k, _ in faults.log] == [kind] * 3
        if path == "blocking":
            assert a.sync.calls >= 1  # it really took the thread-driven path


def test_faults_apply_to_replies_sent_by_the_handler_thread(transport):
    faults = FaultInjector()
    faults.add("reply:rpc_funcs:add", "drop")
    with local_agents(2, options=[_opts(transport), _opts(transport, faults=faults)]) as (a, _):
        with as_current(a), pytest.raises(RpcTimeoutError):
            rpcdist.rpc_sync("worker1", rf.add, args=(1, 2), timeout=0.5)
        assert faults.log == [("reply:rpc_funcs:add", "drop")]
        with as_current(a):  # the next reply goes through
            assert rpcdist.rpc_sync("worker1", rf.add, args=(2, 2), timeout=10) == 4
