"""Shared benchmark infrastructure: machine description, timing, peak memory, matmul rate, outputs.

Timing (`time_fn`, `time_interleaved`): `time.perf_counter` around each call (CUDA: synchronised
before and after), after warm-up calls; the median and the spread (interquartile range and
min/max) of the repeats. The number of repeats adapts to the cost of a call: short calls are
repeated until `min_time_s` has passed (at most `max_repeats`), long ones are cut to fit
`budget_s` (not below min(repeats, 3), unless one call alone exceeds the budget: then one timed
call). `time_interleaved` times several cases in rounds, one call of each per round, so that
background load on a shared machine hits them alike. The thread count is whatever torch uses
(`torch.set_num_threads` is untouched).

Peak memory (`measure_memory`), per call, honest about what it sees:

* CUDA: `torch.cuda.max_memory_allocated()` during one call minus the allocation before it.
* CPU (Linux): the growth of the resident set during one call, in a separate worker process:
  the peak resident set (VmHWM) is reset to the current one through /proc/self/clear_refs, the op
  runs once, and peak = VmHWM - VmRSS before the call. The worker runs with glibc's mmap threshold
  fixed at 64 KiB (MALLOC_MMAP_THRESHOLD_), so tensors above 64 KiB are their own mappings and go
  back to the OS when freed, and it calls malloc_trim(0) before each measurement so that no free
  but resident heap page can be reused unseen: the figure is then the peak of live memory of the
  call (outputs, saved activations, gradients, temporaries, library workspace), inputs excluded.
  A warm-up call (of the same op, possibly at a smaller size) precedes the measured one.
  Elsewhere peak memory is reported as unavailable.
"""
from __future__ import annotations

import datetime as _dt
import gc
import importlib
import json
import math
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from ..errors import ConfigError

# ----------------------------------------------------------------------------------------------
# Machine description
# ----------------------------------------------------------------------------------------------


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _git_commit() -> Optional[str]:
    here = Path(__file__).resolve().parent
    try:
        r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True,
                           text=True, timeout=5)
        return (r.stdout.strip() or None) if r.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def loadavg() -> Optional[List[float]]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (OSError, AttributeError):
        return None


def machine_info(device: str = "cpu") -> Dict[str, Any]:
    """Where and with what a benchmark ran."""
    from .. import __version__

    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    info: Dict[str, Any] = {
        "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": usable,
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "linattn": __version__,
        "git_commit": _git_commit(),
        "loadavg_1_5_15min": loadavg(),
        "device": device,
    }
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
        info["cuda"] = torch.version.cuda
    return info


def describe_machine(info: Dict[str, Any]) -> str:
    lines = [
        f"date     {info['date']}   linattn {info['linattn']}"
        + (f" (git {info['git_commit']})" if info.get("git_commit") else ""),
        f"cpu      {info['cpu']}  ({info['cpus_usable']} usable of {info['cpu_count']} logical cpus)",
        f"torch    {info['torch']}, {info['torch_threads']} threads"
        f" ({info['torch_interop_threads']} inter-op); python {info['python']}; {info['platform']}",
    ]
    if info.get("gpu"):
        lines.append(f"gpu      {info['gpu']} (CUDA {info.get('cuda')})")
    if info.get("loadavg_1_5_15min") is not None:
        lines.append(f"load     {' '.join(map(str, info['loadavg_1_5_15min']))} (1/5/15 min load average at start; "
                     f"other processes share these cpus)")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------------------------


def start_run(threads, device: str, quiet: bool):
    """The run-wide settings of a decoding benchmark: torch threads (None: 1 on CPU, where more
    threads than free cores make timings erratic on a shared machine; 0: torch's default) and a
    progress logger on stderr (silent when quiet). Returns (threads, log)."""
    if threads is None and not str(device).startswith("cuda"):
        threads = 1
    if threads:
        torch.set_num_threads(threads)
    log = (lambda s: None) if quiet else (lambda s: print(s, file=sys.stderr, flush=True))
    return threads, log


def synchronizer(device: str) -> Callable[[], None]:
    if str(device).startswith("cuda"):
        return torch.cuda.synchronize
    return lambda: None


