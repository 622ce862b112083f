"""``RemoteModule``: a module made and kept on another worker, called through RPC."""

from __future__ import annotations

from typing import Any, Generic, TypeVar

from .._errors import ConfigError
from .._futures import Future
from .._rpc._api import rpc_sync
from .._rpc._context import current_agent
from .._rpc._dispatch import resolve
from .._rref._rref import RRef
from .._worker import WorkerInfo
from ._module import Module

__all__ = ["RemoteModule"]

M = TypeVar("M", bound=Module)


def _make(cls_name: str, args: list[Any], kwargs: dict[str, Any]) -> RRef[Module]:
    module = resolve(cls_name)(*args, **kwargs)
    if not isinstance(module, Module):
        raise ConfigError(
            f"RemoteModule: {cls_name} made a {type(module).__name__}, not an rpcdist.nn.Module"
        )
    return RRef(module)


def _parameters(module: RRef[Module], recurse: bool) -> list[RRef[Any]]:
    return [RRef(p) for p in module.local_value().parameters(recurse)]


class RemoteModule(Generic[M]):
    """A module created on worker ``to``; ``forward`` runs it there.

    Inside a distributed autograd context the call records its edges like
    any other, so ``remote_parameters()`` and a ``DistributedOptimizer``
    train it where it lives.

    Args:
        to: The worker that makes and holds the module (name, rank or WorkerInfo).
        module_cls: An ``rpcdist.nn.Module`` subclass, sent by name.
        args: Positional arguments of its constructor.
        kwargs: Keyword arguments of its constructor.

    Raises:
        ConfigError: unknown worker, or the class does not make a Module.
        Exception: what the constructor raised on ``to`` (same type).
    """

    __module__ = "rpcdist.nn"

    def __init__(
        self,
        to: str | int | WorkerInfo,
        module_cls: type[M],
        args: Any = (),
        kwargs: dict[str, Any] | None = None,
    ) -> None:
        agent = current_agent()
        self.owner = agent.worker(to)
        name = agent.function_name(module_cls)
        self.module_rref: RRef[M] = rpc_sync(
            self.owner, _make, args=(name, list(args), kwargs or {})
        )

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the module's forward on its owner and return the result (blocking)."""
        # Through the RRef's proxy: the call names the module by its id (no
        # RRef fork per call) and, once known to be plain, takes the fast path.
        return self.module_rref.rpc_sync().forward(*args, **kwargs)

    __call__ = forward

    def forward_async(self, *args: Any, **kwargs: Any) -> Future[Any]:
        """:meth:`forward`, returning a Future (awaitable)."""
        fut: Future[Any] = self.module_rref.rpc_async().forward(*args, **kwargs)
        return fut

    def remote_parameters(self, recurse: bool = True) -> list[RRef[Any]]:
        """RRefs to the module's parameters, for a ``DistributedOptimizer``."""
        got: list[RRef[Any]] = rpc_sync(self.owner, _parameters, args=(self.module_rref, recurse))
        return got

    def get_module_rref(self) -> RRef[M]:
        """The RRef to the module itself."""
        return self.module_rref

    def __repr__(self) -> str:
        return f"RemoteModule(on {self.owner.name!r}, {self.module_rref!r})"
