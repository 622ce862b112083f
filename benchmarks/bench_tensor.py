"""Local engine speed: an MLP step, LSTM forward+backward, a language-model step.

Run as ``.venv/bin/python benchmarks/bench_tensor.py [--quick] [--no-write]``;
it rewrites the "tensor" section of docs/benchmarks.md. PyTorch (CPU) is
measured in the same run when installed, in alternating blocks, with its
intra-op threads set to the threads NumPy's BLAS uses (read through
threadpoolctl when installed, else ``os.cpu_count()``, OpenBLAS's default).

The language-model ("LM") step is the local half of bench_dist_autograd's
"rnn" workload: embedding (1000 x 64), 2-layer LSTM (hidden 128), decoder
Linear(128, 1000), sequence 35, batch 20, cross-entropy, backward, one SGD
step. It is measured four ways, each in a fresh child process: BLAS and
torch threads at their default or at 1 (bench_dist_autograd runs one compute
thread per process), and glibc malloc as it comes or told to keep freed
memory (``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``): as it comes,
a step that frees megabytes of temporaries hands them back to the kernel
and faults them in again next step, and how much of that a framework does is
part of its cost here.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _report import median, table, write_section

import rpcdist.tensor as rt
from rpcdist import nn
from rpcdist.nn import functional as F
from rpcdist.optim import SGD
from rpcdist.tensor import AccumulateGrad, compute_dependencies

BATCH, SIZES = 128, (784, 256, 256, 10)
LSTM_LAYERS, LSTM_SEQ, LSTM_BATCH = 2, 35, 20
LSTM_CASES = ((64, 128), (256, 256))  # (input, hidden): the rnn workload's, the older row's
LM_VOCAB, LM_EMB, LM_HIDDEN, LM_SEQ, LM_BATCH = 1000, 64, 128, 35, 20
KEEP_FREED = {"MALLOC_MMAP_THRESHOLD_": str(1 << 28), "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}
ONE_THREAD = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
AVX512_KERNELS = {"OPENBLAS_CORETYPE": "SkylakeX"}


def has_avx512() -> bool:
    """Whether this CPU runs AVX-512 (so OpenBLAS's SkylakeX kernels can be forced)."""
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and " avx512f" in line for line in f)
    except OSError:
        return False


def interleaved(
    fns: dict[str, Callable[[], Any]], repeats: int, rounds: int = 5, pause: float = 0.5
) -> dict[str, list[float]]:
    """Seconds per call of each function, measured in alternating blocks.

    Alternating blocks spread background load evenly over the contenders. Each
    block starts after a pause and two untimed calls, so that the previous
    contender's BLAS/OpenMP worker threads have stopped spinning and do not
    compete for the cores.
    """
    times: dict[str, list[float]] = {name: [] for name in fns}
    per_round = max(1, repeats // rounds)
    for _ in range(rounds):
        for name, fn in fns.items():
            time.sleep(pause)
            fn()
            fn()
            for _ in range(per_round):
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
    return times


def summary(times: dict[str, list[float]]) -> dict[str, tuple[float, float]]:
    """(median, best) per contender, in milliseconds."""
    return {k: (median(v) * 1e3, min(v) * 1e3) for k, v in times.items()}


def blas_threads() -> tuple[int, str]:
    """Threads NumPy's BLAS uses, and a description of that BLAS."""
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        n = int(os.environ.get("OPENBLAS_NUM_THREADS", os.cpu_count() or 1))
        return n, f"NumPy's BLAS, {n} threads (threadpoolctl not installed: assumed)"
    for info in threadpool_info():
        if info.get("user_api") == "blas":
            arch = info.get("architecture") or "?"
            desc = f"{info.get('internal_api')} {info.get('version')}, {arch} kernels"
            return int(info["num_threads"]), desc
    return 1, "no BLAS found by threadpoolctl"


def import_torch(threads: int) -> Any:
    try:
        import torch
    except ImportError:
        return None
    torch.set_num_threads(threads)
    return torch


# ---------------------------------------------------------------- MLP step


def mlp_data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH, SIZES[0])).astype(np.float32)
    y = rng.integers(0, SIZES[-1], size=BATCH)
    return x, y


