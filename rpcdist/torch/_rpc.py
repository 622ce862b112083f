"""``torch.distributed.rpc``'s functions over rpcdist's agent.

Where torch's semantics differ from rpcdist's, these follow torch: a
``timeout`` of ``-1`` (torch's ``UNSET_RPC_TIMEOUT``) means the agent's
default and ``0`` means none; ``rank=-1`` means "from the environment";
``shutdown(graceful, timeout=0)``'s ``0`` means no limit.
"""

from __future__ import annotations

import datetime
import enum
import functools
import itertools
import os
import socket
import sys
import warnings
from typing import Any

from .._deadline import UNSET, Unset
from .._errors import ConfigError
from .._futures import Future
from .._options import RpcOptions
from .._rpc import _api
from .._rpc._context import default_agent
from .._rref._rref import RRef
from .._rref._rref import remote as _remote
from .._worker import WorkerInfo
from ._constants import (
    DEFAULT_INIT_METHOD,
    DEFAULT_NUM_WORKER_THREADS,
    DEFAULT_RPC_TIMEOUT_SEC,
    UNSET_RPC_TIMEOUT,
)
from ._futures import adopt
from ._install import install
from ._profile import after, enabled, keep_profiling_future, profiled, set_node_id

__all__ = [
    "BackendType",
    "RpcBackendOptions",
    "TensorPipeRpcBackendOptions",
    "_set_rpc_timeout",
    "get_rpc_timeout",
    "get_worker_info",
    "init_rpc",
    "is_available",
    "remote",
    "rpc_async",
    "rpc_sync",
    "shutdown",
]

_rendezvous_rounds = itertools.count()


class BackendType(enum.Enum):
    """Accepted for compatibility: every backend is rpcdist's own transport."""

    TENSORPIPE = "TENSORPIPE"


def _index(device: Any) -> Any:
    """A device map's key or value as a CUDA index (``0``, ``"cuda:0"`` and
    ``torch.device("cuda", 0)`` alike); other values as they are."""
    if isinstance(device, int):
        return device
    text = str(device)
    if text.startswith("cuda:") and text[5:].isdigit():
        return int(text[5:])
    return "cuda:0" if text == "cuda" else text


class _ArgumentTypeError(ConfigError, TypeError):
    """An argument of the wrong type (a ``TypeError`` too, as torch raises)."""


class RpcBackendOptions:
    """torch's base class of backend options: a default call timeout and a
    rendezvous method (``init_rpc`` takes it as it takes the subclass)."""

    __module__ = "rpcdist.torch.rpc"

    def __init__(
        self, rpc_timeout: float = DEFAULT_RPC_TIMEOUT_SEC, init_method: str = DEFAULT_INIT_METHOD
    ) -> None:
        if isinstance(rpc_timeout, bool) or not isinstance(rpc_timeout, int | float):
            raise _ArgumentTypeError(
                "incompatible constructor arguments: rpc_timeout must be seconds (a float), "
                f"got {rpc_timeout!r}"
            )
        self.rpc_timeout = rpc_timeout
        self.init_method = init_method
        self.num_worker_threads = DEFAULT_NUM_WORKER_THREADS
        self.rpcdist_options: RpcOptions | None = None


