"""The arithmetic of one LSTM layer over a whole sequence: forward and full BPTT.

Array-module generic (NumPy or CuPy). Where the time goes, and what this
layout does about it (the figures behind each choice: docs/benchmarks.md,
"Figures behind the code's choices"):

- **One small GEMM per step is the floor.** ``W_hh @ h`` computed as
  ``(4H, H) @ (H, B)`` is faster than ``h @ W_hh.T`` as ``(B, H) @ (H, 4H)``,
  and backward's ``W_hh.T @ d`` likewise: so a step works on
  *feature-major* blocks, gates ``(4H, B)`` and states ``(H, B)``, each
  contiguous (strided blocks make every elementwise call several times
  slower).
- **Few elementwise calls per step.** The gates are kept in the order
  ``o, i, f, g`` in a per-step block of ``5H`` rows whose last ``H`` rows hold
  the previous cell state: one ``tanh`` serves all four gates (the rows of
  the three sigmoid gates are halved in the weights, and ``sigmoid(x) =
  (1 + tanh(x / 2)) / 2``), one affine map finishes the sigmoids, and one
  multiply gives ``[i * g, f * c_prev]``: eight array calls per step forward
  and six backward besides the GEMM, on views sliced before the loop. The
  bias rides in the step's GEMM as a column of ``W`` against a row of ones.
  The backward's local derivatives are computed for the whole sequence at
  once, before its loop.
- **Whole-sequence work goes to big GEMMs.** The input projection of all
  steps is one GEMM (a big GEMM runs faster per element than the per-step
  ones, so folding it into the steps measured slower); the weight
  gradients and the input gradient are one GEMM each over all steps, after
  the recurrence.
- **No fresh memory per step.** Large buffers come from :mod:`._buffers`.
"""

from __future__ import annotations

from typing import Any

from . import _buffers

__all__ = ["Saved", "gate_grads", "input_grad", "layer_forward", "weight_grads"]

#: Internal gate block ``k`` is PyTorch's block ``_FROM_TORCH[k]`` (PyTorch: i, f, g, o).
_FROM_TORCH = (3, 0, 1, 2)


def _internal(xp: Any, w: Any, sig: float, out: Any = None) -> Any:
    """Rows (or entries) of ``w`` in internal gate order, sigmoid gates times ``sig``."""
    h = w.shape[0] // 4
    if out is None:
        out = _buffers.empty(xp, w.shape, w.dtype)
    xp.multiply(w[3 * h :], sig, out=out[:h])  # o
    xp.multiply(w[: 2 * h], sig, out=out[h : 3 * h])  # i, f
    out[3 * h :] = w[2 * h : 3 * h]  # g
    return out


def _to_torch(xp: Any, a: Any) -> Any:
    """Rows of ``a`` from internal gate order back to PyTorch's."""
    h = a.shape[0] // 4
    out = _buffers.empty(xp, a.shape, a.dtype)
    for k, src in enumerate(_FROM_TORCH):
        out[src * h : (src + 1) * h] = a[k * h : (k + 1) * h]
    return out


class Saved:
    """What one layer's forward keeps for its backward.

    ``acts``: ``(T + 1, 5H, B)``, per step the gates ``o, i, f, g`` after their
    nonlinearities and, in the last ``H`` rows, the cell state entering the
    step (step ``T`` holds the final cell state). ``tcs``: ``tanh`` of each
    step's new cell state, ``(T, H, B)``. ``hsb``: the hidden states
    ``(T + 1, B, H)``, the initial one first; ``hsb[1:]`` is the layer's
    output. ``states``: per step the GEMM operand ``[h_prev; 1]``,
    ``(T + 1, H + 1, B)``.
    """

    __slots__ = ("acts", "hsb", "states", "tcs")

    def __init__(self, acts: Any, tcs: Any, hsb: Any, states: Any) -> None:
        self.acts, self.tcs, self.hsb, self.states = acts, tcs, hsb, states


