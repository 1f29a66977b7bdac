"""`linattn experiment mad`: the six MAD synthetic tasks (Poli et al. 2024) for softmax attention,
linear attention (elu+1 and Hadamard Exp feature maps), DeltaNet, Gated DeltaNet and EFLA, in the
benchmark's model shape, scored as the benchmark scores them. Compare: EFLA paper, Table 2.

Tasks and data: `linattn.data.mad` (generators faithful to athms/mad-lab: vocabularies, lengths,
masking; one seeded generator per dataset, data seed 12345 as MADConfig).

Model (mad-lab's `LanguageModel` backbone): width 128, token embedding (no positional embedding),
layers [mixer, SwiGLU, mixer, SwiGLU] each as x + layer(RMSNorm(x)), final RMSNorm and an untied
linear head. SwiGLU inner width 352 (int(2 * 128 * 4/3) rounded up to 16, mad-lab's GLU). Mixers:
softmax with 16 heads of 8 and RoPE (mad-lab: mh-attention, rotary dim 8); linear attention with
16 heads and the elu+1 or Hadamard Exp (phi = exp) feature map, normalised (the library's
`linear-*` layer); DeltaNet, Gated DeltaNet and EFLA with 4 heads of 32 (Gated DeltaNet with value
heads of 64, mad-lab's gated-delta-net config), short convolutions, sigmoid beta; Comba,
DeltaProduct (n = 2) and KDA in DeltaNet's shape (not in the paper's table); FoX, DeltaFormer and
PaTH in softmax's shape (16 heads of 8; not in the paper's table either).
Compression uses mad-lab's AutoEncoder: the same encoder layers, the last position pooled, a
non-expanding MLP decoder (RMSNorm, Linear, GELU, RMSNorm, Linear, GELU) applied to the pooled
vector plus sinusoidal position embeddings for every position, RMSNorm, linear head.

Training (MADConfig): AdamW (weight decay on everything but biases and norms), cosine annealing
per epoch to 1e-6, cross-entropy ignoring -100, test metrics after every epoch, early stop once
test accuracy >= 0.999. Accuracy is macro-averaged over classes (torchmetrics MulticlassAccuracy's
default in mad-lab): per-class recall, averaged over classes that occur in targets or predictions,
so a class predicted but never a target counts with recall 0; the report lists the runs where such
stray predictions, not the task, set the score or blocked the early stop (`macro_gap_notes`).
A run's score is the test accuracy at its best epoch (lowest test perplexity: mad-lab's "best"
checkpoint). MAD score: per setting the best run over the lr x weight-decay grid, averaged over
a task's settings, then over tasks.

Budgets:
  full      mad-lab's benchmark: every task's baseline and difficulty sweep (one factor at a time),
            lr in {1e-4, 5e-4, 1e-3} x weight decay in {0, 0.1}, batch 128, up to 200 epochs,
            12,800 training (memorization 256) and 1,280 test examples. Meant for a GPU.
  standard  the baseline setting of each task, one learning rate (1e-3, no weight decay), batch 32,
            the full 1,280-example test sets; the full 12,800-example training sets on the recall
            tasks (up to 8 epochs on in-context and noisy recall, 1 on fuzzy recall) and compression
            (2 epochs), 3,200 x 2 on selective copying, 256 x up to 64 on memorization; early stop at
            99.9%. Calibrated: softmax attention must reach 90% on in-context and noisy recall (the
            sanity gate, printed with the results; a run that fails it is marked invalid). With a cap
            of 4 epochs one of two softmax seeds failed it (noisy recall 80%, still rising when the
            cosine schedule reached 0), hence 8; early stopping makes the cap free for mixers that
            solve recall in the first epoch (the delta-rule family). Measured on
            a shared 2-core CPU: 13-30 minutes of one thread per seed for the delta-rule mixers, 34-43 for
            softmax and plain linear attention (their recall runs may go to the cap), about 3 hours for
            the six mixers of the paper's comparison and one seed (1.5-2 hours as two processes, see below).
  quick     the baseline setting of each task only, one learning rate (1e-3, no weight decay),
            batch 32, a few hundred to a few thousand training examples, a few epochs, 256 test
            examples: about 20 minutes of a 2-core CPU for all six mixers. Too small for softmax to
            learn recall (it stays at chance): its numbers show how far each mixer gets on a tiny
            budget, and are not comparable with the paper's.

Seeds: --seeds N trains every run with model seeds seed..seed+N-1 on the same data (mad-lab's data
seed); tables give mean ± std over seeds, and EFLA vs DeltaNet and linear (elu+1) vs softmax are
compared per seed (paired).
Several processes can share one results folder to use more cores: start the same command again
with --resume; each run is claimed by one process (see `common.Experiment.run_all`).
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import common
from .common import fmt, md_table

NAME = "mad"
DESCRIPTION = __doc__
WIDTH = 128
SWIGLU_HIDDEN = 352
MIN_LR = 1e-6
STOP_ACC = 0.999

# key -> (registry mixer, n_heads, extra mixer kwargs, label)
MIXERS: Dict[str, Tuple[str, int, Dict[str, Any], str]] = {
    "softmax": ("softmax", 16, {}, "softmax"),
    "linear-elu": ("linear-elu+1", 16, {}, "linear (elu+1)"),
    "linear-hadamard": ("linear-hadamard_exp", 16, {}, "linear (hadamard_exp)"),
    "deltanet": ("deltanet", 4, {}, "DeltaNet"),
    "gated-deltanet": ("gated-deltanet", 4, {"head_dim_v": 64}, "Gated DeltaNet"),
    "efla": ("efla", 4, {}, "EFLA"),
    # the delta-rule variants in DeltaNet's shape (4 heads of 32, short convolutions, sigmoid beta)
    "comba": ("comba", 4, {}, "Comba"),
    "delta-product": ("delta-product", 4, {}, "DeltaProduct (n=2)"),
    "kda": ("kda", 4, {}, "KDA"),
    # softmax attention fed back by linear attention, in softmax's shape (16 heads of 8): FoX (forget
    # gate, no RoPE), DeltaFormer (RoPE, stage one keys score keys), PaTH (Householder positions, no RoPE).
    # DeltaFormer and PaTH in blocks of 16: at head dim 8 their blockwise forms' per-block work dominates, and
    # fwd+bwd takes 0.6x (DeltaFormer) and 0.5x (PaTH) the time of blocks of 64 (measured); the forms agree to
    # rounding. FoX keeps 64, the block its standard row was run with.
    "fox": ("fox", 16, {}, "FoX"),
    "deltaformer": ("deltaformer", 16, {"chunk_size": 16}, "DeltaFormer"),
    "path": ("path", 16, {"chunk_size": 16}, "PaTH"),
    # test-time regression / training, in DeltaNet's shape (4 heads of 32, short convolutions): MesaNet
    # (CG, 30 iterations), TTT-Linear, TTT-MLP (hidden 128), Titans (MLP memory); mini-batches of 16
    "mesanet": ("mesanet", 4, {}, "MesaNet"),
    "ttt-linear": ("ttt-linear", 4, {}, "TTT-Linear"),
    "ttt-mlp": ("ttt-mlp", 4, {}, "TTT-MLP"),
    "titans": ("titans", 4, {}, "Titans"),
    # RWKV-7 in DeltaNet's shape (4 heads of 32); Mamba2's own block with its defaults (expand 2: 4 heads of 64,
    # state 64, one group, conv 4)
    "rwkv7": ("rwkv7", 4, {}, "RWKV-7"),
    "mamba2": ("mamba2", 4, {}, "Mamba2"),
}

# the EFLA paper, appendix B, Table 2 (MAD accuracy, %)
PAPER_TABLE2 = {
    "deltanet": {"compression": 42.7, "fuzzy-in-context-recall": 22.2, "in-context-recall": 99.9,
                 "memorization": 29.9, "noisy-in-context-recall": 99.9, "selective-copying": 99.6, "average": 65.7},
    "efla": {"compression": 43.8, "fuzzy-in-context-recall": 22.6, "in-context-recall": 100.0,
             "memorization": 32.5, "noisy-in-context-recall": 100.0, "selective-copying": 99.8, "average": 66.4},
}
TASK_ORDER = ("compression", "fuzzy-in-context-recall", "in-context-recall", "memorization",
              "noisy-in-context-recall", "selective-copying")   # Table 2's column order


@dataclass
class Budget:
    sweep: bool                          # the difficulty sweep (all settings) or the baseline only
    lrs: List[float]
    wds: List[float]
    batch_size: int
    epochs: Dict[str, int]               # per task (default key "*")
    num_train: Dict[str, Optional[int]]  # per task; None: the setting's num_train_examples
    num_test: Optional[int]              # None: 1,280
    overrides: Dict[str, Dict[str, Any]] = field(default_factory=dict)   # per-task setting changes (tiny)

    def task_epochs(self, task: str) -> int:
        return self.epochs.get(task, self.epochs.get("*", 1))


BUDGETS = {
    "full": Budget(sweep=True, lrs=[1e-4, 5e-4, 1e-3], wds=[0.0, 0.1], batch_size=128, epochs={"*": 200},
                   num_train={}, num_test=None),
    "quick": Budget(sweep=False, lrs=[1e-3], wds=[0.0], batch_size=32,
                    epochs={"in-context-recall": 2, "fuzzy-in-context-recall": 2, "noisy-in-context-recall": 2,
                            "selective-copying": 2, "compression": 4, "memorization": 24},
                    num_train={"in-context-recall": 1024, "fuzzy-in-context-recall": 1024,
                               "noisy-in-context-recall": 1024, "selective-copying": 512, "compression": 1024,
                               "memorization": 256},
                    num_test=256),
    "standard": Budget(sweep=False, lrs=[1e-3], wds=[0.0], batch_size=32,
                       epochs={"in-context-recall": 8, "noisy-in-context-recall": 8, "fuzzy-in-context-recall": 1,
                               "selective-copying": 2, "compression": 2, "memorization": 64},
                       num_train={"selective-copying": 3200},
                       num_test=None),
    "tiny": Budget(sweep=False, lrs=[1e-3], wds=[0.0], batch_size=8, epochs={"*": 1},
                   num_train={"*": 16}, num_test=8,
                   overrides={"in-context-recall": {"seq_len": 16}, "fuzzy-in-context-recall": {"seq_len": 24},
                              "noisy-in-context-recall": {"seq_len": 16},
                              "selective-copying": {"seq_len": 20, "num_tokens_to_copy": 4},
                              "compression": {"seq_len": 8}, "memorization": {"seq_len": 8}}),
}


# ----------------------------------------------------------------------------------------------
# Models
# ----------------------------------------------------------------------------------------------

def model_config(mixer: str, vocab_size: int, seq_len: int):
    from ..models import LMConfig

    name, heads, kw, _ = MIXERS[mixer]
    return LMConfig(vocab_size=vocab_size, d_model=WIDTH, n_layers=2, n_heads=heads, mixer=name,
                    mixer_kwargs={name: dict(kw)} if kw else {}, ffn="swiglu", ffn_hidden=SWIGLU_HIDDEN,
                    residual="prenorm", tie_embeddings=False, final_norm=True, max_seq_len=max(seq_len, 16),
                    chunk_size=64)


def sincos_positions(n: int, dim: int) -> torch.Tensor:
    """Sinusoidal position embeddings `[n, dim]` (fairseq's layout: sines, then cosines)."""
    half = dim // 2
    freq = torch.exp(torch.arange(half, dtype=torch.float32) * -(math.log(10000.0) / max(1, half - 1)))
    ang = torch.arange(n, dtype=torch.float32)[:, None] * freq[None, :]
    emb = torch.cat([torch.sin(ang), torch.cos(ang)], dim=1)
    if dim % 2:
        emb = torch.cat([emb, torch.zeros(n, 1)], dim=1)
    return emb


class MADAutoEncoder(nn.Module):
    """mad-lab's AutoEncoder backbone (compression): encoder blocks of the LMConfig, the last
    position pooled, a non-expanding MLP decoder over pooled + sinusoidal positions, linear head."""

    def __init__(self, config):
        super().__init__()
        from ..layers import RMSNorm
        from ..models.lm import Block

        d = config.d_model
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, d)
        self.blocks = nn.ModuleList([Block(config, i) for i in range(config.n_layers)])
        self.decoder = nn.Sequential(RMSNorm(d), nn.Linear(d, d), nn.GELU(), RMSNorm(d), nn.Linear(d, d), nn.GELU())
        self.norm = RMSNorm(d)
        self.head = nn.Linear(d, config.vocab_size)
        self.register_buffer("positions", sincos_positions(config.max_seq_len, d), persistent=False)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for b in self.blocks:
            x, _ = b(x)
        z = x[:, -1]                                                   # global pool: the last position
        T = ids.shape[1]
        h = self.decoder(z[:, None, :] + self.positions[:T][None])     # [B, T, d]
        return self.head(self.norm(h))


