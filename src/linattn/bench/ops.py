"""`linattn bench ops`: operator speed against sequence length T.

For each T: causal normalised elu+1 `linear_attention`, the delta rule (DeltaNet, Gated DeltaNet,
EFLA; when `linattn.delta_rule` is importable) and `softmax_attention` (SDPA), forward and
forward+backward, chunk and recurrent forms (recurrent only up to a cap: it is a Python loop over
tokens). Reports ms (median and spread), speed-up over softmax and over the op's own recurrent form,
achieved GFLOP/s against the machine's measured matmul rate, and peak memory; then the issue's
targets at T = 16384, computed from this run. Nothing is extrapolated: what is not measured is
listed as skipped, with the reason.

This module also holds the demo's exactness check (`run_exactness`): each form of each operator
against a direct fp64 evaluation written from the formulas.
"""
from __future__ import annotations

import gc
import math
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from . import common
from ..cli import UsageError

DESCRIPTION = __doc__.split("\n\n")[0] + """

Flop conventions (per forward; forward+backward counts 3x the forward):
  linear chunk      4*B*H*T*K*(C+V)   (C = chunk size: q.k^T and A.v inside chunks, k^T.v and q.S across)
  linear recurrent  4*B*H*T*K*V
  delta chunk       B*H*T*(6*C*K + 4*C*V + 6*K*V)   (WY/UT form; the triangular solve is not counted)
  delta recurrent   6*B*H*T*K*V
  softmax           2*B*H*T^2*(K+V)   (counts the masked half too; causal kernels do about half of it)
"""

TARGET_T = 16384
FAMILIES = ("linear", "delta", "softmax")
MODES = ("chunk", "recurrent")
PASSES = ("fwd", "fwdbwd")
PASS_LABEL = {"fwd": "fwd", "fwdbwd": "fwd+bwd"}
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "float64": torch.float64}
DEFAULT_T = [1024, 2048, 4096, 8192, 16384, 32768, 65536]
DEFAULT_MAX_T_SOFTMAX_CPU = 32768


@dataclass(frozen=True)
class OpDef:
    key: str
    family: str
    label: str
    modes: Tuple[str, ...]
    gated: bool = False
    exact: bool = False
    color: str = "C0"


OPS: Tuple[OpDef, ...] = (
    OpDef("linear", "linear", "linear elu+1", MODES, color="C0"),
    OpDef("deltanet", "delta", "DeltaNet", MODES, color="C1"),
    OpDef("gated_deltanet", "delta", "Gated DeltaNet", MODES, gated=True, color="C2"),
    OpDef("efla", "delta", "EFLA", MODES, exact=True, color="C3"),
    OpDef("softmax", "softmax", "softmax (SDPA)", ("sdpa",), color="k"),
)
OP_BY_KEY = {o.key: o for o in OPS}


def delta_rule_or_reason() -> Tuple[Optional[Callable], Optional[str]]:
    """(linattn.delta_rule, None) when importable, else (None, why not)."""
    try:
        import linattn
        fn = getattr(linattn, "delta_rule", None)
        if fn is None:
            from ..ops.delta import delta_rule as fn
        return fn, None
    except Exception as e:  # missing module, or one being edited: skip the family, say why
        return None, f"linattn.delta_rule is not importable ({type(e).__name__}: {e})"


# ----------------------------------------------------------------------------------------------
# Cases: one (op, mode, pass, shape) -> a zero-argument callable. Also the memory worker's builder.
# ----------------------------------------------------------------------------------------------

def _make_inputs(op: OpDef, B, T, H, K, V, dtype, device, seed) -> Dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    q, k, v = randn(B, T, H, K), randn(B, T, H, K), randn(B, T, H, V)
    x: Dict[str, torch.Tensor] = {}
    if op.family == "delta":
        q = F.normalize(q, dim=-1)
        if not op.exact:
            k = F.normalize(k, dim=-1)  # DeltaNet: L2-normalised keys; EFLA uses the raw key norm
        x["beta"] = torch.sigmoid(randn(B, T, H))
        if op.gated:
            x["g"] = -F.softplus(randn(B, T, H)) / 16
    x.update(q=q, k=k, v=v)
    return {name: t.to(device=device, dtype=dtype).contiguous() for name, t in x.items()}


def _call(op: OpDef, mode: str, chunk_size: int) -> Callable[[Dict[str, torch.Tensor]], torch.Tensor]:
    if op.family == "linear":
        from ..ops.linear import linear_attention

        return lambda x: linear_attention(x["q"], x["k"], x["v"], feature_map="elu+1", causal=True,
                                          normalize=True, mode=mode, chunk_size=chunk_size)[0]
    if op.family == "delta":
        delta_rule, why = delta_rule_or_reason()
        if delta_rule is None:
            raise RuntimeError(why)
        return lambda x: delta_rule(x["q"], x["k"], x["v"], x["beta"], g=x.get("g"), exact=op.exact,
                                    mode=mode, chunk_size=chunk_size)[0]
    from ..ops.softmax import softmax_attention

    return lambda x: softmax_attention(x["q"], x["k"], x["v"], causal=True)


