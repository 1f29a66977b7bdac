"""`linattn bench hf`: transformers' linear-attention models on their own PyTorch fallbacks vs after
`linattn.hf.kernelize`, one real-sized mixer layer of each kind in a small causal LM, and one whole 530M model
(random weights, batch 1, fp32): prefill at --T (the last position's logits, as generation's prefill), decode
(--decode-tokens consecutive tokens after a --decode-context prompt, per token), one training step (forward +
backward) at --train-T, per --threads; prefill peak memory; patched vs unpatched in one run (interleaved repeats,
median), two copies of one model that share its parameters (one set of weights and of a training step's gradients
in memory). Both sides decode from one prompt cache (transformers' own objects, made once by the patched model's
prefill, deep-copied before each timed call): the unpatched prefill of a long prompt is not what the decode rows
time, and on a slow fallback it bounded the run.

Kinds (--kinds): gdn = a Qwen3.5-0.8B-like Gated DeltaNet layer (Qwen3_5ForCausalLM: hidden 1024, 16 key heads
x 128, 32 value heads x 128, conv 4); kda = a Kimi-Linear-like KDA layer (KimiLinearForCausalLM: hidden 2304,
32 heads x 128) then Kimi Linear's MLA layer (32 heads, latent 512) with an MoE feed-forward (8 experts of 1024,
top 2, one shared); mamba2 = a Mamba2 layer (Mamba2ForCausalLM: hidden 1024, 32 heads x 64, state 128, 1 group);
lightning = MiniMax's lightning attention (MiniMaxForCausalLM: hidden 2048, 16 heads x 128, block 256, a MoE
feed-forward of 2 experts, top 1, and a full-attention second layer of the same heads); bamba = a Mamba2 hybrid
(BambaForCausalLM: the mamba2 kind's layer, then a minimal softmax layer); granite = Granite-4.0-H
(GraniteMoeHybridForCausalLM: as bamba, the shared MLP dense, its multipliers); nemotron_h = Nemotron-H
(NemotronHForCausalLM: the mamba2 kind's layer, a MoE block of 8 relu^2 experts of hidden / 2, top 2, a shared
one, a minimal softmax block, a relu^2 MLP block); qwen3.5-530m = a whole model, the one `linattn bench infer
--shape qwen3.5-530m` builds from its shape registry (Qwen3_5ForCausalLM: hidden 1024, 24 layers of 3 Gated
DeltaNet : 1 gated softmax attention, Qwen3.5-0.8B's head layout, intermediate 3584, its own vocabulary of 32000
and a tied head; --quick: the registry's tiny shape).
The MLP (intermediate 2 x hidden), the embeddings and the head (vocab --vocab-size) are the same on both sides.
gdn and bamba models have a second layer, a minimal softmax one (1 head; transformers 5.24 cannot build the
causal mask of a cached model without any attention layer), the same on both sides too.
KDA's unpatched training step (transformers' PyTorch chunk code) takes minutes at T = 2048 on 2 cores: its row
runs at --kda-train-T (default 512), and the table says so.
The qwen3.5-530m kind runs at lengths of its own, sized for a 2-core machine: prefill at --530m-T (default 512
2048), decode after a --530m-decode-context prompt (512), a training step at --530m-train-T (256); every row's
target is >= 1x (its MLPs, projections and head, the same calls on both sides, are most of its time). Memory: the
run's peak resident set with this kind is 6.4 GiB (7.7 GiB with --530m-train-T 512: the unpatched step's
activations); time: 9 minutes at 1 thread and 14 at 2 (--repeats 2 --no-memory, on the 2-core machine at
load 6-8, 2026-11-29; quiet, less).
--cases: which of prefill, decode, train to time (default all; each row is logged with its numbers as it is
measured, so a long run cut short keeps what it made).
--load N: N busy-loop processes (at this process's priority) for the whole run, as on a shared machine; the load
averages at the start and the end are in the output.
Targets: prefill >= 2x faster at T = 2048 and 8192, a training step >= 3x at 2048, every other row not
slower (>= 1x), prefill peak memory at T = 8192 <= 0.5x the unpatched model's; the table says which are met.
--quick: tiny sizes (hidden 64), for the tests.
"""
from __future__ import annotations

import copy
import gc
import importlib.util
import signal
import sys
from typing import Any, Callable, Dict, List, Optional

import torch

from ..cli_support import UsageError, int_at_least
from ..io import atomic_write_text, write_json
from . import common

