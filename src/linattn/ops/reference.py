"""fp64 references written from the formulas, independent of the operators' code: what the tests,
the benchmarks' exactness table and the demo compare every form of every operator against.

They are slow on purpose (explicit T x T kernels, token-by-token loops) and import nothing from
linattn but the feature maps' drawn parameters (FAVOR+'s projection, cosFormer's horizon), which define
the kernel being computed. A feature map registered elsewhere (`register_feature_map`) brings its kernel
written from the formula (`FeatureMap.kernel`), which `kernel` uses for a name it does not know.
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
    if hasattr(fmap, "kernel"):   # a map registered elsewhere: the formula its own kernel() writes down
        return fmap.kernel(a, b, i, j)
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
    if hasattr(fmap, "phi") and not fmap.positional and type(fmap).phi is type(fmap).psi:   # a map registered
        return fmap.phi(a), fmap.log_space                                                # elsewhere, phi = psi
    raise KeyError(name)


def linear_attention_ref(q, k, v, name, *, causal=True, normalize=True, log_gate=None, scale=1.0,
                         eps=1e-6, fmap=None, offset=0):
    """fp64 quadratic reference. log_gate: None, [B,T,H] or [B,T,H,Kphi] (diagonal)."""
    q, k, v = q.double() * scale, k.double(), v.double()
    # grouped value heads (v with HV = n H heads): value head j reads q/k head j // n, and a gate given per q/k
    # head applies to all its value heads
    q, k = value_head_inputs(q, v.shape[2]), value_head_inputs(k, v.shape[2])
    if log_gate is not None:
        log_gate = value_head_inputs(log_gate, v.shape[2])
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


def l2_ref(x, convention):
    """The qk L2 normalisation in fp64: "rsqrt" x / sqrt(sum x^2 + 1e-6), "clamp" x / max(||x||, 1e-6)
    (True means "rsqrt", False / None: x unchanged). Exact for any finite fp32 x (fp64 squares)."""
    x = x.double()
    if convention is None or convention is False:
        return x
    if convention is True or convention == "rsqrt":
        return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)
    if convention == "clamp":
        return x / torch.sqrt((x * x).sum(-1, keepdim=True)).clamp_min(1e-6)
    raise ValueError(convention)


def value_head_inputs(x, HV):
    """x [B, T, H, *] as seen by each of HV = n H value heads: value head j reads head j // n."""
    if x is None or x.shape[2] == HV:
        return x
    n = HV // x.shape[2]
    return torch.stack([x[:, :, j // n] for j in range(HV)], dim=2)


def delta_rule_ref(q, k, v, beta, g=None, exact=False, scale=None, qk_l2norm=False, S0=None):
    """delta_rule from its recurrence, S_t = D_t (I - a_t k_t k_t^T) S_{t-1} + a_t k_t v_t^T,
    o_t = scale S_t^T q_t (a = beta, or EFLA's coefficient when exact); qk_l2norm as `l2_ref`; fp64 -> (o, S).
    Grouped value heads (v, beta, g, S0 with HV = n H heads): value head j runs with q/k head j // n."""
    q, k = l2_ref(q, qk_l2norm), l2_ref(k, qk_l2norm)
    q, k = value_head_inputs(q, v.shape[2]), value_head_inputs(k, v.shape[2])
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    a = efla_coefficient(beta.double(), (k * k).sum(-1)) if exact else beta.double()
    return delta_scan_ref(q, k, v, a, g=g, scale=scale, S0=S0)


def comba_ref(q, k, v, beta, p=None, g=None, scale=None, qk_l2norm=False, S0=None):
    """comba from the seed's eq. (18), S_t = exp(g_t) S_{t-1} + beta_t k_t (v_t - S_{t-1}^T p_t)^T,
    o_t = scale S_t^T q_t (p = None: p = k; qk_l2norm normalises q and k, never p); fp64 -> (o, S).
    This is the general scan with the read key r = p on the undecayed state."""
    q, k = l2_ref(q, qk_l2norm), l2_ref(k, qk_l2norm)
    q, k, p = (value_head_inputs(x, v.shape[2]) for x in (q, k, p))
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    r = k if p is None else p.double()
    return delta_scan_ref(q, k, v, beta.double(), r=r, g=g, scale=scale, S0=S0)


def delta_product_ref(q, k, v, beta, g=None, scale=None, qk_l2norm=False, S0=None):
    """delta_product token by token and Householder step by step, in fp64:

        S <- Diag(exp(g_t)) S;  for j = 1..n: S <- (I - b_tj k_tj k_tj^T) S + b_tj k_tj v_tj^T;  o_t = scale S^T q_t

    q [B, T, H, K], k [B, T, H, n, K], v [B, T, H, n, V], beta [B, T, H, n], g [B, T, H] or [B, T, H, K]
    -> (o [B, T, H, V], S [B, H, K, V])."""
    q, k, v, beta = l2_ref(q, qk_l2norm), l2_ref(k, qk_l2norm), v.double(), beta.double()
    q, k = value_head_inputs(q, v.shape[2]), value_head_inputs(k, v.shape[2])   # grouped value heads
    B, T, H, n, K = k.shape
    scale = K ** -0.5 if scale is None else scale
    S = S0.double() if S0 is not None else torch.zeros(B, H, K, v.shape[-1], dtype=torch.float64)
    outs = []
    for t in range(T):
        if g is not None:
            gt = torch.exp(g[:, t].double())                                   # [B, H] or [B, H, K]
            S = (gt[..., None] if gt.dim() == 3 else gt[..., None, None]) * S   # decays the rows (keys)
        for j in range(n):
            kt, vt, bt = k[:, t, :, j], v[:, t, :, j], beta[:, t, :, j]        # [B, H, K], [B, H, V], [B, H]
            kS = (kt[..., :, None] * S).sum(-2)                                 # k^T S [B, H, V]
            S = S + bt[..., None, None] * kt[..., :, None] * (vt - kS)[..., None, :]
        outs.append(scale * (q[:, t, :, :, None] * S).sum(-2))
    return torch.stack(outs, dim=1), S


# ---------------------------------------------------------------- MesaNet, TTT, Titans

def mesa_net_ref(q, k, v, beta, g, lam, scale=None, state=None):
    """MesaNet from the seed's eq. (35), token by token in fp64 with a dense solve per token:

        H_t = exp(g_t) H_{t-1} + beta_t k_t k_t^T,  G_t = exp(g_t) G_{t-1} + beta_t k_t v_t^T,
        o_t = scale G_t^T (H_t + Diag(lam))^-1 q_t

    q, k [B, T, H, K], v [B, T, H, V], beta and g [B, T, H] (g None: no decay), lam [H, K], state (H0, G0)
    or None -> (o [B, T, H, V], (H [B, H, K, K], G [B, H, K, V]))."""
    q, k, v, beta, lam = q.double(), k.double(), v.double(), beta.double(), lam.double()
    B, T, H, K = q.shape
    scale = K ** -0.5 if scale is None else scale
    if state is None:
        Hs = torch.zeros(B, H, K, K, dtype=torch.float64)
        Gs = torch.zeros(B, H, K, v.shape[-1], dtype=torch.float64)
    else:
        Hs, Gs = state[0].double(), state[1].double()
    ridge = torch.diag_embed(lam)                                           # [H, K, K]
    outs = []
    for t in range(T):
        decay = torch.exp(g[:, t].double())[..., None, None] if g is not None else 1.0
        kt, bt = k[:, t], beta[:, t][..., None, None]
        Hs = decay * Hs + bt * kt[..., :, None] * kt[..., None, :]
        Gs = decay * Gs + bt * kt[..., :, None] * v[:, t][..., None, :]
        x = torch.linalg.solve(Hs + ridge, scale * q[:, t][..., None])[..., 0]   # [B, H, K]
        outs.append((x[..., :, None] * Gs).sum(-2))
    return torch.stack(outs, dim=1), (Hs, Gs)


def _ttt_model(W, x, inner):
    """The inner model m(x; W) on one token per row: x [B, H, K], W as in ttt_ref."""
    if inner == "linear":
        return (x[..., :, None] * W[0]).sum(-2) + W[1]
    h = (x[..., :, None] * W[0]).sum(-2) + W[1]
    h = 0.5 * h * (1 + torch.erf(h / math.sqrt(2.0)))                       # exact GELU
    return (h[..., :, None] * W[2]).sum(-2) + W[3]


def _ttt_f(W, x, inner, ln_w, ln_b, eps, residual):
    """f(x; W) = [x +] LN(m(x; W)), LN over the last dimension with weight ln_w and bias ln_b [H, V]."""
    z = _ttt_model(W, x, inner)
    mu = z.mean(-1, keepdim=True)
    var = ((z - mu) ** 2).mean(-1, keepdim=True)
    y = (z - mu) / torch.sqrt(var + eps) * ln_w + ln_b
    return x + y if residual else y


def ttt_ref(q, k, v, lr, weights, *, inner="linear", mini_batch=16, ln_weight=None, ln_bias=None, residual=True,
            scale=None, eps=1e-6, alpha=None, momentum=None):
    """TTT (and Titans) token by token in fp64, the inner gradients by autograd from the loss:

        u_t = grad_W 1/2 ||f(k_t; W_0) - v_t||^2      (W_0: the weights at the start of t's mini-batch)
        TTT:     W_t = W_{t-1} - lr_t u_t
        Titans:  S_t = momentum_t S_{t-1} - lr_t u_t,   W_t = (1 - alpha_t) W_{t-1} + S_t
        o_t = f(W_t; scale q_t),   f(x; W) = [x +] LN(m(x; W)),   W_0 <- W_t after every mini_batch tokens

    m(x; W) = x W + b (inner="linear", weights (W [B, H, K, V], b [B, H, V])) or gelu(x W1 + b1) W2 + b2
    (inner="mlp", weights (W1, b1, W2, b2)). q, k [B, T, H, K], v [B, T, H, V], lr, alpha, momentum
    [B, T, H] -> (o [B, T, H, V], final weights, final momentum or None)."""
    q, k, v, lr = q.double(), k.double(), v.double(), lr.double()
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K ** -0.5 if scale is None else scale
    ln_w = ln_weight.double() if ln_weight is not None else torch.ones(H, V, dtype=torch.float64)
    ln_b = ln_bias.double() if ln_bias is not None else torch.zeros(H, V, dtype=torch.float64)
    W = [w.double() for w in weights]
    S = [torch.zeros_like(w) for w in W] if alpha is not None else None
    start = W
    outs = []
    with torch.enable_grad():
        for t in range(T):
            leaves = [w if w.requires_grad else w.detach().requires_grad_() for w in start]
            loss = 0.5 * ((_ttt_f(leaves, k[:, t], inner, ln_w, ln_b, eps, residual) - v[:, t]) ** 2).sum()
            u = torch.autograd.grad(loss, leaves, create_graph=True)
            c = lr[:, t]
            if S is None:
                W = [w - c.reshape(B, H, *[1] * (w.dim() - 2)) * du for w, du in zip(W, u)]
            else:
                def bc(x, w):
                    return x.double().reshape(B, H, *[1] * (w.dim() - 2))
                S = [bc(momentum[:, t], s) * s - bc(c, s) * du for s, du in zip(S, u)]
                W = [bc(1 - alpha[:, t], w) * w + s for w, s in zip(W, S)]
            outs.append(_ttt_f(W, scale * q[:, t], inner, ln_w, ln_b, eps, residual))
            if (t + 1) % mini_batch == 0:
                start = W
    return torch.stack(outs, dim=1), tuple(W), (tuple(S) if S is not None else None)


# ---------------------------------------------------------------- the softmax side: FoX, DeltaFormer, PaTH

def _softmax_rows(s, mask):
    """Row softmax of s over the entries where mask is True; a row with none is all zeros."""
    out = torch.zeros_like(s)
    for i in range(s.shape[0]):
        idx = mask[i].nonzero().flatten()
        if idx.numel():
            out[i, idx] = torch.softmax(s[i, idx], dim=0)
    return out


def forgetting_attention_ref(q, k, v, g=None, *, window=None, scale=None):
    """FoX from its definition, fp64: s_ij = scale q_i . k_j + G_i - G_j for j <= i (i - j < window),
    G = cumsum(g); o_i = softmax_j(s_ij) v_j. q, k [B, T, H, K], v [B, T, H, V], g [B, T, H] or None."""
    q, k, v = q.double(), k.double(), v.double()
    B, T, H, K = q.shape
    scale = K ** -0.5 if scale is None else scale
    i = torch.arange(T)
    mask = i[:, None] >= i[None, :]
    if window is not None:
        mask = mask & (i[:, None] - i[None, :] < window)
    out = torch.zeros(B, T, H, v.shape[-1], dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            s = scale * q[b, :, h] @ k[b, :, h].T
            if g is not None:
                G = torch.cumsum(g[b, :, h].double(), 0)
                s = s + G[:, None] - G[None, :]
            out[b, :, h] = _softmax_rows(s, mask) @ v[b, :, h]
    return out


def deltaformer_ref(q, k, v, beta, *, stage1_query="k", scale=None):
    """DeltaFormer from its definition, fp64: B_tj = softmax_{j<t}(scale r_t . k_j) (r = k or q; a row
    with no j is zero), U = (I + diag(beta) B)^{-1} V by an explicit inverse, o = causal softmax(scale
    Q K^T) U. Returns (o [B, T, H, V], u [B, T, H, V])."""
    q, k, v, beta = q.double(), k.double(), v.double(), beta.double()
    B, T, H, K = q.shape
    scale = K ** -0.5 if scale is None else scale
    i = torch.arange(T)
    strict, causal = i[:, None] > i[None, :], i[:, None] >= i[None, :]
    o = torch.zeros(B, T, H, v.shape[-1], dtype=torch.float64)
    u = torch.zeros_like(o)
    for b in range(B):
        for h in range(H):
            r = k[b, :, h] if stage1_query == "k" else q[b, :, h]
            Bm = _softmax_rows(scale * r @ k[b, :, h].T, strict)
            M = torch.eye(T, dtype=torch.float64) + torch.diag(beta[b, :, h]) @ Bm
            u_bh = torch.linalg.inv(M) @ v[b, :, h]
            u[b, :, h] = u_bh
            o[b, :, h] = _softmax_rows(scale * q[b, :, h] @ k[b, :, h].T, causal) @ u_bh
    return o, u


def path_attention_ref(q, k, v, w, beta, *, g=None, scale=None):
    """PaTH from its definition, fp64: A_ij = q_i^T (H_i H_{i-1} ... H_{j+1}) k_j with explicit D x D
    Householder-like factors H_s = I - beta_s w_s w_s^T, multiplied out for every pair j <= i;
    s_ij = scale A_ij (+ G_i - G_j); o_i = softmax_j(s_ij) v_j."""
    q, k, v, w, beta = q.double(), k.double(), v.double(), w.double(), beta.double()
    B, T, H, K = q.shape
    scale = K ** -0.5 if scale is None else scale
    eye = torch.eye(K, dtype=torch.float64)
    i = torch.arange(T)
    causal = i[:, None] >= i[None, :]
    out = torch.zeros(B, T, H, v.shape[-1], dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            Hs = [eye - beta[b, s, h] * torch.outer(w[b, s, h], w[b, s, h]) for s in range(T)]
            A = torch.zeros(T, T, dtype=torch.float64)
            for ii in range(T):
                R = eye.clone()                          # R_{ii, jj}, built from jj = ii downwards
                for jj in range(ii, -1, -1):
                    A[ii, jj] = q[b, ii, h] @ R @ k[b, jj, h]
                    R = R @ Hs[jj]
            s = scale * A
            if g is not None:
                G = torch.cumsum(g[b, :, h].double(), 0)
                s = s + G[:, None] - G[None, :]
            out[b, :, h] = _softmax_rows(s, causal) @ v[b, :, h]
    return out


def rwkv7_ref(r, w, k, v, a, b, scale=1.0, S0=None):
    """RWKV-7 token by token in fp64, the state [K, V] per head (fla's layout):

        S_t = Diag(exp(w_t)) S_{t-1} + b_t (a_t^T S_{t-1}) + k_t v_t^T,   o_t = scale S_t^T r_t

    r, w, k, a, b [B, T, H, K], v [B, T, H, V], S0 [B, H, K, V] or None -> (o [B, T, H, V], S [B, H, K, V])."""
    r, w, k, v, a, b = (x.double() for x in (r, w, k, v, a, b))
    B, T, H, K = r.shape
    S = S0.double() if S0 is not None else torch.zeros(B, H, K, v.shape[-1], dtype=torch.float64)
    outs = []
    for t in range(T):
        aS = (a[:, t, :, :, None] * S).sum(-2)                               # a_t^T S_{t-1}  [B, H, V]
        S = (torch.exp(w[:, t])[..., None] * S + b[:, t, :, :, None] * aS[:, :, None, :]
             + k[:, t, :, :, None] * v[:, t, :, None, :])
        outs.append(scale * (r[:, t, :, :, None] * S).sum(-2))
    return torch.stack(outs, dim=1), S
