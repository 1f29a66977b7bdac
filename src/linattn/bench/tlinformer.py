"""`linattn bench tlinformer`: TLinFormer inference against context length N (the paper's Figure 9).

Three models of the same width, depth and FFN, random weights, batch 1:

* TLinFormer (`linattn.models.TLinFormerLM`): n_blocks x inner_depth layers, windows W_oh / W_og;
* the softmax baseline: a `LanguageModel` with softmax attention (RoPE) and its KV cache, with
  as many layers;
* a linear-attention LM: a `LanguageModel` with a linear mixer (default `linear-elu+1`).

Per N (the context the next token sees) and model:

* cache miss: the latency of the first token for a new N-token context, i.e. processing the
  N + 1 prompt tokens from nothing to the last token's logits (TLinFormer: history N, window 1,
  `logits_to_keep=1`; the LanguageModels: prefill with the head applied to the last token only).
  This is also TLinFormer's cost each time its window slides.
* cache hit: the median latency of the next decoding steps with the cache (TLinFormer: tokens
  2.. of the window; the softmax baseline: one token against a KV cache holding N tokens; the
  linear LM: one recurrent step).
* cache bytes: `cache.nbytes()` after those steps (all tensors the cache holds, capacity included).

The softmax baseline's KV cache is preallocated: every layer's `KVCache` is created with room for
N + the decoding steps, so a decoding step appends in place (no `torch.cat`, no regrowth), unlike
the paper's baseline. For its cache-hit timings the cache is filled with random keys/values instead
of running the quadratic prefill (decoding cost does not depend on the values); its cache-miss
(prefill) timings stop at --max-miss-softmax. As a reference the table also gives the softmax
baseline's attention floor: n_layers bare SDPA calls of one query against contiguous K/V of N
tokens, no mask, nothing else (a lower bound of any softmax decoder of this shape on this machine).

A per-token trace (--trace-N) decodes 2 W_og + 2 tokens from one context with TLinFormer's cache:
misses every W_og tokens, hits in between (the peaks and valleys of the paper's Figure 9b).
"""
from __future__ import annotations

import gc
import math
import statistics
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from ..cli_support import UsageError, int_at_least
from ..io import atomic_write_text, write_json
from ..plotting import save_figure
from . import common

DESCRIPTION = __doc__.split("\n\n")[0] + "\n\n" + "\n\n".join(__doc__.split("\n\n")[1:])

DEFAULT_N = [1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072]
MODELS = ("tlinformer", "softmax", "linear")
LABEL = {"tlinformer": "TLinFormer", "softmax": "softmax + KV cache", "linear": "linear LM"}
COLOR = {"tlinformer": "C3", "softmax": "k", "linear": "C0"}
SHORT = {"tlinformer": "TLin", "softmax": "softmax", "linear": "linear"}  # table headers
PROG = "linattn bench tlinformer"


def add_arguments(p) -> None:
    """The options of `linattn bench tlinformer`.

    Args:
        p: The argparse parser to add them to.
    """
    p.add_argument("--N", type=int, nargs="+", default=DEFAULT_N, metavar="N",
                   help="context lengths (default 1024 ... 131072, powers of two)")
    p.add_argument("--d-model", type=int, default=64, help="width (default 64)")
    p.add_argument("--n-heads", type=int, default=4, help="heads (default 4)")
    p.add_argument("--n-blocks", type=int, default=2, help="TLinFormer blocks (default 2)")
    p.add_argument("--inner-depth", type=int, default=6,
                   help="TLinFormer layers per block, H + 2 (default 6: H = 4 hidden layers)")
    p.add_argument("--history-window", default="128", help="W_oh, an int or 'auto' (default 128)")
    p.add_argument("--generation-window", type=int, default=128, help="W_og (default 128)")
    p.add_argument("--vocab-size", type=int, default=512, help="(default 512)")
    p.add_argument("--linear-mixer", default="linear-elu+1", help="mixer of the linear LM (default linear-elu+1)")
    p.add_argument("--models", default=",".join(MODELS), help="comma list of tlinformer,softmax,linear (default all)")
    p.add_argument("--decode-steps", type=int, default=8,
                   help="timed cache-hit steps per N (default 8, after 1 warm-up)")
    p.add_argument("--miss-repeats", type=int, default=2, help="timed cache-miss calls per N (default 2, after 1 "
                                                               "warm-up at the smallest N)")
    p.add_argument("--max-miss-softmax", type=int, default=4096,
                   help="largest N for the softmax baseline's prefill (quadratic; default 4096, 0 = no cap)")
    p.add_argument("--trace-N", type=int, default=16384,
                   help="context of the per-token trace (default 16384, 0 = none)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:i] (default cpu)")
    p.add_argument("--threads", type=int_at_least(0), default=None,
                   help="torch.set_num_threads (default 1 on cpu: on a shared, loaded machine more threads than "
                        "free cores make every timing erratic; use 0 for torch's default)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights and prompts (default 0)")
    p.add_argument("--out", default=None, help="output folder (default results/bench/tlinformer/)")
    p.add_argument("--name", default="tlinformer", help="file name stem of the outputs (default tlinformer)")
    p.add_argument("--overwrite", action="store_true", help="replace existing output files")
    p.add_argument("--quiet", action="store_true", help="no per-case progress on stderr")


