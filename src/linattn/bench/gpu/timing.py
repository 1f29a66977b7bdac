"""Step `timing`: forward and forward + backward at B*H = 64, K = V = 128, bf16, T = 8k, 2k, 32k: linattn's
`backend="auto"` (what a user gets), fla's direct call (so the gap is our translation's overhead), SDPA (flash)
and linattn's own Triton kernels; TFLOP/s of the chunk algorithm's matmuls and their fraction of the measured
bf16 rate; and the issue's targets derived from the run (auto within 10 % of fla at T >= 8k, faster than SDPA
from 2k)."""
from __future__ import annotations

import time
import traceback
import warnings
from typing import Any, Dict, List, Optional

import torch
import torch.nn.functional as F

from .. import common
from .base import Ctx, NotCovered, fmt, free_cuda, gen, tail
from .fla_ops import fla_fns

# op -> its implementations, in the order they run (fla's direct call beside linattn's auto)
IMPLS = {"linear": ("auto", "fla:chunk_simple_gla", "triton"),
         "deltanet": ("auto", "fla:chunk_delta_rule", "triton"),
         "gated-deltanet": ("auto", "fla:chunk_gated_delta_rule", "triton"),
         "kda": ("auto", "fla:chunk_kda", "triton"),
         "efla": ("auto", "triton")}
# forward + backward as a multiple of the forward's matmul flops (the usual conventions)
BWD_FACTOR = {"sdpa": 3.5, "default": 3.0}


def chunk_flops(op: str, B: int, T: int, H: int, K: int, V: int, C: int = 64) -> float:
    """Matmul flops of one forward pass of the chunk algorithm (tile C), per the kernels' structure:
    linear: intra-chunk Q K^T and A V (2 C (K + V) per token), inter-chunk Q h and the state update
    K^T V (4 K V per token); the delta rule adds the UT transform (K K^T, Tm V, Tm K: 2 C (2K + V))
    and the pseudo-values W h (2 K V); softmax (causal): 2 T^2 (K + V) / 2 per head."""
    if op == "sdpa":
        return B * H * T * T * (K + V)
    per_tok = 2 * C * (K + V) + 4 * K * V
    if op != "linear":
        per_tok += 2 * C * (2 * K + V) + 2 * K * V
    return float(B * T * H * per_tok)


def timing_cases(plan) -> List[Dict[str, Any]]:
    sdpa = "flash" if plan["device"] == "cuda" else "sdpa"
    return [dict(op=op, impl=impl, T=T) for T in plan["time"]["Ts"]
            for op, impls in (*IMPLS.items(), ("sdpa", (sdpa,))) for impl in impls]


def _sdpa_fn(q, k, v, device):
    qt, kt, vt = (x.detach().transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))

    def fwd():
        if device != "cuda":
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
    return fwd, [qt, kt, vt], "SDPA flash" if device == "cuda" else "SDPA (CPU)"


def _fla_fn(c, fn, q, k, v, beta, gate, gk):
    if not callable(fn):
        raise NotCovered(f"fla not importable: {fn!r}")
    if c["op"] == "linear":
        return (lambda: fn(q, k, v, g=gate)[0]), [q, k, v, gate], ""
    if c["op"] == "deltanet":
        return (lambda: fn(q, k, v, beta, use_qk_l2norm_in_kernel=True)[0]), [q, k, v, beta], ""
    if c["op"] == "gated-deltanet":
        return (lambda: fn(q, k, v, gate, beta, use_qk_l2norm_in_kernel=True)[0]), [q, k, v, gate, beta], ""
    return (lambda: fn(q, k, v, gk, beta, use_qk_l2norm_in_kernel=True)[0]), [q, k, v, gk, beta], ""


