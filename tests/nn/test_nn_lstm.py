"""LSTM: full backpropagation through time, checked by finite differences."""

from __future__ import annotations

import numpy as np
import pytest

import rpcdist.tensor as rt
from rpcdist import ConfigError, nn
from rpcdist.nn import _buffers
from rpcdist.tensor import gradcheck


def make(device: str, **kw: object) -> nn.LSTM:
    return nn.LSTM(3, 4, dtype=np.float64, device=device, generator=rt.Generator(0), **kw)  # type: ignore[arg-type]


def leaf(shape: tuple[int, ...], device: str, seed: int) -> rt.Tensor:
    arr = np.random.default_rng(seed).normal(size=shape)
    return rt.tensor(arr, device=device, requires_grad=True)


def test_gradcheck_two_layers_several_steps(device: str) -> None:
    lstm = make(device, num_layers=2)
    x = leaf((5, 2, 3), device, 1)  # T=5 steps, batch 2
    h0, c0 = leaf((2, 2, 4), device, 2), leaf((2, 2, 4), device, 3)
    params = list(lstm.parameters())

    def run(*args: rt.Tensor) -> tuple[rt.Tensor, ...]:
        out, (h, c) = lstm(args[0], (args[1], args[2]))
        return out, h, c

    assert gradcheck(run, [x, h0, c0, *params], atol=1e-7, rtol=1e-5)


def test_gradcheck_last_output_only_batch_first(device: str) -> None:
    lstm = make(device, batch_first=True)
    x = leaf((2, 6, 3), device, 4)
    assert gradcheck(lambda a, *_: lstm(a)[0][:, -1].sum(), [x, *lstm.parameters()])


def test_no_bias_variant(device: str) -> None:
    lstm = make(device, bias=False)
    assert [n for n, _ in lstm.named_parameters()] == ["weight_ih_l0", "weight_hh_l0"]
    x = leaf((3, 2, 3), device, 5)
    assert gradcheck(lambda a, *_: lstm(a)[1][1], [x, *lstm.parameters()])


def test_batch_first_equals_time_first() -> None:
    a = nn.LSTM(3, 5, num_layers=2, generator=rt.Generator(1))
    b = nn.LSTM(3, 5, num_layers=2, batch_first=True, generator=rt.Generator(1))
    x = rt.randn(7, 2, 3, generator=rt.Generator(2))
    out_a, (h_a, c_a) = a(x)
    out_b, (h_b, c_b) = b(x.transpose(0, 1))
    np.testing.assert_allclose(out_a.numpy(), out_b.transpose(0, 1).numpy(), rtol=1e-6)
    np.testing.assert_allclose(h_a.numpy(), h_b.numpy(), rtol=1e-6)
    np.testing.assert_allclose(c_a.numpy(), c_b.numpy(), rtol=1e-6)
    assert out_a.dtype == np.float32 and h_a.shape == (2, 2, 5)


def test_state_carries_over_between_calls() -> None:
    lstm = nn.LSTM(2, 3, generator=rt.Generator(3))
    x = rt.randn(6, 1, 2, generator=rt.Generator(4))
    full, (h, c) = lstm(x)
    _, state = lstm(x[:3])
    second, (h2, c2) = lstm(x[3:], state)
    np.testing.assert_allclose(second.numpy(), full.numpy()[3:], rtol=1e-6)
    np.testing.assert_allclose(h2.numpy(), h.numpy(), rtol=1e-6)
    np.testing.assert_allclose(c2.numpy(), c.numpy(), rtol=1e-6)


def test_dropout_between_layers_only_in_training() -> None:
    lstm = nn.LSTM(3, 8, num_layers=2, dropout=0.5, generator=rt.Generator(0))
    x = rt.randn(4, 2, 3, generator=rt.Generator(1))
    lstm.eval()
    np.testing.assert_array_equal(lstm(x)[0].numpy(), lstm(x)[0].numpy())
    lstm.train()
    assert not np.array_equal(lstm(x)[0].numpy(), lstm(x)[0].numpy())


def test_bad_inputs() -> None:
    lstm = nn.LSTM(3, 4)
    with pytest.raises(ConfigError, match="3-D"):
        lstm(rt.ones(2, 3))
    with pytest.raises(ConfigError, match=r"5 features.*expected 3"):
        lstm(rt.ones(2, 2, 5))
    with pytest.raises(ConfigError, match=r"initial state shapes"):
        lstm(rt.ones(2, 2, 3), (rt.zeros(1, 3, 4), rt.zeros(1, 3, 4)))