def _quantile(sorted_x: Sequence[float], q: float) -> float:
    """Linear-interpolation quantile of an already sorted sequence."""
    if not sorted_x:
        return float("nan")
    pos = (len(sorted_x) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return sorted_x[lo] + (sorted_x[hi] - sorted_x[lo]) * (pos - lo)


@dataclass
class Timing:
    """Milliseconds per call over `repeats` timed calls (after `warmup` untimed ones)."""
    median_ms: float
    q1_ms: float
    q3_ms: float
    min_ms: float
    max_ms: float
    repeats: int
    warmup: int

    @classmethod
    def from_seconds(cls, samples: Sequence[float], warmup: int) -> "Timing":
        xs = sorted(s * 1e3 for s in samples)
        return cls(median_ms=_quantile(xs, 0.5), q1_ms=_quantile(xs, 0.25), q3_ms=_quantile(xs, 0.75),
                   min_ms=xs[0], max_ms=xs[-1], repeats=len(xs), warmup=warmup)

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)


def _plan_repeats(est: Optional[float], repeats: int, min_time_s: float, max_repeats: int,
                  budget_s: Optional[float]) -> int:
    """Timed calls for a call that takes about `est` seconds (see the module docstring)."""
    n = repeats
    if est is None or est <= 0:
        return n
    if est * n < min_time_s:
        n = max(n, min(max_repeats, math.ceil(min_time_s / est)))
    if budget_s is not None and est * n > budget_s:
        n = 1 if est > budget_s else max(min(repeats, 3), int(budget_s // est))
    return n


def _timed_call(fn: Callable[[], Any], sync: Callable[[], None]) -> float:
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def time_fn(fn: Callable[[], Any], *, warmup: int = 1, repeats: int = 5, min_time_s: float = 0.2,
            max_repeats: int = 100, budget_s: Optional[float] = 30.0, device: str = "cpu") -> Timing:
    """Time `fn()`; see the module docstring for the adaptive number of repeats."""
    if repeats < 1:
        raise ConfigError(f"repeats must be >= 1, got {repeats}")
    sync = synchronizer(device)
    est = None
    for _ in range(max(0, warmup)):
        est = _timed_call(fn, sync)  # the last warm-up call estimates the cost of one call
    n = _plan_repeats(est, repeats, min_time_s, max_repeats, budget_s)
    samples = [_timed_call(fn, sync) for _ in range(n)]
    return Timing.from_seconds(samples, warmup=max(0, warmup))


def time_interleaved(makers: Sequence[Callable[[], Callable[[], Any]]], *, warmup: int = 1, repeats: int = 5,
                     min_time_s: float = 0.2, max_repeats: int = 100, budget_s: Optional[float] = 30.0,
                     device: str = "cpu") -> List[Any]:
    """Time several cases fairly on a shared machine: their timed calls are interleaved in rounds.

    makers[i]() builds case i and returns its zero-argument callable. Each case is first built and
    warmed up alone (which also estimates its cost and so its number of repeats n_i); then, in R =
    max(n_i) rounds, each case is built afresh (untimed) and called once (timed) in n_i of the
    rounds, spread evenly over all R, so that every case sees the same background load over the
    same period and their ratios stay fair. Only one case is alive at a time. Returns one Timing,
    or the exception a case raised, per maker.
    """
    if repeats < 1:
        raise ConfigError(f"repeats must be >= 1, got {repeats}")
    sync = synchronizer(device)
    out: List[Any] = [None] * len(makers)
    plan: List[int] = [0] * len(makers)
    samples: List[List[float]] = [[] for _ in makers]
    for i, make in enumerate(makers):
        try:
            fn = make()
            est = None
            for _ in range(max(0, warmup)):
                est = _timed_call(fn, sync)
            plan[i] = _plan_repeats(est, repeats, min_time_s, max_repeats, budget_s)
        except Exception as e:  # reported per case; the others go on
            out[i] = e
        fn = None
    rounds = max(plan, default=0)
    for r in range(rounds):
        for i, make in enumerate(makers):
            # case i takes plan[i] samples spread evenly over the rounds (all of them when it has the most)
            if out[i] is not None or (r + 1) * plan[i] // rounds == r * plan[i] // rounds:
                continue
            try:
                fn = make()
                samples[i].append(_timed_call(fn, sync))
            except Exception as e:
                out[i] = e
            fn = None
    for i in range(len(makers)):
        if out[i] is None:
            out[i] = Timing.from_seconds(samples[i], warmup=max(0, warmup))
    return out


def matmul_rate(n: int = 2048, dtype: torch.dtype = torch.float32, device: str = "cpu",
                repeats: int = 5) -> Dict[str, Any]:
    """The machine's dense matmul rate: median GFLOP/s of an n x n x n product (2 n^3 flops)."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=g).to(device=device, dtype=dtype)
    b = torch.randn(n, n, generator=g).to(device=device, dtype=dtype)
    c = torch.empty(n, n, device=device, dtype=dtype)
    t = time_fn(lambda: torch.mm(a, b, out=c), warmup=2, repeats=repeats, min_time_s=0.5,
                max_repeats=50, budget_s=20.0, device=device)
    flops = 2.0 * n ** 3
    return {
        "n": n, "dtype": str(dtype).replace("torch.", ""), "device": device,
        "gflops": flops / (t.median_ms * 1e-3) / 1e9,
        "gflops_best": flops / (t.min_ms * 1e-3) / 1e9,
        "timing": t.to_dict(),
    }


# ----------------------------------------------------------------------------------------------
# Peak memory
# ----------------------------------------------------------------------------------------------

MEMORY_METHODS = {
    "cuda": "torch.cuda.max_memory_allocated() during one call minus the allocation before it "
            "(after a warm-up call); inputs excluded",
    "cpu": "growth of the resident set during one call (VmHWM reset via /proc/self/clear_refs, minus "
           "VmRSS before the call) in a separate process whose glibc returns every allocation "
           "> 64 KiB to the OS on free (MALLOC_MMAP_THRESHOLD_=65536) and trims its heap before each "
           "call (malloc_trim), after a warm-up call: "
           "the call's peak live memory (outputs, saved activations, gradients, temporaries), "
           "inputs excluded",
    "none": "not measured (needs Linux /proc for CPU, or CUDA)",
}


def memory_method(device: str) -> str:
    if str(device).startswith("cuda"):
        return "cuda"
    return "cpu" if _cpu_memory_supported() else "none"


def _cpu_memory_supported() -> bool:
    return sys.platform.startswith("linux") and os.path.exists("/proc/self/clear_refs") \
        and os.path.exists("/proc/self/status")


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _resolve(builder: str) -> Callable[..., Callable[[], Any]]:
    mod, _, attr = builder.partition(":")
    return getattr(importlib.import_module(mod), attr)


def _malloc_trim() -> None:
    """Give every free page of glibc's heaps back to the OS (no-op where malloc_trim is missing)."""
    global _LIBC
    try:
        if _LIBC is None:
            import ctypes
            _LIBC = ctypes.CDLL(None)
        _LIBC.malloc_trim(0)
    except (OSError, AttributeError):
        pass


_LIBC = None


def _measure_cpu_here(fn: Callable[[], Any], warm: Callable[[], Any]) -> int:
    """Peak resident growth (bytes) of one call of fn in this process (see MEMORY_METHODS['cpu'])."""
    warm()  # warm-up: one-off initialisations (thread pools, kernel caches) do not count
    gc.collect()
    _malloc_trim()  # free heap pages that are still resident would otherwise be reused unseen
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current VmRSS
    before = _status_kb("VmRSS")
    fn()
    peak = _status_kb("VmHWM")
    return max(0, peak - before) * 1024


def _measure_cuda(fn: Callable[[], Any], warm: Callable[[], Any], device: str) -> int:
    warm()
    torch.cuda.synchronize(device)
    gc.collect()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    fn()
    torch.cuda.synchronize(device)
    return max(0, torch.cuda.max_memory_allocated(device) - before)


def measure_memory(builder: str, specs: Sequence[Dict[str, Any]], device: str = "cpu",
                   warmup_specs: Optional[Sequence[Optional[Dict[str, Any]]]] = None,
                   timeout_s: float = 3600.0) -> List[Dict[str, Any]]:
    """Peak memory of one call of each case; `builder` is "module:function" with
    function(**spec) -> fn, a zero-argument callable that runs the case once. The warm-up call
    before each measured one runs `warmup_specs[i]` (e.g. the same op at a small size, to save
    time) or, if that is None, the case itself.

    Returns one {"peak_bytes": int or None, "error": str or None} per spec, in order.
    """
    specs = list(specs)
    warmup_specs = list(warmup_specs) if warmup_specs is not None else [None] * len(specs)
    if not specs:
        return []
    method = memory_method(device)
    if method == "none":
        return [{"peak_bytes": None, "error": MEMORY_METHODS["none"]} for _ in specs]
    if method == "cuda":
        build = _resolve(builder)
        out = []
        for spec, wspec in zip(specs, warmup_specs):
            try:
                fn = build(**spec)
                warm = build(**wspec) if wspec is not None else fn
                out.append({"peak_bytes": _measure_cuda(fn, warm, device), "error": None})
                del fn, warm
            except Exception as e:  # one failing case must not stop the others
                out.append({"peak_bytes": None, "error": f"{type(e).__name__}: {e}"})
            torch.cuda.empty_cache()
        return out
    # CPU: a fresh worker process, glibc told to give freed memory back at once. If the worker dies
    # (e.g. killed for memory), the case it was on is marked failed and a new worker takes the rest.
    env = dict(os.environ)
    env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    env["MALLOC_TRIM_THRESHOLD_"] = "0"
    pkg_root = str(Path(__file__).resolve().parents[2])  # the folder that holds linattn/
    env["PYTHONPATH"] = pkg_root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    cmd = [sys.executable, "-c", "from linattn.bench.common import _memory_worker; _memory_worker()"]
    results: List[Optional[Dict[str, Any]]] = [None] * len(specs)
    start, stalled = 0, 0
    deadline = time.monotonic() + timeout_s
    while start < len(specs):
        failure = None
        payload = json.dumps({"builder": builder, "specs": specs[start:], "warmup_specs": warmup_specs[start:]})
        try:
            proc = subprocess.run(cmd, input=payload, capture_output=True, text=True, env=env,
                                  timeout=max(1.0, deadline - time.monotonic()))
            stdout = proc.stdout
            if proc.returncode != 0:
                tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
                failure = f"memory worker exited with code {proc.returncode}: {tail}"
        except subprocess.TimeoutExpired as e:
            stdout = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            failure = f"memory measurement timed out after {timeout_s:.0f} s"
        for line in stdout.splitlines():
            try:
                rec = json.loads(line)
                results[start + rec["i"]] = {"peak_bytes": rec["peak_bytes"], "error": rec["error"]}
            except (ValueError, KeyError, IndexError, TypeError):
                continue
        done = start
        while done < len(specs) and results[done] is not None:
            done += 1
        if done == len(specs):
            break
        stalled = stalled + 1 if done == start else 0
        if stalled >= 2 or (failure is not None and "timed out" in failure):
            for i in range(done, len(specs)):  # the worker cannot run at all, or time is up
                results[i] = {"peak_bytes": None, "error": failure or "memory worker stopped"}
            break
        results[done] = {"peak_bytes": None, "error": failure or "memory worker stopped"}
        start = done + 1
    return [r if r is not None else {"peak_bytes": None, "error": "not measured (time limit)"} for r in results]


def _memory_worker() -> None:
    """Entry point of the CPU memory worker: JSON {"builder", "specs"} on stdin, one JSON line out per spec."""
    req = json.loads(sys.stdin.read())
    build = _resolve(req["builder"])
    for i, (spec, wspec) in enumerate(zip(req["specs"], req["warmup_specs"])):
        rec: Dict[str, Any] = {"i": i, "peak_bytes": None, "error": None}
        try:
            warm = build(**wspec) if wspec is not None else None
            fn = build(**spec)
            rec["peak_bytes"] = _measure_cpu_here(fn, warm or fn)
            del fn, warm
        except Exception as e:  # report and go on with the next case
            rec["error"] = f"{type(e).__name__}: {e}"
        sys.stdout.write(json.dumps(rec) + "\n")
        sys.stdout.flush()


# ----------------------------------------------------------------------------------------------
# Outputs: table, JSON (linattn.io's atomic writes), PNG; never overwrite silently
# ----------------------------------------------------------------------------------------------


def output_paths(name: str, out: Optional[str] = None, exts: Sequence[str] = ("txt", "json", "png"),
                 overwrite: bool = False, stem: Optional[str] = None) -> Dict[str, Path]:
    """Paths for a benchmark's output files, in `out` (default results/bench/<name>/).

    Files are named <stem>.<ext> (stem defaults to name); if any of them exists and `overwrite` is
    False, a timestamped stem <stem>-YYYYmmdd-HHMMSS[-k] is used instead, so no file is replaced.
    """
    root = Path(out) if out is not None else Path("results") / "bench" / name
    root.mkdir(parents=True, exist_ok=True)
    base = stem or name

    def paths(s):
        return {e: root / f"{s}.{e}" for e in exts}

    cand = paths(base)
    if overwrite or not any(p.exists() for p in cand.values()):
        return cand
    ts = time.strftime("%Y%m%d-%H%M%S")
    k = 0
    while True:
        cand = paths(f"{base}-{ts}" + (f"-{k}" if k else ""))
        if not any(p.exists() for p in cand.values()):
            return cand
        k += 1


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], align: Optional[str] = None) -> str:
    """A plain-text table; `align` is one character per column, 'l' or 'r' (default: text left, numbers right)."""
    cells = [[str(h) for h in headers]] + [["" if c is None else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    if align is None:
        align = "".join("l" if i == 0 else "r" for i in range(len(headers)))
    out = []
    for n, r in enumerate(cells):
        out.append("  ".join(c.ljust(w) if a == "l" else c.rjust(w) for c, w, a in zip(r, widths, align)).rstrip())
        if n == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def plot_panels(path: Path, panels: Sequence[Dict[str, Any]], title: Optional[str] = None) -> None:
    """Save a row of line plots as PNG (matplotlib's Agg canvas: no display, no global backend change).

    Each panel: {"title", "xlabel", "ylabel", "logx", "logy", "series": [{"label", "x", "y",
    "linestyle", "marker", "color"}], "hline": optional y value drawn dotted}.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5.2 * len(panels), 4.6))
    fig.subplots_adjust(left=0.25 / len(panels), right=0.99, bottom=0.11, top=0.86, wspace=0.28)
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for ax, p in zip(axes, panels):
        for s in p["series"]:
            pts = [(x, y) for x, y in zip(s["x"], s["y"]) if y is not None and math.isfinite(y) and y > 0]
            if not pts:
                continue
            ax.plot([a for a, _ in pts], [b for _, b in pts], label=s["label"],
                    linestyle=s.get("linestyle", "-"), marker=s.get("marker", "o"), color=s.get("color"),
                    markersize=4)
        if p.get("hline") is not None:
            ax.axhline(p["hline"], color="grey", linestyle=":", linewidth=1)
        if p.get("logx", True):
            ax.set_xscale("log", base=2)
        if p.get("logy", True):
            ax.set_yscale("log")
        ax.set_title(p.get("title", ""), fontsize=10)
        ax.set_xlabel(p.get("xlabel", ""))
        ax.set_ylabel(p.get("ylabel", ""))
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.savefig(path, dpi=110)


def speed_ratio(baseline_ms: float, ms: float) -> str:
    """How a time compares with a baseline's, always as a ratio >= 1: "2.5x faster" (ms is 2.5 times
    smaller) or "2.5x slower" (2.5 times larger); never "0.4x faster"."""
    r = baseline_ms / ms
    return f"{r:.1f}x faster" if r >= 1 else f"{1 / r:.1f}x slower"


def fmt_ms(ms: Optional[float]) -> str:
    if ms is None or not math.isfinite(ms):
        return "-"
    if ms >= 1000:
        return f"{ms:,.0f}"
    if ms >= 100:
        return f"{ms:.1f}"
    if ms >= 1:
        return f"{ms:.2f}"
    return f"{ms:.3f}"


def fmt_bytes(b: Optional[int]) -> str:
    if b is None:
        return "-"
    mib = b / 2 ** 20
    return f"{mib:,.0f}" if mib >= 100 else f"{mib:.1f}"


__all__ = [
    "Timing", "time_fn", "time_interleaved", "synchronizer", "start_run", "matmul_rate", "machine_info",
    "describe_machine", "cpu_model", "measure_memory", "memory_method", "MEMORY_METHODS", "output_paths",
    "format_table", "plot_panels", "speed_ratio", "fmt_ms", "fmt_bytes",
]
