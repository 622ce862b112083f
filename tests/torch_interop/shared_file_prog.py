"""A hybrid program: RPC and a torch Gloo process group on one ``file://``
rendezvous, as PyTorch's own RPC tests and DDP + RPC programs set them up."""

from __future__ import annotations

from typing import Any

import flavors


def run(rank: int, world: int, init_method: str, flavor: str) -> Any:
    import torch
    import torch.distributed as dist

    M = flavors.use(flavor)
    opts = M.rpc.TensorPipeRpcBackendOptions(init_method=init_method)
    M.rpc.init_rpc(f"w{rank}", rank=rank, world_size=world, rpc_backend_options=opts)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    t = torch.full((4,), float(rank + 1))
    dist.all_reduce(t)
    peer = M.rpc.rpc_sync(f"w{(rank + 1) % world}", torch.add, args=(torch.ones(2), rank))
    dist.barrier()
    dist.destroy_process_group()
    M.rpc.shutdown()
    return t.tolist(), peer.tolist()
