"""CPU stand-ins for the fla-core functions that linattn's fla backend calls (a helper, not a test file).

fla's kernels are Triton kernels that do not run on the CPU. Each stand-in here has the signature of the fla
function it replaces (fla-core 0.6.0: the same argument names and defaults, no others, so a misspelt or
unknown argument fails) and honours every argument the backend may pass: fla's default scale K**-0.5, the
in-kernel L2 norm, the gates (g, g_gamma, gk, per-channel g) in log space, beta, grouped value heads (head j
reads q/k head j // (HV / H)), the initial and final state [N, HV, K, V], and cu_seqlens (B = 1, one state row per
sequence). They also keep fla's own restrictions that the routing must respect (chunk_delta_rule: no fp32, no
grouped value heads; cu_seqlens with B = 1; KDA: an fp32 initial state).

All of them run one plain recurrence in fp64 (`scan`), differentiable by autograd; the output is in q's dtype as
fla's, the final state fp32 (fp64 for fp64 inputs, which the tests allow in place of fla's fp32). `stand_ins()`
is the mapping from fla's module attributes to these; `fla_backend_on_cpu` (a context manager) installs them and
lets the backend take CPU tensors (and fp64, for the exactness tests).
"""
from __future__ import annotations

import contextlib
from typing import Dict, Iterator, Optional

import torch

L2_EPS = 1e-6
CALLS: list = []   # (function name, its keyword names) of every stand-in call, for the tests that check routing


def _l2(x):
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2_EPS)


