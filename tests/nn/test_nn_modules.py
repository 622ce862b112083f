"""Module registration, state dicts, modes, layers' initialisation."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import rpcdist.tensor as rt
from rpcdist import ConfigError, nn
from rpcdist.nn import functional as F


class Block(nn.Module):
    def __init__(self, gen: rt.Generator) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 8, generator=gen)
        self.act = nn.Tanh()
        self.fc2 = nn.Linear(8, 2, generator=gen)
        self.scale = nn.Parameter(rt.ones(2))
        self.register_buffer("running", rt.zeros(2))

    def forward(self, x: rt.Tensor) -> rt.Tensor:
        return self.fc2(self.act(self.fc1(x))) * self.scale


def test_registration_and_traversal() -> None:
    m = Block(rt.Generator(0))
    names = [n for n, _ in m.named_parameters()]
    assert names == ["scale", "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    assert [type(c).__name__ for c in m.children()] == ["Linear", "Tanh", "Linear"]
    assert len(list(m.modules())) == 4
    assert [n for n, _ in m.named_buffers()] == ["running"]
    assert set(m.state_dict()) == {*names, "running"}
    assert all(isinstance(p, nn.Parameter) and p.requires_grad for p in m.parameters())
    assert nn.Parameter.__module__ == "rpcdist.nn"


def test_shared_parameters_listed_once() -> None:
    lin = nn.Linear(3, 3)
    seq = nn.Sequential(lin, nn.ReLU(), lin)
    assert len(list(seq.parameters())) == 2
    assert len(seq) == 3 and seq[0] is lin and seq[-1] is lin
    assert [type(m).__name__ for m in seq] == ["Linear", "ReLU", "Linear"]


def test_assignment_rules() -> None:
    class Bad(nn.Module):
        def __init__(self) -> None:
            self.w = nn.Parameter(rt.ones(1))

    with pytest.raises(ConfigError, match="super"):
        Bad()
    lin = nn.Linear(2, 2)
    with pytest.raises(ConfigError, match="Parameter"):
        lin.weight = rt.ones(2, 2)  # type: ignore[assignment]
    lin.bias = None
    assert [n for n, _ in lin.named_parameters()] == ["weight"]
    assert nn.Linear(2, 2, bias=False).bias is None


def test_state_dict_round_trip() -> None:
    a, b = Block(rt.Generator(1)), Block(rt.Generator(2))
    x = rt.randn(5, 4, generator=rt.Generator(3))
    assert not np.allclose(a(x).numpy(), b(x).numpy())
    sd = a.state_dict()
    assert all(isinstance(v, np.ndarray) for v in sd.values())
    sd["fc1.weight"][...] = sd["fc1.weight"]  # a copy: editing it leaves a alone
    b.load_state_dict(sd)
    np.testing.assert_array_equal(a(x).numpy(), b(x).numpy())
    sd["fc1.bias"] += 1
    assert not np.allclose(a.fc1.bias.numpy(), sd["fc1.bias"])  # type: ignore[union-attr]


def test_load_state_dict_errors() -> None:
    m = Block(rt.Generator(0))
    sd = m.state_dict()
    del sd["fc2.bias"]
    sd["extra"] = np.zeros(1)
    with pytest.raises(
        ConfigError, match=r"missing keys \['fc2.bias'\].*unexpected keys \['extra'\]"
    ):
        m.load_state_dict(sd)
    keys = m.load_state_dict(sd, strict=False)
    assert keys.missing_keys == ["fc2.bias"] and keys.unexpected_keys == ["extra"]
    bad = m.state_dict()
    bad["fc1.weight"] = np.zeros((3, 3))
    with pytest.raises(ConfigError, match=r"fc1.weight.*\(3, 3\).*\(8, 4\)"):
        m.load_state_dict(bad)


def test_train_eval_and_dropout() -> None:
    m = nn.Sequential(nn.Linear(10, 10), nn.Dropout(0.5, generator=rt.Generator(0)))
    x = rt.ones(4, 10)
    assert m.training and all(mod.training for mod in m.modules())
    m.eval()
    assert not any(mod.training for mod in m.modules())
    np.testing.assert_array_equal(m(x).numpy(), m(x).numpy())
    m.train()
    assert (m(x).numpy() == 0).any()


def test_zero_grad_and_to_dtype() -> None:
    m = nn.Linear(3, 2)
    F.mse_loss(m(rt.ones(4, 3)), rt.zeros(4, 2)).backward()
    assert m.weight.grad is not None
    m.zero_grad(set_to_none=False)
    assert m.weight.grad is not None and not m.weight.grad.numpy().any()
    m.zero_grad()
    assert m.weight.grad is None
    m.to(dtype=np.float64)
    assert m.weight.dtype == np.float64 and m(rt.ones(1, 3, dtype=rt.float64)).dtype == np.float64


def test_linear_initialisation_matches_pytorch_rule() -> None:
    a = nn.Linear(50, 40, generator=rt.Generator(7))
    b = nn.Linear(50, 40, generator=rt.Generator(7))
    np.testing.assert_array_equal(a.weight.numpy(), b.weight.numpy())
    bound = 1 / np.sqrt(50)
    w = a.weight.numpy()
    assert a.weight.dtype == np.float32
    assert np.abs(w).max() <= bound and np.abs(w).max() > 0.9 * bound
    assert abs(w.std() - bound / np.sqrt(3)) < 0.1 * bound  # uniform(-b, b) has std b/sqrt(3)
    assert a.bias is not None and np.abs(a.bias.numpy()).max() <= bound


def test_embedding_padding_and_repeated_indices() -> None:
    emb = nn.Embedding(5, 3, padding_idx=0, generator=rt.Generator(0))
    assert not emb.weight.numpy()[0].any()
    idx = rt.tensor([[1, 1, 0], [4, 1, 2]])
    out = emb(idx)
    assert out.shape == (2, 3, 3)
    out.sum().backward()
    assert emb.weight.grad is not None
    counts = np.array([0, 3, 1, 0, 1], dtype=np.float32)  # padding row gets nothing
    np.testing.assert_array_equal(emb.weight.grad.numpy(), np.repeat(counts[:, None], 3, 1))
    with pytest.raises(ConfigError, match=r"embedding.*integers"):
        emb(rt.tensor([0.5]))


def test_repr_shows_structure() -> None:
    text = repr(nn.Sequential(nn.Linear(2, 3), nn.ReLU()))
    assert "Sequential(" in text and "(0): Linear(in_features=2, out_features=3, bias=True)" in text


def test_module_public_api_documented() -> None:
    for name in nn.__all__:
        obj: Any = getattr(nn, name)
        assert obj.__doc__, name
        if isinstance(obj, type):
            assert obj.__module__ == "rpcdist.nn", name
    # isort-style order, as ruff keeps it: CONSTANTS, Classes, functions
    style = sorted(nn.__all__, key=lambda n: (not n.isupper(), not n[0].isupper(), n))
    assert nn.__all__ == style


def test_module_to_device_matches_cpu(device: str) -> None:
    cpu = nn.Sequential(nn.Linear(4, 6, generator=rt.Generator(0)), nn.Tanh(), nn.Linear(6, 2))
    moved = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))
    moved.load_state_dict(cpu.state_dict())
    moved.to(device)
    assert all(p.device == device for p in moved.parameters())
    x = rt.randn(3, 4, generator=rt.Generator(1))
    F.mse_loss(cpu(x), rt.zeros(3, 2)).backward()
    F.mse_loss(moved(x.to(device)), rt.zeros(3, 2, device=device)).backward()
    for (name, a), (_, b) in zip(cpu.named_parameters(), moved.named_parameters()):
        assert a.grad is not None and b.grad is not None and b.grad.device == device
        np.testing.assert_allclose(
            a.grad.numpy(), b.grad.numpy(), rtol=1e-5, atol=1e-6, err_msg=name
        )
