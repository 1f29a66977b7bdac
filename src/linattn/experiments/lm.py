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
    comba ... path     the rest of the family, with their layers' defaults

Every model trains on the same batches (same seed, same number of tokens) with `linattn.training`
(AdamW, warmup then cosine, gradient clipping), validation loss/perplexity on the same held-out
windows; training tokens/s is measured on this machine during training. `--seeds N` trains every
model with seeds seed, seed+1, ..., seed+N-1 (run ids `<model>--s<seed>`; within a seed every
model sees the same batches): the tables give mean ± std over the seeds and each seed's value, and
for the pairs of models compared (softmax vs the ELA kernels, EFLA vs DeltaNet, the causal lobe)
the per-seed differences and whether their mean exceeds their spread.

Data (`--data`): a text file or folder; a folder with train.txt and valid.txt (WikiText-2 as in
../shared/data/wikitext-2) uses them as the training and validation splits; no --data: the
embedded standard-library corpus (`linattn.data.corpus`). A byte-level BPE tokenizer is trained
on the training split (saved in the results folder, reused on --resume).

Budgets: full = the ELA-GPT size (d 256, 4 layers, 4 heads), 256-token windows, batch 16, 3000 steps;
quick = d 128 (same layout), 128-token windows, batch 8, 400 steps (about 410k tokens per model;
per model and seed on one thread about 1-2 minutes for softmax, ELA, DeltaNet and EFLA, up to ~11
minutes for MesaNet, TTT-MLP and Titans).

Other experiments (`ela-ablations`, `efla-variants`, `tlinformer`) are a `Study` of this module:
their own models, budgets and comparisons, trained, tabulated and plotted by `run_study`.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

from . import common
from .common import ExperimentError, fmt, fmt_pm, md_table

NAME = "lm"
DESCRIPTION = __doc__


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


class Model(NamedTuple):
    """One model of an experiment. build(budget, vocab_size) returns its config, of any model family
    (`LMConfig`, `TLinFormerConfig`, ...); label is a string or a function of the budget (names
    that carry the budget's sizes, e.g. "TLinFormer 256-128-0.5")."""
    label: Union[str, Callable[[Budget], str]]
    build: Callable[[Budget, int], Any]
    color: str


def ela_gpt(**overrides) -> Callable[[Budget, int], Any]:
    """A builder: `LMConfig.ela_gpt` at the budget's width, depth and heads, with `overrides`."""
    def build(budget: Budget, vocab_size: int):
        from ..models import LMConfig

        return LMConfig.ela_gpt(vocab_size, d_model=budget.d_model, n_layers=budget.n_layers,
                                n_heads=budget.n_heads, max_seq_len=max(512, budget.seq_len), **overrides)
    return build


MODELS: Dict[str, Model] = {
    "softmax": Model("softmax GPT", ela_gpt(mixer="softmax"), "k"),
    "ela-hadamard": Model("ELA-GPT (Hadamard Exp)", ela_gpt(mixer="ela-hadamard_exp"), "C0"),
    "ela-sum-sq": Model("ELA-GPT (sum sq. Euclid)", ela_gpt(mixer="ela-sum_sq_euclid"), "C2"),
    "deltanet": Model("DeltaNet", ela_gpt(mixer="deltanet"), "C1"),
    "efla": Model("EFLA", ela_gpt(mixer="efla"), "C3"),
    "ela-lobe-causal": Model("ELA-GPT + lobe (causal)", ela_gpt(mixer="ela-hadamard_exp", memory_lobe="causal"),
                             "C4"),
    "ela-lobe-bidir": Model("ELA-GPT + lobe (bidirectional, leaks)",
                            ela_gpt(mixer="ela-hadamard_exp", memory_lobe="bidirectional", allow_future_leak=True),
                            "C5"),
    # the delta-rule variants and the test-time regression / training mixers (4 heads of 32)
    "comba": Model("Comba", ela_gpt(mixer="comba"), "C6"),
    "delta-product": Model("DeltaProduct (n=2)", ela_gpt(mixer="delta-product"), "C7"),
    "kda": Model("KDA", ela_gpt(mixer="kda"), "C8"),
    "mesanet": Model("MesaNet", ela_gpt(mixer="mesanet"), "C9"),
    "ttt-linear": Model("TTT-Linear", ela_gpt(mixer="ttt-linear"), "saddlebrown"),   # C8 is olive already
    "ttt-mlp": Model("TTT-MLP", ela_gpt(mixer="ttt-mlp"), "navy"),
    "titans": Model("Titans", ela_gpt(mixer="titans"), "teal"),
    # softmax attention fed back by linear attention (4 heads of 32)
    "fox": Model("FoX", ela_gpt(mixer="fox"), "magenta"),
    "deltaformer": Model("DeltaFormer", ela_gpt(mixer="deltaformer"), "goldenrod"),
    "path": Model("PaTH", ela_gpt(mixer="path"), "lime"),
}

