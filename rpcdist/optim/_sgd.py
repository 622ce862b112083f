"""Stochastic gradient descent with momentum, dampening, Nesterov, weight decay."""

from __future__ import annotations

from typing import Any

from .._errors import ConfigError
from ..tensor import Tensor
from ..tensor._device import array_module
from ._optimizer import Optimizer, ParamsT, Scratch

__all__ = ["SGD"]


class SGD(Optimizer):
    """SGD, with the update rule PyTorch documents for ``torch.optim.SGD``.

    With ``g = grad + weight_decay * p`` and buffer ``b`` (``b = g`` on the
    first step, then ``b = momentum * b + (1 - dampening) * g``), the step is
    ``p -= lr * (g + momentum * b if nesterov else b)`` (``g`` without momentum).

    Args:
        params: Parameters or parameter groups.
        lr: Learning rate.
        momentum: Momentum factor.
        dampening: Dampening of the momentum.
        weight_decay: L2 penalty.
        nesterov: Nesterov momentum (needs momentum > 0 and no dampening).
        maximize: Ascend instead of descend.

    Raises:
        ConfigError: invalid options.
    """

    __module__ = "rpcdist.optim"

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        *,
        maximize: bool = False,
    ) -> None:
        defaults = {
            "lr": lr,
            "momentum": momentum,
            "dampening": dampening,
            "weight_decay": weight_decay,
            "nesterov": nesterov,
            "maximize": maximize,
        }
        super().__init__(params, defaults)

    def _check_group(self, group: dict[str, Any]) -> None:
        super()._check_group(group)
        if group["momentum"] < 0:
            raise ConfigError(f"SGD: invalid momentum {group['momentum']}")
        if group["weight_decay"] < 0:
            raise ConfigError(f"SGD: invalid weight_decay {group['weight_decay']}")
        if group["nesterov"] and (group["momentum"] <= 0 or group["dampening"] != 0):
            raise ConfigError("SGD: nesterov momentum needs momentum > 0 and dampening 0")

    def _update(self, group: dict[str, Any], params: list[Tensor], grads: list[Any]) -> None:
        lr, momentum, dampening = group["lr"], group["momentum"], group["dampening"]
        wd, nesterov, maximize = group["weight_decay"], group["nesterov"], group["maximize"]
        scratch = Scratch(p.data for p in params)
        for p, g in zip(params, grads):
            if g is None:
                continue
            data = p.data
            xp = array_module(data)
            if maximize:
                g = -g
            if wd:
                g = g + wd * data
            t = scratch.like(data, g)  # None: plain expressions (see Scratch)
            if momentum:
                state = self.state.setdefault(p, {})
                buf = state.get("momentum_buffer")
                if buf is None:
                    buf = state["momentum_buffer"] = g.copy()
                elif t is None:
                    buf *= momentum
                    buf += (1 - dampening) * g
                else:  # the same operations (the same bits), in place
                    buf *= momentum
                    xp.multiply(g, 1 - dampening, out=t)
                    buf += t
                if not nesterov:
                    g = buf
                elif t is None:
                    g = g + momentum * buf
                else:
                    xp.multiply(buf, momentum, out=t)
                    t += g
                    g = t
            if t is None:
                data -= lr * g
            else:
                xp.multiply(g, lr, out=t)
                data -= t