DESCRIPTION = __doc__
PROG = "linattn bench hf"
KINDS = ("gdn", "kda", "mamba2", "lightning", "bamba", "granite", "nemotron_h", "qwen3.5-530m")
#: the kind that is a whole model (bench infer's shape), timed at lengths of its own (--530m-*)
MODEL_KIND = "qwen3.5-530m"
CASES = ("prefill", "decode", "train")


def add_arguments(p) -> None:
    """The options of `linattn bench hf`.

    Args:
        p: The argparse parser to add them to.
    """
    p.add_argument("--kinds", default=",".join(KINDS), help=f"comma list of {', '.join(KINDS)} (default: all)")
    p.add_argument("--T", type=int, nargs="+", default=[512, 2048, 8192], help="prefill lengths (default 512 "
                   "2048 8192)")
    p.add_argument("--cases", default=",".join(CASES), help=f"comma list of {', '.join(CASES)} (default: all)")
    p.add_argument("--decode-context", type=int, default=2048, help="prompt before the timed decode tokens "
                   "(default 2048)")
    p.add_argument("--decode-tokens", type=int_at_least(1), default=8, help="consecutive tokens of a timed "
                   "decode, reported per token (default 8)")
    p.add_argument("--train-T", type=int, default=2048, help="length of the training step (default 2048)")
    p.add_argument("--kda-train-T", type=int, default=512, help="length of the kda kind's training step (default "
                   "512: the unpatched step takes minutes at 2048)")
    p.add_argument("--530m-T", dest="m530_T", metavar="T", type=int, nargs="+", default=[512, 2048],
                   help="the qwen3.5-530m kind's prefill lengths (default 512 2048)")
    p.add_argument("--530m-decode-context", dest="m530_decode_context", metavar="T", type=int, default=512,
                   help="the qwen3.5-530m kind's prompt before its timed decode tokens (default 512)")
    p.add_argument("--530m-train-T", dest="m530_train_T", metavar="T", type=int, default=256,
                   help="the qwen3.5-530m kind's training-step length (default 256: at 512 the unpatched step's "
                        "activations take the run's peak resident set to 7.7 GiB)")
    p.add_argument("--load", type=int_at_least(0), default=0, help="busy-loop processes held for the whole run "
                   "(default 0)")
    p.add_argument("--threads", type=int_at_least(1), nargs="+", default=[1, 2],
                   help="torch.set_num_threads values, each a separate pass (default 1 2)")
    p.add_argument("--repeats", type=int_at_least(1), default=3, help="timed calls per case (default 3)")
    p.add_argument("--vocab-size", type=int_at_least(2), default=1024, help="(default 1024)")
    p.add_argument("--no-memory", action="store_true", help="skip the prefill peak-memory measurement")
    p.add_argument("--quick", action="store_true", help="tiny sizes (hidden 64, T 32/64), for the tests")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights and tokens (default 0)")
    p.add_argument("--out", default=None, help="output folder (default results/bench/hf/)")
    p.add_argument("--overwrite", action="store_true", help="replace existing output files")
    p.add_argument("--quiet", action="store_true", help="no per-case progress on stderr")


# ------------------------------------------------------------------------------------------------------------
# Models
# ------------------------------------------------------------------------------------------------------------

def build_model(kind: str, quick: bool, vocab_size: int, seed: int = 0) -> torch.nn.Module:
    """A causal LM of `kind` with random weights (fp32, eval mode): see linattn.hf.bench_models."""
    from ..hf.bench_models import build_model as build  # only linattn.hf imports transformers

    return build(kind, quick, vocab_size, seed)


def pair(kind: str, quick: bool, vocab_size: int, seed: int = 0):
    """(unpatched, patched) copies of one model."""
    from ..hf.bench_models import pair as make_pair

    return make_pair(kind, quick, vocab_size, seed)


def _ids(T: int, vocab_size: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab_size, (1, T), generator=torch.Generator().manual_seed(seed))


def _pos(start: int, T: int) -> torch.Tensor:
    # explicit positions: transformers cannot count a cache's length when it holds only linear-attention layers
    return torch.arange(start, start + T)[None]


def prefill_fn(model, ids) -> Callable[[], Any]:
    def run():
        with torch.no_grad():
            # (the last position's logits only, as generation's prefill: the 530M model's 32k-vocabulary head
            # over the whole prompt is not prompt processing)
            return model(ids, position_ids=_pos(0, ids.shape[1]), use_cache=True, logits_to_keep=1).logits[:, -1]
    return run


