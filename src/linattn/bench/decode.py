"""`linattn bench decode`: per-token decoding latency and cache bytes against context length.

One `LanguageModel` per mixer (same width, depth and SwiGLU FFN, random weights, batch 1, fp32).
Per context N and mixer:

* prefill (cache miss): the first token of a new (N+1)-token prompt, i.e. the chunk form over
  the prompt with the head on the last token only;
* decode (cache hit): the median latency of the next single-token steps with the cache
  (linear mixers: one recurrent step on their constant-size state; softmax: one token against
  a KV cache of N tokens);
* cache bytes: `cache.nbytes()` (every tensor the cache holds, capacity included);
* floor: the floor of `linattn bench infer` (one definition): the bytes a decoded token reads (every weight
  once in its stored dtype, the embedding as one row, a tied head once) over the read bandwidth measured by
  `bench infer`'s compiled read of a buffer of at least 4x the last-level cache (the fastest of 3 passes), once
  per context N between the models' timings; the table gives step / floor;
* mv: one `W @ x` (torch.mv) over every 2-D weight, timed right after each decoding step (what torch's own
  matrix-vector products take to read the same weights);
* prefill tok/s: the N + 1 prompt tokens over the prefill time.

The softmax baseline's KV cache is preallocated (capacity N + the steps, in-place appends), and
for its decoding timings it holds random keys/values instead of running the quadratic prefill
(the cost of a step does not depend on the values); its prefill is timed up to --max-miss-softmax.
The measurement loop (interleaved decoding across models, so load changes hit them alike) is the
one of `linattn bench tlinformer`.
"""
from __future__ import annotations

import time
from typing import Any, Dict, List, Sequence

import torch

from ..cli_support import UsageError, int_at_least
from ..io import atomic_write_text, write_json
from ..plotting import save_figure
from . import common
from .tlinformer import first_token, fmt_mib, measure_N

DESCRIPTION = __doc__
DEFAULT_MIXERS = "softmax,linear-elu+1,ela-hadamard_exp,retnet,gla,deltanet,gated-deltanet,efla,kda,mamba2"
DEFAULT_N = [1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072]
PROG = "linattn bench decode"
TORCH_SUFFIX = "+torch"   # --decode-step both: the twin model decoding by the PyTorch fast step
BLOCK_SUFFIX = "+block"   # --decode-step all: the twin decoding block by block (one compiled call per block)


def add_arguments(p) -> None:
    """The options of `linattn bench decode`.

    Args:
        p: The argparse parser to add them to.
    """
    p.add_argument("--mixers", default=DEFAULT_MIXERS, help=f"comma list of mixer names (default {DEFAULT_MIXERS})")
    p.add_argument("--N", type=int, nargs="+", default=DEFAULT_N, metavar="N",
                   help="context lengths (default 1024 ... 131072, powers of two)")
    p.add_argument("--d-model", type=int, default=64, help="width (default 64)")
    p.add_argument("--n-layers", type=int, default=2, help="layers (default 2)")
    p.add_argument("--n-heads", type=int, default=4, help="heads (default 4)")
    p.add_argument("--vocab-size", type=int, default=512, help="(default 512)")
    p.add_argument("--decode-steps", type=int, default=8,
                   help="timed decoding steps per N (default 8, after 1 warm-up)")
    p.add_argument("--miss-repeats", type=int, default=1, help="timed prefills per N (default 1)")
    p.add_argument("--max-miss-softmax", type=int, default=4096,
                   help="largest N for the softmax prefill (quadratic; default 4096, 0 = no cap)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:i] (default cpu)")
    p.add_argument("--threads", type=int_at_least(0), default=None,
                   help="torch.set_num_threads (default 1 on cpu, for steadier timings on a shared machine; "
                        "0 = torch's default)")
    p.add_argument("--decode-step", choices=("auto", "torch", "both", "all"), default="auto",
                   help="the linear mixers' single-token step: auto (the compiled CPU step where it covers the "
                        "layer: one call for the whole model, else one per block, else PyTorch), torch (the PyTorch "
                        "fast step), both (each mixer twice, the PyTorch one named <mixer>+torch, interleaved), all "
                        "(also <mixer>+block: one compiled call per block; default auto)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights and prompts (default 0)")
    p.add_argument("--bandwidth-mib", type=int_at_least(1), default=None,
                   help="size of the floor's bandwidth buffer (default: 4x the last-level cache, at least 64 MiB)")
    p.add_argument("--out", default=None, help="output folder (default results/bench/decode/)")
    p.add_argument("--overwrite", action="store_true", help="replace existing output files")
    p.add_argument("--quiet", action="store_true", help="no per-case progress on stderr")


