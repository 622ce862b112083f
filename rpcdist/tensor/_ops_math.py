"""Elementwise arithmetic, unary functions, activations and ``matmul``."""

from __future__ import annotations

import builtins
import math
from typing import TYPE_CHECKING, Any

from ._device import array_module, device_of, move_to
from ._function import Function, unbroadcast
from ._special import erf

if TYPE_CHECKING:
    from ._random import Generator
    from ._tensor import Tensor

__all__ = [
    "abs",
    "add",
    "clamp",
    "div",
    "dropout",
    "exp",
    "gelu",
    "log",
    "matmul",
    "mul",
    "neg",
    "pow",
    "relu",
    "sigmoid",
    "sqrt",
    "sub",
    "tanh",
    "where",
]

_EMPTY: tuple[int, ...] = ()


def _shape(x: Any) -> tuple[int, ...]:
    return getattr(x, "shape", _EMPTY)


class Add(Function):
    __slots__ = ("sa", "sb")

    def forward(self, a: Any, b: Any) -> Any:
        self.sa, self.sb = _shape(a), _shape(b)
        return a + b

    def backward(self, g: Any) -> tuple[Any, ...]:
        na, nb = self.needs_input_grad
        return (unbroadcast(g, self.sa) if na else None, unbroadcast(g, self.sb) if nb else None)


class Sub(Function):
    __slots__ = ("sa", "sb")

    def forward(self, a: Any, b: Any) -> Any:
        self.sa, self.sb = _shape(a), _shape(b)
        return a - b

    def backward(self, g: Any) -> tuple[Any, ...]:
        na, nb = self.needs_input_grad
        return (unbroadcast(g, self.sa) if na else None, unbroadcast(-g, self.sb) if nb else None)


class Mul(Function):
    __slots__ = ("a", "b")

    def forward(self, a: Any, b: Any) -> Any:
        self.a, self.b = a, b
        return a * b

    def backward(self, g: Any) -> tuple[Any, ...]:
        na, nb = self.needs_input_grad
        a, b = self.a, self.b
        return (
            unbroadcast(g * b, _shape(a)) if na else None,
            unbroadcast(g * a, _shape(b)) if nb else None,
        )


class Div(Function):
    __slots__ = ("a", "b")

    def forward(self, a: Any, b: Any) -> Any:
        self.a, self.b = a, b
        return a / b

    def backward(self, g: Any) -> tuple[Any, ...]:
        na, nb = self.needs_input_grad
        a, b = self.a, self.b
        gb = unbroadcast(-g * a / (b * b), _shape(b)) if nb else None
        return (unbroadcast(g / b, _shape(a)) if na else None, gb)


class Pow(Function):
    __slots__ = ("a", "b", "out")

    def forward(self, a: Any, b: Any) -> Any:
        self.a, self.b = a, b
        self.out = a**b
        return self.out

    def backward(self, g: Any) -> tuple[Any, ...]:
        na, nb = self.needs_input_grad
        a, b = self.a, self.b
        ga = gb = None
        if na:
            d = 2 * a if isinstance(b, int | float) and b == 2 else b * a ** (b - 1)
            ga = unbroadcast(g * d, _shape(a))
        if nb:
            log_a = array_module(g).log(a) if hasattr(a, "dtype") else math.log(a)
            gb = unbroadcast(g * self.out * log_a, _shape(b))
        return ga, gb


class Neg(Function):
    __slots__ = ()

    def forward(self, a: Any) -> Any:
        return -a

    def backward(self, g: Any) -> tuple[Any, ...]:
        return (-g,)


class Exp(Function):
    __slots__ = ("out",)

    def forward(self, a: Any) -> Any:
        self.out = array_module(a).exp(a)
        return self.out

    def backward(self, g: Any) -> tuple[Any, ...]:
        return (g * self.out,)


class Log(Function):
    __slots__ = ("a",)

    def forward(self, a: Any) -> Any:
        self.a = a
        return array_module(a).log(a)

    def backward(self, g: Any) -> tuple[Any, ...]:
        return (g / self.a,)


class Sqrt(Function):
    __slots__ = ("out",)

    def forward(self, a: Any) -> Any:
        self.out = array_module(a).sqrt(a)
        return self.out

    def backward(self, g: Any) -> tuple[Any, ...]:
        return (g * 0.5 / self.out,)


class Abs(Function):
    __slots__ = ("a",)

    def forward(self, a: Any) -> Any:
        self.a = a
        return array_module(a).abs(a)

    def backward(self, g: Any) -> tuple[Any, ...]:
        return (g * array_module(g).sign(self.a),)


class Clamp(Function):
    __slots__ = ("mask",)

    def forward(self, a: Any, *, lo: Any, hi: Any) -> Any:
        xp = array_module(a)
        if lo is None and hi is None:
            raise ValueError("at least one of min and max must be given")
        mask = None
        out = a
        if lo is not None:
            mask = a >= lo
            out = xp.maximum(out, lo)
        if hi is not None:
            mask = (a <= hi) if mask is None else (mask & (a <= hi))
            out = xp.minimum(out, hi)
        self.mask = mask
        return out

    def backward(self, g: Any) -> tuple[Any, ...]:
        return (g * self.mask,)


