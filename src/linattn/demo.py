"""`linattn demo` (`make demo`): what the library does, in about five minutes on a 2-core CPU.

1. Exactness: every feature map of `linear_attention` (each exactly decomposable kernel) and the
   delta rule (DeltaNet, Gated DeltaNet, EFLA) in their parallel, chunk and recurrent forms against
   the fp64 references of `linattn.ops.reference` (`linattn.exactness.run_exactness`); max errors.
2. Scaling: causal attention time and peak memory from 1k to 32k tokens, linear (elu+1, chunk
   form) against softmax (SDPA), forward, with a plot (`linattn bench ops`).
3. Learning: a short training of a small ELA-GPT (Hadamard Exp kernel) and of the same GPT with
   softmax attention on the embedded corpus (the standard library's source), same batches:
   losses and tokens/s side by side.
4. Generation: text from the trained linear model, decoded one token at a time from a constant-size
   state, and the per-token decoding latency and cache size at long contexts, against softmax's KV
   cache.

Everything is written to results/demo/ (or --out): demo.json, scaling.{txt,json,png}, learning.png.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

import torch

from .cli_support import UsageError, int_at_least

DEFAULT_T = [1024, 2048, 4096, 8192, 16384, 32768]


def _section(title: str) -> None:
    print()
    print("== " + title + " ==", flush=True)


def add_arguments(p) -> None:
    """The demo's options (declared by `linattn.cli`; kept here for `python -m linattn.demo`)."""
    p.add_argument("--out", default=None, help="output folder (default results/demo/)")
    p.add_argument("--T", type=int, nargs="+", default=DEFAULT_T,
                   help="sequence lengths of the scaling run (default 1024 ... 32768)")
    p.add_argument("--steps", type=int, default=300, help="training steps of each model in part 3 (default 300)")
    p.add_argument("--contexts", type=int, nargs="+", default=[128, 1024, 8192],
                   help="context lengths for the decoding latency of part 4 (default 128 1024 8192)")
    p.add_argument("--skip-bench", action="store_true", help="skip part 2 (scaling)")
    p.add_argument("--skip-train", action="store_true", help="skip parts 3 and 4 (learning, generation)")
    p.add_argument("--threads", type=int_at_least(1), default=None,
                   help="torch threads (default: 1 when other processes already keep the CPUs busy - "
                        "1-minute load average >= 0.75 - else torch's default)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs and the training runs (default 0)")


# ----------------------------------------------------------------------------------------------
# 1. exactness
# ----------------------------------------------------------------------------------------------

def exactness() -> Dict[str, Any]:
    from .exactness import format_exactness, run_exactness

    _section("1. Exactness (fp64): every kernel's and EFLA's three forms against the quadratic reference")
    t = time.perf_counter()
    rows = run_exactness()
    print(format_exactness(rows))
    errs = [r["max_rel_err"] for r in rows if r.get("max_rel_err") is not None]
    worst = max(errs, default=0.0)
    failed = [r for r in rows if r.get("note")]
    ok = worst < 1e-8 and not failed
    print(f"worst relative error over {len(errs)} cases: {worst:.1e} "
          f"({'ok: exact to fp64 rounding' if ok else 'LARGER THAN 1e-8 or failed'}) [{time.perf_counter() - t:.0f} s]")
    return {"rows": rows, "worst_rel_err": worst, "ok": ok}


# ----------------------------------------------------------------------------------------------
# 2. scaling
# ----------------------------------------------------------------------------------------------

def scaling(out: Path, Ts: List[int]) -> Dict[str, Any]:
    from .bench import run_benchmark

    _section("2. Scaling: causal attention, linear (elu+1, chunk) vs softmax (SDPA), forward, B=1 H=1 d=64")
    if any(t < 1 for t in Ts):
        raise UsageError("--T: sequence lengths must be >= 1", prog="linattn demo")
    t = time.perf_counter()
    args = ["--T", *map(str, Ts), "--families", "linear,softmax", "--modes", "chunk", "--passes", "fwd",
            "--B", "1", "--H", "1", "--K", "64", "--V", "64", "--repeats", "1", "--warmup", "1", "--min-time", "0",
            "--budget", "5", "--max-T-softmax", "0", "--matmul-n", "1024", "--out", str(out), "--name", "scaling",
            "--overwrite", "--quiet"]
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):   # the full report goes to scaling.txt; a summary is printed here
        rc = run_benchmark("ops", args)
    res: Dict[str, Any] = {"rc": rc, "wall_s": time.perf_counter() - t, "rows": []}
    try:
        with open(out / "scaling.json") as f:
            rep = json.load(f)
        for r in rep["results"]:
            if "ms" in r:
                res["rows"].append({"T": r["T"], "op": r["op"], "ms": r["ms"], "peak_bytes": r.get("peak_bytes"),
                                    "chunk_size_used": r.get("chunk_size_used")})
    except (OSError, ValueError, KeyError):
        print(buf.getvalue())
        return res
    by = {(r["T"], r["op"]): r for r in res["rows"]}

    def mib(b):
        return "-" if b is None else f"{b / 2 ** 20:,.1f}"

    print(f"{'T':>7}  {'linear ms':>10}  {'softmax ms':>11}  {'speed-up':>9}  {'linear MiB':>11}  {'softmax MiB':>12}")
    for T in sorted({r["T"] for r in res["rows"]}):
        a, b = by.get((T, "linear")), by.get((T, "softmax"))
        sp = f"{b['ms'] / a['ms']:.1f}x" if a and b else "-"
        print(f"{T:>7}  {a['ms'] if a else float('nan'):>10.1f}  {b['ms'] if b else float('nan'):>11.1f}  {sp:>9}  "
              f"{mib(a.get('peak_bytes') if a else None):>11}  {mib(b.get('peak_bytes') if b else None):>12}")
    chunks = sorted({r["chunk_size_used"] for r in res["rows"] if r.get("chunk_size_used") is not None})
    print(f"(linear chunk size used: {'/'.join(map(str, chunks)) or '-'}; one timed call after one warm-up call; "
          f"peak memory = growth of the resident set during one call, "
          f"measured in a separate process; full report: {out / 'scaling.txt'}"
          f"{', plot: ' + str(out / 'scaling.png') if (out / 'scaling.png').is_file() else ''}) "
          f"[{res['wall_s']:.0f} s]")
    return res