def build_model(mixer: str, task: str, vocab_size: int, seq_len: int) -> nn.Module:
    from ..data.mad import TASKS
    from ..models import LanguageModel

    cfg = model_config(mixer, vocab_size, seq_len)
    if TASKS[task].backbone == "autoencoder":
        return MADAutoEncoder(cfg)
    model = LanguageModel(cfg)
    # mad-lab's head has a bias; LanguageModel's untied head has none: add one
    model.head_bias = nn.Parameter(torch.zeros(vocab_size))
    return model


def logits_of(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = model(x)
    if isinstance(out, torch.Tensor):
        return out
    logits = out.logits
    bias = getattr(model, "head_bias", None)
    return logits + bias if bias is not None else logits


# ----------------------------------------------------------------------------------------------
# Metrics
# ----------------------------------------------------------------------------------------------

class MacroAccuracy:
    """torchmetrics MulticlassAccuracy(average="macro", ignore_index=-100), accumulated over batches:
    per-class recall tp_c / (tp_c + fn_c), averaged over the classes with tp + fp + fn > 0."""

    def __init__(self, num_classes: int, ignore_index: int = -100):
        self.num_classes, self.ignore_index = int(num_classes), int(ignore_index)
        self.tp = torch.zeros(num_classes, dtype=torch.long)
        self.support = torch.zeros(num_classes, dtype=torch.long)
        self.predicted = torch.zeros(num_classes, dtype=torch.long)

    def update(self, preds: torch.Tensor, targets: torch.Tensor) -> None:
        p, t = preds.reshape(-1).cpu(), targets.reshape(-1).cpu()
        keep = t != self.ignore_index
        p, t = p[keep], t[keep]
        C = self.num_classes
        self.support += torch.bincount(t, minlength=C)[:C]
        self.predicted += torch.bincount(p.clamp(0, C - 1), minlength=C)[:C]
        self.tp += torch.bincount(t[p == t], minlength=C)[:C]

    def compute(self) -> float:
        fp = self.predicted - self.tp
        fn = self.support - self.tp
        present = (self.tp + fp + fn) > 0
        if not bool(present.any()):
            return 0.0
        recall = torch.where(self.support > 0, self.tp.double() / self.support.clamp_min(1).double(),
                             torch.zeros(self.num_classes, dtype=torch.float64))
        return float(recall[present].mean())

    def micro(self) -> float:
        n = int(self.support.sum())
        return float(self.tp.sum()) / n if n else 0.0

    def stray_classes(self) -> int:
        """Classes predicted at least once but never a target: each enters the macro average with
        recall 0, so one stray prediction among ~10^5 correct ones costs 1/(classes + 1) of the score."""
        return int(((self.support == 0) & (self.predicted > 0)).sum())


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, vocab: int, batch_size: int,
             device: torch.device) -> Dict[str, float]:
    model.eval()
    acc = MacroAccuracy(vocab)
    nll, count = 0.0, 0
    for i in range(0, x.shape[0], batch_size):
        xb, yb = x[i:i + batch_size].to(device), y[i:i + batch_size].to(device)
        logits = logits_of(model, xb).float()
        nll += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), yb.reshape(-1), ignore_index=-100,
                                     reduction="sum"))
        count += int((yb != -100).sum())
        acc.update(logits.argmax(-1), yb)
    model.train()
    loss = nll / max(1, count)
    return {"acc": acc.compute(), "micro_acc": acc.micro(), "stray_classes": acc.stray_classes(), "loss": loss,
            "ppl": math.exp(min(loss, 700.0))}


