"""Optimizers: ``SGD``, ``Adam``, ``AdamW`` on :mod:`rpcdist.tensor` parameters.

Every optimizer can step from ``.grad`` or from explicit gradients
(``opt.step(grads=[...])`` or a ``{param: array}`` mapping), which is how a
distributed optimizer feeds it the gradients of an autograd context.
``DistributedOptimizer`` steps parameters held on other workers (it needs
the RPC stack, so it is loaded on first use).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._adam import Adam, AdamW
from ._optimizer import Optimizer
from ._sgd import SGD

if TYPE_CHECKING:
    from ._distributed import DistributedOptimizer

__all__ = ["SGD", "Adam", "AdamW", "DistributedOptimizer", "Optimizer"]


def __getattr__(name: str) -> Any:
    if name == "DistributedOptimizer":
        from .._publish import publish

        obj = importlib.import_module("._distributed", __name__).DistributedOptimizer
        publish(__name__, [name], {name: obj})
        globals()[name] = obj
        return obj
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
