"""One member of a dynamic group, driven by a test through stdin/stdout.

Started as a launcher starts a worker (``RANK``, ``MASTER_ADDR``,
``MASTER_PORT``, ``RPCDIST_TOKEN`` in the environment) but without
``WORLD_SIZE``: ``init_rpc`` joins the running group. It then reads one JSON
command a line and answers each with one JSON line:

* ``{"op": "call", "to": name, "x": n}``: ``rpc_sync(to, operator.add, (n, 1))``;
* ``{"op": "info", "name": name}``: ``get_worker_info(name)``;
* ``{"op": "until", "present": bool, "name": name}``: wait (polling, up to
  ``timeout``) until ``name`` is (not) in this worker's table;
* ``{"op": "context", "to": name, "keep": bool}``: in a new distributed
  autograd context, ``to`` multiplies a tensor that requires grad (so it
  holds the context too); answers the context id, and with ``keep`` never
  leaves the context (a thread holds it until the process ends);
* ``{"op": "contexts", "count": n}``: wait (polling, up to ``timeout``)
  until this worker holds ``n`` autograd contexts;
* ``{"op": "shutdown"}``: a graceful ``shutdown()``; answers with the rpcdist
  threads still alive, then exits.

With ``DYNAMIC_MEMBER_WAIT=1`` in its environment it waits for one line on
stdin before ``init_rpc`` (started ahead, its imports done, it joins at once).

Answers: ``{"ok": value}`` or ``{"error": type name, "message": text}``.
Usage: ``python dynamic_member.py NAME [INIT_TIMEOUT]``.
"""

from __future__ import annotations

import json
import operator
import os
import queue
import sys
import threading
import time
from typing import Any

import numpy as np

import rpcdist
import rpcdist.autograd as dist_autograd
from rpcdist._rpc._context import current_agent
from rpcdist.tensor import Tensor


def _names() -> list[str]:
    return [w.name for w in current_agent().workers]


def _until(present: bool, name: str, timeout: float) -> list[str]:
    end = time.monotonic() + timeout
    while (name in _names()) != present:
        if time.monotonic() > end:
            raise TimeoutError(f"{name!r} still {'absent' if present else 'present'}: {_names()}")
        time.sleep(0.02)
    return _names()


def _context(to: str, keep: bool) -> int:
    got: queue.Queue[Any] = queue.Queue()

    def run() -> None:
        try:
            with dist_autograd.context() as cid:
                x = Tensor(np.ones(2), requires_grad=True)
                rpcdist.rpc_sync(to, operator.mul, args=(x, 2.0), timeout=30)
                got.put(cid)
                if keep:
                    threading.Event().wait()  # until the process ends
        except Exception as e:
            got.put(e)

    threading.Thread(target=run, daemon=True).start()
    out = got.get(timeout=60)
    if isinstance(out, Exception):
        raise out
    return int(out)


def _contexts(count: int, timeout: float) -> int:
    end = time.monotonic() + timeout
    while (held := rpcdist.statistics()["autograd_contexts"]) != count:
        if time.monotonic() > end:
            raise TimeoutError(f"{held} autograd contexts here after {timeout} s, not {count}")
        time.sleep(0.05)
    return held


def _run(cmd: dict[str, Any]) -> Any:
    op = cmd["op"]
    if op == "call":
        return rpcdist.rpc_sync(cmd["to"], operator.add, args=(cmd["x"], 1), timeout=30)
    if op == "info":
        info = rpcdist.get_worker_info(cmd["name"])
        return [info.name, info.id]
    if op == "until":
        return _until(cmd["present"], cmd["name"], cmd.get("timeout", 30.0))
    if op == "context":
        return _context(cmd["to"], cmd.get("keep", False))
    if op == "contexts":
        return _contexts(cmd["count"], cmd.get("timeout", 30.0))
    raise ValueError(f"unknown op {op!r}")


def _say(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def main() -> None:
    name = sys.argv[1]
    init_timeout = float(sys.argv[2]) if len(sys.argv) > 2 else 60.0
    if os.environ.get("DYNAMIC_MEMBER_WAIT") == "1":
        sys.stdin.readline()
    try:
        rpcdist.init_rpc(name, options=rpcdist.RpcOptions(init_timeout=init_timeout))
    except Exception as e:
        _say({"error": type(e).__name__, "message": str(e)})
        return
    _say({"ok": _names()})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "shutdown":
            rpcdist.shutdown()
            alive = [t.name for t in threading.enumerate() if t.name.startswith("rpcdist")]
            _say({"ok": alive})
            return
        try:
            _say({"ok": _run(cmd)})
        except Exception as e:
            _say({"error": type(e).__name__, "message": str(e)})


if __name__ == "__main__":
    main()
