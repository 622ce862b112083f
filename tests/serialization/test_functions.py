"""Functions travel by name; exceptions travel as descriptions."""

from __future__ import annotations

import collections
import collections.abc
import enum
import functools
import math
import operator
import subprocess
import sys
import threading
import types
from typing import Any

import numpy as np
import pytest

from rpcdist._errors import CallPolicyError, RemoteError, SerializationError
from rpcdist._serialization import (
    decode,
    encode,
    exception_from_wire,
    exception_to_wire,
    function_name,
    resolve_function,
)
from rpcdist._serialization._functions import CallablePolicy, name_of, resolve

from ._helpers import FUNCTIONS, Helpers, module_function, roundtrip


@pytest.mark.parametrize("fn", FUNCTIONS, ids=lambda f: f.__qualname__)
def test_named_functions_resolve_back(fn: Any) -> None:
    name = function_name(fn)
    assert resolve_function(name) == fn
    assert roundtrip({"f": fn}) == {"f": fn}


def test_names_are_module_colon_qualname() -> None:
    assert function_name(module_function) == f"{module_function.__module__}:module_function"
    assert function_name(Helpers.static).endswith(":Helpers.static")
    assert function_name(Helpers.klass).endswith(":Helpers.klass")
    assert function_name(operator.add) == "_operator:add"
    assert function_name(math.sqrt) == "math:sqrt"


def _closure_maker() -> Any:
    def inner() -> None:
        pass

    return inner


def _ghost() -> Any:
    fn = types.FunctionType(module_function.__code__, {}, "ghost")
    fn.__qualname__ = "ghost"
    fn.__module__ = __name__
    return fn


@pytest.mark.parametrize(
    ("fn", "why"),
    [
        (lambda: None, "lambdas cannot be found"),
        (_closure_maker(), "defined inside another function"),
        (Helpers().method, "bound to an instance"),
        (functools.partial(operator.add, 1), "no __module__ and __qualname__"),
        (_ghost(), "does not lead back to it"),
    ],
    ids=["lambda", "closure", "bound-method", "partial", "renamed"],
)
def test_functions_without_a_usable_name_are_refused(fn: Any, why: str) -> None:
    with pytest.raises(SerializationError, match=why) as info:
        function_name(fn)
    label = getattr(fn, "__qualname__", "functools.partial")
    assert label in str(info.value)


class _Unhashable:
    __hash__ = None  # type: ignore[assignment]

    def method(self) -> None:
        pass


@pytest.mark.parametrize(
    ("fn", "name"),
    [
        (str.upper, "builtins:str.upper"),
        (list.append, "builtins:list.append"),
        (dict.get, "builtins:dict.get"),
        (np.ndarray.sum, "numpy:ndarray.sum"),
        (int.__add__, "builtins:int.__add__"),
    ],
    ids=["str.upper", "list.append", "dict.get", "ndarray.sum", "int.__add__"],
)
def test_methods_of_builtin_types_are_named_through_their_type(fn: Any, name: str) -> None:
    # (they have no __module__ of their own; before, they could not be sent)
    assert function_name(fn) == name
    assert resolve_function(name) is fn
    assert roundtrip([fn, "x"]) == [fn, "x"]


class _Shape(enum.Enum):
    SQUARE = 1


@pytest.mark.parametrize(
    "cls",
    [
        int,
        ValueError,
        np.ndarray,
        np.float32,
        collections.OrderedDict,
        collections.abc.Mapping,
        _Shape,
        Helpers,
    ],
    ids=lambda c: c.__qualname__,
)
def test_classes_travel_by_name_as_functions_do(cls: type) -> None:
    # (classes of other metaclasses too: abc.ABCMeta, enum.EnumMeta; decoded
    # on a trusted worker: the default policy refuses collections.abc's)
    trusted = types.SimpleNamespace(agent=types.SimpleNamespace(policy=CallablePolicy("any")))
    header, buffers = encode({"cls": cls, "in": [cls]})
    assert decode(header, buffers, context=trusted) == {"cls": cls, "in": [cls]}
    assert decode(*encode((cls,)), context=trusted)[0] is cls


