"""`linattn bench gpu`: the prepared GPU run, one command within a time budget.

    PYTHONPATH=src python -m linattn bench gpu --out DIR [--budget-min 8.5] [--steps ...] [--wheels DIR]
                                                [--triton-cache ARCHIVE] [--dry-run] [--overwrite]

The steps run in this order, each within its share of the budget (time a step does not use passes to the next
ones); DIR/gpu.json and DIR/gpu.md are rewritten after every case, so a run that is cut short (budget, kill)
still reports, and the cases or steps that did not fit are listed as skipped with the reason. A step that fails
is recorded (its traceback's last lines) and the run goes on. Status: "finished", "incomplete" (cases or steps
did not fit) or "cut short" (the budget ran out inside a step, or SIGTERM). Exit code 0 when every case that ran
passed, 1 when one failed or raised.

  machine      GPU, driver, CUDA, torch, triton, fla, transformers; bf16 / fp32 matmul rate, copy bandwidth
  correctness  the fla backend and linattn's Triton kernels against the PyTorch forms on the same GPU: linear
               attention, GLA, DeltaNet, Gated DeltaNet, KDA, EFLA at T in 65, 1, 2048, fp32 / bf16, grouped value
               heads, uneven cu_seqlens; outputs, states and gradients (module `correctness`)
  timing       B*H = 64, K = V = 128, bf16, T = 8k, 2k, 32k, fwd and fwd+bwd: linattn auto, fla's direct call,
               SDPA (flash), linattn Triton; the targets derived from the rows (module `timing`)
  lm           a 12-layer d 1024 LM: Gated DeltaNet, softmax, fla's GatedDeltaNetForCausalLM (module `lm`)
  cpu-scaling  the compiled CPU kernels at T = 16k on 1-16 threads of the machine's CPU (module `cpu_scaling`)
  sanitizer    compute-sanitizer on every Triton kernel: only when named in --steps (module `sanitizer`)

DIR/triton-cache.tar.gz (at most 16 MiB) is rewritten after every step: Triton's compiled kernels for the next
machine, given back with `--triton-cache ARCHIVE` (module `triton_cache`). `--dry-run` runs every step on CPU
under Triton's interpreter (TRITON_INTERPRET=1, set in a child process when triton is already imported) with
tiny shapes: it checks the command, not the GPU. The core steps need only torch, triton and numpy; fla's rows
need its wheels (`--wheels wheels`) and its model row transformers.
"""
from __future__ import annotations

import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import List

import torch

from ...cli_support import UsageError
from . import triton_cache
from .base import (
    DEFAULT_STEPS,
    PROG,
    SHARES,
    STEPS,
    BudgetExceeded,
    Ctx,
    NotCovered,
    Report,
    Terminated,
    render_md,
    tail,
)
from .correctness import GROUPED_OPS, GVA_OPS, OPS, TOL, correctness_cases, run_correctness_case, step_correctness
from .cpu_scaling import step_cpu_scaling
from .fla_ops import fla_fns, fla_version, import_fla_ops
from .lm import LM_ROWS, run_lm_case, step_lm
from .machine import copy_bandwidth, find_tool, step_machine, versions
from .plans import dry_plan, gpu_plan
from .sanitizer import step_sanitizer
from .timing import BWD_FACTOR, chunk_flops, step_timing, targets, timing_cases

__all__ = ["BWD_FACTOR", "BudgetExceeded", "DEFAULT_STEPS", "GROUPED_OPS", "GVA_OPS", "LM_ROWS", "NotCovered", "OPS",
           "STEPS", "STEP_FNS", "TOL", "Terminated", "add_arguments", "check_wheels", "chunk_flops",
           "copy_bandwidth", "correctness_cases", "dry_plan", "find_tool", "fla_fns", "fla_version", "gpu_plan",
           "import_fla_ops", "render_md", "run", "run_correctness_case", "run_lm_case", "targets", "timing_cases",
           "use_wheels", "versions"]

DESCRIPTION = __doc__
STEP_FNS = {"machine": step_machine, "correctness": step_correctness, "timing": step_timing, "lm": step_lm,
            "cpu-scaling": step_cpu_scaling, "sanitizer": step_sanitizer}


def add_arguments(p):
    """The options of `linattn bench gpu`.

    Args:
        p: The argparse parser to add them to.
    """
    p.add_argument("--out", required=True, help="output folder: DIR/gpu.json, DIR/gpu.md, DIR/triton-cache.tar.gz")
    p.add_argument("--budget-min", type=float, default=8.5, help="time budget of the whole run, minutes (default 8.5)")
    p.add_argument("--steps", nargs="+", default=list(DEFAULT_STEPS), metavar="STEP",
                   help="which steps, in the fixed order (default: all but sanitizer): " + " ".join(STEPS))
    p.add_argument("--dry-run", action="store_true",
                   help="every step on CPU under TRITON_INTERPRET=1 with tiny shapes (checks the command)")
    p.add_argument("--overwrite", action="store_true", help="replace DIR/gpu.json and DIR/gpu.md if they exist")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    p.add_argument("--wheels", default=None, metavar="DIR",
                   help="a folder of pure-Python wheels (fla-core, flash-linear-attention, einops) to use without "
                        "installing them: unpacked to a temporary folder put first on sys.path")
    p.add_argument("--triton-cache", default=None, metavar="ARCHIVE",
                   help="a triton-cache.tar.gz from an earlier run, unpacked into TRITON_CACHE_DIR first")