def timing_fn(c, plan, fla, device):
    """-> (zero-argument forward, the inputs to differentiate, a note naming what ran)."""
    import linattn

    tp = plan["time"]
    B, H, K, V, T, dt = tp["B"], tp["H"], tp["K"], tp["V"], c["T"], tp["dtype"]
    g = gen(0)

    def rnd(*s):
        return torch.randn(*s, generator=g).to(device=device, dtype=dt).requires_grad_()

    q, k, v = rnd(B, T, H, K), rnd(B, T, H, K), rnd(B, T, H, V)
    if c["op"] == "sdpa":
        return _sdpa_fn(q, k, v, device)
    beta = torch.rand(B, T, H, generator=g).to(device).requires_grad_()
    gate = (F.logsigmoid(torch.randn(B, T, H, generator=g) + 4)).to(device).requires_grad_()
    gk = (F.logsigmoid(torch.randn(B, T, H, K, generator=g) + 4)).to(device).requires_grad_()
    if c["impl"].startswith("fla:"):
        return _fla_fn(c, fla.get(c["impl"][4:]), q, k, v, beta, gate, gk)
    backend = c["impl"]
    if c["op"] == "linear":
        kw: Dict[str, Any] = dict(feature_map="identity", normalize=False, g=gate)
        ins = [q, k, v, gate]
        fwd = lambda: linattn.linear_attention(q, k, v, backend=backend, **kw)[0]  # noqa: E731
        explain_args = ("linear_attention", q, k, v)
    else:
        kw = {"exact": True} if c["op"] == "efla" else {"qk_l2norm": True}
        ins = [q, k, v, beta]
        if c["op"] in ("gated-deltanet", "kda"):
            kw["g"] = gate if c["op"] == "gated-deltanet" else gk
            ins.append(kw["g"])
        fwd = lambda: linattn.delta_rule(q, k, v, beta, backend=backend, **kw)[0]  # noqa: E731
        explain_args = ("delta_rule", q, k, v, beta)
    return fwd, ins, _which_backend(explain_args, kw, backend)


def _which_backend(args, kw, backend) -> str:
    """What `backend` resolves to for this call, in words (linattn.explain where it exists)."""
    import linattn

    explain = getattr(linattn, "explain", None)
    if explain is None:
        return ""
    try:
        return str(explain(*args, backend=backend, **kw))[:160]
    except Exception as e:  # the row stands without the note
        return f"explain: {type(e).__name__}"


def _time_case(c, plan, fla, dev, deadline, peak) -> Dict[str, Any]:
    tp = plan["time"]
    r: Dict[str, Any] = {"op": c["op"], "impl": c["impl"], "T": c["T"]}
    fwd, ins, r["note"] = timing_fn(c, plan, fla, dev)
    with warnings.catch_warnings(record=True) as caught:  # a backend that falls back would time PyTorch
        warnings.simplefilter("always")
        with torch.no_grad():
            fwd()
    fell = [str(w.message) for w in caught if "falling back" in str(w.message)]
    if fell:
        raise NotCovered(fell[0])
    budget = max(1.0, min(8.0, (deadline - time.monotonic()) / 4))
    if dev == "cuda":
        torch.cuda.reset_peak_memory_stats()
    warm, reps, min_s = plan["reps"]
    with torch.no_grad():
        tf = common.time_fn(fwd, warmup=warm, repeats=reps, min_time_s=min_s, max_repeats=50, budget_s=budget,
                            device=dev)
    r["fwd_ms"] = tf.median_ms

    def fb():
        o = fwd()
        torch.autograd.grad(o, ins, grad_outputs=torch.ones_like(o), allow_unused=True)

    refused = fla_backward_refused(c["impl"])
    if refused:   # (fla-core would raise inside the backward, after compiling it: the forward row alone)
        r["note"] = f"forward only: {refused}"
    else:
        tb = common.time_fn(fb, warmup=warm, repeats=reps, min_time_s=min_s, max_repeats=50, budget_s=budget,
                            device=dev)
        r["fwdbwd_ms"] = tb.median_ms
    if dev == "cuda":
        r["peak_MiB"] = torch.cuda.max_memory_allocated() / 2 ** 20
    kind = "sdpa" if c["op"] == "sdpa" else ("linear" if c["op"] == "linear" else "delta")
    fl = chunk_flops(kind, tp["B"], c["T"], tp["H"], tp["K"], tp["V"])
    r["fwd_tflops"] = fl / (tf.median_ms * 1e-3) / 1e12
    if not refused:
        r["fwdbwd_tflops"] = fl * BWD_FACTOR["sdpa" if kind == "sdpa" else "default"] / (tb.median_ms * 1e-3) / 1e12
    if peak:
        r["fwd_pct"] = 100 * r["fwd_tflops"] * 1e3 / peak
        if not refused:
            r["fwdbwd_pct"] = 100 * r["fwdbwd_tflops"] * 1e3 / peak
    r["status"] = "ok"
    return r


def fla_backward_refused(impl: str) -> Optional[str]:
    """Why fla-core would refuse the backward of the direct-call row `impl` ("fla:NAME") on this machine (its
    gated chunk kernels on Hopper with Triton >= 3.4, < 3.7.1: `linattn.fla.gated_backward_refused`), else None.
    The "linear" row passes a gate tensor, so every name in `linattn.fla.GATED_BACKWARD_KERNELS` is concerned."""
    from ... import fla

    if not impl.startswith("fla:") or impl[4:] not in fla.GATED_BACKWARD_KERNELS:
        return None
    return fla.gated_backward_refused()


