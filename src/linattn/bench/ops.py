"""`linattn bench ops`: operator speed against sequence length T.

For each T: causal normalised elu+1 `linear_attention`, the delta rule (DeltaNet, Gated DeltaNet,
EFLA) and `softmax_attention` (SDPA), forward and
forward+backward, chunk and recurrent forms (recurrent only up to a cap: it is a Python loop over
tokens). Reports ms (median and spread), speed-up over softmax and over the op's own recurrent form,
achieved GFLOP/s against the machine's measured matmul rate, and peak memory; then the issue's
targets at T = 16384, computed from this run. Nothing is extrapolated: what is not measured is
listed as skipped, with the reason. The chunk size reported, and used in the flop counts, is the
one the backend really ran with (`linattn.ops.chunk_size_used`), which can differ from --chunk-size.

This module also holds the demo's exactness check (`run_exactness`): each form of each operator
against the fp64 references of `linattn.ops.reference`, written from the formulas.
"""
from __future__ import annotations

import argparse
import gc
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from ..cli_support import UsageError
from ..io import atomic_write_text, write_json
from ..ops import chunk_size_used, delta_rule, linear_attention, softmax_attention
from ..ops.reference import delta_rule_ref, linear_attention_ref
from . import common

DESCRIPTION = __doc__.split("\n\n")[0] + """

Flop conventions (per forward; forward+backward counts 3x the forward; C = the chunk size the backend
really uses, printed in column C and recorded as chunk_size_used, which can differ from --chunk-size):
  linear chunk      4*B*H*T*K*(C+V)   (q.k^T and A.v inside chunks, k^T.v and q.S across)
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


def _case(op: str, mode: str, pass_: str, B: int, T: int, H: int, K: int, V: int, dtype: str, device: str,
          chunk_size: int, seed: int) -> Tuple[Dict[str, torch.Tensor], str, Callable, tuple, Dict[str, Any]]:
    """One case's inputs (requiring grad for fwdbwd) and its operator call: (inputs, op name, op,
    positional args, keyword args)."""
    opd = OP_BY_KEY[op]
    x = _make_inputs(opd, B, T, H, K, V, DTYPES[dtype], device, seed)
    if pass_ != "fwd":
        for t in x.values():
            t.requires_grad_(True)
    if opd.family == "linear":
        return x, "linear_attention", linear_attention, (x["q"], x["k"], x["v"]), dict(
            feature_map="elu+1", causal=True, normalize=True, mode=mode, chunk_size=chunk_size)
    if opd.family == "delta":
        return x, "delta_rule", delta_rule, (x["q"], x["k"], x["v"], x["beta"]), dict(
            g=x.get("g"), exact=opd.exact, mode=mode, chunk_size=chunk_size)
    return x, "softmax_attention", softmax_attention, (x["q"], x["k"], x["v"]), dict(causal=True)


def build_case(op: str, mode: str, pass_: str, B: int, T: int, H: int, K: int, V: int,
               dtype: str = "float32", device: str = "cpu", chunk_size: int = 64, seed: int = 0):
    """A zero-argument callable that runs one case once (inputs are made here, outside the timing).

    fwd: the op under torch.no_grad(). fwdbwd: the op with autograd, then backward of a fixed random
    output gradient into every float input (q, k, v, and beta, g for the delta rule).
    """
    x, _, op_fn, args, kwargs = _case(op, mode, pass_, B, T, H, K, V, dtype, device, chunk_size, seed)

    def call() -> torch.Tensor:
        out = op_fn(*args, **kwargs)
        return out[0] if isinstance(out, tuple) else out

    if pass_ == "fwd":
        def fn():
            with torch.no_grad():
                call()
        return fn
    leaves = list(x.values())
    do = torch.randn(B, T, H, V, generator=torch.Generator().manual_seed(seed + 1)).to(device=device,
                                                                                      dtype=DTYPES[dtype])

    def fn():
        for t in leaves:
            t.grad = None
        call().backward(do)
    return fn


def case_chunk_size(op: str, mode: str, pass_: str, B: int, T: int, H: int, K: int, V: int,
                    dtype: str = "float32", device: str = "cpu", chunk_size: int = 64, seed: int = 0) -> Optional[int]:
    """The chunk size a chunk-form case really runs with (None for the other forms)."""
    if mode != "chunk" or OP_BY_KEY[op].family == "softmax":
        return None
    _, name, _, args, kwargs = _case(op, mode, pass_, B, T, H, K, V, dtype, device, chunk_size, seed)
    return chunk_size_used(name, *args, **kwargs)


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
    p.add_argument("--chunk-size", type=int, default=64,
                   help="chunk size asked of the chunk forms (default 64); a backend may use another one, "
                        "which is then what is printed, recorded and counted")
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
        raise UsageError(f"--device: {e}", prog) from None
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

def _plan(a):
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
                    if op.family == "softmax" and max_sm is not None and T > max_sm:
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
        for c in group:
            if c["mode"] == "chunk":
                c["chunk_size"] = a.chunk_size
                try:
                    c["chunk_size_used"] = case_chunk_size(**_spec(a, c))
                except Exception as e:  # unknown: no flop count is claimed for this row
                    c["chunk_size_used"] = None
                    c["chunk_size_error"] = f"{type(e).__name__}: {' '.join(str(e).split())}"
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
        C = r.get("chunk_size_used")  # only the chunk forms' counts depend on C: the size really used
        if r["mode"] == "chunk" and C is None:
            r["flops"] = r["gflops"] = r["matmul_fraction"] = None  # unknown chunk size: no flop count
        else:
            f = flops(r["op"], r["mode"], r["pass"], a.B, r["T"], a.H, a.K, a.V, C or 0)
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


def _chunk_cell(r) -> str:
    """The chunk size a row ran with; '*' marks one that differs from the requested size."""
    used = r.get("chunk_size_used")
    if used is None:
        return "-"
    return f"{used}*" if used != r.get("chunk_size") else str(used)


def chunk_sizes_used(results) -> Dict[str, List[int]]:
    """The chunk sizes each operator's chunk form really ran with, by op key."""
    used: Dict[str, List[int]] = {}
    for r in results:
        if r.get("chunk_size_used") is not None:
            used.setdefault(r["op"], [])
            if r["chunk_size_used"] not in used[r["op"]]:
                used[r["op"]].append(r["chunk_size_used"])
    return {op: sorted(v) for op, v in used.items()}