def use_wheels(folder: str) -> List[str]:
    """Unpack every *.whl in `folder` into a temporary folder (removed at exit) and put it first on
    sys.path, so that a machine without network or write access to site-packages can import them.
    -> the wheels' file names."""
    import atexit
    import zipfile

    wheels = sorted(Path(folder).glob("*.whl"))
    if not wheels:
        raise UsageError(f"--wheels: no *.whl file in {folder}", prog=PROG)
    site = tempfile.mkdtemp(prefix="linattn-wheels-")
    atexit.register(shutil.rmtree, site, True)
    for w in wheels:
        with zipfile.ZipFile(w) as z:
            z.extractall(site)
    sys.path.insert(0, site)
    return [w.name for w in wheels]


def check_wheels() -> List[str]:
    """What the wheels give, imported here without network: fla's ops, then fla's models (which need
    transformers). -> one line each."""
    lines = [f"fla ops: {versions()['fla']}"]
    try:
        from .fla_ops import fla_gated_deltanet_lm

        fla_gated_deltanet_lm()
        lines.append("fla models: GatedDeltaNetForCausalLM imports")
    except Exception as e:
        lines.append(f"fla models: not importable ({type(e).__name__}: {str(e)[:120]})")
    return lines


def _validate(args) -> None:
    bad = [s for s in args.steps if s not in STEPS]
    if bad:
        raise UsageError(f"--steps: unknown step(s) {', '.join(bad)}; choose from {' '.join(STEPS)}", prog=PROG)
    if not (args.budget_min > 0) or not math.isfinite(args.budget_min):
        raise UsageError(f"--budget-min must be a positive number of minutes, got {args.budget_min}", prog=PROG)
    cache = getattr(args, "triton_cache", None)
    if cache is not None and not Path(cache).is_file():
        raise UsageError(f"--triton-cache: no file {cache}", prog=PROG)


def _argv(args) -> List[str]:
    argv = ["--out", args.out, "--budget-min", f"{args.budget_min:g}", "--steps", *args.steps]
    argv += ["--dry-run"] * args.dry_run + ["--overwrite"] * args.overwrite + ["--quiet"] * args.quiet
    argv += ["--wheels", args.wheels] if args.wheels else []
    return argv + (["--triton-cache", args.triton_cache] if getattr(args, "triton_cache", None) else [])


