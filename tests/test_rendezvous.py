"""Parsing ``init_method`` and opening the store through env://, tcp:// and file://."""

from __future__ import annotations

import asyncio
import os
import socket
import stat
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

import rpcdist
from rpcdist._errors import ConfigError, ConnectError
from rpcdist._rpc import _join
from rpcdist._store import StoreClient, StoreServer, _rendezvous
from rpcdist._store._common import REFUSED_KEY
from rpcdist._store._private import open_private_store, private_secret_path
from rpcdist._store._rendezvous import (
    RendezvousSpec,
    open_store,
    parse_init_method,
    rendezvous_file,
)
from rpcdist._store._secret_file import read_secret, write_secret
from rpcdist.launch._hosting import free_port
from rpcdist.testing import local_agents

pytestmark = pytest.mark.timeout(30)

ENV4 = {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "RANK": "1", "WORLD_SIZE": "4"}


def run(test: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(test(), 20))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("init_method", "rank", "world_size", "env", "expected"),
    [
        (None, None, None, ENV4, ("env", "10.0.0.1", 29500, 1, 4, None)),
        ("env://", None, None, ENV4, ("env", "10.0.0.1", 29500, 1, 4, None)),
        ("env://", 3, 8, ENV4, ("env", "10.0.0.1", 29500, 3, 8, None)),
        ("env://", 0, 1, {}, ("env", "127.0.0.1", 0, 0, 1, None)),
        (None, None, None, {**ENV4, "MASTER_ADDR": "::1"}, ("env", "::1", 29500, 1, 4, None)),
        (None, None, None, {**ENV4, "MASTER_ADDR": "[::1]"}, ("env", "::1", 29500, 1, 4, None)),
        ("tcp://10.1.2.3:29500", 1, 2, {}, ("tcp", "10.1.2.3", 29500, 1, 2, None)),
        ("tcp://[::1]:29500", 0, 2, {}, ("tcp", "::1", 29500, 0, 2, None)),
        ("tcp://node-7:1/", 0, 2, {}, ("tcp", "node-7", 1, 0, 2, None)),
        ("tcp://h:65535?rank=1&world_size=2", None, None, {}, ("tcp", "h", 65535, 1, 2, None)),
        ("tcp://h:29500?world_size=2&rank=1", 1, 2, {}, ("tcp", "h", 29500, 1, 2, None)),
        ("tcp://h:29500", None, None, ENV4, ("tcp", "h", 29500, 1, 4, None)),
        ("tcp://h:0", 0, 1, {}, ("tcp", "h", 0, 0, 1, None)),
        ("file:///tmp/rdv", 1, 2, {}, ("file", "127.0.0.1", 0, 1, 2, "/tmp/rdv")),
        (
            "file://localhost/tmp/a%20b?rank=0&world_size=3",
            None,
            None,
            {"RPCDIST_STORE_HOST": "0.0.0.0"},
            ("file", "0.0.0.0", 0, 0, 3, "/tmp/a b"),
        ),
    ],
)
def test_parse_init_method_accepts(
    init_method: str | None,
    rank: int | None,
    world_size: int | None,
    env: dict[str, str],
    expected: tuple[object, ...],
) -> None:
    spec = parse_init_method(init_method, rank, world_size, env=env)
    assert spec == RendezvousSpec(*expected)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("init_method", "rank", "world_size", "env", "match"),
    [
        (None, None, None, {}, "world_size is not known.*WORLD_SIZE"),
        (None, None, None, {**ENV4, "RANK": ""}, "environment variable RANK must be an integer"),
        ("env://", None, 2, {"MASTER_PORT": "1"}, "rank is not known.*RANK"),
        ("env://", 0, 2, {}, "MASTER_PORT is not set"),
        (None, None, None, {**ENV4, "MASTER_PORT": "abc"}, "MASTER_PORT must be a port"),
        (None, None, None, {**ENV4, "MASTER_PORT": "70000"}, r"MASTER_PORT.*0\.\.65535"),
        (None, None, None, {**ENV4, "MASTER_PORT": "-1"}, "MASTER_PORT"),
        (None, None, None, {**ENV4, "MASTER_PORT": "0"}, "port 0"),
        (None, None, None, {**ENV4, "MASTER_ADDR": ""}, "MASTER_ADDR must be a host"),
        (None, None, None, {**ENV4, "RANK": "4"}, r"rank must be in \[0, 4\)"),
        (None, None, None, {**ENV4, "WORLD_SIZE": "0"}, "world_size must be >= 1"),
        (None, -1, None, ENV4, r"rank must be in \[0, 4\)"),
        (None, True, None, ENV4, "rank must be an int"),
        ("env://host:1", 0, 1, {}, "MASTER_ADDR"),
        ("tcp://host", 0, 2, {}, "port is missing"),
        ("tcp://::1:80", 0, 2, {}, "brackets"),
        ("tcp://[::1]", 0, 2, {}, r"tcp://\[ipv6\]:port"),
        ("tcp://[::1:80", 0, 2, {}, "not a valid URL"),
        ("tcp://:80", 0, 2, {}, "host name or IP"),
        ("tcp://h:x", 0, 2, {}, "port number"),
        ("tcp://h:0", 0, 2, {}, "port 0"),
        ("tcp://h:1/path", 0, 2, {}, "unexpected path"),
        ("tcp://h:1#x", 0, 2, {}, "fragment"),
        ("tcp://h:1?rank=1", 0, 2, {}, "disagrees"),
        ("tcp://h:1?color=red", 0, 2, {}, "unknown parameter 'color'"),
        ("tcp://h:1?rank=1&rank=1", None, 2, {}, "twice"),
        ("tcp://h:1?rank=one", None, 2, {}, "rank= in init_method"),
        ("tcp://h:1", None, None, {}, r"rank=.*\?rank=|world_size"),
        ("http://h:1", 0, 2, {}, "expected env://"),
        ("h:1", 0, 2, {}, "expected env://"),
        ("file://relative/path", 0, 2, {}, "file:///absolute"),
        ("file:///x", 0, 2, {"RPCDIST_STORE_HOST": "a b"}, "RPCDIST_STORE_HOST"),
        (42, 0, 1, {}, "string URL"),
    ],
)
def test_parse_init_method_rejects(
    init_method: object, rank: object, world_size: int | None, env: dict[str, str], match: str
) -> None:
    with pytest.raises(ConfigError, match=match) as info:
        parse_init_method(init_method, rank, world_size, env=env)  # type: ignore[arg-type]
    assert isinstance(info.value, ValueError)


