"""`linattn bench quant`: fp32 / bf16 / int8 / int4 weights on the CPU: speed against the memory floor, and quality.

Speed (always): a random-weight linattn LanguageModel of the given shape (default a Gated DeltaNet : softmax 3 : 1
hybrid with SwiGLU and a tied head) in each precision, interleaved in one process, the median of `--repeats`:
prompt tokens/s (one `--prompt`-token prefill) and decode tokens/s (`--tokens` one-token steps after it), and
decode time as a multiple of the floor. The floor of a decoded token is (bytes it reads) / (read bandwidth):
every stored weight once in its stored dtype (quantized: the integers, scales and biases; the embedding: one row,
not the table; a tied float head: the table once), and the bandwidth is a sum over a float32 buffer of at least
4x the last-level cache (256 MiB at least), measured in every repeat beside the models.

Quality (with `--checkpoint` and `--data`): the checkpoint's perplexity on `--data` in each precision (bf16 = the
weights cast to bf16), greedy agreement with fp32 over `--agree-tokens` tokens after prompts taken from `--data`
(teacher-forced: the fraction of positions whose argmax equals fp32's on fp32's continuation; free-running: the
tokens generated before the first difference), and, with `--hf`, a random tiny Qwen3.5 model through
`linattn.hf.kernelize`: the quantized logits' largest error relative to the largest fp32 logit.
"""
from __future__ import annotations

import math
import statistics
import time
from pathlib import Path
from typing import Any, Dict, List

import torch

from ..cli_support import UsageError, int_at_least
from ..cpu import hugepages
from ..cpu.qlayout import step_scales
from ..io import write_json
from . import common

DESCRIPTION = __doc__
#: (int8-a8 / int4-a8: quantize(..., activations="int8"), every product's input rounded to int8 per block of 32)
PRECISIONS = ("fp32", "bf16", "int8", "int4", "int8-a8", "int4-a8")
DEFAULT_PRECISIONS = ("fp32", "bf16", "int8", "int4")


def add_arguments(p) -> None:
    """The options of `linattn bench quant`.

    Args:
        p: The argparse parser to add them to.
    """
    p.add_argument("--precisions", default=",".join(DEFAULT_PRECISIONS),
                   help="comma list of fp32,bf16,int8,int4,int8-a8,int4-a8 (default fp32,bf16,int8,int4; -a8: "
                        "activations rounded to int8 per block of 32)")
    p.add_argument("--compute", choices=("bf16", "fp32"), default="bf16",
                   help="the quantized layers' PyTorch path (prefill, the quality rows' perplexity): bf16 (default, "
                        "bf16 activations) or fp32 (the compiled decode's arithmetic: fp32 activations)")
    p.add_argument("--d-model", type=int_at_least(1), default=1024, help="width (default 1024)")
    p.add_argument("--n-layers", type=int_at_least(1), default=8, help="layers (default 8)")
    p.add_argument("--n-heads", type=int_at_least(1), default=8, help="heads (default 8)")
    p.add_argument("--ffn-hidden", type=int_at_least(1), default=3584, help="SwiGLU width (default 3584)")
    p.add_argument("--vocab-size", type=int_at_least(2), default=32000, help="(default 32000)")
    p.add_argument("--mixers", default="gated-deltanet,gated-deltanet,gated-deltanet,softmax",
                   help="the mixers of the layers, repeated (default GDN x3, softmax)")
    p.add_argument("--group-size", type=int, choices=(32, 64), default=32, help="int4's group (default 32)")
    p.add_argument("--prompt", type=int_at_least(1), default=64, help="prompt tokens (default 64)")
    p.add_argument("--tokens", type=int_at_least(1), default=16, help="decoded tokens per repeat (default 16)")
    p.add_argument("--repeats", type=int_at_least(1), default=5, help="interleaved repeats (default 5)")
    p.add_argument("--threads", type=int_at_least(0), default=None, help="torch threads (default 1; 0 = torch's)")
    p.add_argument("--bandwidth-mib", type=int_at_least(0), default=0,
                   help="size of the bandwidth buffer (default 0 = 4x the last-level cache, 256 MiB at least)")
    p.add_argument("--checkpoint", default=None, help="a float checkpoint: also measure its quality on --data")
    p.add_argument("--data", default=None, help="text file for the quality rows (e.g. wikitext-2/valid.txt)")
    p.add_argument("--seq-len", type=int_at_least(1), default=128, help="perplexity windows (default 128)")
    p.add_argument("--agree-tokens", type=int_at_least(1), default=256, help="greedy tokens compared (default 256)")
    p.add_argument("--agree-prompts", type=int_at_least(1), default=4, help="prompts for the agreement (default 4)")
    p.add_argument("--hf", action="store_true", help="also a kernelized random Qwen3.5 model's logits error")
    p.add_argument("--no-speed", action="store_true", help="only the quality rows")
    p.add_argument("--kernels", action="store_true",
                   help="also one --d-model x --ffn-hidden matrix at --kernel-rows rows: torch's packed int8 / "
                        "int4 kernels (bf16 and fp32 activations) and the compiled decode's own products against "
                        "dequantize-then-matmul (bf16, and fp32: the path of CPUs without bf16 instructions) and "
                        "fp32 / bf16")
    p.add_argument("--kernel-rows", default="1,16,64,512",
                   help="--kernels: comma list of row counts (default 1,16,64,512)")
    p.add_argument("--kernel-clock", choices=("wall", "thread"), default="wall",
                   help="--kernels: wall time (default) or the calling thread's CPU time (time.thread_time: steadier "
                        "on a loaded machine at 1 thread; misses torch's other threads above 1)")
    p.add_argument("--kernel-ways", default="",
                   help="--kernels: only the ways whose name contains one of these comma-separated words "
                        "(default: every way)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights and prompts (default 0)")
    p.add_argument("--out", default=None, help="output folder (default results/bench/quant/)")
    p.add_argument("--overwrite", action="store_true", help="replace existing output files")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")


