"""Fused operations for layers and losses: one graph node each, for speed."""

from __future__ import annotations

import importlib
from typing import Any

import numpy as np

from ..tensor import Function
from ..tensor._device import array_module

__all__ = ["CrossEntropyFn", "EmbeddingFn", "LinearFn", "NLLLossFn"]


class LinearFn(Function):
    """``x @ w.T + b`` for ``x`` of shape ``(..., in)``."""

    __slots__ = ("w", "x2")
    op = "linear"

    def forward(self, x: Any, w: Any, b: Any = None) -> Any:
        if x.dtype != w.dtype:
            raise TypeError(f"input dtype {x.dtype} differs from weight dtype {w.dtype}")
        if w.ndim != 2 or x.ndim == 0 or x.shape[-1] != w.shape[1]:
            raise ValueError(
                f"input of shape {tuple(x.shape)} does not match weight of shape {tuple(w.shape)}"
            )
        x2 = x if x.ndim == 2 else x.reshape(-1, x.shape[-1])
        out = x2 @ w.T
        if b is not None:
            out += b
        self.x2, self.w = x2, w
        return out if x.ndim == 2 else out.reshape(*x.shape[:-1], w.shape[0])

    def backward(self, g: Any) -> tuple[Any, ...]:
        needs = self.needs_input_grad
        w, x2 = self.w, self.x2
        g2 = g if g.ndim == 2 else g.reshape(-1, g.shape[-1])
        gx = gw = gb = None
        if needs[0]:
            gx = g2 @ w
            if g.ndim != 2:
                gx = gx.reshape(*g.shape[:-1], w.shape[1])
        if needs[1]:
            gw = g2.T @ x2
        if len(needs) > 2 and needs[2]:
            gb = g2.sum(axis=0)
        return (gx, gw) if len(needs) == 2 else (gx, gw, gb)


def _scatter_add(xp: Any, target: Any, idx: Any, values: Any) -> None:
    if xp is np:
        np.add.at(target, idx, values)
    else:
        importlib.import_module("cupyx").scatter_add(target, idx, values)


class EmbeddingFn(Function):
    """Rows of ``weight`` picked by integer indices."""

    __slots__ = ("idx", "padding_idx", "wshape")
    op = "embedding"

    def forward(self, idx: Any, weight: Any, *, padding_idx: int | None) -> Any:
        if idx.dtype.kind not in "iu":
            raise TypeError(f"indices must be integers, got dtype {idx.dtype}")
        self.idx, self.wshape, self.padding_idx = idx, weight.shape, padding_idx
        return weight[idx]

    def backward(self, g: Any) -> tuple[Any, ...]:
        xp = array_module(g)
        gw = xp.zeros(self.wshape, dtype=g.dtype)
        _scatter_add(xp, gw, self.idx.reshape(-1), g.reshape(-1, self.wshape[1]))
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
    """``nll_loss(log_softmax(x), target)`` in one node, for logits ``(N, C)``."""

    __slots__ = ("count", "logp", "reduction", "rows", "safe", "valid")
    op = "cross_entropy"

    def forward(self, x: Any, target: Any, *, reduction: str, ignore_index: int) -> Any:
        xp = array_module(x)
        n, c = x.shape
        valid, safe, rows = _targets(xp, target, n, c, ignore_index)
        logp = x - x.max(axis=1, keepdims=True)
        logp -= xp.log(xp.exp(logp).sum(axis=1, keepdims=True))
        picked = -logp[rows, safe] * valid
        self.valid, self.safe, self.rows, self.logp = valid, safe, rows, logp
        self.reduction, self.count = reduction, int(valid.sum())
        if reduction == "none":
            return picked
        total = picked.sum()
        return total if reduction == "sum" else total / x.dtype.type(self.count)

    def backward(self, g: Any) -> tuple[Any, ...]:
        xp = array_module(g)
        grad = xp.exp(self.logp)
        grad[self.rows, self.safe] -= 1
        if self.reduction == "none":
            grad *= (g * self.valid)[:, None]
        else:
            scale = g / self.count if self.reduction == "mean" else g
            grad *= self.valid[:, None]
            grad *= scale
        return grad, None
