"""FSDP's configuration objects, without processes: wrap policies, mixed precision."""

from __future__ import annotations

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