def test_classes_without_a_usable_name_are_refused_as_classes() -> None:
    def make() -> type:
        class Local:
            pass

        return Local

    with pytest.raises(SerializationError, match=r"at args\[0\]: cannot send class '.*make.<loc"):
        encode([make()], where="args")
    with pytest.raises(CallPolicyError, match="subprocess:Popen"):
        decode(*encode(subprocess.Popen))


def test_the_remembered_name_is_the_same_and_refuses_the_same() -> None:
    assert name_of(module_function) == function_name(module_function) == name_of(module_function)
    with pytest.raises(SerializationError, match="bound to an instance"):
        name_of(_Unhashable().method)  # cannot be remembered: still refused, not a TypeError
    with pytest.raises(SerializationError, match="does not lead back to it"):
        name_of(_ghost())
    assert resolve("math:sqrt") is math.sqrt is resolve("math:sqrt")
    with pytest.raises(SerializationError, match="no_such_function"):
        resolve("math:no_such_function")


def test_a_lambda_argument_is_refused_naming_function_and_place() -> None:
    with pytest.raises(SerializationError) as info:
        encode((1, {"key": lambda x: x}), where="args")
    message = str(info.value)
    assert "'function' at args[1]['key']" in message and "<lambda>" in message


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("math:no_such_function", "no_such_function"),
        ("math:pi", "not callable"),
        ("nocolon", "expected 'module:qualname'"),
    ],
)
def test_unresolvable_names(name: str, why: str) -> None:
    with pytest.raises(
        SerializationError, match=f"function '{name}' not found on this worker"
    ) as info:
        resolve_function(name)
    assert why in str(info.value)


def test_a_module_not_imported_is_refused_unless_named_and_then_reported() -> None:
    with pytest.raises(CallPolicyError, match="'no_such_module_xyz' is not imported"):
        resolve_function("no_such_module_xyz:f")
    with pytest.raises(SerializationError, match="cannot import module 'no_such_module_xyz'"):
        resolve_function("no_such_module_xyz:f", CallablePolicy("any"))


# ------------------------------------------------------------- exceptions


class CustomError(Exception):
    """An exception type the receiver also has imported."""

    def __init__(self, code: int, detail: str) -> None:
        super().__init__(code, detail)
        self.code = code


def _raise(exc: BaseException) -> BaseException:
    try:
        raise exc
    except BaseException as caught:
        return caught


def test_exception_to_wire_describes_type_message_args_and_traceback() -> None:
    wire = exception_to_wire(_raise(ValueError("bad value", 3)))
    assert wire["type"] == "builtins:ValueError"
    assert wire["message"] == "('bad value', 3)"
    assert wire["args"] == ("bad value", 3)
    assert "in _raise" in wire["traceback"] and "ValueError" in wire["traceback"]


def test_known_exception_types_are_recreated_with_traceback() -> None:
    exc = exception_from_wire(exception_to_wire(_raise(CustomError(7, "x"))))
    assert type(exc) is CustomError and exc.code == 7 and exc.args == (7, "x")
    assert "CustomError" in exc.remote_traceback  # type: ignore[attr-defined]


def test_unknown_types_become_remote_errors() -> None:
    wire = {"type": "some.module:Weird", "message": "strange", "args": (1,), "traceback": "TB"}
    exc = exception_from_wire(wire)
    assert type(exc) is RemoteError
    assert exc.remote_type == "some.module:Weird" and exc.remote_traceback == "TB"
    assert str(exc) == (
        "Failed to create original exception type. Error msg was some.module:Weird is not "
        "re-created on this worker Original exception on remote side was Weird: strange"
    )


