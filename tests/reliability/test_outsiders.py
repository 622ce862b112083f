"""Processes outside the job, as users run them: plain ``init_rpc`` in separate
processes, another user of the machine (``nobody``), stray calls to the
rendezvous port while a job starts.

A job without a token keeps its secret in a file only its user can read; the
store never hands it out and refuses every call without it. A refused caller
fails alone: the ranks let in keep waiting, and a timed-out rendezvous says
how many calls were refused and from where.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Iterator

import pytest

import rpcdist
from rpcdist._store._client import StoreClient
from rpcdist._store._private import private_secret_path
from rpcdist._store._rendezvous import RendezvousSpec

pytestmark = pytest.mark.multiprocess

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
TIMEOUT = 60.0

#: One rank of a 2-rank job, as a user writes it: plain init_rpc, then rank 0
#: calls rank 1. argv: tcp port (or "env" for env://, RANK from the
#: environment as the launcher sets it), init timeout, rank (tcp only).
#: With GO_FILE set, rank 1 waits for that file before it starts.
WORKER = textwrap.dedent(
    """
    import os, sys, time
    import rpcdist
    import rel_funcs

    where, limit = sys.argv[1], float(sys.argv[2])
    rank = int(os.environ["RANK"] if where == "env" else sys.argv[3])
    if rank == 1 and os.environ.get("GO_FILE"):
        deadline = time.monotonic() + 60
        while not os.path.exists(os.environ["GO_FILE"]) and time.monotonic() < deadline:
            time.sleep(0.02)
    opts = rpcdist.RpcOptions(init_timeout=limit)
    try:
        if where == "env":  # as the launcher starts it: RANK, WORLD_SIZE, MASTER_*
            rpcdist.init_rpc(f"worker{rank}", options=opts)
        else:
            init = f"tcp://127.0.0.1:{where}"
            rpcdist.init_rpc(f"worker{rank}", rank=rank, world_size=2, init_method=init,
                             options=opts)
    except rpcdist.RpcdistError as e:
        print("ERROR", type(e).__name__, e, flush=True)
        sys.exit(3)
    if rank == 0:
        print("SUM", rpcdist.rpc_sync("worker1", rel_funcs.add, args=(20, 22)), flush=True)
    rpcdist.shutdown()
    """
)

#: Run as user nobody: try to read the job's secret, to use its store, to join it.
OUTSIDER = textwrap.dedent(
    """
    import json, sys
    sys.path[:0] = json.loads(sys.argv[3])
    import asyncio
    import rpcdist
    from rpcdist._store._client import StoreClient

    port, secret_file = sys.argv[1], sys.argv[2]
    out = {}
    try:
        with open(secret_file) as f:
            out["file"] = "read: " + f.read()
    except OSError as e:
        out["file"] = type(e).__name__

    async def raw_store():
        store = StoreClient(f"127.0.0.1:{port}", token=None, timeout=5)
        try:
            for key in ("rpc/secret", "rpc/worker/0"):
                try:
                    out[key] = "got: " + repr(await store.get(key, 2))
                except rpcdist.RpcdistError as e:
                    out[key] = f"{type(e).__name__}: {e}"
        finally:
            await store.close()

    asyncio.run(raw_store())
    try:
        rpcdist.init_rpc("worker1", rank=1, world_size=2,
                         init_method=f"tcp://127.0.0.1:{port}",
                         options=rpcdist.RpcOptions(init_timeout=3))
        out["join"] = "joined"
    except rpcdist.RpcdistError as e:
        out["join"] = f"{type(e).__name__}: {e}"
    print(json.dumps(out), flush=True)
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RPCDIST_", "MASTER_"))}
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    env["PYTHONPATH"] = os.pathsep.join([HERE, ROOT])
    env.update(extra)
    return env


