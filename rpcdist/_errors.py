"""The rpcdist error tree.

Every exception rpcdist raises on purpose derives from :class:`RpcdistError`,
itself a ``RuntimeError`` as the errors of ``torch.distributed.rpc`` are (a
program's ``except RuntimeError`` around its calls keeps catching a timeout
or a lost worker)::

    RpcdistError
    ├── RpcError                  a call produced no value
    │   ├── RemoteError           the callee raised (type not re-creatable here)
    │   ├── RpcTimeoutError       (also TimeoutError) the deadline passed
    │   └── TransportError        the wire failed
    │       ├── ConnectError      could not reach a peer or the store
    │       ├── WorkerLostError   a peer went away while we needed it
    │       │   └── OwnerLostError (also RRefError) an RRef's owner is gone
    │       └── ProtocolError     a malformed or unexpected frame
    ├── ClosedError               we shut it down ourselves
    ├── SerializationError        a value could not be encoded or decoded
    ├── RRefError                 misuse or failure of a remote reference
    │   └── RRefCreationError     the remote() that made the RRef failed
    ├── AutogradError             tensor engine or distributed autograd misuse
    ├── CollectiveError           a collective could not complete consistently
    ├── ConfigError               (also ValueError) bad options or arguments
    ├── CallPolicyError           (also PermissionError) the callee refused the function
    ├── NotInitializedError       no agent (init_rpc not called, or shut down)
    └── WrongThreadError          a blocking call made on the agent's loop thread

"We closed it" (:class:`ClosedError`) is kept apart from "something external
broke it" (:class:`WorkerLostError`). Lower-layer exceptions (grpc, msgpack,
protobuf, OS) are translated where they are first caught and chained with
``raise ... from``.
"""

from __future__ import annotations

__all__ = [
    "AutogradError",
    "CallPolicyError",
    "ClosedError",
    "CollectiveError",
    "ConfigError",
    "ConnectError",
    "NotInitializedError",
    "OwnerLostError",
    "ProtocolError",
    "RRefCreationError",
    "RRefError",
    "RemoteError",
    "RpcError",
    "RpcTimeoutError",
    "RpcdistError",
    "SerializationError",
    "TransportError",
    "WorkerLostError",
    "WrongThreadError",
]


class RpcdistError(RuntimeError):
    """Root of every error rpcdist raises on purpose (a ``RuntimeError``, as
    ``torch.distributed.rpc``'s errors are)."""

    __module__ = "rpcdist"


class RpcError(RpcdistError):
    """A remote call produced no value."""

    __module__ = "rpcdist"


class RemoteError(RpcError):
    """The callee raised an exception whose type cannot be re-created here.

    Attributes:
        remote_type: Qualified name of the exception type on the callee.
        remote_traceback: Formatted traceback text from the callee.
    """

    __module__ = "rpcdist"

    def __init__(self, message: str, *, remote_type: str = "", remote_traceback: str = "") -> None:
        super().__init__(message)
        self.remote_type = remote_type
        self.remote_traceback = remote_traceback


class RpcTimeoutError(RpcError, TimeoutError):
    """A call's deadline passed before a reply arrived.

    Attributes:
        snapshot: What this worker had outstanding when the deadline passed
            (pending calls per peer, collectives, RRefs, autograd contexts,
            lost peers), as ``rpcdist.debug_info()`` returns it; ``None``
            where no agent was at hand (for example, a timeout raised on a
            remote worker).
    """

    __module__ = "rpcdist"

    def __init__(self, message: str = "", *, snapshot: dict[str, object] | None = None) -> None:
        super().__init__(message)
        self.snapshot = snapshot


class TransportError(RpcError):
    """The transport failed underneath a call."""

    __module__ = "rpcdist"


class ConnectError(TransportError):
    """A peer or the rendezvous store could not be reached."""

    __module__ = "rpcdist"


class WorkerLostError(TransportError):
    """A peer went away (died, left or became unreachable) while needed."""

    __module__ = "rpcdist"


class ProtocolError(TransportError):
    """A frame was malformed, truncated or unexpected."""

    __module__ = "rpcdist"


class ClosedError(RpcdistError):
    """The agent, or the object used, was shut down by this process."""

    __module__ = "rpcdist"


class SerializationError(RpcdistError):
    """A value could not be encoded for the wire or decoded from it."""

    __module__ = "rpcdist"


class RRefError(RpcdistError):
    """Misuse or failure of a remote reference."""

    __module__ = "rpcdist"


class RRefCreationError(RRefError):
    """The ``remote()`` call that was to create this RRef's value failed."""

    __module__ = "rpcdist"


class OwnerLostError(RRefError, WorkerLostError):
    """The worker that owns an RRef's value is gone."""

    __module__ = "rpcdist"


class AutogradError(RpcdistError):
    """Misuse of the tensor engine or of distributed autograd."""

    __module__ = "rpcdist"


class CollectiveError(RpcdistError):
    """A collective operation could not complete consistently on every rank."""

    __module__ = "rpcdist"


class ConfigError(RpcdistError, ValueError):
    """An option, argument or environment setting is invalid."""

    __module__ = "rpcdist"


class CallPolicyError(RpcdistError, PermissionError):
    """The callee's callable policy refused the function a call named.

    See ``RpcOptions.callable_policy`` and ``RpcOptions.allowed_callables``.
    """

    __module__ = "rpcdist"


class NotInitializedError(RpcdistError):
    """No agent is running: ``init_rpc`` was not called, or shut down since."""

    __module__ = "rpcdist"


class WrongThreadError(RpcdistError):
    """A blocking call was made on the agent's own event-loop thread."""

    __module__ = "rpcdist"