class TensorPipeRpcBackendOptions(RpcBackendOptions):
    """torch's backend options, mapped onto rpcdist's.

    Args:
        num_worker_threads: Threads serving plain-function calls.
        rpc_timeout: Default call timeout in seconds (``0``: none).
        init_method: ``env://`` (default), ``tcp://host:port`` or ``file:///path``.
        device_maps: Accepted and recorded, not applied: a CUDA tensor
            arrives on the device of the sender's index (an identity map).
        devices: Accepted and ignored (as ``device_maps``).
        _transports: Accepted and ignored (TensorPipe's transport list).
        _channels: Accepted and ignored (TensorPipe's channel list).
        rpcdist_options: rpcdist's own :class:`~rpcdist.RpcOptions` (not
            torch's): what a program ported as is may need to set, such as
            ``allowed_callables`` or ``allow_pickle``.
    """

    __module__ = "rpcdist.torch.rpc"

    def __init__(
        self,
        *,
        num_worker_threads: int = DEFAULT_NUM_WORKER_THREADS,
        rpc_timeout: float = DEFAULT_RPC_TIMEOUT_SEC,
        init_method: str = DEFAULT_INIT_METHOD,
        device_maps: dict[Any, Any] | None = None,
        devices: list[Any] | None = None,
        _transports: Any = None,
        _channels: Any = None,
        rpcdist_options: RpcOptions | None = None,
    ) -> None:
        if rpcdist_options is not None and not isinstance(rpcdist_options, RpcOptions):
            raise ConfigError(
                "TensorPipeRpcBackendOptions(rpcdist_options=...) must be an rpcdist.RpcOptions, "
                f"got {type(rpcdist_options).__name__}"
            )
        super().__init__(rpc_timeout, init_method)
        self.rpcdist_options = rpcdist_options
        self.num_worker_threads = num_worker_threads
        self.device_maps: dict[str, dict[Any, Any]] = {}
        for to, device_map in (device_maps or {}).items():
            self._record(to, device_map, 3)
        self.devices = list(devices or [])

    def set_device_map(self, to: str, device_map: dict[Any, Any]) -> None:
        """Recorded, not applied: a CUDA tensor arrives on the device of the
        sender's index. A map that moves tensors elsewhere warns rather
        than being ignored in silence."""
        self._record(to, device_map, 3)

    def _record(self, to: str, device_map: dict[Any, Any], stacklevel: int) -> None:
        self.device_maps[to] = dict(device_map)
        moved = {k: v for k, v in device_map.items() if _index(k) != _index(v)}
        if moved:
            warnings.warn(
                f"rpcdist does not apply device maps: tensors sent to {to!r} arrive on the "
                f"device of the sender's index, not as mapped by {moved} (move them with "
                ".to(device) where they arrive)",
                RuntimeWarning,
                stacklevel=stacklevel,
            )

    def set_devices(self, devices: list[Any]) -> None:
        """Accepted and recorded; rpcdist does not use it."""
        self.devices = list(devices)


def _args(args: Any) -> Any:
    """torch's ``args=None`` is no arguments; anything else goes to rpcdist as
    given, whose error names a value that is not a tuple or list (``args=5``,
    or a tensor for ``args=(t,)``) instead of failing on it here."""
    return () if args is None else args


def _timeout(timeout: float | Unset | None) -> float | Unset | None:
    if timeout is None or isinstance(timeout, Unset):
        return timeout
    if timeout == UNSET_RPC_TIMEOUT:
        return UNSET
    return None if timeout == 0 else float(timeout)


def _torch_store(host: str, port: int, rank: int | None, world_size: int | None) -> Any:
    """torch's default process-group store, if it is a TCPStore serving ``host:port``
    to the same ranks: rpcdist cannot open its own store there."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    if rank is not None and dist.get_rank() != rank:
        return None
    if world_size is not None and dist.get_world_size() != world_size:
        return None
    store = dist.distributed_c10d._get_default_store()
    inner = store
    while hasattr(inner, "underlying_store"):
        inner = inner.underlying_store
    if getattr(inner, "port", None) != port:
        return None
    return store


def _rendezvous(init_method: str, rank: int | None, world_size: int | None) -> str:
    """``init_method``, or a ``tcp://`` address published in torch's store
    when torch's process group already listens where rpcdist would."""
    if init_method.startswith("env://"):
        host = os.environ.get("MASTER_ADDR", "127.0.0.1")
        raw = os.environ.get("MASTER_PORT", "")
    elif init_method.startswith("tcp://"):
        host, _, raw = init_method[len("tcp://") :].rpartition(":")
    else:
        return init_method
    if not raw.isdigit():
        return init_method
    store = _torch_store(host, int(raw), rank, world_size)
    if store is None:
        return init_method
    me = rank if rank is not None else int(os.environ.get("RANK", "-1"))
    key = f"rpcdist/init_method/{next(_rendezvous_rounds)}"
    if me == 0:
        with socket.socket() as s:  # a port the OS picks; published through torch's store
            s.bind(("127.0.0.1" if host == "localhost" else host, 0))
            port = s.getsockname()[1]
        store.set(key, f"tcp://{host}:{port}")
    got: bytes = store.get(key)
    return got.decode()