# ----------------------------------------------------------------------------------------------
# models


def build_models(a, names: Sequence[str]) -> Dict[str, torch.nn.Module]:
    from ..models import LanguageModel, LMConfig, TLinFormerConfig, TLinFormerLM

    w = a.history_window
    n_layers = a.n_blocks * a.inner_depth
    out: Dict[str, torch.nn.Module] = {}
    torch.manual_seed(a.seed)
    if "tlinformer" in names:
        out["tlinformer"] = TLinFormerLM(TLinFormerConfig(
            vocab_size=a.vocab_size, d_model=a.d_model, n_heads=a.n_heads, n_blocks=a.n_blocks,
            inner_depth=a.inner_depth, history_window=w, generation_window=a.generation_window,
            max_seq_len=max(2048, a.generation_window)))
    common_kw = dict(vocab_size=a.vocab_size, d_model=a.d_model, n_layers=n_layers, n_heads=a.n_heads,
                     max_seq_len=2048)
    if "softmax" in names:
        out["softmax"] = LanguageModel(LMConfig(mixer="softmax", **common_kw))
    if "linear" in names:
        out["linear"] = LanguageModel(LMConfig(mixer=a.linear_mixer, **common_kw))
    return {k: m.to(a.device).eval() for k, m in out.items()}


def lm_first_token(model, ids: torch.Tensor):
    """A LanguageModel's prefill with the head on the last token only: (logits [B, 1, V], cache)."""
    cache = model.new_cache()
    x = model.embed(ids)
    for block in model.blocks:
        x, _ = block(x, cache)
    x = x[:, -1:]
    if model.norm is not None:
        x = model.norm(x)
    logits = model.lm_head(x) if model.lm_head is not None else F.linear(x, model.embed.weight)
    cache.seen_tokens += ids.shape[1]
    return logits, cache


def first_token(name: str, model, ids: torch.Tensor):
    if name == "tlinformer":
        out = model(ids, use_cache=True, logits_to_keep=1)
        return out.logits, out.cache
    return lm_first_token(model, ids)


def synthetic_kv_cache(model, N: int, room: int, device):
    """A softmax LanguageModel's cache holding N tokens of random keys/values, each layer's
    KVCache allocated once with capacity N + room (appends are in place)."""
    from ..layers import KVCache

    cache = model.new_cache()
    g = torch.Generator(device="cpu").manual_seed(N)
    for i, block in enumerate(model.blocks):
        mixer = block.mixer
        kv = KVCache(chunk=N + room)
        k = torch.randn(1, N, mixer.n_heads, mixer.head_dim, generator=g).to(device)
        v = torch.randn(1, N, mixer.n_heads, mixer.head_dim_v, generator=g).to(device)
        kv.append(k, v)
        del k, v
        lc = cache.layer(i, "mixer")
        lc.kv, lc.offset = kv, N
    cache.seen_tokens = N
    return cache


def attention_floor(model, N: int, device):
    """A step function: n_layers bare SDPA calls (1 query, contiguous K/V of N tokens, no mask)."""
    m0 = model.blocks[0].mixer
    H, D = m0.n_heads, m0.head_dim
    g = torch.Generator(device="cpu").manual_seed(1)
    kvs = [(torch.randn(1, H, N, D, generator=g).to(device), torch.randn(1, H, N, D, generator=g).to(device))
           for _ in model.blocks]
    q = torch.randn(1, H, 1, D, generator=g).to(device)

    def step():
        for k, v in kvs:
            F.scaled_dot_product_attention(q, k, v)

    return step


# ----------------------------------------------------------------------------------------------
# measurement


def _stats(ms: List[float]) -> Dict[str, Any]:
    xs = sorted(ms)
    return {"median_ms": statistics.median(xs), "min_ms": xs[0], "max_ms": xs[-1], "n": len(xs)}


def _timed(fn, sync):
    sync()
    t0 = time.perf_counter()
    out = fn()
    sync()
    return out, (time.perf_counter() - t0) * 1e3


