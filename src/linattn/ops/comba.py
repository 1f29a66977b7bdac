"""`comba`: Comba's gated delta rule (Hu et al. 2025, "Comba: Improving Bilinear RNNs with Closed-loop
Control"), a thin wrapper over the delta family's core (`delta_core.py`).

With the state S_t `[K, V]` per head,

    S_t = exp(g_t) S_{t-1} + beta_t k_t (v_t - S_{t-1}^T p_t)^T,      o_t = scale * S_t^T q_t,

the seed's eq. (18): the decay acts on the first S_{t-1} only, the prediction S_{t-1}^T p_t reads the
*undecayed* state with its own key p (the "state feedback"), and the write uses k. p = None means
p = k, which is eq. (18) itself. In the core's terms: a = beta, r = p (or r = k: NOT the core's r = None,
which is the delta rule's read of the decayed state, r_t = exp(g_t) k_t, i.e. Gated DeltaNet).

qk_l2norm=True L2-normalises q and k inside the op; p is never normalised, because its norm is the
feedback gain (the Comba layer passes p = sigmoid(c_h) * k_hat with a learnable per-head c_h). With
p = None the read key is the normalised k. (flash-linear-attention's `use_qk_l2norm_in_kernel`
normalises p too; pass `F.normalize(p, dim=-1)` for that behaviour.)
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

import torch

from ._common import check_qkv
from .delta_core import check_tensor_like, prepare_delta, run_delta
from .heads import value_groups
from .registry import randn, register_op, uniform, unit


def comba(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, *,
    p: Optional[torch.Tensor] = None,
    g: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    qk_l2norm: bool = False,
    mode: str = "chunk",
    chunk_size: int = 64,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    backend: str = "auto",
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Comba: the gated delta rule with a separate read key for the prediction.

    S_t = exp(g_t) S_{t-1} + beta_t k_t (v_t - S_{t-1}^T p_t)^T and o_t = scale * S_t^T q_t, with a
    log-gate g (<= 0) `[B, T, H]` per head, or `[B, T, H, K]` per key channel (Diag(exp(g_t)) then
    decays the rows of S); no gate when None. p: the read key of the prediction (None: p = k, the seed's
    eq. 18). scale=None means K**-0.5. qk_l2norm=True L2-normalises q and k (never p; module docstring).

    Args:
        q: Queries `[B, T, H, K]`, any float dtype.
        k: Keys `[B, T, H, K]`, the dtype of q.
        v: Values `[B, T, H, V]` (or `[B, T, HV, V]`, grouped value heads as in `delta_rule`).
        beta: Write strengths `[B, T, H]`, >= 0.
        p: The read key of the prediction `[B, T, H, K]` (never normalised: its norm is the feedback gain),
            or None: p = k, the seed's eq. 18.
        g: Log-gate (<= 0): `[B, T, H]` per head, `[B, T, H, K]` per key channel, or None (no decay).
        scale: The output scale; None means K**-0.5.
        qk_l2norm: True L2-normalises q and k inside the op (never p).
        mode: The form: "chunk" (training), "recurrent" (decoding), "parallel" (quadratic closed form).
        chunk_size: The chunk length of the chunk form, in tokens.
        initial_state: The state to start from, `[N, H, K, V]`, or None (zeros).
        output_final_state: Also return the state after the last token.
        cu_seqlens: int64 `[N+1]` offsets of N packed sequences (B == 1), each with its own state.
        backend: "auto", "torch", "triton" or "fla" (neither kernel set covers a separate read key yet: every
            call runs on PyTorch; "triton" warns once and falls back, "fla" raises).

    Returns:
        o: The output `[B, T, H, V]`, in the input dtype.
        final_state: With output_final_state, the state `[N, H, K, V]` (N = B, or the number of sequences in
            cu_seqlens), fp32 (fp64 for fp64 inputs); it round-trips between modes and calls. Otherwise None.

    Raises:
        LinattnError: An argument of the wrong shape, dtype or value (the message names it).

    Examples:
        >>> import torch
        >>> import torch.nn.functional as F
        >>> from linattn import comba
        >>> B, T, H, K, V = 1, 12, 2, 8, 8
        >>> q, k = torch.randn(B, T, H, K), F.normalize(torch.randn(B, T, H, K), dim=-1)
        >>> v, beta, g = torch.randn(B, T, H, V), torch.rand(B, T, H), -torch.rand(B, T, H)
        >>> p = 0.5 * k                                    # a feedback gain of 0.5
        >>> o, S = comba(q, k, v, beta, p=p, g=g, output_final_state=True)
        >>> o.shape, S.shape
        (torch.Size([1, 12, 2, 8]), torch.Size([1, 2, 8, 8]))
        >>> o_rec, _ = comba(q, k, v, beta, p=p, g=g, mode="recurrent")
        >>> torch.allclose(o, o_rec, atol=1e-5)
        True
    """
    if p is not None:
        check_qkv(q, k, v[:, :, ::value_groups(q, v)])   # q first, so that a bad q is reported as such
        check_tensor_like(p, "p", q)
    prob = prepare_delta(q, k, v, beta, g=g, r=p, channel_gate=True, scale=scale, qk_l2norm=qk_l2norm,
                         mode=mode, chunk_size=chunk_size, initial_state=initial_state,
                         output_final_state=output_final_state, cu_seqlens=cu_seqlens)
    if p is None:
        # p = k: the read key is the prepared (normalised if asked, rescaled) write key itself, which is
        # exactly r~ = k / d of the core's rescaling
        prob = dataclasses.replace(prob, r=prob.k)
    return run_delta(prob, backend)


def _prepare(q, k, v, beta, *, p=None, backend: str = "auto", **kwargs):
    """comba's prepared problem: it always reads with a key of its own (p, or k), so it has no Triton kernel."""
    return prepare_delta(q, k, v, beta, r=k if p is None else p, channel_gate=True, **kwargs)


def _example(gen, B, T, H, K, V, dtype):
    """Unit q and k, a read key p of norm < 1, beta in (0, 1), a scalar decay (the registry's conformance tests)."""
    q, k, v = unit(gen, (B, T, H, K), dtype), unit(gen, (B, T, H, K), dtype), randn(gen, (B, T, H, V), dtype)
    kw = {"p": 0.5 * unit(gen, (B, T, H, K), dtype), "g": uniform(gen, (B, T, H), dtype, -0.3, 0.0)}
    return (q, k, v, uniform(gen, (B, T, H), dtype)), kw


register_op("comba", comba, prepare=_prepare, backends=True, forms=("parallel", "chunk", "recurrent"),
            example=_example, reference="comba_ref", state=True,
            description="Comba: gated delta rule with state feedback (read key p) and output correction")