def _check_init_args(backend: Any, opts: Any) -> RpcBackendOptions:
    """``init_rpc``'s backend and options, checked as torch checks them
    (texts begin as torch's): the base options class is taken as the
    TensorPipe one; another backend's options class is refused."""
    if backend is not None and not isinstance(backend, BackendType):
        raise _ArgumentTypeError(
            f"Argument backend must be a member of BackendType, got {backend!r}"
        )
    if opts is None:
        return TensorPipeRpcBackendOptions()
    if not isinstance(opts, RpcBackendOptions):
        raise _ArgumentTypeError(
            "Argument rpc_backend_options must be an instance of RpcBackendOptions "
            f"(TensorPipeRpcBackendOptions), got {type(opts).__name__}"
        )
    if type(opts) is not RpcBackendOptions and not isinstance(opts, TensorPipeRpcBackendOptions):
        if backend is None:
            raise _ArgumentTypeError(
                f"Could not infer backend for options {opts!r}: rpcdist takes "
                "TensorPipeRpcBackendOptions"
            )
        raise _ArgumentTypeError(
            "`rpc_backend_options` must be a `TensorPipeRpcBackendOptions`, got "
            f"{type(opts).__name__}"
        )
    return opts


def _check_rank_given(init_method: str) -> None:
    """Refuse, in torch's words, a rank that neither the call, the
    ``init_method``'s query (``?rank=``) nor ``RANK`` gives.

    Raises:
        ValueError: no rank anywhere.
    """
    if "RANK" in os.environ or "rank=" in init_method.partition("?")[2]:
        return
    scheme = init_method.partition("://")[0]
    missing = (
        "environment variable RANK expected, but not set"
        if scheme == "env"
        else "rank parameter missing"
    )
    raise ValueError(
        f"Error initializing torch.distributed using {scheme}:// rendezvous: {missing}"
    )


def init_rpc(
    name: str,
    backend: BackendType | None = None,
    rank: int = -1,
    world_size: int | None = None,
    rpc_backend_options: TensorPipeRpcBackendOptions | None = None,
) -> None:
    """Start this worker and rendezvous with the others (``torch.distributed.rpc.init_rpc``).

    When ``torch.distributed.init_process_group`` already runs a store at the
    rendezvous address (``env://`` after a ``gloo`` process group), rpcdist
    opens its own store on a port the OS picks and publishes its address
    through torch's store.

    Args:
        name: This worker's unique name.
        backend: Ignored (rpcdist has one transport).
        rank: This worker's rank; ``-1``: ``RANK`` from the environment.
        world_size: Number of workers; ``None``: ``WORLD_SIZE``, and
            without it a dynamic group, as torch's (ranks join and leave).
        rpc_backend_options: A :class:`TensorPipeRpcBackendOptions`.

    Raises:
        ConfigError: bad arguments or already initialised (a ``TypeError``
            too where an argument has the wrong type, as in torch).
        ConnectError: the rendezvous did not complete in time.
    """
    opts = _check_init_args(backend, rpc_backend_options)
    agent = default_agent()
    if agent is not None and not agent.closed and "rpc" in agent.roles:
        raise ConfigError(  # (torch's words first, before any rendezvous)
            f"RPC is already initialized: this process runs rpcdist's worker {agent.name!r}; "
            "call rpc.shutdown() first"
        )
    install()
    r = None if rank is None or rank < 0 else rank
    if r is None:
        _check_rank_given(opts.init_method)
    timeout = None if not opts.rpc_timeout or opts.rpc_timeout <= 0 else float(opts.rpc_timeout)
    init_method = _rendezvous(opts.init_method, r, world_size)
    _api.init_rpc(
        name,
        r,
        world_size,
        init_method=init_method,
        rpc_timeout=timeout,
        num_worker_threads=opts.num_worker_threads,
        options=opts.rpcdist_options,
    )
    set_node_id(_api.get_worker_info().id)


