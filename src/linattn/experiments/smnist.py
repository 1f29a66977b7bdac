"""`linattn experiment smnist-robustness`: the EFLA paper's sequential-MNIST robustness experiment
(section 5.1, Figure 1), as its public code (declare-lab/EFLA `mnist.py`) runs it.

Model (one class for both methods): pixels in [0, 1] (no normalisation) as a sequence of 784
scalars; Linear(1, 64, no bias) + a learned positional table (N(0, 0.02^2)), GELU; one layer, one
head, d = 64; q, k, v = Linear(64, 64, no bias) with Xavier-uniform init; beta = sigmoid(Linear(64, 1))
with the bias initialised to -2; the delta rule over the 784 steps from a zero state; readout
S_T^T q_T with the raw (unnormalised) last query, LayerNorm(64), Linear(64, 10).

* DeltaNet: keys L2-normalised, a_t = beta_t  (`linattn.delta_rule(..., exact=False)`);
* EFLA:     raw keys, a_t = (1 - exp(-beta_t |k_t|^2)) / |k_t|^2  (`exact=True`).

Both run `linattn.delta_rule` in chunk mode with scale 1. (The public code adds 1e-6 to the EFLA
denominator and clamps |k|^2 >= 1e-6; the library's coefficient is the exact expression, the same
to ~1e-6 relative for any key that is not tiny.)

Training: one pass over the training images in a shuffled order, batch 128, AdamW (weight decay
0.01), gradient clipping at 1.0, cross-entropy, no schedule; lr 1e-3 for DeltaNet and 3e-3 for EFLA.
Seeds: replicate r trains DeltaNet with seed S + 1000 r + 1 and EFLA with S + 1000 r + 2 (S = --seed,
default 42: replicate 0 is the public code's 43 / 44), and evaluates with seed S + 1000 r, reseeded
before each sweep.

Robustness sweeps on the test images (accuracy, %): input scaling x*s, s = 1..10; additive
Gaussian noise x + N(0, sigma^2), sigma = 0, 0.1, ..., 1; pixel dropout x * Bernoulli(1 - p),
p = 0, 0.1, ..., 1, without 1/(1-p) rescaling.

Budgets: full = the protocol above on all 60k training and 10k test images, 3 replicates
(the public code runs one); quick = 6,400 training images (one pass, 50 steps), the first 500
test images and 3 replicates, to fit about 20 minutes of a 2-core CPU.
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..errors import ConfigError
from ..ops import delta_rule
from . import common
from .common import ExperimentError, fmt, fmt_pm, md_table, mean_std

NAME = "smnist-robustness"
DESCRIPTION = __doc__.split("\n\n")[0] + "\n\n" + "\n\n".join(__doc__.split("\n\n")[1:])
DEFAULT_DATA = "../shared/data/mnist"

METHODS = ("deltanet", "efla")
LABEL = {"deltanet": "DeltaNet", "efla": "EFLA"}
COLOR = {"deltanet": "C1", "efla": "C3"}
RANK = {"deltanet": 1, "efla": 2}          # the public code's seed offsets (42 + rank)
LR = {"deltanet": 1e-3, "efla": 3e-3}      # LR and LR_EFLA of the public code

SWEEPS = {
    "scale": ("input scaling s (x * s)", [float(s) for s in range(1, 11)]),
    "noise": ("additive Gaussian noise sigma", [round(0.1 * i, 1) for i in range(11)]),
    "dropout": ("pixel dropout p", [round(0.1 * i, 1) for i in range(11)]),
}
SWEEP_TITLE = {"scale": "OOD intensity scaling", "noise": "additive Gaussian noise", "dropout": "pixel dropout"}


@dataclass
class Budget:
    train_images: int
    test_images: int
    replicates: int
    batch_size: int = 128
    eval_batch_size: int = 128
    chunk_size: int = 64
    levels: Optional[Dict[str, List[float]]] = None   # None: the full sweeps


BUDGETS = {
    "full": Budget(train_images=60_000, test_images=10_000, replicates=3),
    "quick": Budget(train_images=6_400, test_images=500, replicates=3, eval_batch_size=250),
    "tiny": Budget(train_images=32, test_images=16, replicates=1, batch_size=16, eval_batch_size=16,
                   levels={"scale": [1.0, 10.0], "noise": [0.0, 1.0], "dropout": [0.0, 1.0]}),
}


# ----------------------------------------------------------------------------------------------
# The model
# ----------------------------------------------------------------------------------------------

class SMNISTClassifier(nn.Module):
    """The public code's LinearAttentionClassifier, with the recurrence computed by
    `linattn.delta_rule` (chunk form). method: "deltanet" or "efla"."""

    def __init__(self, method: str, dim: int = 64, seq_len: int = 784, n_classes: int = 10, chunk_size: int = 64):
        super().__init__()
        if method not in METHODS:
            raise ConfigError(f"method must be one of {METHODS}, got {method!r}")
        self.method, self.chunk_size = method, int(chunk_size)
        # creation order as in the public code (it decides the initial weights for a seed)
        self.input_proj = nn.Linear(1, dim, bias=False)
        self.pos_emb = nn.Parameter(torch.randn(seq_len, dim) * 0.02)
        self.act = nn.GELU()
        self.q_proj = nn.Linear(dim, dim, bias=False)
        self.k_proj = nn.Linear(dim, dim, bias=False)
        self.v_proj = nn.Linear(dim, dim, bias=False)
        self.beta_proj = nn.Linear(dim, 1)
        self.norm = nn.LayerNorm(dim)
        self.classifier = nn.Linear(dim, n_classes)
        nn.init.xavier_uniform_(self.q_proj.weight)
        nn.init.xavier_uniform_(self.k_proj.weight)
        nn.init.xavier_uniform_(self.v_proj.weight)
        nn.init.constant_(self.beta_proj.bias, -2.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x `[B, T, 1]` (pixels) -> logits `[B, n_classes]`."""
        h = self.act(self.input_proj(x) + self.pos_emb[: x.shape[1]])
        q, k, v = self.q_proj(h), self.k_proj(h), self.v_proj(h)
        beta = torch.sigmoid(self.beta_proj(h))                      # [B, T, 1]: one head
        if self.method == "deltanet":
            k = F.normalize(k, p=2, dim=-1)
        o, _ = delta_rule(q.unsqueeze(2), k.unsqueeze(2), v.unsqueeze(2), beta, exact=self.method == "efla",
                          scale=1.0, mode="chunk", chunk_size=self.chunk_size)
        return self.classifier(self.norm(o[:, -1, 0]))


