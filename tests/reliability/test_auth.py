"""No call from outside the job: a secret per job, loopback without one; a
rank with a wrong token fails at once, and the ranks let in keep waiting."""

from __future__ import annotations

import threading

import harness
import pytest
import rel_funcs as rf
from rawpeer import RawPeer, call_record

import rpcdist
from rpcdist._rpc._agent import Agent
from rpcdist._store._private import private_secret_path
from rpcdist._store._rendezvous import parse_init_method
from rpcdist._store._secret_file import remove_secret, write_secret
from rpcdist._transport._frames import REPLY
from rpcdist._transport._tcp_dial import tcp_connect
from rpcdist.launch._hosting import free_port
from rpcdist.testing import local_agents


def _secret(agent: Agent) -> str | None:
    return agent.links.transport._options.token  # type: ignore[attr-defined]


def _dial_as_other_job(rank: int, world_size: int, init: str, address: str) -> dict:
    """In a process of another job (its own rendezvous, its own secret):
    try to call a worker of the first job, by hand and through the transport."""
    rpcdist.init_rpc("intruder", 0, 1, init_method=init)
    from rpcdist._rpc._context import current_agent

    mine = current_agent()
    out = {}
    peer = RawPeer(address, rank=1, name="worker1", token=_secret(mine))
    out["with_my_secret"] = peer.refused
    peer.close()
    peer = RawPeer(address, rank=1, name="worker1", token=None)
    out["without_token"] = peer.refused
    peer.close()
    try:
        mine.run(
            tcp_connect(
                address, "them", options=mine.links.transport._options, my_rank=1, my_name="worker1"
            )
        )
        out["transport"] = "connected"
    except rpcdist.ConnectError as e:
        out["transport"] = str(e)
    rpcdist.shutdown()
    return out


@pytest.mark.multiprocess
def test_workers_without_a_token_cannot_be_called_from_another_jobs_process():
    with local_agents(2, options=rpcdist.RpcOptions(token=None, local_sockets=False)) as (a, b):
        secret = _secret(a)
        assert secret and secret == _secret(b)  # made at rendezvous, shared by the job
        before = a.rpc_sync(1, rf.add, args=(1, 1))
        res = harness.run_job(_dial_as_other_job, 1, (a.links.address(0),), timeout=60)
        assert not res.errors, res.errors
        got = res.values[0]
        assert "token" in got["with_my_secret"]
        assert "token" in got["without_token"]
        assert "refused" in got["transport"] and "token" in got["transport"]
        # With the job's own secret, a hand-made peer does get in (so the refusals
        # above are about the secret, not the hand-made hello).
        peer = RawPeer(a.links.address(0), rank=1, name="worker1", token=secret)
        assert peer.refused is None
        peer.send(call_record("rel_funcs:add", (20, 22)))
        assert peer.read_reply()[0].kind == REPLY
        peer.close()
        assert before == 2 and a.rpc_sync(1, rf.add, args=(2, 2)) == 4


