"""``torch.distributed.autograd`` over rpcdist: ``import rpcdist.torch.autograd as dist_autograd``.

Send and receive edges are ``torch.autograd.Function`` nodes, so a forward
that mixes local torch modules and remote ones has one backward across the
workers, run by torch's own engine on each (``docs/migrating.md``)::

    with dist_autograd.context() as context_id:
        loss = model(batch)  # local and remote parts
        dist_autograd.backward(context_id, [loss])
        grads = dist_autograd.get_gradients(context_id)  # {param: grad}, this worker's
"""

from __future__ import annotations

from .._publish import publish
from ._backward import backward
from ._grads import context, get_gradients, is_available
from ._install import install

__all__ = ["backward", "context", "get_gradients", "is_available"]

publish(__name__, __all__, globals())
install()  # (codec hooks: see rpcdist.torch._install)