# ----------------------------------------------------------------------------------------------
# Data, training, evaluation
# ----------------------------------------------------------------------------------------------

def to_sequence(images: torch.Tensor) -> torch.Tensor:
    """uint8 `[N, 28, 28]` -> float `[N, 784, 1]` in [0, 1] (ToTensor, no normalisation)."""
    return (images.float() / 255.0).reshape(images.shape[0], -1, 1)


def perturb(x: torch.Tensor, sweep: str, level: float) -> torch.Tensor:
    if sweep == "scale":
        return x * level
    if sweep == "noise":
        return x + torch.randn_like(x) * level
    if sweep == "dropout":
        return x * torch.bernoulli(torch.ones_like(x) * (1 - level))
    raise ConfigError(f"unknown sweep {sweep!r}; sweeps are: {', '.join(SWEEPS)}")


def train_one(method: str, seed: int, train_x: torch.Tensor, train_y: torch.Tensor, budget: Budget,
              device: torch.device, bar: bool) -> Dict[str, Any]:
    common.seed_everything(seed)
    model = SMNISTClassifier(method, chunk_size=budget.chunk_size).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=LR[method])
    perm = torch.randperm(train_x.shape[0])[: budget.train_images]
    steps = math.ceil(len(perm) / budget.batch_size)
    losses: List[float] = []
    model.train()
    t0 = time.perf_counter()
    with common.progress(total=steps, desc=f"train {LABEL[method]} seed {seed}", enabled=bar, unit="step") as pb:
        for i in range(steps):
            idx = perm[i * budget.batch_size:(i + 1) * budget.batch_size]
            x = to_sequence(train_x[idx]).to(device)
            y = train_y[idx].to(device)
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
            opt.step()
            lv = float(loss.item())
            if not math.isfinite(lv):
                raise FloatingPointError(f"{method} seed {seed}: loss {lv} at step {i + 1}")
            losses.append(lv)
            pb.update(1)
            pb.set_postfix(loss=f"{sum(losses[-20:]) / len(losses[-20:]):.3f}", refresh=False)
    return {"model": model, "losses": losses, "steps": steps, "train_images": len(perm),
            "train_s": time.perf_counter() - t0}


