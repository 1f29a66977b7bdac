"""`linattn bench threads`: thread scaling of the compiled CPU kernels, on a quiet machine and with a busy core.

Cases: causal linear attention (elu+1, normalised) and Gated DeltaNet (L2-normalised q, k, sigmoid beta, a log-gate
per head), chunk form on the compiled CPU backend, forward and forward+backward, at B = 1, H = 4, K = V = 64,
T = 16384 by default (one long sequence: the threads must split it, there are fewer heads than cores to hide in).

Levels (--levels): `op`, the public call (`linear_attention`, `delta_rule` with backend="cpu": the input checks, the
feature map or the delta rule's preparation and the output layout around the kernels, which are torch operators with
their own threads), and `kernel`, the compiled kernels alone, so that their own scaling is seen apart from what
surrounds them: linear attention's custom ops on prepared inputs (the features); Gated DeltaNet's the compiled scan on
the raw rows, preparing each row as it reads it (`cpu.delta.delta_scan` with `prep`, what the `op` level runs without
a gradient), and for the forward+backward the custom ops with that `prep` (the backward prepares each row again: what
the `op` level runs with a gradient); `prep` (asked for by name) Gated DeltaNet's preparation pass alone (q scaled, k
and v rescaled by the key norm, the write strength: one memory-bound pass each way), which the `op` level no longer
runs (round 16: the forward+backward's is inside its scans too): the cost that the fusion took off.

Timing: every (case, thread count) is called once per round, the rounds repeated (--repeats, default 15), the calls
of one case at its thread counts side by side and the order of all calls reversed every other round;
`torch.set_num_threads` is set before each call (untimed). A case's speedup at n threads is the median over rounds of
(its 1-thread time / its n-thread time in the same round), so that a change of background load hits both sides of a
ratio alike; the table gives its spread too: the quartiles of the paired ratios and their min and max.

What each call cost besides its wall time (Linux, from /proc/self/task/*/schedstat and stat before and after each
call, untimed): the CPU time of all the process's threads (`cpu ms`: a 2-thread call that costs more CPU time than a
1-thread call runs below 2x even on two idle cores; an idle OpenMP thread spinning at the end of a region counts
here), the time they spent runnable but waiting for a core (`wait ms`: the busy loop's and other processes' share),
and where the system put them: the CPU each thread that ran ran on last. An n-thread call whose threads ended on
fewer CPUs than n ran "shared" (two of its threads took turns on one CPU); the table splits the paired speedups by
that. At the `op` level the time inside the compiled kernels (`cpu.bindings.kernel_time`) is measured too, and the
rest of the call (Python, torch's operators: checks, layouts, allocations) is given apart (`around ms`), with the
bound that this serial part alone puts on n threads (`bound`, Amdahl's law: the 1-thread time t1 over the n-thread
call's serial part plus the 1-thread kernels' time split n ways, t1 / (around_n + (t1 - around_1) / n); medians).
`faults`: the process's minor page faults during the call (getrusage; Unix), the first touches of memory that the
allocator took fresh from the system (a 4 KiB page each, or a 2 MiB one where huge pages were granted): a call that
faults spends part of its time in the kernel, and two threads faulting one address space contend.

--busy-core starts one busy-loop process (`while True: pass`, a child at this process's priority and affinity)
before the first call and stops it after the last: one core is held for the whole run, as on a shared machine or
under a CPU quota, and no thread count may then be slower than 1 thread. The OS places it as it likes (and moves it)
unless --busy-pin CPU pins it to one CPU. The 1/5/15-minute load averages are recorded before the busy loop starts
and at the end (the busy loop itself then counts about 1).

The OpenMP runtime's wait policy (OMP_WAIT_POLICY, read when the runtime loads) is recorded: by default an idle
OpenMP thread spins for a while after every parallel region (torch's and the kernels' share one runtime), which on a
core held by another process takes time from the threads that work; `passive` makes it sleep at once.

The default run takes about a minute on two quiet cores; --quick runs a tiny configuration (the test suite runs it).
"""
from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

try:
    import resource
except ImportError:  # not Unix: no fault counts
    resource = None

from ..cli_support import UsageError, int_at_least
from ..io import atomic_write_text, write_json
from . import common

