"""The single-token decoding step of `LinearAttention` with a log-space feature map (ELA's Hadamard Exp, FAVOR+),
for `fast_decode`'s "linear" step.

The state is the operator's: [kv | z] `[B, HV, K_phi, V + 1]` with its per-feature log-scale mu `[B, HV, K_phi]`
(the true state is exp(mu) [kv | z]; mu the running maximum of the decayed key log-features). One token:
mu <- max(mu + g, lk), the state rows rescaled only where the key raises mu, the output relative to
c = max_d (lq_d + mu_d), so every exponent is <= 0 whatever the magnitudes. The compiled step
(`cpu/linear_log.step`, csrc/linear_log.c: the chunk kernel's own token update, so the bits of
`linear_attention`'s compiled forms) runs when the kernels are on and the layer allows it
(`compiled_decode`); otherwise the same arithmetic in PyTorch (ops/linear_recurrent.py's). Gates: none, RetNet's
gamma and the scalar (Mamba2) gate; the diagonal gate takes the general path.

Inside a model, Hadamard Exp without RoPE decodes through the whole-block and whole-model plans instead
(`models/decode_plan.py`, block kind 3: csrc/decode_log.h, the same token update); FAVOR+ and RoPE layers decode
layer by layer through this step.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..cpu import build as _build, linear_log as _cpu_log

__all__ = ["log_state_step"]

NEG = -1e30  # the log-scale of an empty state (ops/linear_common.py's)


def _compiled(layer, K_phi: int) -> bool:
    return (getattr(layer, "compiled_decode", True) and K_phi <= _cpu_log.MAX_FEATURES and _build.enabled()
            and _build.load_library("linear_log") is not None)


def _torch_step(lq, lk, v, g, S, mu) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The same token update in PyTorch: lq, lk [B, H, Kf], v [B, H, V], g [B, H] or None, S [B, H, Kf, V + 1],
    mu [B, H, Kf] -> (num, den, c, S, mu)."""
    decayed = mu if g is None else mu + g.unsqueeze(-1)
    new_mu = torch.maximum(decayed, lk)
    v1 = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)
    S = torch.exp(decayed - new_mu).unsqueeze(-1) * S + torch.exp(lk - new_mu).unsqueeze(-1) * v1.unsqueeze(-2)
    logits = lq + new_mu
    c = logits.amax(-1)
    y = torch.einsum("bhk,bhkv->bhv", torch.exp(logits - c.unsqueeze(-1)), S)
    return y[..., :-1], y[..., -1], c, S, new_mu


def log_state_step(layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: Optional[torch.Tensor],
                   S: Optional[torch.Tensor], mu: Optional[torch.Tensor]
                   ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One token of a log-space LinearAttention layer: q, k `[B, H, K]` (projected; q not yet scaled), v
    `[B, HV, V]`, g the log-gate `[B, HV]` or None, the state S `[B, HV, K_phi, V + 1]` and mu `[B, HV, K_phi]` (None:
    empty) -> (o `[B, HV, V]` (normalised as the operator does, or the plain sum), new S, new mu)."""
    fm = layer.feature_map
    B, H, _ = q.shape
    HV, V = v.shape[1], v.shape[-1]
    if layer.scale != 1.0:
        q = q * layer.scale
    lq, lk = fm.phi(q.unsqueeze(1)).squeeze(1), fm.psi(k.unsqueeze(1)).squeeze(1)     # [B, H, Kf] log-features
    if HV != H:   # grouped value heads: value head j reads the features of q/k head j // (HV / H)
        lq, lk = lq.repeat_interleave(HV // H, dim=1), lk.repeat_interleave(HV // H, dim=1)
    Kf = lq.shape[-1]
    if _compiled(layer, Kf):
        num, den, c, S, mu = _cpu_log.step(lq, lk, v, g, S, mu)
    else:
        if S is None:
            S = lq.new_zeros(B, HV, Kf, V + 1)
            mu = lq.new_full((B, HV, Kf), NEG)
        num, den, c, S, mu = _torch_step(lq, lk, v, g, S, mu)
    if layer.normalize:   # the stabilised denominator is >= 1 for these positive kernels: eps acts on it
        o = num / den.clamp_min(layer.eps).unsqueeze(-1)
    else:   # exp(c) alone may overflow where the product does not: in fp64, as the operator
        o = (num.double() * torch.exp(c.double()).unsqueeze(-1)).to(num.dtype)
    return o, S, mu