@torch.no_grad()
def evaluate(model: nn.Module, test_x: torch.Tensor, test_y: torch.Tensor, levels: Dict[str, List[float]],
             eval_seed: int, batch_size: int, device: torch.device, bar: bool) -> Dict[str, List[float]]:
    model.eval()
    out: Dict[str, List[float]] = {}
    total = sum(len(v) for v in levels.values())
    with common.progress(total=total, desc="robustness sweeps", enabled=bar, unit="cond") as pb:
        for sweep, values in levels.items():
            torch.manual_seed(eval_seed)        # seed_everything(42) before each sweep, as the public code
            accs = []
            for level in values:
                correct = 0
                for i in range(0, test_x.shape[0], batch_size):
                    x = to_sequence(test_x[i:i + batch_size]).to(device)
                    pred = model(perturb(x, sweep, level)).argmax(dim=-1)
                    correct += int((pred.cpu() == test_y[i:i + batch_size]).sum())
                accs.append(100.0 * correct / test_x.shape[0])
                pb.update(1)
                pb.set_postfix({sweep: level, "acc": f"{accs[-1]:.1f}"}, refresh=False)
            out[sweep] = accs
    return out


# ----------------------------------------------------------------------------------------------
# Summary and verdict
# ----------------------------------------------------------------------------------------------

def _verdict(diffs: List[float]) -> str:
    md, sd, n = mean_std(diffs)
    if n == 0:
        return "not tested"
    if n == 1:
        return "EFLA higher (one replicate: no spread)" if md > 0 else "EFLA not higher (one replicate)"
    if all(d > 0 for d in diffs):
        return ("holds: EFLA higher in every replicate" if md > sd else
                "weak: EFLA higher in every replicate, but the gap is within the spread between replicates")
    if all(d < 0 for d in diffs):
        return "does not hold: DeltaNet higher in every replicate"
    return "inconclusive: the sign differs between replicates"


def summarize(runs: List[Dict[str, Any]], levels: Dict[str, List[float]]) -> Dict[str, Any]:
    """Mean and spread per (method, sweep, level); per sweep and replicate two robustness scores,
    paired EFLA - DeltaNet differences and a verdict for each:

    * area: the mean accuracy over the sweep's levels (the paper's curves, clean point included);
    * retention: the mean over the perturbed levels of accuracy / clean accuracy (how much of its own
      clean accuracy a model keeps; separates "more robust" from "more accurate").
    """
    by = {(r["method"], r["replicate"]): r for r in runs}
    reps = sorted({r["replicate"] for r in runs})
    out: Dict[str, Any] = {"curves": {}, "area": {}, "retention": {}, "verdict": {}, "clean": {}}
    for m in METHODS:
        out["curves"][m] = {}
        for sweep, values in levels.items():
            rows = []
            for j, lv in enumerate(values):
                mu, sd, n = mean_std(by[(m, r)]["acc"][sweep][j] for r in reps if (m, r) in by)
                rows.append({"level": lv, "mean": mu, "std": sd, "n": n})
            out["curves"][m][sweep] = rows
        out["clean"][m] = mean_std(by[(m, r)]["acc"][next(iter(levels))][0] for r in reps if (m, r) in by)
    for sweep in levels:
        diffs, rdiffs = [], []
        areas: Dict[str, List[float]] = {m: [] for m in METHODS}
        rets: Dict[str, List[float]] = {m: [] for m in METHODS}
        for r in reps:
            if (("deltanet", r) not in by) or (("efla", r) not in by):
                continue
            a, ret = {}, {}
            for m in METHODS:
                acc = by[(m, r)]["acc"][sweep]
                a[m] = sum(acc) / len(acc)
                pert = acc[1:] if len(acc) > 1 else acc
                ret[m] = 100.0 * (sum(pert) / len(pert)) / max(acc[0], 1e-9)
                areas[m].append(a[m])
                rets[m].append(ret[m])
            diffs.append(a["efla"] - a["deltanet"])
            rdiffs.append(ret["efla"] - ret["deltanet"])
        out["area"][sweep] = {m: mean_std(areas[m]) for m in METHODS}
        out["retention"][sweep] = {m: mean_std(rets[m]) for m in METHODS}
        md, sd, n = mean_std(diffs)
        rmd, rsd, _ = mean_std(rdiffs)
        out["verdict"][sweep] = {"diff_mean": md, "diff_std": sd, "n": n, "diffs": diffs, "verdict": _verdict(diffs),
                                 "retention_diff_mean": rmd, "retention_diff_std": rsd, "retention_diffs": rdiffs,
                                 "retention_verdict": _verdict(rdiffs)}
    return out