def build_mlp() -> nn.Module:
    gen = rt.Generator(0)
    return nn.Sequential(
        nn.Linear(SIZES[0], SIZES[1], generator=gen),
        nn.ReLU(),
        nn.Linear(SIZES[1], SIZES[2], generator=gen),
        nn.ReLU(),
        nn.Linear(SIZES[2], SIZES[3], generator=gen),
    )


def rpcdist_mlp_step() -> tuple[Callable[[], None], int]:
    """The step, and how many operations its graph records."""
    x_np, y = mlp_data()
    model = build_mlp()
    opt = SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = rt.tensor(x_np)

    def step() -> None:
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()

    loss = F.cross_entropy(model(x), y)
    assert loss.grad_fn is not None
    deps = compute_dependencies([loss.grad_fn])
    n_ops = sum(1 for n in deps if not isinstance(n, AccumulateGrad))
    return step, n_ops


def numpy_mlp_step() -> Callable[[], None]:
    """The same step as raw NumPy operations: the floor the engine adds to."""
    x, y = mlp_data()
    model = build_mlp()
    params = [p.data.copy() for p in model.parameters()]
    bufs: list[np.ndarray | None] = [None] * len(params)
    rows = np.arange(BATCH)

    def step() -> None:
        w1, b1, w2, b2, w3, b3 = params
        z1 = x @ w1.T
        z1 += b1
        a1 = np.maximum(z1, 0)
        z2 = a1 @ w2.T
        z2 += b2
        a2 = np.maximum(z2, 0)
        z3 = a2 @ w3.T
        z3 += b3
        logp = z3 - z3.max(axis=1, keepdims=True)
        logp -= np.log(np.exp(logp).sum(axis=1, keepdims=True))
        _ = -logp[rows, y].sum() / BATCH
        g3 = np.exp(logp)
        g3[rows, y] -= 1
        g3 *= np.float32(1.0 / BATCH)
        grads = [None] * 6
        grads[5] = g3.sum(axis=0)
        grads[4] = g3.T @ a2
        ga2 = g3 @ w3
        gz2 = ga2 * (a2 > 0)
        grads[3] = gz2.sum(axis=0)
        grads[2] = gz2.T @ a1
        ga1 = gz2 @ w2
        gz1 = ga1 * (a1 > 0)
        grads[1] = gz1.sum(axis=0)
        grads[0] = gz1.T @ x
        for i, (p, g) in enumerate(zip(params, grads)):
            buf = bufs[i]
            if buf is None:
                buf = bufs[i] = g.copy()
            else:
                buf *= 0.9
                buf += g
            p -= 0.01 * buf

    return step


def torch_mlp_step(torch: Any) -> Callable[[], None]:
    x_np, y_np = mlp_data()
    model = build_mlp()
    theirs = torch.nn.Sequential(
        torch.nn.Linear(SIZES[0], SIZES[1]),
        torch.nn.ReLU(),
        torch.nn.Linear(SIZES[1], SIZES[2]),
        torch.nn.ReLU(),
        torch.nn.Linear(SIZES[2], SIZES[3]),
    )
    theirs.load_state_dict({k: torch.from_numpy(v) for k, v in model.state_dict().items()})
    opt = torch.optim.SGD(theirs.parameters(), lr=0.01, momentum=0.9)
    x, y = torch.from_numpy(x_np), torch.from_numpy(y_np)

    def step() -> None:
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(theirs(x), y)
        loss.backward()
        opt.step()

    return step


# ---------------------------------------------------------------- LSTM


