"""`delta_rule` on fla's kernels: DeltaNet, Gated DeltaNet, KDA (and EFLA through its write strength).

The translation, argument by argument (docs/backends.md has the table):

* q, k, v: the caller's tensors in their own dtype, q/k with H heads and v with HV = n H (fla's grouped value
  heads read q/k head j // n, linattn's convention); chunk_delta_rule has no grouped heads, so DeltaNet with
  them takes chunk_gated_delta_rule (below);
* beta: fla's `beta` is linattn's write strength a_t (beta, or EFLA's exact coefficient computed by the caller);
* g: a log-gate per head is Gated DeltaNet's `g` [B, T, HV], per key channel KDA's `g` [B, T, HV, K], both
  log-space as linattn's, in fp32; no gate is chunk_delta_rule's DeltaNet (fp16 / bf16 only: it rejects fp32),
  else chunk_gated_delta_rule with a zero gate (exp(0) = 1: the same recurrence);
* qk_l2norm="rsqrt" (True) is fla's `use_qk_l2norm_in_kernel=True` (x * rsqrt(sum x^2 + 1e-6), the same
  formula); "clamp" is applied by the caller before the call, with the in-kernel norm off;
* scale: always explicit (linattn's default K**-0.5 is resolved by the caller);
* state: fla's [N, HV, K, V] in fp32 is linattn's layout;
* cu_seqlens: passed on (B = 1, as linattn requires).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from . import kernel


def chunk_kernel(gate_dim: Optional[int], dtype: torch.dtype, value_groups: int) -> Tuple[str, str]:
    """fla's chunk kernel (module, name) for a gate of `gate_dim` dimensions (None: no gate), the inputs' dtype
    and the value heads per q/k head: KDA (per channel), Gated DeltaNet (per head, or a zero gate), DeltaNet."""
    if gate_dim == 4:
        return "fla.ops.kda", "chunk_kda"
    if gate_dim is None and dtype != torch.float32 and value_groups == 1:
        return "fla.ops.delta_rule", "chunk_delta_rule"
    # chunk_delta_rule takes neither fp32 nor grouped value heads: the gated kernel with exp(0) = 1
    return "fla.ops.gated_delta_rule", "chunk_gated_delta_rule"


def _chunk_call(q, k, v, beta, g, kw):
    """The chunk kernel `chunk_kernel` names, called with fla's argument order (a zero gate where it needs one)."""
    module, name = chunk_kernel(None if g is None else g.dim(), q.dtype, v.shape[2] // q.shape[2])
    if name == "chunk_delta_rule":
        return kernel(module, name)(q, k, v, beta, **kw)
    if g is None:
        g = torch.zeros(beta.shape, dtype=torch.float32, device=beta.device)
    return kernel(module, name)(q, k, v, g, beta, **kw)


def _recurrent_call(q, k, v, beta, g, kw):
    """The decoding kernels (forward only): KDA's for per-channel gates, Gated DeltaNet's otherwise (g may be
    None there: DeltaNet)."""
    if g is not None and g.dim() == 4:
        return kernel("fla.ops.kda", "fused_recurrent_kda")(q, k, v, g, beta, **kw)
    return kernel("fla.ops.gated_delta_rule", "fused_recurrent_gated_delta_rule")(q, k, v, g=g, beta=beta, **kw)


def rwkv7(r: torch.Tensor, w: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *,
          scale: float, initial_state: Optional[torch.Tensor], output_final_state: bool,
          cu_seqlens: Optional[torch.Tensor], mode: str) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """RWKV-7's S_t = Diag(exp(w_t)) S_{t-1} + b_t (a_t^T S_{t-1}) + k_t v_t^T, o_t = scale S_t^T r_t on fla's
    `chunk_rwkv7` / `fused_recurrent_rwkv7` (forward only): linattn's `rwkv7` has fla's arguments, layout and
    meaning, so only the scale needs care: always explicit (fla's defaults differ between the two, 1.0 and
    K**-0.5).

    Args:
        r: The receptance `[B, T, H, K]` (fp16, bf16 or fp32).
        w: The log decay `[B, T, H, K]` (fp32).
        k: Keys `[B, T, H, K]`, the dtype of r.
        v: Values `[B, T, H, V]`, the dtype of r.
        a: The rank-one term's read vector `[B, T, H, K]`, the dtype of r.
        b: Its write vector `[B, T, H, K]`, the dtype of r.
        scale: The output scale, passed as it is.
        initial_state: `[N, H, K, V]` (fp32), or None.
        output_final_state: Also return the final state `[N, H, K, V]` (fp32).
        cu_seqlens: int64 `[N + 1]` sequence starts (B = 1), or None.
        mode: "chunk" or "recurrent".

    Returns:
        o `[B, T, H, V]` in the dtype of v, and the final state or None.
    """
    name = "chunk_rwkv7" if mode == "chunk" else "fused_recurrent_rwkv7"
    return kernel("fla.ops.rwkv7", name)(r, w, k, v, a, b, scale=scale, initial_state=initial_state,
                                         output_final_state=output_final_state, cu_seqlens=cu_seqlens)


def delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, *,
               g: Optional[torch.Tensor], scale: float, l2norm_in_kernel: bool,
               initial_state: Optional[torch.Tensor], output_final_state: bool,
               cu_seqlens: Optional[torch.Tensor], mode: str) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The delta rule S_t = (I - a_t k_t k_t^T) D_t S_{t-1} + a_t k_t v_t^T, o_t = scale S_t^T q_t on fla's kernels.

    Args:
        q: Queries `[B, T, H, K]` (fp16, bf16 or fp32).
        k: Keys `[B, T, H, K]`, the dtype of q.
        v: Values `[B, T, HV, V]`, HV = n H, the dtype of q.
        beta: The write strengths a_t `[B, T, HV]`, the dtype of q.
        g: A log-gate `[B, T, HV]` or `[B, T, HV, K]` (fp32), or None.
        scale: The output scale, passed to fla as it is.
        l2norm_in_kernel: fla's `use_qk_l2norm_in_kernel` (linattn's qk_l2norm="rsqrt").
        initial_state: `[N, HV, K, V]` (fp32), or None.
        output_final_state: Also return the final state `[N, HV, K, V]` (fp32).
        cu_seqlens: int64 `[N + 1]` sequence starts (B = 1), or None.
        mode: "chunk" or "recurrent" (forward only).

    Returns:
        o `[B, T, HV, V]` in the dtype of v, and the final state or None.
    """
    kw = dict(scale=scale, initial_state=initial_state, output_final_state=output_final_state,
              use_qk_l2norm_in_kernel=l2norm_in_kernel, cu_seqlens=cu_seqlens)
    call = _recurrent_call if mode == "recurrent" else _chunk_call
    return call(q, k, v, beta, g, kw)
