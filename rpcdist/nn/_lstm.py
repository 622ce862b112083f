"""``LSTM``: multi-layer long short-term memory with full BPTT.

Each layer is two graph nodes: one matmul of the whole input sequence with
``weight_ih`` (all four gates and all time steps at once), then
:class:`LSTMLayerFn`, which runs the recurrence with one fused
``h @ weight_hh.T`` per step and backpropagates through every step.
Gate order and parameter names follow PyTorch (``i, f, g, o``;
``weight_ih_l0``, ``weight_hh_l0``, ``bias_ih_l0``, ``bias_hh_l0``).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .._errors import ConfigError
from ..tensor import Function, Generator, Tensor, dropout, stack, zeros
from ..tensor._device import array_module
from ._fused import LinearFn
from ._module import Module, Parameter
from .init import uniform_

__all__ = ["LSTM", "LSTMLayerFn"]


class LSTMLayerFn(Function):
    """The recurrence of one LSTM layer over a whole sequence.

    Inputs: ``xw`` (T, B, 4H) = input projection incl. ``bias_ih``; ``h0``,
    ``c0`` (B, H); ``w_hh`` (4H, H); ``b_hh`` (4H). Outputs: the hidden
    sequence (T, B, H), ``h_T`` and ``c_T`` (B, H).
    """

    __slots__ = ("acts", "cs", "hs", "tcs", "w_hh")
    op = "lstm"

    def forward(self, xw: Any, h0: Any, c0: Any, w_hh: Any, b_hh: Any) -> Any:
        xp = array_module(xw)
        steps, batch, four_h = xw.shape
        hidden = four_h // 4
        if h0.shape != (batch, hidden) or c0.shape != (batch, hidden):
            raise ValueError(
                f"initial state shapes {tuple(h0.shape)}, {tuple(c0.shape)} != {(batch, hidden)}"
            )
        dtype = xw.dtype
        h2, h3 = 2 * hidden, 3 * hidden
        # sigmoid(x) = (1 + tanh(x / 2)) / 2: halving the i, f, o rows of the
        # pre-activation up front lets one tanh per step serve all four gates.
        scale = xp.full(four_h, 0.5, dtype=dtype)
        scale[h2:h3] = 1
        acts = xp.add(xw, b_hh, out=xp.empty((steps, batch, four_h), dtype=dtype))
        acts *= scale
        w_t = xp.ascontiguousarray((w_hh * scale[:, None]).T)
        hs = xp.empty((steps + 1, batch, hidden), dtype=dtype)
        cs = xp.empty((steps + 1, batch, hidden), dtype=dtype)
        tcs = xp.empty((steps, batch, hidden), dtype=dtype)
        tmp = xp.empty((batch, hidden), dtype=dtype)
        hs[0] = h0
        cs[0] = c0
        for t in range(steps):
            a = acts[t]
            a += hs[t] @ w_t
            xp.tanh(a, out=a)
            for gate in (a[:, :h2], a[:, h3:]):
                gate += 1
                gate *= 0.5
            c = cs[t + 1]
            xp.multiply(a[:, hidden:h2], cs[t], out=c)
            xp.multiply(a[:, :hidden], a[:, h2:h3], out=tmp)
            c += tmp
            tc = tcs[t]
            xp.tanh(c, out=tc)
            xp.multiply(a[:, h3:], tc, out=hs[t + 1])
        self.acts, self.hs, self.cs, self.tcs, self.w_hh = acts, hs, cs, tcs, w_hh
        return hs[1:], hs[steps], cs[steps]

    def backward(self, g_out: Any, g_h: Any, g_c: Any) -> tuple[Any, ...]:
        acts, hs, cs, tcs, w_hh = self.acts, self.hs, self.cs, self.tcs, self.w_hh
        xp = array_module(acts)
        steps, batch, four_h = acts.shape
        hidden = four_h // 4
        h2, h3 = 2 * hidden, 3 * hidden
        dtype = acts.dtype
        # Local derivatives for the whole sequence at once; they become the
        # gate gradients in place. Per step, d(pre) = dc * [g i', c_prev f',
        # i g'] for i, f, g and dh * tanh(c) o' for o, with s' = s (1 - s) and
        # g' = 1 - g^2.
        d_gates = xp.subtract(1, acts, out=xp.empty_like(acts))
        d_gates *= acts
        gates = acts[..., h2:h3]
        d_cand = d_gates[..., h2:h3]
        xp.multiply(gates, gates, out=d_cand)
        xp.subtract(1, d_cand, out=d_cand)
        d_gates[..., :hidden] *= gates
        d_gates[..., hidden:h2] *= cs[:-1]
        d_cand *= acts[..., :hidden]
        d_gates[..., h3:] *= tcs
        # d(c)/d(h) through the output: o * (1 - tanh(c)^2)
        dc_dh = xp.multiply(tcs, tcs)
        xp.subtract(1, dc_dh, out=dc_dh)
        dc_dh *= acts[..., h3:]
        by_gate = d_gates.reshape(steps, batch, 4, hidden)
        dh = xp.zeros((batch, hidden), dtype=dtype) if g_h is None else g_h.astype(dtype, copy=True)
        dc = xp.zeros((batch, hidden), dtype=dtype) if g_c is None else g_c.astype(dtype, copy=True)
        tmp = xp.empty((batch, hidden), dtype=dtype)
        for t in range(steps - 1, -1, -1):
            if g_out is not None:
                dh += g_out[t]
            xp.multiply(dh, dc_dh[t], out=tmp)
            dc += tmp
            step = by_gate[t]
            step[:, 3] *= dh
            step[:, :3] *= dc[:, None, :]
            dc *= acts[t, :, hidden:h2]
            dh = d_gates[t] @ w_hh
        needs = self.needs_input_grad
        flat = d_gates.reshape(-1, four_h)
        g_w = flat.T @ hs[:-1].reshape(-1, hidden) if needs[3] else None
        g_b = flat.sum(axis=0) if needs[4] else None
        return (
            d_gates if needs[0] else None,
            dh if needs[1] else None,
            dc if needs[2] else None,
            g_w,
            g_b,
        )


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
        if state is None:
            h0 = c0 = zeros(*want, dtype=x.dtype, device=x.device)
        else:
            h0, c0 = state
            if h0.shape != want or c0.shape != want:
                raise ConfigError(
                    f"LSTM: initial state shapes {h0.shape}, {c0.shape}, expected {want}"
                )
        h_n, c_n = [], []
        out = x
        for layer in range(self.num_layers):
            w_ih = getattr(self, f"weight_ih_l{layer}")
            w_hh = getattr(self, f"weight_hh_l{layer}")
            if self.bias:
                xw = LinearFn.call(out, w_ih, getattr(self, f"bias_ih_l{layer}"))
                b_hh = getattr(self, f"bias_hh_l{layer}")
            else:
                xw = LinearFn.call(out, w_ih)
                b_hh = zeros(4 * self.hidden_size, dtype=x.dtype, device=x.device)
            out, h, c = LSTMLayerFn.call(xw, h0[layer], c0[layer], w_hh, b_hh)
            h_n.append(h)
            c_n.append(c)
            if self.dropout and self.training and layer < self.num_layers - 1:
                out = dropout(out, self.dropout, generator=self.generator)
        if self.batch_first:
            out = out.transpose(0, 1)
        return out, (stack(h_n), stack(c_n))
