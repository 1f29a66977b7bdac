"""Step `correctness`: each GPU implementation (the fla backend, linattn's Triton kernels) against the PyTorch
forms on the same device: outputs, final states and the gradients of every input, within the tolerances of
docs/triton.md (ratio of RMS errors: fp32 1e-3, bf16 1e-2).

A case is one (op, backend, K, dtype, T, ...) point. The cheapest and most telling cases come first, so that
every kernel is compiled and checked once before the long sequences run. A call that a backend does not take
(it falls back to PyTorch with a warning, or raises a backend error) is listed as `not covered` with the reason,
never counted as passed."""
from __future__ import annotations

import math
import time
import traceback
import warnings
from typing import Any, Dict, List

import torch

from .base import Ctx, fmt, free_cuda, gen, rel_err, tail

TOL = {torch.float32: 1e-3, torch.bfloat16: 1e-2}
OPS = ("linear-chunk", "gla-chunk", "deltanet-chunk", "gated-deltanet-chunk", "kda-chunk", "efla-chunk",
       "linear-recurrent", "gla-recurrent", "gated-deltanet-recurrent", "kda-recurrent")
# grouped value heads through the public API (v with GROUP x the q/k heads), every backend
GVA_OPS = ("linear-chunk-gva", "gated-deltanet-chunk-gva")
# the Triton entry points with grouped q, k against the same entry points with q, k expanded to H heads
GROUPED_OPS = ("linear-chunk-grouped", "delta-chunk-grouped")
GROUP = 4


def correctness_cases(plan) -> List[Dict[str, Any]]:
    """The grid, in the order it runs."""
    cases: List[Dict[str, Any]] = []
    backends, dtypes, Ks, Ts = plan["backends"], plan["dtypes"], plan["Ks"], plan["Ts"]
    few = plan.get("few_ops")  # the dry run: the extra rounds on two ops only (time in `make test`)

    def add(op, K, T, gate=True, state=True, varlen=False, only=None):
        if op.endswith("recurrent") and T > plan["rec_max_T"]:
            return
        for be in only or backends:
            for dt in dtypes:
                cases.append(dict(op=op, backend=be, K=K, dtype=dt, T=T, gate=gate, state=state, varlen=varlen))

    for op in OPS:  # every kernel once, short
        add(op, Ks[0], Ts[0])
    for op in few or OPS:  # uneven packed sequences
        add(op, Ks[0], sum(plan["varlen"]), varlen=True)
    for op in GVA_OPS:
        add(op, Ks[0], Ts[0])
        add(op, Ks[0], sum(plan["varlen"]), varlen=True)
    for op in GROUPED_OPS:
        add(op, Ks[0], Ts[0], only=("triton",))
        if not few:
            add(op, Ks[0], sum(plan["varlen"]), varlen=True, only=("triton",))
    for op in few or ("linear-chunk", "linear-recurrent", "deltanet-chunk"):
        add(op, Ks[0], Ts[0], gate=False, state=False)
    for T in Ts[1:]:
        for op in OPS:
            add(op, Ks[0], T)
    for K in Ks[1:]:
        for T in (Ts[0], Ts[-1]):
            for op in OPS:
                add(op, K, T)
    return cases


def case_id(c) -> str:
    return (f"{c['op']} [{c['backend']}] K={c['K']} {str(c['dtype']).replace('torch.', '')} T={c['T']}"
            + ("" if c["gate"] else " no-gate") + ("" if c["state"] else " no-state")
            + (" varlen" if c["varlen"] else ""))