DESCRIPTION = __doc__
PROG = "linattn bench threads"
OPS = ("linear", "gated_deltanet")
PASSES = ("fwd", "fwd+bwd")
LEVELS = ("op", "kernel")
EXTRA_LEVELS = ("prep",)  # asked for by name only
QUICK = dict(T=256, repeats=2)
SHARED_MIN_RUN = 0.2  # a thread counts for the placement when it ran at least this share of the call's CPU time
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
                   help=f"comma list of {', '.join(LEVELS + EXTRA_LEVELS)}: the public call, the kernels alone, "
                        "Gated DeltaNet's preparation pass alone (default op,kernel)")
    p.add_argument("--repeats", type=int_at_least(1), default=15, help="rounds of timed calls (default 15)")
    p.add_argument("--busy-core", action="store_true",
                   help="hold one core with a busy-loop child process (same priority) for the whole run")
    p.add_argument("--busy-pin", type=int_at_least(0), default=None, metavar="CPU",
                   help="with --busy-core: pin the busy loop to this CPU (default: not pinned, the OS places it)")
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


def _seeded_randn(seed: int) -> Callable[..., torch.Tensor]:
    """randn(*shape) drawing from one generator seeded with `seed` (each case's inputs, the same for a seed)."""
    gen = torch.Generator().manual_seed(seed)
    return lambda *shape: torch.randn(*shape, generator=gen)


def make_kernel_case(op: str, passes: str, a) -> Callable[[], Any]:
    """A zero-argument call of `op`'s compiled kernels alone on flat inputs [B T, H, D]: the forward, or the forward
    keeping its states and then the backward kernel (the registered custom ops). Gated DeltaNet's is what
    `delta_rule` runs: the scan on make_case's raw rows and beta, which prepares each row itself (prep PREP_RAW; no
    preparation pass): `cpu.delta.delta_scan` without a gradient, the custom ops with that prep with one."""
    from ..cpu import delta as cdelta, linear as clinear

    B, T, H, K, V = a.B, a.T, a.H, a.K, a.V
    randn = _seeded_randn(a.seed)
    TT, grad = B * T, passes == "fwd+bwd"
    starts = [i * T for i in range(B + 1)]

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
    # make_case's very inputs, flat, and delta_rule's preparation of them (no qk_l2norm: PREP_RAW)
    x = [t.reshape(TT, *t.shape[2:]) for t in _gdn_inputs(B, T, H, K, V, _seeded_randn(a.seed))]
    prep = (cdelta.PREP_RAW, K ** -0.5, 0.0)
    if not grad:
        def run_fused():   # (no input requires grad: delta_scan calls the compiled forward directly)
            return cdelta.delta_scan(*x, None, starts, prep=prep)[0]
        return run_fused
    st = torch.tensor(starts, dtype=torch.int64)
    n_ck = T // cdelta.CHECKPOINT + (T % cdelta.CHECKPOINT > 0)
    ck_off = torch.tensor([i * n_ck for i in range(B)], dtype=torch.int64)
    fwd, bwd = torch.ops.linattn.cpu_delta_fwd, torch.ops.linattn.cpu_delta_bwd

    def run_delta():
        o, S, ck = fwd(*x, None, st, ck_off, B * n_ck, *prep)
        bwd(*x, ck, st, ck_off, do, torch.zeros_like(S), *prep)
        return o
    return run_delta


def make_prep_case(op: str, passes: str, a) -> Callable[[], Any]:
    """A zero-argument call of Gated DeltaNet's preparation pass alone (`cpu.delta.delta_prepare_raw_a`, what
    `delta_rule` ran before the scan on make_case's inputs when a gradient was needed, until round 16), forward or
    forward and backward. `delta_rule` runs no pass now (the scans prepare the rows, forward and backward): this is
    the cost that the fusion took off, for comparison."""
    from ..cpu.delta import delta_prepare_raw_a

    B, T, H, K, V = a.B, a.T, a.H, a.K, a.V
    randn = _seeded_randn(a.seed)
    grad = passes == "fwd+bwd"

    x = [torch.nn.functional.normalize(randn(B, T, H, K), dim=-1), torch.nn.functional.normalize(
        randn(B, T, H, K), dim=-1), randn(B, T, H, V), torch.sigmoid(randn(B, T, H))]
    x = [t.requires_grad_(grad) for t in x]
    dout = [randn(B, T, H, K), randn(B, T, H, K), randn(B, T, H, V), randn(B, T, H)]

    def run():
        out = delta_prepare_raw_a(*x, K ** -0.5)
        if grad:
            for t in x:
                t.grad = None
            torch.autograd.backward(out, dout)
        return out[0]

    return run


def _gdn_inputs(B: int, T: int, H: int, K: int, V: int, randn) -> List[torch.Tensor]:
    """Gated DeltaNet's public inputs q, k (L2-normalised), v, beta (sigmoid), g (a log-gate per head)."""
    q, k = torch.nn.functional.normalize(randn(B, T, H, K), dim=-1), randn(B, T, H, K)
    return [q, torch.nn.functional.normalize(k, dim=-1), randn(B, T, H, V), torch.sigmoid(randn(B, T, H)),
            -torch.nn.functional.softplus(randn(B, T, H)) / 16]


