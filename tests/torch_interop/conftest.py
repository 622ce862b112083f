"""The PyTorch interop tests need torch; without it they are skipped."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("torch.distributed.rpc")