def _kernel_rows(a) -> List[int]:
    try:
        rows = [int(t) for t in a.kernel_rows.split(",") if t.strip()]
    except ValueError:
        rows = []
    if not rows or min(rows) < 1:
        raise UsageError(f"--kernel-rows: expected a comma list of row counts >= 1, got {a.kernel_rows!r}")
    return rows


def _precisions(a) -> List[str]:
    names = [s.strip() for s in a.precisions.split(",") if s.strip()]
    bad = [n for n in names if n not in PRECISIONS]
    if bad or not names:
        raise UsageError(f"--precisions: expected a comma list of {','.join(PRECISIONS)}, got {a.precisions!r}")
    return names


def variant(model, precision: str, group_size: int, compute: str = "bf16"):
    """`model` (fp32) in a precision: a copy (bf16: the weights cast; int8/int4[-a8]: linattn.quantize with
    `compute`, -a8 with activations="int8")."""
    import copy

    from ..quant import quantize
    if precision == "fp32":
        return model
    if precision == "bf16":
        return copy.deepcopy(model).to(torch.bfloat16)
    mode, _, a8 = precision.partition("-")
    return quantize(model, mode, group_size=group_size if mode == "int4" else None, compute=compute,
                    activations="int8" if a8 else "float")


def decode_bytes(model) -> int:
    """Bytes one decoded token reads: every stored tensor once in its dtype, the embedding as one row (a tied float
    head reads the whole table once)."""
    from ..quant import quantized_modules

    embed = model.embed.weight
    total, seen = 0, {id(embed)}
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) in seen:
            continue
        seen.add(id(t))
        total += t.numel() * t.element_size()
    head_is_table = model.lm_head is None
    row = embed.shape[1] * embed.element_size()
    total += embed.numel() * embed.element_size() if head_is_table else row
    for q in quantized_modules(model).values():   # non-persistent derived layouts are not read
        total -= sum(b.numel() * b.element_size() for n, b in q.named_buffers() if n.startswith("_"))
    return total