def _state_dtype(q):
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def scan(q, k, v, *, beta=None, g=None, gk=None, g_gamma=None, scale=None, initial_state=None,
         output_final_state=False, cu_seqlens=None, l2norm=False):
    """The recurrence S_t = D_t S_{t-1} (+ the delta rule's correction when beta is given) + k_t v_t^T and
    o_t = scale * S_t^T q_t, in fp64: D_t = exp(g_t) per head, exp(gk_t) per key channel or exp(g_gamma) per
    head; with beta, S_t = D_t S_{t-1} + beta_t k_t (v_t - (D_t S_{t-1})^T k_t)^T."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    assert HV % H == 0, "grouped value heads: HV must be a multiple of H"
    assert q.dtype == k.dtype == v.dtype, "fla takes q, k, v in one dtype"
    if cu_seqlens is not None:
        assert B == 1, "fla wants B = 1 with cu_seqlens"
        assert cu_seqlens.dtype in (torch.int32, torch.int64)
    bounds = [0, T] if cu_seqlens is None else cu_seqlens.tolist()
    N = B if cu_seqlens is None else len(bounds) - 1
    if initial_state is not None:
        assert tuple(initial_state.shape) == (N, HV, K, V), (tuple(initial_state.shape), (N, HV, K, V))
    scale = K ** -0.5 if scale is None else scale
    n = HV // H
    d = torch.float64
    q64, k64 = q.to(d), k.to(d)
    if l2norm:
        q64, k64 = _l2(q64), _l2(k64)
    q64, k64 = q64.repeat_interleave(n, dim=2), k64.repeat_interleave(n, dim=2)
    v64 = v.to(d)
    outs, finals = [], []
    for i in range(1 if cu_seqlens is None else N):   # without cu_seqlens: the B rows together
        a, b = bounds[i], bounds[i + 1]
        rows = slice(None) if cu_seqlens is None else slice(i, i + 1)
        S = (initial_state[rows].to(d) if initial_state is not None
             else torch.zeros(B if cu_seqlens is None else 1, HV, K, V, dtype=d))
        for t in range(a, b):
            bt = slice(None) if cu_seqlens is None else slice(0, 1)
            if g is not None:
                S = S * g[bt, t].to(d).exp()[..., None, None]
            if gk is not None:
                S = S * gk[bt, t].to(d).exp()[..., None]
            if g_gamma is not None:
                S = S * g_gamma.to(d).exp()[:, None, None]
            kt, vt = k64[bt, t], v64[bt, t]
            if beta is not None:
                vt = beta[bt, t].to(d)[..., None] * (vt - torch.einsum("bhkv,bhk->bhv", S, kt))
            S = S + kt[..., None] * vt[..., None, :]
            outs.append((scale * torch.einsum("bhkv,bhk->bhv", S, q64[bt, t])).unsqueeze(1))
        finals.append(S)
    o = torch.cat(outs, dim=1) if outs else v64.new_zeros(B, 0, HV, V)
    final = torch.cat(finals, dim=0).to(_state_dtype(q)) if output_final_state else None
    return o.to(q.dtype), final


def _record(name, **kw):
    CALLS.append((name, sorted(k for k, val in kw.items() if val is not None and val is not False)))


# -- fla.ops.simple_gla / fla.ops.gla ------------------------------------------------------------------------
def chunk_simple_gla(q, k, v, g=None, g_gamma=None, scale=None, initial_state=None, output_final_state=False,
                     state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None, chunk_size=None):
    assert not state_v_first and (g is None or g_gamma is None)
    _record("chunk_simple_gla", g=g, g_gamma=g_gamma, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens)
    return scan(q, k, v, g=g, g_gamma=g_gamma, scale=scale, initial_state=initial_state,
                output_final_state=output_final_state, cu_seqlens=cu_seqlens)


def fused_recurrent_simple_gla(q, k, v, g=None, g_gamma=None, scale=None, initial_state=None,
                               output_final_state=False, reverse=False, state_v_first=False, cu_seqlens=None):
    assert not reverse and not state_v_first
    _record("fused_recurrent_simple_gla", g=g, g_gamma=g_gamma, scale=scale, initial_state=initial_state,
            cu_seqlens=cu_seqlens)
    return scan(q, k, v, g=g, g_gamma=g_gamma, scale=scale, initial_state=initial_state,
                output_final_state=output_final_state, cu_seqlens=cu_seqlens)


def chunk_gla(q, k, v, g, scale=None, initial_state=None, output_final_state=False, state_v_first=False,
              cu_seqlens=None, cu_seqlens_cpu=None):
    assert not state_v_first
    _record("chunk_gla", g=g, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens)
    return scan(q, k, v, gk=g, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                cu_seqlens=cu_seqlens)


def fused_recurrent_gla(q, k, v, gk=None, gv=None, scale=None, initial_state=None, output_final_state=False,
                        reverse=False, state_v_first=False, cu_seqlens=None):
    assert gv is None and not reverse and not state_v_first
    _record("fused_recurrent_gla", gk=gk, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens)
    return scan(q, k, v, gk=gk, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                cu_seqlens=cu_seqlens)


# -- fla.ops.delta_rule / gated_delta_rule / kda -------------------------------------------------------------
def chunk_delta_rule(q, k, v, beta, scale=None, initial_state=None, output_final_state=False,
                     use_qk_l2norm_in_kernel=False, cu_seqlens=None, cu_seqlens_cpu=None):
    assert q.dtype != torch.float32, "ChunkDeltaRuleFunction does not support float32"   # fla's own assert
    assert v.shape[2] == q.shape[2], "chunk_delta_rule has no grouped value heads"
    assert beta.dim() == 3
    _record("chunk_delta_rule", beta=beta, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    return scan(q, k, v, beta=beta, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                cu_seqlens=cu_seqlens, l2norm=use_qk_l2norm_in_kernel)


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
                           state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None, chunk_indices=None,
                           cp_context=None):
    assert g is not None and g.dim() == 3 and not use_beta_sigmoid_in_kernel and not state_v_first
    _record("chunk_gated_delta_rule", g=g, beta=beta, scale=scale, initial_state=initial_state,
            cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    return scan(q, k, v, beta=beta, g=g, scale=scale, initial_state=initial_state,
                output_final_state=output_final_state, cu_seqlens=cu_seqlens, l2norm=use_qk_l2norm_in_kernel)


def fused_recurrent_gated_delta_rule(q, k, v, g=None, gk=None, gv=None, beta=None, scale=None, initial_state=None,
                                     output_final_state=False, use_qk_l2norm_in_kernel=False,
                                     use_gate_in_kernel=False, A_log=None, dt_bias=None,
                                     use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, state_v_first=False,
                                     cu_seqlens=None):
    assert gv is None and not use_gate_in_kernel and not state_v_first and beta is not None
    _record("fused_recurrent_gated_delta_rule", g=g, gk=gk, beta=beta, scale=scale, initial_state=initial_state,
            cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    return scan(q, k, v, beta=beta, g=g, gk=gk, scale=scale, initial_state=initial_state,
                output_final_state=output_final_state, cu_seqlens=cu_seqlens, l2norm=use_qk_l2norm_in_kernel)


def _check_kda(q, g, initial_state):
    assert g is not None and g.dim() == 4
    if initial_state is not None and q.dtype != torch.float64:
        assert initial_state.dtype == torch.float32, "initial_state must be in float32"   # fla's own assert
    assert q.shape[-1] <= 256


def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
              allow_neg_eigval=False, safe_gate=False, lower_bound=None, disable_recompute=False,
              return_intermediate_states=False, state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None,
              cp_context=None, use_graph=False, max_num_seqs=None):
    _check_kda(q, g, initial_state)
    assert not (use_gate_in_kernel or safe_gate or state_v_first or use_beta_sigmoid_in_kernel)
    _record("chunk_kda", g=g, beta=beta, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    return scan(q, k, v, beta=beta, gk=g, scale=scale, initial_state=initial_state,
                output_final_state=output_final_state, cu_seqlens=cu_seqlens, l2norm=use_qk_l2norm_in_kernel)


def fused_recurrent_kda(q, k, v, g, beta, A_log=None, dt_bias=None, scale=None, initial_state=None,
                        output_final_state=False, use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
                        use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, lower_bound=None,
                        state_v_first=False, cu_seqlens=None):
    _check_kda(q, g, initial_state)
    assert not (use_gate_in_kernel or state_v_first or use_beta_sigmoid_in_kernel)
    _record("fused_recurrent_kda", g=g, beta=beta, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    return scan(q, k, v, beta=beta, gk=g, scale=scale, initial_state=initial_state,
                output_final_state=output_final_state, cu_seqlens=cu_seqlens, l2norm=use_qk_l2norm_in_kernel)


def stand_ins() -> Dict[str, object]:
    """fla module -> {function name: stand-in}, every function linattn's fla backend calls."""
    return {
        "fla.ops.simple_gla": {"chunk_simple_gla": chunk_simple_gla,
                               "fused_recurrent_simple_gla": fused_recurrent_simple_gla},
        "fla.ops.gla": {"chunk_gla": chunk_gla, "fused_recurrent_gla": fused_recurrent_gla},
        "fla.ops.delta_rule": {"chunk_delta_rule": chunk_delta_rule},
        "fla.ops.gated_delta_rule": {"chunk_gated_delta_rule": chunk_gated_delta_rule,
                                     "fused_recurrent_gated_delta_rule": fused_recurrent_gated_delta_rule},
        "fla.ops.kda": {"chunk_kda": chunk_kda, "fused_recurrent_kda": fused_recurrent_kda},
        "fla.ops.rwkv7": {"chunk_rwkv7": chunk_rwkv7, "fused_recurrent_rwkv7": fused_recurrent_rwkv7},
        "fla.ops.forgetting_attn": {"parallel_forgetting_attn": parallel_forgetting_attn},
        "fla.ops.path_attn": {"parallel_path_attn": parallel_path_attn},
    }


