"""`linattn experiment lm`: language models at equal parameters and tokens on one text corpus.

Models, all in the ELA paper's GPT skeleton (Hyper-Link blocks: one RMSNorm, the mixer, a
top-2-of-4 MoE of non-expanding SwiGLU experts, no residual around the mixer; no final norm; tied
head), differing only in the token mixer (and the memory lobe):

    softmax            causal softmax attention with RoPE (the ELA paper's GPT baseline)
    ela-hadamard       ELA-GPT, Hadamard Exp kernel  k(a, b) = sum_d e^{a_d} e^{b_d}
    ela-sum-sq         ELA-GPT, summation squared-Euclidean kernel  k(a, b) = ||a + b||^2
    deltanet           DeltaNet layer (short conv, sigmoid beta, L2-normalised q/k, output norm)
    efla               EFLA layer (the same with the exact coefficient, raw keys)
    ela-lobe-causal    ELA-GPT (Hadamard Exp) + a causal memory lobe
    ela-lobe-bidir     ELA-GPT (Hadamard Exp) + the paper's bidirectional memory lobe: position t
                       sees later tokens, so its loss is not a language model's (a leak, flagged
                       by the causality audit `linattn.audit.check_causality`)

Every model trains on the same batches (same seed, same number of tokens) with `linattn.training`
(AdamW, warmup then cosine, gradient clipping), validation loss/perplexity on the same held-out
windows; training tokens/s is measured on this machine during training.

Data (`--data`): a text file or folder; a folder with train.txt and valid.txt (WikiText-2 as in
../shared/data/wikitext-2) uses them as the training and validation splits; no --data: the
embedded standard-library corpus (`linattn.data.corpus`). A byte-level BPE tokenizer is trained
on the training split (saved in the results folder, reused on --resume).

Budgets: full = the ELA-GPT size (d 256, 4 layers, 4 heads), 256-token windows, batch 16, 3000 steps;
quick = d 128 (same layout), 128-token windows, batch 8, 400 steps (about 410k tokens per model,
about 20 minutes for the seven models on a 2-core CPU).
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from . import common
from .common import ExperimentError, fmt, md_table

NAME = "lm"
DESCRIPTION = __doc__

# key -> (label, LMConfig overrides on top of LMConfig.ela_gpt, color)
MODELS: Dict[str, tuple] = {
    "softmax": ("softmax GPT", {"mixer": "softmax"}, "k"),
    "ela-hadamard": ("ELA-GPT (Hadamard Exp)", {"mixer": "ela-hadamard_exp"}, "C0"),
    "ela-sum-sq": ("ELA-GPT (sum sq. Euclid)", {"mixer": "ela-sum_sq_euclid"}, "C2"),
    "deltanet": ("DeltaNet", {"mixer": "deltanet"}, "C1"),
    "efla": ("EFLA", {"mixer": "efla"}, "C3"),
    "ela-lobe-causal": ("ELA-GPT + lobe (causal)", {"mixer": "ela-hadamard_exp", "memory_lobe": "causal"}, "C4"),
    "ela-lobe-bidir": ("ELA-GPT + lobe (bidirectional, leaks)",
                       {"mixer": "ela-hadamard_exp", "memory_lobe": "bidirectional", "allow_future_leak": True},
                       "C5"),
    # issue 11: the delta-rule variants and the test-time regression / training mixers (4 heads of 32)
    "comba": ("Comba", {"mixer": "comba"}, "C6"),
    "delta-product": ("DeltaProduct (n=2)", {"mixer": "delta-product"}, "C7"),
    "kda": ("KDA", {"mixer": "kda"}, "C8"),
    "mesanet": ("MesaNet", {"mixer": "mesanet"}, "C9"),
    "ttt-linear": ("TTT-Linear", {"mixer": "ttt-linear"}, "saddlebrown"),   # C8 is olive already
    "ttt-mlp": ("TTT-MLP", {"mixer": "ttt-mlp"}, "navy"),
    "titans": ("Titans", {"mixer": "titans"}, "teal"),
    # issue 12: softmax attention fed back by linear attention (4 heads of 32)
    "fox": ("FoX", {"mixer": "fox"}, "magenta"),
    "deltaformer": ("DeltaFormer", {"mixer": "deltaformer"}, "goldenrod"),
    "path": ("PaTH", {"mixer": "path"}, "lime"),
}


@dataclass
class Budget:
    d_model: int
    n_layers: int
    n_heads: int
    seq_len: int
    batch_size: int
    steps: int
    vocab_size: int
    eval_every: int
    eval_batches: int
    max_train_bytes: Optional[int]
    max_val_bytes: Optional[int]
    lr: float = 1e-3
    warmup: int = 40
    audit_len: int = 32


BUDGETS = {
    "full": Budget(d_model=256, n_layers=4, n_heads=4, seq_len=256, batch_size=16, steps=3000, vocab_size=4096,
                   eval_every=250, eval_batches=40, max_train_bytes=None, max_val_bytes=None, warmup=200),
    "quick": Budget(d_model=128, n_layers=4, n_heads=4, seq_len=128, batch_size=8, steps=400, vocab_size=2048,
                    eval_every=50, eval_batches=12, max_train_bytes=2 * 2 ** 20, max_val_bytes=256 * 2 ** 10),
    "tiny": Budget(d_model=32, n_layers=1, n_heads=2, seq_len=32, batch_size=2, steps=3, vocab_size=300,
                   eval_every=3, eval_batches=2, max_train_bytes=40_000, max_val_bytes=8_000, warmup=1,
                   audit_len=8),
}


def model_config(key: str, budget: Budget, vocab_size: int):
    from ..models import LMConfig

    _, over, _ = MODELS[key]
    return LMConfig.ela_gpt(vocab_size, d_model=budget.d_model, n_layers=budget.n_layers, n_heads=budget.n_heads,
                            max_seq_len=max(512, budget.seq_len), **over)


# ----------------------------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------------------------

def load_splits(data: Optional[str], budget: Budget):
    """(train documents, validation documents, description)."""
    from ..data.corpus import CorpusError, cap_documents, load_corpus, read_documents, split_documents

    try:
        if data is not None and Path(data).is_dir() and (Path(data) / "train.txt").is_file() \
                and (Path(data) / "valid.txt").is_file():
            train = read_documents(Path(data) / "train.txt", max_bytes=budget.max_train_bytes)
            val = read_documents(Path(data) / "valid.txt", max_bytes=budget.max_val_bytes)
            return train, val, f"{data}: train.txt / valid.txt"
        docs = load_corpus(data, max_bytes=None if data is not None else budget.max_train_bytes)
        if data is not None and budget.max_train_bytes is not None:
            docs = cap_documents(docs, budget.max_train_bytes + (budget.max_val_bytes or 0))
        train, val = split_documents(docs, 0.05)
        what = data if data is not None else "the embedded standard-library corpus"
        if budget.max_val_bytes is not None:
            val = cap_documents(val, budget.max_val_bytes)
        return train, val, f"{what} (hash split of the documents, 5% validation)"
    except CorpusError as e:
        raise ExperimentError(str(e)) from None


def prepare(exp: common.Experiment, budget: Budget, data: Optional[str]):
    from ..data.corpus import PackedTokens, token_fingerprint, tokenize_documents
    from ..data.tokenizer import load_tokenizer, train_tokenizer
    from ..training import TrainData

    train_docs, val_docs, desc = load_splits(data, budget)
    tok_path = exp.root / "tokenizer.json"
    if tok_path.is_file() and exp.args.resume:
        tokenizer = load_tokenizer(tok_path)
    else:
        tokenizer = train_tokenizer((d.text for d in train_docs), vocab_size=budget.vocab_size)
        tokenizer.save(tok_path)
    tr = tokenize_documents(train_docs, tokenizer)
    va = tokenize_documents(val_docs, tokenizer)
    train = PackedTokens(tr, budget.seq_len, name="the training data")
    train.check_trainable()
    val = PackedTokens(va, budget.seq_len, name="the validation data")
    fp = token_fingerprint(tr) + "/" + token_fingerprint(va)
    td = TrainData(tokenizer=tokenizer, train=train, val=val, fingerprint=fp, source=str(data or "stdlib"))
    info = {"description": desc, "train_bytes": sum(len(d.text.encode("utf-8")) for d in train_docs),
            "val_bytes": sum(len(d.text.encode("utf-8")) for d in val_docs), "train_tokens": int(tr.numel()),
            "val_tokens": int(va.numel()), "vocab_size": tokenizer.vocab_size, "fingerprint": fp}
    return td, info


# ----------------------------------------------------------------------------------------------
# One run
# ----------------------------------------------------------------------------------------------

def train_run(spec: Dict[str, Any], exp: common.Experiment, budget: Budget, data, device: str) -> Dict[str, Any]:
    from ..audit import check_causality
    from ..training import TrainConfig, evaluate, train

    key = spec["model"]
    mcfg = model_config(key, budget, data.tokenizer.vocab_size)
    cfg = TrainConfig(out=str(exp.root / "checkpoints" / key), seq_len=budget.seq_len,
                      batch_size=budget.batch_size, steps=budget.steps, lr=budget.lr, warmup=budget.warmup,
                      seed=spec["seed"], eval_every=budget.eval_every, eval_batches=budget.eval_batches,
                      log_every=max(1, budget.eval_every // 5), save_every=budget.eval_every,
                      keep_last=1, device=device, progress=exp.progress_enabled)
    import warnings

    with warnings.catch_warnings():   # the bidirectional lobe's warning: expected here, reported by the audit
        warnings.filterwarnings("ignore", message="memory_lobe='bidirectional'")
        res = train(cfg, mcfg, data=data, resume=bool(exp.args.resume), overwrite=not exp.args.resume)
    if res.interrupted:
        raise KeyboardInterrupt
    hist = res.history
    if exp.args.resume and res.resumed_from:
        from ..training import read_metrics
        hist = read_metrics(cfg.out)
    curve = [{"step": h["step"], "tokens": h["tokens"], "val_loss": h["val_loss"], "val_ppl": h["val_ppl"]}
             for h in hist if "val_loss" in h]
    train_curve = [{"step": h["step"], "loss": h["loss"]} for h in hist]
    final = evaluate(res.model, data.val, batch_size=budget.batch_size, max_batches=budget.eval_batches)
    audit = check_causality(res.model, seq_len=budget.audit_len, batch_size=1, atol=1e-7,
                            cuts=sorted({0, budget.audit_len // 4, budget.audit_len // 2, budget.audit_len - 2}))
    tps = [h["tokens_per_s"] for h in hist if "tokens_per_s" in h]
    return {"n_params": sum(p.numel() for p in res.model.parameters()),
            "n_params_non_embedding": res.model.num_parameters(exclude_embeddings=True),
            "steps": res.step, "tokens": res.step * budget.batch_size * budget.seq_len,
            "val_loss": final.loss, "val_ppl": final.ppl, "val_tokens": final.tokens,
            "tokens_per_s": res.tokens_per_s if res.tokens_per_s else (sorted(tps)[len(tps) // 2] if tps else None),
            "curve": curve, "train_curve": train_curve, "causal": bool(audit.ok),
            "audit_max_change": audit.max_diff, "train_s": res.elapsed_s}


# ----------------------------------------------------------------------------------------------
# Outputs
# ----------------------------------------------------------------------------------------------

def _extra_args(a) -> str:
    out = ""
    if list(a.models) != list(MODELS):
        out += " --models " + ",".join(a.models)
    if a.steps is not None:
        out += f" --steps {a.steps}"
    return out


def markdown(exp: common.Experiment, budget: Budget, runs, info) -> str:
    a = exp.args
    lines = [f"# lm ({a.budget})", ""] + [f"- {h}" for h in exp.header_lines(runs, _extra_args(a))]
    lines += [f"- data: {info['description']}; {info['train_tokens']:,} training tokens available, "
              f"{info['val_tokens']:,} validation tokens ({budget.eval_batches} windows x {budget.batch_size} "
              f"evaluated); byte-level BPE, vocabulary {info['vocab_size']}",
              f"- models: ELA-GPT skeleton (Hyper-Link, MoE 4 experts top-2), d {budget.d_model}, "
              f"{budget.n_layers} layers, {budget.n_heads} heads; {budget.steps} steps x {budget.batch_size} x "
              f"{budget.seq_len} tokens = {budget.steps * budget.batch_size * budget.seq_len:,} training tokens each, "
              f"same batches; AdamW lr {budget.lr:g}, warmup {budget.warmup}, cosine"
              + ("" if a.budget == "full" else f" — **reduced ({a.budget}) budget**"), ""]
    best_causal = min((r["val_ppl"] for r in runs if r["causal"]), default=None)
    rows = []
    for r in runs:
        label = MODELS[r["model"]][0]
        rows.append([label, f"{r['n_params']:,}", f"{r['tokens']:,}", fmt(r["val_loss"], 3), fmt(r["val_ppl"], 2),
                     fmt(r["tokens_per_s"], 0), "yes" if r["causal"] else f"**no** (leak {r['audit_max_change']:.2g})"])
    lines += [md_table(["model", "params", "train tokens", "val loss", "val ppl", "train tok/s", "causal (audit)"],
                       rows), ""]
    if best_causal is not None:
        lines.append(f"Lowest validation perplexity among causal models: {best_causal:.2f}. A model that fails the "
                     "causality audit sees later tokens; its perplexity is not a language model's.")
        lines.append("")
    # the curve table
    steps = sorted({c["step"] for r in runs for c in r["curve"]})
    crow = []
    for s in steps:
        row = [s]
        for r in runs:
            c = next((c for c in r["curve"] if c["step"] == s), None)
            row.append(fmt(c["val_ppl"], 1) if c else "-")
        crow.append(row)
    lines += ["Validation perplexity during training:", "",
              md_table(["step"] + [MODELS[r["model"]][0] for r in runs], crow), ""]
    return "\n".join(lines)


def plot(path: Path, runs, budget: Budget, title: str) -> None:
    series = []
    for r in runs:
        label, _, color = MODELS[r["model"]]
        series.append({"label": label, "x": [c["tokens"] for c in r["curve"]], "y": [c["val_ppl"] for c in r["curve"]],
                       "color": color, "linestyle": "-" if r["causal"] else ":", "marker": "o"})
    panels = [{"title": "validation perplexity", "xlabel": "training tokens", "ylabel": "perplexity", "logy": True,
               "series": series}]
    common.line_panels(path, panels, title=title, panel_size=(6.4, 4.0))


def plot_tps(path: Path, runs, title: str) -> None:
    common.bar_panel(path, ["training throughput"], {MODELS[r["model"]][0]: [r["tokens_per_s"]] for r in runs},
                     "tokens / s", title=title, size=(6.4, 3.2))


# ----------------------------------------------------------------------------------------------
# Entry points
# ----------------------------------------------------------------------------------------------

def _csv(choices: Sequence[str]):
    def parse(text: str) -> List[str]:
        items = [s.strip() for s in text.split(",") if s.strip()]
        bad = [s for s in items if s not in choices]
        if bad or not items:
            import argparse
            raise argparse.ArgumentTypeError(f"a comma-separated subset of {','.join(choices)}, got {text!r}")
        return list(dict.fromkeys(items))
    return parse


def add_arguments(p) -> None:
    common.add_common_arguments(p, NAME, "text file or folder (a folder with train.txt/valid.txt, e.g. "
                                         "../shared/data/wikitext-2, uses those splits); default: the embedded "
                                         "standard-library corpus", default_seed=0)
    p.add_argument("--models", type=_csv(list(MODELS)), default=list(MODELS),
                   help="comma-separated subset of " + ",".join(MODELS) + " (default all)")
    p.add_argument("--steps", type=int, default=None, help="training steps per model (default: the budget's)")


def run(args) -> int:
    budget = Budget(**asdict(BUDGETS[args.budget]))
    if args.steps is not None:
        if args.steps < 1:
            raise ExperimentError(f"--steps must be >= 1, got {args.steps}")
        budget.steps = args.steps
    budget.eval_every = min(budget.eval_every, budget.steps)
    budget.warmup = min(budget.warmup, max(0, budget.steps // 10))
    common.set_threads(args.threads)
    device = str(common.resolve_device(args.device))
    data_path = str(Path(args.data).resolve()) if args.data else None
    models = list(args.models)
    config = {"budget": args.budget, "seed": args.seed, "data": data_path, "models": models,
              "protocol": asdict(budget)}
    exp = common.Experiment(NAME, args, config)
    print(f"linattn experiment {NAME} --budget {args.budget}")
    for h in exp.header_lines():
        print("  " + h)
    t0 = time.perf_counter()
    data, info = prepare(exp, budget, data_path)
    print(f"  data: {info['description']}: {info['train_tokens']:,} training / {info['val_tokens']:,} validation "
          f"tokens, vocabulary {info['vocab_size']} ({time.perf_counter() - t0:.0f} s)")
    if args.budget != "full":
        print(f"  reduced protocol ({args.budget}): d {budget.d_model}, {budget.steps} steps x {budget.batch_size} x "
              f"{budget.seq_len} tokens per model")
    plan = [{"run_id": k, "model": k, "seed": args.seed} for k in models]
    runs = exp.run_all(plan, lambda spec: train_run(spec, exp, budget, data, device))
    md = markdown(exp, budget, runs, info)
    title = (f"lm ({args.budget}): d {budget.d_model}, {budget.n_layers} layers, "
             f"{budget.steps * budget.batch_size * budget.seq_len:,} tokens per model; dotted = not causal")
    paths = exp.write_outputs({"data": info, "models": {r["model"]: {k: r[k] for k in (
        "n_params", "tokens", "val_loss", "val_ppl", "tokens_per_s", "causal")} for r in runs}}, runs, md,
        {"lm": lambda p: plot(p, runs, budget, title), "lm_tokens_per_s": lambda p: plot_tps(p, runs, title)})
    print()
    print(md)
    print(f"\nwrote {', '.join(str(p) for p in paths.values())}")
    return 0