def _extra_args(a) -> str:
    return "".join(f" --{n.replace('_', '-')} {getattr(a, n)}" for n in ("train_images", "test_images", "replicates")
                   if getattr(a, n, None) is not None)


def markdown(exp: common.Experiment, budget: Budget, summary: Dict[str, Any], levels, runs) -> str:
    lines = [f"# smnist-robustness ({exp.args.budget})", ""]
    lines += [f"- {h}" for h in exp.header_lines(runs, _extra_args(exp.args))]
    reps = sorted({r["replicate"] for r in runs})
    steps = runs[0]["steps"] if runs else 0
    lines += [f"- protocol: {budget.train_images} training images (one pass, {steps} steps of batch "
              f"{budget.batch_size}), {budget.test_images} test images, {len(reps)} replicate(s); "
              f"DeltaNet lr 1e-3, EFLA lr 3e-3; AdamW, clip 1.0; delta_rule chunk mode (chunk {budget.chunk_size})"
              + ("" if exp.args.budget == "full" else
                 " — **reduced from the paper's protocol (60k training / 10k test images)**"), ""]
    lines.append("Accuracy (%), mean ± std over replicates:")
    lines.append("")
    for sweep, values in levels.items():
        name, _ = SWEEPS[sweep]
        rows = []
        for j, lv in enumerate(values):
            row = [f"{lv:g}"]
            for m in METHODS:
                c = summary["curves"][m][sweep][j]
                row.append(fmt_pm(c["mean"], c["std"], c["n"]))
            rows.append(row)
        area, ret = summary["area"][sweep], summary["retention"][sweep]
        rows.append(["**mean over levels**"] + [fmt_pm(*area[m]) for m in METHODS])
        rows.append(["**retention** (% of clean)"] + [fmt_pm(*ret[m]) for m in METHODS])
        sym = {"scale": "s", "noise": "σ", "dropout": "p"}[sweep]
        lines += [f"**{SWEEP_TITLE[sweep]}** ({name})", "", md_table([sym] + [LABEL[m] for m in METHODS], rows), ""]
    lines += ["Verdict per sweep (EFLA's claim: more robust than DeltaNet). *Accuracy*: the mean accuracy over "
              "the sweep's levels (the paper's curves). *Retention*: the mean accuracy over the perturbed levels "
              "divided by the model's own clean accuracy (robustness separated from clean accuracy). Differences "
              "are paired by replicate:", ""]
    vrows = []
    for sweep in levels:
        v = summary["verdict"][sweep]

        def pm(m, s, v=v):
            return fmt(m, 1) + (f" ± {s:.1f}" if v["n"] > 1 else "")

        vrows.append([SWEEP_TITLE[sweep], pm(v["diff_mean"], v["diff_std"]),
                      ", ".join(f"{d:+.1f}" for d in v["diffs"]), v["verdict"],
                      pm(v["retention_diff_mean"], v["retention_diff_std"]),
                      ", ".join(f"{d:+.1f}" for d in v["retention_diffs"]), v["retention_verdict"]])
    lines += [md_table(["sweep", "Δ accuracy (EFLA − DeltaNet, points)", "per replicate", "verdict",
                        "Δ retention (points)", "per replicate", "verdict"], vrows, align="lrrlrrl"), ""]
    tr = [[LABEL[r["method"]], r["replicate"], r["train_seed"], r["steps"], fmt(r["final_loss"], 3),
           fmt(r["acc"][next(iter(levels))][0], 1), fmt(r["train_s"], 0), fmt(r["eval_s"], 0)] for r in runs]
    lines += ["Runs:", "", md_table(["method", "replicate", "seed", "steps", "final loss (last 20 steps)",
                                     "clean acc.", "train s", "eval s"], tr), ""]
    return "\n".join(lines)


def plot(path: Path, summary: Dict[str, Any], levels, title: str) -> None:
    panels = []
    for sweep, values in levels.items():
        series = []
        for m in METHODS:
            c = summary["curves"][m][sweep]
            series.append({"label": LABEL[m], "x": values, "y": [p["mean"] for p in c],
                           "err": [p["std"] if p["n"] > 1 else None for p in c], "color": COLOR[m],
                           "marker": "o" if m == "efla" else "x", "linestyle": "-" if m == "efla" else "--"})
        panels.append({"title": SWEEP_TITLE[sweep], "xlabel": SWEEPS[sweep][0], "ylabel": "test accuracy (%)",
                       "series": series, "ylim": (0, 100)})
    common.line_panels(path, panels, title=title)