def read_bandwidth(buf: torch.Tensor) -> float:
    """Bytes/s of one sum over `buf` (a float32 buffer several times the last-level cache)."""
    t0 = time.perf_counter()
    buf.sum()
    return buf.numel() * 4 / (time.perf_counter() - t0)


def _llc_bytes() -> int:
    best = 0
    for p in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = p.read_text().strip().upper()
        mult = {"K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30}.get(text[-1:], 1)
        try:
            best = max(best, int(text.rstrip("KMG")) * mult)
        except ValueError:
            continue
    return best


def _speed_model(a):
    from ..models import LanguageModel, LMConfig

    mixers = [s.strip() for s in a.mixers.split(",") if s.strip()]
    torch.manual_seed(a.seed)
    cfg = LMConfig(vocab_size=a.vocab_size, d_model=a.d_model, n_layers=a.n_layers, n_heads=a.n_heads,
                   mixer=[mixers[i % len(mixers)] for i in range(a.n_layers)], ffn="swiglu", ffn_hidden=a.ffn_hidden,
                   max_seq_len=a.prompt + a.tokens + 8)
    return LanguageModel(cfg).eval()


def _time_one(model, prompt: torch.Tensor, n: int):
    """(prefill seconds, decode seconds per token) of one prompt and n greedy steps."""
    with torch.no_grad():
        t0 = time.perf_counter()
        out = model(prompt, use_cache=True)
        t1 = time.perf_counter()
        nxt = out.logits[:, -1:].argmax(-1)
        t2 = time.perf_counter()
        for _ in range(n):
            out = model(nxt, cache=out.cache)
            nxt = out.logits[:, -1:].argmax(-1)
        t3 = time.perf_counter()
    return t1 - t0, (t3 - t2) / n


def speed_rows(a, names: List[str], log) -> List[Dict[str, Any]]:
    base = _speed_model(a)
    models = {n: variant(base, n, a.group_size, a.compute) for n in names}
    nbytes = {n: decode_bytes(m) for n, m in models.items()}
    buf = hugepages.empty((a.bandwidth_mib * 2 ** 20 or max(4 * _llc_bytes(), 256 * 2 ** 20)) // 4,
                          torch.float32).fill_(1.0)   # (on 2 MiB pages as the models' weights: the best read)
    prompt = torch.randint(0, a.vocab_size, (1, a.prompt), generator=torch.Generator().manual_seed(a.seed))
    for m in models.values():
        _time_one(m, prompt[:, :8], 2)                          # warm-up: kernels, compiled plans
    times = {n: ([], []) for n in names}
    bws = []
    for r in range(a.repeats):
        bws.append(read_bandwidth(buf))
        for n, m in models.items():
            pre, dec = _time_one(m, prompt, a.tokens)
            times[n][0].append(pre)
            times[n][1].append(dec)
        log(f"repeat {r + 1}/{a.repeats}: " + ", ".join(f"{n} {1 / times[n][1][-1]:.1f} tok/s" for n in names))
    bw = statistics.median(bws)
    rows = []
    for n in names:
        pre, dec = statistics.median(times[n][0]), statistics.median(times[n][1])
        floor = nbytes[n] / bw
        rows.append({"precision": n, "bytes_per_token": nbytes[n], "prefill_tok_s": a.prompt / pre,
                     "decode_tok_s": 1 / dec, "decode_ms": dec * 1e3, "floor_ms": floor * 1e3,
                     "over_floor": dec / floor, "bandwidth_gb_s": bw / 1e9})
    return rows


def kernel_rows(a, log) -> List[Dict[str, Any]]:
    """ms per product of x [M, K] with one [N, K] weight, each way of computing it, interleaved (median)."""
    from ..cpu import decode as cpu_decode
    from ..quant import QuantizedLinear

    K, N = a.d_model, a.ffn_hidden
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(a.seed)) * 0.02
    q8 = QuantizedLinear.from_weight(w, None, "int8", activations="float")
    q4 = QuantizedLinear.from_weight(w, None, "int4", a.group_size, activations="float")
    wb = w.to(torch.bfloat16)
    rows = []
    words = [t.strip() for t in a.kernel_ways.split(",") if t.strip()]
    for M in _kernel_rows(a):
        x = torch.randn(M, K)
        xb = x.to(torch.bfloat16)
        ways = {
            "fp32 matmul": lambda: x @ w.T,
            "bf16 matmul": lambda: xb @ wb.T,
            "int8 packed, bf16 x": lambda: torch._weight_int8pack_mm(xb, q8.qweight, q8.scales),
            "int8 packed, fp32 x": lambda: torch._weight_int8pack_mm(x, q8.qweight, q8.scales.float()),
            "int8 dequant + bf16 matmul": lambda: xb @ q8.dequantize(torch.bfloat16).T,
            "int8 dequant + fp32 matmul": lambda: x @ q8.dequantize(torch.float32).T,
            "int4 packed, bf16 x": lambda: torch._weight_int4pack_mm_for_cpu(xb, q4._packed, q4.group_size,
                                                                            q4._scale_zeros),
            "int4 packed, fp32 x": lambda: torch._weight_int4pack_mm_for_cpu(x, q4._packed, q4.group_size,
                                                                            q4._scale_zeros.float()),
            "int4 dequant + bf16 matmul": lambda: xb @ q4.dequantize(torch.bfloat16).T,
            # the path of CPUs without bf16 instructions (quant/linear.py `product_path`): blocks of the weight
            # dequantized to fp32, bf16-rounded as the bf16 path's operand (what runs) or exact q * s
            "int8 dequant (bf16-rounded) + fp32 matmul, blocks": lambda: q8._prefill_fp32(xb),
            "int8 dequant (exact) + fp32 matmul, blocks": lambda: q8._prefill_fp32(xb, exact=True),
            "int4 dequant (bf16-rounded) + fp32 matmul, blocks": lambda: q4._prefill_fp32(xb),
            "int4 dequant (exact) + fp32 matmul, blocks": lambda: q4._prefill_fp32(xb, exact=True),
            # the dequantization alone, the whole weight to bf16-rounded fp32: the compiled kernel (cpu/dequant.py,
            # what the layer runs when it builds) against torch's elementwise ops (its fallback)
            "int8 dequant only, compiled": lambda: q8._dequantize_rows(0, N, torch.float32, bf16_round=True),
            "int8 dequant only, torch ops": lambda: q8._dequantize_rows_torch(0, N, torch.bfloat16).float(),
            "int4 dequant only, compiled": lambda: q4._dequantize_rows(0, N, torch.float32, bf16_round=True),
            "int4 dequant only, torch ops": lambda: q4._dequantize_rows_torch(0, N, torch.bfloat16).float(),
        }
        if cpu_decode.available():   # the compiled decode's own products (csrc/qmatvec.h), fp32 activations
            ways["int8 compiled decode, fp32 x"] = lambda: cpu_decode.weight_matvec(x, "int8", q8.qweight, q8.scales)
            ways["int4 compiled decode, fp32 x"] = lambda: cpu_decode.weight_matvec(x, "int4", q4.qweight, q4.scales,
                                                                                     q4.group_size)
            # x rounded to int8 per block of 32 (activations="int8"): integer products
            ways["int8 compiled decode, int8 x"] = lambda: cpu_decode.weight_matvec(x, "int8_a8", q8.qweight,
                                                                                    q8.scales)
            # (int4-a8 reads its scales in the steps' order, as a plan keeps them: reordered once, not per call)
            s4 = step_scales(q4.scales)
            ways["int4 compiled decode, int8 x"] = lambda: cpu_decode.weight_matvec(
                x, "int4_a8", q4.qweight, s4, q4.group_size, scales_in_step_order=True)
        if words:
            ways = {k: f for k, f in ways.items() if any(wd in k for wd in words)}
        times = {k: [] for k in ways}
        n = 3 if M >= 64 else 10
        clock = time.thread_time if a.kernel_clock == "thread" else time.perf_counter
        for _ in range(a.repeats):
            for k, f in ways.items():
                f()
                t0 = clock()
                for _ in range(n):
                    f()
                times[k].append((clock() - t0) / n * 1e3)
        rows += [{"rows": M, "way": k, "ms": statistics.median(v), "clock": a.kernel_clock} for k, v in times.items()]
        log(f"kernels: {M} rows done")
    return rows