def build_case(op: str, mode: str, pass_: str, B: int, T: int, H: int, K: int, V: int,
               dtype: str = "float32", device: str = "cpu", chunk_size: int = 64, seed: int = 0):
    """A zero-argument callable that runs one case once (inputs are made here, outside the timing).

    fwd: the op under torch.no_grad(). fwdbwd: the op with autograd, then backward of a fixed random
    output gradient into every float input (q, k, v, and beta, g for the delta rule).
    """
    opd = OP_BY_KEY[op]
    x = _make_inputs(opd, B, T, H, K, V, DTYPES[dtype], device, seed)
    call = _call(opd, mode, chunk_size)
    if pass_ == "fwd":
        def fn():
            with torch.no_grad():
                call(x)
        return fn
    leaves = list(x.values())
    for t in leaves:
        t.requires_grad_(True)
    do = torch.randn(B, T, H, V, generator=torch.Generator().manual_seed(seed + 1)).to(device=device,
                                                                                      dtype=DTYPES[dtype])

    def fn():
        for t in leaves:
            t.grad = None
        call(x).backward(do)
    return fn


def flops(op: str, mode: str, pass_: str, B, T, H, K, V, C) -> float:
    """Nominal flop count of one call (see DESCRIPTION for the conventions)."""
    fam = OP_BY_KEY[op].family
    if fam == "softmax":
        f = 2.0 * B * H * T * T * (K + V)
    elif fam == "linear":
        f = 4.0 * B * H * T * K * (C + V) if mode == "chunk" else 4.0 * B * H * T * K * V
    else:
        f = B * H * T * (6.0 * C * K + 4.0 * C * V + 6.0 * K * V) if mode == "chunk" else 6.0 * B * H * T * K * V
    return 3.0 * f if pass_ == "fwdbwd" else f


# ----------------------------------------------------------------------------------------------
# Arguments
# ----------------------------------------------------------------------------------------------

def _csv(choices: Sequence[str]):
    def parse(text: str) -> List[str]:
        items = [s.strip() for s in text.split(",") if s.strip()]
        bad = [s for s in items if s not in choices]
        if bad or not items:
            import argparse
            raise argparse.ArgumentTypeError(
                f"expected a comma-separated subset of {','.join(choices)}, got {text!r}")
        return list(dict.fromkeys(items))
    parse.__name__ = "list"
    return parse


