"""The single-token decoding fast path of the attention layers, behind one hook point: `step`.

`AttentionBase.forward` calls `step(layer, x, cache, cu_seqlens)` first. It returns the layer's output for one
decoded token, or None, and then the general path runs and finds the cache untouched. It applies to a call
that decodes one token on the CPU without autograd (grad disabled, a `LayerCache`, T == 1, fp32/fp64, no
cu_seqlens) of a layer whose submodules are exactly the library's (nn.Linear, ShortConv, GatedRMSNorm: no
adapter replaced them) and carry no forward hooks, since the step computes their forward itself.

A layer opts in through `fast_step_kind()`, which names one of `STEPS`:

* "delta": one step of `delta_rule`'s recurrent form (prepare_delta, then one update of the state) for
  DeltaNet, Gated DeltaNet and EFLA;
* "linear": one step of `linear_attention`'s recurrent form for non-positional feature maps, with the state
  [kv | z] kept whole between steps (kv and z in the cache are views of it); the log-space maps (Hadamard Exp,
  FAVOR+; not with the diagonal gate) keep its log-scale too, through `fast_decode_log.py`.

Each step runs the q/k/v (and beta / decay / output-gate) projections as one matrix-vector product over a
cached concatenation of their weights (`FusedParams`, rebuilt when a weight changes), and then either one
compiled call (`cpu/decode.py`: short convolution, normalisations, gates, state update, read-out, output norm)
or, where that does not cover the layer (RoPE, the diagonal gate, other maps, `LINATTN_CPU_KERNELS=0`,
`layer.compiled_decode = False`), the same step in PyTorch. Both give the general path's values and cache
entries (tests/layers/test_fast_decode.py, tests/cpu/test_decode.py). What the step keeps between tokens besides the
cache's entries (the conv windows and the linear state as whole tensors) lives in the cache's typed field
`LayerCache.fast` (`FastDecodeState`), valid only while the entries are the views it made.

Switches on a layer: `fast_decode = False` (always the general path), `compiled_decode = False` (the PyTorch
step; `linattn bench decode --decode-step both` compares them).

The whole block and the whole model in one compiled call are a model's business: `models/decode_plan.py` builds
those plans from a description of the blocks and uses the public pieces below (the fused weights, the cache
entries' views) to read and write the same entries as these steps.
"""
from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..cpu import decode as _cpu_decode
from ..ops import LinearAttentionState
from ..ops.delta_core import efla_coefficient, key_norms
from ..ops.feature_maps import EluPlusOne, Identity, ReLU
from ..ops.l2norm import L2NORM_CONVENTIONS, L2NORM_EPS, l2norm
from .cache import FastDecodeState, LayerCache
from .common import GatedRMSNorm, ShortConv, mamba_neg_a
from .fast_decode_log import log_state_step

__all__ = ["COMPILED_MAPS", "GLOBAL_HOOKS", "NONNEGATIVE_MAPS", "STEPS", "conv_window", "fused_weights", "hooked",
           "linear_decay", "linear_state", "output_norm_args", "step", "store_conv_window", "store_linear_state",
           "usable_projections"]

_ELEMENTWISE_MAPS = (Identity, EluPlusOne, ReLU)
NONNEGATIVE_MAPS = (EluPlusOne, ReLU)
COMPILED_MAPS = (Identity, EluPlusOne, ReLU)   # exactly these classes: the fused compiled step computes them

# forward hooks registered for every module (nn.modules.module.register_module_forward_hook / _pre_hook). torch
# has no public way to ask whether one is registered, so this one place reads its registries: the fast step
# does not call the submodules, so it steps aside while any hook is registered
GLOBAL_HOOKS = (getattr(nn.modules.module, "_global_forward_hooks", {}),
                 getattr(nn.modules.module, "_global_forward_pre_hooks", {}))