def build_models(a, names) -> Dict[str, torch.nn.Module]:
    from ..layers.base import AttentionBase
    from ..layers.mamba2 import Mamba2Block
    from ..models import LanguageModel, LMConfig

    out = {}
    for name in names:
        mixer = name
        for suffix in (TORCH_SUFFIX, BLOCK_SUFFIX):
            mixer = mixer[:-len(suffix)] if mixer.endswith(suffix) else mixer
        torch.manual_seed(a.seed)
        model = LanguageModel(LMConfig(vocab_size=a.vocab_size, d_model=a.d_model, n_layers=a.n_layers,
                                       n_heads=a.n_heads, mixer=mixer, max_seq_len=2048)).to(a.device).eval()
        if name.endswith(TORCH_SUFFIX) or getattr(a, "decode_step", "auto") == "torch":
            for m in model.modules():   # the PyTorch fast step (layers/base.py), not the compiled one
                if isinstance(m, (AttentionBase, Mamba2Block)):   # (Mamba2: its PyTorch forward)
                    m.compiled_decode = False
        if name.endswith(BLOCK_SUFFIX):
            model.compiled_decode = False   # block by block (models/decode_plan.block_token)
        out[name] = model
    return out


def _with_torch_twins(a, names: List[str]) -> List[str]:
    """--decode-step both: each mixer with a compiled step is followed by its PyTorch twin <mixer>+torch; all: by
    <mixer>+block too."""
    mode = getattr(a, "decode_step", "auto")
    if mode not in ("both", "all"):
        return names
    out = []
    for n in names:
        out.append(n)
        if n != "softmax":
            out += [n + BLOCK_SUFFIX] if mode == "all" else []
            out.append(n + TORCH_SUFFIX)
    return out


def _mixer_names(a) -> List[str]:
    """The --mixers list, validated together with --N, --decode-steps and --miss-repeats."""
    from ..models import mixers

    names = [s.strip() for s in a.mixers.split(",") if s.strip()]
    bad = [n for n in names if n not in mixers()]
    if bad or not names:
        raise UsageError(f"--mixers: unknown {bad}; choose from {', '.join(mixers())}", prog=PROG)
    if any(n < 1 for n in a.N) or a.decode_steps < 1 or a.miss_repeats < 1:
        raise UsageError("--N, --decode-steps and --miss-repeats must be >= 1", prog=PROG)
    return names


def _header_lines(a, info: Dict[str, Any]) -> List[str]:
    """The report's head: the machine, the models and how they are timed."""
    return [PROG, common.describe_machine(info),
            f"models   d_model {a.d_model}, {a.n_heads} heads, {a.n_layers} layers, SwiGLU, batch 1, fp32, "
            f"random weights",
            f"softmax  KV cache preallocated (capacity N + {a.decode_steps + 2}); decoding timed on random K/V; "
            f"prefill timed up to N = {a.max_miss_softmax or 'any'}",
            f"timing   decode: median of {a.decode_steps} steps after 1 warm-up, models interleaved; "
            f"{torch.get_num_threads()} thread(s)",
            "floor    decode bytes (stored dtype, embedding row, tied head once) / read bandwidth (bench infer's "
            "compiled read of >= 4x the LLC, best of 3 passes, once per N); step/floor = median decode / floor; "
            "mv = one torch.mv over every 2-D weight after "
            "each step"]


@torch.no_grad()
def _warm_up(models: Dict[str, torch.nn.Module], a, smallest_N: int) -> None:
    """One first token per model (allocator, thread pools) at the smallest N (at most 512)."""
    for name, m in models.items():
        first_token(name, m, torch.randint(0, a.vocab_size, (1, min(smallest_N, 512) + 1)).to(a.device))


def _measure_all(models: Dict[str, torch.nn.Module], Ns: Sequence[int], a, sync, log):
    """Every N's records and the seconds they took; each record's floor is `bench infer`'s (decode bytes / the read
    bandwidth measured right after that N's timings)."""
    from .infer import ReadBandwidth, model_decode_bytes

    t0 = time.perf_counter()
    bw = ReadBandwidth(None if getattr(a, "bandwidth_mib", None) is None else a.bandwidth_mib << 20)
    nbytes = {name: model_decode_bytes(m) for name, m in models.items()}
    records: List[Dict[str, Any]] = []
    for N in Ns:
        recs = measure_N(models, N, a, sync, log, matvec_floor=True)
        rate = bw.once()
        for rec in recs:
            if "error" in rec or rec.get("model") not in nbytes:
                continue
            rec["decode_bytes"], rec["bandwidth_gbs"] = nbytes[rec["model"]], rate / 1e9
            rec["floor_ms"] = nbytes[rec["model"]] / rate * 1e3
            hit = rec.get("hit")
            if isinstance(hit, dict):
                rec["step_over_floor"] = hit["median_ms"] / rec["floor_ms"]
        records += recs
    return records, time.perf_counter() - t0


def _record_getter(records: List[Dict[str, Any]]):
    """get(name, N, key): a record's value (a timing's median), None if absent or failed."""
    def get(name, N, key):
        for r in records:
            if r["model"] == name and r["N"] == N and "error" not in r:
                v = r.get(key)
                return v["median_ms"] if isinstance(v, dict) else v
        return None

    return get


