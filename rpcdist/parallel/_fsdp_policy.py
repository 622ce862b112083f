"""What ``FullyShardedDataParallel`` is configured with: wrap policies, mixed precision.

A wrap policy decides which submodules become units of their own (each
unit's parameters are flattened, sharded and gathered together). It is
called bottom-up as ``policy(module, numel)``, where ``numel`` counts the
parameters of ``module`` not already claimed by a unit below it.

PyTorch's form, ``policy(module, recurse, nonwrapped_numel)``, is accepted
too (:func:`as_wrap_policy`): asked with ``recurse=True`` before a
submodule's children are visited (``False``: leave them as they are), then
with ``recurse=False`` whether to wrap it. So is
``functools.partial(size_based_auto_wrap_policy, min_num_params=...)``, the
way PyTorch's size policy is configured.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._errors import ConfigError

__all__ = [
    "MixedPrecision",
    "ModuleWrapPolicy",
    "WrapPolicy",
    "as_wrap_policy",
    "resolve_mixed_precision",
    "size_based_auto_wrap_policy",
]


class size_based_auto_wrap_policy:
    """Wrap every submodule that holds at least ``min_num_params`` unclaimed parameters.

    Args:
        min_num_params: The threshold, in parameters (elements, not bytes).

    Raises:
        ConfigError: ``min_num_params`` is negative.
    """

    __module__ = "rpcdist.parallel"

    def __init__(self, min_num_params: int = 100_000_000) -> None:
        if int(min_num_params) < 0:
            raise ConfigError(
                f"size_based_auto_wrap_policy: min_num_params must be >= 0, got {min_num_params!r}"
            )
        self.min_num_params = int(min_num_params)

    def __call__(self, module: Any, numel: int) -> bool:
        return numel >= self.min_num_params

    def __repr__(self) -> str:
        return f"size_based_auto_wrap_policy(min_num_params={self.min_num_params})"


class ModuleWrapPolicy:
    """Wrap every submodule that is an instance of one of ``module_classes``.

    Args:
        module_classes: Module classes (e.g. ``{nn.Linear}`` or a transformer block).

    Raises:
        ConfigError: an entry is not a class.
    """

    __module__ = "rpcdist.parallel"

    def __init__(self, module_classes: Iterable[type]) -> None:
        classes = tuple(module_classes)
        bad = [c for c in classes if not isinstance(c, type)]
        if bad:
            raise ConfigError(f"ModuleWrapPolicy: expected module classes, got {bad!r:.80}")
        self.module_classes = classes

    def __call__(self, module: Any, numel: int) -> bool:
        return numel > 0 and isinstance(module, self.module_classes)

    def __repr__(self) -> str:
        names = sorted(c.__name__ for c in self.module_classes)
        return f"ModuleWrapPolicy({{{', '.join(names)}}})"


@dataclass(frozen=True)
class WrapPolicy:
    """A wrap policy in rpcdist's form: ``descend(module, numel)`` (visit its
    children?) and ``wrap(module, unclaimed_numel)`` (make it a unit?)."""

    descend: Callable[[Any, int], bool]
    wrap: Callable[[Any, int], bool]


def _takes_recurse(policy: Callable[..., Any]) -> bool:
    """Whether ``policy`` has PyTorch's signature ``(module, recurse, nonwrapped_numel)``."""
    try:
        params = inspect.signature(policy).parameters
    except (TypeError, ValueError):  # no signature to read: rpcdist's two-argument form
        return False
    if "recurse" in params:
        return True
    positional = [
        p
        for p in params.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty
    ]
    return len(positional) >= 3


def as_wrap_policy(policy: Callable[..., Any]) -> WrapPolicy:
    """``policy`` in either form (see the module docstring) as a :class:`WrapPolicy`.

    Raises:
        ConfigError: ``policy`` is not callable.
    """
    if not callable(policy):
        raise ConfigError(
            f"FullyShardedDataParallel: auto_wrap_policy must be callable or None, got {policy!r:.60}"
        )
    if isinstance(policy, functools.partial) and policy.func is size_based_auto_wrap_policy:
        policy = size_based_auto_wrap_policy(*policy.args, **policy.keywords)
    if not _takes_recurse(policy):
        return WrapPolicy(descend=lambda module, numel: True, wrap=policy)
    torch_form = policy
    return WrapPolicy(
        descend=lambda module, numel: bool(
            torch_form(module=module, recurse=True, nonwrapped_numel=numel)
        ),
        wrap=lambda module, numel: bool(
            torch_form(module=module, recurse=False, nonwrapped_numel=numel)
        ),
    )


_LOW = {"float16": "float16", "fp16": "float16", "bfloat16": "bfloat16", "bf16": "bfloat16"}


def _low(value: Any, what: str) -> str | None:
    if value is None:
        return None
    name = value if isinstance(value, str) else getattr(value, "__name__", str(value))
    if not isinstance(value, str):
        try:
            name = np.dtype(value).name
        except TypeError:
            pass
    found = _LOW.get(str(name).lower())
    if found is None:
        raise ConfigError(
            f"MixedPrecision: {what} must be None, 'float16' or 'bfloat16', got {value!r}"
        )
    return found


@dataclass(frozen=True)
class MixedPrecision:
    """Low-precision communication for ``FullyShardedDataParallel``; master shards stay float32.

    Parameters are all-gathered in ``param_dtype`` (so every rank computes
    with the rounded values) and gradients are reduce-scattered in
    ``reduce_dtype``; the optimizer updates the float32 shards. NumPy has no
    fast half-precision arithmetic (and no bfloat16), so the forward and
    backward arithmetic itself runs in float32 on the rounded values.
    bfloat16 values travel as the top 16 bits of float32; a bfloat16
    gradient reduction sums bfloat16-rounded values in float32.

    Args:
        param_dtype: ``"float16"``, ``"bfloat16"`` or None (float32).
        reduce_dtype: The same choices; None means ``param_dtype``.

    Raises:
        ConfigError: an unknown dtype.
    """

    __module__ = "rpcdist.parallel"

    param_dtype: str | None = None
    reduce_dtype: str | None = None

    def __post_init__(self) -> None:
        param = _low(self.param_dtype, "param_dtype")
        reduce = _low(self.reduce_dtype, "reduce_dtype") if self.reduce_dtype else param
        object.__setattr__(self, "param_dtype", param)
        object.__setattr__(self, "reduce_dtype", reduce)


def resolve_mixed_precision(value: Any) -> MixedPrecision | None:
    """``None``, a dtype name, or a :class:`MixedPrecision` as a ``MixedPrecision`` (or None).

    Raises:
        ConfigError: anything else.
    """
    if value is None or isinstance(value, MixedPrecision):
        return value
    if isinstance(value, str):
        return MixedPrecision(param_dtype=value)
    raise ConfigError(
        "FullyShardedDataParallel: mixed_precision must be None, 'float16', 'bfloat16' "
        f"or a MixedPrecision, got {value!r:.60}"
    )
