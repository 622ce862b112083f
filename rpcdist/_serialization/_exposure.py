"""What a worker exposes to peers by default: the exposure model's data.

A peer's call may run only what the program exposes, by construction:

- the program's own functions and classes: those of ``__main__`` and of the
  modules the program has already imported whose file lives outside the
  interpreter's standard library and site-packages (rpcdist's own modules
  excepted);
- what the program exposes explicitly: ``RpcOptions.allowed_callables`` and
  :func:`expose`;
- a curated set of pure numerical functions and methods (:data:`CURATED`,
  :data:`CURATED_TYPES`; NumPy's ufuncs; torch's and rpcdist's layers and
  optimizers): none touches files, processes, code loading, pickles or the
  network;
- rpcdist's protocol entry points, registered by name
  (:data:`PROTOCOL_ENTRIES`).

The tables are data; :mod:`._functions` applies them.
"""

from __future__ import annotations

import os
import site
import sys
import sysconfig
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = [
    "CURATED",
    "CURATED_TYPES",
    "IMPORTABLE",
    "NEVER",
    "PROTOCOL_ENTRIES",
    "curated",
    "curated_method",
    "expose",
    "is_exposed",
    "is_program_module",
    "is_program_object",
    "is_protocol",
    "own_method",
]

F = TypeVar("F", bound=Callable[..., Any])

#: rpcdist's functions and classes that peers call by name for its own
#: protocols (RRefs, RemoteModule, DistributedOptimizer, all_gather), and
#: the types whose methods its protocols call through RRef proxies. Nothing
#: else of rpcdist is callable by a peer: not ``rpcdist.save``, never
#: ``rpcdist.launch`` or ``rpcdist.testing``.
PROTOCOL_ENTRIES = frozenset(
    {
        "rpcdist._rref._owner:create_value",
        "rpcdist._rref._owner:call_method",
        "rpcdist._rref._rref:_rref_typeof_on_owner",
        "rpcdist.autograd._backward:apply_grads",
        "rpcdist.torch._backward:apply_grad",
        "rpcdist.nn._remote:_make",
        "rpcdist.nn._remote:_parameters",
        "rpcdist.optim._distributed:_new_local",
        "rpcdist.optim._distributed:_Local",
        "rpcdist.torch._remote_module:_parameter_rrefs",
        "rpcdist.torch._remote_module:_to_device",
        "rpcdist.torch._gather:gather_at_leader",
        "rpcdist.torch._optim:_LocalOptimizer",
        # (torch's idiom: rpc_sync(to, RemoteModule.init_from_module_rref, ...))
        "rpcdist.torch._remote_module:RemoteModule.init_from_module_rref",
        "rpcdist.torch.nn:RemoteModule.init_from_module_rref",
    }
)
#: Modules no peer may call into, whatever the options (but ``"any"``).
NEVER = frozenset({"rpcdist.launch", "rpcdist.testing"})
#: Curated modules a peer's call may import if they are not yet (pure, and
#: importing them does nothing else).
IMPORTABLE = frozenset({"math", "cmath", "operator", "_operator"})


def _names(text: str) -> frozenset[str]:
    """A table of names written as words (one table, many lines, no quoting)."""
    return frozenset(text.split())


