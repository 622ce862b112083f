"""Module bookkeeping a user relies on without thinking: what assignment
registers or refuses, state dicts that do not fit, modes, casts, and the
small layers (Sigmoid, GELU, Identity, Sequential.append)."""

from __future__ import annotations

import numpy as np
import pytest

import rpcdist.tensor as rt
from rpcdist import ConfigError, nn
from rpcdist.nn import functional as F


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 2, dtype=np.float64, generator=rt.Generator().manual_seed(0))
        self.register_buffer("steps", rt.zeros(1, dtype=rt.float64))

    def forward(self, x: rt.Tensor) -> rt.Tensor:
        return self.fc(x)


def test_assignment_registers_or_refuses_by_kind() -> None:
    net = Net()
    with pytest.raises(ConfigError, match="cannot assign ndarray to parameter 'weight'"):
        net.fc.weight = np.zeros((2, 3))
    net.fc.bias = None  # a declared parameter may be absent
    assert [n for n, _ in net.named_parameters()] == ["fc.weight"]
    with pytest.raises(ConfigError, match="buffer 'steps' must be a Tensor or None"):
        net.steps = 3
    net.steps = rt.ones(1, dtype=rt.float64)
    assert net.state_dict()["steps"].tolist() == [1.0]
    net.fc = None
    assert list(net.parameters()) == [] and list(net.named_modules()) == [("", net)]
    del net.steps
    assert "steps" not in net.state_dict()


def test_a_module_without_forward_says_so() -> None:
    class Empty(nn.Module):
        pass

    with pytest.raises(NotImplementedError, match="Empty does not define forward"):
        Empty()(rt.ones(1))


def test_load_state_dict_takes_tensors_arrays_and_lists_and_names_misfits() -> None:
    src, dst = Net(), Net()
    with rt.no_grad():
        src.fc.weight.fill_(0.5)
    state = {
        "fc.weight": rt.tensor(src.fc.weight.numpy()),
        "fc.bias": [1.0, -1.0],
        "steps": np.array([4.0]),
    }
    assert tuple(dst.load_state_dict(state)) == ([], [])
    assert dst.fc.weight.numpy().tolist() == [[0.5] * 3] * 2
    assert dst.fc.bias.numpy().tolist() == [1.0, -1.0]
    with pytest.raises(
        ConfigError, match=r"'fc.bias' has shape \(3,\) in the state dict but \(2,\)"
    ):
        dst.load_state_dict({**state, "fc.bias": np.zeros(3)})
    with pytest.raises(ConfigError, match=r"missing keys \['steps'\], unexpected keys \['extra'\]"):
        dst.load_state_dict(
            {"fc.weight": state["fc.weight"], "fc.bias": [0.0, 0.0], "extra": [1.0]}
        )
    keys = dst.load_state_dict({"fc.bias": [2.0, 2.0], "extra": [1.0]}, strict=False)
    assert keys.missing_keys == ["fc.weight", "steps"] and keys.unexpected_keys == ["extra"]
    assert dst.fc.bias.numpy().tolist() == [2.0, 2.0]


def test_modes_grads_apply_and_casts() -> None:
    net = Net()
    net.fc(rt.ones(4, 3, dtype=rt.float64)).sum().backward()
    net.zero_grad(set_to_none=False)
    assert net.fc.weight.grad is not None and not net.fc.weight.grad.numpy().any()
    net.zero_grad()
    assert net.fc.weight.grad is None
    seen: list[str] = []
    assert net.apply(lambda m: seen.append(type(m).__name__)) is net
    assert seen == ["Linear", "Net"]  # children first
    assert not net.eval().fc.training and net.train().fc.training
    net.fc(rt.ones(1, 3, dtype=rt.float64)).sum().backward()
    assert net.to(dtype=np.float32) is net
    assert net.fc.weight.dtype == np.float32 and net.steps.dtype == np.float32
    assert net.fc.weight.grad is None  # a cast drops gradients of the old dtype


def test_small_layers_match_their_functions() -> None:
    x = rt.tensor(np.linspace(-3, 3, 7))
    np.testing.assert_allclose(nn.Sigmoid()(x).numpy(), 1 / (1 + np.exp(-x.numpy())))
    for approx in ("none", "tanh"):
        np.testing.assert_allclose(nn.GELU(approx)(x).numpy(), F.gelu(x, approx).numpy())
    assert nn.Identity()(x) is x
    seq = nn.Sequential(nn.Identity())
    assert seq.append(nn.Sigmoid()) is seq and len(list(seq.children())) == 2
    np.testing.assert_allclose(seq(x).numpy(), nn.Sigmoid()(x).numpy())
    assert "p=0.25" in repr(nn.Dropout(0.25)) and "10, 4" in repr(nn.Embedding(10, 4))
    assert repr(nn.Linear(2, 2).weight).startswith("Parameter containing:")


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: nn.Linear(0, 3), "Linear: sizes must be positive, got 0, 3"),
        (lambda: nn.Embedding(5, 2, padding_idx=5), "Embedding: padding_idx 5 out of range"),
        (lambda: nn.Dropout(1.0), r"Dropout: p must be in \[0, 1\), got 1.0"),
    ],
    ids=["linear", "embedding", "dropout"],
)
def test_layer_arguments_are_checked(make, message) -> None:
    with pytest.raises(ConfigError, match=message):
        make()