def make_optimizer(model: nn.Module, lr: float, wd: float) -> torch.optim.Optimizer:
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if ("bias" in n or "norm" in n) else decay).append(p)
    return torch.optim.AdamW([{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}],
                             lr=lr)


# ----------------------------------------------------------------------------------------------
# One run: (mixer, task, setting, lr, wd)
# ----------------------------------------------------------------------------------------------

def train_run(spec: Dict[str, Any], data: Dict[str, torch.Tensor], budget: Budget, device: torch.device,
              bar: bool) -> Dict[str, Any]:
    task, mixer = spec["task"], spec["mixer"]
    setting = spec["setting"]
    vocab = int(setting["vocab_size"])
    xtr, ytr = data["train_inputs"], data["train_targets"]
    xte, yte = data["test_inputs"], data["test_targets"]
    common.seed_everything(spec["seed"])
    model = build_model(mixer, task, vocab, xtr.shape[1]).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    opt = make_optimizer(model, spec["lr"], spec["wd"])
    epochs = spec["epochs"]
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=epochs, eta_min=MIN_LR)
    B = budget.batch_size
    steps_per_epoch = math.ceil(xtr.shape[0] / B)
    history: List[Dict[str, Any]] = []
    gen = torch.Generator().manual_seed(spec["seed"])
    t0 = time.perf_counter()
    train_tokens = 0
    stopped_early = False
    model.train()
    with common.progress(total=epochs * steps_per_epoch, desc=f"{mixer} {task}", enabled=bar, unit="step") as pb:
        for epoch in range(epochs):
            perm = torch.randperm(xtr.shape[0], generator=gen)
            tot, nb = 0.0, 0
            for i in range(steps_per_epoch):
                idx = perm[i * B:(i + 1) * B]
                xb, yb = xtr[idx].to(device), ytr[idx].to(device)
                logits = logits_of(model, xb).float()
                loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), yb.reshape(-1), ignore_index=-100)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                lv = float(loss.item())
                if not math.isfinite(lv):
                    raise FloatingPointError(f"{mixer} {task}: training loss {lv} in epoch {epoch + 1}")
                tot += lv
                nb += 1
                train_tokens += xb.numel()
                pb.update(1)
            lr_now = opt.param_groups[0]["lr"]
            sched.step()
            ev = evaluate(model, xte, yte, vocab, max(B, 64), device)
            history.append({"epoch": epoch + 1, "train_loss": tot / max(1, nb), "lr": lr_now,
                            **{f"test_{k}": v for k, v in ev.items()}})
            pb.set_postfix(loss=f"{tot / max(1, nb):.3f}", acc=f"{ev['acc']:.3f}", refresh=False)
            if ev["acc"] >= STOP_ACC:
                stopped_early = epoch + 1 < epochs
                break
    wall = time.perf_counter() - t0
    best = min(history, key=lambda h: h["test_ppl"])
    return {"n_params": n_params, "epochs_run": len(history), "stopped_early": stopped_early, "history": history,
            "acc": best["test_acc"], "best_epoch": best["epoch"], "final_acc": history[-1]["test_acc"],
            "max_acc": max(h["test_acc"] for h in history), "micro_acc": best["test_micro_acc"],
            "test_ppl": best["test_ppl"], "train_tokens": train_tokens,
            "train_tokens_per_s": train_tokens / max(1e-9, wall), "train_s": wall}


