"""Arrays travel out-of-band: NumPy arrays and scalars, CuPy arrays, torch tensors.

An array's header fields are ``[dtype.str, shape, buffer index, order]``; its
bytes are one out-of-band buffer, a zero-copy view of C-contiguous (or
Fortran-contiguous, ``order`` 1) data. torch is never imported to encode: a
value can only be a tensor if torch is already loaded; CuPy is imported to
encode only a CUDA tensor, and only for an agent with a CUDA IPC hook.

CuPy arrays and CUDA tensors travel through host memory and are put back on a
device at the receiver (CUDA tensors on the same device index as the sender's),
unless the agent's CUDA IPC hook (``rpcdist._device._cuda_ipc``, see
``_hooks``) lends them by handle to a worker of the same host: a CuPy array's fields are then
``[dtype.str, shape, order, *the hook's fields]``, and a CUDA tensor's buffer
index is -1 with the hook's fields after its device.
"""

from __future__ import annotations

import importlib
import math
import re
import sys
from typing import Any, Final

import numpy as np

from .._errors import SerializationError
from ._extensions import (
    CUPY,
    FINDERS,
    MARKS,
    NDARRAY,
    NPDTYPE,
    NPSCALAR,
    TENSOR,
    DecodeState,
    EncodeState,
    Handler,
    Unsupported,
    define,
)
from ._hooks import CupyIpcHook, TensorGradHook, hooks_of

__all__: list[str] = []

_KINDS: Final = frozenset("biufcmMSU")
#: What ``dtype.str`` looks like for those kinds ('<f4', '|S3', '<M8[ns]'):
#: anything else from the wire is refused before NumPy parses it (its
#: deprecated aliases warn, and it accepts record and sub-array syntax).
_DTYPE_TEXT: Final = re.compile(r"[<>|=][biufcmMSU][0-9]{1,9}(\[[0-9]{0,9}[a-zA-Z]{1,7}\])?")
_MAX_DIMS: Final = 64
_dtypes: dict[str, np.dtype[Any]] = {}


#: The dtypes arrays may be sent in, with their wire names (filled as met).
_SENDABLE: dict[np.dtype[Any], str] = {}


def _array_fields(state: EncodeState, array: np.ndarray[Any, Any]) -> list[Any]:
    """Append ``array``'s bytes as a buffer; return its header fields."""
    dtype = array.dtype
    name = _SENDABLE.get(dtype)
    if name is None:
        if dtype.kind not in _KINDS or dtype.fields is not None or dtype.subdtype is not None:
            raise Unsupported(
                f"arrays of dtype {dtype} cannot be sent (only bool, integer, floating, "
                "complex, datetime64, timedelta64 and fixed-size string dtypes)"
            )
        name = dtype.str
        if len(_SENDABLE) < 256:  # (bounded, as ``_dtypes``: string dtypes are many)
            _SENDABLE[dtype] = name
    try:  # (the fast way to C-contiguous bytes: a small array's cost is in such calls)
        view = memoryview(array)  # type: ignore[arg-type]  # (NumPy's stubs lack __buffer__)
    except (TypeError, ValueError):  # datetime64 and timedelta64 export no buffer
        view = None
    if view is not None and view.c_contiguous and view.nbytes:  # (cast refuses empty ones)
        index = state.add_buffer(view.cast("B"))
        return [name, list(array.shape), index, 0]
    data, order = _contiguous(array, np.ascontiguousarray)
    index = state.add_buffer(data.reshape(-1).view(np.uint8).data)
    return [name, list(array.shape), index, order]


def _check_shape(shape: object, order: object, what: str) -> None:
    if (
        type(shape) is not list
        or len(shape) > _MAX_DIMS
        or not all(type(n) is int and n >= 0 for n in shape)
        or order not in (0, 1)
        or type(order) is not int
    ):
        raise SerializationError(f"malformed {what} payload: bad shape or order")


def _contiguous(array: Any, copy: Any) -> tuple[Any, int]:
    """``array`` as C-contiguous data and its order: 0, or 1 for Fortran order
    (the data is then its transpose); ``copy`` makes a C-contiguous copy."""
    if array.flags.c_contiguous:
        return array, 0
    if array.flags.f_contiguous:
        return array.T, 1
    return copy(array), 0