async def _close(store: StoreClient, server: StoreServer | None) -> None:
    await store.close()
    if server is not None:
        await server.stop(0)


def test_env_world_size_one_needs_no_port() -> None:
    async def main() -> None:
        spec = parse_init_method(None, 0, 1, env={})
        store, server = await open_store(spec, token="t", timeout=10)
        assert server is not None
        await store.barrier("solo", 1, timeout=5)
        await _close(store, server)

    run(main)


def test_tcp_ranks_started_before_rank_0_wait_for_it() -> None:
    async def main() -> None:
        url = f"tcp://127.0.0.1:{free_port()}"
        specs = [parse_init_method(url, rank, 3, env={}) for rank in range(3)]

        async def rank_main(spec: RendezvousSpec) -> tuple[bytes, StoreClient, StoreServer | None]:
            store, server = await open_store(spec, token="t", timeout=10)
            await store.set(f"name/{spec.rank}", f"worker{spec.rank}".encode())
            await store.barrier("names", spec.world_size, timeout=10)
            return await store.get(f"name/{(spec.rank + 1) % 3}", timeout=5), store, server

        async with asyncio.TaskGroup() as group:
            followers = [group.create_task(rank_main(spec)) for spec in specs[1:]]
            leader = group.create_task(rank_main(specs[0]))
        results = [task.result() for task in (leader, *followers)]
        assert [name for name, _, _ in results] == [b"worker1", b"worker2", b"worker0"]
        # Rank 0 stops serving only after every rank is done with the store.
        for _, store, server in reversed(results):
            await _close(store, server)

    run(main)


def test_tcp_follower_without_rank_0_fails_naming_the_address() -> None:
    async def main() -> None:
        port = free_port()
        spec = parse_init_method(f"tcp://127.0.0.1:{port}", 1, 2, env={})
        with pytest.raises(ConnectError, match=f"127.0.0.1:{port}"):
            await open_store(spec, token=None, timeout=0.3)

    run(main)


def test_rank_0_bind_failure_is_a_connect_error() -> None:
    async def main() -> None:
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            port = taken.getsockname()[1]
            spec = parse_init_method(f"tcp://127.0.0.1:{port}", 0, 2, env={})
            with pytest.raises(ConnectError, match=f"127.0.0.1:{port}.*in use"):
                await open_store(spec, token=None, timeout=5)

    run(main)


def _file_spec(path: Path, rank: int, world_size: int = 3) -> RendezvousSpec:
    return parse_init_method(path.as_uri(), rank, world_size, env={})