def hooked(*modules: Optional[nn.Module]) -> bool:
    """Whether a forward hook is registered globally or on one of `modules`: the fast decoding steps
    compute these modules' forward themselves, so they step aside for any hook."""
    return bool(GLOBAL_HOOKS[0] or GLOBAL_HOOKS[1]) or any(
        m is not None and bool(m._forward_hooks or m._forward_pre_hooks) for m in modules)


# -- the hook point ----------------------------------------------------------------------------------------------
def step(layer, x: torch.Tensor, cache: Optional[LayerCache], cu_seqlens) -> Optional[torch.Tensor]:
    """One decoded token x `[B, 1, d_model]` -> `[B, 1, d_model]` (the cache's state, conv windows and offset
    advanced), or None when the fast path does not apply (module docstring) and the general path must run."""
    if not (layer.fast_decode and cache is not None and cu_seqlens is None and x.shape[1] == 1
            and x.device.type == "cpu" and not torch.is_grad_enabled()
            and x.dtype in (torch.float32, torch.float64)):
        return None
    kind = layer.fast_step_kind()
    if kind is None:
        return None
    lins = usable_projections(layer, x.dtype, kind)
    if lins is None:
        return None
    out = STEPS[kind](layer, x, cache, lins)
    if out is not None:
        cache.offset = cache.offset + 1
    return out


def _extra(layer, kind: str) -> Tuple[nn.Module, ...]:
    """The projections of x, besides q, k, v, that a step takes from the fused product (the output gate last)."""
    mods = layer._modules
    if kind == "delta":
        extra = (mods["b_proj"],) + ((mods["a_proj"],) if mods.get("a_proj") is not None else ())
    else:
        extra = ((mods["a_proj"],) if layer.gate == "scalar" else (mods["gk_proj"][0],) if layer.gate == "diagonal"
                 else ())
    return extra + ((mods["g_proj"],) if mods.get("g_proj") is not None else ())


def usable_projections(layer, dtype: torch.dtype, kind: str, accept=None):
    """The fused projections (q, k, v, then `_extra`) when the layer's modules are exactly the library's, in
    `dtype` (or, with `accept`, linear layers for which accept(module) is true) and without hooks; else None."""
    if layer.gate_act != "silu" or layer.norm_group_size is not None:
        return None   # the fast step computes the default gated norm only
    mods = layer._modules
    lins = (mods["q_proj"], mods["k_proj"], mods["v_proj"]) + _extra(layer, kind)
    for m in lins + (mods["o_proj"],):
        if not (accept(m) if accept is not None else type(m) is nn.Linear and m.weight.dtype == dtype):
            return None
    norm = mods.get("o_norm")
    if (norm is not None and (type(norm) is not GatedRMSNorm or not norm.plain)) or hooked(*lins, mods["o_proj"], norm):
        return None
    if layer.short_conv:
        c0, c1, c2 = mods["q_conv"], mods["k_conv"], mods["v_conv"]
        for c in (c0, c1, c2):
            if (type(c) is not ShortConv or hooked(c)
                    or c.kernel_size != c0.kernel_size or c.activation != c0.activation
                    or (c._parameters.get("bias") is None) != (c0._parameters.get("bias") is None)):
                return None
        if c0._parameters["weight"].dtype != dtype:
            return None
    return lins


# -- pieces shared by the steps ----------------------------------------------------------------------------------
def _fast_state(cache: LayerCache) -> FastDecodeState:
    fs = cache.fast
    if fs is None:
        fs = cache.fast = FastDecodeState()
    return fs


def fused_weights(layer, lins):
    """(convs, w, b, cw, cb): the short convolutions (or ()), the projections' fused weight `[sum of widths,
    d_model]` and bias (or None), and the convolutions' fused weights `[C, 1, K]` and biases (or None)."""
    mods = layer._modules
    convs = (mods["q_conv"], mods["k_conv"], mods["v_conv"]) if layer.short_conv else ()
    w, b, cw, cb = layer._fused.get([m.weight for m in lins],
                                    [m.bias if m.bias is not None else m.out_features for m in lins]
                                    if any(m.bias is not None for m in lins) else [],
                                    [c.weight for c in convs], [c.bias for c in convs if c.bias is not None])
    return convs, w, b, cw, cb