def _dtype(text: object) -> np.dtype[Any]:
    if type(text) is not str:
        raise SerializationError(f"malformed array payload: bad dtype {text!r}")
    dtype = _dtypes.get(text)
    if dtype is not None:
        return dtype
    if _DTYPE_TEXT.fullmatch(text) is None:
        raise SerializationError(f"malformed array payload: bad dtype {text!r}")
    try:
        dtype = np.dtype(text)
    except Exception as exc:
        raise SerializationError(f"malformed array payload: bad dtype {text!r}") from exc
    if (
        dtype.kind not in _KINDS
        or dtype.fields is not None
        or dtype.subdtype is not None
        or dtype.itemsize == 0
    ):
        raise SerializationError(f"malformed array payload: dtype {text!r} is not allowed")
    if len(_dtypes) < 256:
        _dtypes[text] = dtype
    return dtype


def _array_from_fields(state: DecodeState, fields: list[Any]) -> np.ndarray[Any, Any]:
    """Rebuild an array from ``[dtype, shape, index, order]`` over its buffer (no copy)."""
    text, shape, index, order = fields
    dtype = _dtype(text)
    _check_shape(shape, order, "array")
    view = state.take_buffer(index)
    count = math.prod(shape)
    if count * dtype.itemsize != view.nbytes:
        raise SerializationError(
            f"out-of-band buffer {index} has {view.nbytes} bytes, but a {dtype} array of "
            f"shape {tuple(shape)} needs {count * dtype.itemsize}"
        )
    flat = np.frombuffer(view, dtype=dtype, count=count)
    if order:
        return flat.reshape(shape[::-1]).T
    return flat if len(shape) == 1 else flat.reshape(shape)


def _encode_dtype(state: EncodeState, obj: np.dtype[Any]) -> list[Any]:
    # (a dtype as a value, ``np.empty(n, dtype)``'s argument: those arrays may have)
    if obj.kind not in _KINDS or obj.fields is not None or obj.subdtype is not None:
        raise Unsupported(f"NumPy dtype {obj} cannot be sent (only the dtypes arrays may have)")
    return [MARKS[NPDTYPE], obj.str]


def _decode_dtype(state: DecodeState, items: list[Any]) -> object:
    if len(items) != 2:
        raise SerializationError("malformed NumPy dtype payload in message header")
    return _dtype(items[1])


def _find_dtype(obj: object) -> Handler | None:
    return _encode_dtype if isinstance(obj, np.dtype) else None  # (a class per dtype)


def _encode_ndarray(state: EncodeState, obj: np.ndarray[Any, Any]) -> list[Any]:
    return [MARKS[NDARRAY], *_array_fields(state, obj)]


def _decode_ndarray(state: DecodeState, items: list[Any]) -> object:
    if len(items) != 5:
        raise SerializationError("malformed array payload in message header")
    return _array_from_fields(state, items[1:])


def _encode_scalar(state: EncodeState, obj: np.generic) -> list[Any]:
    return [MARKS[NPSCALAR], obj.dtype.str, obj.tobytes()]


def _encode_string_scalar(state: EncodeState, obj: np.str_ | np.bytes_) -> list[Any]:
    return [MARKS[NPSCALAR], obj.dtype.kind, obj.item()]


def _decode_scalar(state: DecodeState, items: list[Any]) -> object:
    if len(items) != 3:
        raise SerializationError("malformed NumPy scalar payload in message header")
    if items[1] == "U" and type(items[2]) is str:
        return np.str_(items[2])
    if items[1] == "S" and type(items[2]) is bytes:
        return np.bytes_(items[2])
    if type(items[2]) is not bytes:
        raise SerializationError("malformed NumPy scalar payload in message header")
    dtype = _dtype(items[1])
    if len(items[2]) != dtype.itemsize:
        raise SerializationError(f"malformed NumPy scalar payload: wrong size for {dtype}")
    return np.frombuffer(items[2], dtype=dtype, count=1)[0]


