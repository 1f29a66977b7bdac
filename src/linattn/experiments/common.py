"""What every experiment shares: arguments, the results folder, resumable per-run result files,
determinism, progress bars, and the JSON / markdown / PNG outputs.

Layout of `results/NAME/` (or `--out DIR`):

    experiment.json     the experiment's configuration (name, budget, seed, data, ...); a resume
                        with a different configuration is refused
    runs/<run>.json     one file per finished run (written atomically once the run is complete)
    results.json        everything: machine, configuration, every run, the summary
    results.md          the markdown tables (what docs/results/ quotes)
    *.png               the plots

Resuming: each run has an id; `--resume` skips runs whose result file exists. Without `--resume`
an occupied folder is refused (so finished results are never overwritten), unless `--overwrite`,
which deletes the previous run files first.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import math
import os
import random
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence

import numpy as np
import torch

from ..bench.common import describe_machine, machine_info
from ..devices import resolve_device  # noqa: F401  (re-exported for the experiments)
from ..errors import LinattnError
from ..io import atomic_write_text, jsonable, read_json, write_json
from ..logs import get_logger
from ..plotting import MISSING, matplotlib_missing

log = get_logger("experiments")

RUNS_DIR = "runs"
CONFIG_FILE = "experiment.json"


class ExperimentError(LinattnError):
    """A bad request (occupied results folder, mismatched resume, missing data)."""


# ----------------------------------------------------------------------------------------------
# Arguments
# ----------------------------------------------------------------------------------------------

def add_common_arguments(p: argparse.ArgumentParser, name: str, data_help: str,
                         default_seed: int = 0, budgets: Optional[Dict[str, str]] = None) -> None:
    """The options every experiment has. budgets: {name: help} of the experiment's advertised
    budgets (default quick and full); "tiny" (the tests' micro budget) is always accepted, never shown."""
    budgets = budgets or {"quick": "a reduced protocol that fits a 2-core CPU in about 20 minutes",
                          "full": "the published protocol (meant for a GPU)"}
    names = list(budgets)
    p.add_argument("--budget", default=names[0], choices=names + ["tiny"], metavar="{" + ",".join(names) + "}",
                   help="; ".join(f"{k}: {v}" for k, v in budgets.items()) + f". Default {names[0]}")
    p.add_argument("--data", default=None, help=data_help)
    p.add_argument("--out", default=None, help=f"results folder (default results/{name}/)")
    p.add_argument("--seed", type=int, default=default_seed, help=f"base random seed (default {default_seed})")
    p.add_argument("--resume", action="store_true",
                   help="continue an interrupted experiment: finished runs are skipped")
    p.add_argument("--overwrite", action="store_true",
                   help="delete the results already in the folder and start over")
    p.add_argument("--report-only", action="store_true",
                   help="train nothing: render the tables and plots from the runs already finished in the "
                        "folder (marked incomplete when some are missing); implies --resume")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: torch's default). On a CPU shared with other jobs, "
                        "1 is often faster than 2")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:i] (default cpu)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def subset_of(choices: Sequence[str], ordered: bool = False) -> Callable[[str], List[str]]:
    """An argparse type: a comma-separated subset of `choices`, without repeats, in the order given
    (ordered=True: in the order of `choices`); unknown or no names are an argparse error naming them."""
    def parse(text: str) -> List[str]:
        items = list(dict.fromkeys(s.strip() for s in text.split(",") if s.strip()))
        bad = [s for s in items if s not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(
                (f"unknown name(s) {', '.join(map(repr, bad))}" if bad else "no name given")
                + f"; give a comma-separated subset of {','.join(choices)}")
        return [c for c in choices if c in items] if ordered else items
    return parse


# ----------------------------------------------------------------------------------------------
# Determinism and small helpers
# ----------------------------------------------------------------------------------------------

def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2 ** 32))
    torch.manual_seed(seed)


def set_threads(threads: Optional[int]) -> None:
    if threads:
        if threads < 1:
            raise ExperimentError(f"--threads must be >= 1, got {threads}")
        torch.set_num_threads(int(threads))


def md_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], align: Optional[str] = None) -> str:
    """A GitHub markdown table; align: one char per column, 'l' or 'r' (default: first left, rest right)."""
    if align is None:
        align = "l" + "r" * (len(headers) - 1)
    sep = ["---:" if a == "r" else ":---" for a in align]
    lines = ["| " + " | ".join(str(h) for h in headers) + " |", "| " + " | ".join(sep) + " |"]
    for r in rows:
        lines.append("| " + " | ".join("" if c is None else str(c) for c in r) + " |")
    return "\n".join(lines)


