import time

import pytest

from rpcdist import UNSET, ConfigError
from rpcdist._deadline import current_deadline, deadline_for, remaining


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