class Decoder:
    """One model at context N: its cache-miss timing, then one cache-hit step per `step()` call."""

    def __init__(self, name: str, model, N: int, a, sync):
        self.name, self.model, self.N, self.a, self.sync = name, model, N, a, sync
        self.rec: Dict[str, Any] = {"model": name, "N": N}
        self.hits: List[float] = []
        self.modes: List[str] = []

    @torch.no_grad()
    def prepare(self) -> None:
        a, name, N = self.a, self.name, self.N
        g = torch.Generator(device="cpu").manual_seed(a.seed + N)
        ids = torch.randint(0, a.vocab_size, (1, N + 1), generator=g).to(a.device)
        self.cache = None
        if name == "softmax" and a.max_miss_softmax and N > a.max_miss_softmax:
            self.rec["miss"] = None
            self.rec["miss_skipped"] = f"N > --max-miss-softmax {a.max_miss_softmax} (quadratic prefill)"
        else:
            ts = []
            for _ in range(a.miss_repeats):
                self.cache = None
                gc.collect()
                (self.logits, self.cache), t = _timed(lambda: first_token(name, self.model, ids), self.sync)
                ts.append(t)
                if t > 5000:  # a slow prefill is timed once
                    break
            self.rec["miss"] = _stats(ts)
            if name == "tlinformer":
                self.rec["miss_mode"] = self.cache.last_mode
        if name == "softmax":  # decode against a preallocated KV cache of N tokens (random contents)
            self.cache = None
            gc.collect()
            self.cache = synthetic_kv_cache(self.model, N, a.decode_steps + 2, a.device)
            self.logits = torch.zeros(1, 1, a.vocab_size, device=a.device)
        self.n_steps = 0

    @torch.no_grad()
    def step(self) -> None:
        tok = self.logits[:, -1].argmax(-1, keepdim=True)
        out, t = _timed(lambda: self.model(tok, cache=self.cache), self.sync)
        self.logits, self.cache = out.logits, out.cache
        if self.n_steps:  # the first step is a warm-up
            self.hits.append(t)
            if self.name == "tlinformer":
                self.modes.append(self.cache.last_mode)
        self.n_steps += 1

    def finish(self) -> Dict[str, Any]:
        rec = self.rec
        rec["hit"] = _stats(self.hits)
        if self.name == "tlinformer":
            rec["hit_modes"] = sorted(set(self.modes))
            rec["context_len"] = self.cache.context_len
        rec["cache_bytes"] = int(self.cache.nbytes())
        rec["seen_tokens"] = int(self.cache.seen_tokens)
        self.cache = None
        return rec


class Floor:
    """The softmax baseline's attention floor as a decoder-like object (no cache, no miss)."""

    def __init__(self, model, N: int, a, sync):
        self.N, self.sync, self.fn = N, sync, attention_floor(model, N, a.device)
        self.ts: List[float] = []

    def step(self) -> None:
        _, t = _timed(self.fn, self.sync)
        self.ts.append(t)

    def finish(self) -> Dict[str, Any]:
        return _stats(self.ts[1:])


def matvec_weights(model) -> List[torch.Tensor]:
    """Every distinct 2-D parameter of a model (a tied embedding / head once), detached."""
    seen, out = set(), []
    for p in model.parameters():
        if p.dim() == 2 and id(p) not in seen:
            seen.add(id(p))
            out.append(p.detach())
    return out


class MatvecFloor:
    """A model's matrix-vector floor as a decoder-like object: one `W @ x` (torch.mv) per 2-D weight
    of the model, every one read once from memory, as a decoding step reads them: the memory-bound
    floor of a step (at batch 1 a step cannot read less)."""

    def __init__(self, model, sync):
        self.sync = sync
        g = torch.Generator(device="cpu").manual_seed(2)
        self.ws = matvec_weights(model)
        self.xs = [torch.randn(w.shape[1], generator=g, dtype=w.dtype).to(w.device) for w in self.ws]
        self.ts: List[float] = []

    def _pass(self) -> None:
        for w, x in zip(self.ws, self.xs):
            torch.mv(w, x)

    def step(self) -> None:
        _, t = _timed(self._pass, self.sync)
        self.ts.append(t)

    def finish(self) -> Dict[str, Any]:
        return _stats(self.ts[1:])


def measure_N(models: Dict[str, torch.nn.Module], N: int, a, sync, log,
              matvec_floor: bool = False) -> List[Dict[str, Any]]:
    """All models at context N: each one's cache misses, then their decoding steps interleaved
    (model 1 step, model 2 step, ..., repeated), so that a change in the machine's load affects
    every model alike. matvec_floor: each model's step is followed by its `MatvecFloor` pass, and
    the record gets "matvec_floor" and "step_over_floor" (median step / median floor)."""
    decs, recs = [], []
    for name, m in models.items():
        d = Decoder(name, m, N, a, sync)
        try:
            d.prepare()
            decs.append(d)
        except (RuntimeError, MemoryError) as e:  # out of memory: record and go on
            msg = " ".join(str(e).split())[:200]
            log(f"  {LABEL.get(name, name):<20} N={N:>7}: FAILED {type(e).__name__}: {msg}")
            recs.append({"model": name, "N": N, "error": f"{type(e).__name__}: {msg}"})
            gc.collect()
    floor = Floor(models["softmax"], N, a, sync) if "softmax" in models else None
    mv = {d.name: MatvecFloor(d.model, sync) for d in decs} if matvec_floor else {}
    runners = [r for d in decs for r in ((d, mv[d.name]) if d.name in mv else (d,))]
    runners += [floor] if floor is not None else []
    for _ in range(a.decode_steps + 1):
        for r in runners:
            r.step()
    for d in decs:
        rec = d.finish()
        if d.name == "softmax":
            rec["attn_floor"] = floor.finish()
            rec["attn_floor_ms"] = rec["attn_floor"]["median_ms"]
        extra = ""
        if d.name in mv:
            rec["matvec_floor"] = mv[d.name].finish()
            rec["step_over_floor"] = rec["hit"]["median_ms"] / rec["matvec_floor"]["median_ms"]
            extra = f", floor {common.fmt_ms(rec['matvec_floor']['median_ms'])} ms (x{rec['step_over_floor']:.2f})"
        recs.append(rec)
        miss = rec["miss"]["median_ms"] if rec["miss"] else None
        log(f"  {LABEL.get(d.name, d.name):<20} N={N:>7}: miss {common.fmt_ms(miss):>8} ms, hit "
            f"{common.fmt_ms(rec['hit']['median_ms']):>8} ms (min {common.fmt_ms(rec['hit']['min_ms'])}), "
            f"cache {fmt_mib(rec['cache_bytes'])} MiB{extra}")
    del decs, floor, runners, mv
    gc.collect()
    return recs