def layer_forward(
    xp: Any, x: Any, h0: Any, c0: Any, w_ih: Any, w_hh: Any, b_ih: Any, b_hh: Any
) -> Saved:
    """Run one layer over ``x`` of shape ``(T, B, n)``.

    ``h0``, ``c0``: ``(B, H)`` or None (zeros). Weights in PyTorch's layout and
    gate order; biases may be None. The input projection of all steps is one
    GEMM, ``(4H, n) @ (n, T*B)``; each step then is one GEMM of ``[W_hh | b]``
    with ``[h_prev; 1]`` (the bias costs no pass of its own), the step's slice
    of the projection added, and eight elementwise calls.
    """
    steps, batch, n_in = x.shape
    hidden = w_hh.shape[1]
    h1, h3, h4 = hidden, 3 * hidden, 4 * hidden
    dt = x.dtype
    acts = _buffers.empty(xp, (steps + 1, 5 * hidden, batch), dt)
    tcs = _buffers.empty(xp, (steps, hidden, batch), dt)
    states = _buffers.empty(xp, (steps + 1, hidden + 1, batch), dt)
    w = _buffers.empty(xp, (h4, hidden + 1), dt)
    _internal(xp, w_hh, 0.5, out=w[:, :hidden])
    if b_ih is None:
        w[:, -1] = 0
    else:
        _internal(xp, b_ih + b_hh, 0.5, out=w[:, -1])
    pre = _buffers.empty(xp, (h4, steps * batch), dt)
    xp.matmul(_internal(xp, w_ih, 0.5), x.reshape(steps * batch, n_in).T, out=pre)
    states[:, -1] = 1
    states[0, :hidden] = 0 if h0 is None else h0.T
    acts[0, h4:] = 0 if c0 is None else c0.T
    prod = xp.empty((2 * hidden, batch), dtype=dt)
    ig, fc = prod[:h1], prod[h1:]
    hs = states[:, :hidden]
    # Per-step views made up front: indexing in the loop costs time every step.
    steps_views = zip(
        list(states[:steps]),
        list(acts[:steps, :h4]),
        list(pre.reshape(h4, steps, batch).transpose(1, 0, 2)),
        list(acts[:steps, :h3]),
        list(acts[:steps, h1:h3]),
        list(acts[:steps, h3:]),
        list(acts[1:, h4:]),
        list(tcs),
        list(acts[:steps, :h1]),
        list(hs[1:]),
    )
    for state, a, p, s, if_g, gc, c, tc, o_g, h in steps_views:
        xp.matmul(w, state, out=a)
        a += p
        xp.tanh(a, out=a)
        s *= 0.5
        s += 0.5
        xp.multiply(if_g, gc, out=prod)
        xp.add(ig, fc, out=c)
        xp.tanh(c, out=tc)
        xp.multiply(o_g, tc, out=h)
    hsb = _buffers.empty(xp, (steps + 1, batch, hidden), dt)
    xp.copyto(hsb, hs.transpose(0, 2, 1))
    return Saved(acts, tcs, hsb, states)


def _local_derivatives(xp: Any, saved: Saved) -> tuple[Any, Any]:
    """Per step, d(gate pre-activation) per unit of (dh for o; dc for i, f, g), and dc/dh.

    With ``s' = s (1 - s)`` and ``g' = 1 - g^2``: ``o: tanh(c) o'``, ``i: g i'``,
    ``f: c_prev f'``, ``g: i g'``; and ``dc/dh = o (1 - tanh(c)^2)``.
    """
    acts, tcs = saved.acts, saved.tcs
    steps, _, batch = acts.shape
    steps -= 1
    hidden = tcs.shape[1]
    h1, h2, h3, h4 = hidden, 2 * hidden, 3 * hidden, 4 * hidden
    a = acts[:steps]
    k = _buffers.empty(xp, (steps, h4, batch), acts.dtype)
    s, ks = a[:, :h3], k[:, :h3]
    xp.subtract(1, s, out=ks)
    ks *= s
    g, kg = a[:, h3:h4], k[:, h3:]
    xp.multiply(g, g, out=kg)
    xp.subtract(1, kg, out=kg)
    k[:, :h1] *= tcs
    k[:, h1:h2] *= g
    k[:, h2:h3] *= a[:, h4:]
    kg *= a[:, h1:h2]
    m = _buffers.empty(xp, tcs.shape, tcs.dtype)
    xp.multiply(tcs, tcs, out=m)
    xp.subtract(1, m, out=m)
    m *= a[:, :h1]
    return k, m