def plot_loss(path: Path, runs: List[Dict[str, Any]]) -> None:
    series = []
    for r in runs:
        ls = r["losses"]
        k = max(1, len(ls) // 50)
        sm = [sum(ls[max(0, i - k + 1):i + 1]) / len(ls[max(0, i - k + 1):i + 1]) for i in range(len(ls))]
        series.append({"label": f"{LABEL[r['method']]} r{r['replicate']}", "x": list(range(1, len(ls) + 1)),
                       "y": sm, "color": COLOR[r["method"]], "marker": "",
                       "linestyle": "-" if r["replicate"] == 0 else ":"})
    common.line_panels(path, [{"title": "training loss (running mean)", "xlabel": "step", "ylabel": "cross-entropy",
                               "series": series}], panel_size=(5.0, 3.4))


# ----------------------------------------------------------------------------------------------
# Entry points
# ----------------------------------------------------------------------------------------------

def add_arguments(p) -> None:
    common.add_common_arguments(p, NAME, f"folder with the MNIST idx .gz files (default {DEFAULT_DATA})",
                                default_seed=42)
    p.add_argument("--replicates", type=int, default=None, help="replicates (seeds) per method (default: the budget's)")
    p.add_argument("--train-images", type=int, default=None, help="training images (default: the budget's)")
    p.add_argument("--test-images", type=int, default=None, help="test images (default: the budget's)")


def run(args) -> int:
    from ..data.mnist import MNISTError, load_mnist

    budget = Budget(**asdict(BUDGETS[args.budget]))
    for name in ("replicates", "train_images", "test_images"):
        v = getattr(args, name)
        if v is not None:
            if v < 1:
                raise ExperimentError(f"--{name.replace('_', '-')} must be >= 1, got {v}")
            setattr(budget, name, v)
    levels = budget.levels or {k: list(v[1]) for k, v in SWEEPS.items()}
    common.set_threads(args.threads)
    device = common.resolve_device(args.device)
    data_dir = args.data or DEFAULT_DATA
    try:
        train_x, train_y = load_mnist(data_dir, "train")
        test_x, test_y = load_mnist(data_dir, "test")
    except MNISTError as e:
        raise ExperimentError(f"{e} (pass --data DIR)") from None
    test_x, test_y = test_x[: budget.test_images], test_y[: budget.test_images]
    budget.train_images = min(budget.train_images, train_x.shape[0])
    budget.test_images = test_x.shape[0]

    config = {"budget": args.budget, "seed": args.seed, "protocol": asdict(budget), "levels": levels}
    exp = common.Experiment(NAME, args, config)
    print(f"linattn experiment {NAME} --budget {args.budget}")
    for h in exp.header_lines():
        print("  " + h)
    if args.budget != "full":
        print(f"  reduced protocol ({args.budget}): {budget.train_images} training images (one pass), "
              f"{budget.test_images} test images, {budget.replicates} replicate(s); the paper uses 60k / 10k")

    plan = [{"run_id": f"{m}-r{r}", "method": m, "replicate": r, "train_seed": args.seed + 1000 * r + RANK[m],
             "eval_seed": args.seed + 1000 * r, "lr": LR[m]}
            for r in range(budget.replicates) for m in METHODS]
    bar = exp.progress_enabled

    def one(spec):
        t = train_one(spec["method"], spec["train_seed"], train_x, train_y, budget, device, bar)
        t0 = time.perf_counter()
        acc = evaluate(t["model"], test_x, test_y, levels, spec["eval_seed"], budget.eval_batch_size, device, bar)
        last = t["losses"][-20:]
        return {"acc": acc, "losses": t["losses"], "steps": t["steps"], "train_images": t["train_images"],
                "final_loss": sum(last) / len(last), "train_s": t["train_s"], "eval_s": time.perf_counter() - t0}

    runs = exp.run_all(plan, one)
    summary = summarize(runs, levels)
    md = markdown(exp, budget, summary, levels, runs)
    title = (f"sMNIST robustness ({args.budget}: {budget.train_images} train / {budget.test_images} test images, "
             f"{budget.replicates} replicate(s)); mean ± std")
    paths = exp.write_outputs(summary, runs, md, {
        "robustness": lambda p: plot(p, summary, levels, title),
        "loss": lambda p: plot_loss(p, runs)})
    print()
    print(md)
    print(f"\nwrote {', '.join(str(p) for p in paths.values())}")
    return 0