# ----------------------------------------------------------------------------------------------
# Planning and scoring
# ----------------------------------------------------------------------------------------------

def setting_id(setting: Dict[str, Any], baseline: Dict[str, Any]) -> str:
    diff = [f"{k}={v}" for k, v in setting.items() if baseline.get(k) != v and k != "num_test_examples"]
    return "baseline" if not diff else ",".join(diff)


def plan_runs(budget: Budget, mixers: Sequence[str], tasks: Sequence[str], seed: int,
              seeds: int = 1) -> List[Dict[str, Any]]:
    """Every run of the budget: per task, setting, mixer, lr, wd and model seed (seed, seed + 1, ...;
    the data are the same for every seed: mad-lab's data seed)."""
    from ..data.mad import TASKS, settings

    cells = []   # (task, setting id, setting)
    for task in tasks:
        base = dict(TASKS[task].baseline)
        for setting in settings(task, sweep=budget.sweep):
            s = dict(setting, **budget.overrides.get(task, {}))
            n_train = budget.num_train.get(task, budget.num_train.get("*"))
            if n_train is not None:
                s["num_train_examples"] = min(int(n_train), int(s["num_train_examples"]))
            if budget.num_test is not None:
                s["num_test_examples"] = int(budget.num_test)
            cells.append((task, setting_id(setting, base), s))
    # seed-major, then mixer: an interrupted run has whole mixers done, the first seed first
    plan = []
    for sd in range(seed, seed + seeds):
        for mixer in mixers:
            for task, sid, s in cells:
                for lr in budget.lrs:
                    for wd in budget.wds:
                        plan.append({"run_id": f"{task}--{sid}--{mixer}--lr{lr:g}-wd{wd:g}--s{sd}", "task": task,
                                     "setting_id": sid, "setting": s, "mixer": mixer, "lr": lr, "wd": wd,
                                     "epochs": budget.task_epochs(task), "seed": sd})
    return plan


