"""fp64 references written from the formulas, independent of the operators' code: what the tests,
the benchmarks' exactness table and the demo compare every form of every operator against.

They are slow on purpose (explicit T x T kernels, token-by-token loops) and import nothing from
linattn but the feature maps' drawn parameters (FAVOR+'s projection, cosFormer's horizon), which define
the kernel being computed.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F


LOG_SPACE_KERNELS = ("hadamard_exp", "favor+")


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
            if normalize and name in LOG_SPACE_KERNELS:
                # strictly positive kernels: eps acts on the stabilised denominator (>= 1), i.e. never
                out[bb, :, h] = num / den[:, None]
            elif normalize:
                e = torch.tensor(eps, dtype=torch.float64)
                den = torch.where(den < 0, torch.minimum(den, -e), torch.maximum(den, e))
                out[bb, :, h] = num / den[:, None]
            else:
                out[bb, :, h] = num
    return out


# ---------------------------------------------------------------- the delta-rule family

def efla_coefficient(beta: torch.Tensor, lam: torch.Tensor) -> torch.Tensor:
    """EFLA's a = (1 - exp(-beta lam)) / lam, and beta where lam == 0."""
    lam_safe = torch.where(lam > 0, lam, torch.ones_like(lam))
    return torch.where(lam > 0, -torch.expm1(-beta * lam_safe) / lam_safe, beta)


def delta_scan_ref(q, k, v, a, *, r=None, g=None, scale=1.0, S0=None):
    """The general delta recurrence, token by token in fp64:

        S_t = D_t S_{t-1} - a_t k_t (S_{t-1}^T r_t)^T + a_t k_t v_t^T,   o_t = scale S_t^T q_t,

    D_t = diag(exp(g_t)) (g [B, T, H] scalar or [B, T, H, K] per channel, None: no decay). r=None
    means the delta rule's own read, r_t = D_t k_t (the erase acts on the decayed state).
    q, k, r [B, T, H, K], v [B, T, H, V], a [B, T, H] -> (o [B, T, H, V], S [B, H, K, V]).
    """
    q, k, v, a = q.double(), k.double(), v.double(), a.double()
    B, T, H, K = q.shape
    S = S0.double() if S0 is not None else torch.zeros(B, H, K, v.shape[-1], dtype=torch.float64)
    outs = []
    for t in range(T):
        kt, vt, at = k[:, t], v[:, t], a[:, t]
        if g is None:
            decay = torch.ones(B, H, 1, dtype=torch.float64)
        else:
            gt = g[:, t].double()
            decay = torch.exp(gt if gt.dim() == 3 else gt[..., None])  # [B, H, K or 1]
        rt = decay * kt if r is None else r[:, t].double()
        pred = (rt[..., :, None] * S).sum(-2)  # S^T r (elementwise: tiny matmuls thrash shared CPUs)
        S = decay[..., None] * S + at[..., None, None] * kt[..., :, None] * (vt - pred)[..., None, :]
        outs.append(scale * (q[:, t, :, :, None] * S).sum(-2))
    return torch.stack(outs, dim=1), S


def delta_rule_ref(q, k, v, beta, g=None, exact=False, scale=None, qk_l2norm=False, S0=None):
    """delta_rule from its recurrence, S_t = D_t (I - a_t k_t k_t^T) S_{t-1} + a_t k_t v_t^T,
    o_t = scale S_t^T q_t (a = beta, or EFLA's coefficient when exact); fp64 -> (o, S)."""
    q, k = q.double(), k.double()
    if qk_l2norm:
        q, k = F.normalize(q, dim=-1, eps=1e-6), F.normalize(k, dim=-1, eps=1e-6)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    a = efla_coefficient(beta.double(), (k * k).sum(-1)) if exact else beta.double()
    return delta_scan_ref(q, k, v, a, g=g, scale=scale, S0=S0)
