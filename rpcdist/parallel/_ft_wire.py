"""Frames of the fault-tolerant mode: a JSON header and raw bytes, over plain TCP.

A frame is ``!II`` (header length, payload length), the header (UTF-8 JSON
object) and the payload. No pickle: state travels as ``rpcdist.save``'s
``.npz`` bytes, or as raw arrays named in the header (:func:`pack`).
"""

from __future__ import annotations

import json
import socket
import struct
from typing import Any

import numpy as np

from .._errors import WorkerLostError

__all__ = ["connect", "listen", "pack", "recv_frame", "recv_into", "send_frame", "unpack"]

_HEAD = struct.Struct("!II")


def send_frame(sock: socket.socket, header: dict[str, Any], payload: Any = b"") -> None:
    """Send one frame (``payload``: bytes or a contiguous array)."""
    head = json.dumps(header).encode()
    view = memoryview(payload).cast("B")
    sock.sendall(_HEAD.pack(len(head), view.nbytes) + head)
    if view.nbytes:
        sock.sendall(view)


def recv_into(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from ``sock``.

    Raises:
        WorkerLostError: the peer closed the connection first.
    """
    got = 0
    while got < view.nbytes:
        n = sock.recv_into(view[got:])
        if n == 0:
            raise WorkerLostError("fault tolerance: a peer closed its connection")
        got += n


def recv_frame(sock: socket.socket) -> tuple[dict[str, Any], bytearray]:
    """Receive one frame: its header and payload.

    Raises:
        WorkerLostError: the peer closed the connection.
    """
    head = bytearray(_HEAD.size)
    recv_into(sock, memoryview(head))
    hlen, plen = _HEAD.unpack(head)
    body = bytearray(hlen)
    recv_into(sock, memoryview(body))
    payload = bytearray(plen)
    recv_into(sock, memoryview(payload))
    header: dict[str, Any] = json.loads(body)
    return header, payload


def connect(address: str, timeout: float | None) -> socket.socket:
    """A TCP connection to ``host:port`` with Nagle off."""
    host, _, port = address.rpartition(":")
    sock = socket.create_connection((host, int(port)), timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def listen(host: str) -> socket.socket:
    """A listening TCP socket on ``host`` and a free port."""
    sock = socket.create_server((host, 0), backlog=64)
    return sock


def pack(arrays: list[Any]) -> tuple[list[list[Any]], bytes]:
    """Arrays as ``[[dtype, count], ...]`` and their bytes laid end to end."""
    specs = [[str(a.dtype), int(a.size)] for a in arrays]
    return specs, b"".join(np.ascontiguousarray(a).tobytes() for a in arrays)


def unpack(specs: list[list[Any]], payload: Any) -> list[Any]:
    """The arrays :func:`pack` laid out (flat; views of ``payload``)."""
    out, at = [], 0
    for dtype, count in specs:
        dt = np.dtype(dtype)
        out.append(np.frombuffer(payload, dt, int(count), at))
        at += dt.itemsize * int(count)
    return out
