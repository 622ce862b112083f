"""Bounded memory: a maximum message size, checked before anything is allocated."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import rel_funcs as rf
from rawpeer import RawPeer, call_record, claim_record

import rpcdist
from rpcdist._transport import _frames
from rpcdist._transport._frames import CALL, REPLY, Frame, Reassembler
from rpcdist.testing import local_agents

TiB = 1 << 40


def _frame(i: int, size: int, last: bool = False) -> Frame:
    return Frame(i, CALL, True, last, "m", buffer_sizes=(size,))


def test_a_huge_claim_is_refused_before_any_allocation(monkeypatch):
    def no_alloc(n):
        raise AssertionError(f"allocated {n} bytes")

    monkeypatch.setattr(_frames, "_fresh", no_alloc)
    with pytest.raises(rpcdist.ProtocolError, match="max_message_bytes"):
        Reassembler(max_message_bytes=1 << 20).start_frame(_frame(1, TiB))


def test_many_partial_messages_cannot_add_up_past_the_bound():
    r = Reassembler(max_message_bytes=1 << 20)
    r.start_frame(_frame(1, 1 << 20))
    r.start_frame(_frame(2, 1 << 20))  # two at once is allowed
    with pytest.raises(rpcdist.ProtocolError, match="at once"):
        r.start_frame(_frame(3, 1 << 20))


def test_a_peer_claiming_a_tebibyte_is_dropped_and_the_worker_serves_on(caplog):
    opts = rpcdist.RpcOptions(token="t", local_sockets=False)
    with local_agents(2, options=opts) as (a, b):
        addr = a.links.address(0)
        peer = RawPeer(addr, rank=1, name="worker1", token="t")
        assert peer.refused is None
        with caplog.at_level(logging.WARNING):
            peer.send(claim_record(TiB))
            assert peer.until_closed() == b""  # dropped, nothing answered
        peer.close()
        warned = [r for r in caplog.records if "max_message_bytes" in r.getMessage()]
        assert warned and all(r.exc_info is None for r in caplog.records)  # no traceback
        # The worker serves on: the real worker1 and a new raw connection.
        assert b.rpc_sync(0, rf.add, args=(2, 3)) == 5
        again = RawPeer(addr, rank=1, name="worker1", token="t")
        again.send(call_record("rel_funcs:add", (1, 1)))
        assert [f.kind for f in again.read_reply()] == [REPLY]
        again.close()


def test_sending_more_than_the_limit_fails_at_the_sender_with_a_clear_error():
    opts = rpcdist.RpcOptions(token=None, transport="inproc", max_message_bytes=1 << 20)
    with local_agents(2, options=opts) as (a, _):
        big = np.zeros((1 << 20) + 1, dtype=np.uint8)
        with pytest.raises(rpcdist.SerializationError, match="max_message_bytes"):
            a.rpc_sync(1, rf.echo, args=(big,))
        with pytest.raises(rpcdist.SerializationError, match="reply to 'rel_funcs:ones'"):
            a.rpc_sync(1, rf.ones, args=((1 << 20) + 1,))
        assert a.rpc_sync(1, rf.ones, args=(1000,)).sum() == 1000


def test_the_limit_is_an_option():
    with pytest.raises(rpcdist.ConfigError, match="max_message_bytes"):
        rpcdist.RpcOptions(max_message_bytes=10).validated()
    assert rpcdist.RpcOptions().max_message_bytes == 2 << 30