def train_fn(model, ids) -> Callable[[], Any]:
    def run():
        model.zero_grad(set_to_none=True)
        model(ids, labels=ids, use_cache=False).loss.backward()
    return run


def prompt_cache(model, ids):
    """The cache of a prefill of ids (untimed)."""
    with torch.no_grad():
        out = model(ids, position_ids=_pos(0, ids.shape[1]), use_cache=True)
    return out.cache if hasattr(out, "cache") else out.past_key_values


def decode_maker(model, ids, n: int = 1, cache=None) -> Callable[[], Callable[[], Any]]:
    """A timed call of n single-token steps, each at its own position, as generation makes them, on a fresh cache
    of all but the last n tokens: a deep copy of `cache` when given (the prompt's cache made once), else a prefill
    by the model (untimed)."""
    def make():
        T0 = ids.shape[1] - n
        c = copy.deepcopy(cache) if cache is not None else prompt_cache(model, ids[:, :T0])

        def steps():
            with torch.no_grad():
                for t in range(T0, T0 + n):
                    logits = model(ids[:, t:t + 1], position_ids=_pos(t, 1), cache=c, use_cache=True).logits
            return logits
        return steps
    return make


def memory_case(kind: str, quick: bool, vocab_size: int, T: int, patched: bool, seed: int = 0):
    """Builder for common.measure_memory (run in its worker process): one prefill of T tokens."""
    from ..hf.kernelize import kernelize, torch_fallbacks

    torch.set_num_threads(1)
    with torch_fallbacks():  # imports the modeling files now, outside the measured call
        model = build_model(kind, quick, vocab_size, seed)
    if patched:
        kernelize(model)
    run = prefill_fn(model, _ids(T, model.config.vocab_size, seed))

    def run_on_torch_kernels():
        with torch_fallbacks():
            return run()
    return run_on_torch_kernels


# ------------------------------------------------------------------------------------------------------------
# Run
# ------------------------------------------------------------------------------------------------------------

TARGETS = {("prefill", 2048): 2.0, ("prefill", 8192): 2.0, ("train", 2048): 3.0}


def _target(kind: str, case: str, T: int) -> float:
    # every other row, and every row of the whole model (its MLPs and head, the same calls on both sides, are most
    # of its time): not slower
    return 1.0 if kind == MODEL_KIND else TARGETS.get((case, T), 1.0)


def _lengths(args, kind: str):
    """(prefill lengths, decode context, training length) of `kind`."""
    if kind == MODEL_KIND:
        return args.m530_T, args.m530_decode_context, args.m530_train_T
    return args.T, args.decode_context, args.kda_train_T if kind == "kda" else args.train_T


def _peak_rss_bytes() -> Optional[int]:
    """This process's peak resident set so far (None where the platform does not say)."""
    try:
        import resource
    except ImportError:   # pragma: no cover - not a Unix
        return None
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kib * (1 if sys.platform == "darwin" else 1024)   # (macOS counts bytes, Linux KiB)


def run(args) -> int:
    """Run the `linattn bench hf` benchmark (module docstring).

    The unpatched side runs transformers' PyTorch fallbacks, also where fla is installed (its kernels are
    Triton-only): `linattn.hf.kernelize.torch_fallbacks`.

    Args:
        args: The options parsed with `add_arguments` (`linattn bench hf --help` lists them).

    Returns:
        The exit code (0: success).

    Raises:
        UsageError: Bad options.
    """
    if importlib.util.find_spec("transformers") is None:
        return _run(args)  # which says what is missing
    from ..hf.kernelize import torch_fallbacks
    from .threads import busy_start, busy_stop

    # (a SIGTERM ends the run through the finally below, which stops the busy loops: they would outlive it)
    old = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143)) if args.load else None
    busy = [busy_start() for _ in range(args.load)]
    try:
        with torch_fallbacks():
            return _run(args)
    finally:
        for p in busy:
            busy_stop(p)
        if old is not None:
            signal.signal(signal.SIGTERM, old)


