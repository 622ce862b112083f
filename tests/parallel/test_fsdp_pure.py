"""FSDP's configuration objects, without processes: wrap policies, mixed precision."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from rpcdist import ConfigError, nn
from rpcdist.parallel import MixedPrecision, ModuleWrapPolicy, size_based_auto_wrap_policy
from rpcdist.parallel._fsdp_policy import resolve_mixed_precision


def test_size_policy_counts_unclaimed_parameters():
    policy = size_based_auto_wrap_policy(min_num_params=100)
    lin = nn.Linear(10, 10)
    assert policy(lin, 110) and policy(lin, 100)
    assert not policy(lin, 99)
    assert "100" in repr(policy)
    with pytest.raises(ConfigError, match="min_num_params"):
        size_based_auto_wrap_policy(-1)


def test_module_policy_matches_classes_with_parameters():
    policy = ModuleWrapPolicy({nn.Linear})
    assert policy(nn.Linear(2, 2), 6)
    assert not policy(nn.Linear(2, 2), 0)  # everything already claimed below
    assert not policy(nn.Tanh(), 6)
    assert "Linear" in repr(policy)
    with pytest.raises(ConfigError, match="module classes"):
        ModuleWrapPolicy(["Linear"])  # type: ignore[list-item]


def test_mixed_precision_names():
    assert MixedPrecision("fp16").param_dtype == "float16"
    assert MixedPrecision(np.float16).reduce_dtype == "float16"
    mp = MixedPrecision(param_dtype="bfloat16", reduce_dtype="float16")
    assert (mp.param_dtype, mp.reduce_dtype) == ("bfloat16", "float16")
    assert resolve_mixed_precision("bf16") == MixedPrecision("bfloat16", "bfloat16")
    assert resolve_mixed_precision(None) is None
    with pytest.raises(ConfigError, match="int8"):
        MixedPrecision("int8")
    with pytest.raises(ConfigError, match="mixed_precision"):
        resolve_mixed_precision(3)


def _pytorch_size_policy(module, recurse, nonwrapped_numel, min_num_params=100):
    """PyTorch's size policy, as its users write their own."""
    return True if recurse else nonwrapped_numel >= min_num_params


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(10, 10)  # 110 parameters
        self.b = nn.Linear(2, 2)  # 6


def _picked(policy):
    from rpcdist.parallel._fsdp import _wrap
    from rpcdist.parallel._fsdp_policy import as_wrap_policy

    picked = []
    model = nn.Sequential(_Block(), nn.Linear(3, 3))
    _wrap(model, as_wrap_policy(policy), lambda m: picked.append(type(m).__name__) or m)
    return picked


def test_pytorch_policy_forms_are_accepted():
    ours = _picked(size_based_auto_wrap_policy(100))
    assert ours == ["Linear"]  # the block's big Linear; the rest (18) is below 100
    assert _picked(_pytorch_size_policy) == ours
    assert _picked(functools.partial(_pytorch_size_policy, min_num_params=100)) == ours
    assert _picked(functools.partial(size_based_auto_wrap_policy, min_num_params=100)) == ours


def test_pytorch_policy_that_declines_to_recurse_leaves_the_module_to_its_parent():
    # As in PyTorch: recurse=False for a module means neither it nor anything
    # under it becomes a unit; its parameters stay with the enclosing unit.
    def no_recurse_into_blocks(module, recurse, nonwrapped_numel):
        if recurse:
            return not isinstance(module, _Block)
        return nonwrapped_numel >= 100

    assert _picked(no_recurse_into_blocks) == []
    assert _picked(functools.partial(no_recurse_into_blocks)) == []

    def wrap_big_leaves(module, recurse, nonwrapped_numel):
        return True if recurse else nonwrapped_numel >= 100 and not isinstance(module, _Block)

    assert _picked(wrap_big_leaves) == ["Linear"]  # only the block's 110-parameter Linear


def test_a_policy_that_is_not_callable_is_refused():
    from rpcdist.parallel._fsdp_policy import as_wrap_policy

    with pytest.raises(ConfigError, match="auto_wrap_policy must be callable"):
        as_wrap_policy(100)
