"""Worker entry points for the DDP tests (importable by spawned children) and their oracles.

Every worker batches many cases into one process launch. Data comes from
``batch(step, rank, micro)``, so the parent can compute the oracle: one
process training on the global batch, in float64.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

import rpcdist
import rpcdist.tensor as rt
from rpcdist import AutogradError, ConfigError, nn, optim
from rpcdist import collectives as dist
from rpcdist.nn import functional as F
from rpcdist.parallel import DistributedDataParallel as DDP
from rpcdist.parallel import Join, ZeroRedundancyOptimizer, comm_hooks

F64 = np.float64
IN, HID, OUT, B = 6, 16, 3, 4


def mlp(seed: int, hidden: int = HID) -> nn.Module:
    """Three Linear layers (several buckets at small caps), float64."""
    g = rt.Generator().manual_seed(seed)
    return nn.Sequential(
        nn.Linear(IN, hidden, dtype=F64, generator=g),
        nn.Tanh(),
        nn.Linear(hidden, hidden, dtype=F64, generator=g),
        nn.Tanh(),
        nn.Linear(hidden, OUT, dtype=F64, generator=g),
    )


class Branchy(nn.Module):
    """``extra`` is used only when ``use_extra``; ``never`` is never used."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        g = rt.Generator().manual_seed(seed)
        self.trunk = nn.Linear(IN, 8, dtype=F64, generator=g)
        self.head = nn.Linear(8, OUT, dtype=F64, generator=g)
        self.extra = nn.Linear(8, OUT, dtype=F64, generator=g)
        self.never = nn.Linear(8, OUT, dtype=F64, generator=g)
        self.use_extra = False

    def forward(self, x: rt.Tensor) -> rt.Tensor:
        h = self.trunk(x).tanh()
        out = self.head(h)
        return out + self.extra(h) if self.use_extra else out


