"""``rpcdist._save``: state dicts to ``.npz`` and back, without pickle."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest

import rpcdist.tensor as rt
from rpcdist import SerializationError, nn
from rpcdist._save import load, save
from rpcdist.optim import Adam


def test_module_state_dict_round_trip(tmp_path: Path) -> None:
    a = nn.LSTM(3, 4, num_layers=2, generator=rt.Generator(0))
    path = tmp_path / "model.npz"
    save(a.state_dict(), path)
    raw = np.load(path, allow_pickle=False)  # an ordinary npz, no pickle needed
    assert "__rpcdist__" in raw.files
    b = nn.LSTM(3, 4, num_layers=2, generator=rt.Generator(1))
    b.load_state_dict(load(path))
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert na == nb
        np.testing.assert_array_equal(pa.numpy(), pb.numpy())


def test_nested_optimizer_state_round_trip() -> None:
    p = nn.Parameter(rt.ones(3))
    opt = Adam([p], lr=0.1, amsgrad=True)
    opt.step(grads=[np.array([1.0, 2.0, 3.0], dtype=np.float32)])
    sd = opt.state_dict()
    buf = io.BytesIO()
    save(sd, buf)
    buf.seek(0)
    back = load(buf)
    assert back["param_groups"][0]["betas"] == (0.9, 0.999)
    assert back["param_groups"][0]["params"] == [0]
    assert back["state"][0]["step"] == 1
    np.testing.assert_array_equal(back["state"][0]["exp_avg"], sd["state"][0]["exp_avg"])
    opt2 = Adam([nn.Parameter(rt.ones(3))], lr=0.5)
    opt2.load_state_dict(back)
    assert opt2.param_groups[0]["lr"] == 0.1


def test_scalars_tensors_and_none(tmp_path: Path) -> None:
    obj = {"a": rt.tensor([1.0, 2.0]), "b": [None, True, 3, 2.5, "x"], "c": np.float32(1.5), 7: ()}
    save(obj, tmp_path / "x.npz")
    back = load(tmp_path / "x.npz")
    np.testing.assert_array_equal(back["a"], [1.0, 2.0])
    assert back["b"] == [None, True, 3, 2.5, "x"] and back[7] == ()
    assert back["c"] == np.float32(1.5) and back["c"].dtype == np.float32


def test_unsavable_and_foreign_files(tmp_path: Path) -> None:
    with pytest.raises(SerializationError, match="object"):
        save({"x": np.array([object()])}, tmp_path / "a.npz")
    with pytest.raises(SerializationError, match="set"):
        save({"x": {1, 2}}, tmp_path / "a.npz")
    assert not (tmp_path / "a.npz").exists()
    np.savez(tmp_path / "plain.npz", x=np.zeros(2))
    with pytest.raises(SerializationError, match="not an rpcdist"):
        load(tmp_path / "plain.npz")
    np.save(tmp_path / "obj.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(SerializationError):
        load(tmp_path / "obj.npy")
