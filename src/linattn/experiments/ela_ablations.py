"""`linattn experiment ela-ablations`: the ELA paper's architectural claims, one change at a time.

ELA-GPT (seed 000) with the Hadamard Exp mixer, each variant changing one thing of the base:

    hyperlink     the base: Hyper-Link blocks (one RMSNorm, no residual around the mixer:
                  out = x + MoE(ELA(norm(x)))), MoE routing bias none, no memory lobe, no final norm
    prenorm       standard pre-norm residuals instead (x + ELA(norm(x)), then + MoE(norm(.))), with
                  the final norm a pre-norm stack needs
    moe-eq14      MoE routing-score bias, eq. 14: y = sum_e S_e f_e(x) + B_e
    moe-eq15      MoE routing-score bias, eq. 15: y = sum_e S_e (f_e(x) + B_e)
    lobe-causal   + a causal memory lobe (the paper's lobe is bidirectional and leaks the targets:
                  `linattn experiment lm --models ela-lobe-bidir` and the causality audit)

Comparisons (paired by seed): hyperlink vs prenorm ("Hyper-Link converges faster than
Residual-Link"), eq14 vs none, eq15 vs none, eq14 vs eq15 (the routing bias; the paper reports no
number), lobe-causal vs none ("faster convergence"; the paper's abrupt drop at ~750 of 1,750 steps
came with the bidirectional lobe and "vanishes completely" with a causal mask). Hence 1,000 steps,
past the paper's 750, with an evaluation every 100 steps: a sudden drop shows in the curve table.

Budgets: quick = the lm quick size (d 128, 4 layers, 4 heads, 128-token windows, batch 8, the first
2 MiB of WikiText-2's train.txt) for 1,000 steps (1M tokens per model), 2 seeds: about 35 minutes of
one thread (measured, CPU time per step: 0.18-0.19 s, 0.27 s with the lobe, + 11 evaluations per run;
more wall time when the CPU is shared); full = the paper's size (d 256,
vocabulary 6,400, 128-token windows, batch 20, 1,750 steps = its 10 epochs of 451k tokens;
meant for a GPU). Data, training, outputs: as `linattn experiment lm` (`lm.run_study`).
"""
from __future__ import annotations

from dataclasses import replace

from . import lm
from .lm import Budget, Model, Study, ela_gpt

NAME = "ela-ablations"
DESCRIPTION = __doc__

HADAMARD = "ela-hadamard_exp"

MODELS = {
    "hyperlink": Model("Hyper-Link (base)", ela_gpt(mixer=HADAMARD), "C0"),
    "prenorm": Model("pre-norm residuals", ela_gpt(mixer=HADAMARD, residual="prenorm", final_norm=True), "k"),
    "moe-eq14": Model("MoE bias eq. 14", ela_gpt(mixer=HADAMARD, moe_bias="eq14"), "C1"),
    "moe-eq15": Model("MoE bias eq. 15", ela_gpt(mixer=HADAMARD, moe_bias="eq15"), "C2"),
    "lobe-causal": Model("+ memory lobe (causal)", ela_gpt(mixer=HADAMARD, memory_lobe="causal"), "C4"),
}

COMPARISONS = [("hyperlink", "prenorm"), ("moe-eq14", "hyperlink"), ("moe-eq15", "hyperlink"),
               ("moe-eq14", "moe-eq15"), ("lobe-causal", "hyperlink")]

BUDGETS = {
    "quick": replace(lm.BUDGETS["quick"], steps=1000, eval_every=100),
    "full": Budget(d_model=256, n_layers=4, n_heads=4, seq_len=128, batch_size=20, steps=1750, vocab_size=6400,
                   eval_every=125, eval_batches=40, max_train_bytes=2 * 2 ** 20, max_val_bytes=None, warmup=100),
    "tiny": lm.BUDGETS["tiny"],
}

BUDGET_HELP = {
    "quick": "the lm quick size, 1,000 steps x 8 x 128 tokens, about 35 minutes of one thread with 2 seeds",
    "full": "the paper's size: d 256, vocabulary 6,400, 1,750 steps x 20 x 128 tokens (meant for a GPU)",
}


def skeleton(budget: Budget) -> str:
    return (f"ELA-GPT with the Hadamard Exp mixer (MoE 4 experts top-2, tied head), d {budget.d_model}, "
            f"{budget.n_layers} layers, {budget.n_heads} heads; each variant changes one thing of the base "
            f"(Hyper-Link, MoE bias none, no lobe, no final norm)")


def notes(budget: Budget, groups) -> list:
    return ["The paper's claims (seed 000): Hyper-Link \"achieves faster convergence and better fitting performance "
            "than conventional Residual-Link\" (section V-B, no numbers); the routing-score bias (eq. 14/15) is "
            "argued for interpretability and semantic alignment, with no perplexity reported; with the memory lobe "
            "\"an abrupt drop with an inflection point at around the 750th training step\" of 1,750, which "
            "\"vanishes completely\" under a causal mask (section VI-B). Only the causal lobe is a language model: "
            "the bidirectional one is `linattn experiment lm --models ela-lobe-bidir` (it fails the causality "
            "audit).", "",
            f"Pre-norm adds {budget.n_layers + 1} RMSNorm weight vectors (one per layer before the MoE, one final), "
            f"{(budget.n_layers + 1) * budget.d_model:,} parameters; the memory lobe 3 d x d matrices per layer."]


STUDY = Study(NAME, MODELS, BUDGETS, skeleton, budget_help=BUDGET_HELP, comparisons=COMPARISONS, seeds=2,
              notes=notes)


def add_arguments(p) -> None:
    lm.add_study_arguments(p, STUDY)


def run(args) -> int:
    return lm.run_study(STUDY, args)
