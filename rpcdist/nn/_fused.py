"""Fused operations for layers and losses: one graph node each, for speed.

Large outputs and gradients come from :mod:`._buffers` (no fresh pages per
step); the embedding's backward sums rows with a 1-D ``np.add.at`` over the
flattened table; cross-entropy keeps ``exp(x - max)`` from its forward, so its
backward is one scaled copy.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..tensor import Function
from ..tensor._device import array_module
from . import _buffers

__all__ = ["CrossEntropyFn", "EmbeddingFn", "LinearFn", "NLLLossFn"]


class LinearFn(Function):
    """``x @ w.T + b`` for ``x`` of shape ``(..., in)``."""

    __slots__ = ("w", "x2")
    op = "linear"
    splittable = True

    def forward(self, x: Any, w: Any, b: Any = None) -> Any:
        if x.dtype != w.dtype:
            raise TypeError(f"input dtype {x.dtype} differs from weight dtype {w.dtype}")
        if w.ndim != 2 or x.ndim == 0 or x.shape[-1] != w.shape[1]:
            raise ValueError(
                f"input of shape {tuple(x.shape)} does not match weight of shape {tuple(w.shape)}"
            )
        x2 = x if x.ndim == 2 else x.reshape(-1, x.shape[-1])
        xp = array_module(x2)
        out = xp.matmul(x2, w.T, out=_buffers.empty(xp, (x2.shape[0], w.shape[0]), x.dtype))
        if b is not None:
            out += b
        self.x2, self.w = x2, w
        return out if x.ndim == 2 else out.reshape(*x.shape[:-1], w.shape[0])

    def backward(self, g: Any) -> tuple[Any, ...]:
        needs = self.needs_input_grad
        w, x2 = self.w, self.x2
        g2 = g if g.ndim == 2 else g.reshape(-1, g.shape[-1])
        xp = array_module(g2)
        gx = gw = gb = None
        if needs[0]:
            gx = _buffers.empty(xp, (*g.shape[:-1], w.shape[1]), g.dtype)
            xp.matmul(g2, w, out=gx.reshape(g2.shape[0], w.shape[1]))
        if needs[1]:
            gw = xp.matmul(g2.T, x2, out=_buffers.empty(xp, w.shape, g.dtype))
        if len(needs) > 2 and needs[2]:
            gb = g2.sum(axis=0)
        return (gx, gw) if len(needs) == 2 else (gx, gw, gb)


def _sum_rows(xp: Any, n_rows: int, idx: Any, values: Any) -> Any:
    """``out[i] = sum of values[j] where idx[j] == i``, for ``out`` of ``n_rows`` rows.

    NumPy: one ``np.add.at`` on the flattened table, with one index per
    element. NumPy's fast path for 1-D ``add.at`` makes that several times
    quicker than ``add.at`` on rows, with the same summation order.
    """
    dim = values.shape[1]
    if xp is not np:
        out = xp.zeros((n_rows, dim), dtype=values.dtype)
        xp.add.at(out, idx, values)
        return out
    out = _buffers.empty(np, (n_rows, dim), values.dtype)
    out.fill(0)
    flat = _buffers.empty(np, (idx.size, dim), np.intp)
    np.add((idx.astype(np.intp) * dim)[:, None], np.arange(dim, dtype=np.intp), out=flat)
    np.add.at(out.reshape(-1), flat.reshape(-1), np.ascontiguousarray(values).reshape(-1))
    return out


class EmbeddingFn(Function):
    """Rows of ``weight`` picked by integer indices."""

    __slots__ = ("idx", "padding_idx", "wshape")
    op = "embedding"

    def forward(self, idx: Any, weight: Any, *, padding_idx: int | None) -> Any:
        if idx.dtype.kind not in "iu":
            raise TypeError(f"indices must be integers, got dtype {idx.dtype}")
        self.idx, self.wshape, self.padding_idx = idx, weight.shape, padding_idx
        xp = array_module(weight)
        if xp is not np or weight.ndim != 2:
            return weight[idx]
        out = _buffers.empty(np, (*idx.shape, weight.shape[1]), weight.dtype)
        np.take(weight, idx, axis=0, out=out)
        return out

    def backward(self, g: Any) -> tuple[Any, ...]:
        xp = array_module(g)
        n, dim = self.wshape
        gw = _sum_rows(xp, n, self.idx.reshape(-1), g.reshape(-1, dim))
        if self.padding_idx is not None:
            gw[self.padding_idx] = 0
        return None, gw


def _targets(xp: Any, target: Any, n: int, c: int, ignore_index: int) -> tuple[Any, Any, Any]:
    if target.dtype.kind not in "iu":
        raise TypeError(f"target must hold class indices (integers), got dtype {target.dtype}")
    if target.shape != (n,):
        raise ValueError(f"target of shape {tuple(target.shape)} does not match input batch {n}")
    valid = target != ignore_index
    safe = xp.where(valid, target, 0)
    if safe.size and (int(safe.min()) < 0 or int(safe.max()) >= c):
        raise ValueError(f"target holds class indices outside [0, {c})")
    return valid, safe, xp.arange(n)


class NLLLossFn(Function):
    """Negative log-likelihood of class indices given log-probabilities ``(N, C)``."""

    __slots__ = ("count", "reduction", "rows", "safe", "shape", "valid")
    op = "nll_loss"

    def forward(self, logp: Any, target: Any, *, reduction: str, ignore_index: int) -> Any:
        xp = array_module(logp)
        n, c = logp.shape
        valid, safe, rows = _targets(xp, target, n, c, ignore_index)
        picked = -logp[rows, safe] * valid
        self.valid, self.safe, self.rows, self.shape = valid, safe, rows, logp.shape
        self.reduction, self.count = reduction, int(valid.sum())
        if reduction == "none":
            return picked
        total = picked.sum()
        return total if reduction == "sum" else total / logp.dtype.type(self.count)

    def backward(self, g: Any) -> tuple[Any, ...]:
        xp = array_module(g)
        gx = xp.zeros(self.shape, dtype=g.dtype)
        scale = g if self.reduction == "none" else g / self.count if self.reduction == "mean" else g
        gx[self.rows, self.safe] = -scale * self.valid
        return gx, None


class CrossEntropyFn(Function):
    """``nll_loss(log_softmax(x), target)`` in one node, for logits ``(N, C)``.

    Forward keeps ``e = exp(x - max)`` and its row sums ``s``; the loss of a
    row is ``log s + max - x[target]`` and its gradient ``e / s - onehot``.
    """

    __slots__ = ("count", "exp", "reduction", "rows", "safe", "sums", "valid")
    op = "cross_entropy"

    def forward(self, x: Any, target: Any, *, reduction: str, ignore_index: int) -> Any:
        xp = array_module(x)
        n, c = x.shape
        valid, safe, rows = _targets(xp, target, n, c, ignore_index)
        top = x.max(axis=1, keepdims=True)
        e = xp.subtract(x, top, out=_buffers.empty(xp, x.shape, x.dtype))
        picked = e[rows, safe]
        xp.exp(e, out=e)
        sums = e.sum(axis=1)
        picked = (xp.log(sums) - picked) * valid
        self.valid, self.safe, self.rows, self.exp, self.sums = valid, safe, rows, e, sums
        self.reduction, self.count = reduction, int(valid.sum())
        if reduction == "none":
            return picked
        total = picked.sum()
        return total if reduction == "sum" else total / x.dtype.type(self.count)

    def backward(self, g: Any) -> tuple[Any, ...]:
        xp = array_module(g)
        e = self.exp
        if self.reduction == "none":
            scale = g * self.valid
        else:
            scale = (g / self.count if self.reduction == "mean" else g) * self.valid
        scale = scale.astype(e.dtype, copy=False)
        grad = xp.multiply(
            e, (scale / self.sums)[:, None], out=_buffers.empty(xp, e.shape, e.dtype)
        )
        grad[self.rows, self.safe] -= scale
        return grad, None
