"""The live state a fault-tolerant rank hands a rank that joins (``_ft.py``).

At the first step of each membership every joiner (a replacement, or at the
very first quorum every member but the lowest id) takes the live state from
one member: the state dicts of the objects registered with
``FaultTolerance.register_state`` (a module, an optimizer), the RNG, the
sampler's position, and what each fault-tolerant ``ZeroRedundancyOptimizer``
or ``FullyShardedDataParallel`` carries beside its shards
(``_ft_live()``: FSDP's module buffers, such as running statistics). The
shards themselves are re-sharded from the members' slices
(``_ft_shard.py``), so a registered sharded object is not sent, and of an
optimizer over shards only the options travel.
"""

from __future__ import annotations

import io
from typing import Any

from .._errors import ConfigError
from .._save import load, save
from ..tensor import default_generator

__all__ = ["LiveState"]


class LiveState:
    """The objects whose state travels to joiners, and how it is packed."""

    def __init__(self) -> None:
        self.objects: dict[str, Any] = {}
        #: Optimizers whose state a sharded object carries (only options travel).
        self.adopted: set[str] = set()

    def register(self, name: str, obj: Any, sharded: list[Any]) -> None:
        """Carry ``obj.state_dict()`` to joiners, unless a sharded object carries it.

        Raises:
            ConfigError: ``obj`` has no ``state_dict``/``load_state_dict``.
        """
        how = {c._ft_adopts(obj) for c in sharded}
        if "whole" in how:
            return  # a sharded object itself: re-sharded, not sent
        if "options" in how:
            self.adopted.add(name)
        if not hasattr(obj, "state_dict") or not hasattr(obj, "load_state_dict"):
            raise ConfigError(f"FaultTolerance.register_state: {name!r} has no state_dict")
        self.objects[name] = obj

    def adopt(self, sharded: Any) -> None:
        """A sharded object came: the registered objects it carries stop travelling."""
        for name, obj in list(self.objects.items()):
            how = sharded._ft_adopts(obj)
            if how == "whole":
                del self.objects[name]
            elif how == "options":
                self.adopted.add(name)

    def pack(self, step: int, sampler: Any, sharded: list[Any]) -> bytes:
        """This member's live state, serialised."""
        out: dict[str, Any] = {
            "step": step,
            "rng": default_generator().get_state(),
            "objects": {n: self._object_state(n, o) for n, o in self.objects.items()},
            "sharded": [obj._ft_live() for obj in sharded],
        }
        if sampler is not None:
            out["sampler"] = sampler.state_dict()
        buf = io.BytesIO()
        save(out, buf)
        return buf.getvalue()

    def unpack(self, payload: bytes, sampler: Any, sharded: list[Any]) -> bool:
        """Load a member's live state here; whether it had the sampler's."""
        state = load(io.BytesIO(payload))
        default_generator().set_state(state["rng"])
        for name, obj in self.objects.items():
            obj.load_state_dict(state["objects"][name])
        for obj, live in zip(sharded, state["sharded"], strict=True):
            obj._ft_take_live(live)
        if sampler is not None and "sampler" in state:
            sampler.load_state_dict(state["sampler"])
            return True
        return False

    def _object_state(self, name: str, obj: Any) -> Any:
        sd = obj.state_dict()
        if name in self.adopted:  # the sharded object carries the state itself
            return {"state": {}, "param_groups": sd["param_groups"]}
        return sd