def mean_std(xs: Iterable[Optional[float]]):
    v = [float(x) for x in xs if x is not None and math.isfinite(float(x))]
    if not v:
        return None, None, 0
    m = sum(v) / len(v)
    s = math.sqrt(sum((x - m) ** 2 for x in v) / (len(v) - 1)) if len(v) > 1 else 0.0
    return m, s, len(v)


def fmt(x: Optional[float], digits: int = 1) -> str:
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:.{digits}f}"


def fmt_pm(m: Optional[float], s: Optional[float], n: int, digits: int = 1) -> str:
    if m is None:
        return "-"
    return f"{m:.{digits}f} ± {s:.{digits}f}" if n > 1 else f"{m:.{digits}f}"


def paired_difference(a: Sequence[Optional[float]], b: Sequence[Optional[float]]) -> Dict[str, Any]:
    """Paired per-seed differences d_r = a_r - b_r (pairs with a missing value are dropped), and
    whether they exceed the spread: |mean(d)| > 2 * std(d) / sqrt(n) with n >= 2 pairs (a paired
    two-standard-error criterion; about a 5% test for many seeds, a rough one for 2-5)."""
    d = [float(x) - float(y) for x, y in zip(a, b) if x is not None and y is not None
         and math.isfinite(float(x)) and math.isfinite(float(y))]
    m, s, n = mean_std(d)
    bound = 2.0 * s / math.sqrt(n) if n >= 2 else None     # what |mean| must exceed
    return {"diffs": d, "mean": m, "std": s, "n": n, "positive": sum(1 for x in d if x > 0), "bound": bound,
            "exceeds": None if bound is None else abs(m) > bound}


def describe_difference(p: Dict[str, Any], higher: str, lower: str, digits: int = 1) -> str:
    """One phrase for a `paired_difference`: "a - b = +1.2 ± 0.3 (+ in 2 of 2 seeds): exceeds the
    spread (higher: A)", with `higher` / `lower` naming what a positive / negative mean says."""
    if not p["n"]:
        return "no paired values"
    text = f"{p['mean']:+.{digits}f} ± {p['std']:.{digits}f} (+ in {p['positive']} of {p['n']})"
    if p["exceeds"] is None:
        return text + ": one seed, spread unknown"
    if not p["exceeds"]:
        return text + ": within the spread"
    return text + f": exceeds the spread ({higher if p['mean'] > 0 else lower})"


def progress(iterable=None, total: Optional[int] = None, desc: str = "", enabled: bool = True, **kw):
    """A tqdm bar on stderr (refreshes at most every 2 s when stderr is not a terminal)."""
    from tqdm import tqdm

    tty = sys.stderr.isatty()
    return tqdm(iterable, total=total, desc=desc, disable=not enabled, dynamic_ncols=True, leave=True,
                mininterval=0.1 if tty else 2.0, file=sys.stderr, **kw)


# ----------------------------------------------------------------------------------------------
# The results folder
# ----------------------------------------------------------------------------------------------