# (a, b): the summary gives the per-seed differences a - b of the final validation perplexity
COMPARISONS: List[Tuple[str, str]] = [("ela-hadamard", "softmax"), ("ela-sum-sq", "softmax"), ("efla", "deltanet"),
                                      ("ela-lobe-causal", "ela-hadamard")]


def label_of(model: Model, budget: Budget) -> str:
    return model.label(budget) if callable(model.label) else model.label


@dataclass
class Study:
    """An experiment of this module's kind: models trained on the same data and batches, then compared.

    budget_help: the advertised budgets ({name: help}; "tiny" is always accepted, for the tests).
    skeleton(budget): the markdown's one-line description of the models.
    comparisons: pairs (a, b) of model keys; the summary gives the per-seed differences a - b.
    doc_boundaries: False runs windows across documents, for every model (needed by a model that
        cannot keep packed documents apart, such as TLinFormer, so that its baseline does the same).
    notes(budget, groups): markdown lines after the tables (the paper's numbers, caveats); groups is
        {model: its finished runs in seed order}.
    """
    name: str
    models: Dict[str, Model]
    budgets: Dict[str, Budget]
    skeleton: Callable[[Budget], str]
    budget_help: Optional[Dict[str, str]] = None
    comparisons: Sequence[Tuple[str, str]] = ()
    seeds: int = 1
    doc_boundaries: bool = True
    notes: Optional[Callable[[Budget, Dict[str, List[Dict[str, Any]]]], List[str]]] = None


def ela_skeleton(budget: Budget) -> str:
    return (f"ELA-GPT skeleton (Hyper-Link, MoE 4 experts top-2, tied head, no final norm), d {budget.d_model}, "
            f"{budget.n_layers} layers, {budget.n_heads} heads")


def _lm_notes(budget: Budget, groups: Dict[str, List[Dict[str, Any]]]) -> List[str]:
    causal = [common.mean_std(r["val_ppl"] for r in rs)[0] for rs in groups.values() if all(r["causal"] for r in rs)]
    causal = [p for p in causal if p is not None]
    if not causal:
        return []
    return [f"Lowest mean validation perplexity among causal models: {min(causal):.2f}. A model that fails the "
            "causality audit sees later tokens; its perplexity is not a language model's."]


LM = Study(NAME, MODELS, BUDGETS, ela_skeleton, comparisons=COMPARISONS, notes=_lm_notes)


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

