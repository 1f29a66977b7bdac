"""`linattn experiment tlinformer`: TLinFormer against a standard Transformer of equal parameter
count, on the same data and tokens (seed 003, sections 6.2-6.3 and Table 1), scaled down.

The paper: d 432, 12 heads, depth 8 (the baseline: 8 decoder layers; TLinFormer: 2 blocks of inner
depth 4, i.e. H = 2 hidden layers between the compress and restore layers), the same parameters;
models "Base L" and "TLinFormer L-W_total-ratio" with W_total = W_oh + W_og and ratio = W_oh / W_total.
Here the quick budget divides the lengths by 4 (L = 256 for the paper's 1K) and the width by ~3.4:

    base              "Base 256": softmax attention with RoPE, pre-norm, SwiGLU FFN (the width
                      TLinFormer's layers have), tied embeddings, final norm; 8 layers
    tlinformer-half   "TLinFormer 256-128-0.5": W_oh 64, W_og 64 (the paper's 1K-512-0.5): the window
                      slides 4 times per sequence, histories of 64-192 tokens compressed to 64
    tlinformer-full   "TLinFormer 256-256-0.5": W_oh 128, W_og 128 (the paper's 1K-1K-0.5): 2 windows,
                      the history (128 tokens) never compressed below its length

d 128, 4 heads (head dim 32); a layer has the same weight shapes in both architectures (q, k, v
and output projections without biases, two RMSNorms, a SwiGLU), so the parameter counts are equal
(checked by the tests at the real sizes, and shown in the results). Comparisons (paired by
seed): each TLinFormer vs Base. Windows run across documents for every model (TLinFormer cannot
keep packed documents apart). Training is `linattn.training.train` with the `TLinFormerConfig` /
`LMConfig` of each model.

Budgets: quick = d 128, 8 layers, 256-token windows, batch 8, 320 steps (655k tokens per model,
of the first 4 MiB of WikiText-2's train.txt), 2 seeds: about 23 minutes of one thread (measured,
CPU time per step: Base 0.52 s, TLinFormer 256-128-0.5 0.83 s, 256-256-0.5 0.70 s, + 9 evaluations of
8 x 8 windows per run; more wall time when the CPU is shared); full = the paper's model and windows
(d 432, 12 heads, 1K tokens: Base 1K, TLinFormer 1K-512-0.5 and 1K-1K-0.5; meant for a GPU; the paper trained 10
epochs of WikiText-103, this trains on WikiText-2). Inference speed and cache memory:
docs/results/tlinformer.md, "TLinFormer inference" (`linattn bench tlinformer`). Data, training, outputs: as
`linattn experiment lm` (`lm.run_study`).
"""
from __future__ import annotations

from typing import Callable

from . import common, lm
from .lm import Budget, Model, Study

NAME = "tlinformer"
DESCRIPTION = __doc__

BLOCKS = 2   # TLinFormer blocks; inner depth = n_layers / BLOCKS (the paper: 2 blocks of 4 = 8 layers)


def _length(n: int) -> str:
    """The paper's names: 1K, 2K, ... for multiples of 1024."""
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def baseline(budget: Budget, vocab_size: int):
    """A standard decoder-only Transformer with TLinFormer's layers: softmax attention (RoPE),
    pre-norm, SwiGLU of the default width (TLinFormer's too), tied embeddings, final norm."""
    from ..models import LMConfig

    return LMConfig(vocab_size=vocab_size, d_model=budget.d_model, n_layers=budget.n_layers, n_heads=budget.n_heads,
                    mixer="softmax", ffn="swiglu", residual="prenorm", final_norm=True, tie_embeddings=True,
                    max_seq_len=budget.seq_len)


def tlinformer(fraction: float, ratio: float = 0.5) -> Callable[[Budget, int], object]:
    """A builder: TLinFormer with W_total = fraction * seq_len, W_oh = ratio * W_total, W_og the rest."""
    def build(budget: Budget, vocab_size: int):
        from ..models.tlinformer import TLinFormerConfig

        w_total = int(fraction * budget.seq_len)
        w_oh = round(ratio * w_total)
        return TLinFormerConfig(vocab_size=vocab_size, d_model=budget.d_model, n_heads=budget.n_heads,
                                n_blocks=BLOCKS, inner_depth=budget.n_layers // BLOCKS, history_window=w_oh,
                                generation_window=w_total - w_oh, max_seq_len=budget.seq_len)
    return build


def _tlin_label(fraction: float, ratio: float = 0.5) -> Callable[[Budget], str]:
    return lambda b: f"TLinFormer {_length(b.seq_len)}-{_length(int(fraction * b.seq_len))}-{ratio:g}"


MODELS = {
    "base": Model(lambda b: f"Base {_length(b.seq_len)}", baseline, "k"),
    "tlinformer-half": Model(_tlin_label(0.5), tlinformer(0.5), "C0"),
    "tlinformer-full": Model(_tlin_label(1.0), tlinformer(1.0), "C3"),
}

