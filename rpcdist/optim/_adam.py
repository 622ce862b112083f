"""Adam and AdamW, with the update rules PyTorch documents."""

from __future__ import annotations

import math
from typing import Any

from .._errors import ConfigError
from ..tensor import Tensor
from ..tensor._device import array_module
from ._optimizer import Optimizer, ParamsT, Scratch

__all__ = ["Adam", "AdamW"]


class Adam(Optimizer):
    """Adam (Kingma & Ba), optionally AMSGrad, as ``torch.optim.Adam``.

    Per step ``t``: ``g += weight_decay * p`` (coupled L2; AdamW decouples it),
    ``m = lerp(m, g, 1 - beta1)``, ``v = beta2 * v + (1 - beta2) * g**2``,
    ``v_hat = max(v_hat, v)`` with amsgrad, and
    ``p -= lr / (1 - beta1**t) * m / (sqrt(v_hat or v) / sqrt(1 - beta2**t) + eps)``.

    Args:
        params: Parameters or parameter groups.
        lr: Learning rate.
        betas: Decay rates of the first and second moment estimates.
        eps: Added to the denominator.
        weight_decay: L2 penalty.
        amsgrad: Use the running maximum of the second moment.
        maximize: Ascend instead of descend.

    Raises:
        ConfigError: invalid options.
    """

    __module__ = "rpcdist.optim"
    _decoupled = False

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
    ) -> None:
        defaults = {
            "lr": lr,
            "betas": tuple(betas),
            "eps": eps,
            "weight_decay": weight_decay,
            "amsgrad": amsgrad,
            "maximize": maximize,
        }
        super().__init__(params, defaults)

    def _check_group(self, group: dict[str, Any]) -> None:
        super()._check_group(group)
        name = type(self).__name__
        b1, b2 = group["betas"]
        if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
            raise ConfigError(f"{name}: betas must be in [0, 1), got {group['betas']}")
        if group["eps"] < 0:
            raise ConfigError(f"{name}: invalid eps {group['eps']}")
        if group["weight_decay"] < 0:
            raise ConfigError(f"{name}: invalid weight_decay {group['weight_decay']}")

    def _update(self, group: dict[str, Any], params: list[Tensor], grads: list[Any]) -> None:
        lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
        beta1, beta2 = group["betas"]
        amsgrad, maximize = group["amsgrad"], group["maximize"]
        scratch = Scratch(p.data for p in params)
        for p, g in zip(params, grads):
            if g is None:
                continue
            xp = array_module(g)
            data = p.data
            if maximize:
                g = -g
            state = self.state.setdefault(p, {})
            if not state:
                state["step"] = 0
                state["exp_avg"] = xp.zeros_like(data)
                state["exp_avg_sq"] = xp.zeros_like(data)
                if amsgrad:
                    state["max_exp_avg_sq"] = xp.zeros_like(data)
            state["step"] += 1
            step = state["step"]
            if wd:
                if self._decoupled:
                    data *= 1 - lr * wd
                else:
                    g = g + wd * data
            m, v = state["exp_avg"], state["exp_avg_sq"]
            bc1 = 1 - beta1**step
            bc2_sqrt = math.sqrt(1 - beta2**step)
            t = scratch.like(data, g)
            if t is None:
                m += (1 - beta1) * (g - m)
                v *= beta2
                v += (1 - beta2) * (g * g)
            else:  # the same operations in the same order (the same bits), in place
                xp.subtract(g, m, out=t)
                t *= 1 - beta1
                m += t
                xp.multiply(g, g, out=t)
                t *= 1 - beta2
                v *= beta2
                v += t
            if amsgrad:
                vmax = state["max_exp_avg_sq"]
                xp.maximum(vmax, v, out=vmax)
                v = vmax
            denom = xp.sqrt(v) if t is None else xp.sqrt(v, out=t)
            denom /= bc2_sqrt
            denom += eps
            if t is None:
                data -= (lr / bc1) * (m / denom)
            else:
                xp.divide(m, denom, out=denom)
                denom *= lr / bc1
                data -= denom


class AdamW(Adam):
    """Adam with decoupled weight decay (``p *= 1 - lr * weight_decay`` first).

    Same arguments as :class:`Adam`; ``weight_decay`` defaults to 0.01.
    """

    __module__ = "rpcdist.optim"
    _decoupled = True

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
    ) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, maximize=maximize)
