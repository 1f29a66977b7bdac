"""`linattn experiment smnist-robustness`: the EFLA paper's sequential-MNIST robustness experiment
(section 5.1, Figure 1), as its public code (declare-lab/EFLA `mnist.py`) runs it, with EFLA's beta
variants (section 5.2: adaptive decay, loose beta) next to it.

Model (one class for every method): pixels in [0, 1] (no normalisation) as a sequence of 784
scalars; Linear(1, 64, no bias) + a learned positional table (N(0, 0.02^2)), GELU; one layer, one
head, d = 64; q, k, v = Linear(64, 64, no bias) with Xavier-uniform init; beta from Linear(64, 1)
with the bias initialised to -2; the delta rule over the 784 steps from a zero state; readout
S_T^T q_T with the raw (unnormalised) last query, LayerNorm(64), Linear(64, 10).

* deltanet:      keys L2-normalised, beta = sigmoid(Linear(h)), a_t = beta_t  (`delta_rule(..., exact=False)`);
* efla:          raw keys, beta = sigmoid(Linear(h)), a_t = (1 - exp(-beta_t |k_t|^2)) / |k_t|^2  (`exact=True`);
* efla-adaptive: as efla, beta = softplus(alpha) * sigmoid(Linear(h)) with one learnable alpha (one head),
                 initialised to log(e - 1) so that softplus(alpha) = 1 ("EFLA + Adaptive Decay");
* efla-loose:    as efla, beta = softplus(Linear(h)), no upper bound ("EFLA + Loose beta").

The beta variants are `linattn.layers.EFLA`'s beta_mode "adaptive" and "loose" (`EFLA._beta_of`).
All run `linattn.delta_rule` in chunk mode with scale 1. (The public code adds 1e-6 to the EFLA
denominator and clamps |k|^2 >= 1e-6; the library's coefficient is the exact expression, the same
to ~1e-6 relative for any key that is not tiny.) --methods picks a subset (default deltanet,efla).

Training: one pass over the training images in a shuffled order, batch 128, AdamW (weight decay
0.01), gradient clipping at 1.0, cross-entropy, no schedule; lr 1e-3 for DeltaNet and 3e-3 for the
EFLA methods. Seeds: replicate r trains method m with seed S + 1000 r + rank(m), rank 1 deltanet,
2 efla, 3 efla-adaptive, 4 efla-loose (S = --seed, default 42: replicate 0 is the public code's
43 / 44), and evaluates with seed S + 1000 r, reseeded before each sweep. A run's seeds depend only
on its method and replicate, so --resume can add methods to a finished experiment.

Robustness sweeps on the test images (accuracy, %): input scaling x*s, s = 1..10; additive
Gaussian noise x + N(0, sigma^2), sigma = 0, 0.1, ..., 1; pixel dropout x * Bernoulli(1 - p),
p = 0, 0.1, ..., 1, without 1/(1-p) rescaling.

Comparisons, paired by replicate: EFLA - DeltaNet (the paper's claim) and each beta variant - EFLA,
for the clean accuracy and per sweep for the mean accuracy over the levels and the retention (mean
accuracy over the perturbed levels / clean accuracy). A difference exceeds the spread when the paired
differences d_r satisfy |mean(d)| > 2 std(d) / sqrt(n) (n >= 2 replicates: the mean is more than two
standard errors from 0); otherwise it is within the spread. A rule of thumb, not a significance test
(a two-sided 5% t-test with 5 replicates needs 2.78 standard errors).

The evaluation gives the accuracies of a plain loop over the test batches but skips repeated work:
the images are converted once, the clean levels (s = 1, sigma = 0, p = 0) are run once and the
all-zero input (p = 1) once per batch shape, under torch.inference_mode.

Budgets: standard = the paper's training pass (60k training images, one pass, batch 128) and all
10k test images, 5 replicates, about 17-25 min per run on one thread of a 2-core CPU (a training
step 0.8-1.15 s, evaluation 2.1-3.2 s per 1,000 images and level, measured); full = the same with 3
replicates (the public code runs one); quick = 6,400 training images (one pass, 50 steps), the
first 500 test images and 3 replicates, about 10-15 minutes of a 2-core CPU for deltanet,efla.
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

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

METHODS = ("deltanet", "efla", "efla-adaptive", "efla-loose")
DEFAULT_METHODS = ("deltanet", "efla")      # the paper's comparison (and the earlier results)
LABEL = {"deltanet": "DeltaNet", "efla": "EFLA", "efla-adaptive": "EFLA + adaptive decay",
         "efla-loose": "EFLA + loose β"}
COLOR = {"deltanet": "C1", "efla": "C3", "efla-adaptive": "C0", "efla-loose": "C2"}
STYLE = {"deltanet": ("x", "--"), "efla": ("o", "-"), "efla-adaptive": ("s", "-."), "efla-loose": ("^", ":")}
RANK = {"deltanet": 1, "efla": 2, "efla-adaptive": 3, "efla-loose": 4}   # seed offsets (42 + rank: the public code's)
LR = {"deltanet": 1e-3, "efla": 3e-3, "efla-adaptive": 3e-3, "efla-loose": 3e-3}   # LR and LR_EFLA of the public code
BETA = {"deltanet": "sigmoid(Linear(h))", "efla": "sigmoid(Linear(h))",
        "efla-adaptive": "softplus(alpha) · sigmoid(Linear(h)), alpha learnable (softplus(alpha) = 1 at init)",
        "efla-loose": "softplus(Linear(h))"}
# the paired comparisons (a - b), each made when both methods ran
PAIRS = (("efla", "deltanet"), ("efla-adaptive", "efla"), ("efla-loose", "efla"))
PAIR_CLAIM = {("efla", "deltanet"): "the paper's claim: EFLA is more robust than DeltaNet",
              ("efla-adaptive", "efla"): "a learnable scale on beta, against sigmoid beta",
              ("efla-loose", "efla"): "beta without an upper bound, against sigmoid beta"}

SWEEPS = {
    "scale": ("input scaling s (x * s)", [float(s) for s in range(1, 11)]),
    "noise": ("additive Gaussian noise sigma", [round(0.1 * i, 1) for i in range(11)]),
    "dropout": ("pixel dropout p", [round(0.1 * i, 1) for i in range(11)]),
}
PAPER_LEVELS = {k: v[1] for k, v in SWEEPS.items()}      # the levels of every budget but tiny
SWEEP_TITLE = {"scale": "OOD intensity scaling", "noise": "additive Gaussian noise", "dropout": "pixel dropout"}
PAPER_TRAIN, PAPER_TEST = 60_000, 10_000


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
    # eval batch 64: faster than 128 or more on a CPU (cache-bound), the same predictions
    "standard": Budget(train_images=60_000, test_images=10_000, replicates=5, eval_batch_size=64),
    "quick": Budget(train_images=6_400, test_images=500, replicates=3, eval_batch_size=250),
    "tiny": Budget(train_images=32, test_images=16, replicates=1, batch_size=16, eval_batch_size=16,
                   levels={"scale": [1.0, 10.0], "noise": [0.0, 1.0], "dropout": [0.0, 1.0]}),
}
# times measured with 1 thread on the 2-core CPU this was written on, shared with other jobs (load 2-3.5):
# a training step of batch 128 0.8-1.15 s, evaluation 2.1-3.2 s per 1,000 test images and level (batch 64)
BUDGET_HELP = {
    "quick": "6,400 training images (50 steps), the first 500 test images, 3 replicates: about 2 min per run, "
             "10-15 min for deltanet,efla (6 runs) with 1 thread on a 2-core CPU",
    "standard": "the paper's training pass (60,000 images: 469 steps of batch 128) and all 10,000 test images, "
                "5 replicates: 17-25 min per run with 1 thread on a 2-core CPU (6-9 min training, 10-16 min "
                "evaluation), 3-4 h for deltanet,efla (10 runs), 6-8 h for all four methods (20 runs); "
                "processes started with --resume on the same --out share the runs",
    "full": "the same protocol with 3 replicates: 20-35 min per run on a 2-core CPU (evaluation in batches "
            "of 128, slower there); meant for a GPU",
}


# ----------------------------------------------------------------------------------------------
# The model
# ----------------------------------------------------------------------------------------------

class SMNISTClassifier(nn.Module):
    """The public code's LinearAttentionClassifier, with the recurrence computed by
    `linattn.delta_rule` (chunk form). method: one of METHODS."""

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
        if method == "efla-adaptive":
            # after everything else, so the other weights are those of efla for the same seed;
            # softplus(alpha) = 1 at init (EFLA's beta_mode="adaptive", one head)
            self.beta_alpha = nn.Parameter(torch.full((1,), math.log(math.e - 1.0)))

    def beta_of(self, b: torch.Tensor) -> torch.Tensor:
        """beta from the beta_proj output `[B, T, 1]`: `EFLA._beta_of`'s sigmoid / adaptive / loose."""
        if self.method == "efla-loose":
            return F.softplus(b)
        beta = torch.sigmoid(b)
        if self.method == "efla-adaptive":
            beta = F.softplus(self.beta_alpha) * beta
        return beta

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x `[B, T, 1]` (pixels) -> logits `[B, n_classes]`."""
        h = self.act(self.input_proj(x) + self.pos_emb[: x.shape[1]])
        q, k, v = self.q_proj(h), self.k_proj(h), self.v_proj(h)
        beta = self.beta_of(self.beta_proj(h))                       # [B, T, 1]: one head
        if self.method == "deltanet":
            k = F.normalize(k, p=2, dim=-1)
        o, _ = delta_rule(q.unsqueeze(2), k.unsqueeze(2), v.unsqueeze(2), beta, exact=self.method != "deltanet",
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
    out = {"model": model, "losses": losses, "steps": steps, "train_images": len(perm),
           "train_s": time.perf_counter() - t0}
    if method == "efla-adaptive":
        out["softplus_alpha"] = float(F.softplus(model.beta_alpha.detach()).item())   # the learned beta scale
    return out


@torch.inference_mode()
def evaluate(model: nn.Module, test_x: torch.Tensor, test_y: torch.Tensor, levels: Dict[str, List[float]],
             eval_seed: int, batch_size: int, device: torch.device, bar: bool) -> Dict[str, List[float]]:
    """Accuracy (%) per sweep and level: those of a plain loop over the batches (the same batches, random
    draws and model calls); only repeated work is skipped. The images are converted once; a perturbed
    batch equal to the clean one (s = 1, sigma = 0, p = 0) reuses the clean predictions, and a batch that
    is zero everywhere (p = 1) is run once per batch shape (the model is deterministic, so the same call
    gives the same predictions)."""
    model.eval()
    xs = to_sequence(test_x).to(device)
    ys = test_y.to(device)
    n = xs.shape[0]
    clean: Dict[int, torch.Tensor] = {}                   # batch start -> predictions on the clean batch
    zero: Dict[Tuple[int, ...], torch.Tensor] = {}        # batch shape -> predictions on an all-zero batch
    out: Dict[str, List[float]] = {}
    total = sum(len(v) for v in levels.values())
    with common.progress(total=total, desc="robustness sweeps", enabled=bar, unit="cond") as pb:
        for sweep, values in levels.items():
            torch.manual_seed(eval_seed)        # seed_everything(42) before each sweep, as the public code
            accs = []
            for level in values:
                correct = torch.zeros((), dtype=torch.long, device=device)
                for i in range(0, n, batch_size):
                    xb = xs[i:i + batch_size]
                    xp = perturb(xb, sweep, level)   # drawn even when unused: the next levels' draws follow it
                    same = torch.equal(xp, xb)
                    if same and i in clean:
                        pred = clean[i]
                    elif not same and not bool(xp.any()):
                        key = tuple(xp.shape)
                        if key not in zero:
                            zero[key] = model(xp).argmax(dim=-1)
                        pred = zero[key]
                    else:
                        pred = model(xp).argmax(dim=-1)
                        if same:
                            clean[i] = pred
                    correct += (pred == ys[i:i + batch_size]).sum()
                accs.append(100.0 * int(correct) / n)
                pb.update(1)
                pb.set_postfix({sweep: level, "acc": f"{accs[-1]:.1f}"}, refresh=False)
            out[sweep] = accs
    return out


# ----------------------------------------------------------------------------------------------
# Summary and verdicts
# ----------------------------------------------------------------------------------------------

def _verdict_of(p: Dict[str, Any], subject: str) -> str:
    """"exceeds the spread (SUBJECT higher/lower)", "within the spread" or why there is no verdict, for a
    `common.paired_difference` of SUBJECT - other."""
    md, n = p["mean"], p["n"]
    if n == 0:
        return "not compared"
    if n == 1:
        return f"one replicate, no spread ({subject} {'higher' if md > 0 else 'lower' if md < 0 else 'equal'})"
    if p["exceeds"]:
        return f"exceeds the spread ({subject} {'higher' if md > 0 else 'lower'})"
    return "within the spread"


def paired(a: Sequence[float], b: Sequence[float], subject: str) -> Dict[str, Any]:
    """The per-replicate differences a_r - b_r, their mean ± std, the sign count, the bound that |mean|
    must exceed and the verdict (subject: what a names)."""
    p = common.paired_difference(a, b)
    p["verdict"] = _verdict_of(p, subject)
    return p


def _scores(acc: Dict[str, List[float]], sweep: str) -> Tuple[float, Optional[float]]:
    """(area, retention) of one run's sweep: the mean accuracy over the levels, and the mean over the
    perturbed levels as % of the run's own clean accuracy (the sweep's first level; None when that is 0,
    which only a model that never learned gives: such a run is left out of the retention statistics)."""
    a = acc[sweep]
    pert = a[1:] if len(a) > 1 else a
    return sum(a) / len(a), (100.0 * (sum(pert) / len(pert)) / a[0] if a[0] > 0 else None)


def summarize(runs: List[Dict[str, Any]], levels: Dict[str, List[float]]) -> Dict[str, Any]:
    """Mean and spread per (method, sweep, level) and per method of two robustness scores per sweep,
    and for each pair of PAIRS that ran, the paired per-replicate differences with a verdict:

    * clean: the accuracy on the unperturbed test images;
    * area: the mean accuracy over the sweep's levels (the paper's curves, clean point included);
    * retention: the mean over the perturbed levels of accuracy / clean accuracy (how much of its own
      clean accuracy a model keeps; separates "more robust" from "more accurate").
    """
    by = {(r["method"], r["replicate"]): r for r in runs}
    reps = sorted({r["replicate"] for r in runs})
    methods = [m for m in METHODS if any((m, r) in by for r in reps)]
    first = next(iter(levels))
    out: Dict[str, Any] = {"methods": methods, "curves": {}, "clean": {}, "area": {}, "retention": {},
                           "comparisons": {}}
    for m in methods:
        mine = [by[(m, r)] for r in reps if (m, r) in by]
        out["curves"][m] = {sweep: [dict(zip(("mean", "std", "n"), mean_std(x["acc"][sweep][j] for x in mine)),
                                         level=lv) for j, lv in enumerate(values)]
                            for sweep, values in levels.items()}
        out["clean"][m] = mean_std(x["acc"][first][0] for x in mine)
    for sweep in levels:
        out["area"][sweep] = {m: mean_std(_scores(by[(m, r)]["acc"], sweep)[0] for r in reps if (m, r) in by)
                              for m in methods}
        out["retention"][sweep] = {m: mean_std(_scores(by[(m, r)]["acc"], sweep)[1] for r in reps if (m, r) in by)
                                   for m in methods}
    for a, b in PAIRS:
        both = [r for r in reps if (a, r) in by and (b, r) in by]
        if not both:
            continue
        ra, rb = [by[(a, r)]["acc"] for r in both], [by[(b, r)]["acc"] for r in both]
        cmp: Dict[str, Any] = {"a": a, "b": b, "replicates": both,
                               "clean": paired([x[first][0] for x in ra], [y[first][0] for y in rb], LABEL[a]),
                               "sweeps": {}}
        for sweep in levels:
            sa, sb = [_scores(x, sweep) for x in ra], [_scores(y, sweep) for y in rb]
            cmp["sweeps"][sweep] = {"area": paired([x[0] for x in sa], [y[0] for y in sb], LABEL[a]),
                                    "retention": paired([x[1] for x in sa], [y[1] for y in sb], LABEL[a])}
        out["comparisons"][f"{a}-vs-{b}"] = cmp
    return out


def _extra_args(a) -> str:
    out = "".join(f" --{n.replace('_', '-')} {getattr(a, n)}" for n in ("train_images", "test_images", "replicates")
                  if getattr(a, n, None) is not None)
    methods = list(getattr(a, "methods", None) or DEFAULT_METHODS)
    return out + ("" if methods == list(DEFAULT_METHODS) else " --methods " + ",".join(methods))


def _pm(c: Dict[str, Any]) -> str:
    if c["mean"] is None:
        return "-"
    return f"{c['mean']:+.1f}" + (f" ± {c['std']:.1f}" if c["n"] > 1 else "")


def markdown(exp: common.Experiment, budget: Budget, summary: Dict[str, Any], levels, runs,
             planned: Optional[int] = None) -> str:
    methods = summary["methods"]
    lines = [f"# smnist-robustness ({exp.args.budget})", ""] + exp.incomplete_note(runs, planned or len(runs))
    lines += [f"- {h}" for h in exp.header_lines(runs, _extra_args(exp.args))]
    reps = sorted({r["replicate"] for r in runs})
    steps = runs[0]["steps"] if runs else 0
    reduced = budget.train_images < PAPER_TRAIN or budget.test_images < PAPER_TEST
    lines += [f"- protocol: {budget.train_images} training images (one pass, {steps} steps of batch "
              f"{budget.batch_size}), {budget.test_images} test images, {len(reps)} replicate(s); "
              + ", ".join(f"{LABEL[m]} lr {LR[m]:g}" for m in methods)
              + f"; AdamW, clip 1.0; delta_rule chunk mode (chunk {budget.chunk_size})"
              + (" — **reduced from the paper's protocol (60k training / 10k test images)**" if reduced else ""),
              "- beta: " + "; ".join(f"{LABEL[m]} {BETA[m]}" for m in methods), ""]
    lines.append("Accuracy (%), mean ± std over replicates:")
    lines.append("")
    for sweep, values in levels.items():
        name, _ = SWEEPS[sweep]
        rows = []
        for j, lv in enumerate(values):
            rows.append([f"{lv:g}"] + [fmt_pm(*(summary["curves"][m][sweep][j][k] for k in ("mean", "std", "n")))
                                       for m in methods])
        area, ret = summary["area"][sweep], summary["retention"][sweep]
        rows.append(["**mean over levels**"] + [fmt_pm(*area[m]) for m in methods])
        rows.append(["**retention** (% of clean)"] + [fmt_pm(*ret[m]) for m in methods])
        sym = {"scale": "s", "noise": "σ", "dropout": "p"}[sweep]
        lines += [f"**{SWEEP_TITLE[sweep]}** ({name})", "", md_table([sym] + [LABEL[m] for m in methods], rows), ""]
    lines += ["Verdict per sweep, paired by replicate: for each replicate r, d_r = (score of A) − (score of B) in "
              "points. *Clean*: the accuracy on the unperturbed test images. *Accuracy*: the mean accuracy over the "
              "sweep's levels (the paper's curves). *Retention*: the mean accuracy over the perturbed levels divided "
              "by the model's own clean accuracy (robustness separated from clean accuracy). A difference "
              "**exceeds the spread** when |mean(d)| > 2 · std(d) / √n over n ≥ 2 replicates (the mean paired "
              "difference lies more than two standard errors from 0), else it is **within the spread**; "
              "a rule of thumb, not a significance test (a two-sided 5% t-test with 5 replicates needs 2.78 "
              "standard errors). *Signs*: in how many replicates A was higher.", ""]
    if not summary["comparisons"]:
        lines += ["(no pair of methods to compare)", ""]
    for cmp in summary["comparisons"].values():
        a, b = cmp["a"], cmp["b"]
        vrows = []
        for what, c in [("clean accuracy", cmp["clean"])] + [
                (f"{SWEEP_TITLE[s]}: {lab}", cmp["sweeps"][s][k]) for s in levels
                for k, lab in (("area", "accuracy"), ("retention", "retention"))]:
            vrows.append([what, _pm(c), ", ".join(f"{d:+.1f}" for d in c["diffs"]),
                          f"+ in {c['positive']} of {c['n']}", c["verdict"]])
        lines += [f"**{LABEL[a]} − {LABEL[b]}** ({PAIR_CLAIM[(a, b)]}):", "",
                  md_table(["score", "Δ mean ± std (points)", "per replicate", "signs", "verdict"], vrows,
                           align="lrrll"), ""]
    tr = [[LABEL[r["method"]], r["replicate"], r["train_seed"], r["steps"], fmt(r["final_loss"], 3),
           fmt(r["acc"][next(iter(levels))][0], 1), fmt(r["train_s"], 0), fmt(r["train_s"] / max(r["steps"], 1), 2),
           fmt(r["eval_s"], 0)] for r in runs]
    lines += ["Runs:", "", md_table(["method", "replicate", "seed", "steps", "final loss (last 20 steps)",
                                     "clean acc.", "train s", "s/step", "eval s"], tr), ""]
    alphas = [(r["replicate"], r["softplus_alpha"]) for r in runs if r.get("softplus_alpha") is not None]
    if alphas:
        lines += ["EFLA + adaptive decay, learned softplus(alpha) (1 at init): "
                  + ", ".join(f"r{rep} {v:.3f}" for rep, v in alphas), ""]
    return "\n".join(lines)


def plot(path: Path, summary: Dict[str, Any], levels, title: str) -> None:
    panels = []
    for sweep, values in levels.items():
        series = []
        for m in summary["methods"]:
            c = summary["curves"][m][sweep]
            series.append({"label": LABEL[m], "x": values, "y": [p["mean"] for p in c],
                           "err": [p["std"] if p["n"] > 1 else None for p in c], "color": COLOR[m],
                           "marker": STYLE[m][0], "linestyle": STYLE[m][1]})
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

parse_methods = common.subset_of(METHODS, ordered=True)   # --methods: returned in METHODS' order


def add_arguments(p) -> None:
    common.add_common_arguments(p, NAME, f"folder with the MNIST idx .gz files (default {DEFAULT_DATA})",
                                default_seed=42, budgets=BUDGET_HELP)
    p.add_argument("--methods", type=parse_methods, default=list(DEFAULT_METHODS),
                   help="comma-separated subset of " + ",".join(METHODS) + " (default " + ",".join(DEFAULT_METHODS)
                        + "); --resume may add methods to a finished experiment")
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
    methods = list(getattr(args, "methods", None) or DEFAULT_METHODS)
    levels = budget.levels or {k: list(v) for k, v in PAPER_LEVELS.items()}
    common.set_threads(args.threads)
    device = common.resolve_device(args.device, common.ExperimentError)
    data_dir = args.data or DEFAULT_DATA
    try:
        train_x, train_y = load_mnist(data_dir, "train")
        test_x, test_y = load_mnist(data_dir, "test")
    except MNISTError as e:
        raise ExperimentError(f"{e} (pass --data DIR)") from None
    test_x, test_y = test_x[: budget.test_images], test_y[: budget.test_images]
    budget.train_images = min(budget.train_images, train_x.shape[0])
    budget.test_images = test_x.shape[0]

    # the methods are not part of the configuration: a run's seeds depend only on its method and
    # replicate, so a --resume with more methods adds their runs to the same results
    config = {"budget": args.budget, "seed": args.seed, "protocol": asdict(budget), "levels": levels}
    exp = common.Experiment(NAME, args, config)
    print(f"linattn experiment {NAME} --budget {args.budget} --methods {','.join(methods)}")
    for h in exp.header_lines():
        print("  " + h)
    if budget.train_images < PAPER_TRAIN or budget.test_images < PAPER_TEST:
        print(f"  reduced protocol ({args.budget}): {budget.train_images} training images (one pass), "
              f"{budget.test_images} test images, {budget.replicates} replicate(s); the paper uses 60k / 10k")

    plan = [{"run_id": f"{m}-r{r}", "method": m, "replicate": r, "train_seed": args.seed + 1000 * r + RANK[m],
             "eval_seed": args.seed + 1000 * r, "lr": LR[m]}
            for r in range(budget.replicates) for m in methods]
    bar = exp.progress_enabled

    def one(spec):
        t = train_one(spec["method"], spec["train_seed"], train_x, train_y, budget, device, bar)
        t0 = time.perf_counter()
        acc = evaluate(t["model"], test_x, test_y, levels, spec["eval_seed"], budget.eval_batch_size, device, bar)
        last = t["losses"][-20:]
        rec = {"acc": acc, "losses": t["losses"], "steps": t["steps"], "train_images": t["train_images"],
               "final_loss": sum(last) / len(last), "train_s": t["train_s"], "eval_s": time.perf_counter() - t0}
        if "softplus_alpha" in t:
            rec["softplus_alpha"] = t["softplus_alpha"]
        return rec

    runs = exp.run_all(plan, one)
    summary = summarize(runs, levels)
    md = markdown(exp, budget, summary, levels, runs, len(plan))
    done = len({r["replicate"] for r in runs})      # an interrupted experiment plots fewer than planned
    title = (f"sMNIST robustness ({args.budget}: {budget.train_images} train / {budget.test_images} test images, "
             f"{done} of {budget.replicates} replicate(s)); mean ± std")
    paths = exp.write_outputs(summary, runs, md, {
        "robustness": lambda p: plot(p, summary, levels, title),
        "loss": lambda p: plot_loss(p, runs)})
    print()
    print(md)
    print(f"\nwrote {', '.join(str(p) for p in paths.values())}")
    return 0