def targets(cases: List[Dict[str, Any]]) -> List[List[Any]]:
    """The issue's targets from the measured rows: [op, T, pass, auto / fla, auto / SDPA, met], met being "-" where
    no target applies (auto within 10 % of fla's direct call from T = 8k, faster than SDPA from T = 2k)."""
    ms = {(c["op"], c["impl"], c["T"]): c for c in cases if c.get("status") == "ok"}
    rows = []
    for (op, impl, T), c in sorted(ms.items(), key=lambda x: (x[0][0], x[0][2])):
        if impl != "auto":
            continue
        fla = next((x for (o, i, t), x in ms.items() if o == op and t == T and i.startswith("fla:")), None)
        sdpa = next((x for (o, i, t), x in ms.items() if o == "sdpa" and t == T), None)
        for pas, key in (("fwd", "fwd_ms"), ("fwd+bwd", "fwdbwd_ms")):
            vs_fla = c[key] / fla[key] if fla and fla.get(key) else None   # (a forward-only fla row: no f+b)
            vs_sdpa = c[key] / sdpa[key] if sdpa else None
            checks = ([vs_fla <= 1.10] if vs_fla is not None and T >= 8192 else []) + \
                ([vs_sdpa < 1.0] if vs_sdpa is not None and T >= 2048 else [])
            rows.append([op, T, pas, vs_fla, vs_sdpa, ("yes" if all(checks) else "no") if checks else "-"])
    return rows


def step_timing(ctx: Ctx, rec: Dict[str, Any], deadline: float) -> None:
    plan, dev = ctx.plan, ctx.device
    tp = plan["time"]
    fla = fla_fns()
    rates = ctx.report.data["steps"]["machine"].get("matmul", {})
    peak = rates.get("bfloat16" if tp["dtype"] == torch.bfloat16 else "float32", {}).get("gflops")
    cases = timing_cases(plan)
    rows: List[List[Any]] = []
    rec["cases"] = []
    rec["table"] = {"headers": ["op", "impl", "T", "fwd ms", "fwd+bwd ms", "fwd TFLOP/s", "fwd %peak",
                                "f+b TFLOP/s", "f+b %peak", "peak MiB", "note"], "rows": rows}
    rec["notes"] = [f"B={tp['B']} H={tp['H']} K={tp['K']} V={tp['V']} {str(tp['dtype']).replace('torch.', '')}; "
                    "linear = identity map, unnormalised, scalar gate (fla's chunk_simple_gla); deltanet / gated / "
                    "kda with qk_l2norm; flops: `chunk_flops` (C=64), fwd+bwd = 3x fwd (SDPA 3.5x)",
                    "peak: " + (f"{peak / 1e3:.1f} TFLOP/s measured bf16 matmul" if peak else
                                "no matmul rate (the machine step did not run)")]
    missing = {n: repr(e) for n, e in fla.items() if not callable(e)}
    if missing:
        rec["notes"].append("fla rows skipped: " + "; ".join(f"{n}: {e}" for n, e in missing.items()))
    if dev != "cuda" and len(missing) < len(fla):  # imported (checked), but fla's kernels need a GPU
        rec["notes"].append(f"fla imports; its rows skipped on CPU: {', '.join(n for n in fla if n not in missing)}")
        missing = {n: "CPU" for n in fla}
    for i, c in enumerate(cases):
        if c["impl"].startswith("fla:") and c["impl"][4:] in missing:
            continue
        label = [c["op"], c["impl"], c["T"]]
        if time.monotonic() > deadline:
            rec["notes"].append(f"{len(cases) - i} cases skipped: the step's budget ran out (from {label})")
            rec["partial"] = True
            break
        t0 = time.monotonic()
        try:
            r = _time_case(c, plan, fla, dev, deadline, peak)
        except NotCovered as e:
            r = {**c, "status": "not covered", "note": str(e)[:160]}
        except Exception as e:
            r = {**c, "status": "error", "error": tail(traceback.format_exc(), 6),
                 "note": f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"}
        finally:
            free_cuda(dev)
        r["seconds"] = round(time.monotonic() - t0, 2)
        rec["cases"].append(r)
        rows.append(label + [r.get("fwd_ms"), r.get("fwdbwd_ms"), r.get("fwd_tflops"), r.get("fwd_pct"),
                             r.get("fwdbwd_tflops"), r.get("fwdbwd_pct"), r.get("peak_MiB"), r.get("note", "")])
        ctx.log(f"  {label}: {r['status']} fwd {fmt(r.get('fwd_ms'))} ms, f+b {fmt(r.get('fwdbwd_ms'))} ms")
        rec["targets"] = {"headers": ["op", "T", "pass", "auto / fla", "auto / SDPA", "met"],
                          "rows": targets(rec["cases"])}
        ctx.report.save()