def make_case(op: str, passes: str, a) -> Callable[[], Any]:
    """A zero-argument call of `op` ("linear" or "gated_deltanet") on the compiled CPU backend, forward or forward
    and backward (the gradients of q, k, v (and beta, g) from a fixed output gradient)."""
    from .. import delta_rule, linear_attention

    B, T, H, K, V = a.B, a.T, a.H, a.K, a.V
    randn = _seeded_randn(a.seed)

    grad = passes == "fwd+bwd"
    if op == "linear":
        x = {"q": randn(B, T, H, K), "k": randn(B, T, H, K), "v": randn(B, T, H, V)}

        def call(x):
            return linear_attention(x["q"], x["k"], x["v"], feature_map="elu+1", causal=True, normalize=True,
                                    mode="chunk", backend="cpu")
    else:
        x = dict(zip(("q", "k", "v", "beta", "g"), _gdn_inputs(B, T, H, K, V, randn)))

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


def busy_start(pin: Optional[int] = None) -> subprocess.Popen:
    """The busy-loop child (it inherits this process's nice value and cpu affinity: the same priority), pinned to
    CPU `pin` when given."""
    p = subprocess.Popen([sys.executable, "-c", BUSY_LOOP], stdin=subprocess.DEVNULL)
    if pin is not None:
        try:
            os.sched_setaffinity(p.pid, {pin})
        except (OSError, AttributeError) as e:
            busy_stop(p)
            raise UsageError(f"--busy-pin: cannot pin the busy loop to CPU {pin} ({e})", prog=PROG) from None
    return p


def busy_stop(p: subprocess.Popen) -> None:
    p.terminate()
    try:
        p.wait(timeout=5)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()


def task_stats(pid: str = "self") -> Dict[str, Tuple[int, int, int]]:
    """Per thread of process `pid`: (ns run on a CPU, ns runnable but waiting for one, the CPU it ran on last), from
    /proc (Linux with schedstats; {} elsewhere); for this process's threads the run time from each thread's CPU clock
    (/proc's figure lags by up to a tick for a thread running meanwhile). Threads that end between the listing and
    the reads are left out."""
    out = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                run_ns, wait_ns = (int(x) for x in f.read().split()[:2])
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                stat = f.read()
            if pid == "self":  # Linux's clock id of a thread's CPU time (CPUCLOCK_PERTHREAD | CPUCLOCK_SCHED)
                run_ns = time.clock_gettime_ns((~int(tid) << 3) | 6)
        except (OSError, ValueError):
            continue
        # the fields after the command name (which may hold spaces and parentheses): "processor" is field 39
        out[tid] = (run_ns, wait_ns, int(stat.rsplit(")", 1)[1].split()[36]))
    return out


def call_record(before: Dict[str, Tuple[int, int, int]], after: Dict[str, Tuple[int, int, int]]) -> Dict[str, Any]:
    """What one call cost the process's threads: CPU ms, runqueue wait ms, and per thread that ran [CPU before,
    CPU after, ms run]; `threads`: how many threads ran at least SHARED_MIN_RUN of the call's CPU time, `cpus`: on
    how many distinct CPUs they ran last."""
    ran, cpu_ms, wait_ms = [], 0.0, 0.0
    for tid, (run1, wait1, cpu1) in after.items():
        run0, wait0, cpu0 = before.get(tid, (0, 0, cpu1))
        if run1 > run0:
            ran.append([cpu0, cpu1, round((run1 - run0) / 1e6, 3)])
            cpu_ms += (run1 - run0) / 1e6
            wait_ms += max(0, wait1 - wait0) / 1e6
    main = [r for r in ran if r[2] >= SHARED_MIN_RUN * cpu_ms]
    return {"cpu_ms": cpu_ms, "wait_ms": wait_ms, "ran": ran, "threads": len(main),
            "cpus": len({r[1] for r in main})}


