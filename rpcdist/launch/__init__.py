"""``rpcdist-run`` (also ``python -m rpcdist.launch``): start the worker processes of a job.

Usage::

    rpcdist-run --nproc-per-node N [--nnodes M --node-rank K
                --master-addr A --master-port P] [--max-restarts R]
                [--token T] [--grace-period S] [--no-prefix] script.py [args...]
    rpcdist-run --nproc-per-node N --nnodes MIN:MAX --master-addr A --master-port P
                --token T [--max-restarts R] script.py [args...]     # elastic
    rpcdist-run --nproc-per-node N [...] -m package.module [args...]

Each node runs one launcher, which starts ``N`` children as
``sys.executable script.py args`` with, in their environment:

| variable | value |
| --- | --- |
| ``RANK`` | ``node_rank * N + local_rank`` |
| ``LOCAL_RANK`` | ``0 .. N-1`` |
| ``WORLD_SIZE`` | ``nodes * N`` (nodes of the current attempt) |
| ``LOCAL_WORLD_SIZE`` | ``N`` |
| ``MASTER_ADDR`` | ``--master-addr`` (default ``127.0.0.1``) |
| ``MASTER_PORT`` | the workers' store port: on one node ``--master-port`` or a free one; with several nodes a free one node 0 picks; fresh for every attempt unless given |
| ``RPCDIST_TOKEN`` | the job token: on one node ``--token``, else ``RPCDIST_TOKEN`` from the launcher's environment, else a fresh random one; with several nodes a random one node 0 makes for the job |
| ``RPCDIST_RESTART_COUNT`` | restarts of the job so far (0 on the first run) |
| ``RPCDIST_MAX_RESTARTS`` | ``--max-restarts`` |
| ``RPCDIST_FT_ADDR`` | with ``--restart-policy rank``: the fault-tolerant mode's coordinator, run by the launcher |

so ``rpcdist.init_rpc(name)`` with the default ``env://`` needs no rank,
world size or address. Every line a child prints is shown with its rank in
front (``[rank 3] ...``; ``--no-prefix`` turns that off).

With several nodes, node 0's launcher serves a rendezvous store on
``--master-addr:--master-port`` (guarded by ``--token``), and all launchers
start, stop and restart their workers together, one *round* at a time. When
a child exits with a non-zero code, or a node is lost, leaves or (elastic
jobs) joins, every worker is stopped (``SIGTERM``, then ``SIGKILL`` after
``--grace-period``) and the job starts again, up to ``--max-restarts``
times; after that every launcher exits with the failing child's code
(``128 + n`` for a child killed by signal ``n``; 1 for a lost node).
With ``--restart-policy rank`` (one node) only the failed child is started
again, up to ``--max-restarts`` times per rank (its
``RPCDIST_RESTART_COUNT`` counts its own restarts), for training with
``rpcdist.parallel.FaultTolerance``, whose coordinator the launcher runs.
``SIGINT`` and ``SIGTERM`` sent to a launcher are forwarded to its children
(a second one kills them at once): node 0 then ends the job with ``128 + n``,
another node leaves it. Children are always reaped before a launcher
returns, and on Linux they die with it even when it is killed. Bad
arguments exit with code 2. See ``docs/launcher.md``.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
from collections.abc import Sequence

from .._errors import ConfigError, ConnectError, RpcdistError
from ._args import LaunchConfig, parse_args, parser
from ._children import child_env
from ._elastic import run_node
from ._hosting import free_port

__all__ = ["LaunchConfig", "child_env", "free_port", "launch", "main", "parse_args"]

logger = logging.getLogger(__name__)

for _obj in (LaunchConfig, child_env, free_port, parse_args):
    _obj.__module__ = __name__
del _obj


def launch(config: LaunchConfig) -> int:
    """Run this node's part of the job described by ``config``; return the exit code.

    ``0`` when every child succeeded, the failing child's code when the
    restarts are used up, ``128 + n`` when the launcher (node 0's, with
    several nodes) got signal ``n``.

    Raises:
        ConfigError: no free port could be picked on ``config.master_addr``,
            or this launcher does not fit the job node 0 started.
        ConnectError: the launchers' store can be neither served nor reached.
        OSError: a child could not be started.
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:  # the usual case: no event loop runs in this thread
        return asyncio.run(run_node(config))
    # Called from a coroutine (a notebook, say): run in a thread of its own.
    result: list[int] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            result.append(asyncio.run(run_node(config)))
        except BaseException as exc:  # re-raised in the caller's thread
            errors.append(exc)

    thread = threading.Thread(target=run, name="rpcdist-launch")
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    return result[0]


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point of ``rpcdist-run``; returns the exit code."""
    args = sys.argv[1:] if argv is None else list(argv)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="[rpcdist-run] %(levelname)s: %(message)s")
    try:
        config = parse_args(args)
        return launch(config)
    except ConfigError as exc:
        sys.stderr.write(f"{parser().format_usage()}rpcdist-run: error: {exc}\n")
        return 2
    except SystemExit as exc:  # --help
        return exc.code if isinstance(exc.code, int) else 0
    except (ConnectError, RpcdistError) as exc:  # the rendezvous failed
        logger.error("%s", exc)
        return 1
    except OSError as exc:  # the workers could not be started
        logger.error("cannot start the workers: %s", exc)
        return 1