def _import(name: str, what: str) -> Any:
    module = sys.modules.get(name)
    if module is not None and not _initializing(module):
        return module
    try:
        return importlib.import_module(name)
    except Exception as exc:
        raise SerializationError(
            f"received {what}, but {name} cannot be imported on this worker: {exc}"
        ) from exc


def _initializing(module: Any) -> bool:
    """Whether another thread is still importing ``module``: it is in
    ``sys.modules`` but half made (``importlib.import_module`` waits for it,
    where using it at once fails with "partially initialized module")."""
    return bool(getattr(getattr(module, "__spec__", None), "_initializing", False))


def _encode_cupy(state: EncodeState, obj: Any) -> list[Any]:
    ipc = _cupy_ipc(state)
    if (
        ipc is not None
        and obj.dtype.kind in "biufc"
        and obj.nbytes >= ipc.min_bytes  # (before copying a strided one)
    ):
        data, order = _contiguous(obj, sys.modules["cupy"].ascontiguousarray)
        fields = ipc.lend(state.context, data)
        if fields is not None:  # [mark, dtype, shape, order, *the hook's fields]
            return [MARKS[CUPY], obj.dtype.str, list(obj.shape), order, *fields]
    cupy = sys.modules["cupy"]
    if obj.ndim > 1 and obj.flags.f_contiguous and not obj.flags.c_contiguous:
        host = cupy.asnumpy(obj.T).T  # (asnumpy makes C order)
    else:
        host = cupy.asnumpy(obj)
    return [MARKS[CUPY], *_array_fields(state, host)]


def _decode_cupy(state: DecodeState, items: list[Any]) -> object:
    if len(items) != 5:
        return _decode_cupy_ipc(state, items)
    host = _array_from_fields(state, items[1:])
    cupy = _import("cupy", "a CuPy array")
    try:
        if host.ndim > 1 and host.flags.f_contiguous and not host.flags.c_contiguous:
            return cupy.asarray(host.T).T  # Fortran order, as sent
        return cupy.asarray(host)
    except Exception as exc:
        raise SerializationError(f"cannot place received CuPy array on the GPU: {exc}") from exc


def _cupy_ipc(state: EncodeState | DecodeState) -> CupyIpcHook | None:
    """The CUDA IPC hook of the agent the message belongs to, if it has one."""
    hooks = hooks_of(state.context)
    return None if hooks is None else hooks.cupy_ipc


def _tensor_grad(state: EncodeState | DecodeState) -> TensorGradHook | None:
    """The tensor-gradient hook of the agent the message belongs to, if it has one."""
    hooks = hooks_of(state.context)
    return None if hooks is None else hooks.tensor_grad


def _decode_cupy_ipc(state: DecodeState, items: list[Any]) -> object:
    ipc = _cupy_ipc(state)
    if len(items) < 5 or ipc is None:
        raise SerializationError("malformed CuPy array payload in message header")
    dtype = _dtype(items[1])
    shape, order = items[2], items[3]
    _check_shape(shape, order, "CuPy array")
    dims = tuple(shape[::-1]) if order else tuple(shape)
    out = ipc.take(state.context, items[4:], dims, dtype)
    return out.T if order else out


def _find_cupy(obj: object) -> Handler | None:
    ndarray = getattr(sys.modules.get("cupy"), "ndarray", None)  # (as torch's below)
    if ndarray is not None and type(obj).__module__.startswith("cupy") and isinstance(obj, ndarray):
        return _encode_cupy
    return None


_SAME_SIZE_INT: Final = {1: "int8", 2: "int16", 4: "int32", 8: "int64"}


#: Encoders of torch tensors of layouts other than dense (``rpcdist.torch``
#: adds sparse COO), by layout.
TENSOR_LAYOUTS: dict[Any, Handler] = {}


