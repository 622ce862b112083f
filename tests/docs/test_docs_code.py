"""The documentation's code runs: every whole program in the docs and the README
runs with the command its first line gives and prints the output shown after
it; every other Python block compiles.

Each program runs in a fresh temporary directory, in a session of its own
under a hard timeout; the whole session is killed on the way out, so no worker
outlives a failing test.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import docs_code
import pytest

PAGES = [*sorted(docs_code.DOCS.rglob("*.md")), docs_code.REPO / "README.md"]
PROGRAMS = [p for page in PAGES for p in docs_code.programs(page)[0]]
# The PyTorch side of the side-by-side programs runs where torch is installed.
PROGRAM_CASES = [
    pytest.param(p, id=p.id, marks=[pytest.mark.torch] if p.uses_torch else []) for p in PROGRAMS
]
FRAGMENTS = [b for page in PAGES for b in docs_code.programs(page)[1]]

#: Pages written for newcomers: each shows at least one whole program.
GUIDES = ["index.md", "getting-started.md", "migrating.md", "guides"]


def _run(prog: docs_code.Program, cwd: Path, timeout: float) -> tuple[int, str]:
    (cwd / prog.file).write_text(prog.block.code, encoding="utf-8")
    # A clean environment: no launcher variables inherited from a parent job.
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "RPCDIST_TOKEN")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    proc = subprocess.Popen(
        [sys.executable, *prog.argv],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        out = f"(killed after {timeout} s)"
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            more, _ = proc.communicate()
            out += more or ""
    return proc.returncode, out


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
@pytest.mark.parametrize("prog", PROGRAM_CASES)
def test_program_runs_and_prints_what_the_page_shows(prog, tmp_path):
    if prog.uses_torch:
        pytest.importorskip("torch")
    code, out = _run(prog, tmp_path, timeout=120)
    assert code == 0, f"{prog.id} exited with {code}:\n{out}"
    missing = docs_code.missing_lines(prog.expected, out)
    assert not missing, f"{prog.id} did not print {missing}; it printed:\n{out}"


@pytest.mark.parametrize("block", FRAGMENTS, ids=[b.id for b in FRAGMENTS])
def test_fragment_compiles(block):
    compile(block.code, block.id, "exec")


def test_every_guide_page_has_a_program():
    pages = {p.block.page for p in PROGRAMS}
    for name in GUIDES:
        target = docs_code.DOCS / name
        files = sorted(target.rglob("*.md")) if target.is_dir() else [target]
        assert files, f"docs/{name} is missing"
        for f in files:
            if f.name.startswith("_"):
                continue
            rel = str(f.relative_to(docs_code.REPO))
            assert rel in pages, f"{rel} shows no whole program (a block run by this test)"


def test_extraction_reads_commands_and_expected_output(tmp_path):
    page = tmp_path / "p.md"
    page.write_text(
        "# t\n\n"
        "```python\n"
        "# a.py — run with:  python -m rpcdist.launch --nproc-per-node 3 a.py --n 2\n"
        "print(1)\n"
        "```\n\n"
        '```text title="output"\n[rank 0] 1\n...\n```\n\n'
        "```python\nx = f(1)  # a fragment\n```\n"
        "```python\n# b.py — run with:  python b.py\nprint(2)\n```\n"
        "```text\nnot checked\n```\n",
        encoding="utf-8",
    )
    progs, frags = docs_code.programs(page)
    assert [p.file for p in progs] == ["a.py", "b.py"]
    assert progs[0].argv == ["-m", "rpcdist.launch", "--nproc-per-node", "3", "a.py", "--n", "2"]
    assert progs[0].expected == ["[rank 0] 1"]
    assert progs[1].argv == ["b.py"] and progs[1].expected == []
    assert [f.code for f in frags] == ["x = f(1)  # a fragment\n"]
    assert docs_code.missing_lines(["[rank 0] 1", "[rank 1] 1"], "[rank 1] 1\n[rank 0] 1  \n") == []
    assert docs_code.missing_lines(["[rank 0] 2"], "[rank 0] 1\n") == ["[rank 0] 2"]
    assert docs_code.missing_lines(["loss ..., acc ...%"], "loss 0.25, acc 91.5%\n") == []
    assert docs_code.missing_lines(["loss ..., acc ...%"], "loss 0.25, acc 91.5\n") != []
    assert docs_code.missing_lines(["a(1)"], "a(1) and more\n") == ["a(1)"]


def test_a_command_that_does_not_run_its_file_is_refused(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("```python\n# a.py — run with:  python b.py\n```\n", encoding="utf-8")
    with pytest.raises(ValueError, match="does not run a.py"):
        docs_code.programs(page)


def test_docs_stand_alone_in_the_repository():
    """No page, nor the README or the site's configuration, points outside the
    repository (design notes kept elsewhere are dead links in a clone)."""
    outside = ("../shared", "/work/shared", "shared/design", "shared/STYLE")
    files = [*PAGES, docs_code.REPO / "mkdocs.yml"]
    for f in files:
        text = f.read_text(encoding="utf-8")
        for needle in outside:
            assert needle not in text, f"{f.relative_to(docs_code.REPO)} mentions {needle!r}"
