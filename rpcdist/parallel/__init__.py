"""Data parallelism: ``DistributedDataParallel``, ``Join``, comm hooks, ZeRO.

::

    from rpcdist import collectives as dist
    from rpcdist.parallel import DistributedDataParallel as DDP

    dist.init_process_group()
    model = DDP(MyModel())                 # rank 0's weights on every rank
    opt = rpcdist.optim.SGD(model.parameters(), lr=0.1)
    for x, y in my_shard_of_the_data:
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()                    # gradients averaged across ranks
        opt.step()

Gradients are averaged in buckets whose all-reduces start while backward
still runs. ``Join([model])`` lets ranks run different numbers of batches;
``register_comm_hook`` swaps the all-reduce for compression
(:mod:`rpcdist.parallel.comm_hooks`); ``ZeroRedundancyOptimizer`` shards
the optimizer state. ``FullyShardedDataParallel`` shards parameters,
gradients and optimizer state (``docs/fsdp.md``). ``FaultTolerance`` keeps
DDP, ZeRO and FSDP training going when ranks die or join, re-sharding ZeRO's
and FSDP's slices over the survivors (``docs/fault-tolerance.md``).
See ``docs/ddp.md``.
"""

from __future__ import annotations

from . import comm_hooks
from ._bucket import GradBucket
from ._ddp import DistributedDataParallel
from ._fsdp import FullyShardedDataParallel
from ._fsdp_policy import MixedPrecision, ModuleWrapPolicy, size_based_auto_wrap_policy
from ._ft import FaultTolerance
from ._ft_coordinator import FaultToleranceCoordinator
from ._join import Join, Joinable, JoinHook
from ._zero import ZeroRedundancyOptimizer

__all__ = [
    "DistributedDataParallel",
    "FaultTolerance",
    "FaultToleranceCoordinator",
    "FullyShardedDataParallel",
    "GradBucket",
    "Join",
    "JoinHook",
    "Joinable",
    "MixedPrecision",
    "ModuleWrapPolicy",
    "ZeroRedundancyOptimizer",
    "comm_hooks",
    "size_based_auto_wrap_policy",
]