def _encode_tensor(state: EncodeState, obj: Any) -> list[Any]:
    torch = sys.modules["torch"]
    if obj.layout != torch.strided:
        other = TENSOR_LAYOUTS.get(obj.layout)
        if other is None:
            raise Unsupported(
                f"tensors of layout {obj.layout} cannot be sent (dense ones can, and sparse "
                "COO ones once rpcdist.torch is imported)"
            )
        return other(state, obj)  # type: ignore[no-any-return]
    data = obj.detach()
    device = data.device
    ipc = None
    if device.type != "cpu":
        if device.type != "cuda":
            raise Unsupported(f"only CPU and CUDA tensors can be sent, not device {device}")
        data = _dense(data)  # (on the device: .cpu() then copies it once, dense)
        ipc = _lend_tensor(state, torch, data)
        if ipc is None:
            data = data.cpu()  # through host memory, as CuPy arrays travel
    dtype_name = str(data.dtype).removeprefix("torch.")
    if ipc is not None:
        fields = [*ipc[:2], -1, 0]  # no buffer: the CUDA IPC fields follow the device
    else:
        strided = _strided_span(data)
        if strided is None:
            fields = _array_fields(state, _tensor_bits(torch, data))
        else:  # (the view's memory, its strides in place of the order)
            fields = _array_fields(state, _tensor_bits(torch, strided[0]))
            fields[1], fields[3] = list(data.shape), strided[1]
    is_parameter = isinstance(obj, torch.nn.Parameter)
    out = [MARKS[TENSOR], *fields, dtype_name, bool(obj.requires_grad), is_parameter]
    index = -1
    if obj.requires_grad:
        grad_hook = _tensor_grad(state)
        if grad_hook is not None:
            index = grad_hook.record(state.context, obj)
    if device.type == "cuda":  # a 9th and 10th field: the index (or -1) and the device
        out += [index, f"cuda:{device.index if device.index is not None else 0}"]
        if ipc is not None:
            out += ipc[2]  # and the CUDA IPC fields
    elif index >= 0:
        out.append(index)  # a 9th field: recorded for distributed autograd
    return out


#: A strided view is sent with its strides when the memory it spans is under
#: this many bytes or under twice its elements' (PyTorch sends a view's whole
#: storage unless that is at least 8 KiB and twice the view; past both, the
#: view arrives contiguous, as PyTorch's copy of it does).
_STRIDED_SPAN_BYTES = 8 * 1024


def _strided_span(data: Any) -> tuple[Any, list[int]] | None:
    """For a non-contiguous CPU view ``data`` worth sending with its strides:
    the 1-D span of memory its elements lie in, and its strides (else ``None``)."""
    if data.is_contiguous() or data.numel() == 0 or data.is_conj() or data.is_neg():
        return None
    strides = list(data.stride())
    span = 1 + sum((n - 1) * s for n, s in zip(data.shape, strides, strict=True))
    if span * data.element_size() >= _STRIDED_SPAN_BYTES and span >= 2 * data.numel():
        return None
    return data.as_strided((span,), (1,)), strides


def _strided_tensor(state: DecodeState, torch: Any, items: list[Any]) -> Any:
    """A tensor sent with its strides (``items[4]``) over the span it covers."""
    shape, strides = items[2], items[4]
    _check_shape(shape, 0, "tensor")
    if (
        len(strides) != len(shape)
        or not all(type(s) is int and s >= 0 for s in strides)
        or not all(shape)
    ):
        raise SerializationError("malformed tensor payload: bad strides")
    span = 1 + sum((n - 1) * s for n, s in zip(shape, strides, strict=True))
    array = _array_from_fields(state, [items[1], [span], items[3], 0])
    if not array.flags.writeable:
        array = array.copy()
    return torch.from_numpy(array).as_strided(shape, strides)


def _dense(data: Any) -> Any:
    """``data`` with its lazy conjugation and negation applied, contiguous."""
    data = data.resolve_conj().resolve_neg()
    return data if data.is_contiguous() else data.contiguous()


def _as_ints(torch: Any, data: Any) -> Any | None:
    """``data``'s bits as same-size integers (for a dtype NumPy and CuPy lack:
    bfloat16, float8, ...), or ``None`` for an element size without one."""
    size = _SAME_SIZE_INT.get(data.element_size())
    return None if size is None else data.view(getattr(torch, size))


def _tensor_bits(torch: Any, data: Any) -> Any:
    """A CPU tensor as a NumPy array over its (contiguous) memory."""
    data = _dense(data)
    try:
        return data.numpy()
    except TypeError:
        ints = _as_ints(torch, data)
        if ints is None:
            raise
        return ints.numpy()


