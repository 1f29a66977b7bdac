"""`linattn experiment efla-variants`: EFLA's beta variants against EFLA and DeltaNet (EFLA paper,
Table 1: WikiText perplexity at 340M parameters).

Models, in the lm experiment's ELA-GPT skeleton (Hyper-Link, MoE 4 experts top-2), differing only in
the mixer (all with a short convolution, L2-normalised queries):

    efla            EFLA, beta = sigmoid(.) (the paper's base model)
    efla-adaptive   EFLA + adaptive decay: beta = softplus(alpha) sigmoid(.), alpha learnt per head
    efla-loose      EFLA + loose beta: beta = softplus(.), no upper bound
    deltanet        DeltaNet, the anchor (the Euler step the paper improves on)

Comparisons (paired by seed): adaptive vs sigmoid, loose vs sigmoid, EFLA vs DeltaNet. The paper's
340M models: WikiText perplexity DeltaNet 38.09, EFLA 37.01, + adaptive decay 35.13, + loose beta
35.26 (one run each, 15B tokens).

Budgets: those of `linattn experiment lm` (quick: d 128, 4 layers, 128-token windows, batch 8,
400 steps, about 410k tokens per model), 2 seeds: about 17 minutes of one thread for the quick
budget (measured, CPU time per step: 0.26-0.30 s, + 9 evaluations per run; more wall time when the
CPU is shared). Data, training, outputs: as `lm` (`lm.run_study`).
"""
from __future__ import annotations

from . import common, lm
from .lm import Budget, Model, Study, ela_gpt

NAME = "efla-variants"
DESCRIPTION = __doc__

MODELS = {
    "efla": Model("EFLA (sigmoid β)", ela_gpt(mixer="efla"), "C3"),
    "efla-adaptive": Model("EFLA + adaptive decay", ela_gpt(mixer="efla-adaptive"), "C0"),
    "efla-loose": Model("EFLA + loose β", ela_gpt(mixer="efla-loose"), "C2"),
    "deltanet": Model("DeltaNet", ela_gpt(mixer="deltanet"), "C1"),
}

COMPARISONS = [("efla-adaptive", "efla"), ("efla-loose", "efla"), ("efla", "deltanet")]

# the paper's Table 1, 340M parameters: WikiText perplexity
PAPER_WIKI_PPL = {"deltanet": 38.09, "efla": 37.01, "efla-adaptive": 35.13, "efla-loose": 35.26}


def notes(budget: Budget, groups) -> list:
    rows = [[MODELS[k].label, f"{v:.2f}", f"{100 * (v / PAPER_WIKI_PPL['efla'] - 1):+.1f}%"]
            for k, v in PAPER_WIKI_PPL.items()]
    return ["The EFLA paper's Table 1 at 340M parameters (SlimPajama, Mistral tokenizer; WikiText perplexity, one "
            "run each), for the direction of the differences only:", "",
            common.md_table(["model", "Wiki. ppl", "vs EFLA"], rows)]


BUDGET_HELP = {
    "quick": "the lm quick budget, 400 steps x 8 x 128 tokens, about 17 minutes of one thread with 2 seeds",
    "full": "the lm full budget: d 256, 3,000 steps x 16 x 256 tokens (meant for a GPU)",
}

STUDY = Study(NAME, MODELS, lm.BUDGETS, lm.ela_skeleton, budget_help=BUDGET_HELP, comparisons=COMPARISONS,
              seeds=2, notes=notes)


def add_arguments(p) -> None:
    lm.add_study_arguments(p, STUDY)


def run(args) -> int:
    return lm.run_study(STUDY, args)