class Experiment:
    """The results folder of one experiment: refusal/overwrite/resume, per-run files, outputs.

    config: what identifies the experiment's results (budget, seed, data, options); a resume
    with a different config is refused.
    """

    def __init__(self, name: str, args: argparse.Namespace, config: Dict[str, Any]):
        self.name = name
        self.args = args
        self.root = Path(args.out) if args.out else Path("results") / name
        self.runs = self.root / RUNS_DIR
        self.config = jsonable(dict(config, experiment=name))
        self.progress_enabled = not getattr(args, "no_progress", False)
        self.t0 = time.perf_counter()
        self.machine = machine_info(str(getattr(args, "device", "cpu")))
        self.report_only = bool(getattr(args, "report_only", False))
        if self.report_only:
            if args.overwrite:
                raise ExperimentError("--report-only and --overwrite contradict each other: pick one")
            if not (self.runs.is_dir() and any(self.runs.glob("*.json"))):
                raise ExperimentError(f"--report-only: no finished run in {self.runs} to report")
            args.resume = True    # everything downstream (tokenizers, checkpoints) reuses what is there
        self._prepare(bool(args.resume), bool(args.overwrite))

    def _prepare(self, resume: bool, overwrite: bool) -> None:
        if self.root.exists() and not self.root.is_dir():
            raise ExperimentError(f"{self.root} exists and is not a folder")
        existing = sorted(self.runs.glob("*.json")) if self.runs.is_dir() else []
        saved = read_json(self.root / CONFIG_FILE)
        if overwrite:
            if self.runs.is_dir():
                shutil.rmtree(self.runs)
        elif existing:   # a folder with a configuration but no finished run holds nothing to lose
            if not resume:
                raise ExperimentError(
                    f"{self.root} already holds results of `{self.name}` ({len(existing)} finished run(s)); pass "
                    f"--resume to continue them, --overwrite to start over, or --out for another folder")
            if saved is not None and saved != self.config:
                diff = sorted(k for k in set(saved) | set(self.config) if saved.get(k) != self.config.get(k))
                raise ExperimentError(
                    f"cannot resume {self.root}: it was started with a different configuration "
                    f"(differs in: {', '.join(diff)}); use the same options, --overwrite, or another --out")
        self.runs.mkdir(parents=True, exist_ok=True)
        write_json(self.root / CONFIG_FILE, self.config)

    # -- runs --------------------------------------------------------------------------------
    def run_path(self, run_id: str) -> Path:
        safe = "".join(c if (c.isalnum() or c in "-_.+=") else "_" for c in run_id)
        return self.runs / f"{safe}.json"

    def finished(self, run_id: str) -> Optional[Dict[str, Any]]:
        rec = read_json(self.run_path(run_id))
        return rec if isinstance(rec, dict) and rec.get("finished") else None

    def save_run(self, run_id: str, record: Dict[str, Any]) -> Dict[str, Any]:
        rec = dict(record, run_id=run_id, finished=True,
                   finished_at=_dt.datetime.now().astimezone().isoformat(timespec="seconds"))
        write_json(self.run_path(run_id), rec)
        return jsonable(rec)

    def run_all(self, plan: Sequence[Dict[str, Any]], fn: Callable[[Dict[str, Any]], Dict[str, Any]],
                log: Callable[[str], None] = print) -> List[Dict[str, Any]]:
        """Run fn(spec) for each spec of `plan` (each with a unique "run_id"), skipping finished runs;
        returns the finished records in plan order.

        Several processes may share one results folder (start the others with --resume): each run
        is claimed with a lock file (`runs/<run>.claim`, released by the OS however the process
        ends) and a process skips the runs another one holds. The last process to finish renders
        the complete tables; the others say which runs were still going."""
        from ..training.lock import RunFolderBusy, RunLock

        out = []
        n_done = sum(1 for s in plan if self.finished(s["run_id"]) is not None)
        if n_done:
            log(f"[{self.name}] {n_done}/{len(plan)} runs already finished in {self.runs} (skipped)")
        for i, spec in enumerate(plan):
            rec = self.finished(spec["run_id"])
            if rec is None and self.report_only:
                continue
            if rec is None:
                claim = RunLock(self.runs, self.run_path(spec["run_id"]).stem + ".claim",
                                after_death="the run starts over")
                try:
                    claim.acquire()
                except RunFolderBusy:
                    log(f"[{self.name}] run {i + 1}/{len(plan)}: {spec['run_id']} is running in another process")
                    continue
                try:
                    rec = self.finished(spec["run_id"])     # finished while we looked at the claim
                    if rec is None:
                        rec = self._run_one(spec, fn, f"run {i + 1}/{len(plan)}", log)
                finally:
                    claim.release()
            out.append(rec)
        if len(out) < len(plan):
            out = [r for r in (self.finished(s["run_id"]) for s in plan) if r is not None]   # others finished meanwhile
        if len(out) < len(plan):
            log(f"[{self.name}] {len(plan) - len(out)} of {len(plan)} runs are not finished (running in other "
                f"processes, or not started): the tables are incomplete")
        return out

    def _run_one(self, spec, fn, what: str, log) -> Dict[str, Any]:
        log(f"[{self.name}] {what}: {spec['run_id']}")
        t, c = time.perf_counter(), time.process_time()
        load = _loadavg1()
        result = fn(spec)
        result.setdefault("loadavg_1min_at_start", load)
        result.setdefault("threads", torch.get_num_threads())
        result.setdefault("wall_s", time.perf_counter() - t)
        result.setdefault("cpu_s", time.process_time() - c)   # all threads: ~ wall time when alone
        return self.save_run(spec["run_id"], dict(spec, **result))

    def incomplete_note(self, runs: Sequence[Dict[str, Any]], planned: int) -> List[str]:
        """A markdown warning when only some planned runs are finished (the rest run elsewhere or later)."""
        if len(runs) >= planned:
            return []
        return [f"**Incomplete: {len(runs)} of {planned} runs finished** (the others were still running in "
                f"another process, or not started; --resume finishes them and re-renders the tables).", ""]

    # -- outputs -----------------------------------------------------------------------------
    def header_lines(self, runs: Optional[List[Dict[str, Any]]] = None, extra_args: str = "") -> List[str]:
        """command, machine and dates; with `runs`, the dates and load come from the runs themselves
        (so re-rendering finished results with --resume keeps the dates of the measurements)."""
        a = self.args
        cmd = "linattn experiment " + self.name + f" --budget {a.budget}" + \
            (f" --data {a.data}" if getattr(a, "data", None) else "") + f" --seed {a.seed}" + extra_args + \
            (f" --threads {a.threads}" if getattr(a, "threads", None) else "")
        lines = [f"command: `{cmd}`"]
        info = self.machine
        if runs:
            loads = [r["loadavg_1min_at_start"] for r in runs if r.get("loadavg_1min_at_start") is not None]
            threads = sorted({r["threads"] for r in runs if r.get("threads")})
            m = f"{info.get('cpu')} ({info.get('cpus_usable')} usable cpus), torch {info.get('torch')}"
            if threads:
                m += f", {'/'.join(map(str, threads))} thread(s)"
            if info.get("gpu"):
                m += f", GPU {info['gpu']}"
            if loads:
                m += f"; 1-min load average at the start of the runs {min(loads):.1f}-{max(loads):.1f} " \
                     f"(the CPUs were shared with other jobs)"
            lines.append("machine: " + m)
            ends = sorted(r["finished_at"] for r in runs if r.get("finished_at"))
            starts = []
            for r in runs:
                try:
                    end = _dt.datetime.fromisoformat(r["finished_at"])
                    start = end - _dt.timedelta(seconds=float(r.get("wall_s", 0.0)))
                    starts.append(start.isoformat(timespec="seconds"))
                except (KeyError, TypeError, ValueError):
                    pass
            if ends:
                lines.append(f"date: runs from {min(starts) if starts else '?'} to {ends[-1]}; "
                             f"total run time {sum(float(r.get('wall_s', 0)) for r in runs) / 60:.1f} min")
        else:
            lines += ["machine: " + machine_line(info), f"date: {info['date']}"]
        return lines

    def write_outputs(self, summary: Dict[str, Any], runs: List[Dict[str, Any]], markdown: str,
                      plots: Dict[str, Callable[[Path], None]] = None) -> Dict[str, Path]:
        paths: Dict[str, Path] = {}
        if plots and matplotlib_missing():   # the `plots` extra is optional: one notice for all the figures
            log.warning(f"[linattn] {MISSING}")
            markdown += f"\n\n({MISSING})"
            plots = {}
        for stem, plot in (plots or {}).items():
            p = self.root / f"{stem}.png"
            try:
                plot(p)
                paths[stem] = p
            except Exception as e:  # a plotting problem must not lose the results
                markdown += f"\n\n(plot {stem} failed: {type(e).__name__}: {e})"
        md_path = self.root / "results.md"
        atomic_write_text(md_path, markdown.rstrip() + "\n")
        js_path = self.root / "results.json"
        write_json(js_path, {"experiment": self.name, "config": self.config, "machine": self.machine,
                             "machine_text": describe_machine(self.machine), "summary": summary, "runs": runs,
                             "wall_s": time.perf_counter() - self.t0})
        paths.update(markdown=md_path, json=js_path)
        return paths