_NO_CUPY: list[bool] = []


def _lend_tensor(state: EncodeState, torch: Any, data: Any) -> list[Any] | None:
    """``[dtype, shape, fields]`` for dense CUDA tensor ``data`` sent by CUDA
    IPC (through a CuPy view of it), or ``None``: send it through host memory."""
    ipc = _cupy_ipc(state)
    if ipc is None or _NO_CUPY:
        return None
    if data.numel() * data.element_size() < ipc.min_bytes:
        return None  # (before asking CuPy for a view of it)
    cupy = sys.modules.get("cupy")
    if cupy is None:
        try:
            cupy = importlib.import_module("cupy")
        except Exception:  # not installed: the host path, without asking again
            _NO_CUPY.append(True)
            return None
    if data.is_floating_point() and data.dtype not in (torch.float16, torch.float32, torch.float64):
        data = _as_ints(torch, data)  # bfloat16, float8, ...: CuPy has no such dtype
        if data is None:
            return None
    try:
        array = _cupy_view(cupy, data, data.device.index)
        _after_torch(torch, cupy, data.device.index)
    except Exception:
        return None
    fields = ipc.lend(state.context, array)
    if fields is None:
        return None
    return [array.dtype.str, list(array.shape), fields]


def _cupy_view(cupy: Any, tensor: Any, index: int, dtype: Any = None) -> Any:
    """A CuPy array over dense CUDA tensor ``tensor``'s memory, holding it,
    of NumPy ``dtype`` (default: the tensor's own; same item size).

    Not ``cupy.from_dlpack``/``torch.from_dlpack``: their stream hand-off
    costs a large share of a tensor's CUDA IPC time (docs/benchmarks.md,
    "Figures behind the code's choices"); ``_after_torch`` orders the
    streams instead."""
    if dtype is None:
        dtype = np.dtype(str(tensor.dtype).removeprefix("torch."))
    if dtype.itemsize != tensor.element_size():
        raise TypeError(f"no CuPy dtype for {tensor.dtype}")
    nbytes = tensor.numel() * dtype.itemsize
    memory = cupy.cuda.UnownedMemory(tensor.data_ptr(), nbytes, tensor, index)
    return cupy.ndarray(tuple(tensor.shape), dtype, cupy.cuda.MemoryPointer(memory, 0))


def _after_torch(torch: Any, cupy: Any, index: int) -> None:
    """Make what CuPy does next on device ``index`` come after what torch has
    queued there: nothing to do when both use the same stream (by default,
    the legacy default stream), else wait for torch's."""
    # (the raw stream is a far cheaper call than torch.cuda.current_stream;
    # torch keeps it for its compiler)
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    ours = raw(index) if raw is not None else torch.cuda.current_stream(index).cuda_stream
    with cupy.cuda.Device(index):
        if ours != cupy.cuda.get_current_stream().ptr:
            torch.cuda.current_stream(index).synchronize()


def _cuda_empty(
    torch: Any, cupy: Any, shape: tuple[int, ...], dtype: Any, wire: Any, index: int
) -> tuple[Any, Any]:
    """A new CUDA tensor of ``dtype`` on device ``index``, and a CuPy view of
    it as NumPy dtype ``wire`` to copy into."""
    tensor = torch.empty(shape, dtype=dtype, device=f"cuda:{index}")
    _after_torch(torch, cupy, index)  # (its memory may be in use on torch's stream)
    return tensor, _cupy_view(cupy, tensor, index, wire)


