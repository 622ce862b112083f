"""Functions travel by name: ``"module:qualname"``, resolved on the receiver,
under a :class:`CallablePolicy`.

Not pickling code keeps arbitrary code off the wire, but any importable
function could still be named: ``os:system`` would run a shell command. So
every resolution passes a policy, and the default (``"exposed"``) admits
only what the program exposes, by construction (see :mod:`._exposure`):
its own functions and classes, what it exposes explicitly, a curated set of
pure numerical functions and rpcdist's protocol entry points, judged on
the object the name resolves to (so ``mymodule:os.system`` and a
re-export are refused). A peer's call never imports a module the program
has not (but for explicit entries, which the program named).
``"allowlist"`` admits only explicit entries and the protocol entry points;
``"any"`` turns the check off, for fully trusted clusters.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .._errors import CallPolicyError, SerializationError
from . import _exposure

__all__ = [
    "DEFAULT_POLICY",
    "POLICY_MODES",
    "CallablePolicy",
    "check_method",
    "function_name",
    "name_of",
    "policy_of",
    "resolve",
    "resolve_function",
]

#: ``CallablePolicy.mode`` values; ``"denylist"`` is a deprecated alias of ``"exposed"``.
POLICY_MODES = ("exposed", "allowlist", "any", "denylist")


def _under(module: str, prefixes: frozenset[str]) -> bool:
    parts = module.split(".")
    return any(".".join(parts[:i]) in prefixes for i in range(1, len(parts) + 1))


@dataclass(frozen=True, eq=False)
class CallablePolicy:
    """What a worker lets peers call by name (see the module docstring).

    Attributes:
        mode: ``"exposed"``, ``"allowlist"`` or ``"any"`` (``"denylist"``,
            deprecated, means ``"exposed"``).
        allowed: Entries ``"module"`` (its functions and its submodules') or
            ``"module:qualname"`` (one function or class, and its methods).

    Compared and hashed by identity (it keys a cache of resolutions).
    """

    mode: str = "exposed"
    allowed: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        if self.mode == "denylist":  # (deprecated; RpcOptions warns)
            object.__setattr__(self, "mode", "exposed")

    def _allowed(self, module: str, qualname: str) -> bool:
        if not self.allowed:
            return False
        if _under(module, frozenset(a for a in self.allowed if ":" not in a)):
            return True
        parts = qualname.split(".")
        return any(
            f"{module}:{'.'.join(parts[:i])}" in self.allowed for i in range(1, len(parts) + 1)
        )

    def may_import(self, module: str, qualname: str) -> bool:
        """Whether a peer's call of ``module:qualname`` may import ``module``
        (not imported yet): only when the program or rpcdist named it."""
        return (
            self.mode == "any"
            or (self._allowed(module, qualname) and not _under(module, _exposure.NEVER))
            or _exposure.is_protocol(module, qualname)
            or (self.mode != "allowlist" and module in _exposure.IMPORTABLE)
        )

    def refusal(self, name: str, target: object, walked: list[object]) -> str | None:
        """Why calling ``target`` (resolved from ``name``, through the
        objects ``walked``) is refused, or ``None`` if it is exposed."""
        if self.mode == "any":
            return None
        module, _, qualname = name.partition(":")
        if _under(module, _exposure.NEVER):
            return "rpcdist's launcher and test helpers are never called by peers"
        if (
            self._allowed(module, qualname)
            or any(_exposure.is_exposed(o) for o in walked)
            or _exposure.is_protocol(module, qualname)
        ):
            return None
        if self.mode == "allowlist":
            return "this worker accepts only the functions it allows (callable_policy='allowlist')"
        if _exposure.curated(module, qualname, target) or _exposure.is_program_object(target):
            return None
        return (
            "it is not one of this program's own functions, nor exposed by it, nor a "
            "curated pure numerical function"
        )

    def method_refusal(self, value: object, name: str, method: object) -> str | None:
        """Why calling method ``name`` (``method``, as found without running
        a getter) of ``value``, an owned value reached through an RRef proxy,
        is refused, or ``None``: admitted are the methods of types exposed or
        allowed and of rpcdist's protocol types, the program's own methods
        (of its own types; not ``os.system`` stored on one), and the curated
        pure methods (NumPy's and torch's array math; not ``ndarray.tofile``)."""
        if self.mode == "any":
            return None
        cls = type(value)
        module, qualname = cls.__module__, f"{cls.__qualname__}.{name}"
        if (
            self._allowed(module, qualname)
            or _exposure.is_exposed(cls)
            or _exposure.is_protocol(module, qualname)
            or _exposure.curated_method(cls, name)
            or (_exposure.is_program_object(cls) and _exposure.own_method(cls, name, method))
        ):
            return None
        return (
            f"{cls.__qualname__} is not one of this program's types, and {name!r} is not "
            "one of its curated pure methods"
        )


#: The policy where none is given: only what the program exposes.
DEFAULT_POLICY = CallablePolicy()


def _label(fn: object) -> str:
    name = getattr(fn, "__qualname__", None)
    if isinstance(name, str):
        return repr(name)
    text = repr(fn)
    return text if len(text) <= 80 else text[:77] + "..."


def function_name(fn: Callable[..., Any]) -> str:
    """Return the name under which ``fn`` can be found on another worker.

    Module-level functions, static methods and class methods (``C.f``),
    builtins such as ``operator.add`` or ``math.sqrt``, methods of builtin
    types (``str.upper``, ``torch.Tensor.sum``: ``torch._C:TensorBase.sum``)
    and PyTorch's operators (``torch.add``: ``torch:add``;
    ``torch.ops.aten.add.Tensor``) have such a name.

    Args:
        fn: The function to name.

    Returns:
        ``"module:qualname"``.

    Raises:
        SerializationError: ``fn`` is a lambda, a closure or nested function,
            a bound method of an instance, has no ``__module__``/``__qualname__``,
            or its name does not lead back to ``fn``.
    """
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None)
    owner = getattr(fn, "__objclass__", None)
    if module is None and isinstance(owner, type):  # a method of a builtin type
        module = owner.__module__
    kind = "class" if isinstance(fn, type) else "function"
    prefix = f"cannot send {kind} {_label(fn)} by name"
    if not isinstance(module, str) or not isinstance(qualname, str):
        raise SerializationError(f"{prefix}: it has no __module__ and __qualname__")
    if "<lambda>" in qualname:
        raise SerializationError(
            f"{prefix}: lambdas cannot be found on another worker; use a module-level def"
        )
    if "<locals>" in qualname:
        raise SerializationError(
            f"{prefix}: it is defined inside another function (a closure or nested "
            "function); define it at module level"
        )
    if isinstance(fn, types.MethodType) and not isinstance(fn.__self__, type):
        raise SerializationError(
            f"{prefix}: it is a method bound to an instance; send the instance's data "
            "and call a module-level function instead"
        )
    names = _names(fn, module, qualname)
    for name in names:
        if _leads_back(name, fn):
            return name
    raise SerializationError(
        f"{prefix}: the name '{names[0]}' does not lead back to it "
        "(was it decorated, replaced or created dynamically?)"
    )


def _names(fn: object, module: str, qualname: str) -> list[str]:
    """The names that may lead back to ``fn``: ``module:qualname`` first. A
    builtin that its module holds under its plain name although its qualified
    name says otherwise (``torch.add`` is ``_VariableFunctionsClass.add``)
    has ``module:__name__``, and one of torch's operators
    (``torch.ops.aten.add``, module ``torch._ops.aten``) its path from ``torch``."""
    names = [f"{module}:{qualname}"]
    plain = getattr(fn, "__name__", None)
    if isinstance(plain, str) and plain != qualname:
        names.append(f"{module}:{plain}")
        namespace = module.removeprefix("torch._ops.")
        if namespace != module:
            names.append(f"torch:ops.{namespace}.{plain}")
    return names


def _leads_back(name: str, fn: object) -> bool:
    """Whether ``name`` finds ``fn`` itself here (and would pass :func:`resolve_function`)."""
    module, _, qualname = name.partition(":")
    parts = qualname.split(".")
    if not all(p.isidentifier() for p in (*module.split("."), *parts)):
        return False
    target: object = sys.modules.get(module)
    try:
        for part in parts:
            target = getattr(target, part)
        return target is fn or bool(target == fn)
    except Exception:
        return False


def policy_of(context: object) -> CallablePolicy:
    """The callable policy of the worker decoding with ``context`` (a message's
    wire context: its agent's), or the default one outside an agent."""
    policy = getattr(getattr(context, "agent", None), "policy", None)
    return policy if isinstance(policy, CallablePolicy) else DEFAULT_POLICY


def resolve_function(name: str, policy: CallablePolicy = DEFAULT_POLICY) -> Callable[..., Any]:
    """Find the function called ``name`` (``"module:qualname"``) and check it
    against ``policy``.

    A module not imported yet is imported only where ``policy`` lets the
    name import it (:meth:`CallablePolicy.may_import`); otherwise the name
    is refused without importing anything.

    Args:
        name: A name made by :func:`function_name`.
        policy: What may be called (default: what the program exposes).

    Returns:
        The callable.

    Raises:
        SerializationError: the module cannot be imported, the attribute path
            does not exist, or it is not callable.
        CallPolicyError: ``policy`` refuses it.
    """
    module_name, _, qualname = name.partition(":")
    prefix = f"function '{name}' not found on this worker"
    if not module_name or not qualname:
        raise SerializationError(f"{prefix}: expected 'module:qualname'")
    if not all(p.isidentifier() for p in (*module_name.split("."), *qualname.split("."))):
        raise SerializationError(f"{prefix}: not a dotted Python name")
    if module_name not in sys.modules and not policy.may_import(module_name, qualname):
        raise _refused(
            name,
            f"its module {module_name!r} is not imported on this worker, and a peer's call "
            "never imports one",
        )
    # Through the import system even when the module is in sys.modules:
    # another thread may be importing it still (two first calls at once), and
    # only import_module waits for that to finish.
    try:
        target: object = importlib.import_module(module_name)
    except Exception as exc:
        raise SerializationError(f"{prefix}: cannot import module '{module_name}': {exc}") from exc
    walked: list[object] = []
    for part in qualname.split("."):
        try:
            target = getattr(target, part)
        except AttributeError as exc:
            raise SerializationError(
                f"{prefix}: {exc} (RPC pickler does not serialize function code: functions "
                "travel by name; define it on both caller and callee)"
            ) from exc
        walked.append(target)
    if not callable(target):
        raise SerializationError(f"{prefix}: {type(target).__qualname__} object is not callable")
    why = policy.refusal(name, target, walked)
    if why is not None:
        raise _refused(name, why)
    return target


@functools.lru_cache(maxsize=4096)
def resolve(name: str, policy: CallablePolicy = DEFAULT_POLICY) -> Callable[..., Any]:
    """:func:`resolve_function`, remembered per name and policy (for
    module-level, long-lived functions: a module reloaded later is not seen;
    failures are not remembered)."""
    return resolve_function(name, policy)


_name_of = functools.lru_cache(maxsize=4096)(function_name)


def name_of(fn: Callable[..., Any]) -> str:
    """:func:`function_name`, remembered per function (keeping it alive:
    functions sent by name are module-level and long-lived)."""
    try:
        return _name_of(fn)
    except TypeError:  # unhashable (a method bound to such an instance): refused anyway
        return function_name(fn)


#: ``(policy, type, name)`` of methods found allowed, where the method came
#: from the type (not the instance): a proxy call checks each once.
_METHODS_OK: dict[tuple[CallablePolicy, type, str], bool] = {}


_MISSING = object()


def check_method(policy: CallablePolicy, value: object, name: str) -> None:
    """Raise unless ``policy`` lets peers call method ``name`` of ``value``
    (see :meth:`CallablePolicy.method_refusal`), without running a getter.

    Raises:
        AttributeError: ``value`` has no such attribute (and its type no
            ``__getattr__`` that could make one): as a local call would.
        CallPolicyError: refused.
    """
    cls = type(value)
    key = (policy, cls, name)
    own = getattr(value, "__dict__", None)
    of_type = not isinstance(own, dict) or name not in own
    if of_type and key in _METHODS_OK:
        return
    method = inspect.getattr_static(value, name, _MISSING)
    if method is _MISSING:
        if inspect.getattr_static(cls, "__getattr__", None) is None:
            raise AttributeError(f"'{cls.__qualname__}' object has no attribute '{name}'")
        method = None
    why = policy.method_refusal(value, name, method)
    if why is not None:
        raise _refused(f"{cls.__module__}:{cls.__qualname__}.{name}", why)
    if of_type:
        if len(_METHODS_OK) >= 4096:
            _METHODS_OK.clear()
        _METHODS_OK[key] = True


def _refused(name: str, why: str) -> CallPolicyError:
    return CallPolicyError(
        f"this worker refuses to call '{name}': {why}; allow it with "
        f"RpcOptions(allowed_callables=('{name}',)) or @rpcdist.expose, or "
        "callable_policy='any' on a fully trusted cluster"
    )