def chunk_line(requested: int, used: Dict[str, List[int]]) -> str:
    parts = [f"{OP_BY_KEY[op].label} {'/'.join(map(str, sizes))}" for op, sizes in used.items()]
    return f"chunk    --chunk-size {requested}; used by the chunk forms: " + (", ".join(parts) or "none ran")


def results_table(results) -> str:
    rows = []
    for r in results:
        head = [r["T"], _label(r), PASS_LABEL[r["pass"]], _chunk_cell(r)]
        if "ms" not in r:
            rows.append(head + ["FAILED", r.get("error", "")[:60]] + [""] * 6)
            continue
        t = r["timing"]
        rows.append(head + [
            common.fmt_ms(r["ms"]), f"{common.fmt_ms(t['q1_ms'])}-{common.fmt_ms(t['q3_ms'])}", t["repeats"],
            _x(r.get("speedup_vs_softmax")), _x(r.get("speedup_vs_recurrent")),
            f"{r['gflops']:.1f}" if r.get("gflops") is not None else "-",
            f"{100 * r['matmul_fraction']:.1f}" if r.get("matmul_fraction") else "-",
            common.fmt_bytes(r.get("peak_bytes")),
        ])
    return common.format_table(
        ["T", "op", "pass", "C", "ms", "IQR ms", "n", "softmax/op", "rec/chunk", "GFLOP/s", "% matmul", "peak MiB"],
        rows, align="rllrrrrrrrrr")


def compute_targets(results, skipped, a, matmul: Dict[str, Any]) -> List[Dict[str, Any]]:
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

    def lin(ps):
        return (T, "linear", "chunk", ps)

    def smk(ps):
        return (T, "softmax", "sdpa", ps)

    add("linear elu+1 chunk fwd: softmax time / op time", *ratio(smk("fwd"), lin("fwd")), 30.0, "x")
    add("linear elu+1 chunk fwd+bwd: softmax time / op time", *ratio(smk("fwdbwd"), lin("fwdbwd")), 15.0, "x")
    r = by.get(lin("fwd"))
    if r is not None and r.get("gflops") is None:
        add(f"linear elu+1 chunk fwd: achieved / measured {matmul['dtype']} matmul rate", None,
            f"chunk size used unknown ({r.get('chunk_size_error')})", 0.45, "fraction")
    else:
        add(f"linear elu+1 chunk fwd: achieved / measured {matmul['dtype']} matmul rate",
            r["gflops"] / matmul["gflops"] if r else None, None if r else why_missing(lin("fwd")), 0.45, "fraction")
    for op in (o for o in OPS if o.family == "delta"):
        def dk(mode, ps, op=op):
            return (T, op.key, mode, ps)

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

    cases, skipped, caps = _plan(a)
    paths = common.output_paths("ops", a.out, overwrite=a.overwrite, stem=a.name)

    info = common.machine_info(a.device)
    print("linattn bench ops")
    print(common.describe_machine(info))
    log(f"measuring the {a.dtype} matmul rate ({a.matmul_n}^3) ...")
    matmul = common.matmul_rate(a.matmul_n, DTYPES[a.dtype], a.device)
    print(f"matmul   {matmul['gflops']:.1f} GFLOP/s median at the start (best {matmul['gflops_best']:.1f}), "
          f"{a.dtype} {a.matmul_n}x{a.matmul_n}x{a.matmul_n} on {a.device}")
    print(f"shape    B={a.B} H={a.H} K={a.K} V={a.V} {a.dtype} on {a.device}; --chunk-size {a.chunk_size}; "
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
    used = chunk_sizes_used(results)
    print(chunk_line(a.chunk_size, used))
    print()
    derive(results, a, matmul["gflops"])
    targets = compute_targets(results, skipped, a, matmul)

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
        "C: the chunk size the chunk form really ran with (a backend may round or cap --chunk-size=%d; "
        "* marks such rows); it is the C of the flop counts" % a.chunk_size,
        "GFLOP/s from nominal flop counts: linear chunk 4*B*H*T*K*(C+V); linear "
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
        "chunk_size": {"requested": a.chunk_size, "used": used},
        "wall_s": time.perf_counter() - t_start,
    }
    header = "\n".join(["linattn bench ops", common.describe_machine(info),
                        f"matmul   {matmul['gflops_start']:.1f} GFLOP/s at the start, {matmul['gflops_end']:.1f} "
                        f"at the end ({a.dtype}, {a.matmul_n}^3); reference {matmul['gflops']:.1f}",
                        f"shape    B={a.B} H={a.H} K={a.K} V={a.V} {a.dtype} {a.device}",
                        chunk_line(a.chunk_size, used), "", ""])
    atomic_write_text(paths["txt"], header + text + "\n")
    write_json(paths["json"], report)
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
# Exactness (the demo's part 1): every form against the fp64 references of linattn.ops.reference
# ----------------------------------------------------------------------------------------------

