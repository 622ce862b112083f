"""Where the gRPC transport's small-call latency goes: a grpc.aio stream echo
built up, one step at a time, toward the structure rpcdist's gRPC links have.

Steps (p50 of a 1-byte round trip, fresh server process each):

1. ``floor``: the client writes and reads in turn; the server is an
   async-generator echo (the "grpc.aio stream" of ``bench_rpc.py``).
2. ``server tasks``: the server reads and writes from two tasks, woken by an
   event, as an rpcdist link's reader and writer are.
3. ``client tasks``: the client does the same.
4. ``user thread``: the caller is a user thread that hands each call to the
   event loop and waits for its reply (``rpc_sync`` from user code).
5. ``handler pool``: the server runs each message's handler on a thread pool
   and hands the reply back to the loop (user functions never run on the
   loop).

rpcdist's ``RpcOptions(transport="grpc")`` does all of step 5's work, and
its p50 is close to step 5's. Printed only (no report section): run
``.venv/bin/python benchmarks/grpc_overhead.py [--calls N]``.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import functools
import multiprocessing as mp
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

from _report import median

STEPS = [
    ("floor", "gen", "seq"),
    ("server tasks", "tasks", "seq"),
    ("client tasks", "tasks", "tasks"),
    ("user thread", "tasks", "thread"),
    ("handler pool", "pool", "thread"),
]


async def _pump(write: Callable[[bytes], Awaitable[Any]], out: deque[bytes], wake: Any) -> None:
    """A link's writer task: send what is queued each time it is woken."""
    while True:
        await wake.wait()
        wake.clear()
        while out:
            await write(out.popleft())


def _serve(port_q: Any, mode: str) -> None:
    import grpc

    async def main() -> None:
        pool = concurrent.futures.ThreadPoolExecutor(4)
        loop = asyncio.get_running_loop()

        async def echo(requests: Any, ctx: Any) -> Any:
            async for m in requests:
                yield m

        async def tasks(_requests: Any, ctx: Any) -> None:
            out: deque[bytes] = deque()
            wake = asyncio.Event()

            def reply(m: bytes) -> None:
                out.append(m)
                wake.set()

            w = asyncio.ensure_future(_pump(ctx.write, out, wake))
            while (m := await ctx.read()) is not grpc.aio.EOF:
                if mode == "pool":
                    pool.submit(loop.call_soon_threadsafe, reply, m)
                else:
                    reply(m)
            w.cancel()

        server = grpc.aio.server()
        handler = grpc.stream_stream_rpc_method_handler(echo if mode == "gen" else tasks)
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("b.B", {"S": handler}),)
        )
        port_q.put(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        await server.wait_for_termination()

    asyncio.run(main())


def _client(port: int, mode: str, calls: int) -> list[float]:
    import grpc

    async def main() -> list[float]:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            call = ch.stream_stream("/b.B/S")()
            lat: list[float] = []
            if mode == "seq":
                for _ in range(calls):
                    t = time.perf_counter()
                    await call.write(b"x")
                    await call.read()
                    lat.append(time.perf_counter() - t)
                return lat
            loop = asyncio.get_running_loop()
            out: deque[bytes] = deque()
            waiters: deque[Callable[[], object]] = deque()
            wake = asyncio.Event()

            def send(done: Callable[[], object]) -> None:
                waiters.append(done)
                out.append(b"x")
                wake.set()

            async def reader() -> None:
                while (await call.read()) is not grpc.aio.EOF:
                    waiters.popleft()()

            pumps = [
                asyncio.ensure_future(_pump(call.write, out, wake)),
                asyncio.ensure_future(reader()),
            ]
            if mode == "tasks":
                for _ in range(calls):
                    t = time.perf_counter()
                    fut = loop.create_future()
                    send(functools.partial(fut.set_result, None))
                    await fut
                    lat.append(time.perf_counter() - t)
            else:

                def user() -> None:
                    for _ in range(calls):
                        t = time.perf_counter()
                        done = threading.Event()
                        loop.call_soon_threadsafe(send, done.set)
                        done.wait()
                        lat.append(time.perf_counter() - t)

                await loop.run_in_executor(None, user)
            for p in pumps:
                p.cancel()
            return lat

    return asyncio.run(main())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=3000)
    calls = ap.parse_args().calls
    ctx = mp.get_context("spawn")
    floor = None
    for name, server_mode, client_mode in STEPS:
        q = ctx.Queue()
        proc = ctx.Process(target=_serve, args=(q, server_mode), daemon=True)
        proc.start()
        try:
            lat = _client(q.get(timeout=60), client_mode, calls)
        finally:
            proc.kill()
            proc.join(10)
        p50 = median(lat[calls // 5 :]) * 1e6
        floor = floor or p50
        print(f"{name:14} p50 {p50:7.0f} us   {p50 / floor:4.2f}x the floor", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
