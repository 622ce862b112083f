"""Optimizers: ``SGD``, ``Adam``, ``AdamW`` on :mod:`rpcdist.tensor` parameters.

Every optimizer can step from ``.grad`` or from explicit gradients
(``opt.step(grads=[...])`` or a ``{param: array}`` mapping), which is how a
distributed optimizer feeds it the gradients of an autograd context.
"""

from __future__ import annotations

from ._adam import Adam, AdamW
from ._optimizer import Optimizer
from ._sgd import SGD

__all__ = ["SGD", "Adam", "AdamW", "Optimizer"]