def test_remote_errors_keep_the_original_type_when_passed_on() -> None:
    first = exception_from_wire({"type": "a:B", "message": "m", "args": None, "traceback": "T1"})
    again = exception_from_wire(exception_to_wire(first))
    assert isinstance(again, RemoteError) and again.remote_type == "a:B"
    assert again.remote_traceback.startswith("T1")


def test_from_wire_imports_nothing() -> None:
    if "wave" in sys.modules:
        pytest.skip("wave already imported")
    exc = exception_from_wire(
        {"type": "wave:Error", "message": "m", "args": ("m",), "traceback": ""}
    )
    assert type(exc) is RemoteError and "wave" not in sys.modules


def test_non_exception_types_are_not_constructed() -> None:
    exc = exception_from_wire(
        {"type": "builtins:print", "message": "m", "args": (), "traceback": ""}
    )
    assert type(exc) is RemoteError


def test_unbuildable_args_fall_back_to_the_message() -> None:
    wire = exception_to_wire(CustomError(1, "x"))
    wire["args"] = ("only-one",)  # CustomError needs two
    exc = exception_from_wire(wire)
    assert type(exc) is RemoteError  # (message,) does not fit either
    assert str(exc).startswith("Failed to create original exception type. Error msg was ")
    assert " Original exception on remote side was CustomError: (1, 'x')" in str(exc)
    wire["type"] = "builtins:KeyError"
    assert type(exception_from_wire(wire)) is KeyError


def test_unencodable_args_are_dropped_and_cycles_survive() -> None:
    wire = exception_to_wire(ValueError(object()))
    assert wire["args"] is None
    exc = exception_from_wire(wire)
    assert type(exc) is ValueError and exc.args == (wire["message"],)
    cyclic = ValueError("c")
    cyclic.args = ("c", cyclic)
    assert type(roundtrip(cyclic)) is ValueError


@pytest.mark.parametrize(
    "wire",
    [None, [], {}, {"type": 1, "message": "m", "args": None, "traceback": ""}, {"type": "a:B"}],
)
def test_malformed_exception_descriptions(wire: Any) -> None:
    with pytest.raises(SerializationError):
        exception_from_wire(wire)


def test_exception_values_round_trip_inside_messages() -> None:
    header, buffers = encode({"errors": [_raise(KeyError("k")), CustomError(2, "y")]})
    out = decode(header, buffers)
    assert isinstance(out, dict)
    first, second = out["errors"]
    assert type(first) is KeyError and first.args == ("k",)
    assert type(second) is CustomError and second.code == 2


def test_a_module_being_imported_by_another_thread_is_waited_for(tmp_path, monkeypatch):
    """Two first calls into one module at once: the second waits for the first's
    import instead of finding the module half made."""
    entered, gate = threading.Event(), threading.Event()
    monkeypatch.setitem(
        sys.modules, "_rpcdist_test_gate", types.SimpleNamespace(entered=entered, gate=gate)
    )
    (tmp_path / "_rpcdist_slow_mod.py").write_text(
        "import _rpcdist_test_gate as g\ng.entered.set()\ng.gate.wait(30)\n\n"
        "def f():\n    return 7\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    results: list[object] = []
    named = CallablePolicy(allowed=frozenset({"_rpcdist_slow_mod"}))  # (so it may import)

    def resolve() -> None:
        try:
            results.append(resolve_function("_rpcdist_slow_mod:f", named)())
        except Exception as e:
            results.append(e)

    first, second = threading.Thread(target=resolve), threading.Thread(target=resolve)
    try:
        first.start()
        assert entered.wait(30)  # the first is inside the module's import
        second.start()
        second.join(1.0)  # (with the race it fails at once, before the gate opens)
    finally:
        gate.set()
        first.join(30)
        second.join(30)
        sys.modules.pop("_rpcdist_slow_mod", None)
    assert results == [7, 7]
