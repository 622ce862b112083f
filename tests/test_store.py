"""The rendezvous key-value store over loopback gRPC."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import grpc
import grpc.aio
import pytest

from rpcdist._errors import (
    ClosedError,
    ConfigError,
    ConnectError,
    RpcTimeoutError,
    WorkerLostError,
)
from rpcdist._proto import store_pb2 as pb
from rpcdist._store import TOKEN_METADATA_KEY, StoreClient, StoreServer, format_address

pytestmark = pytest.mark.timeout(30)


def run(test: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(test(), 20))  # type: ignore[arg-type]


@contextlib.asynccontextmanager
async def serving(token: str | None = None) -> AsyncIterator[tuple[StoreServer, str]]:
    server = StoreServer(token=token)
    port = await server.start("127.0.0.1", 0)
    try:
        yield server, f"127.0.0.1:{port}"
    finally:
        await server.stop(0)


@contextlib.asynccontextmanager
async def client(
    address: str, token: str | None = None, timeout: float = 10.0
) -> AsyncIterator[StoreClient]:
    store = StoreClient(address, token=token, timeout=timeout)
    try:
        await store.connect()
        yield store
    finally:
        await store.close()
    assert store.statistics() == {"pending": 0}


async def waiting(server: StoreServer, count: int) -> None:
    """Until exactly ``count`` calls wait on the server."""
    await server._wait_statistics(lambda stats: stats["waiters"] == count)


def free_port() -> int:
    """A port nobody listens on (bound once by the OS, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_set_get_overwrite_and_large_value() -> None:
    async def main() -> None:
        async with serving() as (server, address), client(address) as store:
            await store.set("a", b"1")
            assert await store.get("a") == b"1"
            await store.set("a", b"")
            assert await store.get("a") == b""
            big = bytes(range(256)) * (32 * 1024)  # 8 MiB, past gRPC's 4 MiB default
            await store.set("big", big)
            assert await store.get("big") == big
            assert server.statistics() == {"keys": 2, "waiters": 0}

    run(main)


def test_get_waits_on_the_server_until_a_later_set() -> None:
    async def main() -> None:
        async with serving() as (server, address), client(address) as a, client(address) as b:
            reader = asyncio.create_task(a.get("late"))
            await waiting(server, 1)
            assert not reader.done()
            await b.set("late", b"value")
            assert await reader == b"value"
            assert server.statistics()["waiters"] == 0

    run(main)


def test_wait_returns_once_every_key_is_set() -> None:
    async def main() -> None:
        async with serving() as (server, address), client(address) as store:
            await store.wait([])
            waiter = asyncio.create_task(store.wait(["x", "y"]))
            await waiting(server, 1)
            await store.set("x", b"1")
            await waiting(server, 1)  # now on "y"
            assert not waiter.done()
            await store.set("y", b"2")
            await waiter
            await store.wait(["x", "y"], timeout=5)
            assert server.statistics()["waiters"] == 0

    run(main)


def test_add_is_atomic_under_50_concurrent_adders() -> None:
    async def main() -> None:
        async with serving() as (_, address), contextlib.AsyncExitStack() as stack:
            stores = [await stack.enter_async_context(client(address)) for _ in range(5)]
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(stores[i % 5].add("n", 1)) for i in range(50)]
            assert sorted(task.result() for task in tasks) == list(range(1, 51))
            assert await stores[0].add("n", -8) == 42
            assert await stores[0].get("n") == b"42"
            assert await stores[0].add("fresh", 0) == 0

    run(main)


def test_add_rejects_a_non_counter_and_overflow() -> None:
    async def main() -> None:
        async with serving() as (_, address), client(address) as store:
            await store.set("text", b"hello")
            with pytest.raises(ConfigError, match=r"'text'.*not an integer"):
                await store.add("text", 1)
            await store.add("big", 2**63 - 1)
            with pytest.raises(ConfigError, match="overflow"):
                await store.add("big", 1)
            assert await store.add("big", 0) == 2**63 - 1
            with pytest.raises(ConfigError, match="amount"):
                await store.add("n", True)
            with pytest.raises(ConfigError, match="amount"):
                await store.add("n", 2**63)

    run(main)


