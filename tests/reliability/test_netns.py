"""A multi-host topology on one machine: three network namespaces.

Over a switch that delays every frame 5-20 ms and drops 1% (see
``netlab.py``: this kernel has no netem, so the switch is a user-space
process), and over veth pairs on a kernel bridge: RPC, RRefs and all_reduce
across the "hosts"; then host 2 is partitioned (its link goes down) and
every side must declare the other lost within the detector's window.
Skipped, with the reason, where namespaces cannot be made.
"""

from __future__ import annotations

import random

import harness
import netlab
import pytest
import rel_workers as rw

from rpcdist._rpc._liveness import REMOTE_FACTOR

pytestmark = [pytest.mark.multiprocess]

OPTS = {"heartbeat_interval": 0.25, "peer_timeout": 2.0}
#: The detector's window for a peer on another "host" (no view of its
#: process: the network namespaces differ), and a margin for a loaded
#: 2-core machine.
WINDOW = REMOTE_FACTOR * OPTS["peer_timeout"] + 2 * OPTS["heartbeat_interval"]
MARGIN = 3.0


@pytest.fixture(params=["switch", "bridge"])
def lab(request):
    why = netlab.cannot_build()
    if why is not None:
        pytest.skip(f"no network namespaces here: {why}")
    try:
        made = netlab.Lab(request.param)
    except Exception as e:  # e.g. no TAP support in a container
        pytest.skip(f"cannot build the {request.param} topology: {e}")
    try:
        yield made
    finally:
        made.close()


@pytest.mark.timeout(180)
def test_rpc_rrefs_and_all_reduce_across_hosts_and_a_partition_is_detected_everywhere(lab):
    part = ["ip", "-n", lab.namespaces[2], "link", "set", "eth0", "down"]
    spec = {
        "namespaces": lab.namespaces,
        "ips": lab.ips,
        "port": random.randrange(20000, 60000),
        "partition": part,
    }
    res = harness.run_job(rw.netns_job, 3, (spec, OPTS), timeout=150)
    assert not res.errors, res.errors
    assert not res.hung, res.hung
    v = res.values
    for rank in range(3):
        assert v[rank]["rref_sum"] == 1000
        assert v[rank]["all_reduce"] == 6.0
    if lab.kind == "switch":  # the switch's delay shows in every round trip
        for rank in range(3):
            for peer, ms in v[rank]["rtt_ms"].items():
                pair = tuple(sorted((rank, int(peer[1]))))
                assert ms >= 2 * netlab.PAIR_DELAY_MS[pair] * 0.9, (rank, peer, ms)
    cut = v[0]["partitioned_at"]
    seconds = {}
    for rank in range(3):
        for peer, at in v[rank]["detected_at"].items():
            seconds[(rank, peer)] = at - cut
            assert "nothing came from it" in v[rank][f"error_{peer}"], v[rank]
    assert set(seconds) == {(0, "h2"), (1, "h2"), (2, "h0"), (2, "h1")}
    assert all(0 < s <= WINDOW + MARGIN for s in seconds.values()), seconds
    assert v[0]["lost"] == ["h2"] and v[1]["lost"] == ["h2"]
    assert set(v[2]["lost"]) == {"h0", "h1"}