def perplexity(model, tokens: torch.Tensor, seq_len: int, batch: int = 16) -> float:
    """exp(mean next-token cross-entropy) over consecutive windows of `tokens` (each window on its own)."""
    n = (tokens.numel() - 1) // seq_len
    x = tokens[: n * seq_len].view(n, seq_len)
    y = tokens[1: n * seq_len + 1].view(n, seq_len)
    total = 0.0
    with torch.no_grad():
        for i in range(0, n, batch):
            logits = model(x[i:i + batch]).logits.float()
            total += torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y[i:i + batch].reshape(-1),
                                                       reduction="sum").item()
    return math.exp(total / (n * seq_len))


def greedy_agreement(model, ref_tokens: torch.Tensor, prompt_len: int, ref_free: torch.Tensor):
    """(teacher-forced agreement, free-running identical prefix) of `model` against fp32's greedy `ref_tokens`."""
    with torch.no_grad():
        logits = model(ref_tokens[:, :-1]).logits[:, prompt_len - 1:]
        forced = (logits.argmax(-1) == ref_tokens[:, prompt_len:]).float().mean().item()
        free = model.generate(ref_tokens[:, :prompt_len], ref_free.shape[1] - prompt_len, temperature=0)
    same = (free[:, prompt_len:] == ref_free[:, prompt_len:]).int().cumprod(-1).sum(-1)
    return forced, same.float().mean().item()