def fmt_mib(b: Optional[int]) -> str:
    if b is None:
        return "-"
    mib = b / 2 ** 20
    return common.fmt_bytes(b) if mib >= 1 else f"{mib:.3f}"


@torch.no_grad()
def trace(model, N: int, a, sync) -> Dict[str, Any]:
    """Per-token latency of TLinFormer decoding 2 W_og + 2 tokens from an N-token context."""
    g = torch.Generator(device="cpu").manual_seed(a.seed + 7)
    ids = torch.randint(0, a.vocab_size, (1, N), generator=g).to(a.device)
    steps = 2 * a.generation_window + 2
    ms, modes, pos = [], [], []
    sync()
    t0 = time.perf_counter()
    out = model(ids, use_cache=True, logits_to_keep=1)
    sync()
    ms.append((time.perf_counter() - t0) * 1e3)
    modes.append(out.cache.last_mode)
    pos.append(N)
    for _ in range(steps - 1):
        tok = out.logits[:, -1].argmax(-1, keepdim=True)
        sync()
        t0 = time.perf_counter()
        out = model(tok, cache=out.cache)
        sync()
        ms.append((time.perf_counter() - t0) * 1e3)
        modes.append(out.cache.last_mode)
        pos.append(out.cache.seen_tokens)
    hits = [t for t, m in zip(ms, modes) if m == "hit"]
    misses = [t for t, m in zip(ms, modes) if m == "miss"]
    return {"N": N, "ms": ms, "modes": modes, "seen_tokens": pos,
            "hit_median_ms": statistics.median(hits) if hits else None,
            "miss_median_ms": statistics.median(misses) if misses else None,
            "amortised_ms": sum(ms[1:]) / max(1, len(ms) - 1)}


# ----------------------------------------------------------------------------------------------
# analysis


def growth(Ns: Sequence[int], ts: Sequence[Optional[float]], min_N: int = 8192) -> Dict[str, Any]:
    """Least-squares slope of log t against log N over N >= min_N (1 = linear, 2 = quadratic),
    and the largest t(2N) / t(N) between measured neighbours there."""
    pts = [(n, t) for n, t in zip(Ns, ts) if t is not None and t > 0 and n >= min_N]
    if len(pts) < 2:
        return {"exponent": None, "max_doubling_ratio": None, "points": len(pts)}
    xs = [math.log(n) for n, _ in pts]
    ys = [math.log(t) for _, t in pts]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx > 0 else None
    ratios = [(t2 / t1) ** (math.log(2) / math.log(n2 / n1)) for (n1, t1), (n2, t2) in zip(pts, pts[1:])]
    return {"exponent": slope, "max_doubling_ratio": max(ratios), "doubling_ratios": ratios, "points": len(pts),
            "from_N": pts[0][0]}


def predicted_tlin_bytes(a, N: int) -> int:
    """Bytes the TLinFormer cache should hold at history N (fp32), from its layout."""
    from ..models.tlinformer import auto_history_window

    d, L = a.d_model, a.n_blocks * a.inner_depth
    W = min(auto_history_window(N) if a.history_window == "auto" else int(a.history_window), N)
    kv = 2 * 4 * d
    return a.n_blocks * N * kv + (L - a.n_blocks) * W * kv + L * a.generation_window * kv


def _fmt_x(x: Optional[float], digits: int = 1) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{x:.{digits}f}x"


# ----------------------------------------------------------------------------------------------
# run


def _model_names(a) -> List[str]:
    """The --models list, validated."""
    names = [s.strip() for s in a.models.split(",") if s.strip()]
    bad = [n for n in names if n not in MODELS]
    if bad or not names:
        raise UsageError(f"--models: unknown {bad}; choose from {', '.join(MODELS)}", prog=PROG)
    return names


def _check_args(a, names: Sequence[str]) -> None:
    """Validate the numeric arguments; --history-window becomes an int unless it is 'auto'."""
    if any(n < 1 for n in a.N):
        raise UsageError("--N: context lengths must be >= 1", prog=PROG)
    if a.history_window != "auto":
        try:
            a.history_window = int(a.history_window)
        except ValueError:
            raise UsageError(f"--history-window must be an int or 'auto', got {a.history_window!r}",
                             prog=PROG) from None
    if a.decode_steps < 1 or a.miss_repeats < 1:
        raise UsageError("--decode-steps and --miss-repeats must be >= 1", prog=PROG)
    if "tlinformer" in names and a.decode_steps + 1 >= a.generation_window:
        raise UsageError(f"--decode-steps ({a.decode_steps}) + 1 must be < W_og ({a.generation_window}) so that "
                         f"every timed TLinFormer step is a cache hit", prog=PROG)


