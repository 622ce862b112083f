"""A hand-made peer of the plain-socket transport: hello, then raw bytes."""

from __future__ import annotations

import socket
import struct
from collections import deque
from typing import Any

import msgpack

from rpcdist._serialization import encode
from rpcdist._transport import _tcp, _tcp_dial
from rpcdist._transport._frames import (
    CALL,
    Frame,
    OutMessage,
    pack_batch,
    pack_envelope,
    parse_envelope,
)

_LEN = struct.Struct("<I")


def call_record(method: str, args: tuple[Any, ...], call_id: int = 1) -> bytes:
    """One stream message carrying a call of ``method(*args)``."""
    header, bufs = encode((args, {}))
    return pack_batch(deque([OutMessage(CALL, method, header, bufs, id=call_id)]), 1 << 20, 1 << 20)


def claim_record(nbytes: int, call_id: int = 7) -> bytes:
    """The head of a call announcing ``nbytes`` of array data (none follows)."""
    header = encode(((0,), {}))[0]
    f = Frame(call_id, CALL, True, False, "rel_funcs:echo", header, (nbytes,), data_len=16)
    return pack_envelope([f]) + b"\0" * 16


class RawPeer:
    """A socket that presents itself as worker ``rank``/``name`` with ``token``."""

    def __init__(self, address: str, *, rank: int, name: str, token: str | None) -> None:
        self.sock = socket.create_connection(_tcp_dial.split_address(address), timeout=10)
        body = msgpack.packb({"rank": rank, "name": name, "token": token})
        self.sock.sendall(_tcp.MAGIC + _LEN.pack(len(body)) + body)
        (n,) = _LEN.unpack(self.recv_exact(4))
        self.answer = msgpack.unpackb(self.recv_exact(n))

    @property
    def refused(self) -> str | None:
        return self.answer.get("error") if isinstance(self.answer, dict) else "?"

    def recv_exact(self, n: int) -> bytes:
        return self.sock.recv(n, socket.MSG_WAITALL)

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def read_reply(self) -> list[Frame]:
        """The frames of the next stream message."""
        (n,) = _LEN.unpack(self.recv_exact(4))
        return parse_envelope(memoryview(self.recv_exact(n)))

    def until_closed(self) -> bytes:
        got = b""
        try:
            while chunk := self.sock.recv(1 << 16):
                got += chunk
        except ConnectionResetError:
            pass
        return got

    def close(self) -> None:
        self.sock.close()
