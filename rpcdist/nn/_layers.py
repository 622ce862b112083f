"""Basic layers: ``Linear``, ``Embedding``, ``Dropout``, activations, ``Sequential``."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import numpy as np

from .._errors import ConfigError
from ..tensor import Generator, Tensor, dropout, gelu, relu, sigmoid, tanh, zeros
from . import functional as F
from ._module import Module, Parameter
from .init import kaiming_uniform_, normal_, uniform_

__all__ = [
    "GELU",
    "Dropout",
    "Embedding",
    "Identity",
    "Linear",
    "ReLU",
    "Sequential",
    "Sigmoid",
    "Tanh",
]


class Linear(Module):
    """``y = x @ weight.T + bias``, initialised as PyTorch's ``nn.Linear``.

    Args:
        in_features: Size of each input sample.
        out_features: Size of each output sample.
        bias: Whether to learn an additive bias.
        dtype: Parameter dtype (float32 by default).
        device: Parameter device.
        generator: Source of the initial weights (the default generator if None).
    """

    __module__ = "rpcdist.nn"

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        dtype: Any = np.float32,
        device: str = "cpu",
        generator: Generator | None = None,
    ) -> None:
        super().__init__()
        if in_features < 1 or out_features < 1:
            raise ConfigError(f"Linear: sizes must be positive, got {in_features}, {out_features}")
        self.in_features, self.out_features = in_features, out_features
        self.weight = Parameter(zeros(out_features, in_features, dtype=dtype, device=device))
        kaiming_uniform_(self.weight, a=math.sqrt(5), generator=generator)
        if bias:
            self.bias: Parameter | None = Parameter(zeros(out_features, dtype=dtype, device=device))
            bound = 1.0 / math.sqrt(in_features)
            uniform_(self.bias, -bound, bound, generator=generator)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: Tensor) -> Tensor:
        """Apply the affine map to the last dimension of ``x``."""
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class Embedding(Module):
    """A lookup table of ``num_embeddings`` vectors, initialised ``N(0, 1)``.

    Args:
        num_embeddings: Table size.
        embedding_dim: Vector size.
        padding_idx: A row kept at zero that receives no gradient.
        dtype: Parameter dtype.
        device: Parameter device.
        generator: Source of the initial weights.
    """

    __module__ = "rpcdist.nn"

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | None = None,
        *,
        dtype: Any = np.float32,
        device: str = "cpu",
        generator: Generator | None = None,
    ) -> None:
        super().__init__()
        if padding_idx is not None:
            if not -num_embeddings <= padding_idx < num_embeddings:
                raise ConfigError(f"Embedding: padding_idx {padding_idx} out of range")
            padding_idx %= num_embeddings
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padding_idx = padding_idx
        self.weight = Parameter(zeros(num_embeddings, embedding_dim, dtype=dtype, device=device))
        normal_(self.weight, generator=generator)
        if padding_idx is not None:
            self.weight.data[padding_idx] = 0

    def forward(self, idx: Any) -> Tensor:
        """Look up the rows at integer indices ``idx``."""
        return F.embedding(idx, self.weight, self.padding_idx)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}"


class Dropout(Module):
    """Zero elements with probability ``p`` while training (scaled by ``1/(1-p)``)."""

    __module__ = "rpcdist.nn"

    def __init__(self, p: float = 0.5, *, generator: Generator | None = None) -> None:
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ConfigError(f"Dropout: p must be in [0, 1), got {p}")
        self.p, self.generator = p, generator

    def forward(self, x: Tensor) -> Tensor:
        """Apply dropout in training mode; identity in eval mode."""
        return dropout(x, self.p, self.training, generator=self.generator)

    def extra_repr(self) -> str:
        return f"p={self.p}"


class ReLU(Module):
    """Elementwise ``max(x, 0)``."""

    __module__ = "rpcdist.nn"

    def forward(self, x: Tensor) -> Tensor:
        """Apply the activation."""
        return relu(x)


class Tanh(Module):
    """Elementwise hyperbolic tangent."""

    __module__ = "rpcdist.nn"

    def forward(self, x: Tensor) -> Tensor:
        """Apply the activation."""
        return tanh(x)


class Sigmoid(Module):
    """Elementwise logistic sigmoid."""

    __module__ = "rpcdist.nn"

    def forward(self, x: Tensor) -> Tensor:
        """Apply the activation."""
        return sigmoid(x)


class GELU(Module):
    """Gaussian error linear unit (``approximate`` is ``"none"`` or ``"tanh"``)."""

    __module__ = "rpcdist.nn"

    def __init__(self, approximate: str = "none") -> None:
        super().__init__()
        self.approximate = approximate

    def forward(self, x: Tensor) -> Tensor:
        """Apply the activation."""
        return gelu(x, self.approximate)


class Identity(Module):
    """Returns its input."""

    __module__ = "rpcdist.nn"

    def forward(self, x: Any) -> Any:
        """Return ``x``."""
        return x


class Sequential(Module):
    """Modules applied in order; indexable and iterable.

    Args:
        *modules: The stages, registered as ``"0"``, ``"1"``, ...
    """

    __module__ = "rpcdist.nn"

    def __init__(self, *modules: Module) -> None:
        super().__init__()
        for i, m in enumerate(modules):
            self.add_module(str(i), m)

    def append(self, module: Module) -> Sequential:
        """Add a stage at the end; returns self."""
        self.add_module(str(len(self._modules)), module)
        return self

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self) -> Iterator[Module]:
        return iter(m for m in self._modules.values() if m is not None)

    def __getitem__(self, i: int) -> Module:
        mods = list(self)
        return mods[i]

    def forward(self, x: Any) -> Any:
        """Feed ``x`` through every stage."""
        for m in self._modules.values():
            if m is not None:
                x = m(x)
        return x