def _build_models_for_cli(a, names: Sequence[str]) -> Dict[str, torch.nn.Module]:
    """`build_models`, a bad configuration reported as a usage error."""
    try:
        return build_models(a, names)
    except ValueError as e:
        raise UsageError(str(e), prog=PROG) from None


def _run_config(a, models: Dict[str, torch.nn.Module]) -> Dict[str, Any]:
    """The shape of the compared models (the JSON's "config")."""
    return {"d_model": a.d_model, "n_heads": a.n_heads, "n_layers": a.n_blocks * a.inner_depth,
            "n_blocks": a.n_blocks, "inner_depth": a.inner_depth, "H": a.inner_depth - 2,
            "W_oh": a.history_window, "W_og": a.generation_window, "vocab_size": a.vocab_size,
            "linear_mixer": a.linear_mixer, "batch": 1, "dtype": "float32",
            "params": {k: m.num_parameters() for k, m in models.items()}}


def _header_lines(a, info: Dict[str, Any], config: Dict[str, Any]) -> List[str]:
    """The report's head: the machine, the models and how they are timed."""
    H, L = config["H"], config["n_layers"]
    return [
        PROG,
        common.describe_machine(info),
        f"models   d_model {a.d_model}, {a.n_heads} heads, {L} layers each, SwiGLU, batch 1, fp32, random weights; "
        + ", ".join(f"{LABEL[k]} {v / 1e6:.2f}M params" for k, v in config["params"].items()),
        f"         TLinFormer: {a.n_blocks} blocks x inner depth {a.inner_depth} (H = {H}), W_oh = {a.history_window}, "
        f"W_og = {a.generation_window}; linear LM mixer {a.linear_mixer}",
        f"         softmax baseline: KV cache preallocated (capacity N + {a.decode_steps + 2}, in-place appends); "
        f"hit timings on a cache of random K/V; prefill (miss) up to N = {a.max_miss_softmax or 'any'}",
        f"timing   miss: median of {a.miss_repeats} first-token calls on a new (N+1)-token prompt (1 if it takes "
        f"> 5 s); hit: median of {a.decode_steps} decoding steps after 1 warm-up; {torch.get_num_threads()} thread(s)",
    ]


@torch.no_grad()
def _warm_up(models: Dict[str, torch.nn.Module], a, smallest_N: int) -> None:
    """One first token per model (allocator, thread pools, kernels) at the smallest N (at most 1024)."""
    for name, m in models.items():
        ids = torch.randint(0, a.vocab_size, (1, min(smallest_N, 1024) + 1)).to(a.device)
        _, c = first_token(name, m, ids)
        del c


@torch.no_grad()
def _check_first_token(models: Dict[str, torch.nn.Module], a) -> None:
    """Sanity: the last-token prefill equals the models' own forward."""
    ids = torch.randint(0, a.vocab_size, (1, 300)).to(a.device)
    for name, m in models.items():
        lg, _ = first_token(name, m, ids)
        ref = m(ids).logits[:, -1:]
        err = float((lg - ref).abs().max())
        if err > 1e-4:
            raise RuntimeError(f"{name}: last-token prefill differs from forward by {err:.2e}")


def _measure_all(models: Dict[str, torch.nn.Module], Ns: Sequence[int], a, sync, log):
    """Every N's records, the per-token trace (or None) and the seconds both took."""
    t_start = time.perf_counter()
    records: List[Dict[str, Any]] = []
    for N in Ns:
        records += measure_N(models, N, a, sync, log)
    tr = None
    if a.trace_N and "tlinformer" in models:
        tr = trace(models["tlinformer"], a.trace_N, a, sync)
    return records, tr, time.perf_counter() - t_start


def _record_getter(records: List[Dict[str, Any]]):
    """get(name, N, key, stat): a record's value, the `stat` of a timing, None if absent or failed."""
    def get(name, N, key, stat="median_ms"):
        for r in records:
            if r["model"] == name and r["N"] == N and "error" not in r:
                v = r.get(key)
                if isinstance(v, dict):
                    return v[stat]
                return v
        return None

    return get


# ---- the table


def _table_headers(names: Sequence[str]) -> List[str]:
    headers = ["N"]
    for name in names:
        headers += [f"{SHORT[name]} miss ms", f"{SHORT[name]} hit ms", f"{SHORT[name]} MiB"]
    if "softmax" in names:
        headers.append("sm attn floor ms")
    if "tlinformer" in names and "softmax" in names:
        headers += ["hit speedup", "miss speedup", "mem ratio"]
    return headers


def _comparison_cells(N: int, get) -> List[str]:
    """Softmax / TLinFormer at N: hit speedup, miss speedup, and TLinFormer / softmax cache bytes."""
    th, sh = get("tlinformer", N, "hit"), get("softmax", N, "hit")
    tm, sm = get("tlinformer", N, "miss"), get("softmax", N, "miss")
    tb, sb = get("tlinformer", N, "cache_bytes"), get("softmax", N, "cache_bytes")
    return [_fmt_x(sh / th if th and sh else None), _fmt_x(sm / tm if tm and sm else None),
            f"{tb / sb:.3f}" if tb and sb else "-"]