def _fused(layer, x: torch.Tensor, lins):
    """(convs, y, cw, cb): `_fused_weights` with the fused projection y `[B, sum of widths]` of one token x
    `[B, 1, d_model]` in place of the weights."""
    convs, w, b, cw, cb = fused_weights(layer, lins)
    return convs, F.linear(x.reshape(x.shape[0], -1), w, b), cw, cb


def conv_window(cache: LayerCache, dtype: torch.dtype) -> Optional[torch.Tensor]:
    """The q | k | v conv windows as one contiguous `[B, C, K - 1]` (None before the first token)."""
    old = (cache.conv.get("q"), cache.conv.get("k"), cache.conv.get("v"))
    fs = cache.fast
    if fs is not None and fs.conv_views is not None and all(a is b for a, b in zip(fs.conv_views, old)):
        return fs.window
    if old[0] is None:
        return None
    return torch.cat([s.to(dtype) for s in old], dim=1)


def store_conv_window(cache: LayerCache, convs, new: torch.Tensor) -> None:
    """conv["q"/"k"/"v"] of cache as views of the new window `[B, C, K - 1]` (kept whole for the next step)."""
    sq, sk, sv = new.split_with_sizes([convs[0].dim, convs[1].dim, convs[2].dim], dim=1)
    cache.conv.update(q=sq, k=sk, v=sv)
    fs = _fast_state(cache)
    fs.conv_views, fs.window = (sq, sk, sv), new


