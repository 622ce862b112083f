"""What a frame costs the CPU: packing no-op calls into stream messages and
reading them back, per frame, one message alone and 64 coalesced.

* ``pack``: :func:`pack_batch` of fresh no-op call messages (with a deadline,
  as every call has), the message objects made beforehand;
* ``parse``: :func:`parse_envelope` of the packed envelope alone;
* ``feed``: :meth:`Reassembler.feed` of the whole stream message (the
  envelope and a whole :class:`InMessage` per frame, as a receiver does).

Microseconds a frame, the best of ``--repeats`` timings. Run it against
another checkout with ``PYTHONPATH=<checkout>`` to compare::

    python benchmarks/probe_frames.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import time
import timeit
from collections import deque

from rpcdist._transport._frames import CALL, OutMessage, Reassembler, pack_batch, parse_envelope

_N = 2000  # stream messages a timing


def _calls(k: int) -> deque[OutMessage]:
    deadline = time.monotonic() + 60
    return deque(
        OutMessage(CALL, "bench_funcs:noop", b"\x92\x90\x80", [], id=1000 + i, deadline=deadline)
        for i in range(k)
    )


def probe(k: int, repeats: int) -> dict[str, float]:
    """µs a frame of each stage, for stream messages of ``k`` frames."""
    packs = []
    for _ in range(repeats):
        queues = [_calls(k) for _ in range(_N)]
        t = time.perf_counter()
        for q in queues:
            pack_batch(q, 1 << 20, 1 << 20)
        packs.append(time.perf_counter() - t)
    data = pack_batch(_calls(k), 1 << 20, 1 << 20)
    env = memoryview(data)[4 : 4 + int.from_bytes(data[:4], "little")]
    r = Reassembler()
    parse = timeit.repeat(lambda: parse_envelope(env), number=_N, repeat=repeats)
    feed = timeit.repeat(lambda: r.feed(data), number=_N, repeat=repeats)
    per = 1e6 / _N / k
    return {"pack": min(packs) * per, "parse": min(parse) * per, "feed": min(feed) * per}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    for k in (1, 64):
        got = probe(k, a.repeats)
        print(f"{k:3} a message: " + ", ".join(f"{s} {v:.2f} µs" for s, v in got.items()))


if __name__ == "__main__":
    main()