def train_run(spec: Dict[str, Any], exp: common.Experiment, study: Study, budget: Budget, data,
              device: str) -> Dict[str, Any]:
    from ..audit import check_causality
    from ..training import TrainConfig, evaluate, train

    mcfg = study.models[spec["model"]].build(budget, data.tokenizer.vocab_size)
    cfg = TrainConfig(out=str(exp.root / "checkpoints" / spec["run_id"]), seq_len=budget.seq_len,
                      batch_size=budget.batch_size, steps=budget.steps, lr=budget.lr, warmup=budget.warmup,
                      seed=spec["seed"], eval_every=budget.eval_every, eval_batches=budget.eval_batches,
                      log_every=max(1, budget.eval_every // 5), save_every=budget.eval_every,
                      keep_last=1, device=device, progress=exp.progress_enabled, doc_boundaries=study.doc_boundaries)
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
    return {"arch": type(mcfg).__name__, "vocab_size": mcfg.vocab_size,
            "n_params": sum(p.numel() for p in res.model.parameters()),
            "n_params_non_embedding": res.model.num_parameters(exclude_embeddings=True),
            "steps": res.step, "tokens": res.step * budget.batch_size * budget.seq_len,
            "val_loss": final.loss, "val_ppl": final.ppl, "val_tokens": final.tokens,
            "tokens_per_s": res.tokens_per_s if res.tokens_per_s else (sorted(tps)[len(tps) // 2] if tps else None),
            "curve": curve, "train_curve": train_curve, "causal": bool(audit.ok),
            "audit_max_change": audit.max_diff, "train_s": res.elapsed_s}


# ----------------------------------------------------------------------------------------------
# Seeds and comparisons
# ----------------------------------------------------------------------------------------------

def by_model(runs: List[Dict[str, Any]]) -> Dict[str, List[Dict[str, Any]]]:
    """{model: its runs in seed order}, models in the order they first appear."""
    out: Dict[str, List[Dict[str, Any]]] = {}
    for r in runs:
        out.setdefault(r["model"], []).append(r)
    for rs in out.values():
        rs.sort(key=lambda r: r["seed"])
    return out


def compare(groups: Dict[str, List[Dict[str, Any]]], comparisons: Sequence[Tuple[str, str]]) -> List[Dict[str, Any]]:
    """The declared comparisons whose two models both ran: `common.paired_difference` of the final
    validation perplexities, a - b, over the seeds both have."""
    out = []
    for a, b in comparisons:
        if a in groups and b in groups:
            pa = {r["seed"]: r["val_ppl"] for r in groups[a]}
            pb = {r["seed"]: r["val_ppl"] for r in groups[b]}
            seeds = sorted(set(pa) & set(pb))
            out.append(dict(common.paired_difference([pa[s] for s in seeds], [pb[s] for s in seeds]),
                            a=a, b=b, seeds=seeds))
    return out


def mean_curve(rs: List[Dict[str, Any]]):
    """(steps, mean val ppl, std) over the seeds, at the evaluation steps every seed has."""
    steps = sorted(set.intersection(*({c["step"] for c in r["curve"]} for r in rs)))
    at = [{c["step"]: c["val_ppl"] for c in r["curve"]} for r in rs]
    stats = [common.mean_std(v[s] for v in at) for s in steps]
    return steps, [m for m, _, _ in stats], [s if n > 1 else None for _, s, n in stats]


# ----------------------------------------------------------------------------------------------
# Outputs
# ----------------------------------------------------------------------------------------------

def _extra_args(study: Study, a) -> str:
    out = ""
    if list(a.models) != list(study.models):
        out += " --models " + ",".join(a.models)
    if a.steps is not None:
        out += f" --steps {a.steps}"
    return out + f" --seeds {a.seeds}"


def markdown(exp: common.Experiment, study: Study, budget: Budget, runs, info, planned: int) -> str:
    a = exp.args
    groups = by_model(runs)
    seeds = sorted({r["seed"] for r in runs})
    each = " / ".join(f"s{s}" for s in seeds)

    def name(key: str) -> str:
        return label_of(study.models[key], budget)

    lines = [f"# {study.name} ({a.budget})", ""] + exp.incomplete_note(runs, planned)
    lines += [f"- {h}" for h in exp.header_lines(runs, _extra_args(study, a))]
    lines += [f"- data: {info['description']}; {info['train_tokens']:,} training tokens available, "
              f"{info['val_tokens']:,} validation tokens ({budget.eval_batches} windows x {budget.batch_size} "
              f"evaluated); byte-level BPE, vocabulary {info['vocab_size']}",
              f"- models: {study.skeleton(budget)}; {budget.steps} steps x {budget.batch_size} x {budget.seq_len} "
              f"tokens = {budget.steps * budget.batch_size * budget.seq_len:,} training tokens each, the same batches "
              f"for every model of a seed; AdamW lr {budget.lr:g}, warmup {budget.warmup}, cosine"
              + ("" if study.doc_boundaries else "; windows run across documents (no document boundaries)")
              + ("" if a.budget == "full" else f" — **reduced ({a.budget}) budget**"),
              f"- seeds: {', '.join(map(str, seeds))} ({len(seeds)}); values are mean ± std over the seeds "
              f"(sample std), then each seed's ({each})", ""]
    rows = []
    for k, rs in groups.items():
        loss, ppl, tps = (common.mean_std(r[f] for r in rs) for f in ("val_loss", "val_ppl", "tokens_per_s"))
        bad = [r for r in rs if not r["causal"]]
        causal = "yes" if not bad else f"**no** (leak {max(r['audit_max_change'] for r in bad):.2g})"
        rows.append([name(k), f"{rs[0]['n_params']:,}", f"{rs[0]['tokens']:,}", fmt_pm(*loss, 3),
                     fmt_pm(*ppl, 2), " / ".join(fmt(r["val_ppl"], 2) for r in rs), fmt(tps[0], 0), causal])
    lines += [md_table(["model", "params", "train tokens", "val loss", "val ppl", f"val ppl per seed ({each})",
                        "train tok/s", "causal (audit)"], rows, align="lrrrrrrl"), ""]
    comps = compare(groups, study.comparisons)
    if comps:
        crow = []
        for c in comps:
            pa, pb = (common.mean_std(r["val_ppl"] for r in groups[k]) for k in (c["a"], c["b"]))
            crow.append([f"{name(c['a'])} vs {name(c['b'])}", fmt_pm(*pa, 2), fmt_pm(*pb, 2),
                         " / ".join(f"{x:+.2f}" for x in c["diffs"]), fmt(c["bound"], 2),
                         common.describe_difference(c, f"{name(c['b'])} lower", f"{name(c['a'])} lower", 2)])
        lines += ["Comparisons (a vs b), paired by seed: d = val ppl(a) − val ppl(b) in each seed (negative: a is "
                  "lower, better). A difference exceeds the spread when |mean d| > 2·std(d)/√n with n ≥ 2 seeds (a "
                  "rough criterion with 2-5 seeds: chance meets it more often than 5% of the time).", "",
                  md_table(["a vs b", "a: val ppl", "b: val ppl", f"d per seed ({each})", "2·std/√n",
                            "mean d ± std (+ in k of n seeds): verdict"], crow, align="lrrrrl"), ""]
    steps = sorted({c["step"] for r in runs for c in r["curve"]})
    crow = []
    for s in steps:
        row = [s]
        for rs in groups.values():
            vals = [next((c["val_ppl"] for c in r["curve"] if c["step"] == s), None) for r in rs]
            row.append(" / ".join(fmt(v, 1) for v in vals))
        crow.append(row)
    lines += [f"Validation perplexity during training (each seed: {each}):", "",
              md_table(["step"] + [name(k) for k in groups], crow), ""]
    if study.notes is not None:
        lines += study.notes(budget, groups) + [""]
    return "\n".join(lines)


def plot(path: Path, study: Study, budget: Budget, runs, title: str) -> None:
    series = []
    for k, rs in by_model(runs).items():
        m = study.models[k]
        steps, mean, std = mean_curve(rs)
        series.append({"label": label_of(m, budget), "x": steps, "y": mean, "err": std, "color": m.color,
                       "linestyle": "-" if all(r["causal"] for r in rs) else ":", "marker": "o"})
    panels = [{"title": "validation perplexity (mean over seeds, band ± std)",
               "xlabel": f"training step ({budget.batch_size} x {budget.seq_len} tokens each)",
               "ylabel": "perplexity", "logy": True, "series": series}]
    common.line_panels(path, panels, title=title, panel_size=(6.4, 4.0))


def plot_tps(path: Path, study: Study, budget: Budget, runs, title: str) -> None:
    common.bar_panel(path, ["training throughput"],
                     {label_of(study.models[k], budget): [common.mean_std(r["tokens_per_s"] for r in rs)[0]]
                      for k, rs in by_model(runs).items()}, "tokens / s", title=title, size=(6.4, 3.2))


def summary(study: Study, budget: Budget, runs, info) -> Dict[str, Any]:
    groups = by_model(runs)
    models = {}
    for k, rs in groups.items():
        m = {"label": label_of(study.models[k], budget), "n_params": rs[0]["n_params"], "tokens": rs[0]["tokens"],
             "causal": all(r["causal"] for r in rs), "seeds": [r["seed"] for r in rs]}
        for f in ("val_loss", "val_ppl", "tokens_per_s"):
            mean, std, n = common.mean_std(r[f] for r in rs)
            m.update({f: mean, f + "_std": std, f + "_per_seed": [r[f] for r in rs]})
        models[k] = m
    return {"data": info, "models": models, "comparisons": compare(groups, study.comparisons)}


# ----------------------------------------------------------------------------------------------
# Entry points
# ----------------------------------------------------------------------------------------------

def add_study_arguments(p, study: Study) -> None:
    common.add_common_arguments(p, study.name, "text file or folder (a folder with train.txt/valid.txt, e.g. "
                                               "../shared/data/wikitext-2, uses those splits); default: the "
                                               "embedded standard-library corpus", default_seed=0,
                                budgets=study.budget_help)
    p.add_argument("--models", type=common.subset_of(list(study.models)), default=list(study.models),
                   help="comma-separated subset of " + ",".join(study.models) + " (default all)")
    p.add_argument("--steps", type=int, default=None, help="training steps per model (default: the budget's)")
    p.add_argument("--seeds", type=int, default=study.seeds,
                   help=f"seeds per model: seed, seed+1, ... (default {study.seeds})")


def run_study(study: Study, args) -> int:
    budget = Budget(**asdict(study.budgets[args.budget]))
    if args.steps is not None:
        if args.steps < 1:
            raise ExperimentError(f"--steps must be >= 1, got {args.steps}")
        budget.steps = args.steps
    if args.seeds < 1:
        raise ExperimentError(f"--seeds must be >= 1, got {args.seeds}")
    budget.eval_every = min(budget.eval_every, budget.steps)
    budget.warmup = min(budget.warmup, max(0, budget.steps // 10))
    common.set_threads(args.threads)
    device = str(common.resolve_device(args.device, common.ExperimentError))
    data_path = str(Path(args.data).resolve()) if args.data else None
    models = list(args.models)
    seeds = [args.seed + i for i in range(args.seeds)]
    # the folder's identity: the data and the protocol; --models and --seed(s) choose runs (a resume may add some)
    config = {"budget": args.budget, "data": data_path, "protocol": asdict(budget)}
    exp = common.Experiment(study.name, args, config)
    print(f"linattn experiment {study.name} --budget {args.budget}")
    for h in exp.header_lines():
        print("  " + h)
    t0 = time.perf_counter()
    data, info = prepare(exp, budget, data_path)
    print(f"  data: {info['description']}: {info['train_tokens']:,} training / {info['val_tokens']:,} validation "
          f"tokens, vocabulary {info['vocab_size']} ({time.perf_counter() - t0:.0f} s)")
    if args.budget != "full":
        print(f"  reduced protocol ({args.budget}): d {budget.d_model}, {budget.steps} steps x {budget.batch_size} x "
              f"{budget.seq_len} tokens per model, {len(seeds)} seed(s)")
    # seed by seed, so that an interrupted experiment holds whole seeds
    plan = [{"run_id": f"{k}--s{s}", "model": k, "seed": s} for s in seeds for k in models]
    runs = exp.run_all(plan, lambda spec: train_run(spec, exp, study, budget, data, device))
    md = markdown(exp, study, budget, runs, info, len(plan))
    title = (f"{study.name} ({args.budget}): d {budget.d_model}, {budget.n_layers} layers, "
             f"{budget.steps * budget.batch_size * budget.seq_len:,} tokens per model, {len(seeds)} seed(s)"
             + ("" if all(r["causal"] for r in runs) else "; dotted = not causal"))
    paths = exp.write_outputs(summary(study, budget, runs, info), runs, md,
                              {study.name: lambda p: plot(p, study, budget, runs, title),
                               f"{study.name}_tokens_per_s": lambda p: plot_tps(p, study, budget, runs, title)})
    print()
    print(md)
    print(f"\nwrote {', '.join(str(p) for p in paths.values())}")
    return 0


def add_arguments(p) -> None:
    add_study_arguments(p, LM)


def run(args) -> int:
    return run_study(LM, args)