class Tanh(Function):
    __slots__ = ("out",)

    def forward(self, a: Any) -> Any:
        self.out = array_module(a).tanh(a)
        return self.out

    def backward(self, g: Any) -> tuple[Any, ...]:
        out = self.out
        return (g * (1 - out * out),)


def _sigmoid(xp: Any, a: Any) -> Any:
    # 0.5 * (1 + tanh(x / 2)) is exact and never overflows.
    out = xp.tanh(a * 0.5)
    out += 1
    out *= 0.5
    return out


class Sigmoid(Function):
    __slots__ = ("out",)

    def forward(self, a: Any) -> Any:
        self.out = _sigmoid(array_module(a), a)
        return self.out

    def backward(self, g: Any) -> tuple[Any, ...]:
        out = self.out
        return (g * out * (1 - out),)


class Relu(Function):
    __slots__ = ("out",)

    def forward(self, a: Any) -> Any:
        self.out = array_module(a).maximum(a, 0)
        return self.out

    def backward(self, g: Any) -> tuple[Any, ...]:
        return (g * (self.out > 0),)


_SQRT1_2 = 1 / math.sqrt(2)
_INV_SQRT_2PI = 1 / math.sqrt(2 * math.pi)
_SQRT_2_PI = math.sqrt(2 / math.pi)


class Gelu(Function):
    __slots__ = ("a", "approximate")

    def forward(self, a: Any, *, approximate: str) -> Any:
        if approximate not in ("none", "tanh"):
            raise ValueError(f"approximate must be 'none' or 'tanh', got {approximate!r}")
        xp = array_module(a)
        self.a, self.approximate = a, approximate
        if approximate == "tanh":
            return 0.5 * a * (1 + xp.tanh(_SQRT_2_PI * (a + 0.044715 * a**3)))
        return 0.5 * a * (1 + erf(a * _SQRT1_2))

    def backward(self, g: Any) -> tuple[Any, ...]:
        a = self.a
        xp = array_module(a)
        if self.approximate == "tanh":
            t = xp.tanh(_SQRT_2_PI * (a + 0.044715 * a**3))
            d = 0.5 * (1 + t) + 0.5 * a * (1 - t * t) * _SQRT_2_PI * (1 + 3 * 0.044715 * a * a)
        else:
            d = 0.5 * (1 + erf(a * _SQRT1_2)) + a * xp.exp(-0.5 * a * a) * _INV_SQRT_2PI
        return (g * d,)


class Where(Function):
    __slots__ = ("cond", "sa", "sb")

    def forward(self, cond: Any, a: Any, b: Any) -> Any:
        xp = array_module(cond)
        if cond.dtype != bool:
            raise TypeError(f"condition must be boolean, got dtype {cond.dtype}")
        self.cond, self.sa, self.sb = cond, _shape(a), _shape(b)
        return xp.where(cond, a, b)

    def backward(self, g: Any) -> tuple[Any, ...]:
        _, na, nb = self.needs_input_grad
        xp = array_module(g)
        cond = self.cond
        ga = unbroadcast(xp.where(cond, g, 0), self.sa) if na else None
        gb = unbroadcast(xp.where(cond, 0, g), self.sb) if nb else None
        return None, ga, gb


class Cast(Function):
    __slots__ = ("src",)

    def forward(self, a: Any, *, dtype: Any) -> Any:
        self.src = a.dtype
        return a.astype(dtype)

    def backward(self, g: Any) -> tuple[Any, ...]:
        return (g.astype(self.src),)


class Clone(Function):
    __slots__ = ()

    def forward(self, a: Any) -> Any:
        return a.copy()

    def backward(self, g: Any) -> tuple[Any, ...]:
        return (g,)


class ToDevice(Function):
    __slots__ = ("src",)
    op = "to"

    def forward(self, a: Any, *, device: str) -> Any:
        self.src = device_of(a)
        return move_to(a, device)

    def backward(self, g: Any) -> tuple[Any, ...]:
        return (move_to(g, self.src),)


class MatMul(Function):
    __slots__ = ("a", "b")
    splittable = True

    def forward(self, a: Any, b: Any) -> Any:
        if _shape(a) == () or _shape(b) == ():
            raise ValueError("both operands must have at least one dimension")
        if a.dtype != b.dtype:
            raise TypeError(f"operands must share a dtype, got {a.dtype} and {b.dtype}")
        self.a, self.b = a, b
        return a @ b

    def backward(self, g: Any) -> tuple[Any, ...]:
        a, b = self.a, self.b
        na, nb = self.needs_input_grad
        if a.ndim == 2 and b.ndim == 2:
            return (g @ b.T if na else None, a.T @ g if nb else None)
        a2 = a[None, :] if a.ndim == 1 else a
        b2 = b[:, None] if b.ndim == 1 else b
        g2 = g
        if b.ndim == 1:
            g2 = g2[..., None]
        if a.ndim == 1:
            g2 = g2[..., None, :]
        ga = gb = None
        if na:
            ga = unbroadcast(g2 @ b2.swapaxes(-1, -2), a2.shape).reshape(a.shape)
        if nb:
            if b2.ndim == 2:
                n, p = b2.shape
                gb = a2.reshape(-1, n).T @ g2.reshape(-1, p)
            else:
                gb = unbroadcast(a2.swapaxes(-1, -2) @ g2, b2.shape)
            gb = gb.reshape(b.shape)
        return ga, gb