@pytest.fixture
def pool_everything(monkeypatch: pytest.MonkeyPatch) -> None:
    """Route every buffer of the fused layers, however small, through the pool."""
    monkeypatch.setattr(_buffers, "MIN_BYTES", 0)
    _buffers.clear()


def test_gradcheck_with_every_buffer_pooled(pool_everything: None) -> None:
    lstm = make("cpu", num_layers=3)
    x = leaf((4, 3, 3), "cpu", 6)
    h0, c0 = leaf((3, 3, 4), "cpu", 7), leaf((3, 3, 4), "cpu", 8)

    def run(*args: rt.Tensor) -> tuple[rt.Tensor, ...]:
        out, (h, c) = lstm(args[0], (args[1], args[2]))
        return out, h, c

    assert gradcheck(run, [x, h0, c0, *lstm.parameters()], atol=1e-7, rtol=1e-5)
    assert _buffers.statistics()["hits"] > 0


def grads_of(lstm: nn.LSTM, xs: list[np.ndarray], retain: bool) -> list[np.ndarray]:
    """Two graphs alive at once, then backward through each (twice with ``retain``)."""
    lstm.zero_grad()
    losses = []
    for k, arr in enumerate(xs):
        out, (h, c) = lstm(rt.tensor(arr))
        losses.append((out * out).sum() * (k + 1) + h.sum() - c.sum())
    for loss in losses:
        loss.backward(retain_graph=retain)
        if retain:
            loss.backward()
    return [p.grad.numpy().copy() for p in lstm.parameters() if p.grad is not None]


def test_pooled_buffers_are_not_shared_between_live_graphs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    lstm = make("cpu", num_layers=2)
    rng = np.random.default_rng(9)
    xs = [rng.normal(size=(6, 2, 3)) for _ in range(2)]
    monkeypatch.setattr(_buffers, "MIN_BYTES", 1 << 40)  # pool off: the reference
    want = [grads_of(lstm, xs, retain) for retain in (False, True)]
    monkeypatch.setattr(_buffers, "MIN_BYTES", 0)
    _buffers.clear()
    for _ in range(2):  # the second round runs on buffers the first gave back
        got = [grads_of(lstm, xs, retain) for retain in (False, True)]
        for g_want, g_got in zip(want, got):
            assert len(g_want) == len(g_got) == 8
            for a, b in zip(g_want, g_got):
                np.testing.assert_array_equal(a, b)
    assert _buffers.statistics()["hits"] > 0


def test_dropout_between_layers_composes_single_layers() -> None:
    lstm = nn.LSTM(3, 5, num_layers=2, dropout=0.4, generator=rt.Generator(5))
    x = rt.randn(6, 2, 3, generator=rt.Generator(6))
    h0, c0 = (
        rt.randn(2, 2, 5, generator=rt.Generator(7)),
        rt.randn(2, 2, 5, generator=rt.Generator(8)),
    )
    lstm.generator = rt.Generator(11)
    out, (h, c) = lstm(x, (h0, c0))
    layers = [nn.LSTM(3, 5), nn.LSTM(5, 5)]
    for k, single in enumerate(layers):
        for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"):
            getattr(single, f"{name}_l0").data[...] = getattr(lstm, f"{name}_l{k}").data
    gen = rt.Generator(11)
    mid, (h1, c1) = layers[0](x, (h0[0:1], c0[0:1]))
    want, (h2, c2) = layers[1](rt.dropout(mid, 0.4, generator=gen), (h0[1:2], c0[1:2]))
    np.testing.assert_allclose(out.numpy(), want.numpy(), rtol=1e-6)
    np.testing.assert_allclose(h.numpy(), np.concatenate([h1.numpy(), h2.numpy()]), rtol=1e-6)
    np.testing.assert_allclose(c.numpy(), np.concatenate([c1.numpy(), c2.numpy()]), rtol=1e-6)


def _received(arr: np.ndarray) -> tuple[rt.RecvFunction, rt.Tensor]:
    recv = rt.RecvFunction(1)
    (t,) = recv.make_outputs([arr])
    return recv, t


