"""``RemoteModule`` over torch modules, as ``torch.distributed.nn.RemoteModule``.

A RemoteModule may be sent to other workers (the DDP + RPC program hands one
to each trainer): it travels as its owner and an RRef to the module
(extension code 35), never by pickle.
"""

from __future__ import annotations

from typing import Any, TypeVar

import torch

from .._errors import ConfigError, SerializationError
from .._futures import Future
from .._rpc import _api
from .._rref._rref import RRef, remote
from .._serialization import register_extension
from .._worker import WorkerInfo

__all__ = ["REMOTE_MODULE_CODE", "RemoteModule", "install"]

_RemoteModuleT = TypeVar("_RemoteModuleT", bound="RemoteModule")

#: Codec extension code of RemoteModules.
REMOTE_MODULE_CODE = 35


def _parameter_rrefs(module_rref: RRef[torch.nn.Module], recurse: bool) -> list[RRef[Any]]:
    return [RRef(p) for p in module_rref.local_value().parameters(recurse)]


def _owner_of(remote_device: str) -> tuple[str | int, str]:
    """``"ps"``, ``"ps/cpu"``, ``"rank:1/cpu"`` -> ``(worker, device)``."""
    if not isinstance(remote_device, str) or not remote_device:
        raise ConfigError(
            f"RemoteModule: remote_device must be 'worker[/device]', got {remote_device!r}"
        )
    worker, _, device = remote_device.partition("/")
    if worker.startswith("rank:"):
        raw = worker[len("rank:") :]
        if not raw.isdigit():
            raise ConfigError(f"RemoteModule: bad rank in remote_device {remote_device!r}")
        return int(raw), device or "cpu"
    return worker, device or "cpu"


#: ``nn.Module`` methods that would act on the local stand-in, not on the
#: module: refused, as torch's RemoteModule refuses them.
_NOT_HERE = (
    "add_module",
    "apply",
    "bfloat16",
    "buffers",
    "children",
    "cpu",
    "cuda",
    "double",
    "extra_repr",
    "float",
    "half",
    "ipu",
    "load_state_dict",
    "named_buffers",
    "named_children",
    "named_parameters",
    "parameters",
    "register_backward_hook",
    "register_buffer",
    "register_forward_hook",
    "register_forward_pre_hook",
    "register_parameter",
    "requires_grad_",
    "share_memory",
    "state_dict",
    "to",
    "type",
    "xpu",
    "zero_grad",
)


def _refuse(name: str) -> Any:
    # (torch's text, which programs match, then rpcdist's detail)
    hint = " Please use ``remote_parameters`` instead." if name == "parameters" else ""

    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise ValueError(
            f"Method ``{name}`` not supported for RemoteModule.{hint} It would act on this "
            f"worker's stand-in, not on the module on {self.owner.name!r} (call it there "
            "through get_module_rref().rpc_sync())"
        )

    method.__name__ = name
    return method


