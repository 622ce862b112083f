"""What the distributed autograd tests share: waiting for contexts to be freed."""

from __future__ import annotations

import gc
import time
from collections.abc import Sequence
from typing import Any


def contexts_settled(agents: Sequence[Any], timeout: float = 10.0) -> bool:
    """Whether every agent's live autograd contexts reach 0 within ``timeout``
    (releases travel as control messages, so they land a little after ``with``)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        gc.collect()
        if all(a.statistics()["autograd_contexts"] == 0 for a in agents):
            return True
        time.sleep(0.01)
    return False