def seed_scores(runs: List[Dict[str, Any]], mixers: Sequence[str],
                tasks: Sequence[str]) -> Dict[str, Dict[str, Dict[int, float]]]:
    """Per (mixer, task, model seed): per setting the best accuracy over lr x wd, averaged over the
    task's settings (%); a seed appears only when all its settings have a run."""
    out: Dict[str, Dict[str, Dict[int, float]]] = {}
    n_settings = {t: len({r["setting_id"] for r in runs if r["task"] == t}) for t in tasks}
    for m in mixers:
        out[m] = {}
        for t in tasks:
            best: Dict[int, Dict[str, float]] = {}
            for r in runs:
                if r["mixer"] == m and r["task"] == t:
                    per = best.setdefault(int(r.get("seed", 0)), {})
                    per[r["setting_id"]] = max(per.get(r["setting_id"], -1.0), 100.0 * r["acc"])
            out[m][t] = {sd: sum(v.values()) / len(v) for sd, v in sorted(best.items())
                         if len(v) == n_settings[t]}
    return out


def score(runs: List[Dict[str, Any]], mixers: Sequence[str], tasks: Sequence[str]) -> Dict[str, Any]:
    """Per (mixer, task): per setting the best accuracy over lr x wd, averaged over settings, then
    over model seeds; the MAD average over tasks (all in %)."""
    return table_of(seed_scores(runs, mixers, tasks), mixers, tasks)


def table_of(per_seed, mixers: Sequence[str], tasks: Sequence[str]) -> Dict[str, Any]:
    """`score`'s table from `seed_scores`' output."""
    table: Dict[str, Dict[str, Optional[float]]] = {}
    for m in mixers:
        table[m] = {t: common.mean_std(per_seed[m][t].values())[0] for t in tasks}
        vals = [table[m][t] for t in tasks]
        table[m]["average"] = sum(vals) / len(vals) if vals and all(v is not None for v in vals) else None
    return table


def seed_averages(per_seed, mixer: str, tasks: Sequence[str]) -> Dict[int, float]:
    """The MAD average over `tasks` of each model seed that has all of them."""
    seeds = set.intersection(*(set(per_seed[mixer][t]) for t in tasks)) if tasks else set()
    return {sd: sum(per_seed[mixer][t][sd] for t in tasks) / len(tasks) for sd in sorted(seeds)}