class _Procs:
    """Processes started by a test; every one is killed and reaped at the end."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[str]] = []

    def start(self, argv: list[str], env: dict[str, str], **kw: object) -> subprocess.Popen[str]:
        proc = subprocess.Popen(  # type: ignore[call-overload]
            argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw
        )
        self.procs.append(proc)
        return proc

    def rank(self, rank: int, where: str, limit: float = 30.0, **env: str) -> subprocess.Popen[str]:
        argv = [sys.executable, "-c", WORKER, where, str(limit), str(rank)]
        return self.start(argv, _env(**env))


@contextlib.contextmanager
def _processes() -> Iterator[_Procs]:
    procs = _Procs()
    try:
        yield procs
    finally:
        for proc in procs.procs:
            if proc.poll() is None:
                proc.kill()
            proc.communicate(timeout=10)


def _finish(proc: subprocess.Popen[str]) -> tuple[int, str]:
    out, _ = proc.communicate(timeout=TIMEOUT)
    return proc.returncode, out


def _wait_for(
    condition: Callable[[], bool], what: str, proc: subprocess.Popen[str] | None = None
) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not condition():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"rank ended while waiting for {what}: {_finish(proc)}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def _secret_file(port: int) -> str:
    return private_secret_path(RendezvousSpec("tcp", "127.0.0.1", port, 0, 2, None))


def _stray_call(address: str, token: str | None) -> str:
    """One call to the store at ``address`` with ``token``; what it was told."""

    async def call() -> str:
        store = StoreClient(address, token=token, timeout=5)
        try:
            return "got: " + repr(await store.get("rpc/worker/0", 2))
        except rpcdist.RpcdistError as e:
            return f"{type(e).__name__}: {e}"
        finally:
            await store.close()

    import asyncio

    return asyncio.run(call())


def _system_python() -> str | None:
    """A Python user nobody may run, of this interpreter's version (the venv's
    compiled modules must load in it), or ``None``."""
    candidate = f"/usr/bin/python{sys.version_info[0]}.{sys.version_info[1]}"
    return candidate if os.access(candidate, os.X_OK) else None


def _nobody_imports(python: str, paths: list[str]) -> bool:
    """Whether user nobody can import rpcdist and its dependencies from ``paths``."""
    probe = f"import sys; sys.path[:0] = {paths!r}; import rpcdist, grpc, msgpack, rel_funcs"
    env = {"PATH": "/usr/bin:/bin", "HOME": "/tmp"}
    done = subprocess.run(
        [python, "-c", probe], env=env, user="nobody", cwd="/", capture_output=True, timeout=60
    )
    return done.returncode == 0


@contextlib.contextmanager
def _paths_for_nobody(python: str) -> Iterator[list[str]]:
    """``sys.path`` entries from which user nobody imports this checkout: the
    checkout itself, else a world-readable copy of rpcdist and the test helpers
    (a checkout under a private home directory)."""
    site = [p for p in sys.path if p.endswith("site-packages")]
    if _nobody_imports(python, [HERE, ROOT, *site]):
        yield [HERE, ROOT, *site]
        return
    copy = tempfile.mkdtemp(prefix="rpcdist-outsider-")
    try:
        shutil.copytree(os.path.join(ROOT, "rpcdist"), os.path.join(copy, "rpcdist"))
        shutil.copy(os.path.join(HERE, "rel_funcs.py"), copy)
        for where, dirs, files in os.walk(copy):
            for name in [where, *(os.path.join(where, n) for n in dirs + files)]:
                os.chmod(name, 0o755 if os.path.isdir(name) else 0o644)
        if not _nobody_imports(python, [copy, *site]):
            pytest.skip(f"user nobody cannot import the venv's packages from {site}")
        yield [copy, *site]
    finally:
        shutil.rmtree(copy, ignore_errors=True)


def test_another_user_can_neither_read_the_secret_nor_use_the_store_nor_join():
    if os.geteuid() != 0:
        pytest.skip("needs root, to run a process as another user (nobody)")
    try:
        import pwd

        pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("there is no user nobody to play the other user")
    python = _system_python()
    if python is None:
        pytest.skip(f"no system python{sys.version_info[0]}.{sys.version_info[1]} for nobody")
    port = _free_port()
    path = _secret_file(port)
    with _paths_for_nobody(python) as paths, _processes() as procs:
        rank0 = procs.rank(0, str(port), limit=TIMEOUT)
        _wait_for(lambda: os.path.exists(path), "rank 0's secret file", rank0)
        mode = os.stat(path).st_mode
        assert stat.S_IMODE(mode) == 0o600, oct(mode)
        assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
        nobody = procs.start(
            [python, "-c", OUTSIDER, str(port), path, json.dumps(paths)],
            {"PATH": "/usr/bin:/bin", "HOME": "/tmp"},
            user="nobody",
            cwd="/tmp",
        )
        code, out = _finish(nobody)
        assert code == 0, out
        got = json.loads(out.strip().splitlines()[-1])
        assert got["file"] == "PermissionError", got
        for key in ("rpc/secret", "rpc/worker/0"):  # the store hands out nothing
            assert got[key].startswith("ConnectError:") and "token" in got[key], got
        assert got["join"].startswith("ConnectError:"), got
        assert "reached no store of its job" in got["join"], got
        # The job is unharmed: rank 0 still waits, the real rank 1 joins.
        assert rank0.poll() is None, _finish(rank0)
        rank1 = procs.rank(1, str(port))
        assert _finish(rank1)[0] == 0
        code, out = _finish(rank0)
        assert code == 0 and "SUM 42" in out, out
    assert not os.path.exists(path), "rank 0 left its secret file behind"


def test_a_job_without_a_token_forms_with_no_configuration_for_its_user():
    port = _free_port()
    with _processes() as procs:
        rank1 = procs.rank(1, str(port))  # first: it waits for rank 0's secret file
        rank0 = procs.rank(0, str(port))
        code, out = _finish(rank0)
        assert code == 0 and "SUM 42" in out, out
        assert _finish(rank1)[0] == 0
    assert not os.path.exists(_secret_file(port))


@pytest.mark.parametrize("token", [None, "job-token"], ids=["no-token", "launcher-token"])
def test_stray_store_calls_during_rendezvous_do_not_abort_the_job(token):
    port = _free_port()
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2"}
    if token is not None:
        env["RPCDIST_TOKEN"] = token
    with _processes() as procs:
        rank0 = procs.rank(0, "env", RANK="0", **env)
        if token is None:
            _wait_for(lambda: os.path.exists(_secret_file(port)), "the secret file", rank0)
        else:
            _wait_for(lambda: "token" in _stray_call(f"127.0.0.1:{port}", "x"), "the store")
        for stray in (None, "wrong"):
            told = _stray_call(f"127.0.0.1:{port}", stray)
            assert told.startswith("ConnectError:") and "token" in told, told
        assert rank0.poll() is None, _finish(rank0)
        rank1 = procs.rank(1, "env", RANK="1", **env)
        code, out = _finish(rank0)
        assert code == 0 and "SUM 42" in out, out
        assert _finish(rank1)[0] == 0


def test_a_timed_out_rendezvous_counts_the_refused_calls_and_says_from_where():
    port = _free_port()
    with _processes() as procs:
        rank0 = procs.rank(0, str(port), limit=4.0)
        _wait_for(lambda: os.path.exists(_secret_file(port)), "the secret file", rank0)
        for stray in (None, "wrong"):
            assert "ConnectError" in _stray_call(f"127.0.0.1:{port}", stray)
        code, out = _finish(rank0)
    assert code == 3 and "ERROR RpcTimeoutError" in out, out
    assert "2 call(s) to the rendezvous store were refused for their token" in out, out
    assert "from ipv4:127.0.0.1:" in out, out


def test_stray_store_calls_do_not_abort_a_job_under_the_launcher(tmp_path):
    port = _free_port()
    script, go = tmp_path / "job.py", tmp_path / "go"
    script.write_text(WORKER)
    argv = [sys.executable, "-m", "rpcdist.launch", "--nproc-per-node", "2"]
    argv += ["--master-port", str(port), str(script), "env", "30"]
    with _processes() as procs:
        launcher = procs.start(argv, _env(GO_FILE=str(go)))  # rank 1 waits for "go"
        # Rank 0 serves the store and waits for rank 1; strangers call it meanwhile.
        _wait_for(lambda: "token" in _stray_call(f"127.0.0.1:{port}", "x"), "the store", launcher)
        told = _stray_call(f"127.0.0.1:{port}", None)
        assert told.startswith("ConnectError:") and "token" in told, told
        assert launcher.poll() is None, _finish(launcher)
        go.touch()
        code, out = _finish(launcher)
    assert code == 0 and "SUM 42" in out, out