class WithBuffer(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        self.lin = nn.Linear(IN, OUT, dtype=F64, generator=rt.Generator().manual_seed(seed))
        self.register_buffer("scale", rt.tensor(np.ones(OUT)))

    def forward(self, x: rt.Tensor) -> rt.Tensor:
        return self.lin(x) * self.scale


def batch(step: int, rank: int, micro: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng([step, rank, micro])
    return rng.standard_normal((B, IN)), rng.integers(0, OUT, B)


def loss_of(model: Any, x: np.ndarray, y: np.ndarray) -> rt.Tensor:
    return F.cross_entropy(model(rt.tensor(x)), rt.tensor(y))


def grads(model: nn.Module) -> dict[str, np.ndarray | None]:
    return {
        n: None if p.grad is None else p.grad.numpy().copy() for n, p in model.named_parameters()
    }


def init(rank: int, world: int, init_method: str) -> None:
    dist.init_process_group(init_method=init_method, rank=rank, world_size=world, timeout=60)


# ----------------------------------------------------------------- oracles


def oracle(
    steps: int,
    world: int,
    *,
    make: Callable[[int], nn.Module] = mlp,
    opt: Callable[[Any], Any] = lambda ps: optim.SGD(ps, lr=0.1, momentum=0.9),
    micro: int = 1,
    batches: Sequence[int] | None = None,
    divide_by_world: bool = True,
    seed: int = 1,
    ranks: Sequence[int] | None = None,
    model: nn.Module | None = None,
    optimizer: Any = None,
    start: int = 0,
) -> tuple[nn.Module, Any]:
    """One process, global batches: what DDP must reproduce.

    ``batches[r]`` (Join) is how many steps rank ``r`` has data for; a step
    averages the ranks that still have data over ``world`` (or over
    themselves when not ``divide_by_world``).
    """
    m = model if model is not None else make(seed)
    o = optimizer if optimizer is not None else opt(list(m.parameters()))
    ranks = list(range(world)) if ranks is None else list(ranks)
    for s in range(start, steps):
        o.zero_grad()
        active = [r for i, r in enumerate(ranks) if batches is None or batches[i] > s]
        scale = 1.0 / (world if divide_by_world else len(active))
        for k in range(micro):
            total = None
            for r in active:
                x, y = batch(s, r, k)
                part = loss_of(m, x, y)
                total = part if total is None else total + part
            assert total is not None
            (total * scale).backward()
        o.step()
    return m, o


# ---------------------------------------------------------------- training


def train(
    rank: int,
    steps: int,
    *,
    group: Any = None,
    make: Callable[[int], nn.Module] = mlp,
    opt: Callable[[Any], Any] = lambda ps: optim.SGD(ps, lr=0.1, momentum=0.9),
    micro: int = 1,
    ddp_kw: dict[str, Any] | None = None,
    hook: tuple[Any, Any] | None = None,
) -> DDP:
    """DDP training; every rank starts from a different model (DDP takes rank 0's)."""
    model = DDP(make(rank + 1), process_group=group, **(ddp_kw or {}))
    if hook is not None:
        model.register_comm_hook(*hook)
    o = opt(list(model.parameters()))
    for s in range(steps):
        o.zero_grad()
        for k in range(micro):
            sync = k == micro - 1
            with contextlib.nullcontext() if sync else model.no_sync():
                x, y = batch(s, rank, k)
                loss_of(model, x, y).backward()
        o.step()
    assert model.statistics()["ddp_inflight"] == 0
    return model


def training_cases(rank: int, world: int, init_method: str) -> dict[str, Any]:
    """Plain DDP, bucket sizes, views or copies, no_sync: state dicts per case."""
    init(rank, world, init_method)
    out: dict[str, Any] = {}
    out["plain"] = train(rank, 4).module.state_dict()
    m = train(rank, 4, ddp_kw={"bucket_cap_mb": 1e-4, "gradient_as_bucket_view": False})
    out["tiny_buckets_copies"] = m.module.state_dict()
    out["tiny_buckets_buckets"] = m.statistics()["ddp_buckets"]
    out["one_bucket"] = train(rank, 4, ddp_kw={"bucket_cap_mb": 100}).module.state_dict()
    out["no_sync"] = train(rank, 3, micro=3).module.state_dict()
    # Gradients are views into the buckets, and stay so across iterations.
    v = train(rank, 2)
    p = next(iter(v.module.parameters()))
    out["grad_is_view"] = p.grad is not None and p.grad.data.base is not None
    # Gradients fed from outside .grad, as distributed autograd will: a
    # gradient map filled by the engine, grad_ready() per parameter, then
    # finalize() into another map.
    ext = DDP(mlp(rank + 1))
    x, y = batch(0, rank)
    loss = loss_of(ext, x, y)
    fed: dict[Any, Any] = {}
    rt.run_backward(rt.tensor_roots([loss]), grad_map=fed)
    for param in reversed(list(ext.module.parameters())):
        ext.reducer.grad_ready(param, fed[param])
    averaged: dict[Any, Any] = {}
    ext.reducer.finalize(averaged)
    out["external"] = {n: averaged[q] for n, q in ext.module.named_parameters()}
    out["external_left_grad_alone"] = all(q.grad is None for q in ext.module.parameters())
    dist.destroy_process_group()
    return out


# ------------------------------------------------------------------- hooks


def double_hook(state: Any, bucket: Any) -> rpcdist.Future:
    """The average times two, in place."""

    def twice(f: rpcdist.Future) -> Any:
        buf = f.value()
        buf *= 2
        return buf

    return comm_hooks.allreduce_hook(state, bucket).then(twice)


def new_array_hook(state: Any, bucket: Any) -> rpcdist.Future:
    """A new array (not the bucket's buffer) with the average minus one."""
    return comm_hooks.allreduce_hook(None, bucket).then(lambda f: f.value() - 1.0)


def one_backward(rank: int, hook: tuple[Any, Any] | None, **ddp_kw: Any) -> tuple[DDP, dict]:
    model = DDP(mlp(rank + 1), **ddp_kw)
    if hook is not None:
        model.register_comm_hook(*hook)
    x, y = batch(0, rank)
    loss_of(model, x, y).backward()
    return model, grads(model.module)


def hook_cases(rank: int, world: int, init_method: str) -> dict[str, Any]:
    init(rank, world, init_method)
    out: dict[str, Any] = {}
    for name, hook in [
        ("none", None),
        ("allreduce", (None, comm_hooks.allreduce_hook)),
        ("double", (None, double_hook)),
        ("new_array", (None, new_array_hook)),
        ("fp16", (None, comm_hooks.fp16_compress_hook)),
        ("bf16", (None, comm_hooks.bf16_compress_hook)),
    ]:
        out[name] = one_backward(rank, hook)[1]
    # PowerSGD with full rank and no size threshold reconstructs exactly.
    exact = comm_hooks.PowerSGDState(
        matrix_approximation_rank=HID, start_powerSGD_iter=0, min_compression_rate=0
    )
    out["powersgd_exact"] = one_backward(rank, (exact, comm_hooks.powerSGD_hook))[1]
    # Rank 1: error feedback keeps exactly what compression dropped.
    state = comm_hooks.PowerSGDState(matrix_approximation_rank=1, start_powerSGD_iter=0)
    seen: dict[int, np.ndarray] = {}

    def spy(st: Any, bucket: Any) -> rpcdist.Future:
        seen[bucket.index()] = bucket.buffer().copy()
        return comm_hooks.powerSGD_hook(st, bucket)

    model, g = one_backward(rank, (state, spy), bucket_cap_mb=1e-4)
    feedback = []
    for b in model.reducer.buckets:  # one parameter each; matrices are compressed
        if b.gradients()[0].ndim < 2:
            continue
        err = state.error_dict[b.index()]
        feedback.append(float(np.abs(seen[b.index()] - b.buffer() - err).max()))
    out["powersgd_feedback_residual"] = max(feedback)
    out["powersgd_rank1"] = g
    out["powersgd_stats"] = state.compression_stats()
    out["powersgd_iter"] = state.iter
    # Before start_powerSGD_iter it is a plain all-reduce.
    late = comm_hooks.PowerSGDState(start_powerSGD_iter=5)
    out["powersgd_before_start"] = one_backward(rank, (late, comm_hooks.powerSGD_hook))[1]
    # Hooks train: three steps of bf16 and PowerSGD (warm start) stay in step across ranks.
    out["bf16_train"] = train(
        rank, 3, hook=(None, comm_hooks.bf16_compress_hook)
    ).module.state_dict()
    ps = comm_hooks.PowerSGDState(matrix_approximation_rank=2, start_powerSGD_iter=1)
    out["powersgd_train"] = train(rank, 3, hook=(ps, comm_hooks.powerSGD_hook)).module.state_dict()
    out["powersgd_warm"] = sorted(ps.q_memory)
    try:
        DDP(mlp(1)).register_comm_hook(None, "not callable")  # type: ignore[arg-type]
    except ConfigError as e:
        out["bad_hook"] = str(e)
    dist.destroy_process_group()
    return out


def hook_wire_cases(rank: int, world: int, init_method: str, backend: str) -> dict[str, Any]:
    """The compressing hooks over one backend: shared memory skips the cast, the ring does not."""
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world)
    out: dict[str, Any] = {"backend": dist.get_backend()}
    sent: list[Any] = []
    real = dist.all_to_all

    def spy(outs: Any, ins: Any, *a: Any, **k: Any) -> Any:
        sent.extend(i.dtype.str for i in ins)
        return real(outs, ins, *a, **k)

    dist.all_to_all = spy  # type: ignore[assignment]
    try:
        for name, hook in [
            ("fp16", (None, comm_hooks.fp16_compress_hook)),
            ("bf16", (None, comm_hooks.bf16_compress_hook)),
        ]:
            out[name] = one_backward(rank, hook)[1]
    finally:
        dist.all_to_all = real  # type: ignore[assignment]
    out["wire_dtypes"] = sorted(set(sent))
    out["bf16_train"] = train(
        rank, 3, hook=(None, comm_hooks.bf16_compress_hook)
    ).module.state_dict()
    dist.destroy_process_group()
    return out


# ----------------------------------------------------- unused, errors, buffers


def _error(fn: Callable[[], Any]) -> str:
    try:
        fn()
    except (AutogradError, ConfigError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def unused_and_errors(rank: int, world: int, init_method: str) -> dict[str, Any]:
    init(rank, world, init_method)
    out: dict[str, Any] = {}
    x, y = batch(0, rank)

    # Rank 1 uses ``extra``, rank 0 does not; nobody uses ``never``.
    strict = DDP(Branchy(rank + 1))
    strict.module.use_extra = rank == 1
    out["strict"] = _error(lambda: loss_of(strict, x, y).backward())
    # The group is still usable, and so is the model once every rank agrees.
    out["after_error"] = _error(lambda: loss_of(strict, x, y).backward())

    lenient = DDP(Branchy(rank + 1), find_unused_parameters=True)
    lenient.module.use_extra = rank == 1
    loss_of(lenient, x, y).backward()
    out["lenient_grads"] = grads(lenient.module)
    # no_sync: rank 1 uses ``extra`` in the first micro-batch only; the
    # synchronised one uses it nowhere, yet rank 1's accumulated gradient counts.
    acc = DDP(Branchy(rank + 1), find_unused_parameters=True)
    for micro in (0, 1):
        acc.module.use_extra = rank == 1 and micro == 0
        with acc.no_sync() if micro == 0 else contextlib.nullcontext():
            xm, ym = batch(0, rank, micro)
            loss_of(acc, xm, ym).backward()
    out["lenient_no_sync_grads"] = grads(acc.module)
    static = DDP(Branchy(rank + 1), static_graph=True)
    static.module.use_extra = rank == 1
    for _ in range(2):
        static.module.zero_grad()
        loss_of(static, x, y).backward()
    out["static_grads"] = grads(static.module)

    # Misuse: two backwards after one forward; a backward through .module.
    m = DDP(mlp(rank + 1))
    loss = loss_of(m, x, y)
    loss.backward(retain_graph=True)
    out["backward_twice"] = _error(lambda: loss.backward())
    out["through_module"] = _error(lambda: loss_of(m.module, x, y).backward())
    # A forward without a backward is fine: the next forward re-arms.
    loss_of(m, x, y)
    m.module.zero_grad()
    loss_of(m, x, y).backward()
    out["forward_without_backward_ok"] = grads(m.module)

    # Mismatched models fail on every rank, naming the difference.
    out["mismatch"] = _error(lambda: DDP(mlp(1, hidden=HID + rank)))
    out["mismatch_count"] = _error(
        lambda: DDP(mlp(1) if rank == 0 else nn.Sequential(*list(mlp(1))[:3]))
    )
    frozen = mlp(1)
    next(iter(frozen.parameters())).requires_grad = rank == 0
    out["mismatch_frozen"] = _error(lambda: DDP(frozen))
    out["bad_cap"] = _error(lambda: DDP(mlp(1), bucket_cap_mb=0))

    # Buffers: rank 0's at every forward (or left alone).
    for flag in (True, False):
        wb = DDP(WithBuffer(rank + 1), broadcast_buffers=flag)
        wb.module.scale.data[...] = rank + 2
        loss_of(wb, x, y).backward()
        out[f"buffer_{flag}"] = wb.module.scale.numpy().copy()
    dist.destroy_process_group()
    return out


# ------------------------------------------------- Join, ZeRO, checkpoints


def join_cases(rank: int, world: int, init_method: str, ckpt: str) -> dict[str, Any]:
    """p=3: Join 2/4/6 (with and without ZeRO), Join 3/5 on a 2-rank group, checkpoints."""
    init(rank, world, init_method)
    out: dict[str, Any] = {}
    sgd = lambda ps: optim.SGD(ps, lr=0.1)  # noqa: E731

    def joined(
        batches: Sequence[int], group: Any = None, zero: bool = False, hook: Any = None, **kw: Any
    ) -> Any:
        me = dist.get_rank(group)
        model = DDP(mlp(rank + 1), process_group=group)
        if hook is not None:
            model.register_comm_hook(*hook)
        if zero:
            o: Any = ZeroRedundancyOptimizer(
                model.parameters(), optim.SGD, process_group=group, lr=0.1, momentum=0.9
            )
            joinables: list[Any] = [model, o]
        else:
            o, joinables = sgd(list(model.parameters())), [model]
        with Join(joinables, **kw):
            for s in range(batches[me]):
                o.zero_grad()
                xb, yb = batch(s, rank)
                loss_of(model, xb, yb).backward()
                o.step()
        return model.module.state_dict()

    out["join_246"] = joined([2, 4, 6])
    out["join_246_active_mean"] = joined([2, 4, 6], divide_by_initial_world_size=False)
    out["join_246_zero"] = joined([2, 4, 6], zero=True)
    out["join_246_bf16"] = joined([2, 4, 6], hook=(None, comm_hooks.bf16_compress_hook))
    pair = dist.new_group([0, 1])
    if rank < 2:
        out["join_35"] = joined([3, 5], group=pair)
    else:
        out["non_member"] = _error(lambda: DDP(mlp(1), process_group=pair))
    out["throw"] = _throw_case(rank)

    # Checkpoint at p=2 (ranks 0 and 1), resume at p=3.
    if rank < 2:
        model = DDP(mlp(rank + 1), process_group=pair)
        z = ZeroRedundancyOptimizer(model.parameters(), optim.Adam, process_group=pair, lr=0.01)
        for s in range(2):
            z.zero_grad()
            xb, yb = batch(s, rank)
            loss_of(model, xb, yb).backward()
            z.step()
        z.consolidate_state_dict(to=0)
        if rank == 0:
            rpcdist.save({"model": model.module.state_dict(), "optim": z.state_dict()}, ckpt)
        else:
            out["state_dict_elsewhere"] = _error(z.state_dict)
    dist.barrier()
    saved = rpcdist.load(ckpt)
    fresh = mlp(100 + rank)
    fresh.load_state_dict(saved["model"])
    model = DDP(fresh)
    z = ZeroRedundancyOptimizer(model.parameters(), optim.Adam, lr=0.01)
    z.load_state_dict(saved["optim"])
    for s in range(2, 4):
        z.zero_grad()
        xb, yb = batch(s, rank)
        loss_of(model, xb, yb).backward()
        z.step()
    out["resumed"] = model.module.state_dict()
    z.consolidate_state_dict(to=2)
    if rank == 2:
        out["resumed_optim"] = z.state_dict()
    out["zero_stats"] = z.statistics()
    dist.destroy_process_group()
    return out


def _throw_case(rank: int) -> str:
    """throw_on_early_termination: rank 0 has 1 batch, the others 2; all raise."""
    model = DDP(mlp(rank + 1))
    o = optim.SGD(list(model.parameters()), lr=0.1)
    try:
        with Join([model], throw_on_early_termination=True):
            for s in range(1 if rank == 0 else 2):
                o.zero_grad()
                xb, yb = batch(s, rank)
                loss_of(model, xb, yb).backward()
                o.step()
    except rpcdist.CollectiveError as e:
        return str(e)
    return "no error"


def zero_cases(rank: int, world: int, init_method: str) -> dict[str, Any]:
    """ZeRO against the unsharded optimizer, both parameter layouts; memory per rank."""
    init(rank, world, init_method)
    out: dict[str, Any] = {}
    for views in (False, True):
        model = DDP(mlp(rank + 1))
        z = ZeroRedundancyOptimizer(
            model.parameters(), optim.Adam, parameters_as_bucket_view=views, lr=0.01
        )
        for s in range(3):
            z.zero_grad()
            xb, yb = batch(s, rank)
            loss_of(model, xb, yb).backward()
            z.step()
        out[f"adam_views_{views}"] = model.module.state_dict()
        out[f"owned_{views}"] = z.statistics()
    z.consolidate_state_dict(to=1)
    if rank == 1:
        out["consolidated"] = z.state_dict()
    # Options set on the wrapper reach the local optimizers.
    z.param_groups[0]["lr"] = 0.0
    before = model.module.state_dict()
    z.zero_grad()
    xb, yb = batch(9, rank)
    loss_of(model, xb, yb).backward()
    z.step()
    after = model.module.state_dict()
    out["lr_zero_keeps_params"] = all(np.array_equal(before[k], after[k]) for k in before)
    dist.destroy_process_group()
    return out