def lstm_pair(torch: Any, n_in: int, hidden: int) -> dict[str, Callable[[], None]]:
    """LSTM forward + backward (loss over the output and the final state), both frameworks."""
    rng = np.random.default_rng(1)
    x_np = rng.normal(size=(LSTM_SEQ, LSTM_BATCH, n_in)).astype(np.float32)
    w_np = rng.normal(size=(LSTM_SEQ, LSTM_BATCH, hidden)).astype(np.float32)
    ours = nn.LSTM(n_in, hidden, num_layers=LSTM_LAYERS, generator=rt.Generator(0))
    x, w = rt.tensor(x_np, requires_grad=True), rt.tensor(w_np)

    def run() -> None:
        ours.zero_grad()
        out, (h, c) = ours(x)
        ((out * w).sum() + h.sum() + c.sum()).backward()

    fns = {"rpcdist": run}
    if torch is not None:
        theirs = torch.nn.LSTM(n_in, hidden, num_layers=LSTM_LAYERS)
        theirs.load_state_dict({k: torch.from_numpy(v) for k, v in ours.state_dict().items()})
        tx, tw = torch.from_numpy(x_np).requires_grad_(True), torch.from_numpy(w_np)

        def trun() -> None:
            theirs.zero_grad()
            out, (h, c) = theirs(tx)
            ((out * tw).sum() + h.sum() + c.sum()).backward()

        fns["torch"] = trun
    return fns


# ---------------------------------------------------------------- LM step


def lm_pair(torch: Any, ours_too: bool = True) -> dict[str, Callable[[], None]]:
    """One training step of the LM, both frameworks (or PyTorch's only), same weights and data."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, LM_VOCAB, (LM_SEQ, LM_BATCH))
    target = rng.integers(0, LM_VOCAB, LM_SEQ * LM_BATCH)
    gen = rt.Generator(0)
    mods = [
        nn.Embedding(LM_VOCAB, LM_EMB, generator=gen),
        nn.LSTM(LM_EMB, LM_HIDDEN, num_layers=2, generator=gen),
        nn.Linear(LM_HIDDEN, LM_VOCAB, generator=gen),
    ]
    opt = SGD([p for m in mods for p in m.parameters()], lr=0.01)

    def step() -> None:
        opt.zero_grad()
        out, _ = mods[1](mods[0](tokens))
        loss = F.cross_entropy(mods[2](out.reshape(LM_SEQ * LM_BATCH, LM_HIDDEN)), target)
        loss.backward()
        opt.step()

    fns = {"rpcdist": step} if ours_too else {}
    if torch is not None:
        theirs = [
            torch.nn.Embedding(LM_VOCAB, LM_EMB),
            torch.nn.LSTM(LM_EMB, LM_HIDDEN, num_layers=2),
            torch.nn.Linear(LM_HIDDEN, LM_VOCAB),
        ]
        for a, b in zip(mods, theirs):
            b.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in a.state_dict().items()})
        topt = torch.optim.SGD([p for m in theirs for p in m.parameters()], lr=0.01)
        tt, ty = torch.from_numpy(tokens), torch.from_numpy(target)

        def tstep() -> None:
            topt.zero_grad()
            out, _ = theirs[1](theirs[0](tt))
            flat = out.reshape(LM_SEQ * LM_BATCH, LM_HIDDEN)
            loss = torch.nn.functional.cross_entropy(theirs[2](flat), ty)
            loss.backward()
            topt.step()

        fns["torch"] = tstep
    return fns


def faults_per_call(fn: Callable[[], Any], calls: int = 20) -> float:
    """Minor page faults per call, after two warm-up calls."""
    fn()
    fn()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(calls):
        fn()
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / calls


def lm_child(repeats: int, torch_only: bool) -> None:
    """Measure the LM step in this process; print the result as JSON."""
    threads, blas = blas_threads()
    torch = import_torch(threads)
    fns = lm_pair(torch, ours_too=not torch_only)
    faults = {k: faults_per_call(f) for k, f in fns.items()}
    times = interleaved(fns, repeats, rounds=8, pause=0.3)
    out = {
        "threads": threads,
        "blas": blas,
        "times": summary(times),
        "faults": faults,
        "torch_threads": torch.get_num_threads() if torch is not None else None,
    }
    print(json.dumps(out))


def lm_measure(env: dict[str, str], repeats: int, torch_only: bool = False) -> dict[str, Any]:
    """Run :func:`lm_child` in a fresh process with ``env`` added."""
    cmd = [sys.executable, __file__, "--lm-child", "--lm-repeats", str(repeats)]
    if torch_only:
        cmd.append("--torch-only")
    done = subprocess.run(
        cmd, env={**os.environ, **env}, capture_output=True, text=True, check=True, timeout=900
    )
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


# ---------------------------------------------------------------- report


def mlp_section(torch: Any, repeats: int, threads: str) -> str:
    step, n_ops = rpcdist_mlp_step()
    contenders = {"rpcdist": step, "numpy": numpy_mlp_step()}
    if torch is not None:
        contenders["torch"] = torch_mlp_step(torch)
    mlp = summary(interleaved(contenders, repeats))
    (t_ours, b_ours), (t_raw, b_raw) = mlp["rpcdist"], mlp["numpy"]
    t_torch, b_torch = mlp.get("torch", (float("nan"), float("nan")))
    overhead_us = (t_ours - t_raw) * 1e3 / n_ops
    overhead_best_us = (b_ours - b_raw) * 1e3 / n_ops
    rows: list[list[object]] = [
        ["rpcdist", t_ours, b_ours, t_ours / t_torch],
        ["raw NumPy (same arithmetic, no engine)", t_raw, b_raw, t_raw / t_torch],
    ]
    if torch is not None:
        rows.append(["PyTorch CPU", t_torch, b_torch, 1.0])
    mlp_table = table(
        ["implementation", "median step (ms)", "best (ms)", "median vs PyTorch"], rows
    )
    return f"""