def test_file_rendezvous_with_three_concurrent_ranks(tmp_path: Path) -> None:
    path = tmp_path / "rdv"

    async def main() -> None:
        opened = await asyncio.gather(
            *(open_store(_file_spec(path, rank), token="t", timeout=10) for rank in (2, 0, 1))
        )
        servers = [server for _, server in opened if server is not None]
        assert len(servers) == 1
        assert {store.server_id for store, _ in opened} == {servers[0].server_id}
        assert Path(rendezvous_file(str(path))).read_text().splitlines()[1] == servers[0].server_id
        async with asyncio.TaskGroup() as group:
            for store, _ in opened:
                group.create_task(store.barrier("joined", 3, timeout=10))
        assert await opened[0][0].add("count", 3) == 3
        for store, server in opened:
            await _close(store, server)
        assert not path.exists() and not Path(rendezvous_file(str(path))).exists()
        assert sorted(os.listdir(tmp_path)) == []

    run(main)


def test_file_rendezvous_replaces_a_stale_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "rdv"

    async def main() -> None:
        # A previous run's rank 0 died and left its file behind.
        old = StoreServer(token="t")
        old_port = await old.start()
        await old.stop(0)
        Path(rendezvous_file(str(path))).write_text(f"127.0.0.1:{old_port}\n{old.server_id}\n")

        read_stale = asyncio.Event()
        stale_reads: set[int] = set()
        real_read = _rendezvous._read_file

        def spying_read(file: str) -> tuple[str, str] | str:
            found = real_read(file)
            if isinstance(found, tuple) and found[1] == old.server_id:
                stale_reads.add(id(asyncio.current_task()))
                if len(stale_reads) == 2:
                    read_stale.set()
            return found

        monkeypatch.setattr(_rendezvous, "_read_file", spying_read)
        async with asyncio.TaskGroup() as group:
            followers = [
                group.create_task(open_store(_file_spec(path, rank), token="t", timeout=10))
                for rank in (1, 2)
            ]
            await read_stale.wait()  # both followers saw the stale address
            leader = await open_store(_file_spec(path, 0), token="t", timeout=10)
        store0, server = leader
        assert server is not None
        for task in followers:
            store, _ = task.result()
            assert store.server_id == server.server_id
            await store.close()
        await _close(store0, server)
        assert not path.exists() and not Path(rendezvous_file(str(path))).exists()

    run(main)


@pytest.mark.parametrize("old_token", ["t", "other"])
def test_file_naming_another_live_store_is_stale(tmp_path: Path, old_token: str) -> None:
    path = tmp_path / "rdv"

    async def main() -> None:
        # The port in the file now belongs to another store (another id or token).
        other = StoreServer(token=old_token)
        port = await other.start()
        Path(rendezvous_file(str(path))).write_text(f"127.0.0.1:{port}\nsome-older-id\n")
        try:
            with pytest.raises(ConnectError, match=r"rendezvous file.*(another store|token)"):
                await open_store(_file_spec(path, 1), token="t", timeout=0.3)
        finally:
            await other.stop(0)

    run(main)


def test_file_follower_without_a_file_times_out(tmp_path: Path) -> None:
    async def main() -> None:
        with pytest.raises(ConnectError, match="does not exist yet"):
            await open_store(_file_spec(tmp_path / "none", 1), token=None, timeout=0.1)

    run(main)


def test_rank_0_keeps_a_file_that_a_newer_run_replaced(tmp_path: Path) -> None:
    path = tmp_path / "rdv"

    async def main() -> None:
        store, server = await open_store(_file_spec(path, 0, 1), token=None, timeout=10)
        own = Path(rendezvous_file(str(path)))
        own.write_text("127.0.0.1:1\nnewer-run\n")
        await _close(store, server)
        assert own.read_text() == "127.0.0.1:1\nnewer-run\n"

    run(main)


def test_unwritable_rendezvous_file_is_a_config_error(tmp_path: Path) -> None:
    async def main() -> None:
        spec = _file_spec(tmp_path / "missing-dir" / "rdv", 0, 1)
        with pytest.raises(ConfigError, match="cannot write the rendezvous file"):
            await open_store(spec, token=None, timeout=5)

    run(main)


def test_workers_of_another_wire_protocol_are_refused_naming_them():
    with local_agents(1) as (a,):
        mine = {
            "name": "worker0",
            "rank": 0,
            "transport": a.links.transport.name,
            "wire": _join.WIRE_PROTOCOL,
            "version": rpcdist.__version__,
        }
        asyncio.run(_join.check(a, [mine]))  # agreeing: fine
        old = {**mine, "name": "old", "rank": 1}
        del old["wire"], old["version"]  # an rpcdist from before the field existed
        with pytest.raises(ConfigError, match=r"'old' runs rpcdist unknown \(wire protocol 1\)"):
            asyncio.run(_join.check(a, [mine, old]))