def _time_kind(args, kind: str, wanted: List[str], log, rows: List[Dict[str, Any]],
               skipped: List[Dict[str, str]]) -> None:
    """Every timed row of one kind (its models live only in this call: the next kind's are built after they are
    freed)."""
    ref, fast = pair(kind, args.quick, args.vocab_size, args.seed)
    models = {"unpatched": ref, "patched": fast}
    vocab = ref.config.vocab_size
    prefill_T, decode_context, train_T = _lengths(args, kind)
    for threads in args.threads:
        torch.set_num_threads(threads)
        cases = [("prefill", T) for T in prefill_T] + [("decode", decode_context), ("train", train_T)]
        for case, T in [(case, T) for case, T in cases if case in wanted]:
            log(f"[{kind}] {case} T={T} threads={threads}")
            n = args.decode_tokens if case == "decode" else 1
            ids = _ids(T + (n if case == "decode" else 0), vocab, args.seed)
            if case == "prefill":
                makers = [lambda m=m: prefill_fn(m, ids) for m in models.values()]
            elif case == "train":
                makers = [lambda m=m: train_fn(m, ids) for m in models.values()]
            else:   # both sides decode from one prompt cache, the patched model's (transformers' own objects)
                cache = prompt_cache(fast, ids[:, :T])
                makers = [decode_maker(m, ids, n, cache) for m in models.values()]
            res = common.time_interleaved(makers, warmup=1, repeats=args.repeats, min_time_s=0.0,
                                          max_repeats=args.repeats, budget_s=None)
            if case == "train":   # (the shared gradients: not held through the next rows)
                ref.zero_grad(set_to_none=True)
            row: Dict[str, Any] = {"kind": kind, "case": case, "T": T, "threads": threads}
            for side, r in zip(models, res):
                if isinstance(r, Exception):
                    skipped.append({"kind": kind, "case": f"{case} T={T} {side}",
                                    "reason": f"{type(r).__name__}: {r}"})
                    row[f"{side}_ms"] = None
                else:   # (decode: per token)
                    row[f"{side}_ms"] = r.median_ms / n
                    row[f"{side}_iqr_ms"] = [r.q1_ms / n, r.q3_ms / n]
            if row["unpatched_ms"] and row["patched_ms"]:
                row["speedup"] = row["unpatched_ms"] / row["patched_ms"]
                row["target"] = _target(kind, case, T)
                row["met"] = bool(row["speedup"] >= row["target"])
                # each row as it is measured: a long run cut short keeps the rows it made
                log(f"[{kind}] {case} T={T} threads={threads}: unpatched {row['unpatched_ms']:.1f} ms, "
                    f"patched {row['patched_ms']:.1f} ms, {row['speedup']:.2f}x")
            rows.append(row)
    peak = _peak_rss_bytes()
    if peak is not None:
        log(f"[{kind}] peak resident set of the run so far: {common.fmt_bytes(peak)} MiB")


