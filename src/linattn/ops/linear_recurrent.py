"""The recurrent form of `linear_attention`: one token at a time with a constant-size state (decoding).

S_t = exp(g_t) S_{t-1} + psi(k_t) [v_t | 1]^T, o_t = phi(q_t) S_t. Log-space maps (Hadamard Exp, FAVOR+)
keep their log-features and a per-feature log-scale mu, the running maximum of the decayed key
log-features, exactly like online softmax keeps its running max: the true state is exp(mu_d) * S_d,
and every rescaling factor is exp(<= 0). Layout and return type: `linear_common.py`.
"""
from __future__ import annotations

import torch

from .linear_common import FormResult, row_scale, split_ones, with_ones


def recurrent_form(fq, fk, v, g, S, mu) -> FormResult:
    """fq, fk [B, H, T, K_phi] (log-features for log-space maps, mu not None), v [B, H, T, V], g, S, mu as in
    `linear_common.py`."""
    v = with_ones(v)
    T = v.shape[2]
    outs, scales = [], []
    # per-step tensors by unbind: indexing [:, :, t] would give every step a full-size backward
    gs = g.unbind(2) if g is not None else [None] * T  # each [B, H, 1 or Kf]
    for q_t, k_t, v_t, gt in zip(fq.unbind(2), fk.unbind(2), v.unbind(2), gs):
        if mu is None:  # linear-space features
            if gt is not None:
                S = torch.exp(gt).unsqueeze(-1) * S
            S = S + k_t.unsqueeze(-1) * v_t.unsqueeze(-2)
            outs.append(torch.einsum("bhk,bhkv->bhv", q_t, S))
        else:  # log-space features: fq, fk are log-features; track the running max mu
            decayed = mu + gt if gt is not None else mu
            new_mu = torch.maximum(decayed, k_t).detach()
            S = torch.exp(decayed - new_mu).unsqueeze(-1) * S \
                + torch.exp(k_t - new_mu).unsqueeze(-1) * v_t.unsqueeze(-2)
            mu = new_mu
            logits = q_t + mu
            c = row_scale(logits, -1)
            scales.append(c)
            outs.append(torch.einsum("bhk,bhkv->bhv", torch.exp(logits - c.unsqueeze(-1)), S))
    o = torch.stack(outs, dim=2)
    return split_ones(o, torch.stack(scales, dim=2) if mu is not None else None, S, mu)
