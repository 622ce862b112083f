"""Worker entry points for the FSDP tests (spawned children) and their cases.

Models, data and the one-process oracle are DDP's (``ddp_workers``): every
rank reads ``batch(step, rank)`` and the oracle trains on the union.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ddp_workers import WithBuffer, batch, init, loss_of, mlp

import rpcdist
from rpcdist import ConfigError, nn, optim
from rpcdist import collectives as dist
from rpcdist.parallel import FullyShardedDataParallel as FSDP
from rpcdist.parallel import Join, ModuleWrapPolicy, size_based_auto_wrap_policy

STRATEGIES = ("full_shard", "shard_grad_op", "no_shard")
OPTS: dict[str, Callable[[Any], Any]] = {
    "sgd": lambda ps: optim.SGD(ps, lr=0.1, momentum=0.9),
    "adam": lambda ps: optim.Adam(ps, lr=0.01),
}
LINEARS = ModuleWrapPolicy({nn.Linear})


def fit(model: Any, o: Any, rank: int, steps: range, micro: int = 1) -> None:
    for s in steps:
        o.zero_grad()
        for k in range(micro):
            x, y = batch(s, rank, k)
            if k < micro - 1:
                with model.no_sync():
                    loss_of(model, x, y).backward()
            else:
                loss_of(model, x, y).backward()
        o.step()


def state_bytes(o: Any) -> int:
    return sum(v.nbytes for st in o.state.values() for v in st.values() if hasattr(v, "nbytes"))


def training_cases(rank: int, world: int, init_method: str) -> dict[str, Any]:
    """Every strategy x optimizer, 3 steps; no_sync; memory; policies; state dicts."""
    init(rank, world, init_method)
    out: dict[str, Any] = {}
    for strategy in STRATEGIES:
        for name, make_opt in OPTS.items():
            model = FSDP(mlp(rank + 1), auto_wrap_policy=LINEARS, sharding_strategy=strategy)
            o = make_opt(list(model.parameters()))
            fit(model, o, rank, range(3))
            out[f"{strategy}_{name}"] = model.state_dict(rank0_only=False)
            out[f"{strategy}_{name}_stats"] = model.statistics()
            out[f"{strategy}_{name}_optim_bytes"] = state_bytes(o)
    # One unit for the whole model, and a size policy that wraps only big layers.
    for label, policy in (("one_unit", None), ("by_size", size_based_auto_wrap_policy(100))):
        model = FSDP(mlp(rank + 1), auto_wrap_policy=policy)
        o = OPTS["adam"](list(model.parameters()))
        fit(model, o, rank, range(3))
        out[label] = model.state_dict(rank0_only=False)
        out[f"{label}_units"] = model.statistics()["units"]
    # no_sync: three micro-batches, one reduction per unit per step.
    model = FSDP(mlp(rank + 1), auto_wrap_policy=LINEARS)
    o = OPTS["sgd"](list(model.parameters()))
    fit(model, o, rank, range(2), micro=3)
    out["no_sync"] = model.state_dict(rank0_only=False)
    out["no_sync_reductions"] = model.statistics()["reductions"]
    # rank0_only and the DDP-free reference memory.
    out["rank0_only"] = model.state_dict()
    plain = mlp(1)
    o = OPTS["adam"](list(plain.parameters()))
    fit(plain, o, 0, range(1))
    out["unsharded_bytes"] = sum(p.data.nbytes for p in plain.parameters())
    out["unsharded_optim_bytes"] = state_bytes(o)
    return out


def checkpoint_cases(rank: int, world: int, init_method: str, path: str) -> dict[str, Any]:
    """Sharded and full round trips; at p=3 save a full checkpoint for p=2 to resume."""
    init(rank, world, init_method)
    out: dict[str, Any] = {}
    model = FSDP(mlp(rank + 1), auto_wrap_policy=LINEARS)
    o = OPTS["adam"](list(model.parameters()))
    fit(model, o, rank, range(2))
    full = model.state_dict(rank0_only=False)
    sharded = model.state_dict("sharded")
    osd = model.optim_state_dict(o, rank0_only=False)
    fresh = FSDP(mlp(50 + rank), auto_wrap_policy=LINEARS)
    rpcdist.save(sharded, f"{path}.shard{rank}")  # each rank its own file
    fresh.load_state_dict(rpcdist.load(f"{path}.shard{rank}"))
    out["sharded_round_trip"] = fresh.state_dict(rank0_only=False)
    other = FSDP(mlp(60 + rank), auto_wrap_policy=LINEARS)
    other.load_state_dict(full)
    out["full_round_trip"] = other.state_dict(rank0_only=False)
    out["full"] = full
    plain = mlp(70)
    plain.load_state_dict(full)
    out["into_plain_module"] = plain.state_dict()
    wrong = dict(sharded)
    wrong["_fsdp_shards"] = {**sharded["_fsdp_shards"], "rank": (rank + 1) % world}
    out["wrong_rank"] = _error(lambda: other.load_state_dict(wrong))
    out["empty_full"] = _error(lambda: other.load_state_dict({}))
    if world == 3:
        ckpt = {"model": model.state_dict(), "optim": model.optim_state_dict(o)}
        if rank == 0:
            rpcdist.save(ckpt, path)
        else:
            out["others_empty"] = ckpt == {"model": {}, "optim": {}}
    # Optimizer state resharded through the full form on the same group.
    m2 = FSDP(mlp(80 + rank), auto_wrap_policy=LINEARS)
    m2.load_state_dict(full)
    o2 = OPTS["adam"](list(m2.parameters()))
    m2.load_optim_state_dict(o2, osd)
    fit(m2, o2, rank, range(2, 4))
    fit(model, o, rank, range(2, 4))
    out["resumed_same_p"] = m2.state_dict(rank0_only=False)
    out["continued"] = model.state_dict(rank0_only=False)
    # A subgroup: ranks 0 and 1 shard over themselves; rank 2 is refused.
    pair = dist.new_group([0, 1])
    if rank < 2:
        sub = FSDP(mlp(rank + 1), process_group=pair, auto_wrap_policy=LINEARS)
        o3 = OPTS["adam"](list(sub.parameters()))
        fit(sub, o3, rank, range(3))
        out["subgroup"] = sub.state_dict(rank0_only=False)
    else:
        out["non_member"] = _error(lambda: FSDP(mlp(1), process_group=pair))
    dist.barrier()
    return out


def resume_cases(rank: int, world: int, init_method: str, path: str) -> dict[str, Any]:
    """Resume a checkpoint written at another world size (steps 2 and 3)."""
    init(rank, world, init_method)
    saved = rpcdist.load(path)
    model = FSDP(mlp(90 + rank), auto_wrap_policy=LINEARS)
    model.load_state_dict(saved["model"])
    o = OPTS["adam"](list(model.parameters()))
    model.load_optim_state_dict(o, saved["optim"])
    fit(model, o, rank, range(2, 4))
    return {"resumed": model.state_dict(rank0_only=False)}


def misc_cases(rank: int, world: int, init_method: str) -> dict[str, Any]:
    """Mixed precision, Join with uneven inputs, eval forward, argument errors."""
    init(rank, world, init_method)
    out: dict[str, Any] = {}
    for mp in ("float16", "bfloat16"):
        model = FSDP(mlp(rank + 1), auto_wrap_policy=LINEARS, mixed_precision=mp)
        o = OPTS["sgd"](list(model.parameters()))
        fit(model, o, rank, range(3))
        out[mp] = model.state_dict(rank0_only=False)
    batches = [2, 4, 3][:world]
    for strategy in STRATEGIES:
        model = FSDP(mlp(rank + 1), auto_wrap_policy=LINEARS, sharding_strategy=strategy)
        o = OPTS["sgd"](list(model.parameters()))
        with Join([model], optimizer=o):
            fit(model, o, rank, range(batches[rank]))
        out[f"join_{strategy}"] = model.state_dict(rank0_only=False)
    model = FSDP(mlp(rank + 1), auto_wrap_policy=LINEARS)
    o = OPTS["sgd"](list(model.parameters()))
    with Join([model], optimizer=o, divide_by_initial_world_size=False):
        fit(model, o, rank, range(batches[rank]))
    out["join_active_mean"] = model.state_dict(rank0_only=False)
    buffered = FSDP(WithBuffer(rank + 1), auto_wrap_policy=LINEARS)
    o = OPTS["sgd"](list(buffered.parameters()))
    fit(buffered, o, rank, range(3))
    out["with_buffer"] = buffered.state_dict(rank0_only=False)
    model = FSDP(mlp(rank + 1), auto_wrap_policy=LINEARS)
    with rpcdist.tensor.no_grad():
        x, _ = batch(0, 0)
        out["eval"] = model(rpcdist.tensor.tensor(x)).numpy()
    out["eval_freed"] = model.statistics()["transient_bytes"]
    # A forward with grad and no backward leaves units gathered; a load must not reuse them.
    model(rpcdist.tensor.tensor(x))
    model.load_state_dict(mlp(33).state_dict())
    with rpcdist.tensor.no_grad():
        out["after_load"] = model(rpcdist.tensor.tensor(x)).numpy()
    out["join_needs_optimizer"] = _error(lambda: model.join_hook())
    out["bad_strategy"] = _error(lambda: FSDP(mlp(1), sharding_strategy="zero4"))
    out["bad_mp"] = _error(lambda: FSDP(mlp(1), mixed_precision="int8"))
    out["twice"] = _error(lambda: FSDP(model))
    dist.barrier()
    return out


def _error(fn: Callable[[], Any]) -> str:
    try:
        fn()
    except ConfigError as exc:
        return f"ConfigError: {exc}"
    return "no error"