class RemoteModule(torch.nn.Module):  # type: ignore[misc]  # Any without torch
    """A ``torch.nn.Module`` made and kept on another worker; ``forward`` runs it there.

    Inside a distributed autograd context the call records its edges like any
    other, so ``remote_parameters()`` and a ``DistributedOptimizer`` train it
    where it lives. It is an ``nn.Module`` here as in torch (it may sit in an
    ``nn.Sequential`` or be a model's attribute), holding no parameters of
    its own: methods that would act on the module's tensors (``to``,
    ``state_dict``, ``named_parameters``, ...) raise ``ValueError`` as
    torch's do; a model holding one lists only its local parameters
    (``model.parameters()`` reads each submodule's own table, empty here).

    Args:
        remote_device: ``"worker"``, ``"worker/cpu"`` or ``"rank:N/cpu"``; a CUDA
            device there is where the module is moved after construction.
        module_cls: The ``torch.nn.Module`` subclass, sent by name.
        args: Positional arguments of its constructor.
        kwargs: Keyword arguments of its constructor.

    Raises:
        ConfigError: bad ``remote_device`` or unknown worker.
        Exception: what the constructor raised on the owner (same type).
    """

    __module__ = "rpcdist.torch.nn"

    #: As torch's: rpcdist applies no device map to a RemoteModule's calls
    #: (``TensorPipeRpcBackendOptions.device_maps`` are recorded, not applied).
    is_device_map_set = False
    #: As torch's for a module made without a module interface: rpcdist runs
    #: no TorchScript.
    is_scriptable = False

    def __init__(
        self,
        remote_device: str,
        module_cls: type[torch.nn.Module],
        args: Any = None,
        kwargs: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        if isinstance(module_cls, type) and not issubclass(module_cls, torch.nn.Module):
            raise ConfigError(
                "Expect `module_cls(*args, **kwargs)` returns an instance of <class nn.Module>, "
                f"but it returns an instance of {module_cls!r} (RemoteModule makes torch "
                "modules only)"
            )
        worker, device = _owner_of(remote_device)
        self.device = device
        self.module_rref: RRef[torch.nn.Module] = remote(
            worker, module_cls, args=() if args is None else args, kwargs=kwargs or {}
        )
        self.owner: WorkerInfo = self.module_rref.owner()
        if device != "cpu":
            self.module_rref = remote(self.owner, _to_device, args=(self.module_rref, device))

    @staticmethod
    def init_from_module_rref(
        remote_device: str, module_rref: RRef[torch.nn.Module], _module_interface_cls: Any = None
    ) -> RemoteModule:
        """A RemoteModule over a module that already lives in ``module_rref``
        (made there by ``rpc.remote``, or another RemoteModule's), sharing it.

        As in torch, the module stays where it lives: calls go to
        ``module_rref``'s owner, whichever worker ``remote_device`` names
        (torch's tests make one on a worker that is not the owner).

        Raises:
            ConfigError: a malformed ``remote_device``, or ``module_rref`` is
                not an RRef.
        """
        _, device = _owner_of(remote_device)
        if not isinstance(module_rref, RRef):
            raise ConfigError(
                f"init_from_module_rref: expected an RRef to a module, got "
                f"{type(module_rref).__name__}"
            )
        return _make(module_rref.owner(), module_rref, device)

    @property
    def on(self) -> str:
        """The owner's name (torch's ``RemoteModule.on``)."""
        return self.owner.name

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the module's forward on its owner and return the result (blocking)."""
        return self.module_rref.rpc_sync().forward(*args, **kwargs)

    __call__ = forward

    def forward_async(self, *args: Any, **kwargs: Any) -> Future[Any]:
        """:meth:`forward`, returning a Future."""
        fut: Future[Any] = self.module_rref.rpc_async().forward(*args, **kwargs)
        return fut

    def remote_parameters(self, recurse: bool = True) -> list[RRef[Any]]:
        """RRefs to the module's parameters, for a ``DistributedOptimizer``."""
        got: list[RRef[Any]] = _api.rpc_sync(
            self.owner, _parameter_rrefs, args=(self.module_rref, recurse)
        )
        return got

    def get_module_rref(self) -> RRef[torch.nn.Module]:
        """The RRef to the module itself."""
        return self.module_rref

    def train(self: _RemoteModuleT, mode: bool = True) -> _RemoteModuleT:
        """Set the module's training mode on its owner (``eval()``: ``train(False)``)."""
        # (through the module's RRef: the module stays there, nothing comes back)
        done = self.module_rref.remote().train(bool(mode))._confirmed
        if done is not None:
            done.wait()
        self.training = bool(mode)
        return self

    def named_modules(
        self, memo: Any = None, prefix: str = "", remove_duplicate: bool = True
    ) -> Any:
        """Refused when called on the RemoteModule itself, as torch's; a model
        holding one still lists its modules (that call passes ``memo``)."""
        if memo is None:
            _refuse("named_modules")(self)
        return super().named_modules(memo, prefix, remove_duplicate)

    def modules(self, remove_duplicate: bool = True) -> Any:
        """Refused, as torch's (see :meth:`named_modules`)."""
        _refuse("modules")(self)

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise RuntimeError(
            "Cannot pickle RemoteModule in python pickler. RemoteModule can only be pickled "
            "when using RPC (rpcdist sends it as its owner and module RRef, never by pickle)"
        )

    def __repr__(self) -> str:
        return f"RemoteModule(on {self.owner.name!r}, {self.module_rref!r})"


for _name in _NOT_HERE:
    setattr(RemoteModule, _name, _refuse(_name))


def _to_device(module_rref: RRef[torch.nn.Module], device: str) -> torch.nn.Module:
    return module_rref.local_value().to(device)


def _encode(m: RemoteModule, wire: Any) -> list[Any]:
    return [m.owner, m.module_rref, m.device]


def _make(owner: WorkerInfo, module_rref: RRef[torch.nn.Module], device: str) -> RemoteModule:
    m = RemoteModule.__new__(RemoteModule)
    torch.nn.Module.__init__(m)
    m.owner, m.module_rref, m.device = owner, module_rref, device
    return m


def _decode(payload: Any, wire: Any) -> RemoteModule:
    if not (
        isinstance(payload, list)
        and len(payload) == 3
        and isinstance(payload[0], WorkerInfo)
        and isinstance(payload[1], RRef)
        and isinstance(payload[2], str)
    ):
        raise SerializationError("malformed RemoteModule payload")
    return _make(*payload)


def install() -> None:
    """Teach the codec RemoteModules (idempotent)."""
    register_extension(RemoteModule, REMOTE_MODULE_CODE, _encode, _decode)
