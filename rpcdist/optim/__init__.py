"""Optimizers: ``SGD``, ``Adam``, ``AdamW`` on :mod:`rpcdist.tensor` parameters.

Every optimizer can step from ``.grad`` or from explicit gradients
(``opt.step(grads=[...])`` or a ``{param: array}`` mapping), which is how a
distributed optimizer feeds it the gradients of an autograd context.
``DistributedOptimizer`` steps parameters held on other workers (it needs
the RPC stack, so it is loaded on first use).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._publish import lazy
from ._adam import Adam, AdamW
from ._optimizer import Optimizer
from ._sgd import SGD

if TYPE_CHECKING:
    from ._distributed import DistributedOptimizer

__all__ = ["SGD", "Adam", "AdamW", "DistributedOptimizer", "Optimizer"]


# It needs the RPC stack: loaded on first use, so ``import rpcdist.optim`` stays local.
__getattr__ = lazy(__name__, globals(), {"DistributedOptimizer": "._distributed"})