def test_compare_set_semantics() -> None:
    async def main() -> None:
        async with serving() as (server, address), client(address) as store:
            assert await store.compare_set("k", b"x", b"y") == b""  # absent, expected set
            assert server.statistics()["keys"] == 0
            reader = asyncio.create_task(store.get("k"))
            await waiting(server, 1)
            assert await store.compare_set("k", b"", b"first") == b"first"  # absent: swap
            assert await reader == b"first"
            assert await store.compare_set("k", b"", b"other") == b"first"  # present: no swap
            assert await store.compare_set("k", b"nope", b"other") == b"first"
            assert await store.compare_set("k", b"first", b"second") == b"second"
            assert await store.get("k") == b"second"

    run(main)


def test_delete() -> None:
    async def main() -> None:
        async with serving() as (server, address), client(address) as store:
            await store.set("k", b"v")
            assert await store.delete("k") is True
            assert await store.delete("k") is False
            assert server.statistics()["keys"] == 0
            with pytest.raises(RpcTimeoutError):
                await store.get("k", timeout=0.05)

    run(main)


def test_barrier_across_clients_and_reuse_by_name() -> None:
    async def main() -> None:
        async with serving() as (server, address), contextlib.AsyncExitStack() as stack:
            stores = [await stack.enter_async_context(client(address)) for _ in range(4)]
            for name in ("init", "step-1", "step-2"):
                async with asyncio.TaskGroup() as group:
                    for store in stores:
                        group.create_task(store.barrier(name, 4, timeout=10))
            assert server.statistics()["waiters"] == 0
            with pytest.raises(ConfigError, match="single-use"):
                await stores[0].barrier("init", 4)

    run(main)


def test_barrier_timeout_says_who_arrived() -> None:
    async def main() -> None:
        async with serving() as (server, address), client(address) as store:
            with pytest.raises(RpcTimeoutError, match=r"'lonely'.*1 of 2"):
                await store.barrier("lonely", 2, timeout=0.1)
            async with asyncio.timeout(10):
                await waiting(server, 0)

    run(main)


def test_get_timeout_names_the_key_and_frees_the_waiter() -> None:
    async def main() -> None:
        async with serving() as (server, address), client(address) as store:
            with pytest.raises(RpcTimeoutError, match=r"get\('missing'\)") as info:
                await store.get("missing", timeout=0.1)
            assert isinstance(info.value, TimeoutError)
            assert address in str(info.value)
            assert isinstance(info.value.__cause__, grpc.aio.AioRpcError)
            with pytest.raises(RpcTimeoutError, match="missing"):
                await store.wait(["missing"], timeout=0.1)
            async with asyncio.timeout(10):
                await waiting(server, 0)

    run(main)


def test_cancelled_get_propagates_and_frees_the_waiter() -> None:
    async def main() -> None:
        async with serving() as (server, address), client(address) as store:
            reader = asyncio.create_task(store.get("never"))
            await waiting(server, 1)
            reader.cancel()
            with pytest.raises(asyncio.CancelledError):
                await reader
            async with asyncio.timeout(10):
                await waiting(server, 0)
            await store.set("still", b"usable")
            assert await store.get("still") == b"usable"

    run(main)


def test_wrong_token_is_rejected_and_changes_nothing() -> None:
    async def main() -> None:
        async with serving(token="s3cret") as (server, address):
            for token in ("wrong", None):
                store = StoreClient(address, token=token, timeout=5)
                with pytest.raises(ConnectError, match="token") as info:
                    await store.connect()
                assert address in str(info.value)
                with pytest.raises(ConnectError, match="token"):
                    await store.set("k", b"v")
                await store.close()
            # Past the client's connect check: the server refuses each call itself.
            async with grpc.aio.insecure_channel(address) as channel:
                set_ = channel.unary_unary(
                    "/rpcdist.v1.Store/Set",
                    request_serializer=pb.SetRequest.SerializeToString,
                    response_deserializer=pb.SetResponse.FromString,
                )
                for metadata in (((TOKEN_METADATA_KEY, "wrong"),), None):
                    with pytest.raises(grpc.aio.AioRpcError) as raw:
                        await set_(pb.SetRequest(key="k", value=b"v"), metadata=metadata)
                    assert raw.value.code() is grpc.StatusCode.UNAUTHENTICATED
            assert server.statistics() == {"keys": 0, "waiters": 0}
            async with client(address, token="s3cret") as store:
                await store.set("k", b"v")
                assert await store.get("k") == b"v"

    run(main)