class Dropout(Function):
    __slots__ = ("mask",)

    def forward(self, a: Any, *, p: float, generator: Generator | None) -> Any:
        from ._random import default_generator

        gen = generator if generator is not None else default_generator()
        keep = gen._uniform_like(a) >= p
        mask = keep.astype(a.dtype)
        mask *= 1.0 / (1.0 - p)
        self.mask = mask
        return a * mask

    def backward(self, g: Any) -> tuple[Any, ...]:
        return (g * self.mask,)


def add(a: Any, b: Any) -> Tensor:
    """``a + b`` with broadcasting."""
    return Add.call(a, b)  # type: ignore[no-any-return]


def sub(a: Any, b: Any) -> Tensor:
    """``a - b`` with broadcasting."""
    return Sub.call(a, b)  # type: ignore[no-any-return]


def mul(a: Any, b: Any) -> Tensor:
    """``a * b`` with broadcasting."""
    return Mul.call(a, b)  # type: ignore[no-any-return]


def div(a: Any, b: Any) -> Tensor:
    """``a / b`` with broadcasting."""
    return Div.call(a, b)  # type: ignore[no-any-return]


def pow(a: Any, b: Any) -> Tensor:
    """``a ** b`` with broadcasting."""
    return Pow.call(a, b)  # type: ignore[no-any-return]


def neg(a: Tensor) -> Tensor:
    """``-a``."""
    return Neg.call(a)  # type: ignore[no-any-return]


def exp(a: Tensor) -> Tensor:
    """Elementwise ``e**a``."""
    return Exp.call(a)  # type: ignore[no-any-return]


def log(a: Tensor) -> Tensor:
    """Elementwise natural logarithm."""
    return Log.call(a)  # type: ignore[no-any-return]


def sqrt(a: Tensor) -> Tensor:
    """Elementwise square root."""
    return Sqrt.call(a)  # type: ignore[no-any-return]


def abs(a: Tensor) -> Tensor:
    """Elementwise absolute value (gradient 0 at 0)."""
    return Abs.call(a)  # type: ignore[no-any-return]


def clamp(a: Tensor, min: Any = None, max: Any = None) -> Tensor:
    """Clamp into ``[min, max]``; the gradient passes where ``min <= a <= max``.

    Raises:
        ConfigError: neither bound given.
    """
    return Clamp.call(a, lo=min, hi=max)  # type: ignore[no-any-return]


def tanh(a: Tensor) -> Tensor:
    """Elementwise hyperbolic tangent."""
    return Tanh.call(a)  # type: ignore[no-any-return]


def sigmoid(a: Tensor) -> Tensor:
    """Elementwise logistic sigmoid."""
    return Sigmoid.call(a)  # type: ignore[no-any-return]


def relu(a: Tensor) -> Tensor:
    """Elementwise ``max(a, 0)``."""
    return Relu.call(a)  # type: ignore[no-any-return]


def gelu(a: Tensor, approximate: str = "none") -> Tensor:
    """Gaussian error linear unit, exact (``"none"``) or ``"tanh"`` approximation."""
    return Gelu.call(a, approximate=approximate)  # type: ignore[no-any-return]


def where(condition: Any, a: Any, b: Any) -> Tensor:
    """``a`` where ``condition`` holds, else ``b`` (broadcasting all three).

    Raises:
        ConfigError: ``condition`` is not boolean, or shapes do not broadcast.
    """
    from ._tensor import Tensor

    cond = condition.data if isinstance(condition, Tensor) else condition
    if not builtins.hasattr(cond, "dtype"):
        xp = array_module(a.data if isinstance(a, Tensor) else b.data)
        cond = xp.asarray(cond)
    return Where.call(cond, a, b)  # type: ignore[no-any-return]


def matmul(a: Any, b: Any) -> Tensor:
    """Matrix product with NumPy's ``matmul`` rules (1-D and batched too).

    Raises:
        ConfigError: inner dimensions or dtypes differ.
    """
    return MatMul.call(a, b)  # type: ignore[no-any-return]


def dropout(
    a: Tensor, p: float = 0.5, training: bool = True, *, generator: Generator | None = None
) -> Tensor:
    """Zero each element with probability ``p`` and scale the rest by ``1/(1-p)``.

    Args:
        a: Input.
        p: Drop probability in ``[0, 1)``.
        training: When False, returns ``a`` unchanged.
        generator: Source of randomness (the default generator if None).

    Raises:
        ConfigError: ``p`` outside ``[0, 1)``.
    """
    from .._errors import ConfigError

    if not 0.0 <= p < 1.0:
        raise ConfigError(f"dropout: p must be in [0, 1), got {p}")
    if not training or p == 0.0:
        return a
    return Dropout.call(a, p=p, generator=generator)  # type: ignore[no-any-return]
