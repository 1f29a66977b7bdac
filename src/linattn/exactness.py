"""Every form of every operator against its fp64 reference (`linattn.ops.reference`, written from the
formulas): part 1 of `linattn demo`, and a quick check that a build computes what it should."""
from __future__ import annotations

from typing import Any, Dict, List

import torch
import torch.nn.functional as F

from .bench.common import format_table
from .feature_maps import FEATURE_MAP_NAMES, FAVORPlus, get_feature_map
from .ops import (
    comba,
    delta_product,
    delta_rule,
    deltaformer,
    forgetting_attention,
    linear_attention,
    mesa_net,
    path_attention,
    rwkv7,
    titans,
    ttt,
)
from .ops.reference import (
    comba_ref,
    delta_product_ref,
    delta_rule_ref,
    deltaformer_ref,
    forgetting_attention_ref,
    linear_attention_ref,
    mesa_net_ref,
    path_attention_ref,
    rwkv7_ref,
    ttt_ref,
)


def run_exactness(T: int = 37, B: int = 2, H: int = 2, K: int = 6, V: int = 5, chunk_size: int = 16,
                  seed: int = 0, eps: float = 1e-6) -> List[Dict[str, Any]]:
    """Max error of every form of every operator against its fp64 reference (linattn.ops.reference).

    linear_attention: each feature map (causal, normalised) in parallel, chunk and recurrent form.
    delta_rule: DeltaNet, Gated DeltaNet, EFLA, gated EFLA, KDA in the three forms; comba; delta_product; rwkv7.
    mesa_net (both solvers, three forms); ttt and titans (chunk and recurrent: no parallel form).
    T is deliberately not a multiple of chunk_size (padding and several chunks are exercised).

    Args:
        T: Tokens (not a multiple of chunk_size).
        B: Batch rows.
        H: Heads.
        K: Key width.
        V: Value width.
        chunk_size: The chunk form's block length.
        seed: Seed of the random inputs.
        eps: The normalised linear attention's epsilon.

    Returns:
        One dict per (operator, variant, form): family, name, mode, max_abs_err, max_rel_err, note (an error
        message when the form failed to run, else None).
    """

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
    # the delta rule's variants: Kimi Delta Attention (a log-gate per key channel), Comba (p = k) and
    # Gated DeltaProduct (2 keys per token, beta in (0, 2))
    gk = -F.softplus(torch.randn(B, T, H, K, generator=gen, dtype=torch.float64)) / 4
    k2 = F.normalize(torch.randn(B, T, H, 2, K, generator=gen, dtype=torch.float64), dim=-1)
    v2 = torch.randn(B, T, H, 2, V, generator=gen, dtype=torch.float64)
    b2 = 2 * torch.sigmoid(torch.randn(B, T, H, 2, generator=gen, dtype=torch.float64))
    refs = [("delta_rule", "KDA", delta_rule_ref(qn, kn, v, beta, g=gk, scale=scale)[0], delta_rule,
             (qn, kn, v, beta), gk),
            ("comba", "Comba", comba_ref(qn, kn, v, beta, g=g, scale=scale)[0], comba, (qn, kn, v, beta), g),
            ("delta_product", "Gated DeltaProduct n=2", delta_product_ref(qn, k2, v2, b2, g=g, scale=scale)[0],
             delta_product, (qn, k2, v2, b2), g)]
    for family, name, ref, op, args, gg in refs:
        for mode in ("parallel", "chunk", "recurrent"):
            record(family, name, mode, ref, op, *args, g=gg, scale=scale)
    # RWKV-7: w a per-channel log decay, a = -kk, b = kk * sigmoid (as its layer), scale 1 (fla's default)
    kkn = F.normalize(torch.randn(B, T, H, K, generator=gen, dtype=torch.float64), dim=-1)
    rw_args = (q, gk, k, v, -kkn, kkn * torch.sigmoid(torch.randn(B, T, H, K, generator=gen, dtype=torch.float64)))
    ref = rwkv7_ref(*rw_args)[0]
    for mode in ("parallel", "chunk", "recurrent"):
        record("rwkv7", "RWKV-7", mode, ref, rwkv7, *rw_args)
    # the test-time family: MesaNet (both solvers), TTT-Linear and Titans (mini-batches of 4, no residual
    # so that V may differ from K; chunk and recurrent: they have no parallel form)
    lam = 0.5 + torch.rand(H, K, generator=gen, dtype=torch.float64)
    ref = mesa_net_ref(qn, kn, v, beta, g, lam)[0]
    for solver in ("exact", "cg"):
        for mode in ("parallel", "chunk", "recurrent"):
            record("mesa_net", f"MesaNet ({solver})", mode, ref, mesa_net, qn, kn, v, beta, g, lam, solver=solver)
    w0 = (0.3 * torch.randn(B, H, K, V, generator=gen, dtype=torch.float64),
          0.1 * torch.randn(B, H, V, generator=gen, dtype=torch.float64))
    alpha = 0.1 * torch.rand(B, T, H, generator=gen, dtype=torch.float64)
    mom = torch.rand(B, T, H, generator=gen, dtype=torch.float64)
    lr = 0.3 * beta

    def tt(*args, mode, chunk_size, **kw):  # the mini-batch is the model's, not a chunk size
        return (titans if len(args) == 6 else ttt)(*args, mode=mode, mini_batch=4, residual=False,
                                                   initial_state=w0, **kw)

    for name, args, extra in (("TTT-Linear", (q, k, v, lr), {}),
                              ("Titans (linear)", (q, k, v, lr, alpha, mom), dict(alpha=alpha, momentum=mom))):
        ref = ttt_ref(q, k, v, lr, w0, mini_batch=4, residual=False, **extra)[0]
        for mode in ("chunk", "recurrent"):
            record("ttt" if len(args) == 4 else "titans", name, mode, ref, tt, *args)
    # the softmax side, FoX, DeltaFormer, PaTH (with FoX's gate): block_size plays chunk_size's part
    gf = F.logsigmoid(torch.randn(B, T, H, generator=gen, dtype=torch.float64) + 1.0)
    wn = F.normalize(torch.randn(B, T, H, K, generator=gen, dtype=torch.float64), dim=-1)
    feedback = (
        ("forgetting_attention", "FoX", forgetting_attention_ref(q, k, v, gf),
         lambda mode, chunk_size: forgetting_attention(q, k, v, gf, mode=mode, block_size=chunk_size)),
        ("deltaformer", "DeltaFormer", deltaformer_ref(q, k, v, beta)[0],
         lambda mode, chunk_size: deltaformer(q, k, v, beta, mode=mode, block_size=chunk_size)),
        ("path_attention", "PaTH-FoX", path_attention_ref(q, k, v, wn, 2 * beta, g=gf),
         lambda mode, chunk_size: path_attention(q, k, v, wn, 2 * beta, g=gf, mode=mode, block_size=chunk_size)),
    )
    for family, name, ref, fn in feedback:
        for mode in ("parallel", "chunk", "recurrent"):
            record(family, name, mode, ref, lambda mode, chunk_size, fn=fn: (fn(mode, chunk_size),))
    return rows


def format_exactness(rows) -> str:
    """The rows of `run_exactness` as a plain-text table.

    Args:
        rows: `run_exactness`'s result.

    Returns:
        The table.
    """
    def e(x):
        return "-" if x is None else f"{x:.1e}"
    return format_table(
        ["operator", "variant", "form", "max abs err", "max rel err", "note"],
        [[r["family"], r["name"], r["mode"], e(r["max_abs_err"]), e(r["max_rel_err"]), r["note"] or ""]
         for r in rows], align="lllrrl")


__all__ = ["run_exactness", "format_exactness"]
