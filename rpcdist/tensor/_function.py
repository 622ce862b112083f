"""``Function``: the base of every differentiable operation.

An operation is a :class:`Function` subclass with ``forward`` (arrays in,
array or tuple of arrays out; it stores on ``self`` what backward needs) and
``backward`` (one gradient per output in, one per input out). ``call`` runs
the forward and, when grad mode is on and an input requires grad, records
the instance as the outputs' ``grad_fn``.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np

from .._errors import AutogradError, ConfigError, RpcdistError
from . import _tensor
from ._device import device_of
from ._grad_mode import _GRAD_ENABLED
from ._node import Edge, Node

__all__ = ["Function", "describe", "unbroadcast"]


def describe(x: Any) -> str:
    """A short description of an operand for error messages."""
    if isinstance(x, _tensor.Tensor):
        x = x.data
        kind = "Tensor"
    else:
        kind = type(x).__name__
    shape = getattr(x, "shape", None)
    if shape is None:
        return f"{kind}({x!r})"
    return f"{kind}(shape={tuple(shape)}, dtype={x.dtype}, device={device_of(x)})"


def unbroadcast(g: Any, shape: tuple[int, ...]) -> Any:
    """Sum ``g`` over the axes along which an input of ``shape`` was broadcast."""
    gshape = g.shape
    if gshape == shape:
        return g
    lead = len(gshape) - len(shape)
    axes = list(range(lead))
    for i, s in enumerate(shape):
        if s == 1 and gshape[i + lead] != 1:
            axes.append(i + lead)
    if axes:
        g = g.sum(axis=tuple(axes))
    return g.reshape(shape)


def _check_devices(op: str, inputs: Sequence[Any]) -> None:
    devices = []
    for x in inputs:
        d = x.data if isinstance(x, _tensor.Tensor) else x
        if hasattr(d, "shape") and hasattr(d, "dtype") and not isinstance(d, np.generic):
            devices.append(device_of(d))
    if len(set(devices)) > 1:
        shown = ", ".join(describe(x) for x in inputs if hasattr(x, "shape"))
        raise ConfigError(f"{op}: expected all operands on one device, got {shown}")


def _as_arrays(out: Any) -> Any:
    """NumPy scalars (what 0-d arithmetic returns) as 0-d arrays; tuples itemwise."""
    if type(out) is tuple:
        return tuple(np.asarray(o) if isinstance(o, np.generic) else o for o in out)
    if isinstance(out, np.generic | int | float):
        return np.asarray(out)
    return out


class Function(Node):
    """A differentiable operation; subclasses define ``forward``/``backward``.

    Example::

        class Square(Function):
            __slots__ = ("x",)          # saved state, freed after backward

            def forward(self, x):
                self.x = x
                return x * x

            def backward(self, g):
                return (2 * self.x * g,)  # one entry per forward input

        y = Square.call(t)               # t a Tensor; y.grad_fn is a Square

    Attributes:
        needs_input_grad: Per input, whether its gradient is wanted.
    """

    __module__ = "rpcdist.tensor"
    __slots__ = ("_freed", "needs_input_grad")

    #: Name used in error messages (defaults to the class name).
    op: ClassVar[str] = ""
    #: Names of the attributes ``forward`` saves; cleared by :meth:`release`.
    _saved: ClassVar[tuple[str, ...]] = ()

    needs_input_grad: tuple[bool, ...]
    _freed: bool

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        names: list[str] = []
        for klass in cls.__mro__:
            names.extend(klass.__dict__.get("__slots__", ()))
        base = {"needs_input_grad", "next_edges", "num_outputs"}
        cls._saved = tuple(n for n in names if not n.startswith("_") and n not in base)
        if not cls.__dict__.get("op"):
            cls.op = cls.__name__.lower()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Compute the output array(s) from input arrays; save what backward needs."""
        raise NotImplementedError

    def backward(self, *grads: Any) -> tuple[Any, ...]:
        """Map output gradients to one gradient (or None) per forward input."""
        raise NotImplementedError

    def apply(self, grads: Sequence[Any | None]) -> Sequence[Any | None]:
        self._check_live()
        return self.backward(*grads)

    def _check_live(self) -> None:
        """Raise if :meth:`release` already freed what backward needs."""
        if self._freed:
            raise AutogradError(
                f"{self.name()}: trying to backward through the graph a second time; its "
                "saved arrays were freed by the first backward (pass retain_graph=True to "
                "the first call to keep them)"
            )

    def apply_some(
        self, grads: Sequence[Any | None], wanted: Sequence[bool]
    ) -> Sequence[Any | None]:
        # A copy with fewer inputs needing grad: threads walking one retained
        # graph may run this node at the same time.
        part = copy.copy(self)
        part.needs_input_grad = tuple(n and w for n, w in zip(self.needs_input_grad, wanted))
        return part.apply(grads)

    def release(self) -> None:
        self._freed = True
        for name in self._saved:
            setattr(self, name, None)

    def name(self) -> str:
        base = type(self).__name__
        return (base[:-2] if base.endswith("Fn") else base) + "Backward"

    @classmethod
    def call(cls, *inputs: Any, **kwargs: Any) -> Any:
        """Run the operation on tensors (or constants) and record it if needed.

        Non-tensor inputs are constants (Python scalars, arrays). Keyword
        arguments are passed to ``forward`` as they are.

        Returns:
            A Tensor, or a tuple of Tensors for multi-output operations.

        Raises:
            ConfigError: operands on different devices, or shapes/dtypes the
                operation rejects (the message names the op and the operands).
        """
        arrays: list[Any] = []
        needs: list[bool] = []
        any_needs = False
        foreign = False
        Tensor = _tensor.Tensor
        for x in inputs:
            if isinstance(x, Tensor):
                d = x.data
                arrays.append(d)
                r = x._requires_grad
                needs.append(r)
                any_needs = any_needs or r
            else:
                d = x
                arrays.append(x)
                needs.append(False)
            if type(d) is not np.ndarray and not isinstance(d, int | float | np.generic):
                foreign = True
        if foreign:
            _check_devices(cls.op, inputs)
        fn = cls.__new__(cls)
        try:
            out = fn.forward(*arrays, **kwargs)
        except RpcdistError:
            raise
        except (ValueError, TypeError) as exc:
            shown = ", ".join(describe(x) for x in inputs)
            raise ConfigError(f"{cls.op}: {exc} (operands: {shown})") from exc
        if type(out) is not np.ndarray:
            out = _as_arrays(out)
        if not (any_needs and _GRAD_ENABLED.get()):
            if type(out) is tuple:
                return tuple(Tensor._wrap(o) for o in out)
            return Tensor._wrap(out)
        edges: list[Edge | None] = []
        for x, r in zip(inputs, needs):
            edges.append(x.gradient_edge() if r else None)
        fn.next_edges = tuple(edges)
        fn.needs_input_grad = tuple(needs)
        fn._pre_hooks = None
        fn._freed = False
        if type(out) is tuple:
            fn.num_outputs = len(out)
            return tuple(Tensor._from_op(o, fn, i) for i, o in enumerate(out))
        fn.num_outputs = 1
        return Tensor._from_op(out, fn, 0)