def _loadavg1() -> Optional[float]:
    try:
        return round(os.getloadavg()[0], 2)
    except (OSError, AttributeError):
        return None


def machine_line(info: Dict[str, Any]) -> str:
    s = f"{info.get('cpu')} ({info.get('cpus_usable')} usable cpus), torch {info.get('torch')}, " \
        f"{info.get('torch_threads')} threads"
    if info.get("gpu"):
        s += f", GPU {info['gpu']}"
    if info.get("loadavg_1_5_15min"):
        s += f", load average at start {info['loadavg_1_5_15min'][0]}"
    return s


# ----------------------------------------------------------------------------------------------
# Plots
# ----------------------------------------------------------------------------------------------

def line_panels(path: Path, panels: Sequence[Dict[str, Any]], title: Optional[str] = None,
                ncols: Optional[int] = None, panel_size=(4.6, 3.6), dpi: int = 90) -> None:
    """Save line plots (Agg canvas, no display). Each panel: {"title", "xlabel", "ylabel",
    "logx", "logy", "ylim", "series": [{"label", "x", "y", "err" (optional band), "color",
    "linestyle", "marker"}]}. None values are skipped."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    n = len(panels)
    ncols = ncols or n
    nrows = (n + ncols - 1) // ncols
    fig = Figure(figsize=(panel_size[0] * ncols, panel_size[1] * nrows), constrained_layout=True)
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    for ax, p in zip(axes, panels):
        for s in p["series"]:
            pts = [(x, y, (s.get("err") or [None] * len(s["x"]))[i]) for i, (x, y) in enumerate(zip(s["x"], s["y"]))
                   if y is not None and math.isfinite(y)]
            if not pts:
                continue
            xs, ys = [a for a, _, _ in pts], [b for _, b, _ in pts]
            ax.plot(xs, ys, label=s.get("label"), color=s.get("color"), linestyle=s.get("linestyle", "-"),
                    marker=s.get("marker", "o"), markersize=3.5, linewidth=1.5)
            errs = [e for _, _, e in pts]
            if any(e is not None for e in errs):
                lo = [y - (e or 0.0) for y, e in zip(ys, errs)]
                hi = [y + (e or 0.0) for y, e in zip(ys, errs)]
                ax.fill_between(xs, lo, hi, color=s.get("color"), alpha=0.18, linewidth=0)
        if p.get("logx"):
            ax.set_xscale("log", base=2)
        if p.get("logy"):
            ax.set_yscale("log")
        if p.get("ylim"):
            ax.set_ylim(*p["ylim"])
        ax.set_title(p.get("title", ""), fontsize=9)
        ax.set_xlabel(p.get("xlabel", ""), fontsize=8)
        ax.set_ylabel(p.get("ylabel", ""), fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6.5)
    for ax in axes[n:]:
        ax.set_visible(False)
    if title:
        fig.suptitle(title, fontsize=8)
    fig.savefig(path, dpi=dpi)


def series_colors(k: int) -> List[Any]:
    """k distinct matplotlib colours: the default cycle's 10, else tab20's 20 (they repeat beyond 20)."""
    import matplotlib

    if k <= 10:
        return [f"C{i}" for i in range(k)]
    return [matplotlib.colormaps["tab20"](i % 20) for i in range(k)]


def bar_panel(path: Path, groups: Sequence[str], series: Dict[str, Sequence[Optional[float]]], ylabel: str,
              title: Optional[str] = None, size=(9.0, 3.6), dpi: int = 90, ylim=None,
              errors: Optional[Dict[str, Sequence[Optional[float]]]] = None, hline: Optional[float] = None) -> None:
    """Grouped bars: one group per entry of `groups`, one bar per series; errors: {series: error bar
    per group} (e.g. the std over seeds); hline: a dashed reference level."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    k = max(1, len(series))
    if k > 10:      # the default cycle has 10 colours: more series take tab20's and a wider figure
        size = (size[0] * k / 10, size[1])
    colors = series_colors(k)
    fig = Figure(figsize=size, constrained_layout=True)
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    w = 0.8 / k
    for i, (label, vals) in enumerate(series.items()):
        xs = [g + (i - (k - 1) / 2) * w for g in range(len(groups))]
        err = (errors or {}).get(label)
        ax.bar(xs, [v if v is not None else 0.0 for v in vals], width=w, label=label, color=colors[i],
               yerr=None if err is None else [e or 0.0 for e in err], capsize=1.5, error_kw={"linewidth": 0.8})
    if hline is not None:
        ax.axhline(hline, color="0.3", linestyle="--", linewidth=0.8)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups, fontsize=7)
    ax.set_ylabel(ylabel, fontsize=8)
    if ylim:
        ax.set_ylim(*ylim)
    ax.tick_params(labelsize=7)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=6.5, ncol=min(7, k), loc="lower center", bbox_to_anchor=(0.5, 1.0), frameon=False)
    if title:
        fig.suptitle(title, fontsize=8)
    fig.savefig(path, dpi=dpi)


__all__ = [
    "Experiment", "ExperimentError", "add_common_arguments", "seed_everything", "set_threads",
    "resolve_device", "subset_of", "md_table", "mean_std", "fmt", "fmt_pm", "paired_difference", "describe_difference",
    "progress", "line_panels", "series_colors", "bar_panel", "machine_line",
]