COMPARISONS = [("tlinformer-half", "base"), ("tlinformer-full", "base")]

BUDGETS = {
    # 320 steps: the whole experiment (3 models x 2 seeds) in ~23 minutes of one thread (measured), and far past
    # the uniform-distribution plateau (vocabulary 2,048; val ppl ~150 at step 150 for Base, ~190 at 125 for 256-128)
    "quick": Budget(d_model=128, n_layers=8, n_heads=4, seq_len=256, batch_size=8, steps=320, vocab_size=2048,
                    eval_every=40, eval_batches=8, max_train_bytes=4 * 2 ** 20, max_val_bytes=256 * 2 ** 10,
                    warmup=32, audit_len=256),
    "full": Budget(d_model=432, n_layers=8, n_heads=12, seq_len=1024, batch_size=16, steps=4000, vocab_size=8192,
                   eval_every=250, eval_batches=40, max_train_bytes=None, max_val_bytes=None, warmup=200,
                   audit_len=1024),
    "tiny": Budget(d_model=32, n_layers=4, n_heads=2, seq_len=32, batch_size=2, steps=3, vocab_size=300,
                   eval_every=3, eval_batches=2, max_train_bytes=40_000, max_val_bytes=8_000, warmup=1, audit_len=32),
}

BUDGET_HELP = {
    "quick": "d 128, 8 layers, L = 256 (the paper's lengths / 4), 320 steps x 8 x 256 tokens, about 23 minutes "
             "of one thread with 2 seeds",
    "full": "the paper's model and windows: d 432, 12 heads, L = 1K, 4,000 steps x 16 x 1024 tokens (meant for a GPU)",
}

# the paper's Table 1: validation perplexity on WikiText-103 after epochs 1-10 (GPT-2 tokenizer, 41M parameters)
PAPER_TABLE_1 = {
    "Base 1K": [341.5, 112.5, 63.4, 43.5, 33.0, 28.3, 25.8, 24.2, 23.3, 22.5],
    "TLinFormer 1K-512-0.5": [341.8, 114.0, 64.0, 44.5, 34.3, 29.4, 26.8, 25.0, 23.8, 23.0],
    "TLinFormer 1K-1K-0.5": [340.7, 115.0, 64.3, 44.6, 34.2, 29.0, 26.3, 24.6, 23.5, 22.7],
}


def skeleton(budget: Budget) -> str:
    return (f"d {budget.d_model}, {budget.n_heads} heads (head dim {budget.d_model // budget.n_heads}), depth "
            f"{budget.n_layers}: Base = {budget.n_layers} pre-norm layers of softmax attention (RoPE) + SwiGLU, final "
            f"norm, tied embeddings; TLinFormer = {BLOCKS} blocks of inner depth {budget.n_layers // BLOCKS} (H = "
            f"{budget.n_layers // BLOCKS - 2}) of the same layers, L-W_total-ratio with W_total = W_oh + W_og and "
            f"ratio = W_oh / W_total")


def notes(budget: Budget, groups) -> list:
    params = {k: rs[0]["n_params"] for k, rs in groups.items()}
    same = len(set(params.values())) == 1
    ppl = [r["val_ppl"] for rs in groups.values() for r in rs]
    vocab = max(r.get("vocab_size", budget.vocab_size) for rs in groups.values() for r in rs)
    rows = [[name] + [f"{v:.1f}" for v in vals] for name, vals in PAPER_TABLE_1.items()]
    lines = [f"Parameter counts: {'equal' if same else '**not equal**'} "
             f"({', '.join(f'{k} {v:,}' for k, v in params.items())}).",
             f"Highest final validation perplexity of any run: {max(ppl):.1f} (the uniform distribution's is the "
             f"vocabulary size, {vocab:,}).", "",
             "The paper's Table 1 at the settings scaled here (L = 1K; validation perplexity on WikiText-103 after "
             "epochs 1-10, 41M parameters, GPT-2 tokenizer; one run each): TLinFormer 1K-512-0.5 ends 0.5 above Base "
             "1K (+2.2%), 1K-1K-0.5 0.2 above (+0.9%).", "",
             common.md_table(["model"] + [f"ep {i}" for i in range(1, 11)], rows), "",
             "Inference speed and cache memory (cache hit / miss vs the softmax baseline's KV cache): "
             "docs/results/tlinformer.md, \"TLinFormer inference\" (`linattn bench tlinformer`)."]
    return lines


STUDY = Study(NAME, MODELS, BUDGETS, skeleton, budget_help=BUDGET_HELP, comparisons=COMPARISONS, seeds=2,
              doc_boundaries=False, notes=notes)


def add_arguments(p) -> None:
    lm.add_study_arguments(p, STUDY)


def run(args) -> int:
    return lm.run_study(STUDY, args)