def _start_pair(init: str, tokens: tuple[str | None, str | None]) -> dict[int, BaseException]:
    """Start rank 0 (init timeout 4 s) and rank 1 (60 s) with these tokens."""
    errors: dict[int, BaseException] = {}
    agents: list[Agent] = []

    def start(rank: int) -> None:
        opts = rpcdist.RpcOptions(token=tokens[rank], init_timeout=(4, 60)[rank])
        try:
            agents.append(Agent(f"w{rank}", rank, 2, init_method=init, options=opts).start())
        except BaseException as e:
            errors[rank] = e

    threads = [threading.Thread(target=start, args=(r,), daemon=True) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(40)  # rank 1's init_timeout is 60 s: finishing first means it was told
    assert not any(t.is_alive() for t in threads), "rank 1 waited for its init timeout"
    for agent in agents:
        agent.shutdown(graceful=False)
    return errors


def _init_method(tmp_path, scheme: str) -> str:
    """A fresh rendezvous: a file under ``tmp_path``, or a free port on 127.0.0.1."""
    if scheme == "file":
        return f"file://{tmp_path}/rdv"
    return f"tcp://127.0.0.1:{free_port()}"


@pytest.mark.parametrize("scheme", ["file", "tcp"])
@pytest.mark.parametrize(
    "tokens", [("a", "b"), (None, "b"), ("a", None)], ids=["wrong", "only-rank1", "only-rank0"]
)
def test_a_token_mismatch_fails_the_rank_at_once_and_rank_0_names_it_at_its_timeout(
    tmp_path, scheme, tokens
):
    init = _init_method(tmp_path, scheme)
    errors = _start_pair(init, tokens)
    assert isinstance(errors.get(1), rpcdist.ConnectError), errors
    assert "token" in str(errors[1]) and "RPCDIST_TOKEN" in str(errors[1])
    # Rank 0 was not aborted by the refusal: it waited for rank 1 until its own
    # timeout, and then says how many calls were refused, and from where.
    assert isinstance(errors.get(0), rpcdist.RpcTimeoutError), errors
    assert "refused for their token, from ipv4:127.0.0.1:" in str(errors[0])
    assert "(claiming rank 1)" in str(errors[0])


@pytest.mark.parametrize("scheme", ["file", "tcp"])
def test_a_rank_without_a_token_fails_at_once_despite_a_stale_secret_file(tmp_path, scheme):
    # A tokenless job that met at the same place earlier left its secret file
    # (killed before it could remove it); this job's rank 0 has a token.
    init = _init_method(tmp_path, scheme)
    path = private_secret_path(parse_init_method(init, 1, 2))
    write_secret(path, "0" * 32, "a-past-job")
    try:
        errors = _start_pair(init, ("a", None))
    finally:
        remove_secret(path, "a-past-job")
    assert isinstance(errors.get(1), rpcdist.ConnectError), errors
    assert "RPCDIST_TOKEN" in str(errors[1]) and "asks for one" in str(errors[1]), errors[1]


def test_listening_beyond_loopback_needs_a_token_tls_or_an_explicit_option():
    with pytest.raises(rpcdist.ConfigError, match="beyond this host"):
        rpcdist.RpcOptions(token=None, listen_host="0.0.0.0").validated()
    rpcdist.RpcOptions(token="t", listen_host="0.0.0.0").validated()
    rpcdist.RpcOptions(token=None, listen_host="0.0.0.0", allow_insecure=True).validated()
    rpcdist.RpcOptions(token=None, listen_host="::1").validated()
    with pytest.raises(rpcdist.ConfigError, match="rendezvous store.*RPCDIST_TOKEN.*rpcdist-run"):
        Agent("w0", 0, 2, init_method="tcp://0.0.0.0:29511", options=rpcdist.RpcOptions(token=None))
    # A rank without a token cannot meet its job beyond loopback either: its
    # secret would come from a file on rank 0's host.
    with pytest.raises(rpcdist.ConfigError, match="rank 1 would meet its job.*RPCDIST_TOKEN"):
        Agent(
            "w1", 1, 2, init_method="tcp://192.0.2.1:29511", options=rpcdist.RpcOptions(token=None)
        )
    with pytest.raises(rpcdist.ConfigError, match="must not be empty"):
        rpcdist.RpcOptions(token="").validated()


def test_a_stray_call_from_outside_the_worker_table_does_not_hold_up_shutdown():
    opts = rpcdist.RpcOptions(token="t", local_sockets=False)
    with local_agents(3, options=opts) as agents:
        a = agents[0]
        peer = RawPeer(a.links.address(0), rank=1, name="worker1", token="t")
        peer.send(call_record("rel_funcs:add", (1, 1)))
        assert peer.read_reply()[0].kind == REPLY
        peer.close()  # its end is not worker1's: worker1 is not declared lost
        assert a.rpc_sync(1, rf.add, args=(1, 2)) == 3
        outsider = RawPeer(a.links.address(0), rank=5, name="nobody", token="t")
        assert "not part of this job" in outsider.refused
        outsider.close()
        assert not a.liveness.lost
        lost: dict[str, object] = {}

        def stop(agent: Agent) -> None:
            lost[agent.name] = agent.shutdown(graceful=True, timeout=20)

        threads = [threading.Thread(target=stop, args=(x,)) for x in agents]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert lost == {"worker0": [], "worker1": [], "worker2": []}
