"""FSDP checkpoints: full and sharded model state, and full optimizer state.

A *full* state dict holds every original parameter (gathered) and buffer
under its original name, exactly like the unwrapped module's, so it loads
into a plain module, into DDP, or into FSDP at any world size (each rank
keeps its own slice). A *sharded* one holds this rank's flat shards; it is
cheap (no communication) but loads only at the same world size and rank.
The full optimizer state keys each original parameter's state arrays by
name, so it too reshards to any world size.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from .._errors import ConfigError
from ..nn import IncompatibleKeys
from ..tensor import Tensor
from ..tensor._device import move_to
from ._arrays import host
from ._types import ShardedModel

__all__ = ["full_state_dict", "load_optim", "load_state", "optim_state", "sharded_state_dict"]

_KEY = "_fsdp_shards"


def _buffers(model: ShardedModel) -> list[tuple[str, Tensor]]:
    return model._orig_buffers


def full_state_dict(model: ShardedModel, rank0_only: bool) -> dict[str, Any]:
    """Every parameter gathered (a collective on every rank) and every buffer, by name."""
    params: dict[str, Any] = {}
    for unit in model._shared.units:
        full = host(unit.full_vector())
        for s in unit.slots:
            params[s.name] = np.array(full[s.offset : s.offset + s.numel].reshape(s.shape))
    if rank0_only and model._shared.rank != 0:
        return {}
    out = {n: params[n] for n in model._param_names if n in params}
    for name, b in _buffers(model):
        out[name] = np.array(host(b.data))
    return out


def sharded_state_dict(model: ShardedModel) -> dict[str, Any]:
    """This rank's shards (plus the buffers), without communication."""
    sh = model._shared
    shards = [np.array(host(u.shard.data)) for u in sh.units]
    out: dict[str, Any] = {
        _KEY: {
            "world_size": sh.world,
            "rank": sh.rank,
            "numels": [u.numel for u in sh.units],
            "shard_sizes": [u.shard_size for u in sh.units],
            "shards": shards,
        }
    }
    for name, b in _buffers(model):
        out[name] = np.array(host(b.data))
    return out


def _array(value: Any) -> Any:
    if isinstance(value, Tensor):
        return value.data
    return value if hasattr(value, "shape") else np.asarray(value)


def load_state(model: ShardedModel, sd: Mapping[str, Any], strict: bool) -> IncompatibleKeys:
    """Load a full or a sharded state dict into ``model``'s shards and buffers.

    Raises:
        ConfigError: missing/unexpected keys (strict), a shape differs, or a
            sharded dict from another world size, rank or model.
    """
    sh = model._shared
    for u in sh.units:
        u.free()  # a gathered copy would be stale
    sh.kept = False
    buffers = dict(_buffers(model))
    if _KEY in sd:
        meta = sd[_KEY]
        numels = [u.numel for u in sh.units]
        sizes = [u.shard_size for u in sh.units]
        if (
            (meta["world_size"], meta["rank"]) != (sh.world, sh.rank)
            or list(meta["numels"]) != numels
            or list(meta.get("shard_sizes", sizes)) != sizes
        ):
            raise ConfigError(
                f"FullyShardedDataParallel.load_state_dict: the sharded state dict is from rank "
                f"{meta['rank']} of {meta['world_size']} (unit sizes {list(meta['numels'])}); "
                f"this is rank {sh.rank} of {sh.world} ({numels}), or the sharding strategy "
                "differs; save a full state dict to change the world size or strategy"
            )
        for u, arr in zip(sh.units, meta["shards"]):
            u.shard.data[...] = move_to(_array(arr), u.shard.device)
        names: list[str] = [_KEY]
    else:
        names = list(model._param_names)
        missing = [n for n in names + list(buffers) if n not in sd]
        unexpected = [k for k in sd if k not in names and k not in buffers]
        if (missing and (strict or not sd)) or (strict and unexpected):
            raise ConfigError(
                f"FullyShardedDataParallel.load_state_dict (rank {sh.rank}): missing keys "
                f"{missing[:8]}, unexpected keys {unexpected[:8]} (a full state dict is "
                "needed on every rank)"
            )
        for u in sh.units:
            if not u.slots or any(s.name not in sd for s in u.slots):
                continue
            parts = []
            for s in u.slots:
                arr = host(_array(sd[s.name]))
                if tuple(arr.shape) != tuple(s.shape):
                    raise ConfigError(
                        f"FullyShardedDataParallel.load_state_dict: {s.name!r} has shape "
                        f"{tuple(arr.shape)} in the state dict but {tuple(s.shape)} in the model"
                    )
                parts.append(arr.reshape(-1))
            piece = u.my_piece(np.concatenate(parts).astype(u.dtype))
            u.shard.data[...] = move_to(piece, u.shard.device)
    for name, b in buffers.items():
        if name in sd:
            b.data[...] = move_to(_array(sd[name]), b.device)
    missing = [n for n in names + list(buffers) if n not in sd]
    unexpected = [k for k in sd if k not in names and k not in buffers]
    return IncompatibleKeys(missing, unexpected)


def optim_state(model: ShardedModel, optimizer: Any, rank0_only: bool) -> dict[str, Any]:
    """The optimizer's per-shard state gathered and split by original parameter name."""
    sh = model._shared
    state: dict[str, dict[str, Any]] = {}
    for u in sh.units:
        st = optimizer.state.get(u.shard, {})
        for key in sorted(st):
            value = st[key]
            if hasattr(value, "shape") and tuple(value.shape) == u.shard.shape:
                full = host(u.gather_shaped(value))
                for s in u.slots:
                    state.setdefault(s.name, {})[key] = np.array(
                        full[s.offset : s.offset + s.numel].reshape(s.shape)
                    )
            else:
                for s in u.slots:
                    state.setdefault(s.name, {})[key] = value
    if rank0_only and sh.rank != 0:
        return {}
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    return {"state": state, "param_groups": groups}


def load_optim(model: ShardedModel, optimizer: Any, saved: Mapping[str, Any]) -> None:
    """Give ``optimizer`` this rank's slices of a state saved by :func:`optim_state`.

    Raises:
        ConfigError: the state names unknown parameters or has the wrong shapes.
    """
    sh = model._shared
    state = saved["state"]
    unknown = sorted(set(state) - set(model._param_names))
    if unknown:
        raise ConfigError(
            f"FullyShardedDataParallel.load_optim_state_dict: unknown parameters {unknown[:8]}"
        )
    for u in sh.units:
        per = [state.get(s.name) for s in u.slots]
        if not u.slots or any(p is None for p in per):
            continue
        new: dict[str, Any] = {}
        for key in per[0]:
            values = [p[key] for p in per]
            if all(
                hasattr(v, "shape") and tuple(v.shape) == s.shape for v, s in zip(values, u.slots)
            ):
                flat = np.concatenate([host(_array(v)).reshape(-1) for v in values])
                piece = u.my_piece(flat.astype(u.dtype))
                new[key] = move_to(piece, u.shard.device)
            else:
                v = values[0]
                new[key] = v.item() if hasattr(v, "shape") and v.shape == () else v
        optimizer.state[u.shard] = new
    for mine, group in zip(optimizer.param_groups, saved.get("param_groups", [])):
        for k, v in group.items():
            if k != "params":
                mine[k] = tuple(v) if isinstance(v, list) else v