@pytest.mark.parametrize("case", ["input", "input+leaf state", "state, leaf input"])
def test_a_distributed_pass_sends_before_the_weights_and_runs_the_recurrence_once(
    case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In a pass that sends gradients on, the LSTM node hands what leaves the
    worker (a received input's or state's gradient) to the callback before
    it computes the weights' gradients, runs each layer's recurrence once
    for both parts, and every gradient equals a plain backward's."""
    from rpcdist.nn import _lstm

    rng = np.random.default_rng(12)
    x_arr, h_arr, c_arr = (rng.normal(size=s) for s in ((5, 2, 3), (2, 2, 4), (2, 2, 4)))
    lstm = make("cpu", num_layers=2)
    params = list(lstm.parameters())
    received_input = case != "state, leaf input"

    def loss_of(x: rt.Tensor, h0: rt.Tensor | None, c0: rt.Tensor | None) -> rt.Tensor:
        out, (h, c) = lstm(x, None if h0 is None else (h0, c0))  # type: ignore[arg-type]
        return (out * out).sum() + h.sum() - (c * c).sum()

    # The plain pass: every input a leaf, gradients in .grad.
    xl = rt.tensor(x_arr, requires_grad=True)
    hl, cl = rt.tensor(h_arr, requires_grad=True), rt.tensor(c_arr, requires_grad=True)
    loss_of(xl, hl if case != "input" else None, cl if case != "input" else None).backward()
    want = {p: p.grad.numpy().copy() for p in params}  # type: ignore[union-attr]
    lstm.zero_grad()

    calls: list[int] = []
    real = _lstm.gate_grads
    monkeypatch.setattr(_lstm, "gate_grads", lambda *a: calls.append(1) or real(*a))
    leaves: list[rt.Tensor] = []
    if received_input:
        recv, x = _received(x_arr)
        h0 = c0 = None
        if case == "input+leaf state":
            h0, c0 = rt.tensor(h_arr, requires_grad=True), rt.tensor(c_arr, requires_grad=True)
            leaves = [h0, c0]
    else:
        recv, h0 = _received(h_arr)
        c0 = rt.tensor(c_arr)
        x = rt.tensor(x_arr, requires_grad=True)
        leaves = [x]
    grads: dict[rt.Tensor, object] = {}
    seen: list[tuple[set[rt.Tensor], np.ndarray]] = []

    def callback(node: rt.Node, g: list[np.ndarray]) -> None:
        assert node is recv
        seen.append((set(grads), g[0]))

    loss = loss_of(x, h0, c0)
    edge = loss.gradient_edge()
    assert edge is not None
    task = rt.GraphTask([edge[0]], grad_map=grads, callback=callback, eager_leaves=True)
    task.execute(rt.tensor_roots([loss]))

    ((held, sent),) = seen
    assert not held & {*params, *leaves}
    assert len(calls) == 2  # one recurrence per layer, not one per part
    np.testing.assert_allclose(sent, (xl if received_input else hl).grad.numpy(), rtol=1e-12)  # type: ignore[union-attr]
    for p in params:
        np.testing.assert_allclose(grads[p], want[p], rtol=1e-12)
    for mine, plain in zip(leaves, [hl, cl] if received_input else [xl]):
        np.testing.assert_allclose(grads[mine], plain.grad.numpy(), rtol=1e-12)  # type: ignore[union-attr]


def test_a_split_pass_over_pooled_buffers_equals_an_unpooled_plain_pass(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every layer's gate gradients have one shape and wait, held, for the
    second part: the pool must not hand them out again meanwhile (a retained
    graph walked twice, on fresh buffers and on buffers given back)."""
    lstm = make("cpu", num_layers=3)
    x_arr = np.random.default_rng(13).normal(size=(4, 3, 3))

    def loss_of(x: rt.Tensor) -> rt.Tensor:
        out, (h, _) = lstm(x)
        return (out * out).sum() + h.sum()

    monkeypatch.setattr(_buffers, "MIN_BYTES", 1 << 40)  # pool off: the reference
    loss_of(rt.tensor(x_arr)).backward()
    want = {p: p.grad.numpy().copy() for p in lstm.parameters()}  # type: ignore[union-attr]
    monkeypatch.setattr(_buffers, "MIN_BYTES", 0)
    _buffers.clear()
    for _ in range(2):
        _, x = _received(x_arr)
        loss = loss_of(x)
        edge = loss.gradient_edge()
        assert edge is not None
        grads: dict[rt.Tensor, object] = {}
        for _ in range(2):
            task = rt.GraphTask(
                [edge[0]],
                grad_map=grads,
                callback=lambda n, g: None,
                eager_leaves=True,
                retain_graph=True,
            )
            task.execute(rt.tensor_roots([loss]))
        for p in lstm.parameters():
            np.testing.assert_allclose(grads[p], 2 * want[p], rtol=1e-12)
    assert _buffers.statistics()["hits"] > 0
