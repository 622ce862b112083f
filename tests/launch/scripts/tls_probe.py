"""A launcher job that reports whether its store and its connections use TLS.

Certificates come from RPCDIST_TLS_CERT, _KEY and _CA, as the launcher
passes its environment on.
"""

from __future__ import annotations

import operator
import os

import rpcdist
from rpcdist._rpc._context import current_agent
from rpcdist._transport._tls import TlsStream


def main() -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    rpcdist.init_rpc(f"worker{rank}")
    try:
        peer = (rank + 1) % world
        # a call through the agent's loop, so that the link below is the one used
        assert rpcdist.rpc_async(peer, operator.add, args=(rank, 1)).wait(30) == rank + 1
        agent = current_agent()
        link = agent.links.get(peer)
        store_tls = agent.store is not None and agent.store._tls is not None
        link_tls = link is not None and isinstance(link._sock, TlsStream)
        print(f"TLS store={store_tls} link={link_tls}", flush=True)
    finally:
        rpcdist.shutdown()


if __name__ == "__main__":
    main()