def minor_faults() -> int:
    """The process's minor page faults so far (0 where getrusage is missing)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt if resource is not None else 0


def _set_threads(n: int, wake: torch.Tensor) -> None:
    """torch's thread count, then one small parallel op untimed: the pool's threads are up before the timed call."""
    torch.set_num_threads(n)
    wake.sum()


def measure(cases: List[Dict[str, Any]], counts: List[int], repeats: int, log,
            busy: Optional[subprocess.Popen] = None) -> None:
    """Fills each case's "ms" {threads: [per-round ms]} and "calls" {threads: [per-round call_record, with the
    kernels' ms inside the call and the CPU the busy loop ran on last]}: one warm-up call per (case, threads), then
    `repeats` rounds of one timed call each, the calls of one case side by side, the order reversed every other
    round."""
    from ..cpu.bindings import kernel_time

    calls = [(c, n) for c in cases for n in counts]
    wake = torch.ones(1 << 18)
    for c in cases:
        c["ms"], c["calls"] = {n: [] for n in counts}, {n: [] for n in counts}
    for c, n in calls:
        _set_threads(n, wake)
        c["fn"]()
    log("warmed up")
    for r in range(repeats):
        for c, n in (calls if r % 2 == 0 else calls[::-1]):
            _set_threads(n, wake)
            before, faults = task_stats(), minor_faults()
            with kernel_time() as spent:
                t0 = time.perf_counter()
                c["fn"]()
                ms = (time.perf_counter() - t0) * 1e3
            faults = minor_faults() - faults
            rec = call_record(before, task_stats())
            rec["kernel_ms"], rec["faults"] = spent[0] * 1e3, faults
            if busy is not None:
                rec["busy_cpu"] = next(iter(task_stats(str(busy.pid)).values()), (0, 0, -1))[2]
            c["ms"][n].append(ms)
            c["calls"][n].append(rec)
        log(f"round {r + 1}/{repeats}")


def _spread(xs: List[float]) -> Dict[str, float]:
    q = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else [xs[0]] * 3
    return {"median": statistics.median(xs), "q1": q[0], "q3": q[2], "min": min(xs), "max": max(xs), "n": len(xs)}


def summarise(cases: List[Dict[str, Any]], counts: List[int]) -> List[Dict[str, Any]]:
    """One record per case: median ms per thread count; the paired speedups over 1 thread (median, quartiles, min,
    max; and split by the placement: the rounds whose n threads ended on n CPUs, "apart", or on fewer, "shared"); the
    median CPU ms, runqueue wait ms, kernels' ms and the rest of the call's ms per thread count."""
    out = []
    for c in cases:
        rec = {"level": c["level"], "op": c["op"], "pass": c["pass"], "median_ms": {}, "speedup": {},
               "speedup_min": {}, "spread": {}, "placement": {}, "cpu_ms": {}, "wait_ms": {}, "kernel_ms": {},
               "around_ms": {}, "bound": {}, "faults": {},
               "ms": c["ms"], "calls": c["calls"]}
        for n in counts:
            calls = c["calls"][n]
            rec["median_ms"][n] = statistics.median(c["ms"][n])
            rec["cpu_ms"][n] = statistics.median(x["cpu_ms"] for x in calls)
            rec["wait_ms"][n] = statistics.median(x["wait_ms"] for x in calls)
            rec["kernel_ms"][n] = statistics.median(x["kernel_ms"] for x in calls)
            rec["faults"][n] = statistics.median(x["faults"] for x in calls)
            rec["around_ms"][n] = statistics.median(ms - x["kernel_ms"] for ms, x in zip(c["ms"][n], calls))
            rec["bound"][n] = amdahl_bound(rec["median_ms"][1], rec["around_ms"][1], rec["around_ms"][n], n)
            ratios = [a / b for a, b in zip(c["ms"][1], c["ms"][n])]
            rec["speedup"][n] = statistics.median(ratios)
            rec["speedup_min"][n] = min(ratios)
            rec["spread"][n] = _spread(ratios)
            apart = [r for r, x in zip(ratios, calls) if x["threads"] >= n and x["cpus"] >= n]
            shared = [r for r, x in zip(ratios, calls) if x["cpus"] < x["threads"]]
            rec["placement"][n] = {"apart": len(apart), "shared": len(shared),
                                   "apart_speedup": statistics.median(apart) if apart else None,
                                   "shared_speedup": statistics.median(shared) if shared else None}
        out.append(rec)
    return out


def amdahl_bound(t1: float, serial1: float, serial_n: float, n: int) -> float:
    """The most that n threads can gain over 1 when only the kernels' time (t1 - serial1 at 1 thread) is split
    n ways and the call's serial part takes serial_n at n threads: t1 / (serial_n + (t1 - serial1) / n)."""
    return t1 / (serial_n + max(t1 - serial1, 0.0) / n)


def _placement(x: Dict[str, Any]) -> str:
    def one(k):
        return f"{x[k]} x {x[k + '_speedup']:.2f}x" if x[k] else "0"
    return f"{one('apart')} / {one('shared')}"