### MLP training step

784-256-256-10 MLP (ReLU), batch {BATCH}, float32, cross-entropy, SGD with
momentum 0.9: zero_grad + forward + backward + step; {repeats} steps per
contender in alternating blocks ({threads}). "best" is the fastest step, a
guide when the machine is shared and medians wander.

{mlp_table}

Engine overhead per recorded operation (its forward, its backward node and
the optimizer's share), over the {n_ops} operations the step records:
({t_ours:.3f} - {t_raw:.3f}) ms / {n_ops} = **{overhead_us:.1f} µs** from the
medians, ({b_ours:.3f} - {b_raw:.3f}) ms / {n_ops} = **{overhead_best_us:.1f} µs**
from the best steps (less sensitive to other load on the machine).
"""


def lstm_section(torch: Any, repeats: int) -> str:
    rows: list[list[object]] = []
    for n_in, hidden in LSTM_CASES:
        got = summary(interleaved(lstm_pair(torch, n_in, hidden), repeats, rounds=8))
        ours, theirs = got["rpcdist"], got.get("torch", (float("nan"), float("nan")))
        rows.append([f"{n_in} → {hidden}", *ours, *theirs, ours[0] / theirs[0]])
    lstm_table = table(
        [
            "input → hidden",
            "rpcdist median (ms)",
            "rpcdist best",
            "PyTorch median",
            "PyTorch best",
            "median vs PyTorch",
        ],
        rows,
    )
    return f"""
### LSTM forward + backward

{LSTM_LAYERS}-layer LSTM, sequence {LSTM_SEQ}, batch {LSTM_BATCH}, float32;
loss over the whole output and the final state; {repeats} passes per
contender in alternating blocks. All layers are one graph node: per layer one
GEMM projects every step's input, then each step does one `W_hh @ h` GEMM on
feature-major `(4H, B)` blocks and eight in-place array calls; BPTT ends with
one GEMM per weight gradient (`rpcdist/nn/_lstm_core.py`).

{lstm_table}
"""


def lm_section(repeats: int, have_torch: bool) -> str:
    as_is, kept = "as it comes", "keeps freed memory"
    runs: list[tuple[str, str, dict[str, str]]] = [
        (as_is, "detected", {}),
        (kept, "detected", KEEP_FREED),
        (as_is, "detected", ONE_THREAD),
        (kept, "detected", {**ONE_THREAD, **KEEP_FREED}),
    ]
    _, detected = blas_threads()
    if has_avx512() and "SkylakeX" not in detected and "Cooperlake" not in detected:
        runs += [
            (kept, "SkylakeX, forced", {**KEEP_FREED, **AVX512_KERNELS}),
            (kept, "SkylakeX, forced", {**ONE_THREAD, **KEEP_FREED, **AVX512_KERNELS}),
        ]
    nan = float("nan")
    rows: list[list[object]] = []
    for malloc, kernels, env in runs:
        got = lm_measure(env, repeats)
        alone = lm_measure(env, repeats, torch_only=True) if have_torch else None
        ours = got["times"]["rpcdist"]
        theirs = got["times"].get("torch", [nan, nan])
        solo = alone["times"]["torch"][0] if alone else nan
        f_ours = got["faults"]["rpcdist"]
        f_theirs = got["faults"].get("torch", nan)
        threads = f"{got['threads']} / {got['torch_threads']}"
        faults = f"{f_ours:,.0f} / {f_theirs:,.0f}"
        row = [threads, malloc, kernels, *ours, *theirs, ours[0] / theirs[0], solo, faults]
        rows.append(row)
    lm_table = table(
        [
            "BLAS / torch threads",
            "glibc malloc",
            "OpenBLAS kernels",
            "rpcdist median (ms)",
            "rpcdist best",
            "PyTorch median",
            "PyTorch best",
            "median vs PyTorch",
            "PyTorch median, own process",
            "page faults per step (rpcdist / PyTorch)",
        ],
        rows,
    )
    return f"""
### Language-model training step

The local half of bench_dist_autograd's "rnn" workload: embedding
({LM_VOCAB} x {LM_EMB}) + 2-layer LSTM (hidden {LM_HIDDEN}) + decoder
Linear({LM_HIDDEN}, {LM_VOCAB}) + cross-entropy, sequence {LM_SEQ}, batch
{LM_BATCH}, float32; zero_grad + forward + backward + SGD step. Each row is a
fresh process, {repeats} steps per contender in alternating blocks; "own
process" is PyTorch measured again in a process where rpcdist does not run.
"keeps freed memory" sets `MALLOC_MMAP_THRESHOLD_` and `MALLOC_TRIM_THRESHOLD_`
so that glibc stops handing freed blocks back to the kernel. With malloc as
it comes, PyTorch's step faults its temporaries in afresh every step (last
column), and how many depends on what else the process allocates; rpcdist's
fused layers reuse their large buffers (`rpcdist/nn/_buffers.py`). The rows
that keep freed memory compare the arithmetic alone. NumPy's BLAS here is
{detected}: on this CPU OpenBLAS's detection falls back to its AVX2
kernels, while PyTorch's LSTM runs oneDNN's AVX-512 code; the last rows
force OpenBLAS's AVX-512 kernels (`OPENBLAS_CORETYPE=SkylakeX`, a process
setting that PyTorch ignores) to show what that costs.

{lm_table}
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=200, help="timed MLP steps")
    parser.add_argument("--lstm-repeats", type=int, default=48, help="timed LSTM passes")
    parser.add_argument("--lm-repeats", type=int, default=160, help="timed LM steps per row")
    parser.add_argument("--quick", action="store_true", help="few repeats, to check it runs")
    parser.add_argument("--no-write", action="store_true", help="print, do not write the report")
    parser.add_argument("--lm-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--torch-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.lstm_repeats, args.lm_repeats = 20, 8, 16
    if args.lm_child:
        lm_child(args.lm_repeats, args.torch_only)
        return
    n_threads, _ = blas_threads()
    torch = import_torch(n_threads)
    threads = (
        f"NumPy's BLAS and torch {n_threads} threads each" if torch else "PyTorch not installed"
    )
    body = mlp_section(torch, args.repeats, threads)
    body += lstm_section(torch, args.lstm_repeats)
    body += lm_section(args.lm_repeats, torch is not None)
    body += """
Figures from a 2-core VM shared with other work while they were taken; they
are to be re-measured in a quiet window.
"""
    if args.no_write:
        print(body)
    else:
        write_section("tensor", "Local tensor engine", body)


if __name__ == "__main__":
    main()