@contextlib.contextmanager
def fla_backend_on_cpu(monkeypatch, fp64: bool = False, replace: Optional[Dict[str, object]] = None) -> Iterator[list]:
    """Inside: linattn's fla backend takes CPU tensors (and fp64 when `fp64`), and every fla function it calls is
    its stand-in above (`replace`: {"module.function": callable} overrides). Yields the list of calls made."""
    import importlib

    import linattn.fla as lfla

    monkeypatch.setattr(lfla, "runs_on", lambda device: True)
    if fp64:
        monkeypatch.setattr(lfla, "DTYPES", (*lfla.DTYPES, torch.float64))
    for module, fns in stand_ins().items():
        mod = importlib.import_module(module)
        for name, fn in fns.items():
            monkeypatch.setattr(mod, name, fn)
    for path, fn in (replace or {}).items():
        module, name = path.rsplit(".", 1)
        monkeypatch.setattr(importlib.import_module(module), name, fn)
    CALLS.clear()
    yield CALLS


# -- fla.ops.rwkv7 -------------------------------------------------------------------------------------------
def scan_rwkv7(r, w, k, v, a, b, *, scale, initial_state, output_final_state, cu_seqlens):
    """S_t = Diag(exp(w_t)) S_{t-1} + b_t (a_t^T S_{t-1}) + k_t v_t^T, o_t = scale S_t^T r_t, in fp64."""
    B, T, H, K = r.shape
    V = v.shape[-1]
    assert r.dtype == k.dtype == v.dtype == a.dtype == b.dtype
    bounds = [0, T] if cu_seqlens is None else cu_seqlens.tolist()
    N = B if cu_seqlens is None else len(bounds) - 1
    if cu_seqlens is not None:
        assert B == 1
    if initial_state is not None:
        assert tuple(initial_state.shape) == (N, H, K, V)
    d = torch.float64
    r, w, k, v, a, b = (x.to(d) for x in (r, w, k, v, a, b))
    outs, finals = [], []
    for i in range(1 if cu_seqlens is None else N):
        rows = slice(None) if cu_seqlens is None else slice(i, i + 1)
        S = (initial_state[rows].to(d) if initial_state is not None
             else torch.zeros(B if cu_seqlens is None else 1, H, K, V, dtype=d))
        for t in range(bounds[i], bounds[i + 1]):
            bt = slice(None) if cu_seqlens is None else slice(0, 1)
            read = torch.einsum("bhkv,bhk->bhv", S, a[bt, t])
            S = S * w[bt, t].exp()[..., None] + b[bt, t][..., None] * read[..., None, :] \
                + k[bt, t][..., None] * v[bt, t][..., None, :]
            outs.append((scale * torch.einsum("bhkv,bhk->bhv", S, r[bt, t])).unsqueeze(1))
        finals.append(S)
    o = torch.cat(outs, dim=1)
    final = torch.cat(finals).to(_state_dtype(r)) if output_final_state else None
    return o.to(v.dtype), final