def add_arguments(p) -> None:
    p.add_argument("--T", type=int, nargs="+", default=DEFAULT_T, metavar="T",
                   help="sequence lengths (default 1024 ... 65536, powers of two)")
    p.add_argument("--B", type=int, default=1, help="batch size (default 1)")
    p.add_argument("--H", type=int, default=4, help="heads (default 4)")
    p.add_argument("--K", type=int, default=64, help="query/key head dim (default 64)")
    p.add_argument("--V", type=int, default=64, help="value head dim (default 64)")
    p.add_argument("--dtype", choices=list(DTYPES), default="float32", help="(default float32)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:i] (default cpu)")
    p.add_argument("--families", type=_csv(FAMILIES), default=list(FAMILIES),
                   help="comma-separated subset of linear,delta,softmax (default all)")
    p.add_argument("--modes", type=_csv(MODES), default=list(MODES),
                   help="forms of linear and delta: chunk,recurrent (default both)")
    p.add_argument("--passes", type=_csv(PASSES), default=list(PASSES),
                   help="fwd (under no_grad) and/or fwdbwd (default both)")
    p.add_argument("--chunk-size", type=int, default=64, help="chunk size of the chunk forms (default 64)")
    p.add_argument("--repeats", type=int, default=5, help="timed calls per case (default 5; adapted, see --budget)")
    p.add_argument("--warmup", type=int, default=1, help="untimed calls before timing (default 1)")
    p.add_argument("--min-time", type=float, default=0.2,
                   help="repeat short calls until this many seconds were timed (default 0.2)")
    p.add_argument("--budget", type=float, default=30.0,
                   help="seconds of timed calls per case; long calls get fewer repeats, at least "
                        "min(repeats, 3) unless one call exceeds the budget (default 30)")
    p.add_argument("--no-interleave", dest="interleave", action="store_false",
                   help="time each case in one block instead of interleaving the cases of a T in rounds "
                        "(interleaving keeps ratios fair when other processes share the machine)")
    p.add_argument("--max-T-softmax", type=int, default=None,
                   help=f"largest T for softmax_attention; 0 = no cap (default {DEFAULT_MAX_T_SOFTMAX_CPU} "
                        f"on cpu, no cap on cuda)")
    p.add_argument("--max-T-recurrent", type=int, default=16384,
                   help="largest T for the recurrent forms, forward (default 16384)")
    p.add_argument("--max-T-recurrent-bwd", type=int, default=1024,
                   help="largest T for the recurrent forms, forward+backward (a Python loop over tokens: "
                        "slow, and its backward keeps every step's state; no target uses it; default 1024)")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory measurement")
    p.add_argument("--matmul-n", type=int, default=2048, help="size of the reference matmul (default 2048)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="output folder (default results/bench/ops/)")
    p.add_argument("--name", default="ops", help="file name stem of the outputs (default ops)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace existing output files (default: write a new timestamped name instead)")
    p.add_argument("--quiet", action="store_true", help="no per-case progress on stderr")


def _validate(a) -> None:
    prog = "linattn bench ops"
    if any(t < 1 for t in a.T):
        raise UsageError(f"--T: sequence lengths must be >= 1, got {a.T}", prog)
    for name in ("B", "H", "K", "V", "chunk_size", "repeats", "matmul_n"):
        if getattr(a, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}", prog)
    if a.warmup < 0:
        raise UsageError(f"--warmup must be >= 0, got {a.warmup}", prog)
    if a.budget <= 0 or a.min_time < 0:
        raise UsageError("--budget must be > 0 and --min-time >= 0", prog)
    for name in ("max_T_softmax", "max_T_recurrent", "max_T_recurrent_bwd"):
        val = getattr(a, name)
        if val is not None and val < 0:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 0 (0 = no cap), got {val}", prog)
    try:
        dev = torch.device(a.device)
    except RuntimeError as e:
        raise UsageError(f"--device: {e}", prog)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {a.device}: CUDA is not available", prog)
    if dev.type not in ("cpu", "cuda"):
        raise UsageError(f"--device must be cpu or cuda[:i], got {a.device!r}", prog)
    if "/" in a.name or not a.name:
        raise UsageError(f"--name must be a plain file name stem, got {a.name!r}", prog)


def _cap(val: Optional[int]) -> Optional[int]:
    return None if val in (None, 0) else val


# ----------------------------------------------------------------------------------------------
# The benchmark
# ----------------------------------------------------------------------------------------------

def _plan(a, delta_ok: bool, delta_why: Optional[str]):
    """The cases to run, and the skipped ones with their reasons (nothing is extrapolated)."""
    cases, skipped = [], []
    max_sm = _cap(a.max_T_softmax if a.max_T_softmax is not None
                  else (None if a.device.startswith("cuda") else DEFAULT_MAX_T_SOFTMAX_CPU))
    max_rec, max_rec_bwd = _cap(a.max_T_recurrent), _cap(a.max_T_recurrent_bwd)
    for T in sorted(set(a.T)):
        for op in OPS:
            if op.family not in a.families:
                continue
            modes = [m for m in op.modes if m in a.modes] if op.family != "softmax" else ["sdpa"]
            for mode in modes:
                for ps in a.passes:
                    rec = {"T": T, "op": op.key, "mode": mode, "pass": ps}
                    if op.family == "delta" and not delta_ok:
                        skipped.append({**rec, "reason": delta_why})
                    elif op.family == "softmax" and max_sm is not None and T > max_sm:
                        skipped.append({**rec, "reason": f"T > --max-T-softmax={max_sm} (O(T^2); not run, "
                                                          f"not extrapolated)"})
                    elif mode == "recurrent" and ps == "fwd" and max_rec is not None and T > max_rec:
                        skipped.append({**rec, "reason": f"T > --max-T-recurrent={max_rec}"})
                    elif mode == "recurrent" and ps == "fwdbwd" and max_rec_bwd is not None and T > max_rec_bwd:
                        skipped.append({**rec, "reason": f"T > --max-T-recurrent-bwd={max_rec_bwd}"})
                    else:
                        cases.append(rec)
    return cases, skipped, {"softmax": max_sm, "recurrent": max_rec, "recurrent_bwd": max_rec_bwd}


def _spec(a, c) -> Dict[str, Any]:
    return {"op": c["op"], "mode": c["mode"], "pass_": c["pass"], "B": a.B, "T": c["T"], "H": a.H,
            "K": a.K, "V": a.V, "dtype": a.dtype, "device": a.device, "chunk_size": a.chunk_size,
            "seed": a.seed}


def _label(r) -> str:
    op = OP_BY_KEY[r["op"]]
    return op.label if op.family == "softmax" else f"{op.label} {r['mode']}"


def run_cases(a, cases, log) -> List[Dict[str, Any]]:
    """Time every case (interleaved within each T unless --no-interleave); then, unless --no-memory,
    measure peak memory in one separate process."""
    results = []
    for T in sorted({c["T"] for c in cases}):
        group = [c for c in cases if c["T"] == T]
        gc.collect()  # once per T: a full collection is not free on a busy machine
        if a.interleave:
            log(f"  T={T:<6} timing {len(group)} cases, interleaved ...")
            timings = common.time_interleaved(
                [lambda c=c: build_case(**_spec(a, c)) for c in group], warmup=a.warmup, repeats=a.repeats,
                min_time_s=a.min_time, budget_s=a.budget, device=a.device)
        else:
            timings = []
            for c in group:
                try:
                    timings.append(common.time_fn(build_case(**_spec(a, c)), warmup=a.warmup, repeats=a.repeats,
                                                  min_time_s=a.min_time, budget_s=a.budget, device=a.device))
                except Exception as e:  # an op that fails (or runs out of memory) is reported, not fatal
                    timings.append(e)
        for c, t in zip(group, timings):
            r = dict(c)
            name = f"  T={c['T']:<6} {_label(r):<26} {PASS_LABEL[c['pass']]:<7}"
            if isinstance(t, Exception):
                r["error"] = f"{type(t).__name__}: {' '.join(str(t).split())}"
                log(f"{name} FAILED: {r['error']}")
            else:
                r["timing"] = t.to_dict()
                r["ms"] = t.median_ms
                log(f"{name} {common.fmt_ms(t.median_ms):>9} ms (n={t.repeats})")
            results.append(r)
    measured = [r for r in results if "error" not in r]
    if measured and not a.no_memory:
        log(f"peak memory of {len(measured)} cases, one call each (separate process) ...")
        specs = [_spec(a, r) for r in measured]
        warm = [{**sp, "T": min(sp["T"], 256)} for sp in specs]  # warm-up at a small size saves time
        mem = common.measure_memory("linattn.bench.ops:build_case", specs, a.device, warmup_specs=warm)
        for r, m in zip(measured, mem):
            r["peak_bytes"] = m["peak_bytes"]
            if m["error"]:
                r["memory_error"] = m["error"]
    return results


def derive(results, a, matmul_gflops: float) -> None:
    """Add flops, GFLOP/s, fraction of the matmul rate, and speed-ups to each measured row."""
    by = {(r["T"], r["op"], r["mode"], r["pass"]): r for r in results if "ms" in r}
    for r in by.values():
        f = flops(r["op"], r["mode"], r["pass"], a.B, r["T"], a.H, a.K, a.V, a.chunk_size)
        r["flops"] = f
        r["gflops"] = f / (r["ms"] * 1e-3) / 1e9
        r["matmul_fraction"] = r["gflops"] / matmul_gflops if matmul_gflops else None
        sm = by.get((r["T"], "softmax", "sdpa", r["pass"]))
        r["speedup_vs_softmax"] = sm["ms"] / r["ms"] if sm is not None else None
        rec = by.get((r["T"], r["op"], "recurrent", r["pass"])) if r["mode"] == "chunk" else None
        r["speedup_vs_recurrent"] = rec["ms"] / r["ms"] if rec is not None else None


def _x(v: Optional[float]) -> str:
    if v is None:
        return "-"
    return f"{v:.1f}x" if v < 100 else f"{v:.0f}x"


def results_table(results) -> str:
    rows = []
    for r in results:
        head = [r["T"], _label(r), PASS_LABEL[r["pass"]]]
        if "ms" not in r:
            rows.append(head + ["FAILED", r.get("error", "")[:60]] + [""] * 6)
            continue
        t = r["timing"]
        rows.append(head + [
            common.fmt_ms(r["ms"]), f"{common.fmt_ms(t['q1_ms'])}-{common.fmt_ms(t['q3_ms'])}", t["repeats"],
            _x(r.get("speedup_vs_softmax")), _x(r.get("speedup_vs_recurrent")),
            f"{r['gflops']:.1f}", f"{100 * r['matmul_fraction']:.1f}" if r.get("matmul_fraction") else "-",
            common.fmt_bytes(r.get("peak_bytes")),
        ])
    return common.format_table(
        ["T", "op", "pass", "ms", "IQR ms", "n", "softmax/op", "rec/chunk", "GFLOP/s", "% matmul", "peak MiB"],
        rows, align="rllrrrrrrrr")


def compute_targets(results, skipped, a, matmul: Dict[str, Any], delta_why: Optional[str]) -> List[Dict[str, Any]]:
    """The issue's targets at T = 16384, from this run's measurements (never hard-coded)."""
    T = TARGET_T
    by = {(r["T"], r["op"], r["mode"], r["pass"]): r for r in results if "ms" in r}
    skip = {(s["T"], s["op"], s["mode"], s["pass"]): s["reason"] for s in skipped}

    def why_missing(key) -> str:
        if key[0] not in a.T:
            return f"T={T} not in --T"
        if key in skip:
            return f"{_label({'op': key[1], 'mode': key[2]})} {PASS_LABEL[key[3]]} skipped: {skip[key]}"
        op = OP_BY_KEY[key[1]]
        if op.family not in a.families:
            return f"family {op.family} not in --families"
        if key[2] != "sdpa" and key[2] not in a.modes:
            return f"mode {key[2]} not in --modes"
        if key[3] not in a.passes:
            return f"pass {key[3]} not in --passes"
        return f"{_label({'op': key[1], 'mode': key[2]})} {PASS_LABEL[key[3]]} failed"

    def ratio(num_key, den_key):
        num, den = by.get(num_key), by.get(den_key)
        if num is None or den is None:
            return None, why_missing(num_key if num is None else den_key)
        return num["ms"] / den["ms"], None

    out = []

    def add(name, value, why, threshold, unit):
        out.append({"target": name, "T": T, "measured": value, "threshold": threshold, "unit": unit,
                    "met": (value >= threshold) if value is not None else None, "note": why})

    lin = lambda ps: (T, "linear", "chunk", ps)  # noqa: E731
    smk = lambda ps: (T, "softmax", "sdpa", ps)  # noqa: E731
    add("linear elu+1 chunk fwd: softmax time / op time", *ratio(smk("fwd"), lin("fwd")), 30.0, "x")
    add("linear elu+1 chunk fwd+bwd: softmax time / op time", *ratio(smk("fwdbwd"), lin("fwdbwd")), 15.0, "x")
    r = by.get(lin("fwd"))
    add(f"linear elu+1 chunk fwd: achieved / measured {matmul['dtype']} matmul rate",
        r["gflops"] / matmul["gflops"] if r else None, None if r else why_missing(lin("fwd")), 0.45, "fraction")
    for op in (o for o in OPS if o.family == "delta"):
        dk = lambda mode, ps: (T, op.key, mode, ps)  # noqa: E731
        if delta_why is not None:
            for name, thr in (("fwd: softmax time / op time", 12.0), ("fwd: recurrent time / chunk time", 20.0),
                              ("fwd+bwd: softmax time / op time", 6.0)):
                add(f"{op.label} chunk {name}", None, delta_why, thr, "x")
            continue
        add(f"{op.label} chunk fwd: softmax time / op time", *ratio(smk("fwd"), dk("chunk", "fwd")), 12.0, "x")
        add(f"{op.label} chunk fwd: recurrent time / chunk time",
            *ratio(dk("recurrent", "fwd"), dk("chunk", "fwd")), 20.0, "x")
        add(f"{op.label} chunk fwd+bwd: softmax time / op time",
            *ratio(smk("fwdbwd"), dk("chunk", "fwdbwd")), 6.0, "x")
    return out


def targets_text(targets) -> str:
    rows = []
    for t in targets:
        if t["unit"] == "fraction":
            meas = f"{100 * t['measured']:.1f} %" if t["measured"] is not None else "-"
            thr = f">= {100 * t['threshold']:.0f} %"
        else:
            meas = f"{t['measured']:.1f}x" if t["measured"] is not None else "-"
            thr = f">= {t['threshold']:g}x"
        status = "met" if t["met"] else ("MISSED" if t["met"] is False else "not measured")
        rows.append([t["target"], meas, thr, status + (f" ({t['note']})" if t["note"] else "")])
    return common.format_table(["target (T = %d)" % TARGET_T, "measured", "target", "status"], rows, align="lrrl")


def make_plot(path, results, a, info, matmul) -> None:
    ok = [r for r in results if "ms" in r]
    panels = []
    for ps in a.passes:
        series = []
        for op in OPS:
            for mode in (op.modes if op.family != "softmax" else ("sdpa",)):
                rows = sorted((r for r in ok if r["op"] == op.key and r["mode"] == mode and r["pass"] == ps),
                              key=lambda r: r["T"])
                if rows:
                    series.append({"label": _label(rows[0]), "x": [r["T"] for r in rows], "y": [r["ms"] for r in rows],
                                   "color": op.color, "linestyle": "--" if mode == "recurrent" else "-",
                                   "marker": "s" if mode == "recurrent" else "o"})
        panels.append({"title": f"{PASS_LABEL[ps]} time", "xlabel": "T", "ylabel": "ms (median)", "series": series})
    series = []
    for op in OPS:
        if op.family == "softmax":
            continue
        for ps in a.passes:
            rows = sorted((r for r in ok if r["op"] == op.key and r["mode"] == "chunk" and r["pass"] == ps
                           and r.get("speedup_vs_softmax")), key=lambda r: r["T"])
            if rows:
                series.append({"label": f"{op.label} chunk {PASS_LABEL[ps]}", "x": [r["T"] for r in rows],
                               "y": [r["speedup_vs_softmax"] for r in rows], "color": op.color,
                               "linestyle": "-" if ps == "fwd" else ":"})
    if series:
        panels.append({"title": "speed-up over softmax (same pass)", "xlabel": "T",
                       "ylabel": "softmax time / op time", "series": series, "hline": 1.0})
    title = (f"linattn bench ops  B={a.B} H={a.H} K={a.K} V={a.V} {a.dtype} {a.device}  |  {info['cpu']}, "
             f"{info['torch_threads']} threads, torch {info['torch']}  |  matmul {matmul['gflops']:.0f} GFLOP/s"
             f"  |  {info['date']}")
    common.plot_panels(path, panels, title=title)


def run(a) -> int:
    _validate(a)
    a.T = sorted(set(a.T))
    log = (lambda s: None) if a.quiet else (lambda s: (sys.stderr.write(s + "\n"), sys.stderr.flush()))
    t_start = time.perf_counter()

    delta_fn, delta_why = delta_rule_or_reason() if "delta" in a.families else (None, None)
    cases, skipped, caps = _plan(a, delta_fn is not None, delta_why)
    paths = common.output_paths("ops", a.out, overwrite=a.overwrite, stem=a.name)

    info = common.machine_info(a.device)
    print("linattn bench ops")
    print(common.describe_machine(info))
    log(f"measuring the {a.dtype} matmul rate ({a.matmul_n}^3) ...")
    matmul = common.matmul_rate(a.matmul_n, DTYPES[a.dtype], a.device)
    print(f"matmul   {matmul['gflops']:.1f} GFLOP/s median at the start (best {matmul['gflops_best']:.1f}), "
          f"{a.dtype} {a.matmul_n}x{a.matmul_n}x{a.matmul_n} on {a.device}")
    print(f"shape    B={a.B} H={a.H} K={a.K} V={a.V} {a.dtype} on {a.device}; chunk size {a.chunk_size}; "
          f"causal; T = {' '.join(map(str, a.T))}")
    log(f"running {len(cases)} cases ({len(skipped)} skipped) ...")

    results = run_cases(a, cases, log)
    # the matmul rate again at the end: on a shared machine it moves; the higher one is the reference
    log("measuring the matmul rate again ...")
    matmul_end = common.matmul_rate(a.matmul_n, DTYPES[a.dtype], a.device)
    matmul["gflops_start"], matmul["gflops_end"] = matmul["gflops"], matmul_end["gflops"]
    matmul["gflops"] = max(matmul["gflops_start"], matmul["gflops_end"])
    print(f"matmul   {matmul_end['gflops']:.1f} GFLOP/s median at the end; reference rate "
          f"{matmul['gflops']:.1f} GFLOP/s (the higher of start and end)")
    print()
    derive(results, a, matmul["gflops"])
    targets = compute_targets(results, skipped, a, matmul, delta_why)

    mem = common.memory_method(a.device) if not a.no_memory else "none"
    notes = [
        "ms: median over n timed calls after %d warm-up call(s); IQR: interquartile range of those calls; "
        "%s" % (a.warmup, "the cases of each T were timed interleaved in rounds, each case's calls spread "
                          "evenly over the rounds (inputs rebuilt, untimed, before each call), so background "
                          "load hits them alike"
                if a.interleave else "each case was timed in one block (--no-interleave)"),
        "fwd runs under torch.no_grad(); fwd+bwd is the forward with autograd plus backward of a random "
        "output gradient into all float inputs (q, k, v; beta, g for the delta rule)",
        "inputs: q, k, v ~ N(0, 1); elu+1 linear attention is causal and normalised; DeltaNet and Gated "
        "DeltaNet use L2-normalised q, k, beta = sigmoid(N(0,1)), Gated DeltaNet g = -softplus(N(0,1))/16; "
        "EFLA (exact=True) uses raw keys",
        "softmax/op: softmax_attention time / op time at the same T and pass; rec/chunk: the op's recurrent "
        "time / its chunk time",
        "GFLOP/s from nominal flop counts: linear chunk 4*B*H*T*K*(C+V) with C = chunk size; linear "
        "recurrent 4*B*H*T*K*V; delta chunk B*H*T*(6CK+4CV+6KV), delta recurrent 6*B*H*T*K*V; softmax "
        "2*B*H*T^2*(K+V), counting the masked half (causal kernels do about half of that work); "
        "fwd+bwd counted as 3x fwd. % matmul = GFLOP/s / the reference matmul rate above (the higher of "
        "the two measurements, start and end)",
        "peak MiB: " + (common.MEMORY_METHODS[mem] if not a.no_memory else "not measured (--no-memory)"),
        "nothing is extrapolated: cases not run are listed under 'skipped'",
    ]
    if info.get("loadavg_1_5_15min"):
        notes.append("the cpus may be shared with other processes (load average at start %s, at end %s): "
                     "timings are noisy, see the IQR" % (info["loadavg_1_5_15min"], common._loadavg()))

    table = results_table(results)
    skipped_lines = _skipped_summary(skipped)
    text = "\n".join([
        "results", table, "",
        "skipped", *(skipped_lines or ["  none"]), "",
        "notes", *("  - " + n for n in notes), "",
        "targets", targets_text(targets),
    ])
    print(text)

    report = {
        "benchmark": "ops", "machine": info, "matmul": matmul,
        "config": {k: v for k, v in vars(a).items() if k != "run"}, "caps": caps,
        "target_T": TARGET_T, "results": results, "skipped": skipped, "targets": targets, "notes": notes,
        "memory_method": common.MEMORY_METHODS[mem] if not a.no_memory else None,
        "delta_rule": "available" if delta_fn is not None else delta_why,
        "wall_s": time.perf_counter() - t_start,
    }
    header = "\n".join(["linattn bench ops", common.describe_machine(info),
                        f"matmul   {matmul['gflops_start']:.1f} GFLOP/s at the start, {matmul['gflops_end']:.1f} "
                        f"at the end ({a.dtype}, {a.matmul_n}^3); reference {matmul['gflops']:.1f}",
                        f"shape    B={a.B} H={a.H} K={a.K} V={a.V} {a.dtype} {a.device}; chunk {a.chunk_size}", "", ""])
    common.write_text(paths["txt"], header + text)
    common.write_json(paths["json"], report)
    try:
        make_plot(paths["png"], results, a, info, matmul)
        plot_note = str(paths["png"])
    except Exception as e:  # a plotting problem must not lose the measurements
        plot_note = f"(plot failed: {type(e).__name__}: {e})"
    print()
    print(f"wrote {paths['txt']}, {paths['json']}, {plot_note}  [{time.perf_counter() - t_start:.0f} s]")
    return 0


def _skipped_summary(skipped) -> List[str]:
    """One line per (op, mode, pass, reason), listing the T values."""
    groups: Dict[Tuple, List[int]] = {}
    for s in skipped:
        groups.setdefault((s["op"], s["mode"], s["pass"], s["reason"]), []).append(s["T"])
    return [f"  {_label({'op': op, 'mode': mode})} {PASS_LABEL[ps]} at T = {', '.join(map(str, Ts))}: {why}"
            for (op, mode, ps, why), Ts in groups.items()]


# ----------------------------------------------------------------------------------------------
# Exactness (the demo's part 1): every form against a direct fp64 evaluation from the formulas
# ----------------------------------------------------------------------------------------------

def _kernel(name: str, a: torch.Tensor, b: torch.Tensor, fmap, i: torch.Tensor, j: torch.Tensor):
    """k(a_i, b_j) for all pairs, from the kernel's formula: a [T, K], b [T, K] -> [T, T]."""
    dot = a @ b.T
    if name == "identity":
        return dot
    if name == "elu+1":
        ea, eb = torch.where(a > 0, a + 1, torch.exp(a)), torch.where(b > 0, b + 1, torch.exp(b))
        return ea @ eb.T
    if name == "relu":
        return a.clamp_min(0) @ b.clamp_min(0).T
    if name == "cosformer":
        return (a.clamp_min(0) @ b.clamp_min(0).T) * torch.cos(math.pi / 2 * (i[:, None] - j[None, :]).double()
                                                               / fmap.max_len)
    if name == "taylor2":
        return 1 + dot + dot * dot / 2
    if name == "hadamard_exp":
        return torch.exp(a[:, None, :] + b[None, :, :]).sum(-1)
    if name == "sum_sq_euclid":
        return ((a[:, None, :] + b[None, :, :]) ** 2).sum(-1)
    if name == "sub_sq_euclid":
        return ((a[:, None, :] - b[None, :, :]) ** 2).sum(-1)
    if name == "magnitude_direction":
        return (dot + 1) * ((a * a).sum(-1) + 1)[:, None] * ((b * b).sum(-1) + 1)[None, :]
    if name == "favor+":
        w = fmap.projection.double()  # the drawn features define the kernel being computed
        la = a @ w.T - (a * a).sum(-1, keepdim=True) / 2
        lb = b @ w.T - (b * b).sum(-1, keepdim=True) / 2
        return torch.exp(la[:, None, :] + lb[None, :, :]).sum(-1) / w.shape[0]
    raise KeyError(name)


def _linear_reference(name, fmap, q, k, v, eps):
    """Causal normalised o_i = sum_{j<=i} k(q_i, k_j) v_j / den_i (den floored at eps, sign kept)."""
    B, T, H, _ = q.shape
    pos = torch.arange(T)
    out = torch.empty(B, T, H, v.shape[-1], dtype=torch.float64)
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    for b in range(B):
        for h in range(H):
            W = _kernel(name, q[b, :, h], k[b, :, h], fmap, pos, pos).masked_fill(~mask, 0.0)
            den = W.sum(-1, keepdim=True)
            den = torch.where(den < 0, torch.clamp(den, max=-eps), torch.clamp(den, min=eps))
            out[b, :, h] = (W @ v[b, :, h]) / den
    return out


def _delta_reference(q, k, v, beta, g, exact, scale):
    """S_t = exp(g_t) (I - a_t k_t k_t^T) S_{t-1} + a_t k_t v_t^T, o_t = scale S_t^T q_t, token by token."""
    B, T, H, K = q.shape
    S = torch.zeros(B, H, K, v.shape[-1], dtype=torch.float64)
    out = []
    for t in range(T):
        kt, vt, qt, bt = k[:, t], v[:, t], q[:, t], beta[:, t]
        if exact:
            lam = (kt * kt).sum(-1)
            at = torch.where(lam > 0, (1 - torch.exp(-bt * lam)) / lam.clamp_min(1e-300), bt)
        else:
            at = bt
        if g is not None:
            S = torch.exp(g[:, t])[..., None, None] * S
        pred = torch.einsum("bhk,bhkv->bhv", kt, S)
        S = S + at[..., None, None] * kt[..., :, None] * (vt - pred)[..., None, :]
        out.append(scale * torch.einsum("bhk,bhkv->bhv", qt, S))
    return torch.stack(out, dim=1)


def run_exactness(T: int = 37, B: int = 2, H: int = 2, K: int = 6, V: int = 5, chunk_size: int = 16,
                  seed: int = 0, eps: float = 1e-6) -> List[Dict[str, Any]]:
    """Max error of every form of every operator against the direct fp64 evaluation.

    linear_attention: each feature map (causal, normalised) in parallel, chunk and recurrent form.
    delta_rule (if importable): DeltaNet, Gated DeltaNet, EFLA, gated EFLA in the three forms.
    T is deliberately not a multiple of chunk_size (padding and several chunks are exercised).
    """
    from .. import FEATURE_MAP_NAMES, FAVORPlus, get_feature_map, linear_attention

    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen, dtype=torch.float64)
    k = torch.randn(B, T, H, K, generator=gen, dtype=torch.float64)
    v = torch.randn(B, T, H, V, generator=gen, dtype=torch.float64)
    rows = []

    def record(family, name, mode, fn, ref):
        row = {"family": family, "name": name, "mode": mode, "max_abs_err": None, "max_rel_err": None, "note": None}
        try:
            o = fn()
            err = (o.double() - ref).abs().max().item()
            row["max_abs_err"] = err
            row["max_rel_err"] = err / max(ref.abs().max().item(), 1e-300)
        except Exception as e:
            row["note"] = f"{type(e).__name__}: {' '.join(str(e).split())}"
        rows.append(row)

    for name in FEATURE_MAP_NAMES:
        fmap = FAVORPlus(K, seed=seed) if name == "favor+" else get_feature_map(name, K)
        ref = _linear_reference(name, fmap, q, k, v, eps)
        for mode in ("parallel", "chunk", "recurrent"):
            record("linear_attention", name, mode,
                   lambda: linear_attention(q, k, v, feature_map=fmap, mode=mode, chunk_size=chunk_size,
                                            eps=eps)[0], ref)

    delta_rule, why = delta_rule_or_reason()
    if delta_rule is None:
        rows.append({"family": "delta_rule", "name": "-", "mode": "-", "max_abs_err": None, "max_rel_err": None,
                     "note": f"skipped: {why}"})
        return rows
    qn, kn = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    beta = torch.sigmoid(torch.randn(B, T, H, generator=gen, dtype=torch.float64))
    g = -F.softplus(torch.randn(B, T, H, generator=gen, dtype=torch.float64)) / 4
    scale = K ** -0.5
    variants = [("DeltaNet", qn, kn, None, False), ("Gated DeltaNet", qn, kn, g, False),
                ("EFLA", qn, k, None, True), ("gated EFLA", qn, k, g, True)]
    for name, qq, kk, gg, exact in variants:
        ref = _delta_reference(qq, kk, v, beta, gg, exact, scale)
        for mode in ("parallel", "chunk", "recurrent"):
            record("delta_rule", name, mode,
                   lambda: delta_rule(qq, kk, v, beta, g=gg, exact=exact, scale=scale, mode=mode,
                                      chunk_size=chunk_size)[0], ref)
    return rows


def format_exactness(rows) -> str:
    def e(x):
        return "-" if x is None else f"{x:.1e}"
    return common.format_table(
        ["operator", "variant", "form", "max abs err", "max rel err", "note"],
        [[r["family"], r["name"], r["mode"], e(r["max_abs_err"]), e(r["max_rel_err"]), r["note"] or ""]
         for r in rows], align="lllrrl")


__all__ = ["DESCRIPTION", "add_arguments", "run", "build_case", "flops", "run_exactness", "format_exactness",
           "compute_targets", "OPS", "TARGET_T"]
