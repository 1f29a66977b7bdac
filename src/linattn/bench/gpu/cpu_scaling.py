"""Step `cpu-scaling` (optional, last): the compiled CPU kernels' linear attention and Gated DeltaNet chunk
forward and forward + backward at T = 16k, B = 1, H = 16 on 1, 2, 4, 8, 16 threads of the GPU machine's CPU
(the speed-up over 1 thread; the target: >= 8x at 16 threads for the forward)."""
from __future__ import annotations

import os
import time
import traceback
from typing import Any, Dict, List

import torch
import torch.nn.functional as F

from .. import common
from .base import Ctx, gen, tail

OPS = ("linear", "gated-deltanet")


def _fn(op: str, p: Dict[str, Any]):
    import linattn

    g = gen(0)
    B, T, H, K, V = p["B"], p["T"], p["H"], p["K"], p["V"]
    q, k, v = (torch.randn(B, T, H, d, generator=g).requires_grad_() for d in (K, K, V))
    if op == "linear":
        def fwd():
            return linattn.linear_attention(q, k, v, feature_map="elu+1", backend="cpu")[0]
        return fwd, [q, k, v]
    beta = torch.rand(B, T, H, generator=g).requires_grad_()
    gate = F.logsigmoid(torch.randn(B, T, H, generator=g) + 4).requires_grad_()

    def fwd():
        return linattn.delta_rule(q, k, v, beta, g=gate, qk_l2norm=True, backend="cpu")[0]
    return fwd, [q, k, v, beta, gate]


def step_cpu_scaling(ctx: Ctx, rec: Dict[str, Any], deadline: float) -> None:
    from ... import cpu

    p = ctx.plan["cpu"]
    rows: List[List[Any]] = []
    rec["cases"] = []
    rec["table"] = {"headers": ["op", "threads", "fwd ms", "fwd speed-up", "fwd+bwd ms", "f+b speed-up", "status"],
                    "rows": rows}
    rec["notes"] = [f"B={p['B']} T={p['T']} H={p['H']} K={p['K']} V={p['V']} fp32, backend='cpu'; "
                    f"{os.cpu_count()} CPUs; load before: {common.loadavg()}"]
    if not cpu.available("linear"):
        rec["status_override"], rec["reason"] = "skipped", "the compiled CPU kernels do not build here"
        return
    threads0 = torch.get_num_threads()
    try:
        for op in OPS:
            base: Dict[str, float] = {}
            for n in p["threads"]:
                if n > (os.cpu_count() or 1):
                    continue
                if time.monotonic() > deadline:
                    rec["notes"].append(f"budget ran out before {op} at {n} threads")
                    rec["partial"] = True
                    return
                r: Dict[str, Any] = {"op": op, "threads": n}
                try:
                    torch.set_num_threads(n)
                    fwd, ins = _fn(op, p)
                    with torch.no_grad():
                        r["fwd_ms"] = common.time_fn(fwd, warmup=1, repeats=p["repeats"], min_time_s=0.0,
                                                     max_repeats=p["repeats"], budget_s=None).median_ms

                    def fb():
                        o = fwd()
                        torch.autograd.grad(o, ins, grad_outputs=torch.ones_like(o))

                    r["fwdbwd_ms"] = common.time_fn(fb, warmup=1, repeats=p["repeats"], min_time_s=0.0,
                                                    max_repeats=p["repeats"], budget_s=None).median_ms
                    base.setdefault("fwd", r["fwd_ms"])
                    base.setdefault("fwdbwd", r["fwdbwd_ms"])
                    r["fwd_speedup"] = base["fwd"] / r["fwd_ms"]
                    r["fwdbwd_speedup"] = base["fwdbwd"] / r["fwdbwd_ms"]
                    r["status"] = "ok"
                except Exception as e:
                    r.update(status="error", error=tail(traceback.format_exc(), 8), note=f"{type(e).__name__}: {e}")
                rec["cases"].append(r)
                rows.append([op, n, r.get("fwd_ms"), r.get("fwd_speedup"), r.get("fwdbwd_ms"),
                             r.get("fwdbwd_speedup"), r["status"] if r["status"] == "ok" else r["note"][:100]])
                ctx.log(f"  {op} x{n}: {r['status']}")
                ctx.report.save()
    finally:
        torch.set_num_threads(threads0)