def chunk_rwkv7(r, w, k, v, a, b, scale=1.0, initial_state=None, output_final_state=False, cu_seqlens=None,
                cu_seqlens_cpu=None, safe_gate=False, chunk_size=None, disable_recompute=False, cp_context=None,
                lower_bound=None):
    assert not safe_gate and lower_bound is None and cp_context is None
    _record("chunk_rwkv7", scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens)
    return scan_rwkv7(r, w, k, v, a, b, scale=scale, initial_state=initial_state,
                      output_final_state=output_final_state, cu_seqlens=cu_seqlens)


def fused_recurrent_rwkv7(r, w, k, v, a, b, scale=None, initial_state=None, output_final_state=True,
                          cu_seqlens=None):
    _record("fused_recurrent_rwkv7", scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens)
    return scan_rwkv7(r, w, k, v, a, b, scale=r.shape[-1] ** -0.5 if scale is None else scale,
                      initial_state=initial_state, output_final_state=output_final_state, cu_seqlens=cu_seqlens)


# -- fla.ops.forgetting_attn ---------------------------------------------------------------------------------
def parallel_forgetting_attn(q, k, v, g, scale=None, window_size=None, cu_seqlens=None):
    """softmax_j(scale q_i . k_j + G_i - G_j) over j <= i, i - j < window_size, G the per-sequence cumsum of g."""
    B, T, H, K = q.shape
    assert q.dtype == k.dtype == v.dtype and k.shape[2] == H
    scale = K ** -0.5 if scale is None else scale
    _record("parallel_forgetting_attn", g=g, scale=scale, window_size=window_size, cu_seqlens=cu_seqlens)
    bounds = [0, T] if cu_seqlens is None else cu_seqlens.tolist()
    if cu_seqlens is not None:
        assert B == 1
    d = torch.float64
    outs = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        qs, ks, vs = (x[:, a:b].to(d) for x in (q, k, v))
        s = scale * torch.einsum("bihk,bjhk->bhij", qs, ks)
        if g is not None:
            G = g[:, a:b].to(d).cumsum(1).transpose(1, 2)                # [B, H, L]
            s = s + G[..., :, None] - G[..., None, :]
        i = torch.arange(b - a)
        keep = i[:, None] >= i[None, :]
        if window_size is not None:
            keep = keep & (i[:, None] - i[None, :] < window_size)
        s = s.masked_fill(~keep, float("-inf"))
        outs.append(torch.einsum("bhij,bjhv->bihv", s.softmax(-1), vs))
    return torch.cat(outs, dim=1).to(q.dtype)