def _reexec_interpreted(args) -> int:
    """The dry run in a child process with TRITON_INTERPRET=1 (triton is already imported here)."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    src_root = str(Path(__file__).resolve().parents[3])
    env["PYTHONPATH"] = src_root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return subprocess.call([sys.executable, "-m", "linattn", "bench", "gpu"] + _argv(args), env=env)


def run(args) -> int:
    """Run the `linattn bench gpu` benchmark (module docstring).

    Args:
        args: The options parsed with `add_arguments` (`linattn bench gpu --help` lists them).

    Returns:
        The exit code (0: success).

    Raises:
        UsageError: Bad options.
    """
    _validate(args)
    from ... import triton as lt

    if args.dry_run and not lt.interpret_mode():
        if "triton" in sys.modules:  # the interpreter must be chosen before triton is imported
            return _reexec_interpreted(args)
        os.environ["TRITON_INTERPRET"] = "1"
    if not args.dry_run:
        if not torch.cuda.is_available():
            raise UsageError("no CUDA device here; `--dry-run` checks the command on CPU", prog=PROG)
        if lt.interpret_mode():
            raise UsageError("TRITON_INTERPRET is set: unset it for the GPU run (or use --dry-run)", prog=PROG)
    out = Path(args.out)
    paths = {"json": out / "gpu.json", "md": out / "gpu.md"}
    if not args.overwrite and any(p.exists() for p in paths.values()):
        raise UsageError(f"{paths['json']} or {paths['md']} exists; pass --overwrite to replace them", prog=PROG)
    cache = triton_cache.prepare_cache_dir(getattr(args, "triton_cache", None))  # before anything compiles
    wheels = use_wheels(args.wheels) if args.wheels else []
    out.mkdir(parents=True, exist_ok=True)
    plan = dry_plan() if args.dry_run else gpu_plan()
    budget_s = args.budget_min * 60
    config = {"dry_run": bool(args.dry_run), "budget_s": budget_s, "wheels": wheels, "steps": list(args.steps),
              "device": plan["device"], "command": "linattn bench gpu " + " ".join(_argv(args)),
              "triton_cache": cache,
              "notes": [f"Triton cache: {cache['dir']}" + (f", {cache['unpacked']} files unpacked from "
                                                           f"{cache['archive']}" if cache["archive"] else ", cold")]
              + (check_wheels() if wheels else [])}
    report = Report(paths, config, list(args.steps))
    log = (lambda s: None) if args.quiet else (lambda s: print(s, file=sys.stderr, flush=True))
    start = time.monotonic()
    end = start + budget_s
    ctx = Ctx(plan, report, log, end)
    report.save()
    with _budget_signals(budget_s):
        _run_steps(ctx, report, args.steps, start, end, out / triton_cache.ARCHIVE_NAME)
    counts = report.data.get("counts", {})
    return 1 if counts.get("failed", 0) or counts.get("errors", 0) else 0


class _budget_signals:
    """SIGALRM at the budget's end (+5 s: a step stuck past its deadline is cut) and SIGTERM raise into the
    run; both handlers restored afterwards. Outside the main thread only the soft deadlines hold."""

    def __init__(self, budget_s: float):
        self.budget_s, self.old = budget_s, {}

    def __enter__(self):
        def on_alarm(signum, frame):
            raise BudgetExceeded(f"the run's budget of {self.budget_s:.0f} s ran out")

        def on_term(signum, frame):
            raise Terminated(f"signal {signum}")

        if hasattr(signal, "SIGALRM"):
            try:
                self.old[signal.SIGALRM] = signal.signal(signal.SIGALRM, on_alarm)
                self.old[signal.SIGTERM] = signal.signal(signal.SIGTERM, on_term)
                signal.setitimer(signal.ITIMER_REAL, self.budget_s + 5)
            except ValueError:  # not the main thread
                self.old = {}
        return self

    def __exit__(self, *exc):
        if self.old:
            signal.setitimer(signal.ITIMER_REAL, 0)
            for s, h in self.old.items():
                signal.signal(s, h)
        return False


def _pack_cache(report: Report, archive: Path) -> None:
    """Rewrite DIR/triton-cache.tar.gz from TRITON_CACHE_DIR; a failure is a note, never the run's end."""
    try:
        info = triton_cache.pack(os.environ["TRITON_CACHE_DIR"], str(archive))
        report.data["config"]["triton_cache"]["packed"] = info
    except Exception as e:
        report.data["config"]["triton_cache"]["packed"] = {"error": f"{type(e).__name__}: {e}"}


def _run_steps(ctx: Ctx, report: Report, steps: List[str], start: float, end: float, archive: Path) -> None:
    todo = [s for s in STEPS if s in steps]
    stop_reason = None
    for i, name in enumerate(todo):
        rec = report.data["steps"][name]
        if stop_reason is not None:
            rec.update(status="skipped", reason=stop_reason)
            continue
        now = time.monotonic()
        left = end - now
        if left <= 1:
            rec.update(status="skipped", reason=f"did not fit: the budget ran out after {now - start:.0f} s")
            continue
        share = SHARES[name] / sum(SHARES[s] for s in todo[i:])
        deadline = now + share * left
        rec.update(status="running", budget_s=round(deadline - now, 1))
        ctx.log(f"[{name}] {deadline - now:.0f} s")
        report.save()
        t0 = time.monotonic()
        try:
            STEP_FNS[name](ctx, rec, deadline)
            rec["status"] = rec.pop("status_override", None) or ("failed" if rec.get("failed") else
                                                                 "partial" if rec.get("partial") else "done")
        except BudgetExceeded as e:
            rec.update(status="cut", reason=str(e))
            stop_reason = f"not run: {e}"
        except Terminated as e:
            rec.update(status="cut", reason=f"terminated ({e})")
            stop_reason = f"not run: terminated ({e})"
        except Exception as e:
            rec.update(status="error", error=tail(traceback.format_exc(), 12), reason=f"{type(e).__name__}: {e}")
        rec["seconds"] = round(time.monotonic() - t0, 2)
        if stop_reason is None:
            _pack_cache(report, archive)
        _count(report)
        report.save()
    incomplete = any(report.data["steps"][n]["status"] in ("skipped", "partial") for n in todo)
    report.data["status"] = "cut short" if stop_reason is not None else "incomplete" if incomplete else "finished"
    _count(report)
    report.save()


def _count(report: Report) -> None:
    c = {"passed": 0, "failed": 0, "not_covered": 0, "errors": 0}
    for name in ("correctness", "sanitizer"):
        s = report.data["steps"][name]
        for k in ("passed", "failed", "not_covered"):
            c[k] += s.get(k, 0)
    for s in report.data["steps"].values():
        if s.get("status") == "error":
            c["errors"] += 1
        c["errors"] += sum(1 for r in s.get("cases", []) if r.get("status") == "error")
    report.data["counts"] = c
