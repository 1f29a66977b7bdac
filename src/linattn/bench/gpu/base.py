"""What every step of `linattn bench gpu` shares: the run's exceptions, the context a step receives, the
report (gpu.json and gpu.md, rewritten whenever something is recorded) and small numeric helpers."""
from __future__ import annotations

import datetime as _dt
import time
from typing import Any, Callable, Dict, List

import torch

from ...errors import LinattnError
from ...io import atomic_write_text, write_json

PROG = "linattn bench gpu"
# the steps in the order they run; cpu-scaling last (optional: the GPU machine's CPU); the sanitizer only
# when asked for by --steps (it took minutes on the first run and found nothing the correctness step misses)
STEPS = ("machine", "correctness", "timing", "lm", "cpu-scaling", "sanitizer")
DEFAULT_STEPS = ("machine", "correctness", "timing", "lm", "cpu-scaling")
# shares of the budget; a step's deadline is its share of what is left when it starts
SHARES = {"machine": 0.05, "correctness": 0.33, "timing": 0.30, "lm": 0.22, "cpu-scaling": 0.10, "sanitizer": 0.10}
STEP_TITLES = {
    "machine": "machine and its measured rates",
    "correctness": "the fla backend and the Triton kernels against the PyTorch forms (same device)",
    "timing": "timings (ms; TFLOP/s of the chunk algorithm's matmuls, % of the measured bf16 matmul rate)",
    "lm": "LM training step and decoding",
    "cpu-scaling": "the compiled CPU kernels on the machine's cores",
    "sanitizer": "compute-sanitizer",
}


class BudgetExceeded(BaseException):
    """The run's time budget ran out in the middle of a step. A BaseException, like KeyboardInterrupt,
    so that no `except Exception` on the way (ours, torch's, fla's) swallows it."""


class Terminated(BaseException):
    """SIGTERM: record what is done and stop (a BaseException, as above)."""


class NotCovered(LinattnError):
    """A case the implementation does not cover (reported as such, not as an error)."""


class Report:
    """gpu.json and gpu.md, rewritten by `save()` after every case and every step."""

    def __init__(self, paths, config: Dict[str, Any], steps: List[str]):
        self.paths = paths
        self.data: Dict[str, Any] = {
            "benchmark": "gpu", "status": "running", "config": config,
            "started": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
            "elapsed_s": 0.0,
            "steps": {s: {"status": "pending" if s in steps else "skipped",
                          **({} if s in steps else {"reason": "not in --steps"})} for s in STEPS},
        }
        self.t0 = time.monotonic()

    def save(self) -> None:
        self.data["elapsed_s"] = round(time.monotonic() - self.t0, 2)
        write_json(self.paths["json"], self.data)
        atomic_write_text(self.paths["md"], render_md(self.data))


class Ctx:
    """What a step function receives besides its record and deadline: the plan (shapes), the report, a
    progress logger and the run's hard end."""

    def __init__(self, plan, report: Report, log: Callable[[str], None], hard_end: float):
        self.plan, self.report, self.log, self.hard_end = plan, report, log, hard_end
        self.device = plan["device"]


def fmt(x) -> str:
    if x is None:
        return ""
    if isinstance(x, float):
        if x != x:
            return "nan"
        return f"{x:.3g}" if (abs(x) < 1e-2 or abs(x) >= 1e4) and x != 0 else f"{x:.3f}".rstrip("0").rstrip(".")
    return str(x)


def render_md(d: Dict[str, Any]) -> str:
    cfg = d["config"]
    out = [f"# linattn bench gpu{' (dry run: CPU, Triton interpreter, tiny shapes)' if cfg.get('dry_run') else ''}",
           "",
           f"started {d['started']}; status **{d['status']}**; {d['elapsed_s']:.0f} s of a "
           f"{cfg['budget_s']:.0f} s budget", "",
           f"command: `{cfg['command']}`", ""]
    counts = d.get("counts")
    if counts:
        out += ["cases: " + ", ".join(f"{k} {v}" for k, v in counts.items()), ""]
    for n in cfg.get("notes", []):
        out.append(f"- {n}")
    if cfg.get("notes"):
        out.append("")
    for i, name in enumerate(STEPS, 1):
        s = d["steps"][name]
        out += [f"## {i}. {name}: {STEP_TITLES[name]}", "",
                f"status: **{s['status']}**" + (f" ({s['seconds']:.1f} s)" if "seconds" in s else "")
                + (f"; {s['reason']}" if s.get("reason") else ""), ""]
        if s.get("error"):
            out += ["```", s["error"].rstrip(), "```", ""]
        for n in s.get("notes", []):
            out.append(f"- {n}")
        if s.get("notes"):
            out.append("")
        for key in ("table", "targets"):  # the step's rows, then (timing) the targets derived from them
            tab = s.get(key)
            if tab and tab["rows"]:
                out.append("| " + " | ".join(tab["headers"]) + " |")
                out.append("|" + "---|" * len(tab["headers"]))
                for r in tab["rows"]:
                    out.append("| " + " | ".join(fmt(c) for c in r) + " |")
                out.append("")
    out += ["## reading this file", "",
            "docs/triton.md, section 'GPU run (runbook)', says what each status means and what to do about it.",
            ""]
    return "\n".join(out)


def tail(text: str, n: int = 12) -> str:
    """The last `n` lines of `text` (tracebacks and tool output in the report)."""
    return "\n".join(text.rstrip().splitlines()[-n:])


def sync(device) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def rel_err(a, b) -> float:
    """RMS of a - b over the RMS of b (fp64)."""
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-300)).item()


def free_cuda(device) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.empty_cache()