def _table_row(N: int, names: Sequence[str], get) -> List[Any]:
    row: List[Any] = [N]
    for name in names:
        row += [common.fmt_ms(get(name, N, "miss")), common.fmt_ms(get(name, N, "hit"))]
        row.append(fmt_mib(get(name, N, "cache_bytes")))
    if "softmax" in names:
        row.append(common.fmt_ms(get("softmax", N, "attn_floor_ms")))
    if "tlinformer" in names and "softmax" in names:
        row += _comparison_cells(N, get)
    return row


def _results_table(names: Sequence[str], Ns: Sequence[int], get) -> str:
    return common.format_table(_table_headers(names), [_table_row(N, names, get) for N in Ns])


# ---- the summary: each part gives (summary entries, report lines)

Part = Tuple[Dict[str, Any], List[str]]


def _growth_line(label: str, gr: Dict[str, Any]) -> Optional[str]:
    """The verdict on a latency's growth with N (None without enough points)."""
    if gr["exponent"] is None:
        return None
    verdict = ("at most linear" if gr["exponent"] <= 1.1 else
               "about linear (above 1.1: see the ratios)" if gr["exponent"] <= 1.3 else
               "FASTER THAN LINEAR")
    return (f"TLinFormer {label} latency vs N (N >= {gr['from_N']}): log-log slope {gr['exponent']:.2f} "
            f"(1 = linear, 2 = quadratic); growth per doubling of N "
            f"{' '.join(f'{r:.2f}' for r in gr['doubling_ratios'])} -> {verdict}")


def _tlinformer_summary(a, Ns: Sequence[int], records: List[Dict[str, Any]], get) -> Part:
    """TLinFormer alone: cache modes, latency growth with N, cache bytes against its layout."""
    gh = growth(Ns, [get("tlinformer", N, "hit") for N in Ns])
    gm = growth(Ns, [get("tlinformer", N, "miss") for N in Ns])
    modes_ok = all(r.get("hit_modes") == ["hit"] and r.get("miss_mode") == "miss"
                   for r in records if r["model"] == "tlinformer" and "error" not in r)
    lines = [f"TLinFormer modes: every timed miss was a cache miss and every timed hit a cache hit: {modes_ok}"]
    lines += [line for line in (_growth_line("cache-hit", gh), _growth_line("cache-miss", gm)) if line is not None]
    layout = [{"N": N, "measured": get("tlinformer", N, "cache_bytes"), "kv_layout": predicted_tlin_bytes(a, N)}
              for N in Ns]
    summary = {"tlinformer_hit_growth": gh, "tlinformer_miss_growth": gm, "tlinformer_modes_ok": modes_ok,
               "tlinformer_bytes_vs_layout": layout}
    return summary, lines


def _hit_speedup_summary(get, Nb: int) -> Part:
    """Softmax / TLinFormer cache-hit latency at Nb, the largest N both ran."""
    s_hit, t_hit = get("softmax", Nb, "hit"), get("tlinformer", Nb, "hit")
    sp = s_hit / t_hit
    floor = get("softmax", Nb, "attn_floor_ms")
    sp_min = get("softmax", Nb, "hit", "min_ms") / get("tlinformer", Nb, "hit", "min_ms")
    summary = {"hit_speedup_largest_N": {"N": Nb, "speedup": sp, "speedup_of_min_times": sp_min,
                                         "vs_attention_floor": floor / t_hit}}
    line = (f"cache-hit speedup over the softmax baseline at N = {Nb} (largest N both ran): {sp:.1f}x "
            f"({s_hit:.1f} ms -> {t_hit:.2f} ms; {sp_min:.1f}x "
            f"from the fastest steps); against the baseline's bare-attention floor ({floor:.1f} ms): "
            f"{floor / t_hit:.1f}x")
    return summary, [line]


def _target_64k_summary(a, get, n0: int) -> Part:
    """The target (cache hit at N = 65536 >= 5x faster than the softmax baseline), and the caveat."""
    N, L = 65536, a.n_blocks * a.inner_depth
    s_hit, t_hit, s_floor = get("softmax", N, "hit"), get("tlinformer", N, "hit"), get("softmax", N, "attn_floor_ms")
    sp64 = s_hit / t_hit
    sp64_min = get("softmax", N, "hit", "min_ms") / get("tlinformer", N, "hit", "min_ms")
    # an optimised softmax decoder costs at least its attention floor plus its non-attention work
    # per token (estimated as the baseline's hit minus its floor at the smallest N, n0)
    rest = max(0.0, get("softmax", n0, "hit") - get("softmax", n0, "attn_floor_ms"))
    opt64 = s_floor + rest
    summary = {"hit_speedup_64k": {"median": sp64, "min": sp64_min, "vs_attention_floor": s_floor / t_hit,
                                   "vs_estimated_optimised_baseline": opt64 / t_hit}}
    lines = [f"target: cache hit at N = 65536 >= 5x faster than the softmax baseline's decode: "
             f"{sp64:.1f}x (median), {sp64_min:.1f}x (fastest steps) -> "
             f"{'met' if sp64 >= 5 else 'NOT MET'}",
             f"  caveat: the baseline's decode step costs {s_hit / s_floor:.1f}x "
             f"its bare-attention floor at N = 65536 (its masked SDPA over a strided KV buffer); against "
             f"an optimised softmax decoder, estimated as floor + non-attention work ({opt64:.0f} ms), "
             f"TLinFormer's hit is {common.speed_ratio(opt64, t_hit)} "
             f"(the layer-count bound is {L}/{a.n_blocks} = {L / a.n_blocks:.0f}x)"]
    return summary, lines