def _make_inputs(c, plan, device, seed=0):
    """Leaves (fp32, requires_grad where gradients are checked) and call(backend) through the public API."""
    import linattn

    g = gen(seed)
    op = c["op"]
    gva = op.endswith("-gva")
    H, K = plan["H"], c["K"]
    HQ = max(1, H // GROUP) if gva else H  # q/k heads
    HV = HQ * GROUP if gva else H  # value heads (states and gates per value head)
    V = K
    B = 1 if c["varlen"] else plan["B"]
    T = c["T"]
    N = len(plan["varlen"]) if c["varlen"] else B
    chunk = "-chunk" in op
    linear = op.startswith(("linear", "gla"))

    def rnd(*s, scale=1.0):
        return (torch.randn(*s, generator=g) * scale).to(device)

    leaves = {"q": rnd(B, T, HQ, K), "k": rnd(B, T, HQ, K), "v": rnd(B, T, HV, V)}
    kw: Dict[str, Any] = {"chunk_size": plan["chunk"], "output_final_state": True,
                          "mode": "chunk" if chunk else "recurrent"}
    if c["varlen"]:
        cu = [0]
        for n in plan["varlen"]:
            cu.append(cu[-1] + n)
        kw["cu_seqlens"] = torch.tensor(cu, dtype=torch.int64, device=device)
    if linear:
        leaves["q"] = leaves["q"] * 0.5
        leaves["k"] = leaves["k"] * 0.5
        kw.update(feature_map="elu+1", normalize=True)
        if c["gate"]:  # scalar, or diagonal (GLA: one per feature)
            shape = (B, T, HV, K) if op.startswith("gla") else (B, T, HV)
            leaves["g"] = -torch.rand(*shape, generator=g).to(device) * 0.3
        if c["state"]:
            leaves["kv0"] = rnd(N, HV, K, V)
            leaves["z0"] = (torch.rand(N, HV, K, generator=g) + 0.5).to(device)
    else:
        leaves["beta"] = torch.rand(B, T, HV, generator=g).to(device)
        if op.startswith("efla"):
            kw["exact"] = True
            leaves["k"] = leaves["k"] * 0.3
        else:
            kw["qk_l2norm"] = True
        if c["gate"] and op.startswith("gated"):
            leaves["g"] = -torch.rand(B, T, HV, generator=g).to(device) * 0.3
        elif c["gate"] and op.startswith("kda"):  # per-channel gates
            leaves["g"] = -torch.rand(B, T, HV, K, generator=g).to(device) * 0.3
        if c["state"]:
            leaves["S0"] = rnd(N, HV, K, V, scale=0.1)
    for x in leaves.values():
        x.requires_grad_(chunk)

    def call(backend):
        dt = c["dtype"]
        q, k, v = (leaves[n].to(dt) for n in ("q", "k", "v"))
        a = dict(kw)
        if "g" in leaves:
            a["g"] = leaves["g"]
        if linear:
            if "kv0" in leaves:
                a["initial_state"] = linattn.LinearAttentionState(
                    leaves["kv0"], leaves["z0"], None, torch.zeros(N, dtype=torch.int64, device=device))
            o, st = linattn.linear_attention(q, k, v, backend=backend, **a)
            return o, ([st.kv, st.z] if st is not None else [])
        if "S0" in leaves:
            a["initial_state"] = leaves["S0"]
        o, st = linattn.delta_rule(q, k, v, leaves["beta"], backend=backend, **a)
        return o, ([st] if st is not None else [])

    return leaves, call, chunk


def _make_grouped_inputs(c, plan, device, seed=0):
    """Entry-point inputs [TT, H, D] with q, k on H // GROUP heads; call("triton") runs them grouped,
    call("torch") with q, k expanded to H heads (repeat_interleave: autograd sums the q/k gradients)."""
    from ...triton import delta as TD, linear as TL

    g = gen(seed)
    H, K = plan["H"], c["K"]
    HQ, V = max(1, H // GROUP), K
    H = HQ * GROUP
    lens = list(plan["varlen"]) if c["varlen"] else [c["T"]] * plan["B"]
    starts = [0]
    for n in lens:
        starts.append(starts[-1] + n)
    TT, N = starts[-1], len(lens)

    def rnd(*s, scale=1.0):
        return (torch.randn(*s, generator=g) * scale).to(device).requires_grad_()

    leaves = {"q": rnd(TT, HQ, K, scale=0.5), "k": rnd(TT, HQ, K, scale=0.5), "v": rnd(TT, H, V),
              "g": (-torch.rand(TT, H, generator=g) * 0.3).to(device).requires_grad_()}
    linear = c["op"].startswith("linear")
    if linear:
        leaves["h0"], leaves["z0"] = rnd(N, H, K, V), (torch.rand(N, H, K, generator=g) + 0.5).to(device)
        leaves["z0"].requires_grad_()
    else:
        leaves["b"] = torch.rand(TT, H, generator=g).to(device).requires_grad_()
        leaves["h0"] = rnd(N, H, K, V, scale=0.1)
        leaves["k"] = (leaves["k"].detach() / leaves["k"].detach().norm(dim=-1, keepdim=True)).requires_grad_()

    def call(mode):
        dt = c["dtype"]
        q, k, v = (leaves[n].to(dt) for n in ("q", "k", "v"))
        if mode == "torch":  # the expanded call
            q, k = q.repeat_interleave(GROUP, dim=1), k.repeat_interleave(GROUP, dim=1)
        if linear:
            num, den, ht, zt = TL.chunk_linear_attention(
                q, k, v, leaves["g"], leaves["h0"], leaves["z0"], fused="elu+1", scale=K ** -0.5, norm=True,
                starts=starts, chunk_size=plan["chunk"], output_final_state=True)
            return num, [den, ht, zt]
        o, ht = TD.chunk_delta_rule(q * K ** -0.5, k, v, leaves["b"], leaves["g"], leaves["h0"], starts=starts,
                                    chunk_size=plan["chunk"], output_final_state=True)
        return o, [ht]

    return leaves, call, True


def _outputs_and_grads(leaves, call, backend, with_grad):
    o, st = call(backend)
    parts = [o] + st
    grads = []
    if with_grad:
        g = gen(1)
        loss = sum((t.float() * torch.randn(t.shape, generator=g).to(t.device)).sum() for t in parts)
        names = list(leaves)
        grads = list(zip(names, torch.autograd.grad(loss, [leaves[n] for n in names], allow_unused=True)))
    return parts, grads


def run_correctness_case(c, plan, device) -> Dict[str, Any]:
    """One case: the backend's outputs, states and gradients against the PyTorch form's."""
    from ...ops.backend import BackendDeviceError, BackendUnavailableError

    make = _make_grouped_inputs if c["op"] in GROUPED_OPS else _make_inputs
    leaves, call, with_grad = make(c, plan, device)
    tol = TOL[c["dtype"]]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            pa, ga = _outputs_and_grads(leaves, call, c["backend"], with_grad)
        except (BackendDeviceError, BackendUnavailableError) as e:
            return {"status": "not covered", "note": str(e).splitlines()[0][:200]}
    fell = [str(w.message) for w in caught if "falling back" in str(w.message)]
    if fell:  # the backend did not take the call: comparing PyTorch with itself would prove nothing
        return {"status": "not covered", "note": fell[0][:200]}
    pb, gb = _outputs_and_grads(leaves, call, "torch", with_grad)
    errs = {"o": rel_err(pa[0], pb[0])}
    for i, (x, y) in enumerate(zip(pa[1:], pb[1:])):
        errs[f"state{i}"] = rel_err(x, y)
    finite = all(torch.isfinite(t).all().item() for t in pa)
    for (n, x), (_, y) in zip(ga, gb):
        if x is None or y is None:
            continue
        errs[f"d{n}"] = rel_err(x, y)
        finite = finite and bool(torch.isfinite(x).all().item())
    worst = max(errs, key=lambda k: errs[k] if errs[k] == errs[k] else math.inf)
    ok = finite and all(e <= tol for e in errs.values())
    return dict(errors=errs, worst=worst, max_err=errs[worst], tol=tol, finite=finite, status="ok" if ok else "FAIL")


def step_correctness(ctx: Ctx, rec: Dict[str, Any], deadline: float) -> None:
    plan, dev = ctx.plan, ctx.device
    cases = correctness_cases(plan)
    rows: List[List[Any]] = []
    rec["cases"] = []
    rec["table"] = {"headers": ["case", "status", "worst", "max rel err", "tol", "s", "note"], "rows": rows}
    rec["notes"] = [f"{len(cases)} cases planned; B={plan['B']} H={plan['H']} chunk {plan['chunk']}; uneven "
                    f"cu_seqlens lengths {list(plan['varlen'])}; recurrent (decoding) forms up to "
                    f"T={plan['rec_max_T']}, forward only; backends {', '.join(plan['backends'])}"]
    for i, c in enumerate(cases):
        cid = case_id(c)
        if time.monotonic() > deadline:
            rec["notes"].append(f"{len(cases) - i} cases skipped: the step's budget ran out (first skipped: {cid})")
            rec["skipped_cases"] = [case_id(x) for x in cases[i:]]
            rec["partial"] = True
            break
        t0 = time.monotonic()
        try:
            r = run_correctness_case(c, plan, dev)
        except Exception as e:
            r = {"status": "error", "error": tail(traceback.format_exc(), 8), "max_err": None,
                 "worst": type(e).__name__}
        finally:
            free_cuda(dev)
        r["case"], r["seconds"] = cid, round(time.monotonic() - t0, 2)
        rec["cases"].append(r)
        rows.append([cid, r["status"], r.get("worst"), r.get("max_err"), r.get("tol"), r["seconds"],
                     r.get("note", "")])
        ctx.log(f"  {cid}: {r['status']} {r.get('worst') or r.get('note', '')[:80]} {fmt(r.get('max_err'))} "
                f"({r['seconds']} s)")
        ctx.report.save()
    rec["passed"] = sum(r["status"] == "ok" for r in rec["cases"])
    rec["failed"] = sum(r["status"] == "FAIL" for r in rec["cases"])
    rec["not_covered"] = sum(r["status"] == "not covered" for r in rec["cases"])
