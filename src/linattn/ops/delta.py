"""`delta_rule`: DeltaNet, Gated DeltaNet, Kimi Delta Attention and EFLA (error-free linear attention),
a thin wrapper over the delta family's core (`delta_core.py`, where the forms and numerics live).

With the state S_t `[K, V]` per head,

    S_t = (I - a_t k_t k_t^T) D_t S_{t-1} + a_t k_t v_t^T,      o_t = scale * S_t^T q_t,

D_t = Diag(exp(g_t)) (the identity without g), and

* DeltaNet:        a_t = beta_t, no gate;
* Gated DeltaNet:  a_t = beta_t, a log-gate g_t <= 0 per head `[B, T, H]`;
* Kimi Delta Attention (KDA): a_t = beta_t, a log-gate per key channel `[B, T, H, K]`;
* EFLA:            a_t = (1 - exp(-beta_t lambda_t)) / lambda_t with lambda_t = ||k_t||^2, the exact
                   (zero-order-hold) solution of dS/dt = -k k^T S + k v^T over a step of length beta_t;
                   a_t -> beta_t as lambda_t -> 0 (EFLA is DeltaNet's explicit-Euler limit); with
                   either gate too.
"""
from __future__ import annotations

from typing import Optional, Tuple, Union

import torch

from ..errors import LinattnTypeError
from .delta_core import efla_coefficient, prepare_delta, run_delta
from .registry import randn, register_op, uniform, unit


def delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, *,
    g: Optional[torch.Tensor] = None,
    exact: bool = False,
    scale: Optional[float] = None,
    qk_l2norm: Union[bool, str] = False,
    mode: str = "chunk",
    chunk_size: int = 64,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    backend: str = "auto",
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Delta-rule linear attention: DeltaNet, Gated DeltaNet, Kimi Delta Attention (KDA) and EFLA.

    S_t = (I - a_t k_t k_t^T) D_t S_{t-1} + a_t k_t v_t^T and o_t = scale * S_t^T q_t, with
    D_t = Diag(exp(g_t)) for a log-gate g (<= 0) `[B, T, H]` (Gated DeltaNet) or `[B, T, H, K]` (Kimi
    Delta Attention), and a_t = beta_t (exact=False) or a_t = (1 - exp(-beta_t ||k_t||^2)) / ||k_t||^2
    (exact=True: EFLA, the exact solution of the delta rule's ODE; a_t = beta_t at k_t = 0).

    Grouped value heads (Qwen3-Next's GVA): v `[B, T, HV, V]` with HV = n * H, beta `[B, T, HV]`, g `[B, T, HV]`
    or `[B, T, HV, K]` and the state `[N, HV, K, V]`; value head j reads q/k head j // n (transformers'
    repeat_interleave). q and k are normalised on their H heads, then repeated (materialised) to HV heads:
    beta and the gates differ per value head, so every value head has its own recurrence.

    Inputs of any float dtype; accumulation in fp32 (fp64 for fp64 inputs); output in the input dtype.
    DeltaNet with unnormalised keys and beta ||k||^2 > 2 is unstable by nature (see delta_core).

    Args:
        q: Queries `[B, T, H, K]`, any float dtype (fp16, bf16, fp32, fp64).
        k: Keys `[B, T, H, K]`, the dtype of q.
        v: Values `[B, T, H, V]` (or `[B, T, HV, V]`, grouped value heads).
        beta: Write strengths `[B, T, H]` (or `[B, T, HV]`), >= 0.
        g: Log-gate (<= 0): `[B, T, H]` per head (Gated DeltaNet), `[B, T, H, K]` per key channel (Kimi
            Delta Attention), or None (no decay).
        exact: False: a_t = beta_t; True: EFLA's a_t (above).
        scale: The output scale; None means K**-0.5.
        qk_l2norm: L2-normalises q and k first (inside the op, differentiably): True or "rsqrt" as
            flash-linear-attention and transformers, x * rsqrt(sum x^2 + 1e-6); "clamp" as F.normalize,
            x / max(||x||, 1e-6) (this operator's form before the choice existed); False: not at all.
        mode: The form: "chunk" (training), "recurrent" (decoding), "parallel" (quadratic closed form).
            They compute the same function (to rounding).
        chunk_size: The chunk length of the chunk form, in tokens.
        initial_state: The state to start from, `[N, H, K, V]` (a previous call's final state, from any
            mode), or None (zeros).
        output_final_state: Also return the state after the last token.
        cu_seqlens: int64 `[N+1]` offsets of N packed sequences (B == 1): each sequence starts from its own
            row of initial_state and ends in its own row of the final state. None: the B rows are the sequences.
        backend: "auto" (for CUDA tensors fla's kernels when fla-core is installed and covers the call, else
            linattn's Triton kernels when they do; the compiled CPU kernels for CPU tensors; PyTorch otherwise),
            "torch", "fla" (CUDA; see docs/backends.md), "triton" (on CPU only under TRITON_INTERPRET=1; see
            docs/triton.md) or "cpu". `linattn.explain` says which a call takes and why.

    Returns:
        o: The output `[B, T, H, V]` (or `[B, T, HV, V]`), in the input dtype.
        final_state: With output_final_state, the state `[N, H, K, V]` (N = B, or the number of sequences in
            cu_seqlens), a plain tensor, fp32 (fp64 for fp64 inputs), that round-trips between modes and
            calls; otherwise None.

    Raises:
        LinattnError: An argument of the wrong shape, dtype or value (the message names it).
        LinattnTypeError: exact is not a bool.

    Examples:
        >>> import torch
        >>> import torch.nn.functional as F
        >>> from linattn import delta_rule
        >>> B, T, H, K, V = 2, 10, 4, 16, 32
        >>> q, k = torch.randn(B, T, H, K), F.normalize(torch.randn(B, T, H, K), dim=-1)
        >>> v, beta = torch.randn(B, T, H, V), torch.rand(B, T, H)
        >>> o, S = delta_rule(q, k, v, beta, output_final_state=True)
        >>> o.shape, S.shape
        (torch.Size([2, 10, 4, 32]), torch.Size([2, 4, 16, 32]))

        The forms agree, and a state carries a sequence across calls:

        >>> o_rec, _ = delta_rule(q, k, v, beta, mode="recurrent")
        >>> torch.allclose(o, o_rec, atol=1e-5)
        True
        >>> o1, S1 = delta_rule(q[:, :6], k[:, :6], v[:, :6], beta[:, :6], output_final_state=True)
        >>> o2, _ = delta_rule(q[:, 6:], k[:, 6:], v[:, 6:], beta[:, 6:], initial_state=S1)
        >>> torch.allclose(torch.cat([o1, o2], 1), o, atol=1e-5)
        True

        Gated DeltaNet (a gate per head) and KDA (a gate per key channel):

        >>> g = -torch.rand(B, T, H)
        >>> o, _ = delta_rule(q, k, v, beta, g=g)
        >>> o, _ = delta_rule(q, k, v, beta, g=-torch.rand(B, T, H, K))
    """
    if not isinstance(exact, bool):
        raise LinattnTypeError(f"exact must be a bool, got {type(exact).__name__}")
    p = prepare_delta(q, k, v, beta, g=g, channel_gate=True, coefficient=efla_coefficient if exact else None,
                      scale=scale, qk_l2norm=qk_l2norm, mode=mode, chunk_size=chunk_size,
                      initial_state=initial_state, output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                      fused=backend in ("auto", "cpu"),   # backend="torch": the PyTorch preprocessing as well
                      backend=backend)                     # a call for fla's kernels: no preprocessing
    return run_delta(p, backend)


def _prepare(q, k, v, beta, *, exact: bool = False, backend: str = "auto", **kwargs):
    """delta_rule's prepared problem (chunk_size_used reads its chunk from it)."""
    return prepare_delta(q, k, v, beta, channel_gate=True, coefficient=efla_coefficient if exact else None, **kwargs)


def _example(gen, B, T, H, K, V, dtype):
    """Gated DeltaNet's inputs: unit q and k, beta in (0, 1), a scalar decay (the registry's conformance tests)."""
    q, k, v = unit(gen, (B, T, H, K), dtype), unit(gen, (B, T, H, K), dtype), randn(gen, (B, T, H, V), dtype)
    return (q, k, v, uniform(gen, (B, T, H), dtype)), {"g": uniform(gen, (B, T, H), dtype, -0.3, 0.0)}


register_op("delta_rule", delta_rule, prepare=_prepare, backends=True, forms=("parallel", "chunk", "recurrent"),
            example=_example, reference="delta_rule_ref", state=True,
            description="the delta rule: DeltaNet, Gated DeltaNet, EFLA (exact=True), KDA (g per key channel)")
