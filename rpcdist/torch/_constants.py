"""The defaults of ``torch.distributed.rpc.constants`` (public in ``rpcdist.torch.rpc.constants``)."""

from __future__ import annotations

#: Rendezvous through ``MASTER_ADDR``/``MASTER_PORT``.
DEFAULT_INIT_METHOD = "env://"
#: Threads serving plain-function calls.
DEFAULT_NUM_WORKER_THREADS = 16
#: The default call timeout, seconds.
DEFAULT_RPC_TIMEOUT_SEC = 60.0
#: ``shutdown``'s and ``_wait_all_workers``' default: no limit.
DEFAULT_SHUTDOWN_TIMEOUT = 0.0
#: A call's ``timeout=`` when not given: the default.
UNSET_RPC_TIMEOUT = -1.0