_ARITHMETIC = frozenset(
    f"__{n}__"
    for base in _names(
        "add sub mul matmul truediv floordiv mod pow divmod and or xor lshift rshift"
    )
    for n in (base, f"r{base}")
)
#: Special methods that compute on a value (proxies and builtin types).
SAFE_DUNDERS = _ARITHMETIC | _names(
    """
    __neg__ __pos__ __abs__ __invert__ __eq__ __ne__ __lt__ __le__ __gt__ __ge__ __len__
    __getitem__ __contains__ __bool__ __int__ __float__ __complex__ __index__ __round__ __hash__
    __repr__ __str__
    """
)
_OPERATOR = _names(
    """
    abs add and_ concat contains countOf eq floordiv ge getitem gt index indexOf inv invert is_
    is_not le length_hint lshift lt matmul mod mul ne neg not_ or_ pos pow rshift sub truediv
    truth xor
    """
) | frozenset(n for n in SAFE_DUNDERS if n not in {"__repr__", "__str__", "__hash__"})
_BUILTINS = _names(
    """
    abs all any bin bool bytes bytearray chr complex dict divmod enumerate float frozenset hash
    hex int isinstance issubclass len list max min oct ord pow range repr reversed round set
    slice sorted str sum tuple zip
    """
)
_NUMPY = _names(
    """
    all allclose amax amin any arange argmax argmin argsort around array array_equal array_split
    asarray ascontiguousarray average bincount broadcast_to clip concatenate copy count_nonzero
    cross cumprod cumsum diag diff dot dtype einsum empty empty_like expand_dims eye flip full
    full_like histogram hstack identity inner isclose linspace max mean median meshgrid min
    ndarray nonzero ones ones_like outer percentile prod ravel repeat reshape roll round
    searchsorted shape sort split squeeze stack std sum swapaxes take tensordot tile trace
    transpose tril triu unique var vstack where zeros zeros_like bool_ int8 int16 int32 int64
    uint8 uint16 uint32 uint64 float16 float32 float64 complex64 complex128
    """
)
_LINALG = _names(
    """
    cholesky det eig eigh eigvals eigvalsh inv lstsq matrix_power matrix_rank norm pinv qr
    slogdet solve svd LinAlgError
    """
)
_NDARRAY = SAFE_DUNDERS | _names(
    """
    all any argmax argmin argsort astype clip conj copy cumprod cumsum diagonal dot fill flatten
    item max mean min nonzero prod ravel repeat reshape round sort squeeze std sum swapaxes take
    tobytes tolist trace transpose var
    """
)
#: Tensor math: torch's functions and the tensor methods of the same names.
_TORCH_MATH = _names(
    """
    abs add addmm allclose argmax argmin bmm cat clamp clone cos div dot eq equal exp flatten ge
    gt le log log_softmax lt matmul max mean min mm mul ne neg nonzero norm pow prod relu reshape
    sigmoid sin softmax sqrt squeeze stack std sub sum t tanh transpose unsqueeze var where
    """
)
_TORCH = _TORCH_MATH | _names(
    """
    Tensor arange as_tensor empty eye from_numpy full get_num_threads linspace ones ones_like
    rand rand_like randint randn randn_like tensor zeros zeros_like
    """
)
_TENSOR = (
    SAFE_DUNDERS
    | _TORCH_MATH
    | _names(
        """
    add_ bool contiguous copy_ cpu detach dim double expand fill_ float half int item long mul_
    numel numpy permute repeat requires_grad_ size sub_ to to_dense to_sparse tolist view zero_
    """
    )
)
#: torch.linalg's functions, by the name they travel under (torch._C._linalg's).
_TORCH_LINALG = _names(
    """
    linalg_multi_dot linalg_norm linalg_vector_norm linalg_matrix_norm linalg_inv linalg_det
    linalg_solve linalg_qr linalg_svd linalg_eigh linalg_cholesky
    """
)
#: torch's functions written in Python (torch.split is torch.functional.split).
_TORCH_FUNCTIONAL = _names("split einsum tensordot broadcast_tensors meshgrid chain_matmul cdist")
_NN_FUNCTIONAL = _names(
    """
    relu gelu sigmoid tanh softmax log_softmax linear conv1d conv2d dropout mse_loss
    cross_entropy nll_loss embedding
    """
)
#: Methods of layers (torch's and rpcdist's) and optimizers peers call
#: through RRef proxies.
_MODEL = _names(
    """
    __call__ forward parameters named_parameters state_dict load_state_dict train eval zero_grad
    step to cpu float double requires_grad_
    """
)
_TIME = _names("sleep time time_ns monotonic monotonic_ns perf_counter perf_counter_ns")
_PUBLIC = frozenset({"*"})  # (a table entry: every public method and SAFE_DUNDERS)

