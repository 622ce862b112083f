"""Distributed autograd: one backward pass across the workers a forward pass crossed.

Import it as torch users do::

    import rpcdist.autograd as dist_autograd

    with dist_autograd.context() as context_id:
        loss = forward_that_calls_other_workers(...)
        dist_autograd.backward(context_id, [loss])
        grads = dist_autograd.get_gradients(context_id)  # this worker's leaves

Tensors (``rpcdist.tensor.Tensor``) that require grad and cross workers in a
call made inside a context record send and receive edges; ``backward`` runs
the local engines of every worker the pass reaches, FAST mode without its
hang (``docs/design.md``, "Distributed autograd").
"""

from __future__ import annotations

from .._publish import publish
from ._api import backward, context, get_gradients, statistics

__all__ = ["backward", "context", "get_gradients", "statistics"]

publish(__name__, __all__, globals())