# -- fla.ops.path_attn ---------------------------------------------------------------------------------------
def parallel_path_attn(q, k, v, w, beta, g=None, scale=None, cu_seqlens=None, use_cache=False):
    """softmax_j((q_i^T R_ij k_j + G_i - G_j) scale) v_j over j <= i, R_ij = H_i ... H_{j+1}, H_t = I - beta_t w_t
    w_t^T: fla's kernel scales the gate with the scores. Keeps fla's asserts (fp32 w, beta, g; head sizes)."""
    B, T, H, K = q.shape
    if q.dtype != torch.float64:
        assert w.dtype == beta.dtype == torch.float32 and (g is None or g.dtype == torch.float32)
        assert K in (16, 32, 64, 128) and v.shape[-1] in (16, 32, 64, 128)
    assert not use_cache
    scale = K ** -0.5 if scale is None else scale
    _record("parallel_path_attn", g=g, scale=scale, cu_seqlens=cu_seqlens)
    bounds = [0, T] if cu_seqlens is None else cu_seqlens.tolist()
    d = torch.float64
    outs = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        qs, ks, vs, ws = (x[:, a:b].to(d) for x in (q, k, v, w))
        bs = beta[:, a:b].to(d)
        L = b - a
        cols = []
        for j in range(L):                      # u_t = H_t ... H_{j+1} k_j, A_tj = q_t . u_t for t >= j
            u, col = ks[:, j], []
            for t in range(L):
                if t > j:
                    u = u - bs[:, t, :, None] * ws[:, t] * (ws[:, t] * u).sum(-1, keepdim=True)
                col.append((qs[:, t] * u).sum(-1) if t >= j else torch.full_like(u[..., 0], float("-inf")))
            cols.append(torch.stack(col, dim=1))            # [B, L (t), H]
        A = torch.stack(cols, dim=2).permute(0, 3, 1, 2)   # [B, H, t, j]
        if g is not None:
            G = g[:, a:b].to(d).cumsum(1).transpose(1, 2)
            A = A + G[..., :, None] - G[..., None, :]
        outs.append(torch.einsum("bhij,bjhv->bihv", (A * scale).softmax(-1), vs))
    return torch.cat(outs, dim=1).to(q.dtype), None