# The sanity gate: attention solves in-context recall in the MAD paper; a setup where it does not
# (too little data or training) cannot rank the other mixers. Checked at the baseline setting.
GATE_MIXER = "softmax"
GATE_TASKS = ("in-context-recall", "noisy-in-context-recall")
GATE_MIN_ACC = 90.0


def sanity_gate(runs: List[Dict[str, Any]]) -> Dict[str, Any]:
    """{"status": "passed" | "failed" | "not checked", "accuracy": {task: [per seed]}, "text"}: passed
    when every seed of softmax reaches GATE_MIN_ACC on both GATE_TASKS at the baseline setting (best
    lr/wd run)."""
    from ..data.mad import TASKS

    baseline = seed_scores([r for r in runs if r["setting_id"] == "baseline"], [GATE_MIXER], GATE_TASKS)
    acc = {t: list(baseline[GATE_MIXER][t].values()) for t in GATE_TASKS}
    need = f"softmax >= {GATE_MIN_ACC:g}% on {' and '.join(TASKS[t].label for t in GATE_TASKS)} at the baseline setting"
    if not all(acc.values()):
        return {"status": "not checked", "accuracy": acc,
                "text": f"Sanity gate not checked: it needs softmax's runs on {', '.join(GATE_TASKS)} "
                        f"(add softmax to --mixers); {need}."}
    ok = all(min(v) >= GATE_MIN_ACC for v in acc.values())
    got = "; ".join(f"{TASKS[t].label} {', '.join(fmt(x) for x in v)}" for t, v in acc.items())
    if ok:
        return {"status": "passed", "accuracy": acc, "text": f"**Sanity gate passed**: {got} ({need})."}
    return {"status": "failed", "accuracy": acc,
            "text": f"**Sanity gate FAILED: this run is invalid** ({got}; {need}). The setup does not reproduce "
                    f"the known baseline, so the other rows cannot be trusted to rank the mixers."}


# EFLA's claim (Table 2): EFLA above DeltaNet on every task; MAD's: linear attention below attention
# on the recall tasks
COMPARISONS = (("efla", "deltanet"), ("linear-elu", "softmax"))


def comparisons(per_seed, mixers: Sequence[str], tasks: Sequence[str]) -> List[Dict[str, Any]]:
    """Paired per-seed differences for each pair of COMPARISONS present, per task and on average."""
    out = []
    for a, b in COMPARISONS:
        if a not in mixers or b not in mixers:
            continue
        rows = {}
        for t in list(tasks) + ["average"]:
            va = per_seed[a][t] if t != "average" else seed_averages(per_seed, a, tasks)
            vb = per_seed[b][t] if t != "average" else seed_averages(per_seed, b, tasks)
            seeds = sorted(set(va) & set(vb))
            rows[t] = common.paired_difference([va[k] for k in seeds], [vb[k] for k in seeds])
        out.append({"a": a, "b": b, "tasks": rows})
    return out


def _extra_args(a) -> str:
    from ..data.mad import TASKS

    out = ""
    if list(a.mixers) != list(MIXERS):
        out += " --mixers " + ",".join(a.mixers)
    if list(a.tasks) != list(TASKS):
        out += " --tasks " + ",".join(a.tasks)
    if a.seeds != 1:
        out += f" --seeds {a.seeds}"
    return out


def macro_gap_notes(runs, points: float = 1.0, high: float = 0.99) -> List[str]:
    """Runs that got nearly every test target right (micro accuracy >= `high`) yet score more than
    `points` lower on macro accuracy at the scored epoch, or missed the early stop on macro accuracy
    alone: in mad-lab's macro average a class that is predicted but never a target counts as recall 0
    (`MacroAccuracy.stray_classes`), so such a cell measures a few stray predictions, not the task."""
    from ..data.mad import TASKS

    notes = []
    for r in runs:
        best = next(h for h in r["history"] if h["epoch"] == r["best_epoch"])
        parts = []
        if best["test_micro_acc"] >= high and 100 * (best["test_micro_acc"] - best["test_acc"]) > points:
            stray = f", {best['test_stray_classes']} stray class(es)" if "test_stray_classes" in best else ""
            parts.append(f"scored macro {fmt(100 * best['test_acc'])} at micro {fmt(100 * best['test_micro_acc'], 2)} "
                         f"(epoch {best['epoch']}{stray})")
        missed = [str(h["epoch"]) for h in r["history"] if h["test_micro_acc"] >= STOP_ACC > h["test_acc"]]
        if missed:
            parts.append(f"trained on past micro >= {100 * STOP_ACC:g}% in epoch(s) {', '.join(missed)}")
        if parts:
            notes.append(f"- {MIXERS[r['mixer']][3]}, {TASKS[r['task']].label}, seed {r.get('seed', 0)}: "
                         + "; ".join(parts))
    if not notes:
        return []
    return ["Macro accuracy below micro (mad-lab's macro average gives a class that is predicted but never a "
            "target recall 0, so one stray prediction among ~10^5 right ones costs 1/(classes + 1) of the score "
            "and can block the early stop):", ""] + notes + [""]


