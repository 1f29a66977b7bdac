"""Plain fp64 references written from the formulas, independent of linattn's phi/psi code."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative RMS error rms(a - b) / rms(b)."""
    a, b = a.double(), b.double()
    return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-300)).item()


def kernel(name: str, a: torch.Tensor, b: torch.Tensor, i=None, j=None, fmap=None) -> torch.Tensor:
    """k(a_i, b_j) for all pairs, computed directly: a [T, K], b [S, K] -> [T, S]."""
    if name == "identity":
        return a @ b.T
    if name == "elu+1":
        return (F.elu(a) + 1) @ (F.elu(b) + 1).T
    if name == "relu":
        return a.relu() @ b.relu().T
    if name == "cosformer":
        M = fmap.max_len
        return (a.relu() @ b.relu().T) * torch.cos(math.pi / 2 * (i[:, None] - j[None, :]).double() / M)
    if name == "taylor2":
        d = a @ b.T
        return 1 + d + d * d / 2
    if name == "hadamard_exp":
        return torch.logsumexp(a[:, None, :] + b[None, :, :], -1).exp()
    if name == "sum_sq_euclid":
        return ((a[:, None] + b[None]) ** 2).sum(-1)
    if name == "sub_sq_euclid":
        return ((a[:, None] - b[None]) ** 2).sum(-1)
    if name == "magnitude_direction":
        return (a @ b.T + 1) * ((a * a).sum(-1) + 1)[:, None] * ((b * b).sum(-1) + 1)[None]
    if name == "favor+":
        w = fmap.projection.double()
        m = w.shape[0]
        la = a @ w.T - (a * a).sum(-1, keepdim=True) / 2
        lb = b @ w.T - (b * b).sum(-1, keepdim=True) / 2
        return torch.logsumexp(la[:, None, :] + lb[None, :, :], -1).exp() / m
    raise KeyError(name)


def diag_features(name: str, a: torch.Tensor, fmap=None):
    """(features, is_log) for the per-feature (diagonal-gate) reference."""
    if name == "hadamard_exp":
        return a, True
    if name == "favor+":
        w = fmap.projection.double()
        return a @ w.T - (a * a).sum(-1, keepdim=True) / 2 - 0.5 * math.log(w.shape[0]), True
    if name == "elu+1":
        return F.elu(a) + 1, False
    if name == "relu":
        return a.relu(), False
    if name == "identity":
        return a, False
    raise KeyError(name)


def linear_attention_ref(q, k, v, name, *, causal=True, normalize=True, log_gate=None, scale=1.0,
                         eps=1e-6, fmap=None, offset=0):
    """fp64 quadratic reference. log_gate: None, [B,T,H] or [B,T,H,Kphi] (diagonal)."""
    q, k, v = q.double() * scale, k.double(), v.double()
    B, T, H, _ = q.shape
    out = torch.zeros(B, T, H, v.shape[-1], dtype=torch.float64)
    pos = torch.arange(T) + offset
    mask = torch.ones(T, T, dtype=torch.bool).tril() if causal else torch.ones(T, T, dtype=torch.bool)
    for bb in range(B):
        for h in range(H):
            if log_gate is not None and log_gate.dim() == 4:
                G = log_gate[bb, :, h].double().cumsum(0)  # [T, Kphi]
                fa, is_log = diag_features(name, q[bb, :, h], fmap)
                fb, _ = diag_features(name, k[bb, :, h], fmap)
                expo = G[:, None, :] - G[None, :, :]
                if is_log:
                    expo = expo + fa[:, None, :] + fb[None, :, :]
                    expo = expo.masked_fill(~mask[..., None], -math.inf)
                    W = torch.logsumexp(expo, -1).exp()
                else:
                    W = (fa[:, None, :] * fb[None, :, :] * torch.exp(expo.masked_fill(~mask[..., None], 0))).sum(-1)
            else:
                W = kernel(name, q[bb, :, h], k[bb, :, h], pos, pos, fmap)
                if log_gate is not None:
                    G = log_gate[bb, :, h].double().cumsum(0)
                    W = W * torch.exp((G[:, None] - G[None, :]).masked_fill(~mask, 0))
            W = W.masked_fill(~mask, 0)
            num, den = W @ v[bb, :, h], W.sum(1)
            if normalize:
                e = torch.tensor(eps, dtype=torch.float64)
                den = torch.where(den < 0, torch.minimum(den, -e), torch.maximum(den, e))
                out[bb, :, h] = num / den[:, None]
            else:
                out[bb, :, h] = num
    return out
