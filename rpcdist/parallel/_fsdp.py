"""``FullyShardedDataParallel``: parameters, gradients and optimizer state sharded 1/p.

The root wrapper splits the model into units (its auto-wrap policy picks
submodules, which are replaced by nested wrappers; the root keeps what is
left). Each unit is a :class:`FlatUnit`. An iteration, per unit:

* forward: wait for the unit's all-gather (prefetched while the previous
  unit computed), start the next unit's, install views, compute, free the
  gathered copy (``full_shard``; the root and the last unit, which backward
  needs first, stay gathered until their backward);
* backward: a hook on the unit's outputs gathers it again (and prefetches
  the unit that runs next in backward); once every view's gradient is in,
  the flat gradient is reduce-scattered asynchronously and the gathered copy
  freed; the shard gradients are complete when ``backward()`` returns.

Units are prefetched in the order they appear in the model (pre-order of
``named_modules``), the same on every rank, so collectives always match.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np

from .. import collectives as dist
from .._errors import ConfigError
from ..nn import Module
from ..tensor import Tensor, is_grad_enabled
from ._arrays import group_size, xp_of
from ._fsdp_ft import FsdpFaultTolerance
from ._fsdp_policy import MixedPrecision, WrapPolicy, as_wrap_policy, resolve_mixed_precision
from ._fsdp_state import full_state_dict, load_optim, load_state, optim_state, sharded_state_dict
from ._fsdp_unit import FlatUnit, Shared, Slot
from ._ft import FaultTolerance
from ._join import Join, Joinable, JoinHook
from ._sync import broadcast_tensors, check_same_model, describe

__all__ = ["FullyShardedDataParallel"]

_WHAT = "FullyShardedDataParallel"
_STRATEGIES = ("full_shard", "shard_grad_op", "no_shard")


class FullyShardedDataParallel(Module, Joinable):
    """Data parallelism with parameters, gradients and optimizer state sharded across ranks.

    Each unit's parameters are flattened into one vector, padded to a
    multiple of the group size, and each rank keeps one 1/p slice of it as
    a parameter (``parameters()`` yields these shards, so any
    :mod:`rpcdist.optim` optimizer keeps 1/p of the state). Around each
    unit's computation the full vector is all-gathered and then freed;
    gradients are reduce-scattered (averaged) so each rank gets its
    shard's. At construction every rank takes rank 0's parameters.

    Args:
        module: The model, the same on every rank.
        process_group: The ranks to shard over (None: the default group).
        auto_wrap_policy: ``policy(submodule, numel) -> bool`` deciding which
            submodules become units of their own, e.g.
            :class:`size_based_auto_wrap_policy` or :class:`ModuleWrapPolicy`
            (None: the whole model is one unit); PyTorch's form
            ``policy(module, recurse, nonwrapped_numel)`` works too.
        sharding_strategy: ``"full_shard"`` (ZeRO-3: free gathered
            parameters after each unit's forward and backward),
            ``"shard_grad_op"`` (ZeRO-2: keep them from forward until that
            unit's backward) or ``"no_shard"`` (like DDP: every rank keeps
            everything, gradients all-reduced).
        mixed_precision: None, ``"float16"``, ``"bfloat16"`` or a
            :class:`MixedPrecision`: communicate parameters and gradients in
            that precision; the shards stay in their own dtype.
        fault_tolerance: A :class:`FaultTolerance`: no process group; the
            shards are re-sharded over each step's members, each rank also
            keeping its successor's shard; gradients are averaged by
            ``fault_tolerance.commit()`` (``docs/fault-tolerance.md``).

    Raises:
        ConfigError: bad arguments, this process is not in the group, the
            model differs across ranks, a unit mixes dtypes or frozen and
            trained parameters, or one parameter is shared by two units.
    """

    __module__ = "rpcdist.parallel"

    def __init__(
        self,
        module: Module,
        process_group: dist.ProcessGroup | None = None,
        auto_wrap_policy: Callable[[Module, int], bool] | None = None,
        sharding_strategy: str = "full_shard",
        mixed_precision: str | MixedPrecision | None = None,
        fault_tolerance: FaultTolerance | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(module, Module):
            raise ConfigError(f"{_WHAT}: module must be an rpcdist.nn.Module, got {module!r:.60}")
        if isinstance(module, FullyShardedDataParallel):
            raise ConfigError(f"{_WHAT}: the module is already wrapped in {_WHAT}")
        if sharding_strategy not in _STRATEGIES:
            raise ConfigError(
                f"{_WHAT}: sharding_strategy must be one of {list(_STRATEGIES)}, "
                f"got {sharding_strategy!r}"
            )
        wrap_policy = None if auto_wrap_policy is None else as_wrap_policy(auto_wrap_policy)
        mp = resolve_mixed_precision(mixed_precision)
        params = list(module.named_parameters())
        buffers = list(module.named_buffers())
        if fault_tolerance is not None:  # the members of each step: see _fsdp_ft.py
            rank, world = 0, 1  # until the first quorum; every rank holds everything
        else:
            rank, world = group_size(process_group, _WHAT)
            check_same_model(
                describe(params, "parameter") + describe(buffers, "buffer"), process_group, _WHAT
            )
            broadcast_tensors([p for _, p in params] + [b for _, b in buffers], 0, process_group)
        first = next((t.data for _, t in params + buffers), None)
        shared = Shared(
            process_group, rank, world, sharding_strategy, mp, np if first is None else xp_of(first)
        )
        names = {id(p): n for n, p in params}
        claimed: set[int] = set()
        self.process_group = process_group
        self.sharding_strategy = sharding_strategy
        self.mixed_precision = mp

        def make(sub: Module) -> FullyShardedDataParallel:
            child: FullyShardedDataParallel = object.__new__(FullyShardedDataParallel)
            Module.__init__(child)
            child._setup(sub, shared, names, claimed, root=False)
            return child

        if wrap_policy is not None:
            _wrap(module, wrap_policy, make)
        self._setup(module, shared, names, claimed, root=True)
        order = [m for m in self.modules() if isinstance(m, FullyShardedDataParallel)]
        shared.units = [m.unit for m in order]
        for i, u in enumerate(shared.units):
            u.index = i
        self._param_names = [n for n, _ in params]
        self._orig_buffers = buffers
        self._divide_by_initial_world_size = True
        self.fault_tolerance = fault_tolerance
        if fault_tolerance is not None:
            shared.ft = fault_tolerance
            FsdpFaultTolerance(self, fault_tolerance)

    def _setup(
        self, module: Module, shared: Shared, names: dict[int, str], claimed: set[int], root: bool
    ) -> None:
        self.module = module
        self._shared = shared
        self._is_root = root
        self.unit = _make_unit(module, shared, names, claimed)
        self._flat_param = self.unit.shard

    # ---------------------------------------------------------------- forward
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Gather this unit, run the module, free it (per the strategy).

        Raises:
            CollectiveError: a gather or a Join exchange failed.
        """
        sh, unit = self._shared, self.unit
        grad = is_grad_enabled()
        if self._is_root:
            self._begin_iteration(grad)
        unit.wait_gather()
        if sh.sharded and unit.index + 1 < len(sh.units):
            sh.units[unit.index + 1].start_gather(prefetch=True)
        unit.install(grad)
        out = self.module(*args, **kwargs)
        if grad:
            _on_output_grads(out, self._pre_backward)
        # full_shard frees after forward, except the root and the last unit:
        # backward starts with them and would gather them again at once.
        last = unit.index == len(sh.units) - 1
        if not grad or (sh.strategy == "full_shard" and not self._is_root and not last):
            unit.free(graph_holds_views=grad)
        return out

    def _begin_iteration(self, grad: bool) -> None:
        sh = self._shared
        sh.log = []
        sh.pending.clear()  # left over only by a backward that raised
        if not sh.kept:  # e.g. after a forward whose backward never ran: maybe stale
            for u in sh.units:
                u.free()
        sh.kept = False
        if not (grad and sh.sync):
            return
        active = Join.notify_join_context(self) if Join.context_of(self) is not None else None
        if active is None or self._divide_by_initial_world_size:
            sh.divisor = float(sh.world)
        else:
            sh.divisor = float(len(active))

    def _pre_backward(self) -> None:
        sh, unit = self._shared, self.unit
        unit.wait_gather()
        if sh.sharded and len(sh.units) > 1:
            nxt = sh.units[(unit.index - 1) % len(sh.units)]
            if nxt.index != 0:
                nxt.start_gather(prefetch=True)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backwards inside accumulate full-size gradients locally, without communication.

        The first synchronised backward after the block reduces the sum.
        Under ``full_shard`` forwards still all-gather parameters.
        """
        sh = self._shared
        old, sh.sync = sh.sync, False
        try:
            yield
        finally:
            sh.sync = old

    # ------------------------------------------------------------------ state
    def state_dict(self, kind: str = "full", *, rank0_only: bool = True) -> dict[str, Any]:  # type: ignore[override]
        """The model's parameters and buffers under their original names.

        Args:
            kind: ``"full"``: whole arrays, gathered (a collective: call it on
                every rank); ``"sharded"``: this rank's shards only, no
                communication (load them back at the same world size).
            rank0_only: For ``"full"``: other ranks get an empty dict.

        Raises:
            ConfigError: an unknown ``kind``.
        """
        if kind == "full":
            return full_state_dict(self, rank0_only)
        if kind == "sharded":
            return sharded_state_dict(self)
        raise ConfigError(f"{_WHAT}.state_dict: kind must be 'full' or 'sharded', got {kind!r}")

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True) -> Any:
        """Load a full state dict (any world size; needed on every rank) or a sharded one.

        Raises:
            ConfigError: keys or shapes do not match, or a sharded dict was
                saved at another world size or rank.
        """
        return load_state(self, state_dict, strict)

    def optim_state_dict(self, optimizer: Any, *, rank0_only: bool = True) -> dict[str, Any]:
        """``optimizer``'s state gathered into full arrays keyed by parameter name (a collective).

        Loadable at any world size with :meth:`load_optim_state_dict`.
        """
        return optim_state(self, optimizer, rank0_only)

    def load_optim_state_dict(self, optimizer: Any, state: Mapping[str, Any]) -> None:
        """Give ``optimizer`` (over this model's shards) this rank's part of a full optimizer state.

        Raises:
            ConfigError: the saved state names parameters this model lacks.
        """
        load_optim(self, optimizer, state)

    # ------------------------------------------------------------------- Join
    def join_hook(self, **kwargs: Any) -> JoinHook:
        """The hook that shadows an iteration's collectives once this rank ran out of inputs.

        Args:
            **kwargs: ``optimizer`` (required): the optimizer over this
                model's shards, stepped in each shadowed iteration so this
                rank's shard keeps up; ``divide_by_initial_world_size``
                (default True) as for DDP.

        Raises:
            ConfigError: no ``optimizer`` was given to ``Join``.
        """
        opt = kwargs.get("optimizer")
        if opt is None:
            raise ConfigError(
                f"{_WHAT} under Join needs the optimizer: Join([model], optimizer=opt), "
                "since a joined rank must still update its own shard"
            )
        self._divide_by_initial_world_size = bool(kwargs.get("divide_by_initial_world_size", True))
        return _FSDPJoinHook(self, opt)

    @property
    def join_process_group(self) -> dist.ProcessGroup | None:
        """The process group the model is sharded over."""
        return self.process_group

    def statistics(self) -> dict[str, Any]:
        """Units, bytes held per rank, and gather/prefetch/reduce counts since construction.

        ``prefetches`` counts the all-gathers started ahead of their unit
        (while another unit computed); ``transient_bytes`` and
        ``peak_transient_bytes`` are the gathered vectors and flat
        gradients alive now and at most.
        """
        sh = self._shared
        shard_bytes = sum(u.shard.data.nbytes for u in sh.units)
        grad_bytes = sum(u.shard.grad.data.nbytes for u in sh.units if u.shard.grad is not None)
        return {
            "units": len(sh.units),
            "shard_bytes": shard_bytes,
            "grad_bytes": grad_bytes,
            "transient_bytes": sh.live,
            "peak_transient_bytes": sh.peak,
            "gathers": sh.gathers,
            "prefetches": sh.prefetches,
            "reductions": sh.reductions,
        }

    def extra_repr(self) -> str:
        u = self.unit
        return f"strategy={self.sharding_strategy}, numel={u.numel}, shard={u.shard_size}"


class _FSDPJoinHook(JoinHook):
    """Replay this rank's last iteration's collectives with zero gradients, then step."""

    def __init__(self, model: FullyShardedDataParallel, optimizer: Any) -> None:
        self.model = model
        self.optimizer = optimizer

    def main_hook(self) -> None:
        model = self.model
        sh = model._shared
        ctx = Join.context_of(model)
        active = ctx.active if ctx is not None and ctx.active else [0]
        divide = model._divide_by_initial_world_size
        sh.divisor = float(sh.world if divide else len(active))
        self.optimizer.zero_grad()
        pending = [(sh.units[i], sh.units[i].shadow(kind)) for kind, i in sh.log]
        for unit, (out, work) in pending:
            work.wait()
            if out is not None:
                out *= unit.post_scale()
                unit.add_grad(out)
        self.optimizer.step()


def _wrap(module: Module, policy: WrapPolicy, make: Callable[[Module], Module]) -> int:
    """Replace submodules the policy picks (bottom-up); the unclaimed numel of ``module``."""
    total = sum(int(p.data.size) for p in module._parameters.values() if p is not None)
    for name, child in list(module._modules.items()):
        if child is None or isinstance(child, FullyShardedDataParallel):
            continue
        if not policy.descend(child, _numel(child)):
            total += _numel(child)
            continue
        n = _wrap(child, policy, make)
        if n and policy.wrap(child, n):
            wrapper = make(child)
            module._modules[name] = wrapper
            object.__setattr__(module, name, wrapper)
        else:
            total += n
    return total


def _numel(module: Module) -> int:
    """The parameters under ``module``, in elements (each shared one once)."""
    seen = {id(p): int(p.data.size) for p in module.parameters()}
    return sum(seen.values())


def _make_unit(
    module: Module, shared: Shared, names: dict[int, str], claimed: set[int]
) -> FlatUnit:
    """Take the parameters under ``module`` (not under nested wrappers) into one flat unit."""
    owners: dict[int, list[tuple[Module, str]]] = {}
    params: dict[int, Any] = {}
    stack = [module]
    seen: set[int] = set()
    while stack:
        mod = stack.pop()
        if id(mod) in seen:
            continue
        seen.add(id(mod))
        for attr, p in list(mod._parameters.items()):
            if p is None:
                continue
            if id(p) in claimed:
                raise ConfigError(
                    f"{_WHAT}: parameter {names.get(id(p), attr)!r} is shared by two units; "
                    "wrap the modules that share it in one unit"
                )
            params.setdefault(id(p), p)
            owners.setdefault(id(p), []).append((mod, attr))
        children = [c for c in mod._modules.values() if c is not None]
        stack.extend(c for c in reversed(children) if not isinstance(c, FullyShardedDataParallel))
    claimed.update(params)
    plist = list(params.values())
    dtypes = {p.data.dtype for p in plist}
    if len(dtypes) > 1:
        raise ConfigError(f"{_WHAT}: one unit mixes dtypes {sorted(map(str, dtypes))}")
    trainable = {p.requires_grad for p in plist}
    if len(trainable) > 1:
        raise ConfigError(f"{_WHAT}: one unit mixes frozen and trained parameters")
    slots: list[Slot] = []
    offset = 0
    for p in plist:
        slots.append(Slot(names.get(id(p), "?"), p.shape, offset, p.data.size, owners[id(p)]))
        offset += p.data.size
        for mod, attr in owners[id(p)]:
            del mod._parameters[attr]
            object.__setattr__(mod, attr, None)
    if plist:
        full = xp_of(plist[0].data).concatenate([p.data.reshape(-1) for p in plist])
    else:  # every parameter went to nested units: an empty unit on the model's device
        full = shared.xp.zeros(0, np.float32)
    unit = FlatUnit(0, slots, full, shared)
    unit.shard.requires_grad = not plist or plist[0].requires_grad
    return unit


def _on_output_grads(out: Any, hook: Callable[[], None]) -> None:
    """Call ``hook()`` when the gradient of any tensor in ``out`` arrives."""
    if isinstance(out, Tensor):
        if out.requires_grad and out.grad_fn is not None:
            out.register_hook(lambda g: hook())
    elif isinstance(out, list | tuple):
        for o in out:
            _on_output_grads(o, hook)
    elif isinstance(out, Mapping):
        for o in out.values():
            _on_output_grads(o, hook)
