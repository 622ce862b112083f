"""The exposure model: a peer runs only what the program exposes.

Each known gadget (a stdlib or NumPy function that runs a command, writes or
reads a file, imports code or unpickles) is refused under the default
options on every path a peer has, with no side effect; the same call under
``callable_policy="any"`` shows the gadget is real. Sweeps over the whole
standard library and NumPy's namespace check that nothing outside a small
set of pure-computation modules is admitted.
"""

from __future__ import annotations

import codecs
import contextlib
import gzip
import importlib
import json
import linecache
import logging
import os
import pickle
import subprocess
import sys
import traceback
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import numpy.lib.format
import pytest
import rel_funcs as rf

import rpcdist
from rpcdist._rpc import _agent
from rpcdist._serialization import _builtins, _exposure
from rpcdist._serialization._functions import DEFAULT_POLICY, CallablePolicy, resolve_function
from rpcdist.testing import as_current, local_agents

INPROC = rpcdist.RpcOptions(token=None, transport="inproc")
ANY = rpcdist.RpcOptions(token=None, transport="inproc", callable_policy="any")


def apply_args(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A program function that calls a function it was sent (the argument path)."""
    return fn(*args, **kwargs)


class _Evil:
    """Run a command when unpickled (a payload for ``numpy.load(allow_pickle=True)``)."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (self.command,))


def _pickle_file(marker: Path) -> str:
    path = marker.parent / "payload.pkl"
    path.write_bytes(pickle.dumps(_Evil(f"touch {marker}")))
    return str(path)


#: Gadgets that act: ``name -> (function, (args, kwargs) for a marker path)``.
#: Each creates the marker file when it runs.
ACTING: dict[
    str, tuple[Callable[[], Any], Callable[[Path], tuple[tuple[Any, ...], dict[str, Any]]]]
] = {
    "_osx_support:_read_output": (
        lambda: importlib.import_module("_osx_support")._read_output,
        lambda m: ((f"touch {m}",), {}),
    ),
    "uuid:_get_command_stdout": (
        lambda: uuid._get_command_stdout,  # type: ignore[attr-defined]
        lambda m: (("touch", str(m)), {}),
    ),
    "codecs:open": (lambda: codecs.open, lambda m: ((str(m), "w"), {})),
    "logging:FileHandler": (lambda: logging.FileHandler, lambda m: ((str(m),), {})),
    "gzip:open": (lambda: gzip.open, lambda m: ((str(m), "wb"), {})),
    "numpy.lib.format:open_memmap": (
        lambda: numpy.lib.format.open_memmap,
        lambda m: ((str(m), "w+", np.float64, (4,)), {}),
    ),
    "numpy:save": (lambda: np.save, lambda m: ((str(m), np.zeros(2)), {})),
    "numpy:load": (lambda: np.load, lambda m: ((_pickle_file(m),), {"allow_pickle": True})),
}
#: Gadgets that read: ``name -> (function, path)``.
READING = {
    "linecache:getlines": (linecache.getlines, "/etc/shadow"),
    "numpy:fromfile": (np.fromfile, "/etc/shadow"),
}


def _run(
    agent: Any, path: str, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """Call ``fn`` on worker 1 through ``path``."""
    if path == "rpc_sync":
        return agent.rpc_sync(1, fn, args=args, kwargs=kwargs)
    if path == "rpc_async":
        return agent.rpc_async(1, fn, args=args, kwargs=kwargs).wait(10)
    if path == "remote":
        with as_current(agent):
            rref = rpcdist.remote(1, fn, args=args, kwargs=kwargs)
            try:
                return rref.to_here(10)
            finally:
                del rref
    assert path == "argument"
    return agent.rpc_sync(1, apply_args, args=(fn, args, kwargs))


PATHS = ["rpc_sync", "rpc_async", "remote", "argument"]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name", sorted(ACTING))
def test_an_acting_gadget_is_refused_with_no_side_effect(tmp_path, by_raw_name, name, path):
    get, make = ACTING[name]
    marker = tmp_path / "marker.npy"
    args, kwargs = make(marker)
    # (as an argument by its name: NumPy's dispatchers do not travel as values)
    fn = by_raw_name(name) if path == "argument" else get()
    with local_agents(2, options=INPROC) as (a, _):
        with pytest.raises(rpcdist.RpcdistError, match=name.replace(".", r"\.")) as info:
            _run(a, path, fn, args, kwargs)
        text = str(info.value)
        assert "allowed_callables" in text and "rpcdist.expose" in text, text
        assert a.rpc_sync(1, rf.add, args=(2, 3)) == 5  # it serves on
    assert not marker.exists()


@pytest.mark.parametrize("name", sorted(ACTING))
def test_each_acting_gadget_is_real_on_a_trusted_worker(tmp_path, name):
    # (so the refusal above is what keeps the marker away)
    get, make = ACTING[name]
    marker = tmp_path / "marker.npy"
    args, kwargs = make(marker)
    with local_agents(2, options=ANY) as (a, _):
        with contextlib.suppress(rpcdist.RpcdistError):  # (the result may not travel back)
            got = a.rpc_sync(1, get(), args=args, kwargs=kwargs)
            del got
    assert marker.exists()


def test_a_file_object_from_codecs_open_cannot_be_written_through_a_proxy(tmp_path):
    marker = tmp_path / "marker"
    with local_agents(2, options=INPROC) as (a, _), as_current(a):
        rref = rpcdist.remote(1, codecs.open, args=(str(marker), "w"))
        with pytest.raises(rpcdist.RpcdistError, match="codecs:open"):
            rref.rpc_sync().write("pwned")
        del rref
    assert not marker.exists()


def test_a_method_a_value_lacks_is_an_attribute_error_through_a_proxy():
    # As a local call (and PyTorch) would say: the name does not exist, so
    # there is nothing to refuse; a method that exists is judged as before.
    with local_agents(2, options=INPROC) as (a, _), as_current(a):
        rref = rpcdist.remote(1, rf.ones, args=(4,))
        with pytest.raises(AttributeError, match="'ndarray' object has no attribute 'nope'"):
            rref.rpc_sync().nope()
        with pytest.raises(rpcdist.CallPolicyError, match="tofile"):
            rref.rpc_sync().tofile("/tmp/never")
        del rref


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name", sorted(READING))
def test_a_reading_gadget_is_refused(by_raw_name, name, path):
    fn, target = READING[name]
    fn = by_raw_name(name) if path == "argument" else fn
    linecache.cache.pop(target, None)
    with local_agents(2, options=INPROC) as (a, _):
        with pytest.raises(rpcdist.CallPolicyError, match=name):
            _run(a, path, fn, (target,), {})
    assert target not in linecache.cache


@pytest.fixture
def by_raw_name(monkeypatch):
    """Send a stand-in function under a raw name (one the caller does not
    have imported either: the two agents share this process)."""
    names: dict[Any, str] = {}

    def named(real: Callable[[Any], str]) -> Callable[[Any], str]:
        return lambda fn: names[fn] if fn in names else real(fn)

    monkeypatch.setattr(_agent, "name_of", named(_agent.name_of))
    monkeypatch.setattr(_builtins, "name_of", named(_builtins.name_of))

    def stand_in(name: str) -> Callable[..., Any]:
        def fn(*args: Any, **kwargs: Any) -> Any:
            raise AssertionError("the stand-in ran on the caller")

        names[fn] = name
        return fn

    return stand_in


@pytest.mark.parametrize("path", PATHS)
def test_a_peer_cannot_import_code_it_planted_on_the_callee(
    tmp_path, monkeypatch, by_raw_name, path
):
    marker = tmp_path / "imported"
    (tmp_path / "evil_mod.py").write_text(
        f"open({str(marker)!r}, 'w').close()\n\ndef f(*args):\n    return 'ran'\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("evil_mod", None)
    with local_agents(2, options=INPROC) as (a, _):
        with pytest.raises(rpcdist.CallPolicyError, match="'evil_mod' is not imported"):
            _run(a, path, by_raw_name("evil_mod:f"), (), {})
    assert "evil_mod" not in sys.modules
    assert not marker.exists()


def test_the_programs_own_modules_are_admitted_once_imported(tmp_path, monkeypatch, by_raw_name):
    (tmp_path / "prog_mod_xyz.py").write_text("def f(x):\n    return x * 2\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("prog_mod_xyz", None)
    f = by_raw_name("prog_mod_xyz:f")
    try:
        with local_agents(2, options=INPROC) as (a, _):
            with pytest.raises(rpcdist.CallPolicyError, match="not imported"):
                a.rpc_sync(1, f, args=(2,))
            assert "prog_mod_xyz" not in sys.modules
            importlib.import_module("prog_mod_xyz")  # the program imports it: now its own
            assert a.rpc_sync(1, f, args=(2,)) == 4
            assert a.rpc_sync(1, rf.add, args=(1, 2)) == 3  # (a test helper module: the program's)
    finally:
        sys.modules.pop("prog_mod_xyz", None)


def test_a_reexport_through_the_programs_module_is_judged_by_its_origin():
    for name in (
        "rel_funcs:hidden_os.system",
        "rel_funcs:np.save",
        "rel_funcs:time.sleep.__call__",
    ):
        with pytest.raises(rpcdist.CallPolicyError):
            resolve_function(name)
    assert resolve_function("rel_funcs:shell") is rf.shell  # the program's own: its choice


def test_string_formatting_cannot_read_the_programs_globals():
    # "{0.__globals__[SECRET]}".format(some_program_function) would read them
    for name in ("builtins:str.format", "builtins:str.format_map", "builtins:format"):
        with pytest.raises(rpcdist.CallPolicyError):
            resolve_function(name)
    assert resolve_function("builtins:str.upper") is str.upper


def test_expose_admits_a_function_of_any_module_process_wide():
    import json

    with pytest.raises(rpcdist.CallPolicyError, match="json:dumps"):
        resolve_function("json:dumps")
    assert rpcdist.expose(json.dumps) is json.dumps
    try:
        assert resolve_function("json:dumps") is json.dumps
        only = CallablePolicy("allowlist")
        assert resolve_function("json:dumps", only) is json.dumps
    finally:
        _exposure._EXPOSED.pop(id(json.dumps))  # (process-wide: undone for the sweeps)
    with pytest.raises(TypeError):
        rpcdist.expose(42)  # type: ignore[type-var]


def test_allowlist_refuses_rpcdists_own_functions_but_runs_its_protocols():
    opts = rpcdist.RpcOptions(
        token=None,
        transport="inproc",
        callable_policy="allowlist",
        allowed_callables=(rf.ones, rpcdist.nn.Linear),
    )
    with local_agents(2, options=opts) as (a, _), as_current(a):
        for fn, args in [
            (rpcdist.save, ({}, "/tmp/x")),
            (rpcdist.statistics, ()),
            (rpcdist.debug_info, ()),
            (rf.add, (1, 2)),
        ]:
            with pytest.raises(rpcdist.CallPolicyError, match="refuses"):
                a.rpc_sync(1, fn, args=args)
        rref = rpcdist.remote(1, rf.ones, args=(4,))  # RRef creation (create_value)
        assert rref.to_here(10).sum() == 4
        with pytest.raises(rpcdist.CallPolicyError, match="numpy:ndarray"):
            rref._get_type()  # _rref_typeof_on_owner runs; the class in its reply is not allowed here
        assert rref.rpc_sync().sum() == 4  # a curated method through a proxy
        with pytest.raises(rpcdist.CallPolicyError, match="tofile"):
            rref.rpc_sync().tofile("/tmp/never")
        del rref
        remote_linear = rpcdist.nn.RemoteModule(1, rpcdist.nn.Linear, args=(2, 3))  # _make
        assert len(remote_linear.remote_parameters()) == 2  # _parameters
        assert remote_linear(rpcdist.tensor.Tensor(np.ones((1, 2), dtype=np.float32))).shape == (
            1,
            3,
        )
        del remote_linear


# ------------------------------------------------------------ error replies


def raise_value_error(x: int) -> None:
    raise ValueError(f"bad value {x}")


def raise_system_exit() -> None:
    raise SystemExit(3)


def raise_keyboard_interrupt() -> None:
    raise KeyboardInterrupt


@pytest.mark.parametrize(
    ("fn", "kind"),
    [(raise_system_exit, "SystemExit"), (raise_keyboard_interrupt, "KeyboardInterrupt")],
)
def test_a_base_exception_in_a_reply_is_not_rebuilt_as_such(fn, kind):
    with local_agents(2, options=INPROC) as (a, _):
        with pytest.raises(rpcdist.RemoteError) as info:
            a.rpc_sync(1, fn)
        assert info.value.remote_type == f"builtins:{kind}"
        assert a.rpc_sync(1, rf.add, args=(1, 1)) == 2


def test_a_remote_value_error_carries_the_callees_traceback_as_its_cause():
    with local_agents(2, options=INPROC) as (a, _):
        with pytest.raises(ValueError, match="bad value 7") as info:
            a.rpc_sync(1, raise_value_error, args=(7,))
    cause = info.value.__cause__
    assert cause is not None and "raise_value_error" in str(cause)
    printed = "".join(traceback.format_exception(info.value))
    assert "raise_value_error" in printed and "direct cause" in printed


def test_an_unexposed_exception_type_arrives_as_a_remote_error():
    from rpcdist._serialization import exception_from_wire

    text = "Traceback...\nsubprocess.CalledProcessError: boom\n"
    got = exception_from_wire(
        {"type": "subprocess:CalledProcessError", "message": "boom", "args": [1], "traceback": text}
    )
    assert type(got) is rpcdist.RemoteError and got.remote_type == "subprocess:CalledProcessError"
    rebuilt = exception_from_wire(
        {"type": "builtins:KeyError", "message": "'k'", "args": ["k"], "traceback": text}
    )
    assert type(rebuilt) is KeyError and "boom" in str(rebuilt.__cause__)


# ------------------------------------------------------------------ sweeps

#: Modules that must not be imported even to look at them (they act on import).
_SKIP_IMPORT = {
    "antigravity",
    "this",
    "tkinter",
    "turtle",
    "turtledemo",
    "idlelib",
    "_tkinter",
    "__hello__",
    "__phello__",
    "__main__",
}
#: The only modules whose callables the default policy admits by name.
PURE_MODULES = {"math", "cmath", "operator", "_operator", "builtins", "time", "collections"}


def _callables(module: Any) -> list[str]:
    out = []
    for attr in dir(module):
        with contextlib.suppress(Exception):
            if callable(getattr(module, attr)):
                out.append(attr)
    return out


def sweep_stdlib() -> tuple[int, dict[str, list[str]]]:
    """Import every standard-library module that imports here and resolve
    each of its module-level callables under the default policy: how many
    names were swept, and the admitted ones by module."""
    admitted: dict[str, list[str]] = {}
    swept = 0
    for modname in sorted(sys.stdlib_module_names - _SKIP_IMPORT):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                module = importlib.import_module(modname)
        except BaseException:  # (not importable here: refused anyway)
            continue
        for attr in _callables(module):
            swept += 1
            try:
                resolve_function(f"{modname}:{attr}", DEFAULT_POLICY)
            except (rpcdist.CallPolicyError, rpcdist.SerializationError):
                continue
            admitted.setdefault(modname, []).append(attr)
    return swept, admitted


def test_sweep_the_standard_library_admits_only_pure_computation():
    # In a child process: importing the whole standard library here would
    # change what later tests find in sys.modules.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    child = subprocess.run(
        [sys.executable, __file__, "--sweep-stdlib"],
        env=env,
        timeout=300,
        capture_output=True,
        text=True,
        check=False,
    )
    assert child.returncode == 0, child.stderr[-3000:]
    swept, admitted = json.loads(child.stdout.strip().splitlines()[-1])
    assert swept > 5000
    outside = {m: names for m, names in admitted.items() if m not in PURE_MODULES}
    assert not outside, f"admitted outside the pure modules: {outside}"
    assert "sqrt" in admitted["math"] and "add" in admitted["operator"]
    for refused in ("eval", "exec", "open", "__import__", "getattr", "compile", "print", "format"):
        assert refused not in admitted["builtins"]
    assert not {"attrgetter", "methodcaller", "call"} & set(admitted["operator"])


def test_sweep_numpy_admits_math_and_refuses_files_and_pickles():
    admitted = set()
    for attr in _callables(np):
        if attr.startswith("_"):
            continue
        with contextlib.suppress(rpcdist.CallPolicyError, rpcdist.SerializationError):
            resolve_function(f"numpy:{attr}")
            admitted.add(attr)
    assert {"add", "sum", "matmul", "mean", "dot", "concatenate", "zeros", "array"} <= admitted
    files = {
        "save",
        "savez",
        "savez_compressed",
        "savetxt",
        "load",
        "loadtxt",
        "genfromtxt",
        "fromfile",
        "fromregex",
        "memmap",
        "DataSource",
        "frompyfunc",
        "vectorize",
    }
    assert not files & admitted
    for name in (
        "numpy.lib.format:open_memmap",
        "numpy.lib.npyio:DataSource",
        "numpy.ctypeslib:load_library",
        "numpy:ndarray.tofile",
        "numpy:ndarray.dump",
    ):
        with pytest.raises(rpcdist.CallPolicyError):
            resolve_function(name)
    assert callable(resolve_function("numpy.linalg:norm"))
    assert callable(resolve_function("numpy:ndarray.reshape"))


def test_sweep_torch_admits_tensor_math_only():
    pytest.importorskip("torch")
    for loaded in ("torch.hub", "torch.utils.cpp_extension", "torch.jit"):
        importlib.import_module(loaded)  # (imported: refused all the same)

    from rpcdist._serialization._exposure import CURATED

    admitted = set()
    for modname in (
        "torch",
        "torch._C",
        "torch.nn.functional",
        "torch.hub",
        "torch.serialization",
        "torch.utils.cpp_extension",
        "torch.jit",
    ):
        for attr in _callables(sys.modules[modname]):
            with contextlib.suppress(rpcdist.CallPolicyError, rpcdist.SerializationError):
                resolve_function(f"{modname}:{attr}")
                admitted.add(f"{modname}:{attr}")
    allowed = {f"{m}:{n}" for m in ("torch", "torch.nn.functional") for n in CURATED[m]}
    assert admitted <= allowed, sorted(admitted - allowed)
    assert {"torch:add", "torch:matmul", "torch:ones", "torch:rand"} <= admitted
    for name in (
        "torch:load",
        "torch:save",
        "torch:from_file",
        "torch.hub:load",
        "torch:ops.load_library",
        "torch._C:_pickle_load_obj",
        "torch:Tensor.storage",
    ):
        with pytest.raises((rpcdist.CallPolicyError, rpcdist.SerializationError)):
            resolve_function(name)
    assert callable(resolve_function("torch:ops.aten.mul.Tensor"))
    assert callable(resolve_function("torch:Tensor.sum"))


if __name__ == "__main__" and sys.argv[1:] == ["--sweep-stdlib"]:
    print(json.dumps(sweep_stdlib()))
