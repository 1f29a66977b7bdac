"""The single-token decoding fast path of the attention layers, behind one hook point: `step`.

`AttentionBase.forward` calls `step(layer, x, cache, cu_seqlens)` first. It returns the layer's output for one
decoded token, or None, and then the general path runs and finds the cache untouched. It applies to a call
that decodes one token on the CPU without autograd (grad disabled, a `LayerCache`, T == 1, fp32/fp64, no
cu_seqlens) of a layer whose submodules are exactly the library's (nn.Linear, ShortConv, GatedRMSNorm: no
adapter replaced them) and carry no forward hooks, since the step computes their forward itself.

A layer opts in through `fast_step_kind()`, which names one of `STEPS`:

* "delta": one step of `delta_rule`'s recurrent form (prepare_delta, then one update of the state) for
  DeltaNet, Gated DeltaNet and EFLA;
* "linear": one step of `linear_attention`'s recurrent form for linear-space, non-positional feature maps,
  with the state [kv | z] kept whole between steps (kv and z in the cache are views of it).

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
"""
from __future__ import annotations

import ctypes
import math
import operator
from typing import Callable, Dict, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..cpu import decode as _cpu_decode
from ..ops import LinearAttentionState
from ..ops.delta_core import efla_coefficient, key_norms
from ..ops.feature_maps import EluPlusOne, Identity, ReLU
from ..ops.l2norm import L2NORM_CONVENTIONS, L2NORM_EPS, l2norm
from .cache import Cache, FastDecodeState, LayerCache
from .common import GatedRMSNorm, RMSNorm, ShortConv, mamba_neg_a

__all__ = ["STEPS", "BlockPlanSlot", "ModelFastState", "ModelPlanSlot", "block_step", "hooked", "model_step", "step"]

_ELEMENTWISE_MAPS = (Identity, EluPlusOne, ReLU)
_NONNEGATIVE_MAPS = (EluPlusOne, ReLU)
_COMPILED_MAPS = (Identity, EluPlusOne, ReLU)   # exactly these classes: the fused compiled step computes them

# forward hooks registered for every module (nn.modules.module.register_module_forward_hook / _pre_hook). torch
# has no public way to ask whether one is registered, so this one place reads its registries: the fast step
# does not call the submodules, so it steps aside while any hook is registered
_GLOBAL_HOOKS = (getattr(nn.modules.module, "_global_forward_hooks", {}),
                 getattr(nn.modules.module, "_global_forward_pre_hooks", {}))


