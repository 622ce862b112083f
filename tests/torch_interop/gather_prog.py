"""A program that uses torch's private RPC helpers as libraries do (PyTorch
Geometric's distributed loaders: gather who is who, then line up): run under
PyTorch RPC and under rpcdist.torch, it must learn the same things."""

from __future__ import annotations

from typing import Any

import flavors

M: Any = None


def run(rank: int, world: int, init_method: str, flavor: str) -> Any:
    global M
    M = flavors.use(flavor)
    rpc = M.rpc
    opts = flavors.options(flavor, init_method, num_worker_threads=8, rpc_timeout=60)
    before = rpc._is_current_rpc_agent_set()
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=world, rpc_backend_options=opts)
    rpc._set_rpc_timeout(30.0)
    roles = rpc.api._all_gather(("sampler" if rank else "trainer", rank * rank))
    again = rpc.api._all_gather(f"second-{rank}")
    pair = rpc.api._all_gather(-rank, worker_names={"w1", "w2"}) if rank else None
    rpc.api._barrier([f"w{r}" for r in range(world)])
    infos = sorted((w.name, w.id) for w in rpc._get_current_rpc_agent().get_worker_infos())
    me = rpc._get_current_rpc_agent().get_worker_info().name
    out = {
        "before": before,
        "during": rpc._is_current_rpc_agent_set(),
        "roles": roles,
        "again": again,
        "pair": pair,
        "infos": infos,
        "me": me,
        "timeout": rpc.get_rpc_timeout(),
    }
    rpc.shutdown()
    out["after"] = rpc._is_current_rpc_agent_set()
    return out