def gate_grads(
    xp: Any, saved: Saved, w_hh: Any, g_seq: Any, g_h: Any, g_c: Any, want_h0: bool, want_c0: bool
) -> tuple[Any, Any, Any]:
    """The recurrence of one layer's backward: the gradients of every step's
    gate pre-activations, from which :func:`weight_grads` and
    :func:`input_grad` each take one GEMM.

    Returns:
        ``(flat, dh0, dc0)``: the gate gradients ``(4H, T*B)`` in internal
        gate order, and the initial states' gradients ``(B, H)`` (None unless
        wanted).
    """
    acts = saved.acts
    steps, _, batch = acts.shape
    steps -= 1
    hidden = w_hh.shape[1]
    h1, h2, h3, h4 = hidden, 2 * hidden, 3 * hidden, 4 * hidden
    dt = acts.dtype
    d, m = _local_derivatives(xp, saved)
    whh_t = _buffers.empty(xp, (hidden, h4), dt)
    for k, src in enumerate(_FROM_TORCH):
        whh_t[:, k * hidden : (k + 1) * hidden] = w_hh[src * hidden : (src + 1) * hidden].T
    dh = xp.zeros((hidden, batch), dtype=dt) if g_h is None else xp.array(g_h.T, dt, order="C")
    dc = xp.zeros((hidden, batch), dtype=dt) if g_c is None else xp.array(g_c.T, dt, order="C")
    g_t = None
    if g_seq is not None:
        g_t = _buffers.empty(xp, (steps, hidden, batch), dt)
        xp.copyto(g_t, g_seq.transpose(0, 2, 1))
    tmp = xp.empty((hidden, batch), dtype=dt)
    steps_views = zip(
        range(steps - 1, -1, -1),
        list(g_t)[::-1] if g_t is not None else [None] * steps,
        list(m)[::-1],
        list(d[:, :h1])[::-1],
        list(d[:, h1:].reshape(steps, 3, hidden, batch))[::-1],
        list(acts[:steps, h2:h3])[::-1],
        list(d)[::-1],
    )
    for t, g, m_t, d_o, d_rest, f_g, d_t in steps_views:
        if g is not None:
            dh += g
        xp.multiply(dh, m_t, out=tmp)
        dc += tmp
        d_o *= dh
        d_rest *= dc
        dc *= f_g
        if t or want_h0:
            xp.matmul(whh_t, d_t, out=dh)
    flat = _buffers.empty(xp, (h4, steps, batch), dt)
    xp.copyto(flat, d.transpose(1, 0, 2))
    return (
        flat.reshape(h4, steps * batch),
        dh.T.copy() if want_h0 else None,
        dc.T.copy() if want_c0 else None,
    )


def weight_grads(
    xp: Any, flat: Any, x: Any, saved: Saved, want_ih: bool, want_hh: bool, want_b: bool
) -> tuple[Any, Any, Any]:
    """``(dw_ih, dw_hh, db)`` of one layer from its gate gradients ``flat``
    (:func:`gate_grads`), its input ``x`` and its :class:`Saved`; None where
    not wanted. ``db`` is the gradient of either bias."""
    dw_ih = dw_hh = db = None
    h4, rows = flat.shape
    if want_ih:
        n_in = x.shape[2]
        dw = _buffers.empty(xp, (h4, n_in), flat.dtype)
        dw_ih = _to_torch(xp, xp.matmul(flat, x.reshape(rows, n_in), out=dw))
    if want_hh:
        hidden, steps = h4 // 4, saved.acts.shape[0] - 1
        dw = _buffers.empty(xp, (h4, hidden), flat.dtype)
        hs = saved.hsb[:steps].reshape(rows, hidden)
        dw_hh = _to_torch(xp, xp.matmul(flat, hs, out=dw))
    if want_b:
        db = _to_torch(xp, flat.sum(axis=1))
    return dw_ih, dw_hh, db


def input_grad(xp: Any, flat: Any, x: Any, w_ih: Any) -> Any:
    """The gradient of one layer's input ``x`` ``(T, B, n)`` from its gate
    gradients ``flat`` (:func:`gate_grads`)."""
    dx = _buffers.empty(xp, x.shape, flat.dtype)
    xp.matmul(flat.T, _internal(xp, w_ih, 1.0), out=dx.reshape(flat.shape[1], x.shape[2]))
    return dx