def hooked(*modules: Optional[nn.Module]) -> bool:
    """Whether a forward hook is registered globally or on one of `modules`: the fast decoding steps
    compute these modules' forward themselves, so they step aside for any hook."""
    return bool(_GLOBAL_HOOKS[0] or _GLOBAL_HOOKS[1]) or any(
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
    lins = _usable(layer, x, kind)
    if lins is None:
        return None
    out = STEPS[kind](layer, x, cache, lins)
    if out is not None:
        cache["offset"] = cache.offset + 1
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


def _usable(layer, x: torch.Tensor, kind: str):
    """The fused projections (q, k, v, then `_extra`) when the layer's modules are exactly the library's, in
    x's dtype and without hooks; else None."""
    if layer.gate_act != "silu" or layer.norm_group_size is not None:
        return None   # the fast step computes the default gated norm only
    mods = layer._modules
    lins = (mods["q_proj"], mods["k_proj"], mods["v_proj"]) + _extra(layer, kind)
    for m in lins + (mods["o_proj"],):
        if type(m) is not nn.Linear or m.weight.dtype != x.dtype:
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
        if c0._parameters["weight"].dtype != x.dtype:
            return None
    return lins


# -- pieces shared by the steps ----------------------------------------------------------------------------------
def _fast_state(cache: LayerCache) -> FastDecodeState:
    fs = cache.fast
    if fs is None:
        fs = cache.fast = FastDecodeState()
    return fs


def _fused_weights(layer, lins):
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
    convs, w, b, cw, cb = _fused_weights(layer, lins)
    return convs, F.linear(x.reshape(x.shape[0], -1), w, b), cw, cb


def _window(cache: LayerCache, dtype: torch.dtype) -> Optional[torch.Tensor]:
    """The q | k | v conv windows as one contiguous `[B, C, K - 1]` (None before the first token)."""
    old = (cache.get("conv_q"), cache.get("conv_k"), cache.get("conv_v"))
    fs = cache.fast
    if fs is not None and fs.conv_views is not None and all(a is b for a, b in zip(fs.conv_views, old)):
        return fs.window
    if old[0] is None:
        return None
    return torch.cat([s.to(dtype) for s in old], dim=1)


def _store_window(cache: LayerCache, convs, new: torch.Tensor) -> None:
    """conv_q/k/v in cache as views of the new window `[B, C, K - 1]` (kept whole for the next step)."""
    sq, sk, sv = new.split_with_sizes([convs[0].dim, convs[1].dim, convs[2].dim], dim=1)
    cache["conv_q"], cache["conv_k"], cache["conv_v"] = sq, sk, sv
    fs = _fast_state(cache)
    fs.conv_views, fs.window = (sq, sk, sv), new


def _conv(u: torch.Tensor, cache: LayerCache, convs, w: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """The q, k and v short convolutions of one token as one: u `[B, C]` (q | k | v before the convolution),
    w their weights `[C, 1, K]` -> `[B, C]`; the states conv_q/k/v in cache are views of one window."""
    K, C = convs[0].kernel_size, u.shape[1]
    state = _window(cache, u.dtype)
    if state is None:
        state = u.new_zeros(u.shape[0], C, K - 1)
    xp = torch.cat([state, u.unsqueeze(-1)], dim=-1)                      # [B, C, K]
    y = (xp * w.view(C, K)).sum(-1)
    if bias is not None:
        y = y + bias
    if convs[0].activation is not None:
        y = F.silu(y)
    _store_window(cache, convs, xp[..., 1:])
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
        window = _window(cache, y.dtype)
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
        _store_window(cache, (mods["q_conv"], mods["k_conv"], mods["v_conv"]), window)
    return F.linear(o.view(o.shape[0], 1, -1), layer._modules["o_proj"].weight)


def _norm_args(layer, dtype: torch.dtype):
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
    S = cache.get("state")
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
    cache["state"] = S
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
        alpha=alpha, gated=gated, neg_a=neg_a, dt_bias=dt_bias, S=S, norm=_norm_args(layer, cdt),
        has_gate=layer._modules.get("g_proj") is not None)
    cache["state"] = S
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
    return not fm.log_space and not fm.positional


def _linear_decay(layer, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """RetNet's per-head decay exp(log gamma) `[1, HV, 1, 1]`, as the operator computes it."""
    return torch.exp(torch.log(layer._gamma_on(device).to(dtype))).view(1, -1, 1, 1)


def _linear_state(cache: LayerCache, st: LinearAttentionState, cdt: torch.dtype) -> torch.Tensor:
    """[kv | z] `[B, HV, K, V + 1]`: the kept whole tensor while cache["state"] is the state made from it."""
    fs = cache.fast
    if fs is not None and fs.linear_of is st:
        return fs.linear_state
    return torch.cat([st.kv, st.z.unsqueeze(-1)], -1).to(cdt)


def _store_linear(cache: LayerCache, S: torch.Tensor, offset: torch.Tensor, V: int) -> None:
    state = LinearAttentionState(kv=S[..., :V], z=S[..., V], log_scale=None, offset=offset + 1)
    cache["state"] = state
    fs = _fast_state(cache)
    fs.linear_of, fs.linear_state = state, S


def _linear_step(layer, x: torch.Tensor, cache: LayerCache, lins) -> Optional[torch.Tensor]:
    """The recurrent form of `linear_attention` for one token, with the state [kv | z] kept as one tensor."""
    fm = layer.feature_map
    B, H, HV, V, cdt = x.shape[0], layer.n_heads, layer.n_value_heads, layer.head_dim_v, x.dtype
    Kf = fm.feature_dim(layer.head_dim)
    st = cache.get("state")
    if st is not None and not (isinstance(st, LinearAttentionState) and st.log_scale is None
                               and st.kv.shape == (B, HV, Kf, V) and st.z.shape == (B, HV, Kf)
                               and st.kv.device == x.device and st.offset.shape == (B,)):
        return None   # the general path checks it and says what is wrong
    if type(fm) in _COMPILED_MAPS and layer.gate != "diagonal":
        fused = _compiled_inputs(layer, x, cache, lins)
        if fused is not None:
            return _linear_step_compiled(layer, cache, st, *fused)
    qk, v, extra = _project(layer, x, cache, lins)                        # [B, 2H, 1, K], [B, HV, 1, V]
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
        S = _linear_state(cache, st, cdt)
        offset = st.offset if st.offset.dtype == torch.int64 else st.offset.to(torch.int64)
    if layer.gate == "retnet":
        S = _linear_decay(layer, cdt, x.device) * S
    elif layer.gate == "scalar":
        g = layer._scalar_gate(extra[0], fast=True)
        S = torch.exp(g if g.dtype == cdt else g.to(cdt)).view(B, HV, 1, 1) * S
    elif layer.gate == "diagonal":
        gk = F.linear(extra[0], layer.gk_proj[1].weight, layer.gk_proj[1].bias)
        S = torch.exp(layer._diagonal_gate(gk).to(cdt)).view(B, HV, Kf, 1) * S
    S = S + fk.transpose(-1, -2) * F.pad(v, (0, 1), value=1.0)   # (not addcmul: the operator's bits)
    o, den = torch.matmul(fq, S).split([V, 1], dim=-1)                  # [B, HV, 1, V], [B, HV, 1, 1]
    if layer.normalize:
        if isinstance(fm, _NONNEGATIVE_MAPS):
            den = den.clamp_min(layer.eps)
        else:   # a floor on |den| that keeps its sign, as the operator
            floor = torch.as_tensor(layer.eps, dtype=den.dtype)
            den = torch.where(den < 0, torch.minimum(den, -floor), torch.maximum(den, floor))
        o = o / den
    _store_linear(cache, S, offset, V)
    return _out(layer, o, _gate_out(layer, extra))


def _linear_step_compiled(layer, cache: LayerCache, st: Optional[LinearAttentionState], y: torch.Tensor, conv,
                          heads):
    """For the maps in _COMPILED_MAPS and the gates None, "retnet" and "scalar"."""
    cdt, B, HV, V = y.dtype, y.shape[0], layer.n_value_heads, layer.head_dim_v
    S, offset = None, torch.zeros(B, dtype=torch.int64)
    if st is not None:
        S = _linear_state(cache, st, cdt)
        if S.dtype != cdt or not S.is_contiguous():
            S = S.to(cdt).contiguous()
        offset = st.offset if st.offset.dtype == torch.int64 else st.offset.to(torch.int64)
    decay = neg_a = dt_bias = None
    gate_kind = 0
    if layer.gate == "retnet":
        gate_kind, decay = 1, _linear_decay(layer, cdt, y.device).reshape(-1).expand(HV).contiguous()
    elif layer.gate == "scalar":
        gate_kind = 2
        neg_a = mamba_neg_a(layer.A_log, cdt, layer).reshape(-1).expand(HV).contiguous()
        dt_bias = layer.dt_bias.detach().to(cdt).reshape(-1).expand(HV).contiguous()
    fm = layer.feature_map
    o, S, window = _cpu_decode.linear_step(
        y, heads=heads, conv=conv, fmap=_cpu_decode.FEATURE_MAPS[fm.name], scale=layer.scale,
        gate_kind=gate_kind, decay=decay, neg_a=neg_a, dt_bias=dt_bias, S=S, normalize=layer.normalize,
        nonneg=isinstance(fm, _NONNEGATIVE_MAPS), eps=float(layer.eps), norm=_norm_args(layer, cdt),
        has_gate=layer._modules.get("g_proj") is not None)
    _store_linear(cache, S, offset, V)
    return _compiled_out(layer, cache, o, window)


#: the fast steps by the kind a layer's `fast_step_kind()` names: step(layer, x, cache, lins) -> output or None
STEPS: Dict[str, Callable] = {"delta": _delta_step, "linear": _linear_step}


# -- a whole model block in one compiled call (models/lm.py's pre-norm block) -----------------------------------
class BlockPlanSlot:
    """A layer's whole-block decoding plan (`cpu/decode.BlockPlan`), the key it was built for, the tensors it
    points into and the fused weights it was built from. Not state: a copy or a pickle gets an empty slot, rebuilt
    on first use."""

    __slots__ = ("key", "plan", "fn", "keep", "fused")

    def __init__(self):
        self.key = self.plan = self.fn = self.keep = self.fused = None

    def __reduce__(self):
        return (BlockPlanSlot, ())


def _block_key(layer, x: torch.Tensor, norm1, norm2, ffn):
    """What a plan depends on, cheap enough to compare every token: the modules it reads (by identity: a replaced
    submodule), their parameters (identity, version, storage: in-place updates, `.data =`, `.to()`), the layer's
    configuration, dtype, batch and threads. Hooks are checked separately (`hooked`), on every call."""
    mods = (layer, *layer._modules.values(), norm1, norm2)
    if ffn is not None:
        mods += (ffn, ffn._modules["w_gate_up"], ffn._modules["w_down"])
    params = [p for m in mods if m is not None for p in m._parameters.values()]
    d = layer.__dict__
    return (x.dtype, x.shape[0], torch.get_num_threads(), type(layer), mods,
            tuple([None if p is None else (id(p), p._version, p.data_ptr()) for p in params]),
            id(d.get("_gamma")), d.get("scale"), d.get("l2norm_convention"), d.get("beta_mode"), d.get("q_l2norm"),
            d.get("gate"), d.get("normalize"), d.get("eps"), id(d.get("feature_map")), norm1.eps,
            None if norm2 is None else norm2.eps)


def _block_hooked(layer) -> bool:
    """`hooked` over the layer and its modules, which the block step computes (the block checks its norms and
    FFN)."""
    return hooked(layer, *layer._modules.values())


def _build_plan(layer, kind, lins, x, norm1, norm2, ffn):
    """(BlockPlan, the tensors it points into) for this layer, block and dtype."""
    cdt, B, d = x.dtype, x.shape[0], x.shape[-1]
    keep = []

    def addr(t):
        if t is None:
            return None
        t = t.detach()
        if t.dtype != cdt or not t.is_contiguous():
            t = t.to(cdt).contiguous()
        keep.append(t)
        return t.data_ptr()

    convs, w, b, cw, cb = _fused_weights(layer, lins)
    H, HV, K, V = layer.n_heads, layer.n_value_heads, layer.head_dim, layer.head_dim_v
    p = _cpu_decode.BlockPlan(B=B, H=H, HV=HV, K=K, V=V, d=d, ny=w.shape[0], KC=convs[0].kernel_size if convs else 0,
                              hid=ffn.w_down.in_features if ffn is not None else 0, kind=0 if kind == "delta" else 1,
                              conv_act=int(bool(convs) and convs[0].activation is not None), scale=layer.scale,
                              nthreads=max(1, torch.get_num_threads()), has_ffn=int(ffn is not None))
    p.W, p.Wb = addr(w), addr(b)
    if convs:
        p.cw, p.cb = addr(cw.view(cw.shape[0], -1)), addr(cb)
    if kind == "delta":
        p.dkind, p.l2eps = int(bool(layer.exact)), L2NORM_EPS
        p.l2conv = L2NORM_CONVENTIONS.index(layer.l2norm_convention) if layer.qk_l2norm else 0
        p.q_l2 = int(bool(getattr(layer, "q_l2norm", False)))
        if layer.exact:
            p.beta_mode = _cpu_decode.BETA_MODES.index(layer.beta_mode)
            if layer.beta_mode == "adaptive":
                p.alpha = addr(layer.beta_alpha)
        if layer._modules.get("a_proj") is not None:
            p.gated = 1
            p.neg_a, p.dt_bias = addr(mamba_neg_a(layer.A_log, cdt, layer)), addr(layer.dt_bias)
    else:
        fm = layer.feature_map
        p.fmap, p.normalize = _cpu_decode.FEATURE_MAPS[fm.name], int(bool(layer.normalize))
        p.nonneg, p.eps = int(isinstance(fm, _NONNEGATIVE_MAPS)), float(layer.eps)
        if layer.gate == "retnet":
            p.gate_kind, p.decay = 1, addr(_linear_decay(layer, cdt, x.device).reshape(-1).expand(HV))
        elif layer.gate == "scalar":
            p.gate_kind = 2
            p.neg_a = addr(mamba_neg_a(layer.A_log, cdt, layer).reshape(-1).expand(HV))
            p.dt_bias = addr(layer.dt_bias.reshape(-1).expand(HV))
    has_norm, nw, neps = _norm_args(layer, cdt)
    p.has_norm, p.nw, p.norm_eps = int(has_norm), addr(nw), neps
    p.has_gate = int(layer._modules.get("g_proj") is not None)
    p.Wo = addr(layer._modules["o_proj"].weight)
    p.n1w, p.n1eps = addr(norm1.weight), float(norm1.eps)
    if ffn is not None:
        p.n2w, p.n2eps = addr(norm2.weight), float(norm2.eps)
        p.Wgu, p.bgu = addr(ffn.w_gate_up.weight), addr(ffn.w_gate_up.bias)
        p.Wd, p.bd = addr(ffn.w_down.weight), addr(ffn.w_down.bias)
    return p, keep


def _new_block_plan(layer, x: torch.Tensor, norm1, norm2, ffn):
    """(BlockPlan, the tensors it points into) after the full checks (a covered layer, modules exactly the
    library's, in x's dtype), or None."""
    kind = layer.fast_step_kind()
    if kind is None or (kind == "linear" and (type(layer.feature_map) not in _COMPILED_MAPS
                                              or layer.gate == "diagonal")):
        return None
    if ffn is not None and any(t is not None and t.dtype != x.dtype for t in (
            ffn.w_gate_up.weight, ffn.w_gate_up.bias, ffn.w_down.weight, ffn.w_down.bias)):
        return None
    lins = _usable(layer, x, kind)
    if lins is None or not _cpu_decode.available():
        return None
    plan, keep = _build_plan(layer, kind, lins, x, norm1, norm2, ffn)
    plan.keep = keep   # the plan holds what it points into (a call in flight keeps it alive)
    return plan, keep


def block_step(layer, x: torch.Tensor, cache: Optional[LayerCache], norm1, norm2, ffn) -> Optional[torch.Tensor]:
    """The hook point of a pre-norm model block (models/lm.py) for one decoded token x `[B, 1, d]`:

        h = x + layer(norm1(x)),   out = h + ffn(norm2(h))      (ffn a SwiGLU, or None: out = h)

    as one compiled call (csrc/decode.c, linattn_decode_block), with the cache advanced as `step` advances it;
    or None when that does not cover the call (then the block runs its usual path, which finds the cache
    untouched). norm1 / norm2: the block's RMSNorms, exactly the library's, in x's dtype and without hooks (the
    block checks them). Covers what the compiled step covers (`_compiled_inputs`, the linear maps of
    `_COMPILED_MAPS` without the diagonal gate); the per-layer constants are one plan (`BlockPlanSlot`), rebuilt
    when a parameter changes (its version or storage), the dtype, the batch or the thread count."""
    slot = getattr(layer, "_block_plan", None)
    if not (isinstance(slot, BlockPlanSlot) and getattr(layer, "fast_decode", False) and layer.compiled_decode
            and cache is not None and x.dim() == 3 and x.shape[1] == 1 and x.device.type == "cpu"
            and not torch.is_grad_enabled() and x.dtype in (torch.float32, torch.float64) and layer.rope is None
            and not torch.compiler.is_compiling() and _cpu_decode.switched_on()):
        return None
    key = _block_key(layer, x, norm1, norm2, ffn)
    if key != slot.key or layer._fused._value is not slot.fused:
        slot.key = None
        built = _new_block_plan(layer, x, norm1, norm2, ffn)
        if built is None:
            return None
        slot.plan, slot.keep = built
        slot.fn, slot.fused, slot.key = _cpu_decode.block_function(x.dtype), layer._fused._value, key
    if _block_hooked(layer):
        return None
    plan, fn = slot.plan, slot.fn
    kind = "delta" if plan.kind == 0 else "linear"
    B, d, cdt = x.shape[0], x.shape[2], x.dtype
    H, HV, K, V = layer.n_heads, layer.n_value_heads, layer.head_dim, layer.head_dim_v
    st = cache.get("state")
    if kind == "delta":
        S = st
        if S is not None and not (isinstance(S, torch.Tensor) and S.shape == (B, HV, K, V) and S.device == x.device):
            return None   # the general path checks it and says what is wrong
        S_out = torch.empty(B, HV, K, V, dtype=cdt)
    else:
        Kf = layer.feature_map.feature_dim(K)
        if st is not None and not (isinstance(st, LinearAttentionState) and st.log_scale is None
                                   and st.kv.shape == (B, HV, Kf, V) and st.z.shape == (B, HV, Kf)
                                   and st.kv.device == x.device and st.offset.shape == (B,)):
            return None
        S = None if st is None else _linear_state(cache, st, cdt)
        S_out = torch.empty(B, HV, Kf, V + 1, dtype=cdt)
    if S is not None and (S.dtype != cdt or not S.is_contiguous()):
        S = S.to(cdt).contiguous()
    window = w_out = None
    mods = layer._modules
    if layer.short_conv:
        c0 = mods["q_conv"]
        window = _window(cache, cdt)
        Cc, W = 2 * H * K + HV * V, c0.kernel_size - 1
        if window is not None:
            if window.shape != (B, Cc, W):
                return None   # not this layer's windows: the general path says what is wrong
            if window.dtype != cdt or not window.is_contiguous():
                window = window.to(cdt).contiguous()
        w_out = torch.empty(B, Cc, W, dtype=cdt)
    xin = x.reshape(B, d)
    if not xin.is_contiguous():
        xin = xin.contiguous()
    x_out = torch.empty(B, 1, d, dtype=cdt)
    _cpu_decode.block_step(plan, fn, xin, window, S, w_out, S_out, x_out)
    if kind == "delta":
        cache["state"] = S_out
    else:
        offset = torch.zeros(B, dtype=torch.int64) if st is None else (
            st.offset if st.offset.dtype == torch.int64 else st.offset.to(torch.int64))
        _store_linear(cache, S_out, offset, V)
    if w_out is not None:
        _store_window(cache, (mods["q_conv"], mods["k_conv"], mods["v_conv"]), w_out)
    cache["offset"] = cache.offset + 1
    return x_out


# -- the whole model in one compiled call (models/lm.py's LanguageModel) -----------------------------------------
_version_of = operator.attrgetter("_version")
_fused_value = operator.attrgetter("_value")
_fast_on, _compiled_on = operator.attrgetter("fast_decode"), operator.attrgetter("compiled_decode")
_data_ptr = torch.Tensor.data_ptr
# what a block plan reads from a mixer's / a norm's __dict__ (checked by identity on every token)
_MIXER_KEYS = ("scale", "l2norm_convention", "beta_mode", "q_l2norm", "qk_l2norm", "exact", "gate", "gate_act",
               "normalize", "eps", "feature_map", "_gamma", "norm_group_size", "short_conv", "causal", "_fused")
_NORM_KEYS = ("eps", "plain")
# the BlockPlan fields that hold data addresses
_PLAN_POINTERS = ("n1w", "W", "Wb", "cw", "cb", "alpha", "neg_a", "dt_bias", "decay", "nw", "Wo", "n2w", "Wgu", "bgu",
                  "Wd", "bd")


class _Layer:
    """Where one layer's state and conv window sit in a model step's buffers, and their shapes."""

    __slots__ = ("kind", "sshape", "wshape", "sizes", "s_off", "w_off", "V")

    def __init__(self, kind, sshape, wshape, sizes, s_off, w_off, V):
        self.kind, self.sshape, self.wshape, self.sizes = kind, sshape, wshape, sizes
        self.s_off, self.w_off, self.V = s_off, w_off, V


class _Layout:
    """Where every layer's state and conv window sit in a model step's buffer (one buffer per token: the states of
    all layers, `n_state` elements, then their conv windows, `n_win`), for one batch size and dtype. Read-only once
    built, so a copy of a cache shares it (`__deepcopy__`)."""

    __slots__ = ("layers", "L", "B", "dtype", "vocab", "n_state", "n_win", "same", "lin", "sbuf", "wbuf", "wmode",
                 "key")

    def __deepcopy__(self, memo):
        return self

    def fits(self, other: "_Layout") -> bool:
        """Whether buffers laid out by `other` are laid out as this one's."""
        return other is self or other.key == self.key


class ModelPlanSlot:
    """A LanguageModel's whole-model decoding plan (`cpu/decode.ModelPlan` with its L block plans), what it was
    built from (checked on every token: `_model_plan_valid`) and the layout of the step's state / window
    buffers. Not state: a copy or a pickle gets an empty slot, rebuilt on first use."""

    __slots__ = ("plan", "fn", "keep", "B", "dtype", "nthreads", "training", "idicts", "inames", "iobjs",
                 "tensors", "vtensors", "versions", "ptrs", "aliases", "hookdicts", "mixers",
                 "fusedobjs", "fused", "layout", "spent", "planref")

    def __init__(self):
        self.plan = self.spent = None

    def __reduce__(self):
        return (ModelPlanSlot, ())


class ModelFastState:
    """What the whole-model step keeps in `Cache.fast` between tokens: the buffers its entries are views of (all
    layers' states `S`, conv windows `W`, the linear layers' offsets `offsets` `[n_linear, B]`) in the layout
    `layout`, valid while the layers' cache entries are still `entries`, the objects it stored (by identity)."""

    __slots__ = ("entries", "S", "W", "offsets", "layout")

    def __init__(self, entries, S, W, offsets, layout):
        self.entries, self.S, self.W, self.offsets, self.layout = entries, S, W, offsets, layout


def _model_plan_valid(slot, model, B: int) -> bool:
    """Whether the plan still describes the model, cheap enough for every token (map over prepared lists, no
    Python loop): the same batch, threads and mode; every submodule, and every parameter or buffer that was
    None, still where it was (identity); every parameter and buffer at the same storage (the slot holds the old
    storages, so a replaced tensor cannot reuse an address), and those the plan holds copies of (fused
    projections, converted or derived tensors) at the same version (in-place updates); the mixers' and
    norms' configuration values the same objects, the layers' fused weights the ones the plan was built from;
    the switches on and no forward hook anywhere (torch registers hooks by mutating these dicts in place)."""
    if (slot.B != B or slot.nthreads != torch.get_num_threads() or slot.training is not model.training
            or _GLOBAL_HOOKS[0] or _GLOBAL_HOOKS[1] or any(slot.hookdicts)):
        return False
    try:   # one pass over every (dict, key) -> object the plan depends on: modules, tensors, configuration
        if not all(map(operator.is_, map(operator.getitem, slot.idicts, slot.inames), slot.iobjs)):
            return False
    except KeyError:
        return False
    return (list(map(_data_ptr, slot.tensors)) == slot.ptrs          # the same objects (checked just above)
            and list(map(_version_of, slot.vtensors)) == slot.versions
            and all(map(operator.is_, map(_fused_value, slot.fusedobjs), slot.fused))
            and all(map(_fast_on, slot.mixers)) and all(map(_compiled_on, slot.mixers)))


def _build_model_plan(slot, model, B: int, block_type) -> bool:
    """Fills slot with a plan for `model` at batch B, or returns False when some part of the model is not covered
    (then the per-block path runs): an nn.Embedding, blocks of exactly `block_type` whose `fast_parts` accept the
    token and whose mixers have a compiled block plan, an RMSNorm (or no final norm), an nn.Linear head without
    bias (or the tied embedding), every weight in the embedding's dtype, no hook."""
    slot.plan = None
    mods = model._modules
    embed, blocks, norm, head = mods.get("embed"), mods.get("blocks"), mods.get("norm"), mods.get("lm_head")
    if type(embed) is not nn.Embedding or embed.max_norm is not None or blocks is None or len(blocks) == 0:
        return False
    cdt = embed.weight.dtype
    if cdt not in (torch.float32, torch.float64) or embed.weight.device.type != "cpu" or not _cpu_decode.available():
        return False
    vocab, d = embed.weight.shape
    if norm is not None and (type(norm) is not RMSNorm or (norm.weight is not None and norm.weight.dtype != cdt)):
        return False
    if head is not None and (type(head) is not nn.Linear or head.bias is not None or head.weight.dtype != cdt
                             or head.weight.shape != (vocab, d)):
        return False
    if hooked(embed, norm, head):
        return False
    x = torch.zeros(B, 1, d, dtype=cdt)
    plans, keep, layers, mixers, snapmods = [], [], [], [], []
    s_off = w_off = 0
    for b in blocks:
        if type(b) is not block_type or b._modules.get("pre_norm") is not None or hooked(b):
            return False
        parts = b.fast_parts(x)
        layer = b._modules.get("mixer")
        if (parts is None or not isinstance(getattr(layer, "_block_plan", None), BlockPlanSlot) or hooked(layer)
                or not (layer.fast_decode and layer.compiled_decode) or layer.rope is not None):
            return False
        built = _new_block_plan(layer, x, *parts)
        if built is None:
            return False
        plan, kept = built
        plans.append(plan)
        keep += kept
        mixers.append(layer)
        snapmods.append((layer, tuple(k for k in _MIXER_KEYS if k in layer.__dict__)))
        snapmods += [(n, tuple(k for k in _NORM_KEYS if k in n.__dict__))
                     for n in (parts[0], parts[1], layer._modules.get("o_norm")) if n is not None]
        H, HV, K, V = layer.n_heads, layer.n_value_heads, layer.head_dim, layer.head_dim_v
        if plan.kind == 0:
            lay = _Layer("delta", (B, HV, K, V), None, None, s_off, -1, V)
        else:
            lay = _Layer("linear", (B, HV, layer.feature_map.feature_dim(K), V + 1), None, None, s_off, -1, V)
        if plan.KC:
            lay.wshape, lay.sizes, lay.w_off = (B, 2 * H * K + HV * V, plan.KC - 1), [H * K, H * K, HV * V], w_off
            w_off += B * lay.wshape[1] * lay.wshape[2]
        s_off += math.prod(lay.sshape)
        layers.append(lay)
    mp = _cpu_decode.ModelPlan(L=len(plans), B=B, d=d, vocab=vocab, has_norm=int(norm is not None),
                               nthreads=max(1, torch.get_num_threads()),
                               norm_eps=float(norm.eps) if norm is not None else 0.0)
    head_w = (head if head is not None else embed).weight.detach()
    norm_w = norm.weight.detach() if norm is not None and norm.weight is not None else None
    for t in (embed.weight.detach(), head_w, norm_w):
        if t is not None and not t.is_contiguous():
            return False
    mp.embed, mp.head = embed.weight.data_ptr(), head_w.data_ptr()
    mp.norm_w = None if norm_w is None else norm_w.data_ptr()
    block_ptrs = (ctypes.c_void_p * len(plans))(*[ctypes.addressof(p) for p in plans])
    offs = ((ctypes.c_int64 * len(plans))(*[lay.s_off for lay in layers]),
            (ctypes.c_int64 * len(plans))(*[lay.w_off for lay in layers]))
    mp.blocks, mp.s_off, mp.w_off = ctypes.addressof(block_ptrs), ctypes.addressof(offs[0]), ctypes.addressof(offs[1])
    # every module but the model itself (its own hooks ran in its __call__)
    every = list(model.modules())[1:]
    tensors = [(h, k, t) for m in every for h in (m._parameters, m._buffers) for k, t in h.items() if t is not None]
    if any(t.device.type != "cpu" for _, _, t in tensors):
        return False
    ident = [(m._modules, k, c) for m in [model] + every for k, c in m._modules.items()]
    ident += [(h, k, t) for m in every for h in (m._parameters, m._buffers) for k, t in h.items() if t is None]
    cur = [t for _, _, t in tensors]
    slot.tensors, slot.ptrs = cur, list(map(_data_ptr, cur))
    # the tensors the plans read in place need no version check (an in-place update is read as it is)
    direct = {mp.embed, mp.head, mp.norm_w} | {getattr(p, f) for p in plans for f in _PLAN_POINTERS}
    slot.vtensors = [t for t in cur if t.data_ptr() not in direct]
    slot.versions = list(map(_version_of, slot.vtensors))
    slot.aliases = [t.detach() for t in cur]   # the storages stay alive: a new tensor cannot take their address
    ident += tensors + [(m.__dict__, k, m.__dict__[k]) for m, keys in snapmods for k in keys]
    slot.idicts, slot.inames, slot.iobjs = [list(z) for z in zip(*ident)]
    slot.mixers, slot.fusedobjs = mixers, [m._fused for m in mixers]
    slot.fused = list(map(_fused_value, slot.fusedobjs))
    slot.hookdicts = [h for m in every for h in (m._forward_hooks, m._forward_pre_hooks)]
    slot.keep = (plans, keep, block_ptrs, offs, embed.weight, head_w, norm_w)
    slot.fn, slot.B, slot.dtype = _cpu_decode.model_function(cdt), B, cdt
    slot.nthreads, slot.training = torch.get_num_threads(), model.training
    slot.layout = lo = _Layout()
    lo.layers, lo.L, lo.B, lo.dtype, lo.vocab, lo.n_state, lo.n_win = layers, len(layers), B, cdt, vocab, s_off, w_off
    first = layers[0]
    lo.same = all(lay.kind == first.kind and lay.sshape == first.sshape and lay.wshape == first.wshape
                  and lay.sizes == first.sizes for lay in layers)
    lo.lin = [i for i, lay in enumerate(layers) if lay.kind == "linear"]
    lo.key = (B, cdt, vocab, tuple((lay.kind, lay.sshape, lay.wshape, lay.sizes and tuple(lay.sizes), lay.s_off,
                                    lay.w_off) for lay in layers))
    # the buffers' shapes (`_views`)
    lo.sbuf, lo.wbuf, lo.wmode = (s_off,), (w_off,), 0
    if lo.same:
        lo.sbuf = (lo.L,) + first.sshape
        if first.wshape is not None:
            C, KW = first.wshape[1:]
            lo.wmode = 1 if B == 1 and first.sizes[0] == first.sizes[2] else 2
            lo.wbuf = (3 * lo.L, 1, C // 3, KW) if lo.wmode == 1 else (lo.L,) + first.wshape
    slot.plan, slot.planref = mp, ctypes.byref(mp)
    return True


def _entries(lo: _Layout, lcs) -> list:
    """The cache entries a step reads, in a fixed order: per layer its state, then conv_q, conv_k, conv_v."""
    out = []
    for lay, lc in zip(lo.layers, lcs):
        out.append(lc.get("state"))
        if lay.wshape is not None:
            out += (lc.get("conv_q"), lc.get("conv_k"), lc.get("conv_v"))
    return out


def _gather(lo: _Layout, lcs, cdt):
    """(S_in, W_in, offsets) from cache entries that another path wrote (a prefill, the per-block step, a
    reorder or restore): fresh buffers in the plan's layout; (None, None, None) before the first token; None
    when an entry is missing or not this layer's (then the per-block path runs and reports it)."""
    states, wins, offs, empty = [], [], [], 0
    for lay, lc in zip(lo.layers, lcs):
        st = lc.get("state")
        conv = (lc.get("conv_q"), lc.get("conv_k"), lc.get("conv_v")) if lay.wshape is not None else ()
        if st is None and all(c is None for c in conv):
            empty += 1
            continue
        if st is None or any(c is None for c in conv):
            return None
        if lay.kind == "delta":
            if not (isinstance(st, torch.Tensor) and st.shape == lay.sshape and st.device.type == "cpu"):
                return None
            states.append(st)
        else:
            B, HV, Kf, V1 = lay.sshape
            if not (isinstance(st, LinearAttentionState) and st.log_scale is None
                    and st.kv.shape == (B, HV, Kf, V1 - 1) and st.z.shape == (B, HV, Kf)
                    and st.kv.device.type == "cpu" and st.offset.shape == (B,)):
                return None
            states.append(torch.cat([st.kv, st.z.unsqueeze(-1)], -1))
            offs.append(st.offset.to(torch.int64))
        if conv:
            B, _, W = lay.wshape
            if any(not isinstance(c, torch.Tensor) or c.shape != (B, n, W) for c, n in zip(conv, lay.sizes)):
                return None
            wins.append(torch.cat(conv, 1))
    if empty == len(lcs):
        return None, None, None
    if empty:
        return None
    S = torch.cat([s.to(cdt).reshape(-1) for s in states])
    W = torch.cat([w.to(cdt).reshape(-1) for w in wins]) if wins else None
    return S, W, (torch.stack(offs) if offs else None)


def _views(lo: _Layout, S: torch.Tensor, W: Optional[torch.Tensor], offsets: Optional[torch.Tensor]):
    """(states, convs): the cache entries of every layer as views of a step's buffers S (states, `lo.sbuf`) and W
    (windows, `lo.wbuf`) in as few view ops as possible; convs holds conv_q, conv_k, conv_v of every layer with a
    short convolution, in layer order. With every layer alike (`lo.same`) S is `[L, B, ...]`, and W `[3L, 1, C/3,
    KC-1]` (batch 1, q | k | v of one width: the same memory as `[L, 1, C, KC-1]`, so one unbind gives every conv
    entry) or `[L, B, C, KC-1]`."""
    lays = lo.layers
    if lo.same:
        lay = lays[0]
        if lay.kind == "delta":
            states = S.unbind(0)
        else:
            V = lay.V
            states = list(map(_linear_state_of, S[..., :V].unbind(0), S[..., V].unbind(0), offsets.unbind(0)))
        if W is None:
            return states, ()
        if lo.wmode == 1:
            return states, W.unbind(0)
        q, k, v = W.split_with_sizes(lay.sizes, dim=2)
        return states, [t for qkv in zip(q.unbind(0), k.unbind(0), v.unbind(0)) for t in qkv]
    states, convs, j = [], [], 0
    for lay in lays:
        Sl = S[lay.s_off:lay.s_off + math.prod(lay.sshape)].view(lay.sshape)
        if lay.kind == "delta":
            states.append(Sl)
        else:
            states.append(_linear_state_of(Sl[..., :lay.V], Sl[..., lay.V], offsets[j]))
            j += 1
        if lay.wshape is not None:
            convs += W[lay.w_off:lay.w_off + math.prod(lay.wshape)].view(lay.wshape).split_with_sizes(lay.sizes,
                                                                                                      dim=1)
    return states, convs


def _store(lo: _Layout, lcs, states, convs, n: int) -> list:
    """Stores `_views`' entries in the layers' caches (dict operations only) and advances their offsets by n
    tokens; returns the entries in the order of `_entries`."""
    out, j = [], 0
    for lay, lc, st in zip(lo.layers, lcs, states):
        lc["state"] = st
        out.append(st)
        if lay.wshape is not None:
            lc["conv_q"], lc["conv_k"], lc["conv_v"] = c = convs[j:j + 3]
            out += c
            j += 3
        o = lc.get("offset", 0)
        lc["offset"] = o + n if type(o) is int else lc.offset + n
        if lc.fast is not None:
            lc.fast = None   # the per-block step's views of the old entries
    return out


def _linear_state_of(kv, z, offset):
    return LinearAttentionState(kv=kv, z=z, log_scale=None, offset=offset)


def _mixer_caches(cache: Cache, L: int) -> list:
    layers = cache.layers
    try:
        return [d["mixer"] for d in layers]
    except KeyError:
        return [cache.layer(i, "mixer") for i in range(L)]


class ModelPending:
    """Tokens the whole-model step has run on a cache but not yet written into its layers' entries (`Cache.pending`):
    `buf` the buffer of the last one (every layer's new state, then the new conv windows: `_Layout`), `offsets` the
    linear layers' offsets `[n_linear, B]` before the first of them (None: zeros), `n` how many. While nothing reads
    the cache's layers between tokens, the next token reads `buf` directly, so a token makes no views and stores
    nothing; the first read of `Cache.layers` calls `apply`, which writes the entries as the token-by-token stores
    would have left them."""

    __slots__ = ("layout", "buf", "offsets", "n")

    def __init__(self, layout: _Layout, buf: torch.Tensor, offsets: Optional[torch.Tensor], n: int):
        self.layout, self.buf, self.offsets, self.n = layout, buf, offsets, n

    def apply(self, cache: Cache) -> None:
        lo, buf, n = self.layout, self.buf, self.n
        S = buf[:lo.n_state].view(lo.sbuf)
        W = buf[lo.n_state:].view(lo.wbuf) if lo.n_win else None
        offsets = None
        if lo.lin:
            offsets = (torch.full((len(lo.lin), lo.B), n, dtype=torch.int64) if self.offsets is None
                       else self.offsets + n)
        lcs = _mixer_caches(cache, lo.L)
        entries = _store(lo, lcs, *_views(lo, S, W, offsets), n)
        cache.fast = ModelFastState(entries, S, W, offsets, lo)


def model_step(model, ids: torch.Tensor, cache, logits_to_keep, block_type):
    """The hook point of a LanguageModel's forward (models/lm.py) for one decoded token per row, ids `[B, 1]`:
    the embedding, every block, the final norm and the head as ONE compiled call (csrc/decode.c,
    linattn_decode_model), the cache advanced as the per-block steps advance it. Returns (logits `[B, 1, vocab]`,
    the zero aux loss), or None where that does not cover the call (then forward runs as usual and finds the
    cache untouched): grad enabled, not a plain `Cache` or one with rollback, a block the per-block compiled step
    would not take (`block_step`, `_build_model_plan`), a hook, `model.compiled_decode = False`,
    `LINATTN_CPU_KERNELS=0`, a token id out of range, or cache entries that are not this model's.

    The plan is built once and checked on every token (`_model_plan_valid`). The new states and conv windows of
    all layers are one fresh buffer per token (never written in place: a copy of the cache may share the old
    ones). The cache's entries are written lazily (`ModelPending`): a token leaves its buffer in `Cache.pending`,
    the next token reads it from there, and the entries (views of the buffer) are made only when something reads
    `Cache.layers`. After that, while the entries are still those views, the next token reads the buffer
    directly (`ModelFastState` in `Cache.fast`), else it gathers the entries. The blocks' arithmetic is the
    per-block step's (bit for bit); the final norm and head are C loops (the logits agree with torch's to
    rounding)."""
    if (torch.is_grad_enabled() or type(cache) is not Cache or cache.rollback or not ids.is_cpu
            or type(logits_to_keep) is not int or logits_to_keep < 0 or not getattr(model, "compiled_decode", True)
            or torch.compiler.is_compiling() or not _cpu_decode.switched_on()):
        return None
    B = ids.shape[0]
    slot = model.__dict__.get("_model_plan")
    if slot is None:
        slot = model.__dict__["_model_plan"] = ModelPlanSlot()
    if slot.plan is None or not _model_plan_valid(slot, model, B):
        if not _build_model_plan(slot, model, B, block_type):
            return None
    lo = slot.layout
    pend = cache.pending
    if type(pend) is ModelPending and lo.fits(pend.layout) and len(cache._layers) == lo.L:
        # the last token's buffer, its entries not yet made: nobody has read the cache since
        buf_in, offsets, n = pend.buf, pend.offsets, pend.n + 1
        S_ptr = buf_in.data_ptr()
        W_ptr = S_ptr + lo.n_state * buf_in.element_size() if lo.n_win else None
    else:
        if len(cache.layers) != lo.L:   # (applies a pending step of another layout first)
            return None
        lcs = _mixer_caches(cache, lo.L)
        rec = cache.fast
        if type(rec) is ModelFastState and lo.fits(rec.layout) and all(map(operator.is_, _entries(lo, lcs),
                                                                             rec.entries)):
            S_in, W_in, offsets = rec.S, rec.W, rec.offsets
        else:
            got = _gather(lo, lcs, lo.dtype)
            if got is None:
                return None
            S_in, W_in, offsets = got
        buf_in, n = (S_in, W_in), 1
        S_ptr = None if S_in is None else S_in.data_ptr()
        W_ptr = None if W_in is None else W_in.data_ptr()
    if ids.dtype != torch.int64 or not ids.is_contiguous():
        ids = ids.to(torch.int64).contiguous()
    # every torch call before the compiled one: it streams all the weights through the caches, after which each
    # torch call costs several times more (its code and data are fetched again); the same for freeing the
    # previous step's buffers (`slot.spent` keeps them until the next token)
    slot.spent = None
    cdt = lo.dtype
    buf = torch.empty(lo.n_state + lo.n_win, dtype=cdt)
    logits = torch.empty(B, 1, lo.vocab, dtype=cdt)
    aux = torch.empty((), dtype=torch.float32)   # zeroed by the call (torch.zeros costs a fill kernel's code)
    out_ptr = buf.data_ptr()
    rc = slot.fn(slot.planref, ids.data_ptr(), S_ptr, W_ptr, out_ptr,
                 out_ptr + lo.n_state * buf.element_size() if lo.n_win else None, logits.data_ptr(), aux.data_ptr())
    if rc == 2:
        return None   # a token id out of range: forward's checks report it
    if rc:
        raise MemoryError("linattn: the compiled decoding step could not allocate its work buffer")
    slot.spent = buf_in
    cache.pending = ModelPending(lo, buf, offsets, n)
    cache.seen_tokens += 1
    return logits, aux
