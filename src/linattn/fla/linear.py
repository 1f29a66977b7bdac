"""`linear_attention` on fla's kernels: chunk_simple_gla / chunk_gla and their fused_recurrent_* twins.

The translation, argument by argument (docs/backends.md has the table):

* features: the caller maps q and k through the feature map first (fla's kernels take the features), so any
  linear-space map runs here; fla's `scale` then multiplies the query features (linattn's `scale` is applied
  inside phi(scale q) by the caller for every map but the identity, and passed as 1.0 then);
* scale: always passed explicitly: fla's default (None) is K**-0.5, linattn's is 1;
* normalize: linattn's own construction, a column of ones appended to v, so that one kernel call returns the
  numerator and the denominator, decayed by the same gate, and the state is linattn's [kv | z] as it is
  (without a gate the caller sums the keys itself instead, `ops/backend.py`: the column would widen every
  value tile).
  (fla's `chunk_linear_attn(normalize=True)` is not used: its denominator adds 1e-10 instead of linattn's
  sign-keeping floor, sums the keys in the input dtype, takes no gate and keeps z as [N, 1, H, K].)
* gates: a constant decay per head (gamma) is fla's `g_gamma` [H] (log-space), a gate per head fla's `g`
  [B, T, H], a gate per feature fla's `gk` [B, T, H, K] (chunk_gla); all log-gates, as linattn's;
* state: fla's layout [N, H, K, V] is linattn's kv (with z as the ones column's value), in fp32;
* cu_seqlens: passed on (linattn already requires B = 1 with it, as fla does).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from . import kernel


def _gate_kwargs(log_gate: Optional[torch.Tensor], gamma_log: Optional[torch.Tensor], mode: str):
    """linattn's log-gate -> (fla module, function, gate keywords)."""
    chunk = mode == "chunk"
    if log_gate is not None and log_gate.dim() == 4:  # per feature: GLA
        return "fla.ops.gla", "chunk_gla" if chunk else "fused_recurrent_gla", {
            ("g" if chunk else "gk"): log_gate}
    name = "chunk_simple_gla" if chunk else "fused_recurrent_simple_gla"
    if gamma_log is not None:
        return "fla.ops.simple_gla", name, {"g_gamma": gamma_log}
    return "fla.ops.simple_gla", name, {"g": log_gate}


def linear_attention(fq: torch.Tensor, fk: torch.Tensor, v: torch.Tensor, *, scale: float, normalize: bool,
                     log_gate: Optional[torch.Tensor], gamma_log: Optional[torch.Tensor],
                     initial_state: Optional[torch.Tensor], output_final_state: bool,
                     cu_seqlens: Optional[torch.Tensor], mode: str
                     ) -> Tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Causal linear attention over features on fla's kernels.

    Args:
        fq: Query features `[B, T, H, K]` (fla's dtype: fp16, bf16 or fp32).
        fk: Key features `[B, T, H, K]`, the dtype of fq.
        v: Values `[B, T, H, V]`, the dtype of fq.
        scale: The query scale, passed to fla as it is (1.0: features already scaled).
        normalize: Also return the denominator (the ones column).
        log_gate: A log-gate `[B, T, H]` or `[B, T, H, K]` (fp32), or None.
        gamma_log: A constant log-decay per head `[H]` (fp32) instead of log_gate, or None.
        initial_state: `[N, H, K, V + normalize]` (fp32; the last column z when normalize), or None.
        output_final_state: Also return the final state, in the layout of initial_state.
        cu_seqlens: int64 `[N + 1]` sequence starts (B = 1), or None.
        mode: "chunk" or "recurrent".

    Returns:
        num `[B, T, H, V]`, den `[B, T, H]` (None without normalize), the final state or None.
    """
    V = v.shape[-1]
    if normalize:
        v = torch.cat([v, v.new_ones(*v.shape[:-1], 1)], dim=-1)
    module, name, gate = _gate_kwargs(log_gate, gamma_log, mode)
    out, S = kernel(module, name)(fq, fk, v, scale=scale, initial_state=initial_state,
                                  output_final_state=output_final_state, cu_seqlens=cu_seqlens, **gate)
    if not normalize:
        return out, None, S
    return out[..., :V], out[..., V], S
