"""Device memory between workers: CUDA IPC for CuPy arrays and CUDA tensors.

A layer below the RPC layer: its extensions never import the agent. The
agent installs them when it is made (``_rpc._registry.BUILTIN_EXTENSIONS``),
handing itself over as a :class:`~._host.Host`; each registers its internal
handlers on the agent's registry and its codec hook on the agent's codec
(``_serialization._hooks.CodecHooks``).
"""

from __future__ import annotations

from ._cuda_ipc import CudaIpc, install_cuda_ipc
from ._host import Host, Outbox

__all__ = ["CudaIpc", "Host", "Outbox", "install_cuda_ipc"]
