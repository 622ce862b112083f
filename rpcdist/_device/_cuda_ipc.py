"""CuPy arrays between workers of one host through CUDA IPC, not host memory.

Without this, a CuPy array in a call or reply is copied to host memory,
sent as bytes and uploaded again at the receiver. Between two workers on one
host (the same boot id) whose devices can reach each other, a large array
instead crosses in device memory:

* the **sender** copies it into a *staging block* (device memory of its own,
  exported once with ``cudaIpcGetMemHandle``) and sends the block's handle,
  the array's dtype and shape, a lend id and the lend's expiry, instead of
  its bytes. The copy is a snapshot: the caller may change its array as soon
  as the call returns, as with host arrays;
* the **receiver** maps the block (``cudaIpcOpenMemHandle``, once per block,
  cached), copies it into a new array on its current device, and sends the
  lend id back in an unordered control message (``cuda_ipc.release``, batched
  per peer); the sender then reuses the block.

What keeps this safe:

* **A probe before first use.** The first large array for a peer (per device
  of the sender's) travels through host memory while the sender asks the
  peer (``cuda_ipc.probe``) to map a block and read a random pattern from
  it. Only if it reads it back does the peer get handles from then on; a
  peer without CuPy, on another host or device it cannot map, or in the same
  process, keeps the host path. A message never depends on IPC working.
* **Leases.** Every lend carries an expiry on the host's monotonic clock
  (shared by every process of one host). The sender takes back a lend that
  is neither released nor expired only when the peer is lost; an expired one
  it takes back when it needs room. A receiver that would copy out of an
  expired lend, or finishes its copy after the expiry, raises
  ``SerializationError`` instead of returning what may be another array's
  bytes. A message that is dropped undecoded therefore holds its block for
  one lease at most.
* **A cap, and idle blocks go back.** An agent's staging blocks total
  ``CAP`` bytes at most; beyond that arrays take the host path. A block
  unused for ``IDLE`` seconds is retired: every peer it was lent to unmaps
  it (``cuda_ipc.unmap``), then it is freed, so a burst of large arrays
  does not hold device memory for the rest of the job.

Turned off by ``RpcOptions.cuda_ipc=False`` (or ``RPCDIST_CUDA_IPC=0``): the
agent's codec then has no CUDA IPC hook, and its probes are refused. CuPy is
imported only when a CuPy array is sent or a probe arrives.

The agent installs this extension when it is made (:func:`install_cuda_ipc`):
it registers the three internal handlers on the agent's registry and, when
turned on, itself as the CUDA IPC hook of the agent's codec (it has the
``_serialization._hooks.CupyIpcHook`` methods).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import secrets
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from .._errors import RpcdistError, SerializationError
from .._worker import WorkerInfo
from ._cuda_runtime import Block, Runtime
from ._host import Host, Outbox

__all__ = ["CudaIpc", "install_cuda_ipc"]

_log = logging.getLogger(__name__)

PROBE: Final = "cuda_ipc.probe"
RELEASE: Final = "cuda_ipc.release"
UNMAP: Final = "cuda_ipc.unmap"
#: Arrays smaller than this take the host path: an IPC lend costs a control
#: message and a device synchronisation on each side (where the two paths
#: break even: docs/benchmarks.md, "Figures behind the code's choices").
MIN_BYTES: Final = 1 << 19
#: The smallest staging block (blocks are powers of two from here).
MIN_BLOCK: Final = 1 << 20
#: Seconds a lend stays valid without a release.
LEASE: Final = 120.0
#: A receiver refuses a lend with less than this left of its lease.
MARGIN: Final = 1.0
#: Most bytes of staging blocks one agent keeps.
CAP: Final = 4 << 30
#: Seconds a staging block may sit unused before it is unmapped and freed.
IDLE: Final = 60.0
_PATTERN_BYTES: Final = 64


@dataclass(slots=True, eq=False)
class _Lend:
    block: Block
    peer: int
    expiry: float


def _block_size(nbytes: int) -> int:
    return max(MIN_BLOCK, 1 << (nbytes - 1).bit_length())


class CudaIpc:
    """One agent's staging blocks, lends, probes and mapped peer blocks (an
    extension of the agent: see ``_rpc._registry.Extension``)."""

    name = "cuda_ipc"

    def __init__(self, agent: Host, acks: Outbox, runtime: Runtime | None = None) -> None:
        self.agent = agent
        self.enabled = bool(getattr(agent.options, "cuda_ipc", True))
        self._runtime = runtime
        self.token = secrets.token_bytes(8)
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._blocks: list[Block] = []
        self._free: dict[tuple[int, int], list[Block]] = {}
        self._lends: dict[int, _Lend] = {}
        self._held = 0  # bytes of blocks
        #: (peer rank, device) -> True (use IPC), False (never), None (probing).
        self._peers: dict[tuple[int, int], bool | None] = {}
        self._same_host: dict[int, bool] = {}
        #: (exporter token, block id, device) -> (mapped pointer, peer rank).
        self._mapped: dict[tuple[bytes, int, int], tuple[int, int]] = {}
        #: exporter token -> (the device its probe was mapped on here, its rank).
        self._probed_on: dict[bytes, tuple[int, int]] = {}
        #: Releases of the lends received here, on their way to their senders.
        self._acks = acks
        self._trim_timer: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self.sent = 0
        self.received = 0
        self.closed = False

    # ----------------------------------------------------------- runtime

    def runtime(self) -> Runtime:
        if self._runtime is None:
            self._runtime = Runtime()
        return self._runtime

    # ------------------------------------------------------------ sending

    @property
    def min_bytes(self) -> int:
        """Smaller arrays take the host path (the codec asks before copying)."""
        return MIN_BYTES

    def lend(self, wire: Any, array: Any) -> list[Any] | None:
        """Fields for ``array`` sent by handle, or ``None``: take the host path
        (any thread; ``array`` is C-contiguous)."""
        nbytes = int(array.nbytes)
        if not self.enabled or self.closed or nbytes < MIN_BYTES or wire.extra.get("aborted"):
            return None
        if nbytes > self.agent.options.max_message_bytes:
            return None  # the host path refuses it, saying so
        peer = wire.peer.id
        if peer == self.agent.rank or not self._on_this_host(peer):
            return None
        rt = self.runtime()
        device = rt.device_of(array)
        key = (peer, device)
        if key not in self._peers:
            self._start_probe(peer, device)
            return None
        if self._peers[key] is not True:  # probing, or refused
            return None
        try:
            block = self._take_block(device, nbytes)
        except Exception as e:  # (the host path does not need it)
            _log.debug("no CUDA IPC staging block: %r", e)
            return None
        if block is None:
            return None
        try:
            rt.stage(array, block.ptr)
        except Exception as e:  # a fault of the array's own shows on the host path too
            self._put_back(block)
            _log.debug("staging a CuPy array for CUDA IPC failed: %r", e)
            return None
        lend_id = next(self._ids)
        expiry = time.monotonic() + LEASE
        with self._lock:
            block.peers.add(peer)
            self._lends[lend_id] = _Lend(block, peer, expiry)
            self.sent += 1
        wire.extra.setdefault("undo", []).append(lambda: self._release(peer, [lend_id]))
        return [self.token, block.id, block.handle, lend_id, expiry, block.size]

    def _on_this_host(self, peer: int) -> bool:
        same = self._same_host.get(peer)
        if same is None:
            try:
                same = self.agent.links.peer(peer).same_host
            except Exception:
                same = False
            self._same_host[peer] = same
        return same

    def _take_block(self, device: int, nbytes: int) -> Block | None:
        size = _block_size(nbytes)
        with self._lock:
            free = self._free.get((device, size))
            if free:
                return free.pop()
            if self._held + size > CAP:
                self._reclaim_expired()
                free = self._free.get((device, size))
                if free:
                    return free.pop()
                if self._held + size > CAP:
                    return None
            self._held += size
        rt = self.runtime()
        try:
            ptr = rt.malloc(device, size)
        except Exception as e:  # out of device memory: the host path still works
            _log.debug("no CUDA IPC staging block of %d bytes: %s", size, e)
            with self._lock:
                self._held -= size
            return None
        try:
            handle = rt.export(device, ptr)
        except Exception:
            rt.free(device, ptr)
            with self._lock:
                self._held -= size
            raise
        block = Block(next(self._ids), device, size, ptr, handle)
        with self._lock:
            closed = self.closed
            if not closed:
                self._blocks.append(block)
        if closed:  # close() ran meanwhile: it would never free this one
            rt.free(device, ptr)
            return None
        try:
            self.agent.loop.call_soon_threadsafe(self._arm_trim)
        except RuntimeError:  # the loop is gone: close() frees it
            pass
        return block

    def _put_back(self, block: Block) -> None:
        with self._lock:
            self._freed(block)

    def _freed(self, block: Block) -> None:
        """``block`` is free for another lend (with the lock held)."""
        block.idle_since = time.monotonic()
        self._free.setdefault((block.device, block.size), []).append(block)

    def _reclaim_expired(self) -> None:
        """Take back lends past their lease (with the lock held)."""
        now = time.monotonic()
        for lend_id, lend in list(self._lends.items()):
            if lend.expiry <= now:
                del self._lends[lend_id]
                self._freed(lend.block)

    def _release(self, peer: int, lend_ids: list[int]) -> None:
        with self._lock:
            for lend_id in lend_ids:
                lend = self._lends.get(lend_id)
                if lend is not None and lend.peer == peer:
                    del self._lends[lend_id]
                    self._freed(lend.block)

    # ------------------------------------------------------------ probing

    def _start_probe(self, peer: int, device: int) -> None:
        with self._lock:
            if (peer, device) in self._peers:
                return
            self._peers[(peer, device)] = None
        try:
            self.agent.loop.call_soon_threadsafe(self._spawn, self._probe(peer, device))
        except RuntimeError:  # the loop is gone: the agent shut down
            pass

    def _spawn(self, coro: Any) -> None:
        task = self.agent.loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _probe(self, peer: int, device: int) -> None:
        ok: bool = False
        block = None
        try:
            block = self._take_block(device, MIN_BLOCK)
            if block is None:
                return
            block.peers.add(peer)
            pattern = secrets.token_bytes(_PATTERN_BYTES)
            self.runtime().write(device, block.ptr, pattern)
            expiry = time.monotonic() + LEASE
            answer = await self.agent.send_control(
                peer, PROBE, [self.token, block.id, block.handle, pattern, expiry]
            )
            ok = answer is True
            if not ok:
                _log.info(
                    "CuPy arrays from device %d to %s travel through host memory, not CUDA IPC: %s",
                    device,
                    self._name(peer),
                    answer,
                )
        except Exception as e:
            _log.info(
                "CuPy arrays from device %d to %s travel through host memory: the CUDA IPC "
                "probe failed: %r",
                device,
                self._name(peer),
                e,
            )
        finally:
            if block is not None:
                self._put_back(block)
            with self._lock:
                if (peer, device) in self._peers:
                    self._peers[(peer, device)] = ok

    def _name(self, rank: int) -> str:
        try:
            return repr(self.agent.workers[rank].name)
        except Exception:
            return f"rank {rank}"

    def answer_probe(self, src: WorkerInfo, payload: Any) -> object:
        """Map the prober's block and read its pattern: ``True``, or why not."""
        if not self.enabled:
            return "CUDA IPC is turned off here (RpcOptions.cuda_ipc)"
        try:
            token, block_id, handle, pattern, expiry = payload
            rt = self.runtime()
            ptr = self._map(src.id, token, block_id, handle, rt)
            got = rt.read(ptr, len(pattern))
        except Exception as e:
            return f"{type(e).__name__}: {e}"
        if time.monotonic() >= expiry:
            return "the probe's lease ran out"
        if got != pattern:
            return "the mapped block did not hold the pattern"
        with self._lock:
            self._probed_on[token] = (rt.current_device(), src.id)
        return True

    # ----------------------------------------------------------- trimming

    def _arm_trim(self) -> None:
        if self._trim_timer is None and not self.closed:
            self._trim_timer = self.agent.loop.call_later(IDLE / 2, self._trim)

    def _trim(self) -> None:
        """Retire the blocks idle for ``IDLE`` seconds (on the loop)."""
        self._trim_timer = None
        now = time.monotonic()
        with self._lock:
            if self.closed:
                return
            self._reclaim_expired()  # (a lend whose message was dropped unread)
            idle = [b for free in self._free.values() for b in free if now - b.idle_since >= IDLE]
            for b in idle:
                self._free[(b.device, b.size)].remove(b)
            more = len(self._blocks) > len(idle)
        for block in idle:
            self._spawn(self._retire(block))
        if more:
            self._arm_trim()

    async def _retire(self, block: Block) -> None:
        """Have every peer that may map ``block`` unmap it, then free it."""
        for peer in sorted(block.peers):
            try:
                await self.agent.send_control(peer, UNMAP, [self.token, block.id])
            except RpcdistError as e:  # lost: its mapping went with its process
                _log.debug("unmapping CUDA IPC block %d on rank %d: %s", block.id, peer, e)
        with self._lock:
            if self.closed or block not in self._blocks:
                return  # close() frees it
            self._blocks.remove(block)
            self._held -= block.size
        try:
            self.runtime().free(block.device, block.ptr)
        except Exception as e:
            _log.debug("freeing a CUDA IPC staging block: %r", e)

    def unmap(self, token: bytes, block_id: int) -> None:
        """The exporter retires a block: unmap it here (on every device)."""
        with self._lock:
            keys = [k for k in self._mapped if k[0] == token and k[1] == block_id]
            ptrs = [self._mapped.pop(k)[0] for k in keys]
        self._close_all(ptrs)

    # ---------------------------------------------------------- receiving

    def take(
        self, wire: Any, fields: list[Any], shape: tuple[int, ...], dtype: Any, out: Any = None
    ) -> Any:
        """The array a lend holds, copied onto this worker's current device
        (into ``out`` when given: see ``_serialization._hooks.CupyIpcHook.take``)."""
        if len(fields) != 6:
            raise SerializationError("malformed CuPy array payload (CUDA IPC fields)")
        token, block_id, handle, lend_id, expiry, size = fields
        if (
            type(token) is not bytes
            or type(block_id) is not int
            or type(handle) is not bytes
            or type(lend_id) is not int
            or type(expiry) is not float
            or type(size) is not int
        ):
            raise SerializationError("malformed CuPy array payload (CUDA IPC fields)")
        peer = wire.peer
        nbytes = math.prod(shape) * dtype.itemsize
        try:
            if nbytes > size or nbytes > self.agent.options.max_message_bytes:
                raise SerializationError(
                    f"a CuPy array from {peer.name!r} of shape {shape} and dtype {dtype} "
                    f"({nbytes} bytes) does not fit its CUDA IPC block of {size} bytes, or "
                    "exceeds RpcOptions.max_message_bytes"
                )
            if time.monotonic() > expiry - MARGIN:
                raise SerializationError(
                    f"a CuPy array from {peer.name!r} arrived after its CUDA IPC lease "
                    "ran out (the message was delayed too long)"
                )
            try:
                rt = self.runtime()
                ptr = self._map(peer.id, token, block_id, handle, rt)
                out = rt.fetch(ptr, shape, dtype, out)
            except Exception as e:
                raise SerializationError(
                    f"cannot copy a CuPy array from {peer.name!r} through CUDA IPC: "
                    f"{type(e).__name__}: {e}"
                ) from e
            if time.monotonic() >= expiry:
                raise SerializationError(
                    f"copying a CuPy array from {peer.name!r} through CUDA IPC outlasted "
                    "its lease: its bytes may have been reused"
                )
        finally:
            self._acks.post(peer.id, lend_id)
        with self._lock:
            self.received += 1
        return out

    def _map(self, peer: int, token: bytes, block_id: int, handle: bytes, rt: Runtime) -> int:
        """The block mapped here: in the current device's context, else in the
        context its exporter's probe was mapped in (a thread on a device that
        cannot map the peer's memory then copies across devices)."""
        current = rt.current_device()
        probed = self._probed_on.get(token, (current, peer))[0]
        failures: list[Exception] = []
        for device in dict.fromkeys((current, probed)):
            key = (token, block_id, device)
            with self._lock:
                hit = self._mapped.get(key)
            if hit is not None:
                return hit[0]
            try:
                ptr = rt.open(handle, device)
            except Exception as e:
                failures.append(e)
                continue
            with self._lock:
                other = self._mapped.setdefault(key, (ptr, peer))
            if other[0] != ptr:  # another thread mapped it first
                rt.close(ptr)
            return other[0]
        raise failures[0]

    # ----------------------------------------------------------- handlers

    async def on_probe(self, agent: Host, src: WorkerInfo, payload: Any) -> object:
        return self.answer_probe(src, payload)

    async def on_unmap(self, agent: Host, src: WorkerInfo, payload: Any) -> None:
        if type(payload) is list and len(payload) == 2:
            self.unmap(payload[0], payload[1])

    async def on_release(self, agent: Host, src: WorkerInfo, payload: Any) -> None:
        if type(payload) is list and all(type(i) is int for i in payload):
            self._release(src.id, payload)

    # ---------------------------------------------------------- extension

    def statistics(self) -> Mapping[str, int]:
        return {
            "cuda_ipc_lends": len(self._lends),
            "cuda_ipc_block_bytes": self._held,
            "cuda_ipc_sent": self.sent,
            "cuda_ipc_received": self.received,
        }

    def check(self) -> None:
        return None

    async def drain(self) -> None:
        """Graceful shutdown: deliver the releases already due."""
        await self._acks.drain()
        if self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    def peer_lost(self, rank: int) -> None:
        """``rank`` is gone: its lends come back, its blocks are unmapped."""
        with self._lock:
            for lend_id, lend in list(self._lends.items()):
                if lend.peer == rank:
                    del self._lends[lend_id]
                    self._freed(lend.block)
            for key in [k for k in self._peers if k[0] == rank]:
                self._peers[key] = False
            for token in [t for t, v in self._probed_on.items() if v[1] == rank]:
                del self._probed_on[token]
            unmap = [k for k, v in self._mapped.items() if v[1] == rank]
            ptrs = [self._mapped.pop(k)[0] for k in unmap]
        self._acks.drop(rank)
        self._close_all(ptrs)

    def close(self) -> None:
        if self._trim_timer is not None:
            self._trim_timer.cancel()
            self._trim_timer = None
        with self._lock:
            self.closed = True
            blocks, self._blocks = self._blocks, []
            self._free.clear()
            self._lends.clear()
            self._held = 0
            ptrs = [v[0] for v in self._mapped.values()]
            self._mapped.clear()
        self._close_all(ptrs)
        self._acks.close()
        rt = self._runtime
        for block in blocks:
            try:
                rt.free(block.device, block.ptr)  # type: ignore[union-attr]
            except Exception as e:
                _log.debug("freeing a CUDA IPC staging block: %r", e)

    def _close_all(self, ptrs: list[int]) -> None:
        rt = self._runtime
        for ptr in ptrs:
            try:
                rt.close(ptr)  # type: ignore[union-attr]
            except Exception as e:
                _log.debug("unmapping a peer's CUDA IPC block: %r", e)


def install_cuda_ipc(agent: Host, acks: Outbox) -> CudaIpc:
    """Give ``agent`` CUDA IPC for CuPy arrays: its handlers, and (when
    ``RpcOptions.cuda_ipc`` is on) its codec hook. ``acks`` carries the
    releases of received lends (``RELEASE`` messages) to their senders."""
    ipc = CudaIpc(agent, acks)
    agent.registry.add_handler(PROBE, ipc.on_probe)
    agent.registry.add_handler(RELEASE, ipc.on_release)
    agent.registry.add_handler(UNMAP, ipc.on_unmap)
    agent.registry.install(ipc)
    if ipc.enabled:
        agent.codec_hooks.set_cupy_ipc(ipc)
    return ipc