def _memory_summary(a, Ns: Sequence[int], get) -> Part:
    """TLinFormer / softmax cache bytes per N, against the paper's 1/(H+2)."""
    H, L = a.inner_depth - 2, a.n_blocks * a.inner_depth
    mem = [(N, get("tlinformer", N, "cache_bytes") / get("softmax", N, "cache_bytes")) for N in Ns
           if get("tlinformer", N, "cache_bytes") and get("softmax", N, "cache_bytes")]
    if not mem:
        return {}, []
    line = (f"cache memory TLinFormer / softmax: {mem[-1][1]:.3f} at N = {mem[-1][0]} "
            f"({mem[0][1]:.3f} at N = {mem[0][0]}); the paper predicts 1/(H+2) = {1 / (H + 2):.3f} "
            f"for N >> W (only the {a.n_blocks} compress layers keep O(N) keys/values, the "
            f"softmax baseline all {L} layers; the rest is O(W_oh + W_og) per layer + the token ids)")
    return {"memory_ratio": {str(n): r for n, r in mem}}, [line]


def _miss_speedup_summary(Ns: Sequence[int], get) -> Part:
    """Softmax / TLinFormer prefill latency at the largest N both ran."""
    misses = [N for N in Ns if get("tlinformer", N, "miss") and get("softmax", N, "miss")]
    if not misses:
        return {}, []
    Nm = misses[-1]
    speedup = get("softmax", Nm, "miss") / get("tlinformer", Nm, "miss")
    line = f"cache-miss (prefill) speedup over the softmax baseline at N = {Nm}: {speedup:.1f}x"
    return {"miss_speedup_largest_N": {"N": Nm, "speedup": speedup}}, [line]


def _vs_softmax_parts(a, Ns: Sequence[int], get) -> List[Part]:
    """TLinFormer against the softmax baseline: hit speedups, cache memory, miss speedup."""
    parts = []
    both = [N for N in Ns if get("tlinformer", N, "hit") and get("softmax", N, "hit")]
    if both:
        parts.append(_hit_speedup_summary(get, both[-1]))
    if 65536 in both:
        parts.append(_target_64k_summary(a, get, both[0]))
    parts += [_memory_summary(a, Ns, get), _miss_speedup_summary(Ns, get)]
    return parts


def _linear_lines(Ns: Sequence[int], get) -> List[str]:
    """The linear LM against TLinFormer at the largest N."""
    Nl = Ns[-1]
    lh, th = get("linear", Nl, "hit"), get("tlinformer", Nl, "hit")
    if not (lh and th):
        return []
    return [f"linear LM at N = {Nl}: hit {lh:.2f} ms (constant in N), cache "
            f"{fmt_mib(get('linear', Nl, 'cache_bytes'))} MiB (constant); TLinFormer hit / linear hit "
            f"= {th / lh:.1f}"]


def _trace_line(tr: Dict[str, Any]) -> str:
    return (f"trace at N = {tr['N']}: {tr['modes'].count('miss')} misses in {len(tr['ms'])} tokens, "
            f"miss median {common.fmt_ms(tr['miss_median_ms'])} ms, "
            f"hit median {common.fmt_ms(tr['hit_median_ms'])} ms, "
            f"amortised {common.fmt_ms(tr['amortised_ms'])} ms/token over the decoded tokens")


def _summarize(a, names: Sequence[str], Ns: Sequence[int], records: List[Dict[str, Any]],
               tr: Optional[Dict[str, Any]], elapsed: float, get) -> Part:
    """The JSON's "summary" and the report's closing lines."""
    parts: List[Part] = []
    if "tlinformer" in names:
        parts.append(_tlinformer_summary(a, Ns, records, get))
    if "tlinformer" in names and "softmax" in names:
        parts += _vs_softmax_parts(a, Ns, get)
    if "linear" in names and "tlinformer" in names:
        parts.append(({}, _linear_lines(Ns, get)))
    if tr is not None:
        parts.append(({}, [_trace_line(tr)]))
    summary: Dict[str, Any] = {}
    lines: List[str] = []
    for part_summary, part_lines in parts:
        summary.update(part_summary)
        lines += part_lines
    lines.append(f"benchmark time {elapsed:.0f} s")
    return summary, lines


# ---- the run


