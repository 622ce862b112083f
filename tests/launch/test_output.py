"""Rank-prefixed output: the line splitter, the pump, and whole jobs."""

from __future__ import annotations

import io
import os
import re
from collections import Counter
from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st
from launch_util import SCRIPTS

from rpcdist.launch._output import LineBuffer, OutputPump, prefix_for

CHATTER = str(SCRIPTS / "chatter.py")


def test_prefix_names_the_rank():
    assert prefix_for(3) == b"[rank 3] "


def test_line_buffer_holds_a_partial_line_until_its_newline():
    buf = LineBuffer()
    assert buf.feed(b"ab") == []
    assert buf.feed(b"c\nde\n\nf") == [b"abc\n", b"de\n", b"\n"]
    assert buf.flush() == b"f\n"
    assert buf.flush() is None


def test_line_buffer_cuts_an_overlong_partial_line():
    buf = LineBuffer(max_partial=4)
    assert buf.feed(b"abcdefghij") == [b"abcd\n", b"efgh\n"]
    assert buf.feed(b"k\n") == [b"ijk\n"]


@given(
    st.binary(max_size=300).map(lambda b: b.replace(b"\r", b"\n")),
    st.lists(st.integers(0, 300), max_size=8),
)
def test_line_buffer_reassembles_any_chunking(data, cuts):
    buf = LineBuffer(max_partial=1 << 20)
    lines = []
    start = 0
    for cut in [*sorted(cuts), len(data)]:
        lines += buf.feed(data[start : max(start, cut)])
        start = max(start, cut)
    rest = buf.flush()
    lines += [rest] if rest is not None else []
    expected = data if data.endswith(b"\n") or not data else data + b"\n"
    assert b"".join(lines) == expected
    assert all(line.endswith(b"\n") and line.count(b"\n") == 1 for line in lines)


def _pump_with_pipes(n: int) -> tuple[OutputPump, io.BytesIO, io.BytesIO, list[int]]:
    out, err = io.BytesIO(), io.BytesIO()
    pump = OutputPump(SimpleNamespace(buffer=out), SimpleNamespace(buffer=err))
    writers = []
    for rank in range(n):
        r, w = os.pipe()
        pump.add(os.fdopen(r, "rb"), prefix_for(rank), "stdout" if rank % 2 == 0 else "stderr")
        writers.append(w)
    pump.start()
    return pump, out, err, writers


def test_pump_prefixes_each_pipe_and_flushes_a_dead_writer_s_partial_line():
    pump, out, err, (w0, w1) = _pump_with_pipes(2)
    os.write(w0, b"hello ")
    os.write(w1, b"on stderr\nand no newline")
    os.write(w0, b"world\n")
    os.close(w1)
    os.close(w0)
    pump.finish(timeout=10)
    assert out.getvalue() == b"[rank 0] hello world\n"
    assert err.getvalue() == b"[rank 1] on stderr\n[rank 1] and no newline\n"


def test_pump_gives_up_on_a_pipe_someone_else_keeps_open():
    pump, out, _, (w0,) = _pump_with_pipes(1)
    os.write(w0, b"partial")
    pump.finish(timeout=0.05)  # a grandchild holds the pipe: stop copying anyway
    os.close(w0)
    assert out.getvalue() == b"[rank 0] partial\n"


# ---------------------------------------------------------------- processes

LINE = re.compile(r"\[rank (\d)\] (out|err) (\d) (\d+) x{60}")


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_job_output_is_prefixed_and_never_interleaved_within_a_line(launchers):
    proc = launchers.start("--nproc-per-node", "3", CHATTER, "150", separate=True)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, out + err
    seen: Counter[tuple[str, str, str, str]] = Counter()
    for stream, text in (("out", out), ("err", err)):
        for line in text.splitlines():
            if line.startswith("[rank 2] tail"):
                continue
            if line.startswith("[rank"):
                match = LINE.fullmatch(line)
                assert match, f"mangled line on std{stream}: {line!r}"
                assert match[1] == match[3] and match[2] == stream
                seen[match.groups()] += 1
    assert set(seen.values()) == {1}
    assert len(seen) == 3 * 2 * 150  # every line of every rank, once
    assert "[rank 2] tail without newline\n" in out  # died without a newline


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_no_prefix_leaves_the_child_s_output_alone(launchers):
    # One worker: without the launcher in between, several would interleave their pieces.
    rc, out = launchers.run("--nproc-per-node", "1", "--no-prefix", CHATTER, "2")
    assert rc == 0, out
    assert "out 0 1 " + "x" * 60 in out.splitlines()
    assert "err 0 1 " + "x" * 60 in out.splitlines()
    assert "[rank" not in out and "tail without newline[rpcdist-run]" in out
