"""RPC and a torch process group share one ``file://`` rendezvous: rpcdist
keeps its own file beside the path, which torch's FileStore owns."""

from __future__ import annotations

import pytest
import shared_file_prog

from rpcdist.testing import run_workers

pytestmark = [pytest.mark.multiprocess, pytest.mark.torch]


@pytest.mark.timeout(120)
def test_gloo_group_on_the_rpc_file_rendezvous_completes():
    pytest.importorskip("torch")
    got = run_workers(shared_file_prog.run, 2, args=("rpcdist",), timeout=90)
    assert got == [([3.0] * 4, [1.0, 1.0]), ([3.0] * 4, [2.0, 2.0])]
