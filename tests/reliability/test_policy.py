"""The callable policy: what peers may call by name.

"No pickle" keeps code off the wire, but any importable function can still be
named; the default policy refuses the ones that run programs or code or reach
the system, however they are reached (tests/reliability/test_exposure.py
holds the exposure model's own tests), and the allowlist mode accepts only
what the application allows.
"""

from __future__ import annotations

import os
import subprocess

import pytest
import rel_funcs as rf

import rpcdist
from rpcdist._serialization._functions import DEFAULT_POLICY, CallablePolicy, resolve_function
from rpcdist.testing import as_current, local_agents

INPROC = rpcdist.RpcOptions(token=None, transport="inproc")


@pytest.mark.parametrize(
    "name",
    [
        "os:system",
        "posix:system",
        "subprocess:run",
        "subprocess:Popen",
        "builtins:eval",
        "builtins:exec",
        "builtins:open",
        "builtins:__import__",
        "importlib:import_module",
        "ctypes:CDLL",
        "pickle:loads",
        "shutil:rmtree",
        "numpy:save",
        "numpy:load",
        "numpy:ndarray.tofile",  # a method of a builtin type, matched by its name
        "rel_funcs:hidden_os.system",  # os reached through an innocent module
        "rpcdist.launch:main",
    ],
)
def test_default_policy_refuses_what_runs_code_or_reaches_the_system(name):

    with pytest.raises(rpcdist.CallPolicyError, match="refuses to call") as info:
        resolve_function(name)
    assert isinstance(info.value, PermissionError)
    assert "allowed_callables" in str(info.value)


@pytest.mark.parametrize("name", ["operator:add", "math:sqrt", "builtins:len", "numpy:add"])
def test_default_policy_accepts_ordinary_functions(name):
    assert callable(resolve_function(name))


def test_a_refused_module_is_not_even_imported():
    import sys

    sys.modules.pop("webbrowser", None)
    with pytest.raises(rpcdist.CallPolicyError):
        resolve_function("webbrowser:open")
    assert "webbrowser" not in sys.modules


def test_allowed_entries_admit_more_and_allowlist_mode_is_exclusive():
    pol = CallablePolicy("exposed", frozenset({"os:getpid"}))
    assert resolve_function("os:getpid", pol) is os.getpid
    with pytest.raises(rpcdist.CallPolicyError):
        resolve_function("os:system", pol)
    only = CallablePolicy("allowlist", frozenset({"rel_funcs", "math:sqrt"}))
    assert resolve_function("rel_funcs:add", only) is rf.add
    assert callable(resolve_function("math:sqrt", only))
    with pytest.raises(rpcdist.CallPolicyError, match="allowlist"):
        resolve_function("operator:add", only)
    with pytest.raises(rpcdist.CallPolicyError, match="refuses"):  # not every rpcdist function
        resolve_function("rpcdist._rpc._api:debug_info", only)
    assert callable(
        resolve_function("rpcdist._rref._rref:_rref_typeof_on_owner", only)
    )  # its protocols
    assert callable(resolve_function("os:system", CallablePolicy("any")))
    assert DEFAULT_POLICY.mode == "exposed"


def test_the_old_denylist_mode_is_a_deprecated_alias_of_the_default():
    with pytest.warns(DeprecationWarning, match="denylist"):
        got = rpcdist.RpcOptions(callable_policy="denylist").validated()
    assert got.callable_policy == "exposed"
    assert CallablePolicy("denylist").mode == "exposed"


def test_peer_cannot_run_a_shell_command_through_any_call_path(tmp_path):
    marker = tmp_path / "pwned"
    command = f"touch {marker}"
    with local_agents(2, options=INPROC) as (a, _):
        with pytest.raises(rpcdist.CallPolicyError):
            a.rpc_sync(1, os.system, args=(command,))
        with pytest.raises(rpcdist.CallPolicyError):
            a.rpc_async(1, subprocess.run, args=(["touch", str(marker)],)).wait(10)
        with pytest.raises(rpcdist.CallPolicyError):  # a function value, not the callee
            a.rpc_sync(1, rf.apply, args=(os.system, command))
        with as_current(a), pytest.raises(rpcdist.RpcdistError):
            rpcdist.remote(1, os.system, args=(command,)).to_here(10)
        assert a.rpc_sync(1, rf.add, args=(2, 3)) == 5  # it serves on
    assert not marker.exists()