# ----------------------------------------------------------------------------------------------
# 3. learning
# ----------------------------------------------------------------------------------------------

def _small(mixer: str, vocab: int):
    from .models import LMConfig

    return LMConfig.ela_gpt(vocab, d_model=128, n_layers=4, n_heads=4, mixer=mixer, max_seq_len=512)


def learning(out: Path, steps: int, seed: int) -> Dict[str, Any]:
    from .training import TrainConfig, evaluate, prepare_data, train

    _section(f"3. Learning: ELA-GPT (Hadamard Exp) vs softmax GPT, {steps} steps each on the embedded corpus")
    t = time.perf_counter()
    cfg = TrainConfig(data=None, out=None, vocab_size=1024, max_data_bytes=1 << 20, seq_len=128, batch_size=8,
                      steps=steps, lr=2e-3, warmup=max(1, steps // 10), eval_every=0, eval_batches=8,
                      log_every=max(1, steps // 6), seed=seed, progress=False, device="cpu")
    data = prepare_data(cfg)
    print(f"corpus: {data.train.n_tokens:,} training tokens (1 MiB of the standard library's .py files), "
          f"byte-level BPE vocabulary {data.tokenizer.vocab_size} [{time.perf_counter() - t:.0f} s]", flush=True)
    results = {}
    for key, mixer in (("linear", "ela-hadamard_exp"), ("softmax", "softmax")):
        t1 = time.perf_counter()
        res = train(cfg, _small(mixer, data.tokenizer.vocab_size), data=data, handle_signals=False)
        ev = evaluate(res.model, data.val, batch_size=8, max_batches=8)
        results[key] = {"model": res.model, "losses": res.losses, "tokens_per_s": res.tokens_per_s,
                        "val_loss": ev.loss, "val_ppl": ev.ppl, "n_params": res.model.num_parameters(),
                        "wall_s": time.perf_counter() - t1}
        print(f"  trained {key:<7} ({res.model.num_parameters():,} parameters) in {time.perf_counter() - t1:.0f} s",
              flush=True)
    k = max(1, steps // 6)
    print()
    print(f"{'step':>6}  {'ELA-GPT loss':>13}  {'softmax loss':>13}   (mean of the last {k} steps)")
    lin, sm = results["linear"]["losses"], results["softmax"]["losses"]
    rows = []
    for s in range(k, steps + 1, k):
        a = statistics.mean(loss for st, loss in lin if s - k < st <= s)
        b = statistics.mean(loss for st, loss in sm if s - k < st <= s)
        rows.append((s, a, b))
        print(f"{s:>6}  {a:>13.3f}  {b:>13.3f}")
    print(f"{'val':>6}  {results['linear']['val_loss']:>13.3f}  {results['softmax']['val_loss']:>13.3f}   "
          f"(validation loss; perplexity {results['linear']['val_ppl']:.1f} vs {results['softmax']['val_ppl']:.1f})")
    print(f"{'tok/s':>6}  {results['linear']['tokens_per_s'] or 0:>13.0f}  "
          f"{results['softmax']['tokens_per_s'] or 0:>13.0f}   (training tokens per second, batch 8 x 128)")
    from .experiments.common import line_panels
    from .plotting import MISSING, save_figure

    figure = save_figure(out / "learning.png", lambda path: line_panels(path, [{
        "title": "training loss (demo)", "xlabel": "step", "ylabel": "loss",
        "series": [{"label": "ELA-GPT (Hadamard Exp)", "x": [r[0] for r in rows], "y": [r[1] for r in rows],
                    "color": "C0"},
                   {"label": "softmax GPT", "x": [r[0] for r in rows], "y": [r[2] for r in rows], "color": "k"}]}],
        panel_size=(5.0, 3.4)))
    if figure == MISSING or figure.startswith("(plot failed"):  # the plot is a convenience
        print(f"(learning plot: {figure})")
    results["table"] = rows
    results["data"] = data
    results["wall_s"] = time.perf_counter() - t
    return results


# ----------------------------------------------------------------------------------------------
# 4. generation
# ----------------------------------------------------------------------------------------------

@torch.no_grad()
def _decode_latency(model, context: int, vocab: int, n: int = 16, seed: int = 0) -> Dict[str, Any]:
    """Prefill `context` random tokens, then time n single-token steps: median ms/token, cache bytes."""
    model.eval()
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (1, context), generator=g)
    t = time.perf_counter()
    out = model(ids, use_cache=True)
    prefill = time.perf_counter() - t
    tok = out.logits[:, -1].argmax(-1, keepdim=True)
    times = []
    for _ in range(n):
        t = time.perf_counter()
        out = model(tok, cache=out.cache)
        times.append(time.perf_counter() - t)
        tok = out.logits[:, -1].argmax(-1, keepdim=True)
    return {"context": context, "ms_per_token": 1e3 * statistics.median(times), "prefill_s": prefill,
            "cache_bytes": out.cache.nbytes()}


def generation(learned: Dict[str, Any], contexts: List[int], seed: int) -> Dict[str, Any]:
    _section("4. Generation: constant-memory decoding with the trained ELA-GPT")
    data = learned["data"]
    tok = data.tokenizer
    lin = learned["linear"]["model"]
    prompt = "def "
    ids = torch.tensor(tok.encode(prompt), dtype=torch.long)
    t = time.perf_counter()
    gen = lin.generate(ids, 80, temperature=0.8, top_k=40, seed=seed)
    dt = time.perf_counter() - t
    text = tok.decode(gen.tolist())
    print(f"prompt {prompt!r}, 80 tokens, temperature 0.8, top-k 40 ({80 / dt:.0f} tokens/s):")
    print("-" * 72)
    print(text)
    print("-" * 72)
    rows = []
    print()
    print("per-token decoding latency after a prefill of N random tokens (median of 16 steps, batch 1):")
    print(f"{'N':>7}  {'ELA-GPT ms/token':>17}  {'state bytes':>12}  {'softmax ms/token':>17}  {'KV cache bytes':>15}")
    for c in contexts:
        a = _decode_latency(lin, c, tok.vocab_size, seed=seed)
        b = _decode_latency(learned["softmax"]["model"], c, tok.vocab_size, seed=seed)
        rows.append({"context": c, "linear": a, "softmax": b})
        print(f"{c:>7}  {a['ms_per_token']:>17.2f}  {a['cache_bytes']:>12,}  {b['ms_per_token']:>17.2f}  "
              f"{b['cache_bytes']:>15,}", flush=True)
    return {"prompt": prompt, "text": text, "tokens_per_s": 80 / dt, "latency": rows}


# ----------------------------------------------------------------------------------------------
# main
# ----------------------------------------------------------------------------------------------

def main(args) -> int:
    from .bench.common import describe_machine, machine_info
    from .io import write_json

    threads_note = ""
    if getattr(args, "threads", None):
        torch.set_num_threads(int(args.threads))
    else:
        try:
            busy = os.getloadavg()[0] >= 0.75
        except (OSError, AttributeError):
            busy = False
        if busy and torch.get_num_threads() > 1:
            # several threads of ours would wait on each other's time slices behind the other jobs
            # (OpenMP barriers): one thread is faster on a shared, busy CPU
            torch.set_num_threads(1)
            threads_note = " (1 thread: the CPUs are busy with other processes; --threads N overrides)"
    out = Path(args.out) if args.out is not None else Path("results") / "demo"
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    info = machine_info("cpu")
    print("linattn demo")
    print(describe_machine(info) + threads_note)
    report: Dict[str, Any] = {"machine": info}
    ex = exactness()
    report["exactness"] = {"worst_rel_err": ex["worst_rel_err"], "ok": ex["ok"], "rows": ex["rows"]}
    if not getattr(args, "skip_bench", False):
        report["scaling"] = scaling(out, list(args.T))
    if not getattr(args, "skip_train", False):
        steps = int(getattr(args, "steps", 300))
        learned = learning(out, steps, int(getattr(args, "seed", 0)))
        report["learning"] = {k: {kk: vv for kk, vv in v.items() if kk != "model"} for k, v in learned.items()
                              if k in ("linear", "softmax")}
        report["learning"]["table"] = learned["table"]
        report["generation"] = generation(learned, list(getattr(args, "contexts", [128, 1024, 8192])),
                                          int(getattr(args, "seed", 0)))
    report["wall_s"] = time.perf_counter() - t0
    write_json(out / "demo.json", report)
    print()
    files = sorted(p.name for p in out.iterdir() if p.is_file())
    print(f"demo finished in {report['wall_s']:.0f} s; files in {out}/: {', '.join(files)}")
    return 0 if ex["ok"] else 1


if __name__ == "__main__":  # pragma: no cover
    import argparse

    p = argparse.ArgumentParser(prog="python -m linattn.demo")
    add_arguments(p)
    sys.exit(main(p.parse_args()))