def markdown(exp: common.Experiment, budget: Budget, per_seed, runs, mixers, tasks, gate, compared,
             planned: int) -> str:
    from ..data.mad import NUM_TEST_EXAMPLES, TASKS

    a = exp.args
    lines = [f"# MAD ({a.budget})", ""] + exp.incomplete_note(runs, planned)
    lines += [f"- {h}" for h in exp.header_lines(runs, _extra_args(a))]
    if a.budget == "full":
        lines.append("- protocol: mad-lab's benchmark (all settings, lr {1e-4, 5e-4, 1e-3} x wd {0, 0.1}, "
                     "batch 128, up to 200 epochs, early stop at 99.9% test accuracy)")
    else:
        def n_train(t):
            return next((r["setting"]["num_train_examples"] for r in runs if r["task"] == t), "?")
        per = "; ".join(f"{TASKS[t].label}: {n_train(t)} train x {budget.task_epochs(t)} epochs" for t in tasks)
        n_test = budget.num_test if budget.num_test is not None else NUM_TEST_EXAMPLES
        lines.append(f"- protocol ({a.budget}, **reduced**): baseline setting of each task only, one learning rate "
                     f"({', '.join(f'{x:g}' for x in budget.lrs)}, wd {', '.join(f'{x:g}' for x in budget.wds)}), "
                     f"batch {budget.batch_size}, {n_test} test examples, early stop at 99.9%; {per}. The paper's "
                     f"protocol trains on 12,800 examples for up to 200 epochs and takes the best of 6 lr/wd "
                     f"settings and the mean over each difficulty sweep: the baseline-only numbers are not the "
                     f"same average as Table 2's.")
    lines += [f"- model seeds: {a.seed}..{a.seed + a.seeds - 1} ({a.seeds}); the data are the same for every seed",
              "- score: macro-averaged test accuracy (%) at the epoch with the lowest test perplexity; "
              "per task the mean over its settings of the best lr/wd run; average over the tasks"
              + ("; mean ± std over model seeds" if a.seeds > 1 else ""), "", gate["text"], ""]
    cols = [t for t in TASK_ORDER if t in tasks]
    headers = ["mixer"] + [TASKS[t].label for t in cols] + ["Average"]

    def cell(m, t):
        vals = list(per_seed[m][t].values()) if t != "average" else list(seed_averages(per_seed, m, cols).values())
        mean, std, n = common.mean_std(vals)
        return common.fmt_pm(mean, std, n)

    rows = [[MIXERS[m][3]] + [cell(m, t) for t in cols] + [cell(m, "average")] for m in mixers]
    lines += [md_table(headers, rows), ""]
    if set(("deltanet", "efla")) & set(mixers):
        lines += ["EFLA paper, Table 2 (full protocol, for reference):", ""]
        prow = [[MIXERS[m][3] + " (paper)"] + [fmt(PAPER_TABLE2[m][t]) for t in cols] +
                [fmt(PAPER_TABLE2[m]["average"])] for m in ("deltanet", "efla")]
        lines += [md_table(headers, prow), ""]
    for c in compared:
        la, lb = MIXERS[c["a"]][3], MIXERS[c["b"]][3]
        lines += [f"{la} - {lb}, paired by model seed (accuracy points; 'exceeds the spread': |mean| > 2 std / "
                  "sqrt(n)):", ""]
        lines += [md_table(["task", "difference"], [[TASKS[t].label if t in TASKS else "Average",
                                                     common.describe_difference(p, f"{la} higher", f"{lb} higher")]
                                                    for t, p in c["tasks"].items()], align="ll"), ""]
    lines += macro_gap_notes(runs)
    rrows = []
    for r in runs:
        rrows.append([MIXERS[r["mixer"]][3], TASKS[r["task"]].label, r["setting_id"], r.get("seed", ""),
                      f"{r['lr']:g}/{r['wd']:g}", r["n_params"], f"{r['epochs_run']}/{r['epochs']}",
                      fmt(100 * r["acc"]), fmt(100 * r["micro_acc"]), fmt(r["test_ppl"], 2),
                      fmt(r["train_tokens_per_s"], 0), fmt(r["train_s"], 0)])
    lines += ["Runs:", "", md_table(["mixer", "task", "setting", "seed", "lr/wd", "params", "epochs", "acc (macro)",
                                     "acc (micro)", "test ppl", "train tok/s", "s"], rrows), ""]
    return "\n".join(lines)


