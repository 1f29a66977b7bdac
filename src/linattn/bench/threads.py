"""`linattn bench threads`: thread scaling of the compiled CPU kernels, on a quiet machine and with a busy core.

Cases: causal linear attention (elu+1, normalised) and Gated DeltaNet (L2-normalised q, k, sigmoid beta, a log-gate
per head), chunk form on the compiled CPU backend, forward and forward+backward, at B = 1, H = 4, K = V = 64,
T = 16384 by default (one long sequence: the threads must split it, there are fewer heads than cores to hide in).

Levels (--levels): `op`, the public call (`linear_attention`, `delta_rule` with backend="cpu": the input checks, the
feature map or the delta rule's preparation and the output layout around the kernels, which are torch operators with
their own threads), and `kernel`, the compiled kernels' custom ops alone on prepared inputs (the features, the
normalised keys), so that the kernels' own scaling is seen apart from what surrounds them.

Timing: every (case, thread count) is called once per round, the rounds repeated (--repeats), the order of the
calls reversed every other round; `torch.set_num_threads` is set before each call (untimed). A case's speedup at
n threads is the median over rounds of (its 1-thread time / its n-thread time in the same round), so that a change
of background load hits both sides of a ratio alike; the table also gives each median time.

--busy-core starts one busy-loop process (`while True: pass`, a child at this process's priority and affinity)
before the first call and stops it after the last: one core is held for the whole run, as on a shared machine or
under a CPU quota, and no thread count may then be slower than 1 thread. The 1/5/15-minute load averages are
recorded before the busy loop starts and at the end (the busy loop itself then counts about 1).

The OpenMP runtime's wait policy (OMP_WAIT_POLICY, read when the runtime loads) is recorded: by default an idle
OpenMP thread spins for a while after every parallel region (torch's and the kernels' share one runtime), which on a
core held by another process takes time from the threads that work; `passive` makes it sleep at once.

The default run takes under a minute on two quiet cores; --quick runs a tiny configuration (the test suite runs it).
"""
from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from typing import Any, Callable, Dict, List

import torch

from ..cli_support import UsageError, int_at_least
from ..io import atomic_write_text, write_json
from . import common

DESCRIPTION = __doc__
PROG = "linattn bench threads"
OPS = ("linear", "gated_deltanet")
PASSES = ("fwd", "fwd+bwd")
LEVELS = ("op", "kernel")
QUICK = dict(T=256, repeats=2)
BUSY_LOOP = "while True:\n    pass\n"


def add_arguments(p) -> None:
    """The options of `linattn bench threads`.

    Args:
        p: The argparse parser to add them to.
    """
    p.add_argument("--T", type=int_at_least(1), default=16384, help="tokens of the one sequence (default 16384)")
    p.add_argument("--B", type=int_at_least(1), default=1, help="sequences (default 1)")
    p.add_argument("--H", type=int_at_least(1), default=4, help="heads (default 4)")
    p.add_argument("--K", type=int_at_least(1), default=64, help="key width (default 64)")
    p.add_argument("--V", type=int_at_least(1), default=64, help="value width (default 64)")
    p.add_argument("--threads", default="1,2", help="comma list of thread counts; 1 is always added (default 1,2)")
    p.add_argument("--ops", default=",".join(OPS), help=f"comma list of {', '.join(OPS)} (default both)")
    p.add_argument("--passes", default=",".join(PASSES), help=f"comma list of {', '.join(PASSES)} (default both)")
    p.add_argument("--levels", default=",".join(LEVELS),
                   help=f"comma list of {', '.join(LEVELS)}: the public call, the kernels alone (default both)")
    p.add_argument("--repeats", type=int_at_least(1), default=9, help="rounds of timed calls (default 9)")
    p.add_argument("--busy-core", action="store_true",
                   help="hold one core with a busy-loop child process (same priority) for the whole run")
    p.add_argument("--seed", type=int, default=0, help="seed of the inputs (default 0)")
    p.add_argument("--quick", action="store_true", help="a tiny configuration (T 256, 2 rounds) for a smoke test")
    p.add_argument("--out", default=None, help="output folder (default results/bench/threads/)")
    p.add_argument("--overwrite", action="store_true", help="replace existing output files")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")


def _int_list(text: str, what: str) -> List[int]:
    try:
        out = sorted({int(s) for s in text.split(",") if s.strip()} | {1})
    except ValueError:
        raise UsageError(f"{what}: expected a comma list of integers, got {text!r}", prog=PROG) from None
    if out[0] < 1:
        raise UsageError(f"{what}: thread counts must be >= 1, got {text!r}", prog=PROG)
    return out


