"""Arrays: zero copy where promised, correct bytes where not; CuPy and torch."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import textwrap
import threading
import types
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
from fake_cupy import FakeArray, install

from rpcdist._errors import SerializationError
from rpcdist._serialization import _arrays, decode, encode
from rpcdist._serialization._hooks import CodecHooks

from ._helpers import roundtrip, same


def _bytes_of(buffer: memoryview) -> np.ndarray[Any, Any]:
    return np.frombuffer(buffer, dtype=np.uint8)


@pytest.mark.parametrize(
    "array",
    [
        np.arange(10, dtype=np.float64),
        np.arange(12, dtype=">i4").reshape(3, 4),
        np.asfortranarray(np.ones((3, 2), dtype=np.complex64)),
        np.array(7, dtype=np.uint16),
    ],
    ids=["c", "big-endian", "fortran", "0-d"],
)
def test_encode_does_not_copy_contiguous_arrays(array: np.ndarray[Any, Any]) -> None:
    header, buffers = encode({"a": array})
    assert len(buffers) == 1
    assert np.shares_memory(_bytes_of(buffers[0]), array)
    assert same(decode(header, buffers)["a"], array)  # type: ignore[index]


def test_decode_views_writable_bytearray_buffers() -> None:
    header, buffers = encode(np.arange(6, dtype=np.int32).reshape(2, 3))
    storage = bytearray(buffers[0])
    out = decode(header, [memoryview(storage)])
    assert isinstance(out, np.ndarray)
    assert out.flags.writeable
    assert np.shares_memory(out, np.frombuffer(storage, dtype=np.uint8))
    out[1, 2] = 100
    assert np.frombuffer(storage, dtype=np.int32)[5] == 100


def test_decode_of_read_only_buffers_gives_read_only_arrays() -> None:
    header, buffers = encode(np.arange(3))
    out = decode(header, [bytes(buffers[0])])
    assert isinstance(out, np.ndarray) and not out.flags.writeable


@pytest.mark.parametrize(
    "view",
    [
        np.arange(20.0)[::2],
        np.arange(12).reshape(3, 4)[:, 1:3],
        np.arange(24, dtype=">f8").reshape(2, 3, 4).transpose(1, 0, 2),
        np.arange(5)[::-1],
    ],
)
def test_non_contiguous_arrays_arrive_contiguous_and_equal(view: np.ndarray[Any, Any]) -> None:
    out = roundtrip(view)
    assert isinstance(out, np.ndarray)
    assert out.flags.c_contiguous and out.dtype == view.dtype
    np.testing.assert_array_equal(out, view)


def test_arrays_share_one_buffer_list_in_order() -> None:
    a, b = np.zeros(3), np.ones((2, 2), dtype=np.int8)
    header, buffers = encode([a, (b, {"again": a})])
    assert [buf.nbytes for buf in buffers] == [24, 4, 24]
    out = decode(header, buffers)
    assert same(out, [a, (b, {"again": a})])


@pytest.mark.parametrize(
    "array",
    [np.array([object()]), np.array([("a", 1)], dtype=[("s", "U1"), ("i", "i4")])],
    ids=["object", "structured"],
)
def test_unsupported_dtypes_are_refused_with_their_place(array: np.ndarray[Any, Any]) -> None:
    with pytest.raises(SerializationError, match=r"type 'ndarray' at args\[1\]: arrays of dtype"):
        encode(({}, array), where="args")


def test_array_subclasses_are_refused() -> None:
    with pytest.raises(SerializationError, match="MaskedArray' at value: NumPy array subclasses"):
        encode(np.ma.masked_array([1, 2], mask=[0, 1]))


# ------------------------------------------------------------------- CuPy


@pytest.fixture
def fake_cupy(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    return install(monkeypatch)


def test_cupy_arrays_travel_as_host_buffers(fake_cupy: types.ModuleType) -> None:
    device = FakeArray(np.arange(6, dtype=np.float32).reshape(2, 3)[:, ::2])
    header, buffers = encode({"x": device})
    assert len(buffers) == 1
    out = decode(header, buffers)["x"]  # type: ignore[index]
    assert isinstance(out, FakeArray)
    assert same(out.host, np.ascontiguousarray(device.host))


def test_fortran_ordered_cupy_arrays_keep_their_order(fake_cupy: types.ModuleType) -> None:
    device = FakeArray(np.asfortranarray(np.arange(12.0).reshape(3, 4)))
    out = roundtrip(device)
    assert out.host.flags.f_contiguous and not out.host.flags.c_contiguous
    assert same(out.host, device.host)


def test_cupy_array_refused_where_cupy_is_missing(
    fake_cupy: types.ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    header, buffers = encode(FakeArray(np.zeros(2)))
    monkeypatch.setitem(sys.modules, "cupy", None)  # makes `import cupy` fail
    with pytest.raises(SerializationError, match="CuPy array, but cupy cannot be imported"):
        decode(header, buffers)


@pytest.mark.gpu
def test_real_cupy_round_trip() -> None:
    cupy = pytest.importorskip("cupy")
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            pytest.skip("no CUDA device")
    except Exception as exc:  # no driver
        pytest.skip(f"no CUDA device: {exc}")
    a = cupy.arange(12, dtype=cupy.float32).reshape(3, 4).T
    out = roundtrip({"a": a})["a"]  # type: ignore[index]
    assert isinstance(out, cupy.ndarray)
    assert out.device.id == cupy.cuda.Device().id
    assert bool((out == a).all()) and out.dtype == a.dtype and out.shape == a.shape


# ------------------------------------------------------------------ torch


@pytest.mark.torch
@pytest.mark.parametrize(
    "dtype",
    ["float32", "float64", "float16", "bfloat16", "int8", "int64", "uint8", "bool", "complex64"],
)
def test_torch_tensors_keep_dtype_shape_and_values(dtype: str) -> None:
    torch = pytest.importorskip("torch")
    t = (torch.arange(12) % 2).reshape(3, 4).to(getattr(torch, dtype))
    for value in (t, t.T, t[0, 0]):
        out = roundtrip(value)
        assert type(out) is torch.Tensor
        assert out.dtype == value.dtype and out.shape == value.shape
        assert torch.equal(out, value)


@pytest.mark.torch
def test_torch_encode_and_decode_are_zero_copy() -> None:
    torch = pytest.importorskip("torch")
    t = torch.arange(6, dtype=torch.float32, requires_grad=True)
    header, buffers = encode([t])
    assert np.shares_memory(_bytes_of(buffers[0]), t.detach().numpy())
    storage = bytearray(buffers[0])
    (out,) = decode(header, [memoryview(storage)])  # type: ignore[misc]
    assert out.requires_grad
    assert np.shares_memory(out.detach().numpy(), np.frombuffer(storage, dtype=np.uint8))


@pytest.mark.torch
def test_torch_parameters_stay_parameters() -> None:
    torch = pytest.importorskip("torch")
    p = torch.nn.Parameter(torch.ones(2, 2))
    out = roundtrip(p)
    assert isinstance(out, torch.nn.Parameter) and out.requires_grad
    assert torch.equal(out, p)


def _with_device(header: bytes, device: object) -> bytes:
    """A tensor's header as a sender on ``device`` writes it (10 fields)."""
    items = msgpack.unpackb(header, raw=False, strict_map_key=False)
    return msgpack.packb([*items, -1, device], use_bin_type=True)