def plot(path: Path, table, per_seed, mixers, tasks, title: str) -> None:
    """Bars of the table, error bars = std over model seeds, the sanity gate's level dashed."""
    from ..data.mad import TASKS

    cols = [t for t in TASK_ORDER if t in tasks]
    groups = [TASKS[t].label for t in cols] + ["Average"]
    series = {MIXERS[m][3]: [table[m][t] for t in cols] + [table[m]["average"]] for m in mixers}
    errors = {MIXERS[m][3]: [common.mean_std(per_seed[m][t].values())[1] for t in cols] +
              [common.mean_std(seed_averages(per_seed, m, cols).values())[1]] for m in mixers}
    common.bar_panel(path, groups, series, "test accuracy (%, macro)", title=title, ylim=(0, 100), errors=errors,
                     hline=GATE_MIN_ACC)


# ----------------------------------------------------------------------------------------------
# Entry points
# ----------------------------------------------------------------------------------------------

BUDGET_HELP = {
    "quick": "the baseline settings with a few hundred to a few thousand examples: about 20 minutes of a "
             "2-core CPU for the six paper mixers; too small for softmax to learn recall (not calibrated)",
    "standard": "the baseline settings with the full 12,800-example training sets on the recall tasks and "
                "compression and enough epochs for softmax to pass the sanity gate; 13-45 minutes of one CPU "
                "thread per mixer and seed (measured), 3 hours for softmax, linear (elu+1, hadamard), "
                "DeltaNet, Gated DeltaNet and EFLA (1.5-2 hours as two processes sharing --out)",
    "full": "mad-lab's benchmark (every setting, 6 lr/wd, up to 200 epochs): meant for a GPU",
}


def add_arguments(p) -> None:
    from ..data.mad import TASKS

    common.add_common_arguments(p, NAME, "unused (the MAD data are generated)", default_seed=0, budgets=BUDGET_HELP)
    p.add_argument("--mixers", type=common.subset_of(list(MIXERS)), default=list(MIXERS),
                   help="comma-separated subset of " + ",".join(MIXERS) + " (default all)")
    p.add_argument("--tasks", type=common.subset_of(list(TASKS)), default=list(TASKS),
                   help="comma-separated subset of " + ",".join(TASKS) + " (default all)")
    p.add_argument("--seeds", type=int, default=1,
                   help="model seeds per run (seed, seed+1, ...; the data stay the same); default 1")


def run(args) -> int:
    from ..data.mad import DATA_SEED, make_dataset

    budget = BUDGETS[args.budget]
    if args.seeds < 1:
        raise common.ExperimentError(f"--seeds must be >= 1, got {args.seeds}")
    common.set_threads(args.threads)
    device = common.resolve_device(args.device, common.ExperimentError)
    mixers, tasks = list(args.mixers), list(args.tasks)
    # the folder's identity is the protocol; --mixers, --tasks, --seed(s) only choose which of its runs
    # to train and show (every run id names its mixer, task, setting, lr, wd and seed), so a resume may add some
    config = {"budget": args.budget, "protocol": asdict(budget)}
    exp = common.Experiment(NAME, args, config)
    print(f"linattn experiment {NAME} --budget {args.budget}")
    for h in exp.header_lines():
        print("  " + h)
    if args.budget != "full":
        print(f"  reduced protocol ({args.budget}): baseline settings only, lr {budget.lrs} wd {budget.wds}, "
              f"batch {budget.batch_size} (see results.md); not the paper's average over difficulty sweeps")
    plan = plan_runs(budget, mixers, tasks, args.seed, args.seeds)
    cache: Dict[str, Dict[str, torch.Tensor]] = {}

    def one(spec):
        key = spec["task"] + "|" + spec["setting_id"]
        if key not in cache:
            if len(cache) >= len(tasks):   # at most one dataset per task in memory (the full budget has ~70)
                cache.clear()
            s = dict(spec["setting"])
            cache[key] = make_dataset(spec["task"], s.pop("num_train_examples"), s.pop("num_test_examples"),
                                      seed=DATA_SEED, **s)
        return train_run(spec, cache[key], budget, device, exp.progress_enabled)

    runs = exp.run_all(plan, one)
    per_seed = seed_scores(runs, mixers, tasks)
    table = table_of(per_seed, mixers, tasks)
    gate = sanity_gate(runs)
    compared = comparisons(per_seed, mixers, tasks)
    md = markdown(exp, budget, per_seed, runs, mixers, tasks, gate, compared, len(plan))
    title = f"MAD ({args.budget}{'' if args.budget == 'full' else ': reduced protocol'}), macro accuracy" + \
        ("" if gate["status"] != "failed" else " -- INVALID: softmax failed the sanity gate")
    paths = exp.write_outputs({"table": table, "per_seed": per_seed, "sanity_gate": gate,
                               "comparisons": compared, "paper_table2": PAPER_TABLE2,
                               "complete": len(runs) == len(plan)}, runs, md,
                              {"mad": lambda p: plot(p, table, per_seed, mixers, tasks, title)})
    print()
    print(md)
    print(f"\nwrote {', '.join(str(p) for p in paths.values())}")
    return 0