def _decode_tensor(state: DecodeState, items: list[Any]) -> object:
    n = len(items)
    if (
        n < 8
        or (n >= 10 and (type(items[9]) is not str or not items[9].startswith("cuda:")))
        or type(items[5]) is not str
        or type(items[6]) is not bool
        or type(items[7]) is not bool
    ):
        raise SerializationError("malformed tensor payload in message header")
    torch = _import("torch", "a torch tensor")
    dtype = getattr(torch, items[5], None)
    if not isinstance(dtype, torch.dtype):
        raise SerializationError(f"malformed tensor payload: unknown dtype {items[5]!r}")
    try:
        if n > 10:  # the CUDA IPC hook's fields follow the device (it checks them)
            tensor = _tensor_from_ipc(state, torch, dtype, items)
        elif type(items[4]) is list:
            tensor = _strided_tensor(state, torch, items)
        else:
            array = _array_from_fields(state, items[1:5])
            if not array.flags.writeable:
                array = array.copy()  # torch tensors are always writable
            tensor = torch.from_numpy(array)
        if tensor.dtype != dtype:
            tensor = tensor.view(dtype)
    except SerializationError:
        raise
    except Exception as exc:
        raise SerializationError(f"cannot rebuild received tensor: {exc}") from exc
    if n >= 10:
        if n == 10:
            tensor = _to_cuda(torch, tensor, items[9])
        if items[8] != -1:
            return _attach(state, tensor, items[8])
    elif n == 9:
        return _attach(state, tensor, items[8])
    try:
        if items[7]:
            return torch.nn.Parameter(tensor, requires_grad=items[6])
        return tensor.requires_grad_(items[6])
    except Exception as exc:
        raise SerializationError(f"cannot rebuild received tensor: {exc}") from exc


def _tensor_from_ipc(state: DecodeState, torch: Any, dtype: Any, items: list[Any]) -> Any:
    """A CUDA tensor of ``dtype`` sent by CUDA IPC, on the sender's device index."""
    ipc = _cupy_ipc(state)
    if ipc is None:
        raise SerializationError("malformed tensor payload in message header")
    wire = _dtype(items[1])
    _check_shape(items[2], items[4], "tensor")
    index = items[9][5:]
    if not index.isdigit():
        raise SerializationError(f"malformed tensor payload: device {items[9]!r}")
    if wire.itemsize != dtype.itemsize:
        raise SerializationError(f"malformed tensor payload: {wire} data for a {dtype} tensor")
    cupy = _import("cupy", "a CUDA tensor sent by CUDA IPC")
    shape = tuple(items[2])
    tensor, view = _cuda_empty(torch, cupy, shape, dtype, wire, int(index))
    with cupy.cuda.Device(int(index)):
        ipc.take(state.context, items[10:], shape, wire, view)
    return tensor


def _to_cuda(torch: Any, tensor: Any, device: str) -> Any:
    """A received CUDA tensor back on its device (the same index as the sender's)."""
    if not torch.cuda.is_available():
        raise SerializationError(
            f"received a tensor on {device}, but this worker has no CUDA device "
            "(torch.cuda.is_available() is False); move it to the CPU before sending"
        )
    try:
        return tensor.to(device)
    except Exception as exc:
        raise SerializationError(f"cannot place a received tensor on {device}: {exc}") from exc


def _attach(state: DecodeState, tensor: Any, index: object) -> Any:
    if type(index) is not int or index < 0:
        raise SerializationError(f"malformed tensor payload: autograd index {index!r}")
    grad_hook = _tensor_grad(state)
    if grad_hook is None:
        raise SerializationError(
            "a torch tensor recorded for distributed autograd arrived, but this worker's "
            "agent has no torch autograd hook (it arrived outside an RPC message, or the "
            "agent was made without its built-in extensions)"
        )
    return grad_hook.attach(state.context, tensor, index)


def _find_tensor(obj: object) -> Handler | None:
    # (getattr: torch may be half imported by another thread, without Tensor yet)
    tensor = getattr(sys.modules.get("torch"), "Tensor", None)
    if tensor is not None and isinstance(obj, tensor):
        return _encode_tensor
    return None


_SCALARS: Final = {np.dtype(code).type for code in "?bhilqpBHILQPefdgFDG"}
define(NDARRAY, [np.ndarray], _encode_ndarray, _decode_ndarray)
define(NPSCALAR, [*_SCALARS, np.datetime64, np.timedelta64], _encode_scalar, _decode_scalar)
define(NPSCALAR, [np.str_, np.bytes_], _encode_string_scalar, _decode_scalar)
define(CUPY, [], _encode_cupy, _decode_cupy)
define(TENSOR, [], _encode_tensor, _decode_tensor)
define(NPDTYPE, [], _encode_dtype, _decode_dtype)
FINDERS.extend([_find_cupy, _find_tensor, _find_dtype])
