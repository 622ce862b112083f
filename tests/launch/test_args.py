"""The launcher's arguments, exit code 2 on bad ones, and the workers' environment."""

from __future__ import annotations

import sys

import pytest
from launch_util import CHILD

from rpcdist import ConfigError
from rpcdist.launch import LaunchConfig, child_env, main, parse_args
from rpcdist.launch._children import worker_argv

MULTI = ["--master-port", "1234", "--token", "t"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([CHILD], "--nproc-per-node"),
        (["--nproc-per-node", "0", CHILD], "--nproc-per-node must be >= 1"),
        (["--nproc-per-node", "x", CHILD], "invalid int value"),
        (["--nproc-per-node", "2", "--nnodes", "2", "--node-rank", "2", CHILD], "--node-rank"),
        (["--nproc-per-node", "2", "--master-port", "70000", CHILD], "--master-port"),
        (["--nproc-per-node", "2", "--max-restarts", "-1", CHILD], "--max-restarts"),
        (
            ["--nproc-per-node", "2", "--nnodes", "2", "--restart-policy", "rank", *MULTI, CHILD],
            "--restart-policy rank needs a single node",
        ),
        (["--nproc-per-node", "2", "--restart-policy", "node", CHILD], "invalid choice"),
        (
            ["--nproc-per-node", "2", "--nnodes", "2", "--token", "t", CHILD],
            "--master-port is required",
        ),
        (
            ["--nproc-per-node", "2", "--nnodes", "2", "--master-port", "1234", CHILD],
            "token is required",
        ),
        (["--nproc-per-node", "2", "no/such/script.py"], "not found"),
        (["--nproc-per-node", "2"], "script"),
        # The elastic form and the rendezvous settings.
        (["--nproc-per-node", "1", "--nnodes", "0", *MULTI, CHILD], "--nnodes must be >= 1"),
        (["--nproc-per-node", "1", "--nnodes", "3:2", *MULTI, CHILD], "1 <= MIN <= MAX"),
        (["--nproc-per-node", "1", "--nnodes", "0:2", *MULTI, CHILD], "1 <= MIN <= MAX"),
        (["--nproc-per-node", "1", "--nnodes", "a:b", *MULTI, CHILD], "N or MIN:MAX"),
        (["--nproc-per-node", "1", "--nnodes", "1:3", "--token", "t", CHILD], "--master-port"),
        (["--nproc-per-node", "1", "--nnodes", "1:3", "--master-port", "9", CHILD], "token"),
        (
            ["--nproc-per-node", "1", "--nnodes", "2:3", "--node-rank", "0", *MULTI, CHILD],
            "assigned by the rendezvous",
        ),
        (["--nproc-per-node", "1", "--node-timeout", "0", CHILD], "--node-timeout must be > 0"),
        (["--nproc-per-node", "1", "--rdzv-timeout", "-1", CHILD], "--rdzv-timeout"),
        (["--nproc-per-node", "1", "--grace-period", "nan", CHILD], "--grace-period"),
        (["--nproc-per-node", "1", "--rdzv-last-call", "inf", CHILD], "--rdzv-last-call"),
        (["--nproc-per-node", "1", "--token", "", CHILD], "must not be empty"),
    ],
)
def test_bad_arguments_exit_2_with_a_message(argv, message, capsys, monkeypatch):
    monkeypatch.delenv("RPCDIST_TOKEN", raising=False)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "usage: rpcdist-run" in err and message in err
    with pytest.raises(ConfigError):
        parse_args(argv, env={})


def test_script_arguments_are_passed_through_untouched():
    cfg = parse_args(["--nproc-per-node", "2", CHILD, "--epochs", "3", "-h"], env={})
    assert cfg.command == (CHILD, "--epochs", "3", "-h")
    mod = parse_args(["--nproc-per-node", "1", "-m", "pkg.mod", "--x"], env={})
    assert mod.command == ("-m", "pkg.mod", "--x")


def test_token_comes_from_flag_then_environment_then_is_random():
    base = ["--nproc-per-node", "1", CHILD]
    assert parse_args(["--token", "flag", *base], env={"RPCDIST_TOKEN": "env"}).token == "flag"
    assert parse_args(base, env={"RPCDIST_TOKEN": "env"}).token == "env"
    a, b = parse_args(base, env={}).token, parse_args(base, env={}).token
    assert a != b and len(a) == 32


@pytest.mark.parametrize(
    ("nnodes", "expected"),
    [
        ("1", (None, 1, False)),
        ("4", (None, 4, False)),
        ("2:4", (2, 4, True)),
        ("1:1", (None, 1, False)),
        ("3:3", (3, 3, True)),
    ],
)
def test_nnodes_fixed_or_elastic(nnodes, expected):
    cfg = parse_args(["--nproc-per-node", "2", "--nnodes", nnodes, *MULTI, CHILD], env={})
    assert (cfg.min_nodes, cfg.nnodes, cfg.elastic) == expected
    assert cfg.world_size == 2 * expected[1]
    assert cfg.multi_node == (expected[1] > 1)


def test_defaults_and_switches():
    cfg = parse_args(["--nproc-per-node", "1", CHILD], env={})
    assert (cfg.prefix_output, cfg.node_rank, cfg.master_port) == (True, 0, None)
    assert (cfg.rdzv_timeout, cfg.rdzv_last_call, cfg.node_timeout) == (300.0, 3.0, 5.0)
    argv = ["--nproc-per-node", "1", "--no-prefix", "--node-timeout", "2.5", CHILD]
    cfg = parse_args(argv, env={})
    assert (cfg.prefix_output, cfg.node_timeout) == (False, 2.5)


def test_child_env_for_a_second_node():
    argv = "--nproc-per-node 4 --nnodes 3 --node-rank 1 --master-addr 10.0.0.1"
    argv += " --master-port 29500 --token tok"
    cfg = parse_args([*argv.split(), CHILD], env={})
    env = child_env(cfg, 2, 29500, restart_count=1, base={"KEEP": "1", "RANK": "9"})
    assert env == {
        "KEEP": "1",
        "RANK": "6",
        "LOCAL_RANK": "2",
        "WORLD_SIZE": "12",
        "LOCAL_WORLD_SIZE": "4",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29500",
        "RPCDIST_TOKEN": "tok",
        "RPCDIST_RESTART_COUNT": "1",
        "RPCDIST_MAX_RESTARTS": "0",
    }


def test_child_env_takes_the_round_s_node_rank_size_and_job_token():
    cfg = LaunchConfig(
        nproc_per_node=2,
        nnodes=4,
        node_rank=0,
        master_addr="127.0.0.1",
        master_port=1234,
        max_restarts=3,
        token="launchers-secret",
        command=(CHILD,),
        min_nodes=2,
    )
    env = child_env(cfg, 1, 4321, restart_count=2, node_rank=2, nnodes=3, token="job", base={})
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == ("5", "6", "2")
    assert (env["MASTER_PORT"], env["RPCDIST_TOKEN"]) == ("4321", "job")
    assert (env["RPCDIST_RESTART_COUNT"], env["RPCDIST_MAX_RESTARTS"]) == ("2", "3")


def test_workers_are_started_to_die_with_the_launcher():
    argv = worker_argv(["script.py", "--x"])
    assert argv[0] == sys.executable and argv[-2:] == ["script.py", "--x"]
    if sys.platform.startswith("linux"):
        assert "prctl" in argv[4]  # PR_SET_PDEATHSIG before exec'ing the worker
