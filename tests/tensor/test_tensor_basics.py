"""Tensor construction, conversion, factories, randomness, errors and the public API."""

from __future__ import annotations

import inspect
import math
from typing import Any

import numpy as np
import pytest

import rpcdist.tensor as rt
from rpcdist import AutogradError, ConfigError
from rpcdist.tensor._special import _erf_fallback


def test_factories_dtypes_and_shapes(device: str) -> None:
    assert rt.tensor([1.0, 2.0], device=device).dtype == np.float32
    assert rt.tensor([1, 2], device=device).dtype == np.int64
    assert rt.tensor(np.zeros(2), device=device).dtype == np.float64
    assert rt.zeros(2, 3, device=device).shape == (2, 3)
    assert rt.ones((4,), dtype=rt.float64, device=device).dtype == np.float64
    assert rt.full((2, 2), 7.0, device=device).numpy().tolist() == [[7.0, 7.0], [7.0, 7.0]]
    assert rt.arange(5, device=device).numpy().tolist() == [0, 1, 2, 3, 4]
    assert rt.arange(0, 1, 0.25).dtype == np.float32
    assert rt.zeros_like(rt.ones(3, dtype=rt.float64)).dtype == np.float64
    assert rt.ones_like(rt.zeros(2, 2)).numpy().sum() == 4
    t = rt.tensor([[1.0, 2.0]], device=device)
    assert t.device == device and t.ndim == 2 and t.numel() == 2 and len(t) == 1
    assert t.size() == (1, 2) and t.size(1) == 2 and t.dim() == 2


def test_from_numpy_shares_memory_and_tensor_copies() -> None:
    arr = np.zeros(3, dtype=np.float32)
    shared = rt.from_numpy(arr)
    copied = rt.tensor(arr)
    arr[0] = 5
    assert shared.numpy()[0] == 5 and copied.numpy()[0] == 0


def test_item_numpy_tolist_repr() -> None:
    t = rt.tensor([[2.5]])
    assert t.item() == 2.5 and float(t) == 2.5 and t.tolist() == [[2.5]]
    assert isinstance(t.numpy(), np.ndarray)
    with pytest.raises(ConfigError, match="3 elements"):
        rt.ones(3).item()
    assert "requires_grad=True" in repr(rt.ones(2, requires_grad=True))
    assert "grad_fn=<MulBackward>" in repr(rt.ones(2, requires_grad=True) * 2)
    np.testing.assert_array_equal(np.asarray(rt.ones(2)), [1.0, 1.0])


def test_generators_are_seeded_and_independent() -> None:
    a = rt.randn(3, 4, generator=rt.Generator(123)).numpy()
    b = rt.randn(3, 4, generator=rt.Generator(123)).numpy()
    c = rt.randn(3, 4, generator=rt.Generator(124)).numpy()
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    u = rt.rand(1000, generator=rt.Generator(0)).numpy()
    assert u.dtype == np.float32 and u.min() >= 0.0 and u.max() < 1.0
    rt.manual_seed(5)
    first = rt.randn(4).numpy()
    rt.manual_seed(5)
    assert np.array_equal(first, rt.randn(4).numpy())
    gen = rt.Generator(9)
    state = gen.get_state()
    x = gen.normal((3,))
    gen.set_state(state)
    assert np.array_equal(x, gen.normal((3,)))


def test_dropout_is_seeded_and_scaled() -> None:
    x = rt.ones(1000)
    a = rt.dropout(x, 0.3, generator=rt.Generator(1)).numpy()
    b = rt.dropout(x, 0.3, generator=rt.Generator(1)).numpy()
    assert np.array_equal(a, b)
    np.testing.assert_allclose(np.unique(a), [0.0, 1 / 0.7], rtol=1e-6)
    assert 0.2 < (a == 0).mean() < 0.4
    assert rt.dropout(x, 0.3, training=False) is x
    with pytest.raises(ConfigError, match="dropout"):
        rt.dropout(x, 1.0)


