"""PowerSGD gradient compression (Vogels et al., 2019) as a DDP comm hook.

For each gradient matrix ``M`` (``a x b``, a tensor of 2 or more dimensions
viewed as its first dimension by the rest) a rank-``r`` approximation
``P Q^T`` is found with one step of power iteration that shares ``Q``:

1. ``M += error`` (error feedback: what compression dropped last time);
2. ``P = M Q`` on every rank, all-reduced (sum), then orthonormalised;
3. ``Q = M^T P`` on every rank, all-reduced (sum);
4. ``M ~ P Q^T / world``; the error kept for next time is the local input
   minus that average approximation.

``Q`` starts from a seeded normal draw, the same on every rank, and is kept
between iterations (warm start). Tensors that would not shrink by at least
``min_compression_rate`` (biases, small matrices) are all-reduced as they
are, together, in one buffer. Each bucket costs three collectives, issued
back to back; steps 2 and 3's local work runs in callbacks between them
(see :mod:`rpcdist.parallel.comm_hooks`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import collectives as dist
from .._errors import ConfigError
from .._futures import Future
from ._arrays import future_of, xp_of
from ._bucket import GradBucket

__all__ = ["PowerSGDState", "powerSGD_hook"]


class PowerSGDState:
    """Settings and per-bucket memory of :func:`powerSGD_hook`.

    Args:
        process_group: The group (None: DDP's group).
        matrix_approximation_rank: Rank ``r`` of the approximation.
        start_powerSGD_iter: Iterations of plain all-reduce before compressing
            (error feedback needs a model that has started to settle).
        min_compression_rate: Compress a matrix only if ``a*b >= rate * (a+b) * r``.
        use_error_feedback: Add back what compression dropped last iteration.
        warm_start: Keep ``Q`` between iterations (else draw it afresh).
        orthogonalization_epsilon: Added to column norms (0: exact, zero
            columns are left as they are).
        random_seed: Seed of the initial ``Q`` (the same on every rank).

    Attributes:
        iter: Iterations seen (counted at each iteration's last bucket).
        bytes_uncompressed: Bytes the compressed tensors would have taken.
        bytes_compressed: Bytes of ``P`` and ``Q`` actually reduced for them.

    Raises:
        ConfigError: a rank below 1 or a negative start iteration.
    """

    __module__ = "rpcdist.parallel"

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        matrix_approximation_rank: int = 1,
        start_powerSGD_iter: int = 1_000,
        min_compression_rate: float = 2.0,
        use_error_feedback: bool = True,
        warm_start: bool = True,
        orthogonalization_epsilon: float = 0.0,
        random_seed: int = 0,
    ) -> None:
        if matrix_approximation_rank < 1:
            raise ConfigError(
                f"PowerSGDState: matrix_approximation_rank must be >= 1, got {matrix_approximation_rank}"
            )
        if start_powerSGD_iter < 0:
            raise ConfigError(
                f"PowerSGDState: start_powerSGD_iter must be >= 0, got {start_powerSGD_iter}"
            )
        self.process_group = process_group
        self.matrix_approximation_rank = matrix_approximation_rank
        self.start_powerSGD_iter = start_powerSGD_iter
        self.min_compression_rate = min_compression_rate
        self.use_error_feedback = use_error_feedback
        self.warm_start = warm_start
        self.orthogonalization_epsilon = orthogonalization_epsilon
        self.rng = np.random.default_rng(random_seed)
        self.iter = 0
        self.error_dict: dict[int, Any] = {}
        self.q_memory: dict[int, Any] = {}
        self.bytes_uncompressed = 0
        self.bytes_compressed = 0

    def compression_stats(self) -> tuple[float, int, int]:
        """``(rate, bytes_uncompressed, bytes_compressed)`` over the matrices compressed so far."""
        rate = self.bytes_uncompressed / self.bytes_compressed if self.bytes_compressed else 0.0
        return rate, self.bytes_uncompressed, self.bytes_compressed


def _orthonormalize(m: Any, eps: float) -> None:
    """Gram-Schmidt on the columns of ``m`` in place.

    Each column is projected out of the previous ones twice ("twice is
    enough" for orthogonality in floating point). A column left with only
    rounding noise (the matrix has lower rank than ``r``, as a gradient of a
    small batch has) becomes zero rather than a normalised noise vector, so
    ``P P^T`` stays a projection.
    """
    xp = xp_of(m)
    tiny = float(np.finfo(m.dtype).eps) * 64
    for i in range(m.shape[1]):
        col = m[:, i]
        before = float(xp.linalg.norm(col))
        if i:
            prev = m[:, :i]
            for _ in range(2):
                col -= prev @ (prev.T @ col)
        norm = float(xp.linalg.norm(col))
        if norm <= tiny * before:
            col[...] = 0
        elif norm + eps > 0:
            col /= norm + eps


def _matrices(state: PowerSGDState, bucket: GradBucket) -> tuple[list[int], list[int]]:
    """Positions of the tensors to compress and of those reduced as they are."""
    r = state.matrix_approximation_rank
    big, small = [], []
    for i, g in enumerate(bucket.gradients()):
        if g.ndim >= 2:
            a, b = g.shape[0], g.size // g.shape[0]
            k = min(a, b, r)
            if a * b >= state.min_compression_rate * (a + b) * k:
                big.append(i)
                continue
        small.append(i)
    return big, small


def powerSGD_hook(state: PowerSGDState, bucket: GradBucket) -> Future[Any]:
    """Average the bucket with rank-``r`` PowerSGD compression of its matrices.

    Args:
        state: A :class:`PowerSGDState` (one per model, the same settings on
            every rank).
        bucket: The gradients.

    Returns:
        A Future of the buffer holding the (approximate) average.
    """
    group = state.process_group if state.process_group is not None else bucket.process_group
    buf = bucket.buffer()
    world = bucket.world_size
    if state.iter < state.start_powerSGD_iter:
        if bucket.is_last():
            state.iter += 1
        work = dist.all_reduce(buf, dist.ReduceOp.AVG, group=group, async_op=True)
        return future_of(work)
    xp = xp_of(buf)
    idx = bucket.index()
    if state.use_error_feedback:
        err = state.error_dict.get(idx)
        if err is None:
            state.error_dict[idx] = xp.zeros_like(buf)
        else:
            buf += err
        before = buf.copy()
    grads = bucket.gradients()
    big, small = _matrices(state, bucket)
    mats = [grads[i].reshape(grads[i].shape[0], -1) for i in big]
    ranks = [min(m.shape[0], m.shape[1], state.matrix_approximation_rank) for m in mats]
    p_all = xp.empty(sum(m.shape[0] * k for m, k in zip(mats, ranks)), buf.dtype)
    q_all = xp.empty(sum(m.shape[1] * k for m, k in zip(mats, ranks)), buf.dtype)
    ps, qs, po, qo = [], [], 0, 0
    for m, k in zip(mats, ranks):
        ps.append(p_all[po : po + m.shape[0] * k].reshape(m.shape[0], k))
        qs.append(q_all[qo : qo + m.shape[1] * k].reshape(m.shape[1], k))
        po, qo = po + m.shape[0] * k, qo + m.shape[1] * k
    kept = state.q_memory.get(idx)
    if state.warm_start and kept is not None and kept.size == q_all.size:
        q_all[...] = kept
    else:
        q_all[...] = xp.asarray(state.rng.standard_normal(q_all.size), dtype=buf.dtype)
        for q in qs:
            _orthonormalize(q, state.orthogonalization_epsilon)
    for m, p, q in zip(mats, ps, qs):
        xp.matmul(m, q, out=p)
    state.bytes_uncompressed += sum(m.size for m in mats) * buf.itemsize
    state.bytes_compressed += (p_all.size + q_all.size) * buf.itemsize

    flat_small = xp.concatenate([grads[i].reshape(-1) for i in small]) if small else None
    works = []
    if flat_small is not None:
        works.append(
            future_of(dist.all_reduce(flat_small, dist.ReduceOp.AVG, group=group, async_op=True))
        )
    p_done = future_of(dist.all_reduce(p_all, group=group, async_op=True))

    def project(f: Future[Any]) -> None:
        f.value()
        for m, p, q in zip(mats, ps, qs):
            _orthonormalize(p, state.orthogonalization_epsilon)
            xp.matmul(m.T, p, out=q)

    projected = p_done.then(project)  # runs before the Q all-reduce reads q_all
    q_done = future_of(dist.all_reduce(q_all, group=group, async_op=True))
    if bucket.is_last():
        state.iter += 1

    def decompress(f: Future[Any]) -> Any:
        f.value()
        projected.value()
        for w in works:
            w.value()
        if state.warm_start:
            state.q_memory[idx] = q_all.copy()
        for m, p, q in zip(mats, ps, qs):
            xp.matmul(p, q.T, out=m)
            m *= 1.0 / world
        if flat_small is not None:
            off = 0
            for i in small:
                g = grads[i]
                g[...] = flat_small[off : off + g.size].reshape(g.shape)
                off += g.size
        if state.use_error_feedback:
            err = state.error_dict[idx]
            xp.subtract(before, buf, out=err)
            for i in small:  # reduced exactly: nothing to feed back
                err[bucket.plan.offsets[i] : bucket.plan.offsets[i] + grads[i].size] = 0
        return buf

    return q_done.then(decompress)