def test_no_token_on_either_side_is_accepted() -> None:
    async def main() -> None:
        async with serving(token=None) as (_, address), client(address, token=None) as store:
            await store.set("k", b"v")
            assert await store.get("k") == b"v"

    run(main)


def test_connect_to_a_closed_port_fails_within_the_timeout() -> None:
    async def main() -> None:
        address = f"127.0.0.1:{free_port()}"
        store = StoreClient(address, token=None, timeout=0.5)
        async with asyncio.timeout(10):
            with pytest.raises(ConnectError, match="UNAVAILABLE") as info:
                await store.connect()
        assert address in str(info.value)
        assert isinstance(info.value.__cause__, grpc.aio.AioRpcError)
        await store.close()

    run(main)


def test_server_stop_wakes_a_waiting_get_with_an_error() -> None:
    async def main() -> None:
        async with serving() as (server, address), client(address) as store:
            reader = asyncio.create_task(store.get("never"))
            await waiting(server, 1)
            await server.stop(0.5)
            with pytest.raises(WorkerLostError, match="never"):
                await reader
            assert server.statistics()["waiters"] == 0
            with pytest.raises(WorkerLostError):
                await store.get("never", timeout=5)

    run(main)


def test_close_ends_calls_in_flight_with_closed_error() -> None:
    async def main() -> None:
        async with serving() as (server, address):
            store = StoreClient(address, token=None)
            await store.connect()
            reader = asyncio.create_task(store.get("never"))
            await waiting(server, 1)
            await store.close()
            with pytest.raises(ClosedError, match="never"):
                await reader
            with pytest.raises(ClosedError):
                await store.set("k", b"v")
            with pytest.raises(ClosedError):
                await store.connect()
            assert store.statistics() == {"pending": 0}

    run(main)


def test_two_servers_cannot_share_a_port() -> None:
    async def main() -> None:
        async with serving() as (_, address):
            port = int(address.rsplit(":", 1)[1])
            other = StoreServer(token=None)
            with pytest.raises(ConnectError, match=f"127.0.0.1:{port}.*in use"):
                await other.start("127.0.0.1", port)
            await other.stop()

    run(main)


def test_bad_arguments_raise_config_error() -> None:
    async def main() -> None:
        async with serving() as (_, address), client(address) as store:
            with pytest.raises(ConfigError, match="non-empty"):
                await store.set("", b"v")
            with pytest.raises(ConfigError, match="bytes"):
                await store.set("k", "text")  # type: ignore[arg-type]
            with pytest.raises(ConfigError, match="timeout"):
                await store.get("k", timeout=-1)
            with pytest.raises(ConfigError, match="world_size"):
                await store.barrier("b", 0)

    run(main)


def test_format_address() -> None:
    assert format_address("127.0.0.1", 5) == "127.0.0.1:5"
    assert format_address("::1", 5) == "[::1]:5"
    assert format_address("[::1]", 5) == "[::1]:5"


def test_connect_to_a_grpc_server_that_is_not_a_store() -> None:
    async def main() -> None:
        other = grpc.aio.server()
        port = other.add_insecure_port("127.0.0.1:0")
        await other.start()
        store = StoreClient(f"127.0.0.1:{port}", token=None, timeout=5)
        try:
            with pytest.raises(ConnectError, match=r"UNIMPLEMENTED.*rpcdist store"):
                await store.connect()
        finally:
            await store.close()
            await other.stop(0)

    run(main)


_SERVE_SCRIPT = """
import asyncio, sys
from rpcdist._store import StoreServer

async def main():
    server = StoreServer(token=None)
    print(await server.start(), flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


@pytest.mark.multiprocess
def test_killed_server_process_ends_a_waiting_get() -> None:
    root = Path(__file__).resolve().parents[1]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
    }
    process = subprocess.Popen(
        [sys.executable, "-c", _SERVE_SCRIPT], cwd=root, env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        assert line, "the server process exited before printing its port"
        port = int(line)

        async def main() -> None:
            async with client(f"127.0.0.1:{port}") as store:
                await store.set("k", b"v")
                reader = asyncio.create_task(store.get("never"))
                assert await store.get("k") == b"v"  # the server is up and serving
                process.kill()
                with pytest.raises(WorkerLostError, match="never"):
                    await reader

        run(main)
    finally:
        process.kill()
        process.wait(10)
        if process.stdout is not None:
            process.stdout.close()
