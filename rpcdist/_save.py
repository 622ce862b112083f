"""``save`` / ``load``: state dicts to and from ``.npz`` files, without pickle.

The file is an ordinary NumPy ``.npz`` archive: every array is one entry
(``"0"``, ``"1"``, ...) and the structure around them (nested dicts with str
or int keys, lists, tuples, Python scalars, None) is a JSON document in the
entry ``"__rpcdist__"``. It is read with ``allow_pickle=False``, so loading an
untrusted file cannot run code.
"""

from __future__ import annotations

import json
import os
import tempfile
import zipfile
from collections.abc import Mapping
from typing import IO, Any

import numpy as np

from ._errors import SerializationError

__all__ = ["load", "save"]

_META = "__rpcdist__"
_FORMAT = "rpcdist-npz"
_VERSION = 1


def _host(arr: Any) -> np.ndarray[Any, Any]:
    if isinstance(arr, np.ndarray):
        return arr
    if hasattr(arr, "get") and hasattr(arr, "shape"):  # CuPy
        return np.asarray(arr.get())
    return np.asarray(arr)


class _Encoder:
    def __init__(self) -> None:
        self.arrays: dict[str, np.ndarray[Any, Any]] = {}

    def array(self, arr: Any, scalar: bool = False) -> dict[str, Any]:
        host = _host(arr)
        if host.dtype.hasobject:
            raise SerializationError(f"save: object arrays cannot be saved (dtype {host.dtype})")
        ref = str(len(self.arrays))
        self.arrays[ref] = host
        return {"t": "array", "ref": ref, "scalar": scalar}

    def encode(self, obj: Any, path: str) -> Any:
        from .tensor import Tensor

        if obj is None or isinstance(obj, bool | int | float | str):
            return {"t": "py", "v": obj}
        if isinstance(obj, Tensor):
            return self.array(obj.data)
        if isinstance(obj, np.generic):
            return self.array(np.asarray(obj), scalar=True)
        if isinstance(obj, np.ndarray) or (hasattr(obj, "shape") and hasattr(obj, "dtype")):
            return self.array(obj)
        if isinstance(obj, Mapping):
            items = []
            for k, v in obj.items():
                if isinstance(k, bool) or not isinstance(k, str | int):
                    raise SerializationError(
                        f"save: key {k!r} at {path or '<root>'} is not a str or int"
                    )
                items.append([k, self.encode(v, f"{path}/{k}")])
            return {"t": "dict", "items": items}
        if isinstance(obj, list | tuple):
            kind = "list" if isinstance(obj, list) else "tuple"
            return {"t": kind, "items": [self.encode(v, f"{path}/{i}") for i, v in enumerate(obj)]}
        raise SerializationError(
            f"save: cannot save a {type(obj).__name__} at {path or '<root>'}; expected arrays, "
            "tensors, dicts, lists, tuples or Python scalars"
        )


def save(obj: Any, f: str | os.PathLike[str] | IO[bytes]) -> None:
    """Write ``obj`` (a state dict, possibly nested) to ``f`` as ``.npz``.

    Args:
        obj: Arrays (NumPy or CuPy), Tensors, and dicts/lists/tuples of them
            and of Python scalars or None. Tensors and CuPy arrays are saved
            as NumPy arrays.
        f: A path (written atomically; no suffix is added) or a binary file.

    Raises:
        SerializationError: ``obj`` holds something that cannot be saved.
    """
    enc = _Encoder()
    root = enc.encode(obj, "")
    meta = json.dumps({"format": _FORMAT, "version": _VERSION, "root": root})
    entries = dict(enc.arrays)
    entries[_META] = np.frombuffer(meta.encode("utf-8"), dtype=np.uint8)
    if not isinstance(f, str | os.PathLike):
        np.savez(f, **entries)  # type: ignore[arg-type]
        return
    target = os.fspath(f)
    folder = os.path.dirname(os.path.abspath(target))
    fd, tmp = tempfile.mkstemp(prefix=".rpcdist-save-", dir=folder)
    try:
        with os.fdopen(fd, "wb") as out:
            np.savez(out, **entries)  # type: ignore[arg-type]
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _decode(node: Any, arrays: Any) -> Any:
    kind = node["t"]
    if kind == "py":
        return node["v"]
    if kind == "array":
        arr = arrays[node["ref"]]
        return arr[()] if node.get("scalar") else arr
    if kind == "dict":
        return {k: _decode(v, arrays) for k, v in node["items"]}
    if kind == "list":
        return [_decode(v, arrays) for v in node["items"]]
    if kind == "tuple":
        return tuple(_decode(v, arrays) for v in node["items"])
    raise SerializationError(f"load: unknown entry kind {kind!r}")


def load(f: str | os.PathLike[str] | IO[bytes]) -> Any:
    """Read what :func:`save` wrote (arrays come back as NumPy arrays).

    Args:
        f: A path or a binary file.

    Raises:
        SerializationError: the file is not an rpcdist ``.npz`` file.
    """
    try:
        with np.load(f, allow_pickle=False) as npz:
            if _META not in npz.files:
                raise SerializationError(f"load: {f!r} is not an rpcdist save file")
            meta = json.loads(npz[_META].tobytes().decode("utf-8"))
            if meta.get("format") != _FORMAT or meta.get("version") != _VERSION:
                raise SerializationError(
                    f"load: unsupported format {meta.get('format')!r} v{meta.get('version')!r}"
                )
            arrays = {k: npz[k] for k in npz.files if k != _META}
    except (ValueError, EOFError, zipfile.BadZipFile) as exc:
        raise SerializationError(f"load: cannot read {f!r}: {exc}") from exc
    return _decode(meta["root"], arrays)