@pytest.mark.torch
def test_a_cuda_tensor_reaching_a_worker_without_cuda_is_a_clear_error() -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    header, buffers = encode(torch.ones(3))
    with pytest.raises(SerializationError, match="cuda:1, but this worker has no CUDA device"):
        decode(_with_device(header, "cuda:1"), buffers)
    for bad in ("cpu", 3):
        with pytest.raises(SerializationError, match="malformed tensor payload"):
            decode(_with_device(header, bad), buffers)


@pytest.mark.torch
@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
def test_tensors_of_other_layouts_are_refused_naming_the_layout() -> None:
    # (sparse COO tensors travel once rpcdist.torch is imported: tests/torch_interop)
    torch = pytest.importorskip("torch")
    with pytest.raises(SerializationError, match="layout torch.sparse_csr cannot be sent"):
        encode({"t": torch.eye(2).to_sparse_csr()})


def test_encoding_never_imports_torch_or_cupy() -> None:
    code = (
        "import sys, numpy as np\n"
        "from rpcdist._serialization import encode, decode\n"
        "h, b = encode([np.arange(3), {'a': (1, 2.5)}])\n"
        "decode(h, b)\n"
        "assert 'torch' not in sys.modules and 'cupy' not in sys.modules, 'imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


class _StubIpcHook:
    """Stands in for CUDA IPC on the receiving side: hands back a host array."""

    min_bytes = 0

    def __init__(self, array: np.ndarray[Any, Any]) -> None:
        self.array = array
        self.fields: list[Any] = []

    def lend(self, context: object, array: Any) -> None:
        return None

    def take(self, context: object, fields: list[Any], shape: Any, dtype: Any, out: Any) -> Any:
        self.fields = fields
        out[...] = self.array.reshape(shape).astype(dtype)
        return out


@pytest.mark.torch
@pytest.mark.parametrize("n_fields", [6, 7])
def test_a_tensor_sent_by_cuda_ipc_gives_the_hook_every_field_after_its_device(
    fake_cupy: types.ModuleType, monkeypatch: pytest.MonkeyPatch, n_fields: int
) -> None:
    """The tensor decoder leaves the CUDA IPC fields to the hook, however many
    there are (it once expected five after CUDA IPC's lend had grown to six,
    and refused every CUDA tensor sent by handle: found on a GPU), and has it
    copy straight into the tensor it returns."""
    torch = pytest.importorskip("torch")
    hook = _StubIpcHook(np.arange(6, dtype=np.float32))
    context = types.SimpleNamespace(codec_hooks=CodecHooks())  # (an agent's message)
    context.codec_hooks.set_cupy_ipc(hook)
    fake_cupy.cuda = types.SimpleNamespace(Device=lambda index: contextlib.nullcontext())  # type: ignore[attr-defined]

    def cpu_empty(torch: Any, cupy: Any, shape: Any, dtype: Any, wire: Any, index: int) -> Any:
        tensor = torch.empty(shape, dtype=dtype)  # (the tensor and a view to fill)
        return tensor, tensor.numpy().view(wire)

    monkeypatch.setattr(_arrays, "_cuda_empty", cpu_empty)
    header, buffers = encode(torch.zeros(2, 3))
    items = msgpack.unpackb(header, raw=False, strict_map_key=False)
    fields = [f"field{i}" for i in range(n_fields)]
    # as a sender on cuda:0 writes it: no buffer, then the index, device, fields
    items[1:5] = [np.dtype(np.float32).str, [2, 3], -1, 0]
    ipc_header = msgpack.packb([*items, -1, "cuda:0", *fields], use_bin_type=True)
    out = decode(ipc_header, [], context=context)
    assert hook.fields == fields
    assert isinstance(out, torch.Tensor) and out.shape == (2, 3)
    assert torch.equal(out, torch.arange(6, dtype=torch.float32).reshape(2, 3))
    items[1] = np.dtype(np.float16).str  # 2-byte elements for a 4-byte dtype
    bad = msgpack.packb([*items, -1, "cuda:0", *fields], use_bin_type=True)
    with pytest.raises(SerializationError, match="float16 data for a torch.float32 tensor"):
        decode(bad, [], context=context)


def test_a_module_another_thread_is_importing_is_waited_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A decoder that needs CuPy while another thread is still importing it
    waits for that import instead of using the half-made module (which failed
    on a GPU: "partially initialized module 'cupy' has no attribute 'asarray'")."""
    gate = types.ModuleType("rpcdist_test_gate")
    gate.started = threading.Event()  # type: ignore[attr-defined]
    gate.release = threading.Event()  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "rpcdist_test_gate", gate)
    (tmp_path / "rpcdist_test_slow.py").write_text(
        textwrap.dedent(
            """
            import rpcdist_test_gate as gate
            gate.started.set()
            assert gate.release.wait(30)
            ready = True
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "rpcdist_test_slow", raising=False)
    importer = threading.Thread(target=__import__, args=("rpcdist_test_slow",))
    importer.start()
    seen: list[object] = []
    try:
        assert gate.started.wait(30)
        user = threading.Thread(
            target=lambda: seen.append(
                getattr(_arrays._import("rpcdist_test_slow", "a test"), "ready", None)
            )
        )
        user.start()
        user.join(0.5)  # (a chance to return early, with the half-made module)
    finally:
        gate.release.set()
        importer.join(30)
    user.join(30)
    assert seen == [True]
    sys.modules.pop("rpcdist_test_slow", None)