def rpc_sync(
    to: str | int | WorkerInfo,
    func: Any,
    args: Any = None,
    kwargs: Any = None,
    timeout: float = UNSET_RPC_TIMEOUT,
) -> Any:
    """Run ``func(*args, **kwargs)`` on ``to`` and return its result.

    Raises:
        RpcTimeoutError: no reply within ``timeout`` (``-1``: the default, ``0``: none).
        Exception: what ``func`` raised there (same type where possible).
    """
    call = functools.partial(
        _api.rpc_sync, to, func, args=_args(args), kwargs=kwargs, timeout=_timeout(timeout)
    )
    return profiled("rpc_sync", to, func, call)[0] if enabled() else call()


def rpc_async(
    to: str | int | WorkerInfo,
    func: Any,
    args: Any = None,
    kwargs: Any = None,
    timeout: float = UNSET_RPC_TIMEOUT,
) -> Future[Any]:
    """Run ``func(*args, **kwargs)`` on ``to``; a Future of its result.

    Raises:
        ConfigError: unknown worker.
        SerializationError: an argument cannot be sent.
    """
    call = functools.partial(
        _api.rpc_async, to, func, args=_args(args), kwargs=kwargs, timeout=_timeout(timeout)
    )
    if not enabled():
        return adopt(call())  # (then() callbacks may block, as torch's)
    fut, profiling = profiled("rpc_async", to, func, call, until=_completion_of)
    assert profiling is not None
    # Complete once the profiled range has ended, as torch's does.
    return adopt(after(fut, profiling))


def remote(
    to: str | int | WorkerInfo,
    func: Any,
    args: Any = None,
    kwargs: Any = None,
    timeout: float = UNSET_RPC_TIMEOUT,
) -> RRef[Any]:
    """Run ``func(*args, **kwargs)`` on ``to`` and return an RRef to the result at once.

    Raises:
        ConfigError: unknown worker.
        SerializationError: an argument cannot be sent.
    """
    call = functools.partial(
        _remote, to, func, args=_args(args), kwargs=kwargs, timeout=_timeout(timeout)
    )
    if not enabled():
        return call()
    rref, profiling = profiled("rpc_remote", to, func, call, until=_created)
    assert profiling is not None
    keep_profiling_future(rref, profiling)  # (RRef._get_profiling_future)
    return rref


def _completion_of(fut: Future[Any]) -> Future[Any]:
    """When an ``rpc_async`` call is done: when its future is."""
    return fut


def _created(rref: RRef[Any]) -> Future[Any] | None:
    """When the owner has made the value (``None``: it is made already)."""
    return rref._confirmed


def shutdown(graceful: bool = True, timeout: float = 0) -> None:
    """Stop this worker; ``graceful`` waits for every worker's outstanding work.

    Args:
        graceful: Wait for all workers to finish (torch's barrier).
        timeout: Seconds to wait at most; ``0``: no limit.

    Raises:
        RpcTimeoutError: the graceful shutdown did not finish in time.
    """
    _api.shutdown(graceful=graceful, timeout=timeout or None)


def get_rpc_timeout() -> float:
    """The default call timeout in seconds (``0``: none), as torch reports it.

    Raises:
        NotInitializedError: ``init_rpc`` was not called.
    """
    got = _api.get_rpc_timeout()
    return 0.0 if got is None else float(got)


def _set_rpc_timeout(timeout: float | datetime.timedelta, /) -> None:
    """Change the default call timeout (torch's private setter): seconds or a
    ``timedelta``; ``0``: none.

    Raises:
        ConfigError: a negative or non-numeric timeout.
    """
    seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else timeout
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) or seconds < 0:
        raise ConfigError(
            f"_set_rpc_timeout: expected seconds >= 0 or a timedelta, got {timeout!r}"
        )
    _api.set_rpc_timeout(float(seconds) or None)


def is_available() -> bool:
    """Always ``True``: rpcdist's RPC needs no special build of torch."""
    return True


def get_worker_info(worker_name: str | None = None) -> WorkerInfo:
    """This worker's :class:`WorkerInfo`, or that of ``worker_name``.

    Raises:
        ConfigError: no worker has that name.
    """
    return _api.get_worker_info(worker_name)


install()
