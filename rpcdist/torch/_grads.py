"""``rpcdist.torch.autograd``'s contexts and gradients."""

from __future__ import annotations

import torch

from .._errors import AutogradError
from .._rpc._context import current_agent
from ..autograd._api import context as _context
from ..autograd._context import CURRENT
from ..autograd._extension import ext
from ._edges import state

__all__ = ["context", "get_gradients", "is_available"]


class context(_context):
    """A distributed autograd context: ``with context() as context_id: ...``.

    Calls made inside the block carry it, so torch tensors that require grad
    and cross workers record send and receive edges for ``backward``.
    Leaving the block frees it here and on every worker it touched.

    Raises:
        NotInitializedError: ``init_rpc`` was not called in this process.
        AutogradError: a context is open already in this thread (or in the
            call this runs in): they do not nest, as in torch.
    """

    __module__ = "rpcdist.torch.autograd"

    def __enter__(self) -> int:
        open_here = CURRENT.get()
        if open_here is not None:  # torch's contexts do not nest
            raise AutogradError(
                "Already have an autograd context id for this thread (context "
                f"{open_here} is open here; torch.distributed.autograd contexts do not nest)"
            )
        return super().__enter__()


def get_gradients(context_id: int) -> dict[torch.Tensor, torch.Tensor]:
    """This worker's leaf gradients in ``context_id``: ``{tensor: gradient}``.

    Keyed by the very tensor objects this worker holds (its parameters).

    Raises:
        AutogradError: no such context on this worker.
    """
    ctx = ext(current_agent()).get(context_id, "get_gradients()")
    st = state(ctx)
    with st.lock:
        return dict(st.grads)


def is_available() -> bool:
    """Always ``True``: rpcdist's distributed autograd needs no special build of torch."""
    return True
