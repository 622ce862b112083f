"""``Tensor``: an array (NumPy or CuPy) plus what reverse mode needs."""

from __future__ import annotations

import builtins
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from .._errors import AutogradError, ConfigError
from . import _backward, _ops_math, _ops_reduce, _ops_shape
from ._device import array_module, device_of, move_to, normalize_device
from ._grad_mode import _GRAD_ENABLED
from ._node import AccumulateGrad, Edge, Node, RemovableHandle

__all__ = ["Tensor"]

_FLOAT_KINDS = ("f", "c")


def _as_array(data: Any, dtype: Any = None) -> Any:
    if isinstance(data, Tensor):
        data = data.data
    if isinstance(data, np.ndarray) or type(data).__module__.startswith("cupy"):
        return data if dtype is None or data.dtype == dtype else data.astype(dtype)
    return np.asarray(data, dtype=dtype)


class Tensor:
    """An n-dimensional array that can record the operations applied to it.

    Args:
        data: An array-like (NumPy or CuPy arrays are used as they are).
        requires_grad: Whether gradients with respect to it are wanted; only
            floating-point tensors may require grad.

    Attributes:
        data: The underlying ``numpy.ndarray`` or ``cupy.ndarray``.
        grad_fn: The :class:`Node` that produced it (None for leaves).
        output_nr: Which output of ``grad_fn`` it is.

    Tensors hash by identity, so they can key gradient maps.

    Raises:
        AutogradError: ``requires_grad`` on a non-floating-point tensor.
    """

    __module__ = "rpcdist.tensor"
    __slots__ = (
        "__weakref__",
        "_accumulator",
        "_grad",
        "_hooks",
        "_post_hooks",
        "_requires_grad",
        "data",
        "grad_fn",
        "output_nr",
    )
    __array_ufunc__ = None
    __array_priority__ = 1000
    __hash__ = object.__hash__

    data: Any
    grad_fn: Node | None
    output_nr: int
    _requires_grad: bool
    _grad: Tensor | None
    _hooks: list[Callable[[Tensor], Any]] | None
    _post_hooks: list[Callable[[Tensor], None]] | None
    _accumulator: weakref.ref[AccumulateGrad] | None

    def __init__(self, data: Any, *, requires_grad: bool = False) -> None:
        self.data = _as_array(data)
        self.grad_fn = None
        self.output_nr = 0
        self._requires_grad = False
        self._grad = None
        self._hooks = None
        self._post_hooks = None
        self._accumulator = None
        if requires_grad:
            self.requires_grad = True

    @staticmethod
    def _wrap(data: Any) -> Tensor:
        """A tensor around ``data`` with no graph (internal fast path)."""
        t = object.__new__(Tensor)
        t.data = data
        t.grad_fn = None
        t.output_nr = 0
        t._requires_grad = False
        t._grad = None
        t._hooks = None
        t._post_hooks = None
        t._accumulator = None
        return t

    @staticmethod
    def _from_op(data: Any, grad_fn: Node, output_nr: int) -> Tensor:
        """Output ``output_nr`` of ``grad_fn`` (internal)."""
        t = object.__new__(Tensor)
        t.data = data
        t.grad_fn = grad_fn
        t.output_nr = output_nr
        t._requires_grad = True
        t._grad = None
        t._hooks = None
        t._post_hooks = None
        t._accumulator = None
        return t

    # ------------------------------------------------------------------ autograd
    @property
    def requires_grad(self) -> bool:
        """Whether gradients flow to (or through) this tensor."""
        return self._requires_grad

    @requires_grad.setter
    def requires_grad(self, value: bool) -> None:
        if self.grad_fn is not None:
            if not value:
                raise AutogradError(
                    "requires_grad can only be changed on leaf tensors; use detach()"
                )
            return
        if value and self.data.dtype.kind not in _FLOAT_KINDS:
            raise AutogradError(
                f"only floating-point tensors can require gradients, got dtype {self.data.dtype}"
            )
        self._requires_grad = bool(value)

    def requires_grad_(self, requires_grad: bool = True) -> Tensor:
        """Set ``requires_grad`` in place and return self."""
        self.requires_grad = requires_grad
        return self

    @property
    def grad(self) -> Tensor | None:
        """The gradient accumulated by ``backward()`` (leaves only), or None."""
        return self._grad

    @grad.setter
    def grad(self, value: Tensor | None) -> None:
        if value is not None:
            if not isinstance(value, Tensor):
                value = Tensor(value)
            if value.shape != self.shape:
                raise ConfigError(
                    f"assigned grad has shape {value.shape}, tensor has shape {self.shape}"
                )
        self._grad = value

    @property
    def is_leaf(self) -> bool:
        """True for tensors not produced by a recorded operation."""
        return self.grad_fn is None

    def gradient_edge(self) -> Edge | None:
        """The ``(node, output_nr)`` a gradient for this tensor flows into.

        For a leaf that requires grad this is its :class:`AccumulateGrad`
        (created on first use); None when it does not require grad.
        """
        if self.grad_fn is not None:
            return (self.grad_fn, self.output_nr)
        if not self._requires_grad:
            return None
        ref = self._accumulator
        acc = ref() if ref is not None else None
        if acc is None:
            acc = AccumulateGrad(self)
            self._accumulator = weakref.ref(acc)
        return (acc, 0)

    def backward(self, gradient: Any = None, retain_graph: bool = False) -> None:
        """Accumulate d(self)/d(leaf) into every leaf's ``.grad``.

        Args:
            gradient: d(loss)/d(self); may be omitted for a one-element tensor.
            retain_graph: Keep the graph for another backward pass.

        Raises:
            AutogradError: self does not require grad, or is not a scalar and
                no gradient was given, or the graph was already freed.
        """
        _backward.backward([self], [gradient], retain_graph=retain_graph)

    def register_hook(self, hook: Callable[[Tensor], Any]) -> RemovableHandle:
        """Call ``hook(grad)`` when this tensor's gradient is computed.

        The hook may return a replacement gradient (Tensor or array). On a leaf
        it runs before accumulation; it fires once per backward pass with the
        summed gradient.

        Raises:
            AutogradError: the tensor does not require grad.
        """
        if not self._requires_grad:
            raise AutogradError("cannot register a hook on a tensor that does not require grad")
        if self.grad_fn is not None:
            return self.grad_fn.add_pre_hook(self.output_nr, hook)
        if self._hooks is None:
            self._hooks = []
        self._hooks.append(hook)
        return RemovableHandle(self._hooks, hook)

    def register_post_accumulate_grad_hook(self, hook: Callable[[Tensor], None]) -> RemovableHandle:
        """Call ``hook(tensor)`` right after backward accumulated into ``.grad``.

        Only for leaves; not called when backward writes into a gradient map.

        Raises:
            AutogradError: the tensor is not a leaf that requires grad.
        """
        if self.grad_fn is not None or not self._requires_grad:
            raise AutogradError(
                "post-accumulate-grad hooks can only be registered on leaf tensors "
                "that require grad"
            )
        if self._post_hooks is None:
            self._post_hooks = []
        self._post_hooks.append(hook)
        return RemovableHandle(self._post_hooks, hook)

    def retain_grad(self) -> None:
        """Make a non-leaf tensor keep its gradient in ``.grad`` too."""
        if self.grad_fn is None:
            return
        ref = weakref.ref(self)

        def keep(g: Tensor) -> None:
            t = ref()
            if t is not None:
                if t._grad is None:
                    t._grad = Tensor._wrap(g.data.copy())
                else:
                    t._grad.data += g.data

        self.grad_fn.add_pre_hook(self.output_nr, keep)

    def detach(self) -> Tensor:
        """A new leaf sharing this tensor's data, outside any graph."""
        return Tensor._wrap(self.data)

    # ---------------------------------------------------------------- array-ish
    @property
    def shape(self) -> tuple[int, ...]:
        """The array's shape."""
        return tuple(self.data.shape)

    @property
    def dtype(self) -> np.dtype[Any]:
        """The array's dtype (a ``numpy.dtype``)."""
        dt: np.dtype[Any] = np.dtype(self.data.dtype)
        return dt

    @property
    def device(self) -> str:
        """``"cpu"`` or ``"cuda:N"``."""
        return device_of(self.data)

    @property
    def ndim(self) -> int:
        """Number of dimensions."""
        return int(self.data.ndim)

    def dim(self) -> int:
        """Number of dimensions."""
        return int(self.data.ndim)

    def size(self, dim: int | None = None) -> Any:
        """The shape, or the size of dimension ``dim``."""
        return self.shape if dim is None else self.shape[dim]

    def numel(self) -> int:
        """Number of elements."""
        return int(self.data.size)

    def __len__(self) -> int:
        if self.data.ndim == 0:
            raise TypeError("len() of a 0-d tensor")
        return int(self.data.shape[0])

    def numpy(self) -> np.ndarray[Any, Any]:
        """The data as a NumPy array (shared on CPU, copied from a GPU)."""
        return np.asarray(self.data) if self.device == "cpu" else self.data.get()

    def item(self) -> Any:
        """The single element as a Python scalar.

        Raises:
            ConfigError: the tensor has more than one element.
        """
        if self.data.size != 1:
            raise ConfigError(
                f"item(): a tensor with {self.data.size} elements (shape {self.shape}) "
                "cannot be converted to a Python scalar"
            )
        return self.data.item()

    def tolist(self) -> Any:
        """The data as nested Python lists."""
        return self.data.tolist()

    def to(self, device: str) -> Tensor:
        """This tensor on ``device`` (differentiable; self when already there)."""
        dev = normalize_device(device)
        if dev == self.device:
            return self
        return _ops_math.ToDevice.call(self, device=dev)  # type: ignore[no-any-return]

    def cpu(self) -> Tensor:
        """This tensor on the CPU."""
        return self.to("cpu")

    def cuda(self, index: int = 0) -> Tensor:
        """This tensor on CUDA device ``index``."""
        return self.to(f"cuda:{index}")

    def astype(self, dtype: Any) -> Tensor:
        """This tensor converted to ``dtype`` (differentiable between floats)."""
        if np.dtype(dtype) == self.data.dtype:
            return self
        return _ops_math.Cast.call(self, dtype=np.dtype(dtype))  # type: ignore[no-any-return]

    def clone(self) -> Tensor:
        """A differentiable copy with its own data."""
        return _ops_math.Clone.call(self)  # type: ignore[no-any-return]

    def _check_inplace(self, op: str) -> None:
        if self._requires_grad and _GRAD_ENABLED.get():
            raise AutogradError(
                f"{op}: in-place change of a tensor that requires grad; wrap it in no_grad()"
            )

    def zero_(self) -> Tensor:
        """Fill with zeros in place (not recorded)."""
        self._check_inplace("zero_")
        self.data[...] = 0
        return self

    def fill_(self, value: builtins.float) -> Tensor:
        """Fill with ``value`` in place (not recorded)."""
        self._check_inplace("fill_")
        self.data[...] = value
        return self

    def copy_(self, src: Any) -> Tensor:
        """Copy ``src`` (same shape) into this tensor's data in place (not recorded).

        Raises:
            ConfigError: the shapes differ.
        """
        self._check_inplace("copy_")
        arr = move_to(_as_array(src), self.device)
        if tuple(arr.shape) != self.shape:
            raise ConfigError(f"copy_: source shape {tuple(arr.shape)} != {self.shape}")
        self.data[...] = arr
        return self

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray[Any, Any]:
        if self.device != "cpu":
            raise TypeError(f"cannot convert a {self.device} tensor implicitly; use .numpy()")
        return np.asarray(self.data, dtype=dtype)

    def __repr__(self) -> str:
        body = np.array2string(self.numpy(), separator=", ", prefix="tensor(")
        extra = [f"dtype={self.data.dtype}"]
        if self.device != "cpu":
            extra.append(f"device='{self.device}'")
        if self.grad_fn is not None:
            extra.append(f"grad_fn=<{self.grad_fn.name()}>")
        elif self._requires_grad:
            extra.append("requires_grad=True")
        return f"tensor({body}, {', '.join(extra)})"

    def __bool__(self) -> bool:
        if self.data.size != 1:
            raise ConfigError(
                f"the truth value of a tensor with {self.data.size} elements is ambiguous"
            )
        return bool(self.data)

    def __float__(self) -> builtins.float:
        return builtins.float(self.item())

    def __int__(self) -> int:
        return int(self.item())

    # ---------------------------------------------------------------- operators
    # Operations are the functions of the ops modules, bound as methods (their
    # first argument is the tensor), so that they are written and documented
    # once.
    __add__ = _ops_math.add
    __sub__ = _ops_math.sub
    __mul__ = _ops_math.mul
    __truediv__ = _ops_math.div
    __pow__ = _ops_math.pow
    __matmul__ = _ops_math.matmul
    __neg__ = _ops_math.neg
    __abs__ = _ops_math.abs
    __getitem__ = _ops_shape.index

    def __radd__(self, other: Any) -> Tensor:
        return _ops_math.add(other, self)

    def __rsub__(self, other: Any) -> Tensor:
        return _ops_math.sub(other, self)

    def __rmul__(self, other: Any) -> Tensor:
        return _ops_math.mul(other, self)

    def __rtruediv__(self, other: Any) -> Tensor:
        return _ops_math.div(other, self)

    def __rpow__(self, other: Any) -> Tensor:
        return _ops_math.pow(other, self)

    def __rmatmul__(self, other: Any) -> Tensor:
        return _ops_math.matmul(other, self)

    def __pos__(self) -> Tensor:
        return self

    def _compare(self, other: Any, fn: Callable[[Any, Any], Any]) -> Tensor:
        o = other.data if isinstance(other, Tensor) else other
        return Tensor._wrap(fn(self.data, o))

    def __eq__(self, other: object) -> Tensor:  # type: ignore[override]
        return self._compare(other, lambda a, b: a == b)

    def __ne__(self, other: object) -> Tensor:  # type: ignore[override]
        return self._compare(other, lambda a, b: a != b)

    def __lt__(self, other: Any) -> Tensor:
        return self._compare(other, lambda a, b: a < b)

    def __le__(self, other: Any) -> Tensor:
        return self._compare(other, lambda a, b: a <= b)

    def __gt__(self, other: Any) -> Tensor:
        return self._compare(other, lambda a, b: a > b)

    def __ge__(self, other: Any) -> Tensor:
        return self._compare(other, lambda a, b: a >= b)

    # ---------------------------------------------------------------- methods
    matmul = _ops_math.matmul
    pow = _ops_math.pow
    exp = _ops_math.exp
    log = _ops_math.log
    sqrt = _ops_math.sqrt
    abs = _ops_math.abs
    clamp = _ops_math.clamp
    tanh = _ops_math.tanh
    sigmoid = _ops_math.sigmoid
    relu = _ops_math.relu
    sum = _ops_reduce.sum
    mean = _ops_reduce.mean
    max = _ops_reduce.amax
    min = _ops_reduce.amin
    amax = _ops_reduce.amax
    amin = _ops_reduce.amin
    softmax = _ops_reduce.softmax
    log_softmax = _ops_reduce.log_softmax
    reshape = _ops_shape.reshape
    view = _ops_shape.reshape
    flatten = _ops_shape.flatten
    transpose = _ops_shape.transpose
    permute = _ops_shape.permute
    expand = _ops_shape.expand
    squeeze = _ops_shape.squeeze
    unsqueeze = _ops_shape.unsqueeze
    split = _ops_shape.split
    chunk = _ops_shape.chunk

    @property
    def T(self) -> Tensor:
        """All dimensions reversed."""
        return _ops_shape.permute(self, *reversed(range(self.ndim)))

    def argmax(self, axis: int | None = None, keepdims: bool = False) -> Tensor:
        """Indices of the maxima (not differentiable)."""
        xp = array_module(self.data)
        return Tensor._wrap(xp.argmax(self.data, axis=axis, keepdims=keepdims))

    def argmin(self, axis: int | None = None, keepdims: bool = False) -> Tensor:
        """Indices of the minima (not differentiable)."""
        xp = array_module(self.data)
        return Tensor._wrap(xp.argmin(self.data, axis=axis, keepdims=keepdims))