def _write_outputs(paths, a, text: str, result: Dict[str, Any], names: Sequence[str], Ns: Sequence[int],
                   get) -> None:
    """The report (.txt), the measurements (.json), then the figure (.png; a failure is only reported)."""
    atomic_write_text(paths["txt"], text)
    write_json(paths["json"], result)
    plot_note = save_figure(paths["png"], lambda p: plot(p, a, Ns, names, get, result["trace"]))
    print(f"\nwrote {paths['txt']}, {paths['json']}, {plot_note}")


def run(a) -> int:
    """Run the `linattn bench tlinformer` benchmark (module docstring).

    Args:
        a: The options parsed with `add_arguments` (`linattn bench tlinformer --help` lists them).

    Returns:
        The exit code (0: success).

    Raises:
        UsageError: Bad options.
    """
    names = _model_names(a)
    _check_args(a, names)
    a.threads, log = common.start_run(a.threads, a.device, a.quiet)
    Ns = sorted(set(a.N))
    sync = common.synchronizer(a.device)
    models = _build_models_for_cli(a, names)
    paths = common.output_paths("tlinformer", a.out, overwrite=a.overwrite, stem=a.name)
    info = common.machine_info(a.device)
    config = _run_config(a, models)
    head = _header_lines(a, info, config)
    print("\n".join(head))
    print()

    _warm_up(models, a, Ns[0])
    _check_first_token(models, a)
    records, tr, elapsed = _measure_all(models, Ns, a, sync, log)
    get = _record_getter(records)

    table = _results_table(names, Ns, get)
    print(table)
    print()
    summary, lines = _summarize(a, names, Ns, records, tr, elapsed, get)
    print("\n".join(lines))

    text = "\n".join(head) + "\n\n" + table + "\n\n" + "\n".join(lines) + "\n"
    result = {"benchmark": "tlinformer", "machine": info, "config": config,
              "args": vars(a), "records": records, "trace": tr, "summary": summary}
    _write_outputs(paths, a, text, result, names, Ns, get)
    return 0


def plot(path, a, Ns, names, get, tr) -> None:
    lat = []
    for name in names:
        lat.append({"label": f"{LABEL[name]}: miss", "x": Ns, "y": [get(name, N, "miss") for N in Ns],
                    "color": COLOR[name], "linestyle": "-"})
        lat.append({"label": f"{LABEL[name]}: hit", "x": Ns, "y": [get(name, N, "hit") for N in Ns],
                    "color": COLOR[name], "linestyle": "--", "marker": "s"})
    if "softmax" in names:
        lat.append({"label": "softmax attention floor", "x": Ns, "y": [get("softmax", N, "attn_floor_ms") for N in Ns],
                    "color": "grey", "linestyle": ":", "marker": "."})
    panels = [{"title": "(a,b) per-token latency: cache miss / hit", "xlabel": "context N", "ylabel": "ms",
               "series": lat}]
    util = []
    for name in names:
        util.append({"label": LABEL[name], "x": Ns,
                     "y": [(get(name, N, "miss") / get(name, N, "hit")) if get(name, N, "miss") and get(name, N, "hit")
                           else None for N in Ns], "color": COLOR[name]})
    panels.append({"title": "(c,d) cache utility: miss latency / hit latency", "xlabel": "context N",
                   "ylabel": "x", "series": util, "hline": 1.0})
    panels.append({"title": "(e) cache memory", "xlabel": "context N", "ylabel": "MiB",
                   "series": [{"label": LABEL[n], "x": Ns,
                               "y": [(get(n, N, "cache_bytes") or 0) / 2 ** 20 or None for N in Ns],
                               "color": COLOR[n]} for n in names]})
    if "tlinformer" in names and "softmax" in names:
        sp = [{"label": "cache hit: softmax / TLinFormer", "x": Ns,
               "y": [(get("softmax", N, "hit") / get("tlinformer", N, "hit")) if get("softmax", N, "hit")
                     and get("tlinformer", N, "hit") else None for N in Ns], "color": "C3", "linestyle": "--"},
              {"label": "cache miss: softmax / TLinFormer", "x": Ns,
               "y": [(get("softmax", N, "miss") / get("tlinformer", N, "miss")) if get("softmax", N, "miss")
                     and get("tlinformer", N, "miss") else None for N in Ns], "color": "C3"}]
        panels.append({"title": "(f) TLinFormer speed-up over softmax + KV cache", "xlabel": "context N",
                       "ylabel": "x", "series": sp, "hline": 5.0})
    if tr is not None:
        xs = list(range(len(tr["ms"])))
        panels.append({"title": f"TLinFormer per-token latency decoding from N = {tr['N']}",
                       "xlabel": "generated token",
                       "ylabel": "ms", "logx": False, "logy": True,
                       "series": [{"label": "per token (peaks: window slides = miss)", "x": xs, "y": tr["ms"],
                                   "color": "C3", "marker": "."}]})
    title = (f"TLinFormer vs softmax+KV cache vs linear LM: d={a.d_model}, {a.n_heads} heads, "
             f"{a.n_blocks * a.inner_depth} layers (TLin {a.n_blocks}x{a.inner_depth}, W_oh={a.history_window}, "
             f"W_og={a.generation_window}), batch 1, fp32, {a.device}")
    common.plot_panels(path, panels, title=title)