def test_grpc_loads_only_when_a_store_is_made() -> None:
    code = (
        "import sys\n"
        "import rpcdist, rpcdist._rpc._agent, rpcdist._rref._rref, rpcdist._store\n"
        "assert 'grpc' not in sys.modules, 'grpc imported before any store'\n"
        "rpcdist._store.StoreClient\n"
        "assert 'grpc' in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# -- a job without a token: the secret in a per-user file ---------------------


def _private_specs(scheme: str, tmp_path: Path) -> list[RendezvousSpec]:
    url = f"file://{tmp_path}/rdv" if scheme == "file" else f"tcp://127.0.0.1:{free_port()}"
    return [parse_init_method(url, rank, 2, env={}) for rank in (0, 1)]


@pytest.mark.parametrize("scheme", ["tcp", "file"])
def test_a_tokenless_job_shares_its_secret_through_a_private_file_not_the_store(
    scheme: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    specs = _private_specs(scheme, tmp_path)
    path = private_secret_path(specs[0])
    # A file left by a killed job that met here: rank 1 must not be fooled by it.
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    write_secret(path, "stale", "0" * 32)

    async def main() -> None:
        follower = asyncio.create_task(open_private_store(specs[1], timeout=10))
        await asyncio.sleep(0)  # (rank 1 first reads the stale file)
        store0, server, secret = await open_private_store(specs[0], timeout=10)
        store1, _, secret1 = await follower
        assert server is not None and secret == secret1 != "stale"
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
        await store1.set("k", b"v")
        assert await store0.get("k", 5) == b"v"
        # Without the secret the store answers nothing, and keeps serving.
        # (Rank 1 may have been refused once already, with the stale secret.)
        before = int((await store1.get(REFUSED_KEY, 1)).split(b" ")[0] or b"0")
        stranger = StoreClient(store0.address, token=None, timeout=2)
        with pytest.raises(ConnectError, match="token"):
            await stranger.get("k", 1)
        await stranger.close()
        assert (await store1.get(REFUSED_KEY, 1)).startswith(b"%d call(s) " % (before + 1))
        assert await store1.get("k", 1) == b"v"
        await store1.close()
        await _close(store0, server)
        assert not os.path.exists(path)

    run(main)


def test_the_secret_directory_must_be_private_to_the_user(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    spec = _private_specs("tcp", tmp_path)[1]
    os.mkdir(tmp_path / "rpcdist", 0o755)
    os.chmod(tmp_path / "rpcdist", 0o755)
    with pytest.raises(ConfigError, match="the group or others may use it"):
        private_secret_path(spec)
    os.rmdir(tmp_path / "rpcdist")
    os.symlink(tmp_path, tmp_path / "rpcdist")
    with pytest.raises(ConfigError, match="is not a plain directory"):
        private_secret_path(spec)
    os.remove(tmp_path / "rpcdist")
    if os.geteuid() == 0:  # root can give the directory away
        os.mkdir(tmp_path / "rpcdist", 0o700)
        os.chown(tmp_path / "rpcdist", 65534, 65534)
        with pytest.raises(ConfigError, match="is owned by uid 65534"):
            private_secret_path(spec)
        os.rmdir(tmp_path / "rpcdist")
    path = private_secret_path(spec)
    write_secret(path, "s", "id")
    os.chmod(path, 0o644)
    with pytest.raises(ConfigError, match="RPCDIST_TOKEN"):
        read_secret(path)


def test_a_tokenless_rank_fails_at_once_when_its_job_has_a_token(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    specs = _private_specs("tcp", tmp_path)

    async def main() -> None:
        store0, server = await open_store(specs[0], token="t", timeout=10)
        with pytest.raises(ConnectError, match="has no job token"):
            await open_private_store(specs[1], timeout=10)  # not its 10 s
        await _close(store0, server)

    run(main)


def test_an_empty_refusal_summary_when_nobody_was_refused() -> None:
    async def main() -> None:
        store, server = await open_store(
            parse_init_method(None, 0, 1, env={}), token="t", timeout=5
        )
        assert await store.get(REFUSED_KEY, 1) == b""
        await _close(store, server)

    run(main)


def test_a_tokenless_ranks_probe_is_refused_without_a_report(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async def main() -> None:
        server = StoreServer(token="secret", secret_file=str(tmp_path / "secret"))
        port = await server.start("127.0.0.1", 0)
        try:
            for probe in (True, False):
                client = StoreClient(f"127.0.0.1:{port}", token=None, rank=1, probe=probe)
                with pytest.raises(ConnectError, match="no job token"):
                    await client.connect(timeout=5)
                await client.close()
                # the probe is refused as any tokenless caller, but only the
                # stranger is counted and logged
                assert server.refused == (0 if probe else 1)
        finally:
            await server.stop(0)

    with caplog.at_level("WARNING", logger="rpcdist._store._server"):
        run(main)
    assert [r.getMessage().count("refused a call") for r in caplog.records] == [1]