def _growth_lines(names: Sequence[str], Ns: Sequence[int], get) -> List[str]:
    """Decode time and cache bytes at the largest N over the smallest, per mixer."""
    lines = []
    for name in names:
        t_lo, t_hi = get(name, Ns[0], "hit"), get(name, Ns[-1], "hit")
        b_lo, b_hi = get(name, Ns[0], "cache_bytes"), get(name, Ns[-1], "cache_bytes")
        if None not in (t_lo, t_hi, b_lo, b_hi):
            lines.append(f"{name:<18} N {Ns[0]} -> {Ns[-1]}: decode x{t_hi / t_lo:.2f}, cache bytes x{b_hi / b_lo:.2f}")
    return lines


def _speedup_lines(names: Sequence[str], Ns: Sequence[int], get) -> List[str]:
    """Each mixer's decoding speed against softmax + KV cache at the largest N ("2.5x faster", or
    "2.5x slower" when it is slower)."""
    soft_hi = get("softmax", Ns[-1], "hit")
    if not soft_hi:
        return []
    lines = []
    for name in names:
        t = get(name, Ns[-1], "hit")
        if name != "softmax" and t:
            lines.append(f"at N = {Ns[-1]}: {name} decodes {common.speed_ratio(soft_hi, t)} than softmax + KV cache")
    return lines


def _tok_per_s(N: int, miss_ms) -> str:
    """Prefill throughput: the N + 1 prompt tokens over the prefill time."""
    return "-" if not miss_ms else f"{(N + 1) / (miss_ms / 1e3):,.0f}"


def _fmt_ratio(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def _report(names: Sequence[str], Ns: Sequence[int], get, elapsed: float) -> str:
    """The table, then the claim to check: linear mixers decode in constant time and memory,
    softmax grows with N."""
    rows = [[name, N, common.fmt_ms(get(name, N, "miss")), _tok_per_s(N, get(name, N, "miss")),
             common.fmt_ms(get(name, N, "hit")), common.fmt_ms(get(name, N, "floor_ms")),
             _fmt_ratio(get(name, N, "step_over_floor")), common.fmt_ms(get(name, N, "matvec_floor")),
             fmt_mib(get(name, N, "cache_bytes"))]
            for name in names for N in Ns]
    table = common.format_table(["mixer", "N", "prefill ms", "prefill tok/s", "decode ms/token", "floor ms",
                                 "step/floor", "mv ms", "cache MiB"], rows)
    lines = [table, ""] + _growth_lines(names, Ns, get) + _speedup_lines(names, Ns, get)
    lines.append(f"\nelapsed {elapsed:.0f} s")
    return "\n".join(lines)


def _panels(names: Sequence[str], Ns: Sequence[int], get) -> List[Dict[str, Any]]:
    """The figure: decode latency and cache bytes against N, one series per mixer."""
    return [
        {"title": "decode latency per token", "xlabel": "context N", "ylabel": "ms",
         "series": [{"label": n, "x": Ns, "y": [get(n, N, "hit") for N in Ns],
                     "color": "k" if n == "softmax" else None} for n in names]},
        {"title": "cache bytes", "xlabel": "context N", "ylabel": "bytes",
         "series": [{"label": n, "x": Ns, "y": [get(n, N, "cache_bytes") for N in Ns],
                     "color": "k" if n == "softmax" else None} for n in names]},
    ]


def _write_outputs(paths, text: str, result: Dict[str, Any], panels, info: Dict[str, Any]) -> None:
    """The report (.txt), the measurements (.json), then the figure (.png; a failure is only reported)."""
    atomic_write_text(paths["txt"], text)
    write_json(paths["json"], result)
    plot_note = save_figure(paths["png"], lambda p: common.plot_panels(
        p, panels, title=f"{PROG}: {common.describe_machine(info).splitlines()[0]}"))
    print(f"\nwrote {paths['txt']}, {paths['json']}, {plot_note}")


def run(a) -> int:
    """Run the `linattn bench decode` benchmark (module docstring).

    Args:
        a: The options parsed with `add_arguments` (`linattn bench decode --help` lists them).

    Returns:
        The exit code (0: success).

    Raises:
        UsageError: Bad options.
    """
    names = _with_torch_twins(a, _mixer_names(a))
    a.threads, log = common.start_run(a.threads, a.device, a.quiet)
    Ns = sorted(set(a.N))
    sync = common.synchronizer(a.device)
    models = build_models(a, names)
    paths = common.output_paths("decode", a.out, overwrite=a.overwrite)
    info = common.machine_info(a.device)
    head = _header_lines(a, info)
    print("\n".join(head) + "\n")
    _warm_up(models, a, Ns[0])

    records, elapsed = _measure_all(models, Ns, a, sync, log)
    get = _record_getter(records)
    text = _report(names, Ns, get, elapsed)
    print(text)

    result = {"benchmark": "decode", "machine": info, "config": vars(a), "records": records}
    _write_outputs(paths, "\n".join(head) + "\n\n" + text + "\n", result, _panels(names, Ns, get), info)
    return 0
