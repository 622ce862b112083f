"""While agents run, a thread that needs the GIL (a handler, a reply) waits
at most ``RpcOptions.gil_switch_us`` for a compute thread holding it."""

from __future__ import annotations

import os
import socket
import sys

import pytest
import rpc_funcs as rf

import rpcdist
from rpcdist import ConfigError, RpcOptions
from rpcdist.testing import local_agents, run_workers

PYTHON = 0.005


@pytest.fixture(autouse=True)
def python_switch():
    assert sys.getswitchinterval() == PYTHON  # each test starts from Python's own
    yield
    sys.setswitchinterval(PYTHON)


def test_agents_set_the_switch_interval_and_the_last_one_puts_it_back():
    with local_agents(2, options=RpcOptions(token=None)) as (a, b):
        assert sys.getswitchinterval() == pytest.approx(500e-6, abs=2e-6)
        assert a.rpc_async(1, rf.add, args=(1, 2)).wait(30) == 3
        b.shutdown(graceful=False)
        assert sys.getswitchinterval() == pytest.approx(500e-6, abs=2e-6)  # ``a`` still runs
    assert sys.getswitchinterval() == PYTHON


def test_a_programs_own_switch_interval_is_left_alone():
    sys.setswitchinterval(0.002)
    with local_agents(2, options=RpcOptions(token=None)):
        assert sys.getswitchinterval() == pytest.approx(0.002, abs=2e-6)
    assert sys.getswitchinterval() == pytest.approx(0.002, abs=2e-6)


def test_a_change_made_while_agents_run_stays_after_them():
    with local_agents(2, options=RpcOptions(token=None)):
        sys.setswitchinterval(0.003)
    assert sys.getswitchinterval() == pytest.approx(0.003, abs=2e-6)


@pytest.mark.parametrize("off", [None, "off"])
def test_it_can_be_turned_off(off):
    with local_agents(2, options=RpcOptions(token=None, gil_switch_us=off)):
        assert sys.getswitchinterval() == PYTHON


def test_the_environment_sets_it(monkeypatch):
    monkeypatch.setenv("RPCDIST_GIL_SWITCH_US", "200")
    with local_agents(2, options=RpcOptions(token=None)):
        assert sys.getswitchinterval() == pytest.approx(200e-6, abs=2e-6)
    assert sys.getswitchinterval() == PYTHON


@pytest.mark.parametrize("bad", [0, -5, "fast", True, 2e6])
def test_bad_values_are_refused_naming_the_option(bad):
    with pytest.raises(ConfigError, match="gil_switch_us"):
        RpcOptions(gil_switch_us=bad).validated()


def _switch_in_worker(rank: int, world: int, _init: str) -> float:
    os.environ["RANK"] = str(rank)  # the rest of the launcher's variables come from ``env``
    rpcdist.init_rpc(f"w{rank}")
    try:
        return sys.getswitchinterval()
    finally:
        rpcdist.shutdown()


@pytest.mark.timeout(120)
def test_workers_started_as_a_launcher_starts_them_run_with_it():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2"}
    got = run_workers(_switch_in_worker, 2, timeout=100, env=env)
    assert got == [pytest.approx(500e-6, abs=2e-6)] * 2
