"""RPC core benchmark: rpcdist beside raw grpc.aio and PyTorch RPC, same run.

Two processes on this machine over 127.0.0.1: a caller and a callee.

* ``rpc_sync`` no-op latency (p50/p99 over many calls), and the p50 of an
  ``rpc_sync`` echoing a 256-byte float32 array (a small tensor's path);
* ``rpc_async`` throughput with 64 calls in flight (sliding window);
* array echo: a float32 array sent and returned; one-way GB/s = bytes / (rtt/2);
  and with ``rpc_async``, 4 echoes of 16 MB in flight: GB/s each way.

Baselines: raw grpc.aio unary calls and a bidirectional-stream ping-pong (the
transport floor), and PyTorch RPC over TensorPipe when torch is installed.

Run: ``.venv/bin/python benchmarks/bench_rpc.py [--quick] [--repeats N] [--no-write]``
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import sys
import threading
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _bench_funcs as bf
from _report import free_port, median, percentile, table, time_steps, write_section

SIZES_MB = [1, 16, 64, 256]
WINDOW = 64
#: The rpc_async array echo: this many MB, this many in flight.
ASYNC_MB, ASYNC_WINDOW = 16, 4


# ------------------------------------------------------------------ workloads


def _latency(call: Any, n: int) -> list[float]:
    return time_steps(call, min(200, n), n)


def _throughput(submit: Any, n: int, window: int = WINDOW) -> float:
    """Calls/s with ``window`` in flight; ``submit(cb)`` starts one call."""
    sem = threading.Semaphore(window)
    done = threading.Event()
    left = [n]
    lock = threading.Lock()

    def cb(_: Any) -> None:
        sem.release()
        with lock:
            left[0] -= 1
            if left[0] == 0:
                done.set()

    t = time.perf_counter()
    for _ in range(n):
        sem.acquire()
        submit(cb)
    done.wait()
    return n / (time.perf_counter() - t)


def _echo_gbps(call: Any, nbytes: int, reps: int) -> float:
    x = np.ones(nbytes // 4, dtype=np.float32)
    call(x)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        call(x)
        times.append(time.perf_counter() - t)
    return nbytes / (median(times) / 2) / 1e9


def _echo_async_gbps(submit: Any, nbytes: int, n: int) -> float:
    """GB/s each way of ``n`` array echoes, ``ASYNC_WINDOW`` in flight;
    ``submit(x, cb)`` starts one echo of ``x``."""
    x = np.ones(nbytes // 4, dtype=np.float32)
    return _throughput(lambda cb: submit(x, cb), n, ASYNC_WINDOW) * nbytes / 1e9


def _measure(
    sync_noop: Any, submit_noop: Any, echo: Any, quick: bool, echo_async: Any = None
) -> dict[str, Any]:
    n = 1000 if quick else 3000
    res: dict[str, Any] = {}
    lat = _latency(sync_noop, n)
    res["p50_us"] = median(lat) * 1e6
    res["p99_us"] = percentile(lat, 99) * 1e6
    if submit_noop is None:
        return res
    res["calls_s"] = median([_throughput(submit_noop, n * 3) for _ in range(3)])
    if echo is not None:
        small = np.ones(64, dtype=np.float32)
        res["small_echo_p50_us"] = median(_latency(lambda: echo(small), n)) * 1e6
        for mb in SIZES_MB:
            if quick and mb > 64:
                continue
            res[f"echo_{mb}"] = _echo_gbps(echo, mb << 20, 3 if mb >= 64 else 8)
    if echo_async is not None:
        _echo_async_gbps(echo_async, ASYNC_MB << 20, 4 * ASYNC_WINDOW)  # (segments made, mapped)
        res["async_echo"] = _echo_async_gbps(echo_async, ASYNC_MB << 20, 16 if quick else 32)
    return res


# ---------------------------------------------------------------- rpcdist


def _rpcdist_worker(rank: int, init: str, quick: bool, transport: str, q: Any) -> None:
    import rpcdist

    # "tcp-only": the TCP transport with same-host Unix sockets turned off,
    # which is what two workers on different hosts would use. "tcp-loop": the
    # default, with every rpc_sync going through the agent loop (only the
    # latency is measured: rpc_async takes that path anyway).
    opts = rpcdist.RpcOptions(
        transport=transport.split("-")[0],
        local_sockets=transport != "tcp-only",
        sync_channels=0 if transport == "tcp-loop" else 4,
    )
    rpcdist.init_rpc(f"w{rank}", rank, 2, init_method=init, rpc_timeout=120, options=opts)
    try:
        if rank == 0:
            loop_only = transport == "tcp-loop"
            res = _measure(
                lambda: rpcdist.rpc_sync("w1", bf.noop),
                None
                if loop_only
                else lambda cb: rpcdist.rpc_async("w1", bf.noop).add_done_callback(cb),
                None if loop_only else lambda x: rpcdist.rpc_sync("w1", bf.echo, args=(x,)),
                quick,
                None
                if loop_only
                else lambda x, cb: rpcdist.rpc_async("w1", bf.echo, args=(x,)).add_done_callback(
                    cb
                ),
            )
            q.put(res)
    finally:
        rpcdist.shutdown()


def _echo_worker(rank: int, init: str, shm: bool, sizes: list[int], q: Any) -> None:
    """Array echo over the default TCP transport, /dev/shm segments on or off."""
    import rpcdist

    opts = rpcdist.RpcOptions(shm_threshold_bytes=1 << 20 if shm else None)
    rpcdist.init_rpc(f"w{rank}", rank, 2, init_method=init, rpc_timeout=120, options=opts)
    try:
        if rank == 0:
            echo = lambda x: rpcdist.rpc_sync("w1", bf.echo, args=(x,))  # noqa: E731
            q.put({mb: _echo_gbps(echo, mb << 20, 5 if mb >= 64 else 10) for mb in sizes})
    finally:
        rpcdist.shutdown()


def _memcpy_gbps(nbytes: int, reps: int = 5) -> float:
    src, dst = np.ones(nbytes, np.uint8), np.zeros(nbytes, np.uint8)
    np.copyto(dst, src)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t)
    return nbytes / median(times) / 1e9


def echo_table(rounds: int) -> str:
    """One-way array echo GB/s with and without /dev/shm segments, against memcpy.

    The two settings and NumPy's memcpy alternate round by round
    (``rounds`` each); a cell is the median over rounds (and the best
    round), so load on a shared machine falls on all three alike.
    """
    sizes = [16, 64, 256]
    got: dict[str, list[dict[int, float]]] = {"on": [], "off": [], "memcpy": []}
    for _ in range(rounds):
        for shm in (True, False):
            with __import__("tempfile").TemporaryDirectory() as tmp:
                r = _run_pair(_echo_worker, (f"file://{tmp}/rdv", shm, sizes))
            got["on" if shm else "off"].append(r)
        got["memcpy"].append({mb: _memcpy_gbps(mb << 20) for mb in sizes})
    rows = []
    for mb in sizes:
        on, off, mc = ([r[mb] for r in got[k]] for k in ("on", "off", "memcpy"))
        rows.append(
            [
                mb,
                f"{median(on):.2f} ({max(on):.2f})",
                f"{median(off):.2f} ({max(off):.2f})",
                f"{median(mc):.2f} ({max(mc):.2f})",
                median(on) / median(mc),
            ]
        )
    return table(
        [
            "MB",
            "shm segments GB/s (best)",
            "socket GB/s (best)",
            "NumPy memcpy GB/s (best)",
            "shm / memcpy (medians)",
        ],
        rows,
    )


def _spin(stop: Any) -> None:
    """A busy loop at normal priority (a training process's compute thread)."""
    x = 0
    while not stop.is_set():
        for _ in range(10_000):
            x += 1


def _own_thread(on: bool) -> Any:
    """With ``on``: a pure-Python compute thread in this worker (it holds the
    GIL whenever it runs); returns what stops it."""
    stop = threading.Event()
    if on:
        threading.Thread(target=_spin, args=(stop,), daemon=True).start()
    return stop.set


def _noop_worker(rank: int, init: str, quick: bool, own: bool, q: Any) -> None:
    import rpcdist

    rpcdist.init_rpc(f"w{rank}", rank, 2, init_method=init, rpc_timeout=120)
    stop = _own_thread(own)
    try:
        if rank == 0:
            q.put(
                _measure(
                    lambda: rpcdist.rpc_sync("w1", bf.noop),
                    lambda cb: rpcdist.rpc_async("w1", bf.noop).add_done_callback(cb),
                    None,
                    quick,
                )
            )
    finally:
        stop()
        rpcdist.shutdown()


#: The crowded table's machines: no load, one busy process per core, a
#: compute thread in each of the two workers.
CROWDING = ("quiet", "loops", "own")


def crowded_table(rounds: int, quick: bool, with_torch: bool) -> str:
    """No-op ``rpc_sync`` p50/p99 and ``rpc_async`` rate, quiet, with one
    busy loop per CPU this process may use (``cpu_allowance``: affinity and
    cgroup quota), and with a pure-Python compute thread in each worker (it
    holds the GIL the handlers need), rpcdist and PyTorch RPC alternating."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from rpcdist._cores import cpu_allowance

    cores = cpu_allowance()
    ctx = mp.get_context("spawn")
    got: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for _ in range(rounds):
        for mode, crowding in enumerate(CROWDING):
            busy, own = crowding == "loops", crowding == "own"
            stop = ctx.Event()
            spinners = [ctx.Process(target=_spin, args=(stop,), daemon=True) for _ in range(cores)]
            for sp in spinners if busy else []:
                sp.start()
            try:
                with __import__("tempfile").TemporaryDirectory() as tmp:
                    r = _run_pair(_noop_worker, (f"file://{tmp}/rdv", quick, own))
                got.setdefault(("rpcdist", mode), []).append(r)
                if with_torch:
                    t = _run_pair(_torch_noop_worker, (free_port(), quick, own))
                    got.setdefault(("torch", mode), []).append(t)
            finally:
                stop.set()
                for sp in spinners if busy else []:
                    sp.join(10)
    names = {
        "quiet": "no busy loops",
        "loops": f"{cores} busy loops",
        "own": "a compute thread in each worker",
    }
    rows = []
    for (name, mode), rs in sorted(got.items()):
        rows.append(
            [
                name,
                names[CROWDING[mode]],
                median([r["p50_us"] for r in rs]),
                median([r["p99_us"] for r in rs]),
                " / ".join(f"{r['p99_us']:,.0f}" for r in rs),
                median([r.get("calls_s", float("nan")) for r in rs]),
            ]
        )
    return table(
        ["", "machine", "rpc_sync p50 (µs)", "p99 (µs)", "p99 by round", "rpc_async calls/s"], rows
    )


# -------------------------------------------------------------- raw grpc.aio


def _grpc_server(port_q: Any, stop: Any) -> None:
    import grpc

    async def main() -> None:
        async def unary(req: bytes, ctx: Any) -> bytes:
            return req

        async def stream(it: Any, ctx: Any) -> Any:
            async for m in it:
                yield m

        server = grpc.aio.server(
            options=[("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
        )
        server.add_generic_rpc_handlers(
            (
                grpc.method_handlers_generic_handler(
                    "b.B",
                    {
                        "U": grpc.unary_unary_rpc_method_handler(unary),
                        "S": grpc.stream_stream_rpc_method_handler(stream),
                    },
                ),
            )
        )
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        port_q.put(port)
        await asyncio.get_running_loop().run_in_executor(None, stop.wait)
        await server.stop(0)

    asyncio.run(main())


def _grpc_client(port: int, quick: bool) -> dict[str, Any]:
    import grpc

    n = 1000 if quick else 3000
    res: dict[str, Any] = {}

    async def main() -> None:
        async with grpc.aio.insecure_channel(
            f"127.0.0.1:{port}",
            options=[("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)],
        ) as ch:
            unary = ch.unary_unary("/b.B/U")
            for _ in range(200):
                await unary(b"")
            lat = []
            for _ in range(n):
                t = time.perf_counter()
                await unary(b"")
                lat.append(time.perf_counter() - t)
            res["unary_p50_us"] = median(lat) * 1e6
            sem = asyncio.Semaphore(WINDOW)

            async def one() -> None:
                async with sem:
                    await unary(b"")

            rates = []
            for _ in range(3):
                t = time.perf_counter()
                await asyncio.gather(*(one() for _ in range(n * 3)))
                rates.append(n * 3 / (time.perf_counter() - t))
            res["unary_calls_s"] = median(rates)
            call = ch.stream_stream("/b.B/S")()
            for _ in range(200):
                await call.write(b"x")
                await call.read()
            lat = []
            for _ in range(n):
                t = time.perf_counter()
                await call.write(b"x")
                await call.read()
                lat.append(time.perf_counter() - t)
            res["stream_p50_us"] = median(lat) * 1e6
            await call.done_writing()
            for mb in SIZES_MB:
                if quick and mb > 64:
                    continue
                x = np.ones((mb << 20) // 4, dtype=np.float32)
                data = x.tobytes()
                await unary(data)
                ts = []
                for _ in range(3 if mb >= 64 else 8):
                    t = time.perf_counter()
                    # what a user would do: array -> bytes -> array, both ways
                    got = await unary(x.tobytes())
                    np.frombuffer(got, dtype=np.float32)
                    ts.append(time.perf_counter() - t)
                res[f"echo_{mb}"] = (mb << 20) / (median(ts) / 2) / 1e9

    asyncio.run(main())
    return res


# ---------------------------------------------------------------- PyTorch RPC


def _torch_worker(rank: int, port: int, quick: bool, q: Any) -> None:
    _torch_run(rank, port, quick, q, with_echo=True)


def _torch_noop_worker(rank: int, port: int, quick: bool, own: bool, q: Any) -> None:
    _torch_run(rank, port, quick, q, with_echo=False, own=own)


def _torch_run(
    rank: int, port: int, quick: bool, q: Any, with_echo: bool, own: bool = False
) -> None:
    import torch
    import torch.distributed.rpc as rpc

    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    opts = rpc.TensorPipeRpcBackendOptions(num_worker_threads=16, rpc_timeout=120)
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=2, rpc_backend_options=opts)
    stop = _own_thread(own)
    try:
        if rank == 0:

            def echo(x: np.ndarray) -> Any:
                return rpc.rpc_sync("w1", bf.echo, args=(torch.from_numpy(x),))

            def echo_async(x: np.ndarray, cb: Any) -> None:
                rpc.rpc_async("w1", bf.echo, args=(torch.from_numpy(x),)).add_done_callback(cb)

            res = _measure(
                lambda: rpc.rpc_sync("w1", bf.noop),
                lambda cb: rpc.rpc_async("w1", bf.noop).add_done_callback(cb),
                echo if with_echo else None,
                quick,
                echo_async if with_echo else None,
            )
            q.put(res)
    finally:
        stop()
        rpc.shutdown()


def _run_pair(target: Any, args: tuple[Any, ...], timeout: float = 600) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, *args, q), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    end = time.monotonic() + timeout
    try:
        while True:
            try:
                return q.get(timeout=1.0)  # type: ignore[no-any-return]
            except Exception:
                if time.monotonic() > end or any(p.exitcode not in (None, 0) for p in procs):
                    raise RuntimeError(
                        f"benchmark workers failed: {[p.exitcode for p in procs]}"
                    ) from None
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer calls, no 256 MB")
    ap.add_argument("--repeats", type=int, default=3, help="independent runs; medians reported")
    ap.add_argument("--no-write", action="store_true", help="print, do not touch docs/")
    ap.add_argument("--echo-only", action="store_true", help="only the large-array table; print")
    ap.add_argument(
        "--crowded",
        action="store_true",
        help="only quiet, busy loops per core, and a compute thread per worker; print",
    )
    a = ap.parse_args()
    if a.echo_only:
        print(echo_table(a.repeats))
        return
    with_torch = True
    try:
        import torch  # noqa: F401
    except ImportError:
        with_torch = False
    if a.crowded:
        print(crowded_table(a.repeats, a.quick, with_torch))
        return

    runs: dict[str, list[dict[str, Any]]] = {
        "rpcdist": [],
        "rpcdist_loop": [],
        "rpcdist_tcp": [],
        "rpcdist_grpc": [],
        "grpc": [],
        "torch": [],
    }
    for i in range(a.repeats):
        for name, transport in (
            ("rpcdist", "tcp"),
            ("rpcdist_loop", "tcp-loop"),
            ("rpcdist_tcp", "tcp-only"),
            ("rpcdist_grpc", "grpc"),
        ):
            with __import__("tempfile").TemporaryDirectory() as tmp:
                init = f"file://{tmp}/rdv"
                runs[name].append(_run_pair(_rpcdist_worker, (init, a.quick, transport)))
        ctx = mp.get_context("spawn")
        port_q, stop = ctx.Queue(), ctx.Event()
        srv = ctx.Process(target=_grpc_server, args=(port_q, stop), daemon=True)
        srv.start()
        try:
            runs["grpc"].append(_grpc_client(port_q.get(timeout=60), a.quick))
        finally:
            stop.set()
            srv.join(10)
        if with_torch:
            try:
                runs["torch"].append(_run_pair(_torch_worker, (free_port(), a.quick)))
            except Exception as e:  # report, don't fail the whole benchmark
                print(f"PyTorch RPC run {i} failed: {e}", file=sys.stderr)
        print(f"run {i + 1}/{a.repeats} done", file=sys.stderr)

    def m(name: str, key: str) -> float:
        vals = [r[key] for r in runs[name] if key in r]
        return median(vals) if vals else float("nan")

    rows = []
    r_p50, t_p50, s_p50 = m("rpcdist", "p50_us"), m("torch", "p50_us"), m("grpc", "stream_p50_us")
    rows.append(
        [
            "rpc_sync no-op p50 (µs)",
            r_p50,
            m("rpcdist_loop", "p50_us"),
            m("rpcdist_tcp", "p50_us"),
            m("rpcdist_grpc", "p50_us"),
            t_p50,
            m("grpc", "unary_p50_us"),
            s_p50,
            r_p50 / t_p50,
            r_p50 / s_p50,
        ]
    )
    rows.append(
        [
            "rpc_sync no-op p99 (µs)",
            m("rpcdist", "p99_us"),
            m("rpcdist_loop", "p99_us"),
            m("rpcdist_tcp", "p99_us"),
            m("rpcdist_grpc", "p99_us"),
            m("torch", "p99_us"),
            float("nan"),
            float("nan"),
            m("rpcdist", "p99_us") / m("torch", "p99_us"),
            float("nan"),
        ]
    )
    r_s, t_s = m("rpcdist", "small_echo_p50_us"), m("torch", "small_echo_p50_us")
    rows.append(
        [
            "rpc_sync 256-byte array echo p50 (µs)",
            r_s,
            float("nan"),
            m("rpcdist_tcp", "small_echo_p50_us"),
            m("rpcdist_grpc", "small_echo_p50_us"),
            t_s,
            float("nan"),
            float("nan"),
            r_s / t_s,
            float("nan"),
        ]
    )
    r_c, t_c, g_c = m("rpcdist", "calls_s"), m("torch", "calls_s"), m("grpc", "unary_calls_s")
    rows.append(
        [
            f"rpc_async calls/s ({WINDOW} in flight)",
            r_c,
            float("nan"),
            m("rpcdist_tcp", "calls_s"),
            m("rpcdist_grpc", "calls_s"),
            t_c,
            g_c,
            float("nan"),
            r_c / t_c,
            r_c / g_c,
        ]
    )
    for mb in SIZES_MB:
        k = f"echo_{mb}"
        rv, tv, gv = m("rpcdist", k), m("torch", k), m("grpc", k)
        rows.append(
            [
                f"array echo {mb} MB, one-way GB/s",
                rv,
                float("nan"),
                m("rpcdist_tcp", k),
                m("rpcdist_grpc", k),
                tv,
                gv,
                float("nan"),
                rv / tv,
                rv / gv,
            ]
        )
    k = "async_echo"
    rows.append(
        [
            f"rpc_async {ASYNC_MB} MB array echo ({ASYNC_WINDOW} in flight), GB/s each way",
            m("rpcdist", k),
            float("nan"),
            m("rpcdist_tcp", k),
            m("rpcdist_grpc", k),
            m("torch", k),
            float("nan"),
            float("nan"),
            m("rpcdist", k) / m("torch", k),
            float("nan"),
        ]
    )
    body = table(
        [
            "metric",
            "rpcdist",
            "rpcdist, rpc_sync via the loop",
            "rpcdist, TCP only",
            "rpcdist, gRPC transport",
            "PyTorch RPC",
            "grpc.aio unary",
            "grpc.aio stream",
            "rpcdist / PyTorch",
            "rpcdist / grpc",
        ],
        rows,
    )
    body += (
        f"\n\nMedians of {a.repeats} independent runs, each a fresh pair of processes. "
        "`rpcdist` is the default: plain sockets, which between two workers on one "
        "host are Unix sockets, and an `rpc_sync` with nothing else in flight drives a "
        "connection of its own from the calling thread; `rpc_sync via the loop` turns "
        "that off (`RpcOptions(sync_channels=0)`; only latency differs); `TCP only` "
        "turns the Unix sockets off "
        "(`RpcOptions(local_sockets=False)`: loopback TCP, the path between hosts); "
        "`gRPC transport` is `RpcOptions(transport='grpc')` (used with TLS). All in the "
        "same run; ratios are for the default. "
        "The 256-byte echo sends and returns a small float32 array (a torch tensor "
        "for PyTorch RPC), where each message's own costs dominate. "
        f"The rpc_async echo keeps {ASYNC_WINDOW} echoes of a {ASYNC_MB} MB array in flight "
        "(the calling thread copies each into its segment; replies come back on the loop). "
        "Latency ratios below 1 and throughput ratios above 1 favour rpcdist. "
        "The last column compares with the grpc.aio stream ping-pong for latency and with "
        "grpc.aio unary calls otherwise. Goals: p50 ≤ 0.9× PyTorch and ≤ 1.2× the stream "
        "ping-pong; calls/s ≥ 2× PyTorch; echo at 64/256 MB ≥ 1× PyTorch."
    )
    if a.no_write:
        print(body)
        return
    write_section("rpc", "RPC core: latency, throughput, array echo", body)


if __name__ == "__main__":
    main()