def _run(args) -> int:
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    bad = [k for k in kinds if k not in KINDS]
    if bad or not kinds:
        raise UsageError(f"--kinds: unknown {bad or args.kinds!r}; choose from {', '.join(KINDS)}", prog=PROG)
    wanted = [c.strip() for c in args.cases.split(",") if c.strip()]
    bad = [c for c in wanted if c not in CASES]
    if bad or not wanted:
        raise UsageError(f"--cases: unknown {bad or args.cases!r}; choose from {', '.join(CASES)}", prog=PROG)
    if args.quick:
        args.T, args.decode_context, args.train_T, args.kda_train_T = [32, 64], 64, 32, 16
        args.m530_T, args.m530_decode_context, args.m530_train_T = [32, 64], 64, 32
    for name, vals in (("--T", args.T), ("--decode-context", [args.decode_context]), ("--train-T", [args.train_T]),
                       ("--kda-train-T", [args.kda_train_T]), ("--530m-T", args.m530_T),
                       ("--530m-decode-context", [args.m530_decode_context]),
                       ("--530m-train-T", [args.m530_train_T])):
        if min(vals) < 2:
            raise UsageError(f"{name} must be >= 2, got {min(vals)}", prog=PROG)
    if importlib.util.find_spec("transformers") is None:
        raise UsageError("linattn bench hf needs transformers: pip install 'linattn[hf]'", prog=PROG)
    log = (lambda s: None) if args.quiet else (lambda s: print(s, file=sys.stderr, flush=True))
    paths = common.output_paths("hf", args.out, overwrite=args.overwrite)
    info = common.machine_info("cpu")
    load_start = common.loadavg()
    rows: List[Dict[str, Any]] = []
    skipped: List[Dict[str, str]] = []
    for kind in kinds:
        _time_kind(args, kind, wanted, log, rows, skipped)
        gc.collect()
    peak_rss = _peak_rss_bytes()
    memory: List[Dict[str, Any]] = []
    if not args.no_memory and "prefill" in wanted:
        specs, warm = [], []
        for kind in kinds:
            for T in _lengths(args, kind)[0]:
                for patched in (False, True):
                    specs.append({"kind": kind, "quick": args.quick, "vocab_size": args.vocab_size, "T": T,
                                  "patched": patched, "seed": args.seed})
                    # (the whole model warms up on its own case: a second 530M model in the worker costs more)
                    warm.append(None if kind == MODEL_KIND else dict(specs[-1], T=min(T, 64)))
        log("prefill peak memory")
        res = common.measure_memory("linattn.bench.hf:memory_case", specs, warmup_specs=warm)
        for spec, r in zip(specs, res):
            memory.append({"kind": spec["kind"], "T": spec["T"], "patched": spec["patched"], **r})
    mem_rows = []
    for kind in kinds:
        for T in _lengths(args, kind)[0]:
            u = next((m for m in memory if m["kind"] == kind and m["T"] == T and not m["patched"]), None)
            p = next((m for m in memory if m["kind"] == kind and m["T"] == T and m["patched"]), None)
            if u and p and u["peak_bytes"] and p["peak_bytes"] is not None:
                ratio = p["peak_bytes"] / u["peak_bytes"]
                mem_rows.append([kind, T, common.fmt_bytes(u["peak_bytes"]), common.fmt_bytes(p["peak_bytes"]),
                                 f"{ratio:.2f}", "<= 0.5" if T == 8192 else "", ("yes" if ratio <= 0.5 else "no")
                                 if T == 8192 else ""])
            elif u or p:
                mem_rows.append([kind, T, ((u or {}).get("error") or "-")[:40], ((p or {}).get("error") or "-")[:40],
                                 "", "", ""])
    table = common.format_table(
        ["kind", "case", "T", "threads", "unpatched ms", "patched ms", "speedup", "target", "met"],
        [[r["kind"], r["case"], r["T"], r["threads"], common.fmt_ms(r.get("unpatched_ms")),
          common.fmt_ms(r.get("patched_ms")), f"{r['speedup']:.2f}x" if r.get("speedup") else "-",
          f">= {r['target']:g}x" if r.get("target") else "", {True: "yes", False: "no"}.get(r.get("met"), "")]
         for r in rows])
    load_end = common.loadavg()
    context = f"{args.decode_context}-token" + (f" ({MODEL_KIND}: {args.m530_decode_context})"
                                                 if MODEL_KIND in kinds else "")
    notes = [f"decode   ms per token: {args.decode_tokens} consecutive tokens after a {context} "
             f"prompt (its cache made once by the patched model's prefill, a deep copy per timed call)",
             f"busy     {args.load} busy-loop process(es) for the whole run; load averages at the start "
             f"{' '.join(map(str, load_start or []))}, at the end {' '.join(map(str, load_end or []))}"]
    if "kda" in kinds and "train" in wanted and args.kda_train_T != args.train_T:
        notes.append(f"kda      training step at T = {args.kda_train_T} (--kda-train-T: transformers' unpatched KDA "
                     f"step takes minutes at 2048), the other kinds at {args.train_T}")
    if MODEL_KIND in kinds:
        notes.append(f"{MODEL_KIND} the whole model of `linattn bench infer --shape {MODEL_KIND}`"
                     f"{' (--quick: its tiny shape)' if args.quick else ''} and its own vocabulary (not --vocab-size): "
                     f"prefill at {' '.join(map(str, args.m530_T))}, decode after a {args.m530_decode_context}-token "
                     f"prompt, training step at {args.m530_train_T} (--530m-T, --530m-decode-context, "
                     f"--530m-train-T); target >= 1x on every row")
    if peak_rss is not None:
        notes.append(f"memory   peak resident set of the timed rows (this process): {common.fmt_bytes(peak_rss)} MiB")
    text = common.describe_machine(info) + "\n" + "\n".join(notes) + "\n\n" + table + "\n"
    if mem_rows:
        text += "\nprefill peak memory\n" + common.format_table(
            ["kind", "T", "unpatched MiB", "patched MiB", "ratio", "target", "met"], mem_rows) + "\n"
    for s in skipped:
        text += f"skipped: {s['kind']} {s['case']}: {s['reason']}\n"
    print(text, end="")
    write_json(paths["json"], {"machine": info, "load_start": load_start, "load_end": load_end,
                               "config": {k: v for k, v in vars(args).items() if k not in ("func",)},
                               "timings": rows, "memory": memory, "skipped": skipped, "peak_rss_bytes": peak_rss})
    atomic_write_text(paths["txt"], text)
    return 0
