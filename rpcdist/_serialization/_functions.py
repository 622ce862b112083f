"""Functions travel by name: ``"module:qualname"``, resolved on the receiver,
under a :class:`CallablePolicy`.

Not pickling code keeps arbitrary code off the wire, but any importable
function can still be named: ``os:system`` would run a shell command. So
every resolution passes a policy. The default (``"denylist"``) refuses what
runs programs or code, loads code or native libraries, unpickles, or reaches
files, processes and the network (:data:`DENIED_MODULES`,
:data:`DENIED_NAMES`), judged on the module the name gives, every module
the name's path walks through, and the module the resolved object says it
comes from (so ``mymodule:os.system`` and a re-export are refused too).
``"allowlist"`` accepts only the application's entries (and rpcdist's own
functions, which its protocols call); ``"any"`` turns the check off. An
explicit entry in ``allowed`` overrides the deny list.
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

__all__ = [
    "DEFAULT_POLICY",
    "DENIED_MODULES",
    "DENIED_NAMES",
    "PRIVATE_DENIED",
    "CallablePolicy",
    "check_method",
    "function_name",
    "name_of",
    "policy_of",
    "resolve",
    "resolve_function",
]

#: Modules (and their submodules) whose callables peers may not call by
#: default: they run programs or code, load code or native libraries,
#: unpickle, or reach files, processes, signals and the network.
DENIED_MODULES = frozenset(
    {
        # processes, the OS, signals, threads
        "os", "posix", "nt", "subprocess", "_posixsubprocess", "pty", "signal", "_signal",
        "multiprocessing", "_multiprocessing", "concurrent", "threading", "_thread", "sys",
        "resource", "atexit", "faulthandler", "gc",
        # code: import, compile, evaluate, native libraries, serialised objects
        "importlib", "_imp", "imp", "zipimport", "pkgutil", "runpy", "code", "codeop",
        "ctypes", "_ctypes", "cffi", "pickle", "_pickle", "cPickle", "copyreg", "marshal",
        "shelve", "dill", "cloudpickle", "joblib", "types", "inspect", "pdb", "bdb",
        "cProfile", "profile", "timeit", "trace", "doctest", "pydoc", "unittest",
        "ensurepip", "pip", "venv", "setuptools", "distutils", "site", "sysconfig",
        # files and the network
        "io", "_io", "pathlib", "shutil", "tempfile", "fileinput", "glob", "zipfile",
        "tarfile", "socket", "_socket", "ssl", "select", "selectors", "asyncio",
        "socketserver", "http", "urllib", "ftplib", "smtplib", "poplib", "imaplib",
        "telnetlib", "xmlrpc", "webbrowser", "sqlite3", "dbm", "mmap", "logging.config",
        # modules whose import alone acts (opens a browser, a window, prints)
        "antigravity", "this", "turtle", "turtledemo", "idlelib", "tkinter",
        # rpcdist's own process launchers
        "rpcdist.launch", "rpcdist.testing",
        # NumPy's native-code and build helpers
        "numpy.ctypeslib", "numpy.f2py", "numpy.distutils", "numpy.testing",
        # PyTorch's loaders of code, native libraries and pickles, its code
        # generators (they write and run Python files), statement timers and
        # launchers, and the helpers that write logs or run commands
        "torch.hub", "torch.utils.cpp_extension", "torch.package", "torch.serialization",
        "torch.jit._serialization", "torch._inductor", "torch._dynamo", "torch._C._dynamo",
        "torch.utils.benchmark", "torch.multiprocessing", "torch.distributed.elastic",
        "torch.distributed.run", "torch.distributed.launch", "torch.distributed.launcher",
        "torch.utils.tensorboard", "torch.utils.bottleneck", "torch.utils.collect_env",
        "torch.testing",
    }
)  # fmt: skip
#: Callables refused by default: ``(module, name)``. Each refuses every
#: callable called ``name`` (the last part of its qualified name: a method
#: such as ``numpy:ndarray.tofile`` too) in ``module`` or its submodules,
#: matched against the name on the wire and against the resolved object's own
#: module and name (``torch:load`` is ``torch.serialization``'s).
DENIED_NAMES = frozenset(
    {
        *(("builtins", n) for n in (
            "eval", "exec", "compile", "__import__", "open", "breakpoint", "input", "getattr",
            "setattr", "delattr", "globals", "locals", "vars", "exit", "quit", "help",
            "memoryview", "__build_class__",
        )),
        *(("numpy", n) for n in (
            "save", "savez", "savez_compressed", "savetxt", "load", "loadtxt", "genfromtxt",
            "fromfile", "fromregex", "memmap", "DataSource", "tofile", "dump",
        )),
        # unpickling, files, native libraries (``torch.ops.load_library``),
        # TorchScript source and archives, compilers that start processes
        *(("torch", n) for n in (
            "load", "save", "from_file", "load_library", "CompilationUnit", "import_ir_module",
            "import_ir_module_from_buffer", "PyTorchFileReader", "PyTorchFileWriter", "compile",
        )),
    }
)  # fmt: skip
#: Modules whose private callables (a part of the name on the wire with one
#: leading underscore) are refused by default: torch's include loaders of
#: pickles and files (``torch._C._pickle_load_obj``) under many names.
PRIVATE_DENIED = frozenset({"torch"})
#: :data:`DENIED_NAMES` by name: the modules each name is refused in.
_DENIED_BY_NAME: dict[str, frozenset[str]] = {
    n: frozenset(m for m, n2 in DENIED_NAMES if n2 == n) for _, n in DENIED_NAMES
}
#: Modules every policy accepts unless denied: rpcdist's own protocols call them.
_OWN = "rpcdist"
POLICY_MODES = ("denylist", "allowlist", "any")


def _under(module: str, prefixes: frozenset[str]) -> bool:
    parts = module.split(".")
    return any(".".join(parts[:i]) in prefixes for i in range(1, len(parts) + 1))


@dataclass(frozen=True, eq=False)
class CallablePolicy:
    """What a worker lets peers call by name (see the module docstring).

    Attributes:
        mode: ``"denylist"``, ``"allowlist"`` or ``"any"``.
        allowed: Entries ``"module"`` (its functions and its submodules') or
            ``"module:qualname"`` (one function or class, and its methods).

    Compared and hashed by identity (it keys a cache of resolutions).
    """

    mode: str = "denylist"
    allowed: frozenset[str] = frozenset()

    def _allowed(self, module: str, qualname: str) -> bool:
        if not self.allowed:
            return False
        if _under(module, frozenset(a for a in self.allowed if ":" not in a)):
            return True
        parts = qualname.split(".")
        return any(
            f"{module}:{'.'.join(parts[:i])}" in self.allowed for i in range(1, len(parts) + 1)
        )

    def refusal(self, name: str, target: object, modules: list[str]) -> str | None:
        """Why calling ``target`` (resolved from ``name``, walking through
        ``modules``) is refused, or ``None`` if it is not (pure)."""
        if self.mode == "any":
            return None
        module, _, qualname = name.partition(":")
        if self._allowed(module, qualname):
            return None
        why = self._denied(module, qualname, target, modules)
        if why is None and self.mode == "allowlist" and not _under(module, frozenset({_OWN})):
            return "this worker accepts only the functions it allows (callable_policy='allowlist')"
        return why

    def method_refusal(self, value: object, name: str, method: object) -> str | None:
        """Why calling method ``name`` (``method``) of ``value``, an owned
        value reached through an RRef proxy, is refused, or ``None``: the deny
        checks, on ``module:Type.name`` of the value's type and on where
        ``method`` says it comes from (``numpy:ndarray.tofile`` writes a
        file). An allowlist does not limit methods: the value came from a
        call it allowed."""
        if self.mode == "any":
            return None
        cls = type(value)
        module, qualname = cls.__module__, f"{cls.__qualname__}.{name}"
        if self._allowed(module, qualname):
            return None
        return self._denied(module, qualname, method, [])

    def _denied(self, module: str, qualname: str, target: object,
                modules: list[str]) -> str | None:  # fmt: skip
        """The deny lists' reason to refuse ``module:qualname`` (resolved to
        ``target`` through ``modules``), or ``None``."""
        origins = _origins(target)
        for m in [module, *modules, *(o[0] for o in origins)]:
            if _under(m, DENIED_MODULES):
                return f"functions of module {m!r} run programs or code or reach the system"
        if _under(module, PRIVATE_DENIED) and any(
            p.startswith("_") and not p.startswith("__") for p in qualname.split(".")
        ):
            top = module.partition(".")[0]
            return f"private functions of {top!r} are refused (they include loaders of files)"
        for m, q in [(module, qualname), *origins]:
            denied_in = _DENIED_BY_NAME.get(q.rpartition(".")[2])
            if denied_in is not None and _under(m, denied_in):
                return f"'{m}.{q}' can run code or reach files"
        return None


#: The policy where none is given: refuse the deny lists.
DEFAULT_POLICY = CallablePolicy()


def _origins(target: object, depth: int = 0) -> list[tuple[str, str]]:
    """``(module, name)`` pairs a callable says it comes from (through partials)."""
    out: list[tuple[str, str]] = []
    module = getattr(target, "__module__", None)
    name = getattr(target, "__qualname__", None) or getattr(target, "__name__", None)
    if isinstance(module, str):
        out.append((module, name if isinstance(name, str) else ""))
    owner = getattr(target, "__objclass__", None)  # a method of a builtin type
    if isinstance(owner, type) and isinstance(name, str):
        out.append((owner.__module__, name))
    self_ = getattr(target, "__self__", None)  # builtin methods: their module object
    if isinstance(self_, types.ModuleType):
        out.append((self_.__name__, name if isinstance(name, str) else ""))
    if isinstance(target, functools.partial) and depth < 8:
        out.extend(_origins(target.func, depth + 1))
    return out


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
    """Find the function called ``name`` (``"module:qualname"``), importing its
    module, and check it against ``policy``.

    A module the policy refuses by name is not even imported.

    Args:
        name: A name made by :func:`function_name`.
        policy: What may be called (default: the deny lists).

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
    early = policy.refusal(name, None, [])
    if early is not None:
        raise _refused(name, early)
    # Always through the import system, even when the module is in sys.modules:
    # another thread may be importing it still (two first calls at once), and
    # only import_module waits for that to finish.
    try:
        target: object = importlib.import_module(module_name)
    except Exception as exc:
        raise SerializationError(f"{prefix}: cannot import module '{module_name}': {exc}") from exc
    walked: list[str] = []
    for part in qualname.split("."):
        if isinstance(target, types.ModuleType):
            walked.append(target.__name__)
        try:
            target = getattr(target, part)
        except AttributeError as exc:
            raise SerializationError(f"{prefix}: {exc}") from exc
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


def check_method(policy: CallablePolicy, value: object, name: str) -> None:
    """Raise unless ``policy`` lets peers call method ``name`` of ``value``
    (see :meth:`CallablePolicy.method_refusal`), without running a getter.

    Raises:
        CallPolicyError: refused.
    """
    cls = type(value)
    key = (policy, cls, name)
    own = getattr(value, "__dict__", None)
    of_type = not isinstance(own, dict) or name not in own
    if of_type and key in _METHODS_OK:
        return
    why = policy.method_refusal(value, name, inspect.getattr_static(value, name, None))
    if why is not None:
        raise _refused(f"{cls.__module__}:{cls.__qualname__}.{name}", why)
    if of_type:
        if len(_METHODS_OK) >= 4096:
            _METHODS_OK.clear()
        _METHODS_OK[key] = True


def _refused(name: str, why: str) -> CallPolicyError:
    return CallPolicyError(
        f"this worker refuses to call '{name}': {why}; allow it with "
        f"RpcOptions(allowed_callables=('{name}',)) if it is meant to be called"
    )