def _names(text: str, allowed, what: str) -> List[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    bad = [n for n in names if n not in allowed]
    if bad or not names:
        raise UsageError(f"{what}: unknown {bad}; choose from {', '.join(allowed)}", prog=PROG)
    return names


def make_kernel_case(op: str, passes: str, a) -> Callable[[], Any]:
    """A zero-argument call of `op`'s compiled kernels alone (the registered custom ops) on prepared, flat inputs
    [B T, H, D]: the forward, or the forward keeping its states and then the backward kernel."""
    from ..cpu import delta as cdelta, linear as clinear

    gen = torch.Generator().manual_seed(a.seed)
    B, T, H, K, V = a.B, a.T, a.H, a.K, a.V
    TT, grad = B * T, passes == "fwd+bwd"
    starts = [i * T for i in range(B + 1)]

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    q, k, v, do = randn(TT, H, K), randn(TT, H, K), randn(TT, H, V), randn(TT, H, V)
    if op == "linear":
        fwd, bwd, fmap = torch.ops.linattn.cpu_linear_chunk_fwd, torch.ops.linattn.cpu_linear_chunk_bwd, \
            clinear.FMAPS["elu+1"]

        def run():
            num, den, S, P, _ = fwd(q, k, v, None, None, starts, 64, True, fmap, 1.0, grad, 1e-6)
            if grad:
                bwd(q, k, v, None, P, do, None, None, starts, 64, True, fmap, 1.0, num, den, 1e-6)
            return num
        return run
    q, k = torch.nn.functional.normalize(q, dim=-1), torch.nn.functional.normalize(k, dim=-1)
    beta, g = torch.sigmoid(randn(TT, H)), -torch.nn.functional.softplus(randn(TT, H)) / 16
    st = torch.tensor(starts, dtype=torch.int64)
    n_ck = T // cdelta.CHECKPOINT + (T % cdelta.CHECKPOINT > 0)
    ck_off = torch.tensor([i * n_ck for i in range(B)], dtype=torch.int64)
    fwd, bwd = torch.ops.linattn.cpu_delta_fwd, torch.ops.linattn.cpu_delta_bwd

    def run_delta():
        o, S, ck = fwd(q, k, v, beta, g, None, st, ck_off, B * n_ck if grad else 0)
        if grad:
            bwd(q, k, v, beta, g, ck, st, ck_off, do, torch.zeros_like(S))
        return o
    return run_delta


def make_case(op: str, passes: str, a) -> Callable[[], Any]:
    """A zero-argument call of `op` ("linear" or "gated_deltanet") on the compiled CPU backend, forward or forward
    and backward (the gradients of q, k, v (and beta, g) from a fixed output gradient)."""
    from .. import delta_rule, linear_attention

    gen = torch.Generator().manual_seed(a.seed)
    B, T, H, K, V = a.B, a.T, a.H, a.K, a.V

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    grad = passes == "fwd+bwd"
    if op == "linear":
        x = {"q": randn(B, T, H, K), "k": randn(B, T, H, K), "v": randn(B, T, H, V)}

        def call(x):
            return linear_attention(x["q"], x["k"], x["v"], feature_map="elu+1", causal=True, normalize=True,
                                    mode="chunk", backend="cpu")
    else:
        q, k = torch.nn.functional.normalize(randn(B, T, H, K), dim=-1), randn(B, T, H, K)
        x = {"q": q, "k": torch.nn.functional.normalize(k, dim=-1), "v": randn(B, T, H, V),
             "beta": torch.sigmoid(randn(B, T, H)), "g": -torch.nn.functional.softplus(randn(B, T, H)) / 16}

        def call(x):
            return delta_rule(x["q"], x["k"], x["v"], x["beta"], g=x["g"], mode="chunk", backend="cpu")
    x = {n: t.requires_grad_(grad) for n, t in x.items()}
    do = randn(B, T, H, V)

    def run():
        o = call(x)
        o = o[0] if isinstance(o, tuple) else o
        if grad:
            for t in x.values():
                t.grad = None
            o.backward(do)
        return o

    return run


def busy_start() -> subprocess.Popen:
    # a child inherits this process's nice value and cpu affinity: the same priority
    return subprocess.Popen([sys.executable, "-c", BUSY_LOOP], stdin=subprocess.DEVNULL)


def busy_stop(p: subprocess.Popen) -> None:
    p.terminate()
    try:
        p.wait(timeout=5)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()


def _set_threads(n: int, wake: torch.Tensor) -> None:
    """torch's thread count, then one small parallel op untimed: the pool's threads are up before the timed call."""
    torch.set_num_threads(n)
    wake.sum()


def measure(cases: List[Dict[str, Any]], counts: List[int], repeats: int, log) -> None:
    """Fills each case's "ms" {threads: [per-round ms]}: one warm-up call per (case, threads), then `repeats`
    rounds of one timed call each, the order reversed every other round."""
    calls = [(c, n) for c in cases for n in counts]
    wake = torch.ones(1 << 18)
    for c in cases:
        c["ms"] = {n: [] for n in counts}
    for c, n in calls:
        _set_threads(n, wake)
        c["fn"]()
    log("warmed up")
    for r in range(repeats):
        for c, n in (calls if r % 2 == 0 else calls[::-1]):
            _set_threads(n, wake)
            t0 = time.perf_counter()
            c["fn"]()
            c["ms"][n].append((time.perf_counter() - t0) * 1e3)
        log(f"round {r + 1}/{repeats}")


def summarise(cases: List[Dict[str, Any]], counts: List[int]) -> List[Dict[str, Any]]:
    """One record per case: median ms per thread count and the median paired speedup over 1 thread."""
    out = []
    for c in cases:
        rec = {"level": c["level"], "op": c["op"], "pass": c["pass"], "median_ms": {}, "speedup": {},
               "speedup_min": {}, "ms": c["ms"]}
        for n in counts:
            rec["median_ms"][n] = statistics.median(c["ms"][n])
            ratios = [a / b for a, b in zip(c["ms"][1], c["ms"][n])]
            rec["speedup"][n] = statistics.median(ratios)
            rec["speedup_min"][n] = min(ratios)
        out.append(rec)
    return out


def _report(records: List[Dict[str, Any]], counts: List[int]) -> str:
    head = ["level", "op", "pass"] + [f"{n} thr ms" for n in counts] + [f"{n} thr speedup (min)" for n in counts
                                                                        if n > 1]
    rows = []
    for r in records:
        rows.append([r["level"], r["op"], r["pass"]] + [common.fmt_ms(r["median_ms"][n]) for n in counts]
                    + [f"{r['speedup'][n]:.2f}x ({r['speedup_min'][n]:.2f}x)" for n in counts if n > 1])
    return common.format_table(head, rows)


def run(a) -> int:
    """Run the `linattn bench threads` benchmark (module docstring).

    Args:
        a: The options parsed with `add_arguments` (`linattn bench threads --help` lists them).

    Returns:
        The exit code (0: success).

    Raises:
        UsageError: Bad options, or the compiled kernels are not available.
    """
    if a.quick:
        for k, v in QUICK.items():
            setattr(a, k, v)
    counts = _int_list(a.threads, "--threads")
    ops, passes = _names(a.ops, OPS, "--ops"), _names(a.passes, PASSES, "--passes")
    levels = _names(a.levels, LEVELS, "--levels")
    from ..cpu import available

    if not (available("linear") and available("delta")):
        raise UsageError("the compiled CPU kernels are not available (LINATTN_CPU_KERNELS=0 or no C compiler)",
                         prog=PROG)
    _, log = common.start_run(None, "cpu", a.quiet)
    paths = common.output_paths("threads", a.out, exts=("txt", "json"), overwrite=a.overwrite)
    info = common.machine_info("cpu")
    busy = busy_start() if a.busy_core else None
    try:
        cases = [{"level": lv, "op": op, "pass": ps,
                  "fn": (make_case if lv == "op" else make_kernel_case)(op, ps, a)}
                 for lv in levels for op in ops for ps in passes]
        measure(cases, counts, a.repeats, log)
    finally:
        if busy is not None:
            busy_stop(busy)
    load_end = common.loadavg()
    records = summarise(cases, counts)
    head = [PROG, common.describe_machine(info),
            f"shape    B {a.B}, T {a.T}, H {a.H}, K {a.K}, V {a.V}, fp32, chunk form, backend cpu",
            f"timing   {a.repeats} rounds, one call per (case, threads) each, order reversed every other round; "
            f"speedup = median over rounds of the paired ratio (min in brackets)",
            f"busy     {'one busy-loop process held a core for the whole run' if busy else 'no busy loop'}; "
            f"load at the end {' '.join(map(str, load_end or []))}",
            f"openmp   OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(unset: idle threads spin a while)')}"]
    text = _report(records, counts)
    print("\n".join(head) + "\n\n" + text)
    atomic_write_text(paths["txt"], "\n".join(head) + "\n\n" + text + "\n")
    write_json(paths["json"], {"benchmark": "threads", "machine": info, "load_end": load_end,
                               "busy_core": bool(busy), "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
                               "config": {k: v for k, v in vars(a).items() if k != "func"},
                               "records": records})
    print(f"\nwrote {paths['txt']}, {paths['json']}")
    return 0
