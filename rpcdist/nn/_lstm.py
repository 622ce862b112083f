"""``LSTM``: multi-layer long short-term memory with full BPTT.

All layers of a sequence are one graph node, :class:`LSTMFn`, whose arithmetic
is in :mod:`._lstm_core`: per layer, one GEMM projects every step's input,
then each step does one ``W_hh @ h`` GEMM and a handful of in-place array
calls on feature-major blocks; backward runs the steps in reverse and
finishes with one GEMM per weight gradient and one for the input's. With dropout between layers
(training only) each layer is its own node, with the dropout between them.
Gate order and parameter names follow PyTorch (``i, f, g, o``;
``weight_ih_l0``, ``weight_hh_l0``, ``bias_ih_l0``, ``bias_hh_l0``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .._errors import ConfigError
from ..tensor import Function, Generator, Tensor, cat, dropout, zeros
from ..tensor._device import array_module
from ._lstm_core import Saved, gate_grads, input_grad, layer_forward, weight_grads
from ._module import Module, Parameter
from .init import uniform_

__all__ = ["LSTM", "LSTMFn"]


class LSTMFn(Function):
    """A stack of LSTM layers over a whole sequence, in one node.

    Inputs: ``x`` (T, B, n); ``h0``, ``c0`` (L, B, H) or None (zeros); then per
    layer ``w_ih``, ``w_hh`` and, with ``bias=True``, ``b_ih``, ``b_hh``.
    Outputs: the last layer's hidden sequence (T, B, H), ``h_n`` and ``c_n``
    (L, B, H).
    """

    __slots__ = ("bias", "layers", "saved", "weights", "x")
    op = "lstm"
    splittable = True

    def _weights(self, weights: tuple[Any, ...], layer: int) -> tuple[Any, Any, Any, Any]:
        per = 4 if self.bias else 2
        w = weights[layer * per : (layer + 1) * per]
        return (w[0], w[1], w[2], w[3]) if self.bias else (w[0], w[1], None, None)

    def forward(self, x: Any, h0: Any, c0: Any, *weights: Any, num_layers: int, bias: bool) -> Any:
        self.layers, self.bias = num_layers, bias
        if len(weights) != num_layers * (4 if bias else 2):
            raise ValueError(f"{len(weights)} weight arrays for {num_layers} layers (bias={bias})")
        xp = array_module(x)
        steps, batch, _ = x.shape
        hidden = weights[1].shape[1]
        for w in weights:
            if w.dtype != x.dtype:
                raise TypeError(f"input dtype {x.dtype} differs from weight dtype {w.dtype}")
        want = (num_layers, batch, hidden)
        for name, s in (("h0", h0), ("c0", c0)):
            if s is not None and s.shape != want:
                raise ValueError(f"{name} of shape {tuple(s.shape)} != {want}")
        saved: list[Saved] = []
        h_n = xp.empty(want, dtype=x.dtype)
        c_n = xp.empty(want, dtype=x.dtype)
        inp = x
        for layer in range(num_layers):
            w_ih, w_hh, b_ih, b_hh = self._weights(weights, layer)
            if w_ih.shape != (4 * hidden, inp.shape[2]) or w_hh.shape != (4 * hidden, hidden):
                raise ValueError(
                    f"layer {layer}: weights {tuple(w_ih.shape)}, {tuple(w_hh.shape)} do not "
                    f"match input size {inp.shape[2]} and hidden size {hidden}"
                )
            s = layer_forward(
                xp,
                inp,
                None if h0 is None else h0[layer],
                None if c0 is None else c0[layer],
                w_ih,
                w_hh,
                b_ih,
                b_hh,
            )
            saved.append(s)
            h_n[layer] = s.hsb[steps]
            c_n[layer] = s.acts[steps, 4 * hidden :].T
            inp = s.hsb[1:]
        self.saved, self.x, self.weights = saved, x, weights
        return inp, h_n, c_n

    def backward(self, g_out: Any, g_h: Any, g_c: Any) -> tuple[Any, ...]:
        needs = self.needs_input_grad
        grads, _ = self._backward(g_out, g_h, g_c, needs, (False,) * len(needs))
        return grads

    def apply_split(
        self, grads: Sequence[Any], first: Sequence[bool]
    ) -> tuple[Sequence[Any], Callable[[], Sequence[Any]]]:
        # The recurrence runs once, in the first part; the second keeps its
        # gate gradients for the GEMMs it still owes (the weights', in a
        # distributed pass: see GraphTask).
        self._check_live()
        needs = self.needs_input_grad
        now = tuple(n and f for n, f in zip(needs, first))
        then = tuple(n and not f for n, f in zip(needs, first))
        g_out, g_h, g_c = grads
        return self._backward(g_out, g_h, g_c, now, then)

    def _backward(
        self, g_out: Any, g_h: Any, g_c: Any, now: Sequence[bool], then: Sequence[bool]
    ) -> tuple[tuple[Any, ...], Callable[[], tuple[Any, ...]]]:
        """The input gradients ``now`` asks for, and a function computing those
        ``then`` asks for (all false: no second part)."""
        saved, weights, layers = self.saved, self.weights, self.layers
        xp = array_module(saved[0].acts)
        per = 4 if self.bias else 2
        n = 3 + len(weights)
        needs = self.needs_input_grad  # ``now`` or ``then``
        grads: list[Any] = [None] * n
        fixed: dict[int, Any] = {}  # the second part's gradients already computed
        jobs: list[Callable[[list[Any]], None]] = []  # and those it computes
        dh0: list[Any] = []
        dc0: list[Any] = []
        g_seq = g_out
        for layer in range(layers - 1, -1, -1):
            w_ih, w_hh, _, _ = self._weights(weights, layer)
            x = self.x if layer == 0 else saved[layer - 1].hsb[1:]
            flat, dh, dc = gate_grads(
                xp,
                saved[layer],
                w_hh,
                g_seq,
                None if g_h is None else g_h[layer],
                None if g_c is None else g_c[layer],
                needs[1],
                needs[2],
            )
            dh0.append(dh)
            dc0.append(dc)
            base = 3 + layer * per
            idx = tuple(range(base, base + per))
            _put_weight_grads(xp, flat, x, saved[layer], idx, now, grads)
            if any(then[i] for i in idx):
                jobs.append(
                    functools.partial(_put_weight_grads, xp, flat, x, saved[layer], idx, then)
                )
            if layer or now[0]:
                g_seq = input_grad(xp, flat, x, w_ih)
            elif then[0]:
                jobs.append(functools.partial(_put_input_grad, xp, flat, x, w_ih))
        if now[0]:
            grads[0] = g_seq
        for i, parts in ((1, dh0), (2, dc0)):
            if needs[i]:
                (grads if now[i] else fixed)[i] = xp.stack(parts[::-1])

        def rest() -> tuple[Any, ...]:
            out: list[Any] = [None] * n
            for i, g in fixed.items():
                out[i] = g
            for job in jobs:
                job(out)
            return tuple(out)

        return tuple(grads), rest


def _put_weight_grads(
    xp: Any,
    flat: Any,
    x: Any,
    saved: Saved,
    idx: tuple[int, ...],
    mask: Sequence[bool],
    out: list[Any],
) -> None:
    """Put the gradients ``mask`` asks for of one layer's weights (at ``idx``:
    ``w_ih, w_hh`` and, with biases, ``b_ih, b_hh``) into ``out``."""
    want_b = len(idx) == 4 and (mask[idx[2]] or mask[idx[3]])
    if not (mask[idx[0]] or mask[idx[1]] or want_b):
        return
    dw_ih, dw_hh, db = weight_grads(xp, flat, x, saved, mask[idx[0]], mask[idx[1]], want_b)
    out[idx[0]], out[idx[1]] = dw_ih, dw_hh
    if want_b:
        out[idx[2]], out[idx[3]] = db, db


def _put_input_grad(xp: Any, flat: Any, x: Any, w_ih: Any, out: list[Any]) -> None:
    out[0] = input_grad(xp, flat, x, w_ih)


class LSTM(Module):
    """A multi-layer LSTM (PyTorch's ``nn.LSTM`` without projections).

    Args:
        input_size: Features per input step.
        hidden_size: Features of the hidden state.
        num_layers: Stacked layers.
        bias: Whether the layers have ``bias_ih``/``bias_hh``.
        batch_first: Inputs and outputs are ``(B, T, F)`` instead of ``(T, B, F)``.
        dropout: Dropout on each layer's output but the last (training only).
        dtype: Parameter dtype.
        device: Parameter device.
        generator: Source of the initial weights (the default generator if None).

    ``forward(x, (h0, c0)=None)`` returns ``output, (h_n, c_n)`` with states of
    shape ``(num_layers, B, hidden_size)``.
    """

    __module__ = "rpcdist.nn"

    def __init__(
        self,
        input_size: int,
        hidden_size: int,
        num_layers: int = 1,
        bias: bool = True,
        batch_first: bool = False,
        dropout: float = 0.0,
        *,
        dtype: Any = np.float32,
        device: str = "cpu",
        generator: Generator | None = None,
    ) -> None:
        super().__init__()
        if num_layers < 1 or hidden_size < 1 or input_size < 1:
            raise ConfigError("LSTM: sizes and num_layers must be positive")
        if not 0.0 <= dropout < 1.0:
            raise ConfigError(f"LSTM: dropout must be in [0, 1), got {dropout}")
        self.input_size, self.hidden_size, self.num_layers = input_size, hidden_size, num_layers
        self.bias, self.batch_first, self.dropout = bias, batch_first, dropout
        self.generator = generator
        bound = 1.0 / math.sqrt(hidden_size)
        for layer in range(num_layers):
            fan_in = input_size if layer == 0 else hidden_size
            shapes: dict[str, tuple[int, ...]] = {
                f"weight_ih_l{layer}": (4 * hidden_size, fan_in),
                f"weight_hh_l{layer}": (4 * hidden_size, hidden_size),
            }
            if bias:
                shapes[f"bias_ih_l{layer}"] = (4 * hidden_size,)
                shapes[f"bias_hh_l{layer}"] = (4 * hidden_size,)
            for name, shape in shapes.items():
                p = Parameter(zeros(*shape, dtype=dtype, device=device))
                uniform_(p, -bound, bound, generator=generator)
                setattr(self, name, p)

    def extra_repr(self) -> str:
        return (
            f"{self.input_size}, {self.hidden_size}, num_layers={self.num_layers}, "
            f"batch_first={self.batch_first}"
        )

    def forward(
        self, x: Tensor, state: tuple[Tensor, Tensor] | None = None
    ) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        """Run the sequence; returns ``output, (h_n, c_n)``.

        Raises:
            ConfigError: the input is not 3-D, or its feature size or the
                state shapes do not match.
        """
        if x.ndim != 3:
            raise ConfigError(f"LSTM: expected a 3-D input, got shape {x.shape}")
        if self.batch_first:
            x = x.transpose(0, 1)
        _, batch, feats = x.shape
        if feats != self.input_size:
            raise ConfigError(
                f"LSTM: input has {feats} features per step, expected {self.input_size}"
            )
        want = (self.num_layers, batch, self.hidden_size)
        h0: Tensor | None = None
        c0: Tensor | None = None
        if state is not None:
            h0, c0 = state
            if h0.shape != want or c0.shape != want:
                raise ConfigError(
                    f"LSTM: initial state shapes {h0.shape}, {c0.shape}, expected {want}"
                )
        weights: list[Tensor] = []
        for layer in range(self.num_layers):
            names = ["weight_ih", "weight_hh"] + (["bias_ih", "bias_hh"] if self.bias else [])
            weights.extend(getattr(self, f"{n}_l{layer}") for n in names)
        if not (self.dropout and self.training and self.num_layers > 1):
            out, h_n, c_n = LSTMFn.call(
                x, h0, c0, *weights, num_layers=self.num_layers, bias=self.bias
            )
        else:
            per = len(weights) // self.num_layers
            hs, cs = [], []
            out = x
            for layer in range(self.num_layers):
                if layer:
                    out = dropout(out, self.dropout, generator=self.generator)
                out, h, c = LSTMFn.call(
                    out,
                    None if h0 is None else h0[layer : layer + 1],
                    None if c0 is None else c0[layer : layer + 1],
                    *weights[layer * per : (layer + 1) * per],
                    num_layers=1,
                    bias=self.bias,
                )
                hs.append(h)
                cs.append(c)
            h_n, c_n = cat(hs), cat(cs)
        if self.batch_first:
            out = out.transpose(0, 1)
        return out, (h_n, c_n)