def _report(records: List[Dict[str, Any]], counts: List[int]) -> str:
    multi = [n for n in counts if n > 1]
    head = (["level", "op", "pass"] + [f"{n} thr ms" for n in counts]
            + [f"{n} thr speedup [q1-q3] (min-max)" for n in multi] + [f"{n} thr cpu ms" for n in counts]
            + [f"{n} thr wait ms" for n in counts] + [f"{n} thr around ms" for n in counts]
            + [f"{n} thr bound" for n in multi] + [f"{n} thr faults" for n in counts]
            + [f"{n} thr apart / shared" for n in multi])
    rows = []
    for r in records:
        sp = [r["spread"][n] for n in multi]
        rows.append([r["level"], r["op"], r["pass"]] + [common.fmt_ms(r["median_ms"][n]) for n in counts]
                    + [f"{x['median']:.2f}x [{x['q1']:.2f}-{x['q3']:.2f}] ({x['min']:.2f}-{x['max']:.2f})" for x in sp]
                    + [f"{r['cpu_ms'][n]:.1f}" for n in counts] + [f"{r['wait_ms'][n]:.1f}" for n in counts]
                    + [f"{r['around_ms'][n]:.1f}" if r["level"] == "op" else "-" for n in counts]
                    + [f"{r['bound'][n]:.2f}x" if r["level"] == "op" else "-" for n in multi]
                    + [f"{r['faults'][n]:.0f}" for n in counts]
                    + [_placement(r["placement"][n]) for n in multi])
    return common.format_table(head, rows)


def _busy_text(busy: Optional[subprocess.Popen], pin: Optional[int]) -> str:
    if busy is None:
        return "no busy loop"
    return "one busy-loop process held a core for the whole run, " + (
        f"pinned to CPU {pin}" if pin is not None else "not pinned (the OS placed it)")


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
    levels = _names(a.levels, LEVELS + EXTRA_LEVELS, "--levels")
    if levels == ["prep"] and "gated_deltanet" not in ops:
        raise UsageError("--levels prep: only gated_deltanet has a preparation pass (add it to --ops)", prog=PROG)
    from ..cpu import available

    if not (available("linear") and available("delta")):
        raise UsageError("the compiled CPU kernels are not available (LINATTN_CPU_KERNELS=0 or no C compiler)",
                         prog=PROG)
    _, log = common.start_run(None, "cpu", a.quiet)
    paths = common.output_paths("threads", a.out, exts=("txt", "json"), overwrite=a.overwrite)
    info = common.machine_info("cpu")
    if a.busy_pin is not None and not a.busy_core:
        raise UsageError("--busy-pin: only with --busy-core", prog=PROG)
    busy = busy_start(a.busy_pin) if a.busy_core else None
    try:
        make = {"op": make_case, "kernel": make_kernel_case, "prep": make_prep_case}
        cases = [{"level": lv, "op": op, "pass": ps, "fn": make[lv](op, ps, a)}
                 for lv in levels for op in ops for ps in passes if lv != "prep" or op == "gated_deltanet"]
        measure(cases, counts, a.repeats, log, busy)
    finally:
        if busy is not None:
            busy_stop(busy)
    load_end = common.loadavg()
    records = summarise(cases, counts)
    head = [PROG, common.describe_machine(info),
            f"shape    B {a.B}, T {a.T}, H {a.H}, K {a.K}, V {a.V}, fp32, chunk form, backend cpu",
            f"timing   {a.repeats} rounds, one call per (case, threads) each, order reversed every other round; "
            f"speedup = median over rounds of the paired ratio [quartiles] (min-max)",
            f"busy     {_busy_text(busy, a.busy_pin)}; load at the end {' '.join(map(str, load_end or []))}",
            f"threads  torch {torch.get_num_threads()} by default; cpu / wait ms: CPU time of all the process's "
            f"threads and their time runnable without a core, per call (median); around: the public call's time "
            f"outside the compiled kernels; bound: Amdahl's bound of that serial part; faults: minor page faults per "
            f"call (median); apart / shared: rounds "
            f"whose n threads ended on n CPUs / fewer, with their median speedup",
            f"openmp   OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(unset: idle threads spin a while)')}"]
    text = _report(records, counts)
    print("\n".join(head) + "\n\n" + text)
    atomic_write_text(paths["txt"], "\n".join(head) + "\n\n" + text + "\n")
    write_json(paths["json"], {"benchmark": "threads", "machine": info, "load_end": load_end,
                               "busy_core": bool(busy), "busy_pin": a.busy_pin,
                               "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
                               "config": {k: v for k, v in vars(a).items() if k != "func"},
                               "records": records})
    print(f"\nwrote {paths['txt']}, {paths['json']}")
    return 0