def _conv(u: torch.Tensor, cache: LayerCache, convs, w: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """The q, k and v short convolutions of one token as one: u `[B, C]` (q | k | v before the convolution),
    w their weights `[C, 1, K]` -> `[B, C]`; the windows conv["q"/"k"/"v"] of cache are views of one window."""
    K, C = convs[0].kernel_size, u.shape[1]
    state = conv_window(cache, u.dtype)
    if state is None:
        state = u.new_zeros(u.shape[0], C, K - 1)
    xp = torch.cat([state, u.unsqueeze(-1)], dim=-1)                      # [B, C, K]
    y = (xp * w.view(C, K)).sum(-1)
    if bias is not None:
        y = y + bias
    if convs[0].activation is not None:
        y = F.silu(y)
    store_conv_window(cache, convs, xp[..., 1:])
    return y


def _project(layer, x: torch.Tensor, cache: LayerCache, lins):
    """q and k as one `[B, 2H, 1, K]` (q's heads, then k's), v `[B, HV, 1, V]` (after the short convolution and
    RoPE) and the outputs of the projections after q, k, v in lins `[B, n_i]`; updates the conv states."""
    B = x.shape[0]
    H, HV, Dk, Dv = layer.n_heads, layer.n_value_heads, layer.head_dim, layer.head_dim_v
    convs, y, cw, cb = _fused(layer, x, lins)
    nq, nv = H * Dk, HV * Dv
    if convs:
        parts = y.split([2 * nq + nv] + [m.out_features for m in lins[3:]], dim=1)
        qk, v = _conv(parts[0], cache, convs, cw, cb).split([2 * nq, nv], dim=1)
        extra = parts[1:]
    else:
        qk, v, *extra = y.split([2 * nq, nv] + [m.out_features for m in lins[3:]], dim=1)
    if layer.rope is not None:   # the same rotation for q and k
        qk = layer.rope.apply(qk.view(B, 1, 2 * H, Dk), cache.offset)
    return qk.view(B, 2 * H, 1, Dk), v.view(B, HV, 1, Dv), extra


def _out(layer, o: torch.Tensor, gate: Optional[torch.Tensor]) -> torch.Tensor:
    """The layer's output norm, gate and o_proj for one token: o `[B, HV, 1, V]`, gate the g_proj output
    `[B, HV * V]` or None -> `[B, 1, d_model]`."""
    B, H, _, Dv = o.shape
    norm = layer._modules.get("o_norm")
    if norm is not None:
        o = F.rms_norm(o, (Dv,), norm.weight, norm.eps)
    if gate is not None:
        o = o * F.silu(gate.view(B, H, 1, Dv))
    return F.linear(o.reshape(B, 1, H * Dv), layer._modules["o_proj"].weight)


def _gate_out(layer, extra):
    return extra[-1] if layer._modules.get("g_proj") is not None else None


# -- the compiled step's glue (cpu/decode.py) --------------------------------------------------------------------
def _compiled_inputs(layer, x: torch.Tensor, cache: LayerCache, lins):
    """(y, conv, heads) for the compiled step, or None when it does not apply (switched off or not buildable,
    RoPE). y: the fused projection `[B, sum of widths]`; conv: (window in, weights [C, K], bias, silu) or None
    without a short convolution; heads: (H, HV, K, V)."""
    if not layer.compiled_decode or layer.rope is not None or not _cpu_decode.available():
        return None
    convs, y, cw, cb = _fused(layer, x, lins)
    heads = (layer.n_heads, layer.n_value_heads, layer.head_dim, layer.head_dim_v)
    conv = None
    if convs:
        C, KC = cw.shape[0], convs[0].kernel_size
        window = conv_window(cache, y.dtype)
        if window is not None:
            if window.shape != (y.shape[0], C, KC - 1):
                return None   # not this layer's windows: the PyTorch step (and then the general path) checks them
            if window.dtype != y.dtype or not window.is_contiguous():
                window = window.to(y.dtype).contiguous()
        conv = (window, cw.view(C, KC), cb, convs[0].activation is not None)
    return y, conv, heads


def _compiled_out(layer, cache: LayerCache, o: torch.Tensor, window: Optional[torch.Tensor]) -> torch.Tensor:
    """Stores the compiled step's new conv window and applies o_proj to its output o `[B, HV * V]`."""
    if window is not None:
        mods = layer._modules
        store_conv_window(cache, (mods["q_conv"], mods["k_conv"], mods["v_conv"]), window)
    return F.linear(o.view(o.shape[0], 1, -1), layer._modules["o_proj"].weight)


def output_norm_args(layer, dtype: torch.dtype):
    """(has_norm, weight or None, eps) of the output RMSNorm as `_out` applies it."""
    norm = layer._modules.get("o_norm")
    if norm is None:
        return False, None, 0.0
    eps = norm.eps if norm.eps is not None else torch.finfo(dtype).eps
    w = norm.weight
    if w is not None and (w.dtype != dtype or not w.is_contiguous()):
        w = w.detach().to(dtype).contiguous()
    return True, w, float(eps)


# -- "delta": DeltaNet, Gated DeltaNet, EFLA ----------------------------------------------------------------------
def _delta_step(layer, x: torch.Tensor, cache: LayerCache, lins) -> Optional[torch.Tensor]:
    """The recurrent form of `delta_rule` (ops/delta_core.py: prepare_delta, then one step of _recurrent)."""
    B, H, HV, K, V, cdt = x.shape[0], layer.n_heads, layer.n_value_heads, layer.head_dim, layer.head_dim_v, x.dtype
    S = cache.state
    if S is not None and not (isinstance(S, torch.Tensor) and S.shape == (B, HV, K, V) and S.device == x.device):
        return None   # the general path checks it and says what is wrong
    gated = layer._modules.get("a_proj") is not None    # Gated DeltaNet's decay
    fused = _compiled_inputs(layer, x, cache, lins)
    if fused is not None:
        return _delta_step_compiled(layer, cache, S, gated, *fused)
    qk, v, extra = _project(layer, x, cache, lins)                        # [B, 2H, 1, K], [B, HV, 1, V]
    if layer.qk_l2norm:          # DeltaNet, GatedDeltaNet: both, inside the operator
        q, k = l2norm(qk, layer.l2norm_convention).split(H, dim=1)
    else:                        # EFLA: the layer normalises q (or not); keys keep their norm
        q, k = layer._prepare_qk(*qk.split(H, dim=1))
    q = q * layer.scale
    lam, d2, d = key_norms(k)                             # [B, H, 1] (fp64 for fp32), [B, H, 1, 1]
    k = k / d                                                               # key-norm rescaling
    if HV != H:   # grouped value heads: as prepare_delta, repeated after the normalisation and key norms
        q, k, lam, d2, d = (t.repeat_interleave(HV // H, dim=1) for t in (q, k, lam, d2, d))
    beta = layer._beta_of(extra[0]).view(B, HV, 1)
    if beta.dtype != cdt:
        beta = beta.to(cdt)
    a = efla_coefficient(beta.to(lam.dtype), lam) if layer.exact else beta
    a = (a * d2).to(cdt).unsqueeze(-1)
    bv = (v / d) * a
    if S is None:
        S = q.new_zeros(B, HV, K, V)
    elif S.dtype != cdt:
        S = S.to(cdt)
    if gated:
        g = layer._gate_of(extra[1], fast=True)
        S = S * torch.exp(g if g.dtype == cdt else g.to(cdt)).view(B, HV, 1, 1)
    err = torch.addcmul(bv, a, k @ S, value=-1.0)                          # a (v - S^T k)
    S = torch.addcmul(S, k.transpose(-1, -2), err)
    cache.state = S
    return _out(layer, q @ S, _gate_out(layer, extra))


def _delta_step_compiled(layer, cache: LayerCache, S: Optional[torch.Tensor], gated: bool, y: torch.Tensor, conv,
                         heads):
    cdt = y.dtype
    if S is not None and (S.dtype != cdt or not S.is_contiguous()):
        S = S.to(cdt).contiguous()
    neg_a = dt_bias = alpha = None
    if gated:
        neg_a = mamba_neg_a(layer.A_log, cdt, layer)
        dt_bias = layer.dt_bias.detach().to(cdt).contiguous()
    beta_mode = 0
    if layer.exact:
        beta_mode = _cpu_decode.BETA_MODES.index(layer.beta_mode)
        if layer.beta_mode == "adaptive":
            alpha = layer.beta_alpha.detach().to(cdt).contiguous()
    o, S, window = _cpu_decode.delta_step(
        y, heads=heads, conv=conv, kind=1 if layer.exact else 0,
        l2conv=L2NORM_CONVENTIONS.index(layer.l2norm_convention) if layer.qk_l2norm else 0,
        q_l2=bool(getattr(layer, "q_l2norm", False)), l2eps=L2NORM_EPS, scale=layer.scale, beta_mode=beta_mode,
        alpha=alpha, gated=gated, neg_a=neg_a, dt_bias=dt_bias, S=S, norm=output_norm_args(layer, cdt),
        has_gate=layer._modules.get("g_proj") is not None)
    cache.state = S
    return _compiled_out(layer, cache, o, window)


# -- "linear": LinearAttention -----------------------------------------------------------------------------------
def linear_supported(layer) -> bool:
    """Whether a LinearAttention layer's configuration has a fast step: a linear-space, non-positional map, and
    the diagonal gate's low-rank projection exactly as built (an adapter may have replaced it)."""
    fm = layer.feature_map
    if layer.gate == "diagonal":
        g = layer._modules["gk_proj"]
        if not (type(g) is nn.Sequential and len(g) == 2 and type(g[1]) is nn.Linear) or hooked(g, g[1]):
            return False
    return not fm.positional and not (fm.log_space and layer.gate == "diagonal")


def linear_decay(layer, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """RetNet's per-head decay exp(log gamma) `[1, HV, 1, 1]`, as the operator computes it."""
    return torch.exp(torch.log(layer._gamma_on(device).to(dtype))).view(1, -1, 1, 1)


def linear_state(cache: LayerCache, st: LinearAttentionState, cdt: torch.dtype) -> torch.Tensor:
    """[kv | z] `[B, HV, K, V + 1]`: the kept whole tensor while cache.state is the state made from it."""
    fs = cache.fast
    if fs is not None and fs.linear_of is st:
        return fs.linear_state
    return torch.cat([st.kv, st.z.unsqueeze(-1)], -1).to(cdt)


def store_linear_state(cache: LayerCache, S: torch.Tensor, offset: torch.Tensor, V: int,
                       log_scale: Optional[torch.Tensor] = None) -> None:
    state = LinearAttentionState(kv=S[..., :V], z=S[..., V], log_scale=log_scale, offset=offset + 1)
    cache.state = state
    fs = _fast_state(cache)
    fs.linear_of, fs.linear_state = state, S


def _linear_step(layer, x: torch.Tensor, cache: LayerCache, lins) -> Optional[torch.Tensor]:
    """The recurrent form of `linear_attention` for one token, with the state [kv | z] kept as one tensor."""
    fm = layer.feature_map
    B, H, HV, V, cdt = x.shape[0], layer.n_heads, layer.n_value_heads, layer.head_dim_v, x.dtype
    Kf = fm.feature_dim(layer.head_dim)
    st = cache.state
    if st is not None and not (isinstance(st, LinearAttentionState)
                               and (st.log_scale is None if not fm.log_space else
                                    isinstance(st.log_scale, torch.Tensor) and st.log_scale.shape == (B, HV, Kf))
                               and st.kv.shape == (B, HV, Kf, V) and st.z.shape == (B, HV, Kf)
                               and st.kv.device == x.device and st.offset.shape == (B,)):
        return None   # the general path checks it and says what is wrong
    if type(fm) in COMPILED_MAPS and layer.gate != "diagonal":
        fused = _compiled_inputs(layer, x, cache, lins)
        if fused is not None:
            return _linear_step_compiled(layer, cache, st, *fused)
    qk, v, extra = _project(layer, x, cache, lins)                        # [B, 2H, 1, K], [B, HV, 1, V]
    if fm.log_space:   # Hadamard Exp, FAVOR+: the state keeps its log-scale (layers/fast_decode_log.py)
        return _log_linear_step(layer, cache, st, qk, v, extra)
    if isinstance(fm, _ELEMENTWISE_MAPS) and layer.scale == 1.0:
        fq, fk = fm.phi(qk).split(H, dim=1)
    else:
        q, k = qk.split(H, dim=1)
        if layer.scale != 1.0:
            q = q * layer.scale
        fq, fk = fm.phi(q.transpose(1, 2)).transpose(1, 2), fm.psi(k.transpose(1, 2)).transpose(1, 2)
    if HV != H:   # grouped value heads: value head j reads the features of q/k head j // (HV / H)
        fq, fk = fq.repeat_interleave(HV // H, dim=1), fk.repeat_interleave(HV // H, dim=1)
    if st is None:
        S = fq.new_zeros(B, HV, Kf, V + 1)
        offset = torch.zeros(B, dtype=torch.int64, device=x.device)
    else:
        S = linear_state(cache, st, cdt)
        offset = st.offset if st.offset.dtype == torch.int64 else st.offset.to(torch.int64)
    if layer.gate == "retnet":
        S = linear_decay(layer, cdt, x.device) * S
    elif layer.gate == "scalar":
        g = layer._scalar_gate(extra[0], fast=True)
        S = torch.exp(g if g.dtype == cdt else g.to(cdt)).view(B, HV, 1, 1) * S
    elif layer.gate == "diagonal":
        gk = F.linear(extra[0], layer.gk_proj[1].weight, layer.gk_proj[1].bias)
        S = torch.exp(layer._diagonal_gate(gk).to(cdt)).view(B, HV, Kf, 1) * S
    S = S + fk.transpose(-1, -2) * F.pad(v, (0, 1), value=1.0)   # (not addcmul: the operator's bits)
    o, den = torch.matmul(fq, S).split([V, 1], dim=-1)                  # [B, HV, 1, V], [B, HV, 1, 1]
    if layer.normalize:
        if isinstance(fm, NONNEGATIVE_MAPS):
            den = den.clamp_min(layer.eps)
        else:   # a floor on |den| that keeps its sign, as the operator
            floor = torch.as_tensor(layer.eps, dtype=den.dtype)
            den = torch.where(den < 0, torch.minimum(den, -floor), torch.maximum(den, floor))
        o = o / den
    store_linear_state(cache, S, offset, V)
    return _out(layer, o, _gate_out(layer, extra))


def _log_linear_step(layer, cache: LayerCache, st: Optional[LinearAttentionState], qk, v, extra):
    B, H, HV, cdt = v.shape[0], layer.n_heads, layer.n_value_heads, v.dtype
    S = mu = None
    offset = torch.zeros(B, dtype=torch.int64, device=v.device)
    if st is not None:
        S, mu = linear_state(cache, st, cdt), st.log_scale.to(cdt)
        offset = st.offset if st.offset.dtype == torch.int64 else st.offset.to(torch.int64)
    g = None
    if layer.gate == "retnet":
        g = torch.log(layer._gamma_on(v.device).to(cdt)).reshape(1, -1).expand(B, HV)
    elif layer.gate == "scalar":
        g = layer._scalar_gate(extra[0], fast=True).to(cdt).view(B, HV)
    q, k = qk.view(B, 2 * H, -1).split(H, dim=1)
    o, S, mu = log_state_step(layer, q, k, v.view(B, HV, -1), g, S, mu)
    store_linear_state(cache, S, offset, v.shape[-1], log_scale=mu)
    return _out(layer, o.unsqueeze(2), _gate_out(layer, extra))


def _linear_step_compiled(layer, cache: LayerCache, st: Optional[LinearAttentionState], y: torch.Tensor, conv,
                          heads):
    """For the maps in COMPILED_MAPS and the gates None, "retnet" and "scalar"."""
    cdt, B, HV, V = y.dtype, y.shape[0], layer.n_value_heads, layer.head_dim_v
    S, offset = None, torch.zeros(B, dtype=torch.int64)
    if st is not None:
        S = linear_state(cache, st, cdt)
        if S.dtype != cdt or not S.is_contiguous():
            S = S.to(cdt).contiguous()
        offset = st.offset if st.offset.dtype == torch.int64 else st.offset.to(torch.int64)
    decay = neg_a = dt_bias = None
    gate_kind = 0
    if layer.gate == "retnet":
        gate_kind, decay = 1, linear_decay(layer, cdt, y.device).reshape(-1).expand(HV).contiguous()
    elif layer.gate == "scalar":
        gate_kind = 2
        neg_a = mamba_neg_a(layer.A_log, cdt, layer).reshape(-1).expand(HV).contiguous()
        dt_bias = layer.dt_bias.detach().to(cdt).reshape(-1).expand(HV).contiguous()
    fm = layer.feature_map
    o, S, window = _cpu_decode.linear_step(
        y, heads=heads, conv=conv, fmap=_cpu_decode.FEATURE_MAPS[fm.name], scale=layer.scale,
        gate_kind=gate_kind, decay=decay, neg_a=neg_a, dt_bias=dt_bias, S=S, normalize=layer.normalize,
        nonneg=isinstance(fm, NONNEGATIVE_MAPS), eps=float(layer.eps), norm=output_norm_args(layer, cdt),
        has_gate=layer._modules.get("g_proj") is not None)
    store_linear_state(cache, S, offset, V)
    return _compiled_out(layer, cache, o, window)


#: the fast steps by the kind a layer's `fast_step_kind()` names: step(layer, x, cache, lins) -> output or None
STEPS: Dict[str, Callable] = {"delta": _delta_step, "linear": _linear_step}


class BlockPlanSlot:
    """An empty stand-in, so that a model pickled whole before the block plans moved to `models/decode_plan.py` (its
    layers held a slot of this name) still loads; nothing reads it."""

    __slots__ = ()

    def __reduce__(self):
        return (BlockPlanSlot, ())
