import time

import pytest

from rpcdist import UNSET, ConfigError
from rpcdist._deadline import current_deadline, deadline_after, deadline_for, remaining, seconds_of


def test_unset_uses_default_and_none_or_zero_mean_no_deadline():
    now = time.monotonic()
    d = deadline_for(UNSET, 5.0)
    assert d is not None and now + 4.9 < d < now + 5.1
    assert deadline_for(UNSET, None) is None
    assert deadline_for(None, 5.0) is None
    assert deadline_for(0, 5.0) is None
    d2 = deadline_for(0.5, 5.0)
    assert d2 is not None and d2 < now + 1


@pytest.mark.parametrize("bad", [-1, float("nan"), "3", True])
def test_bad_timeouts_are_config_errors(bad):
    with pytest.raises(ConfigError):
        deadline_for(bad, 1.0)


def test_inherited_deadline_caps_own_timeout():
    inherited = time.monotonic() + 1.0
    token = current_deadline.set(inherited)
    try:
        assert deadline_for(10.0, 60.0) == inherited
        assert deadline_for(None, 60.0) == inherited
        own = deadline_for(0.1, 60.0)
        assert own is not None and own < inherited
    finally:
        current_deadline.reset(token)
    assert remaining(None) is None
    assert remaining(time.monotonic() - 1) == 0.0


def test_a_checked_default_gives_the_same_deadlines_as_deadline_for():
    """The agent checks its default timeout once (``seconds_of``) and each
    call takes ``deadline_after`` of it: the same rules, inherited cap included."""
    assert seconds_of(None) is None and seconds_of(0) is None
    assert seconds_of(float("inf")) is None and seconds_of(2.5) == 2.5
    for bad in [-1, float("nan"), "3", True]:
        with pytest.raises(ConfigError):
            seconds_of(bad)
    assert deadline_after(None) is None
    now = time.monotonic()
    d = deadline_after(5.0)
    assert d is not None and now + 4.9 < d < now + 5.1
    inherited = time.monotonic() + 1.0
    token = current_deadline.set(inherited)
    try:
        assert deadline_after(None) == inherited  # no timeout of its own: the cap alone
        assert deadline_after(10.0) == inherited
        d = deadline_after(0.1)
        assert d is not None and d < inherited
    finally:
        current_deadline.reset(token)


def test_set_rpc_timeout_checks_the_value_and_changes_the_default_deadline():
    from rpcdist._rpc._agent import Agent

    agent = Agent.__new__(Agent)  # (the setter alone: no rendezvous, no threads)
    agent.rpc_timeout = 2.0
    assert agent._timeout_s == 2.0
    agent.rpc_timeout = 0
    assert agent._timeout_s is None and agent.rpc_timeout == 0
    with pytest.raises(ConfigError):
        agent.rpc_timeout = -1.0
    assert agent.rpc_timeout == 0 and agent._timeout_s is None  # unchanged