def run_exactness(T: int = 37, B: int = 2, H: int = 2, K: int = 6, V: int = 5, chunk_size: int = 16,
                  seed: int = 0, eps: float = 1e-6) -> List[Dict[str, Any]]:
    """Max error of every form of every operator against its fp64 reference (linattn.ops.reference).

    linear_attention: each feature map (causal, normalised) in parallel, chunk and recurrent form.
    delta_rule: DeltaNet, Gated DeltaNet, EFLA, gated EFLA in the three forms.
    T is deliberately not a multiple of chunk_size (padding and several chunks are exercised).
    """
    from ..feature_maps import FEATURE_MAP_NAMES, FAVORPlus, get_feature_map

    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen, dtype=torch.float64)
    k = torch.randn(B, T, H, K, generator=gen, dtype=torch.float64)
    v = torch.randn(B, T, H, V, generator=gen, dtype=torch.float64)
    rows = []

    def record(family, name, mode, ref, op, *args, **kwargs):
        row = {"family": family, "name": name, "mode": mode, "max_abs_err": None, "max_rel_err": None, "note": None}
        try:
            o = op(*args, mode=mode, chunk_size=chunk_size, **kwargs)[0]
            err = (o.double() - ref).abs().max().item()
            row["max_abs_err"] = err
            row["max_rel_err"] = err / max(ref.abs().max().item(), 1e-300)
        except Exception as e:
            row["note"] = f"{type(e).__name__}: {' '.join(str(e).split())}"
        rows.append(row)

    for name in FEATURE_MAP_NAMES:
        fmap = FAVORPlus(K, seed=seed) if name == "favor+" else get_feature_map(name, K)
        ref = linear_attention_ref(q, k, v, name, causal=True, normalize=True, eps=eps, fmap=fmap)
        for mode in ("parallel", "chunk", "recurrent"):
            record("linear_attention", name, mode, ref, linear_attention, q, k, v, feature_map=fmap, eps=eps)

    qn, kn = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    beta = torch.sigmoid(torch.randn(B, T, H, generator=gen, dtype=torch.float64))
    g = -F.softplus(torch.randn(B, T, H, generator=gen, dtype=torch.float64)) / 4
    scale = K ** -0.5
    variants = [("DeltaNet", qn, kn, None, False), ("Gated DeltaNet", qn, kn, g, False),
                ("EFLA", qn, k, None, True), ("gated EFLA", qn, k, g, True)]
    for name, qq, kk, gg, exact in variants:
        ref, _ = delta_rule_ref(qq, kk, v, beta, g=gg, exact=exact, scale=scale)
        for mode in ("parallel", "chunk", "recurrent"):
            record("delta_rule", name, mode, ref, delta_rule, qq, kk, v, beta, g=gg, exact=exact, scale=scale)
    return rows


def format_exactness(rows) -> str:
    def e(x):
        return "-" if x is None else f"{x:.1e}"
    return common.format_table(
        ["operator", "variant", "form", "max abs err", "max rel err", "note"],
        [[r["family"], r["name"], r["mode"], e(r["max_abs_err"]), e(r["max_rel_err"]), r["note"] or ""]
         for r in rows], align="lllrrl")


__all__ = ["DESCRIPTION", "add_arguments", "run", "build_case", "case_chunk_size", "chunk_sizes_used", "flops",
           "run_exactness", "format_exactness", "compute_targets", "OPS", "TARGET_T"]