#: Pure functions and classes by the name they travel under: ``module`` ->
#: qualified names (``"*"``: every callable of the module).
CURATED: dict[str, frozenset[str]] = {
    "math": _PUBLIC,
    "cmath": _PUBLIC,
    "operator": _OPERATOR,
    "_operator": _OPERATOR,
    "builtins": _BUILTINS,
    "time": _TIME,
    "collections": frozenset({"OrderedDict", "Counter", "deque", "ChainMap"}),
    "numpy": _NUMPY,
    "numpy.linalg": _LINALG,
    "torch": _TORCH,
    "torch._C._linalg": _TORCH_LINALG,
    "torch.functional": _TORCH_FUNCTIONAL,
    "torch.nn.functional": _NN_FUNCTIONAL,
}
_BUILTIN_TYPES = _names(
    "int float complex bool str bytes list tuple dict set frozenset range slice"
)
#: Pure methods by their type's ``(module, qualname)``.
CURATED_TYPES: dict[tuple[str, str], frozenset[str]] = {
    **{("builtins", t): _PUBLIC for t in _BUILTIN_TYPES},
    ("numpy", "ndarray"): _NDARRAY,
    ("torch", "Tensor"): _TENSOR,
    ("torch._C", "TensorBase"): _TENSOR,
    ("torch.nn.parameter", "Parameter"): _TENSOR,
}
#: Refused whatever a table says: they reach files, or read attributes of
#: their arguments (``"{0.__globals__}".format(fn)`` would leak a module's).
_REFUSED = _names("tofile dump dumps save load fromfile memmap format format_map")
#: Base classes of layers and optimizers, by the packages they live in:
#: their subclasses there are pure and callable, with the :data:`_MODEL` methods.
_MODEL_BASES = (
    ("torch.nn.modules", "torch.nn", "Module"),
    ("torch.optim", "torch.optim", "Optimizer"),
    ("rpcdist.nn", "rpcdist.nn", "Module"),
    ("rpcdist.optim", "rpcdist.optim", "Optimizer"),
)


