"""End-to-end launcher job: every worker calls the next one in a ring, then shuts down.

Rank, world size, address, port and token all come from the launcher's
environment, so ``init_rpc`` gets nothing but a name.
"""

from __future__ import annotations

import os

import rpcdist


def greet(sender: str, value: int) -> tuple[str, str, int]:
    """Runs on the callee: who answered, who asked, and ``value + 1``."""
    return rpcdist.get_worker_info().name, sender, value + 1


def main() -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    me = f"worker{rank}"
    rpcdist.init_rpc(me)
    try:
        callee, caller, value = rpcdist.rpc_sync(
            f"worker{(rank + 1) % world}", greet, args=(me, 100 * rank)
        )
        assert caller == me and value == 100 * rank + 1, (callee, caller, value)
        print(f"RING {me} -> {callee} value={value} world={world}", flush=True)
    finally:
        rpcdist.shutdown()


if __name__ == "__main__":
    main()
