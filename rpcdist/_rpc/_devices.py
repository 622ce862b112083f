"""The device extensions every agent installs (``rpcdist._device``, a layer
below this one): the agent hands them itself and the control outbox their
batched messages travel in."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._device import CudaIpc, install_cuda_ipc
from .._device._cuda_ipc import RELEASE
from ._outbox import ControlOutbox

if TYPE_CHECKING:
    from ._agent_view import AgentView

__all__ = ["install"]


def install(agent: AgentView) -> CudaIpc:
    """Give ``agent`` CUDA IPC (a built-in extension, see ``_registry``)."""
    return install_cuda_ipc(agent, ControlOutbox(agent, RELEASE))