def quality_rows(a, names: List[str], log) -> List[Dict[str, Any]]:
    from ..checkpoint import load_checkpoint

    ck = load_checkpoint(a.checkpoint)
    base = ck.model.float().eval()
    text = Path(a.data).read_text(encoding="utf-8")
    tokens = torch.tensor(ck.tokenizer.encode(text), dtype=torch.long)
    g = torch.Generator().manual_seed(a.seed)
    starts = torch.randint(0, tokens.numel() - 64, (a.agree_prompts,), generator=g)
    prompts = torch.stack([tokens[s:s + 32] for s in starts.tolist()])
    with torch.no_grad():
        ref = base.generate(prompts, a.agree_tokens, temperature=0)
    rows = []
    for n in names:
        m = variant(base, n, a.group_size, a.compute)
        ppl = perplexity(m, tokens, a.seq_len)
        forced, free = greedy_agreement(m, ref, 32, ref)
        rows.append({"precision": n, "ppl": ppl, "tokens": int(((tokens.numel() - 1) // a.seq_len) * a.seq_len),
                     "agree_forced": forced, "agree_free_tokens": free})
        log(f"quality {n}: ppl {ppl:.3f}, forced agreement {forced:.4f}, free-running {free:.1f} tokens")
    for r in rows:
        r["ppl_vs_fp32"] = r["ppl"] / rows[0]["ppl"] - 1 if rows[0]["precision"] == "fp32" else None
    return rows


# the kernelized transformers model of the quality rows: a small random Qwen3.5 (3 Gated DeltaNet : 1 softmax)
HF_SHAPE = dict(d=256, layers=4, every=4, vocab=2048, inter=896, lin_heads=8, lin_dim=32, attn_heads=8, kv_heads=2,
                attn_dim=64)


def hf_rows(a, names: List[str]) -> List[Dict[str, Any]]:
    from ..hf.infer_models import qwen35_model

    model = qwen35_model(HF_SHAPE, seed=a.seed, kernelized=True)
    ids = torch.randint(0, 2048, (2, 96), generator=torch.Generator().manual_seed(a.seed))
    with torch.no_grad():
        ref = model(ids).logits.double()
        rows = []
        for n in names:
            m = variant(model, n, a.group_size, a.compute)
            err = (m(ids).logits.double() - ref).abs()
            rows.append({"precision": n, "max_err_rel": (err.max() / ref.abs().max()).item(),
                         "mean_err_rel": (err.mean() / ref.abs().mean()).item(),
                         "argmax_agree": (m(ids).logits.argmax(-1) == ref.argmax(-1)).float().mean().item()})
    return rows


def _report(speed, quality, hf, kernels=()) -> str:
    parts = []
    if kernels:
        ways = list(dict.fromkeys(r["way"] for r in kernels))
        Ms = list(dict.fromkeys(r["rows"] for r in kernels))
        ms = {(r["way"], r["rows"]): r["ms"] for r in kernels}
        clock = "thread CPU" if kernels[0].get("clock") == "thread" else "wall"
        parts.append(f"one weight, ms per product ({clock} time, median):\n" + common.format_table(
            ["way", *[f"{M} rows" for M in Ms]], [[w, *[f"{ms[w, M]:.3f}" for M in Ms]] for w in ways]))
    if speed:
        parts.append(common.format_table(
            ["weights", "MiB read/token", "prompt tok/s", "decode tok/s", "decode ms", "floor ms", "x floor"],
            [[r["precision"], f"{r['bytes_per_token'] / 2 ** 20:.1f}", f"{r['prefill_tok_s']:.1f}",
              f"{r['decode_tok_s']:.2f}", f"{r['decode_ms']:.2f}", f"{r['floor_ms']:.2f}", f"{r['over_floor']:.2f}"]
             for r in speed]) + f"\nread bandwidth {speed[0]['bandwidth_gb_s']:.1f} GB/s (median)")
    if quality:
        parts.append(common.format_table(
            ["weights", "val ppl", "vs fp32", "greedy agree (forced)", "identical greedy tokens (free)"],
            [[r["precision"], f"{r['ppl']:.3f}", "" if r["ppl_vs_fp32"] is None else f"{100 * r['ppl_vs_fp32']:+.2f}%",
              f"{100 * r['agree_forced']:.2f}%", f"{r['agree_free_tokens']:.1f}"] for r in quality]))
    if hf:
        parts.append("kernelized Qwen3.5 (random, hidden 256, 4 layers), logits vs fp32:\n" + common.format_table(
            ["weights", "max |err| / max |logit|", "mean |err| / mean |logit|", "argmax agree"],
            [[r["precision"], f"{r['max_err_rel']:.2e}", f"{r['mean_err_rel']:.2e}",
              f"{100 * r['argmax_agree']:.2f}%"] for r in hf]))
    return "\n\n".join(parts)


def run(a) -> int:
    """Run the `linattn bench quant` benchmark (module docstring).

    Args:
        a: The options parsed with `add_arguments`.

    Returns:
        The exit code (0: success).

    Raises:
        UsageError: Bad options.
    """
    names = _precisions(a)
    _kernel_rows(a)
    if (a.checkpoint is None) != (a.data is None):
        raise UsageError("--checkpoint and --data go together (the quality rows)")
    a.threads, log = common.start_run(a.threads, "cpu", a.quiet)
    paths = common.output_paths("quant", a.out, exts=("txt", "json"), overwrite=a.overwrite)
    info = common.machine_info("cpu")
    head = common.describe_machine(info) + f"\nload at the start: {common.loadavg()}"
    print(head + "\n")
    speed = [] if a.no_speed else speed_rows(a, names, log)
    quality = quality_rows(a, names, log) if a.checkpoint else []
    hf = hf_rows(a, [n for n in names if n != "fp32"]) if a.hf else []
    kernels = kernel_rows(a, log) if a.kernels else []
    text = _report(speed, quality, hf, kernels) + f"\nload at the end: {common.loadavg()}"
    print(text)
    result = {"benchmark": "quant", "machine": info, "config": vars(a), "speed": speed, "quality": quality, "hf": hf,
              "kernels": kernels}
    paths["txt"].write_text(head + "\n\n" + text + "\n", encoding="utf-8")
    write_json(paths["json"], result)
    return 0