def test_comparisons_and_argmax() -> None:
    t = rt.tensor([[1.0, 5.0, 3.0], [7.0, 0.0, 2.0]])
    assert (t > 2.0).numpy().tolist() == [[False, True, True], [True, False, False]]
    assert t.argmax(1).numpy().tolist() == [1, 0]
    assert (t.argmax(axis=1) == rt.tensor([1, 1])).numpy().tolist() == [True, False]


def test_to_device_cpu_is_identity_and_astype() -> None:
    t = rt.ones(2, requires_grad=True)
    assert t.to("cpu") is t and t.cpu() is t
    d = t.astype(np.float64)
    assert d.dtype == np.float64 and d.requires_grad
    d.sum().backward()
    assert t.grad is not None and t.grad.dtype == np.float32
    with pytest.raises(ConfigError, match="unknown device"):
        t.to("tpu")


@pytest.mark.gpu
def test_to_cuda_and_back_with_gradient() -> None:
    if not rt.cuda_is_available():
        pytest.skip("CuPy or a CUDA device is not available")
    x = rt.tensor([1.0, 2.0], requires_grad=True)
    y = x.to("cuda:0")
    assert y.device == "cuda:0"
    (y * y).sum().backward()
    assert x.grad is not None and x.grad.device == "cpu"
    np.testing.assert_allclose(x.grad.numpy(), [2.0, 4.0])
    with pytest.raises(ConfigError, match=r"cpu.*cuda:0|cuda:0.*cpu"):
        x + y


def test_shape_mismatch_names_op_and_shapes() -> None:
    a, b = rt.ones(2, 3), rt.ones(4, 5)
    with pytest.raises(ConfigError, match=r"add.*\(2, 3\).*\(4, 5\)"):
        a + b
    with pytest.raises(ConfigError, match=r"matmul.*\(2, 3\).*\(4, 5\)"):
        a @ b
    with pytest.raises(ConfigError, match=r"reshape.*\(2, 3\)"):
        a.reshape(4, 2)
    with pytest.raises(ConfigError, match="cat"):
        rt.cat([a, b])
    with pytest.raises(ConfigError, match="split"):
        a.split([1, 1], dim=1)


def test_wrong_dtypes_are_rejected() -> None:
    with pytest.raises(ConfigError, match=r"matmul.*float32.*float64"):
        rt.ones(2, 2) @ rt.ones(2, 2, dtype=rt.float64)
    with pytest.raises(ConfigError, match="integer or boolean"):
        rt.ones(3)[np.array([0.5])]
    with pytest.raises(ConfigError, match="boolean"):
        rt.where(rt.ones(2), rt.ones(2), rt.zeros(2))


class _FakeGpuArray:
    """Just enough of a CuPy array for the device check (no GPU needed)."""

    __module__ = "cupy._core.core"

    class _Dev:
        id = 0

    def __init__(self, shape: tuple[int, ...]) -> None:
        self.shape = shape
        self.dtype = np.dtype(np.float32)
        self.device = self._Dev()
        self.ndim = len(shape)


def test_mixing_devices_names_op_and_devices() -> None:
    cpu = rt.ones(2, 3)
    gpu = rt.Tensor._wrap(_FakeGpuArray((2, 3)))
    with pytest.raises(ConfigError, match=r"mul: .*one device.*device=cpu.*device=cuda:0"):
        cpu * gpu
    with pytest.raises(ConfigError, match=r"matmul: .*one device"):
        gpu @ cpu


def test_erf_fallback_matches_math() -> None:
    x = np.linspace(-7, 7, 2001)
    ref = np.array([math.erf(v) for v in x])
    np.testing.assert_allclose(_erf_fallback(np, x), ref, rtol=1e-13, atol=1e-15)
    assert _erf_fallback(np, x.astype(np.float32)).dtype == np.float32


def test_public_api_is_documented_and_public() -> None:
    for name in rt.__all__:
        obj: Any = getattr(rt, name)
        if isinstance(obj, np.dtype):
            continue
        assert inspect.getdoc(obj), name
        assert obj.__module__ == "rpcdist.tensor", (name, obj.__module__)
    assert rt.__all__ == sorted(rt.__all__)


def test_requires_grad_on_int_raises_autograd_error() -> None:
    with pytest.raises(AutogradError, match="int64"):
        rt.Tensor(np.arange(3), requires_grad=True)