@pytest.mark.parametrize("transport", ["tcp", "inproc"])
def test_allowlist_mode_accepts_only_the_application_functions(transport):
    opts = rpcdist.RpcOptions(
        token=None,
        transport=transport,
        callable_policy="allowlist",
        allowed_callables=(rf.add, "rel_funcs:ones"),
    )
    with local_agents(2, options=opts) as (a, _):
        assert a.rpc_sync(1, rf.add, args=(1, 2)) == 3
        assert a.rpc_async(1, rf.ones, args=(3,)).wait(10).sum() == 3
        with pytest.raises(rpcdist.CallPolicyError, match="allowlist"):
            a.rpc_sync(1, rf.echo, args=(1,))
        with pytest.raises(rpcdist.CallPolicyError, match="echo"):  # as an argument too
            a.rpc_sync(1, rf.add, args=(rf.echo, 1))
        with as_current(a):  # rpcdist's own protocols still work: RRefs
            rref = rpcdist.remote(1, rf.ones, args=(4,))
            assert rref.to_here(10).sum() == 4
            del rref


def test_policy_options_are_checked():
    with pytest.raises(rpcdist.ConfigError, match="callable_policy"):
        rpcdist.RpcOptions(callable_policy="nothing").validated()
    with pytest.raises(rpcdist.ConfigError, match="allowed_callables"):
        rpcdist.RpcOptions(allowed_callables=(lambda: 1,)).validated()
    got = rpcdist.RpcOptions(allowed_callables=(rf.add, os, "a.b:c")).validated()
    assert got.allowed_callables == ("a.b:c", "os", "rel_funcs:add")


@pytest.mark.parametrize("path", ["rpc_sync", "rpc_async", "remote"])
def test_rref_proxy_methods_pass_the_policy_too(tmp_path, path):
    # An RRef to an array let any peer write files on its owner through
    # ``ndarray.tofile`` or ``dump``: methods are named by their type.
    import numpy as np

    target = tmp_path / "written"
    with local_agents(2, options=INPROC) as (a, _):
        with as_current(a):
            rref = rpcdist.remote(1, np.zeros, args=(3,))
            for method in ("tofile", "dump"):
                with pytest.raises(rpcdist.CallPolicyError, match=f"numpy:ndarray.{method}"):
                    if path == "rpc_sync":
                        getattr(rref.rpc_sync(), method)(str(target))
                    elif path == "rpc_async":
                        getattr(rref.rpc_async(), method)(str(target)).wait(10)
                    else:
                        getattr(rref.remote(), method)(str(target)).to_here(10)
            assert rref.rpc_sync().sum() == 0.0  # other methods still run
            del rref
    assert not target.exists()


def test_allowed_entries_and_allowlist_mode_for_rref_proxy_methods(tmp_path):
    import numpy as np

    target = tmp_path / "written"
    allowed = rpcdist.RpcOptions(
        token=None, transport="inproc", allowed_callables=("numpy:ndarray.tofile",)
    )
    only = rpcdist.RpcOptions(
        token=None,
        transport="inproc",
        callable_policy="allowlist",
        allowed_callables=("numpy:zeros",),
    )
    with local_agents(2, options=allowed) as (a, _), as_current(a):
        rref = rpcdist.remote(1, np.zeros, args=(3,))
        rref.rpc_sync().tofile(str(target))  # allowed by name
        assert np.fromfile(target).tolist() == [0.0, 0.0, 0.0]
        del rref
    with local_agents(2, options=only) as (a, _), as_current(a):
        rref = rpcdist.remote(1, np.zeros, args=(3,))
        # methods of values follow the same rule in every mode but "any":
        # the curated pure ones run, file writers never
        assert rref.rpc_sync().sum() == 0.0
        with pytest.raises(rpcdist.CallPolicyError):
            rref.rpc_sync().dump(str(tmp_path / "other"))
        del rref
    assert not (tmp_path / "other").exists()


def test_a_method_allowed_once_is_remembered_per_type_never_per_instance():
    from rpcdist._serialization._functions import check_method

    class Box:
        def get(self):
            return 1

    plain, rigged = Box(), Box()
    check_method(DEFAULT_POLICY, plain, "get")  # allowed, and remembered for Box.get
    check_method(DEFAULT_POLICY, plain, "get")
    rigged.get = os.system  # an instance's own attribute: checked every time
    with pytest.raises(rpcdist.CallPolicyError):
        check_method(DEFAULT_POLICY, rigged, "get")
    with pytest.raises(rpcdist.CallPolicyError):  # a refusal is not remembered as allowed
        check_method(DEFAULT_POLICY, np_zeros(), "tofile")
    with pytest.raises(rpcdist.CallPolicyError):
        check_method(DEFAULT_POLICY, np_zeros(), "tofile")


def np_zeros():
    import numpy as np

    return np.zeros(2)
