"""Authentication and TLS between agents."""

from __future__ import annotations

import shutil
import subprocess
import threading
from pathlib import Path

import pytest
import rpc_funcs as rf

import rpcdist
from rpcdist._rpc._agent import Agent
from rpcdist.testing import local_agents


def test_workers_with_different_tokens_cannot_join(tmp_path):
    init = f"file://{tmp_path}/rdv"
    errors: dict[int, BaseException] = {}

    def start(rank: int, token: str) -> None:
        opts = rpcdist.RpcOptions(token=token, init_timeout=3)
        try:
            Agent(f"w{rank}", rank, 2, init_method=init, options=opts).start()
        except BaseException as e:
            errors[rank] = e

    threads = [threading.Thread(target=start, args=(r, t)) for r, t in ((0, "a"), (1, "b"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    # The intruder is told its token was refused; rank 0 gives up waiting for it.
    assert isinstance(errors[1], rpcdist.ConnectError) and "token" in str(errors[1])
    assert isinstance(errors[0], rpcdist.RpcTimeoutError | rpcdist.ConnectError)


def _make_certs(d: Path) -> dict[str, str]:
    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=d)

    run(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "1",
        "-subj",
        "/CN=rpcdist-test-ca",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
    )
    (d / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    run(
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-subj",
        "/CN=127.0.0.1",
        "-keyout",
        "w.key",
        "-out",
        "w.csr",
    )
    run(
        "x509",
        "-req",
        "-in",
        "w.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-days",
        "1",
        "-extfile",
        "ext.cnf",
        "-out",
        "w.pem",
    )
    return {
        "tls_cert_file": str(d / "w.pem"),
        "tls_key_file": str(d / "w.key"),
        "tls_ca_file": str(d / "ca.pem"),
    }


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl CLI not available")
def test_tls_between_agents(tmp_path):
    files = _make_certs(tmp_path)
    opts = rpcdist.RpcOptions(token="t", **files)
    with local_agents(2, options=opts) as (a, _):
        assert a.rpc_async(1, rf.add, args=(20, 22)).wait(10) == 42


def test_tls_options_must_be_complete():
    with pytest.raises(rpcdist.ConfigError, match="together"):
        rpcdist.RpcOptions(tls_cert_file="x").validated()
    with pytest.raises(rpcdist.ConfigError, match="tls_ca_file"):
        rpcdist.RpcOptions(tls_cert_file="x", tls_key_file="y").validated()
