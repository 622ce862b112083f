"""Three "hosts" on this machine: network namespaces joined by a lossy, slow switch.

This kernel has network namespaces, veth pairs and bridges, but no ``netem``
qdisc (nor tc classifiers), so delay and loss cannot come from the kernel.
They come from a user-space switch instead: each namespace gets a TAP
device as its only link (``eth0``, 10.x.y.h/24), whose other end is a file
descriptor held by the switch process. The switch forwards Ethernet frames
between the ports (learning MACs, flooding the rest) after a fixed one-way
delay per pair of hosts (5 to 20 ms) and drops 1% of them at random, so TCP
sees real loss and retransmits. Frames leave each port in order (no
reordering, as on a wire). A partition is a link taken down inside a
namespace (``ip link set eth0 down``).

:class:`Lab` also builds the plain topology the issue describes, three
namespaces on veth pairs and a kernel bridge (no delay, no loss), where a
partition is the namespace's veth taken down.

Everything is made by the tests and removed in ``close()``, failure or not:
the namespaces (which takes their devices with them), the bridge, the
root-side veth ends and the switch process.
"""

from __future__ import annotations

import ctypes
import fcntl
import heapq
import os
import random
import select
import struct
import subprocess
import time
from typing import Any

_TUNSETIFF = 0x400454CA
_IFF_TAP, _IFF_NO_PI = 0x0002, 0x1000
_CLONE_NEWNET = 0x40000000
#: One-way delay between hosts (ms), a fixed value per pair in [5, 20].
PAIR_DELAY_MS = {(0, 1): 5.0, (0, 2): 12.0, (1, 2): 20.0}
LOSS = 0.01


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def cannot_build() -> str | None:
    """Why namespaces cannot be made here (``None``: they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if not os.path.exists("/dev/net/tun"):
        return "no /dev/net/tun"
    probe = f"rpcdprobe{os.getpid() % 100000}"
    try:
        _ip("netns", "add", probe)
    except (OSError, subprocess.CalledProcessError) as e:
        return f"cannot create a network namespace: {getattr(e, 'stderr', e)}"
    try:
        _ip("netns", "del", probe)
    except subprocess.CalledProcessError:
        pass
    return None


def enter(namespace: str) -> None:
    """Move this (single-threaded, freshly forked) process into ``namespace``."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{namespace}", os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns({namespace}) failed")
    finally:
        os.close(fd)


class Lab:
    """Three namespaces; ``kind`` is ``"switch"`` (delay, loss) or ``"bridge"``."""

    def __init__(self, kind: str) -> None:
        tag = f"{os.getpid() % 10000}{random.randrange(100)}"
        self.kind = kind
        self.namespaces = [f"rpcd{tag}h{i}" for i in range(3)]
        net = random.randrange(16, 250)
        self.ips = [f"10.{net}.{random.randrange(1, 250)}.{i + 1}" for i in range(3)]
        self.ips = [f"{self.ips[0].rsplit('.', 1)[0]}.{i + 1}" for i in range(3)]
        self.bridge = f"rpcdbr{tag}"
        self.veths = [f"rpcd{tag}v{i}" for i in range(3)]
        self._switch: Any = None
        self._made: list[tuple[str, ...]] = []
        try:
            for ns in self.namespaces:
                _ip("netns", "add", ns)
                self._made.append(("netns", "del", ns))
                _ip("-n", ns, "link", "set", "lo", "up")
            if kind == "bridge":
                self._build_bridge()
            else:
                self._build_switch()
        except BaseException:
            self.close()
            raise

    def _build_bridge(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        self._made.append(("link", "del", self.bridge))
        _ip("link", "set", self.bridge, "up")
        for ns, veth, ip in zip(self.namespaces, self.veths, self.ips):
            _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            self._made.append(("link", "del", veth))
            _ip("link", "set", veth, "master", self.bridge)
            _ip("link", "set", veth, "up")
            _ip("-n", ns, "addr", "add", f"{ip}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")

    def _build_switch(self) -> None:
        import harness

        ctx = harness.context()
        parent, child = ctx.Pipe()
        self._switch = ctx.Process(
            target=run_switch, args=(self.namespaces, self.ips, child), daemon=True
        )
        self._switch.start()
        child.close()
        if not parent.poll(30):
            raise RuntimeError("the switch did not start")
        status = parent.recv()
        if status != "ready":
            raise RuntimeError(f"the switch failed: {status}")

    def partition(self, host: int) -> None:
        """Cut ``host`` off: its link goes down."""
        _ip("-n", self.namespaces[host], "link", "set", "eth0", "down")

    def close(self) -> None:
        if self._switch is not None:
            self._switch.kill()
            self._switch.join(10)
            self._switch = None
        for cmd in reversed(self._made):
            try:
                _ip(*cmd)
            except subprocess.CalledProcessError:
                pass  # gone with its namespace
        self._made.clear()


def run_switch(namespaces: list[str], ips: list[str], conn: Any) -> None:
    """The switch process: make a TAP per namespace, then forward frames."""
    fds: list[int] = []
    try:
        for i, (ns, ip) in enumerate(zip(namespaces, ips)):
            fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
            name = f"rpcdtap{os.getpid() % 10000}{i}"
            fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH", name.encode(), _IFF_TAP | _IFF_NO_PI))
            fds.append(fd)
            _ip("link", "set", name, "netns", ns)
            _ip("-n", ns, "link", "set", name, "name", "eth0")
            _ip("-n", ns, "addr", "add", f"{ip}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
    except BaseException as e:
        conn.send(f"{type(e).__name__}: {e}")
        return
    conn.send("ready")
    _forward(fds)


def _forward(fds: list[int]) -> None:
    rnd = random.Random(16)
    macs: dict[bytes, int] = {}
    due: list[tuple[float, int, int, bytes]] = []
    last = [0.0] * len(fds)
    seq = 0
    while True:
        now = time.monotonic()
        while due and due[0][0] <= now:
            _, _, port, frame = heapq.heappop(due)
            try:
                os.write(fds[port], frame)
            except OSError:
                pass  # that link is down: the frame is lost
        wait = max(0.0, due[0][0] - now) if due else 1.0
        readable, _, _ = select.select(fds, [], [], wait)
        now = time.monotonic()
        for src in readable:
            i = fds.index(src)
            for _ in range(64):
                try:
                    frame = os.read(src, 65536)
                except (BlockingIOError, OSError):
                    break
                if len(frame) < 14 or rnd.random() < LOSS:
                    continue
                macs[frame[6:12]] = i
                dst = macs.get(frame[0:6])
                for j in [dst] if dst is not None else [p for p in range(len(fds)) if p != i]:
                    if j == i:
                        continue
                    t = now + PAIR_DELAY_MS[(min(i, j), max(i, j))] / 1000.0
                    t = last[j] = max(t, last[j])  # in order, as on a wire
                    seq += 1
                    heapq.heappush(due, (t, seq, j, frame))