def _lib_dirs() -> tuple[str, ...]:
    """The interpreter's standard library and site-packages directories."""
    paths = sysconfig.get_paths()
    dirs = {paths.get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    dirs.update(getattr(site, "getsitepackages", list)())
    dirs.add(getattr(site, "getusersitepackages", str)())
    for prefix in {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}:
        dirs.update(os.path.join(prefix, d) for d in ("lib", "lib64"))
    return tuple(sorted({os.path.realpath(d) + os.sep for d in dirs if d}))


_LIB_DIRS = _lib_dirs()


def is_program_module(name: str) -> bool:
    """Whether module ``name`` is one of the program's own: ``__main__``, or
    imported already with a file outside the standard library and
    site-packages (rpcdist's own modules are not)."""
    module = sys.modules.get(name)
    if module is None or name == "rpcdist" or name.startswith("rpcdist."):
        return False
    if name in ("__main__", "__mp_main__"):
        return True
    path = getattr(module, "__file__", None)
    return isinstance(path, str) and not os.path.realpath(path).startswith(_LIB_DIRS)


def is_program_object(obj: object) -> bool:
    """Whether ``obj`` (a function, class or callable) says it comes from one
    of the program's modules (see :func:`is_program_module`)."""
    module = getattr(obj, "__module__", None)
    return isinstance(module, str) and is_program_module(module)


def is_protocol(module: str, qualname: str) -> bool:
    """Whether ``module:qualname`` is one of rpcdist's protocol entry points
    or a method of one of its protocol types."""
    owner, _, method = qualname.rpartition(".")
    return f"{module}:{qualname}" in PROTOCOL_ENTRIES or (
        not method.startswith("_") and f"{module}:{owner}" in PROTOCOL_ENTRIES
    )


def _method_ok(allowed: frozenset[str], name: str) -> bool:
    if name in _REFUSED:
        return False
    if allowed is _PUBLIC:
        return not name.startswith("_") or name in SAFE_DUNDERS
    return name in allowed


def _model_class(cls: object) -> bool:
    """A layer or optimizer class of torch or rpcdist (see :data:`_MODEL_BASES`)."""
    if not isinstance(cls, type):
        return False
    for where, home, base_name in _MODEL_BASES:
        module = cls.__module__
        base = getattr(sys.modules.get(home), base_name, None)
        if (
            isinstance(base, type)
            and (module == where or module.startswith(where + "."))
            and issubclass(cls, base)
        ):
            return True
    return False


def curated(module: str, qualname: str, target: object) -> bool:
    """Whether ``target``, found as ``module:qualname``, is one of the curated
    pure functions, classes or methods."""
    names = CURATED.get(module)
    if names is not None and (qualname in names or (names is _PUBLIC and "." not in qualname)):
        return qualname.rpartition(".")[2] not in _REFUSED
    owner, _, method = qualname.rpartition(".")
    types_ = CURATED_TYPES.get((module, owner))
    if types_ is not None and _method_ok(types_, method):
        return True
    if module == "builtins" and isinstance(target, type) and issubclass(target, Exception):
        return True
    if module.partition(".")[0] == "numpy" and type(target).__name__ == "ufunc":
        return True
    parts = qualname.split(".")
    if module == "torch" and parts[:2] == ["ops", "aten"] and len(parts) in (3, 4):
        return parts[2] in _TORCH and not any(p.startswith("_") for p in parts)
    return _model_class(target)


def curated_method(cls: type, name: str) -> bool:
    """Whether method ``name`` of a ``cls`` value is a curated pure one."""
    allowed = CURATED_TYPES.get((cls.__module__, cls.__qualname__))
    if allowed is not None:
        return _method_ok(allowed, name)
    return _model_class(cls) and name in _MODEL


def own_method(cls: type, name: str, method: object) -> bool:
    """Whether ``method`` (attribute ``name`` of a value of ``cls``, one of the
    program's types, found without running a getter) runs the program's own
    code or a curated pure method of a base (``list.append``,
    ``torch.nn.Module.parameters``)."""
    if method is None:  # not found statically: the program's __getattr__ runs, or AttributeError
        return True
    fn = getattr(method, "__func__", method)  # staticmethod, classmethod
    if is_program_object(fn):
        return True
    owner = getattr(fn, "__objclass__", None)  # a method of a builtin base
    if isinstance(owner, type):
        return curated_method(owner, name)
    module = getattr(fn, "__module__", None)
    return (
        name in _MODEL
        and isinstance(module, str)
        and module.startswith(("torch.nn.", "torch.optim.", "rpcdist.nn.", "rpcdist.optim."))
    )


#: Functions and classes exposed with :func:`expose`, by id (kept alive).
_EXPOSED: dict[int, object] = {}


def expose(fn: F) -> F:
    """Let peers call ``fn`` (a function or class, and a class's methods) on
    this process, whatever its module, under the default and allowlist policies.

    Use it as a decorator::

        @rpcdist.expose
        def step(batch): ...

    Args:
        fn: A module-level function or class.

    Returns:
        ``fn`` itself.

    Raises:
        TypeError: ``fn`` is not callable.
    """
    if not callable(fn):
        raise TypeError(f"rpcdist.expose() takes a function or class, got {type(fn).__name__}")
    _EXPOSED[id(fn)] = fn
    return fn


def is_exposed(obj: object) -> bool:
    """Whether ``obj`` was exposed with :func:`expose`."""
    return _EXPOSED.get(id(obj)) is obj
