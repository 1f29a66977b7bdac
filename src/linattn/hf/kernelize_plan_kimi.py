"""A kernelized transformers Kimi Linear decoded through the compiled decode plan: one call per token for the model.

`KimiLinearForCausalLM`'s KDA layers map onto the plan's KDA block (kind 4, `cpu/csrc/decode_kda.h`) with one
regrouping, made once when the plan is built:

* `q_proj | k_proj | v_proj | b_proj | forget_gate.f_a_proj | g_a_proj` fused into the plan's one first product
  `[q | k | v | b | f1 | g1]` (the forget gate's and the output gate's low-rank first stages among them);
* `conv1d` (depthwise over q | k | v, SiLU) as the plan's short convolution, its conv state kept as transformers';
* `forget_gate`: `f_b_proj` is the gate's second stage, `dt_bias` per key channel, `-exp(A_log)` per head, the
  softplus log-decay per key channel (transformers' threshold 20 is the plan's);
* beta = sigmoid(b), q / k L2-normalised (transformers' `x / sqrt(sum x^2 + 1e-6)`, fla's; the plan's "rsqrt" row
  agrees to rounding), scale `head_dim ** -0.5`;
* `o_norm` (per-head RMSNorm, then times sigmoid of the gate) with `g_b_proj` as the gate's second stage;
* the block norms and the final norm as they are (plain RMSNorm weights), `gate_proj | up_proj` concatenated once.

What the plan does not compute makes the whole model step aside (every cached token then runs transformers'
forward, as kernelize serves it; `describe_model` says why):

* an MLA layer (`KimiLinearAttention`, every real Kimi Linear checkpoint has them): its keys and values are the
  RMS-normalised latent `kv_a_layernorm(kv_a_proj(x))` expanded by `kv_b_proj`, a norm between the projection and
  the keys that the softmax block (kind 2: keys a projection of x, then a per-head norm over all channels) does
  not compute; a latent-attention block kind is needed;
* an MoE feed-forward (`KimiLinearMoE`: routed experts, not a plan block);
* another activation, conv bias, unequal head dims, modules that are not exactly transformers'.

So today the plan serves Kimi Linear models made of KDA layers and dense MLPs only. transformers' own cache of such
a model cannot report a sequence length (`DynamicCache.get_seq_length` raises without an attention layer), so its
`generate` and a plain cached forward fail on them; transformers' forward runs them given explicit `position_ids`
(which a model without attention layers does not read) and the per-layer-type masks as a dict
(`{"full_attention": None, "linear_attention": None}`), and so does the hook.

transformers' cache objects stay valid after every token: each KDA layer's recurrent state becomes a view of the
step's output buffer (a copy where the layer keeps another dtype), its conv state (the last K inputs; the plan keeps
K - 1) is shifted and copied. The hook steps aside for: grad enabled, torch.compile tracing, more than one token,
`inputs_embeds`, labels, no `position_ids` (transformers' forward then reports the missing length), an attention
mask with a zero (left padding; in a dict of masks, a "linear_attention" mask), a cache that is not a
`DynamicCache` of exactly these layers or that records its past, a hook on a described module, non-CPU tensors or
dtypes without a plan, `LINATTN_CPU_KERNELS=0`.
"""
from __future__ import annotations

import ctypes
import functools
import types
from typing import Optional, Union

import torch
import torch.nn as nn

from ..cpu import decode as _cpu_decode
from ..layers import fast_decode as _fast
from ..models import decode_plan as _dp

__all__ = ["MODELS", "describe_model", "hook_model", "model_token", "undescribed_reason"]

#: the transformers classes this module describes
MODELS = ("KimiLinearForCausalLM",)


class _Norm:
    """An RMSNorm as the plan reads it: `weight`, `eps`."""

    __slots__ = ("weight", "eps")

    def __init__(self, weight, eps):
        self.weight, self.eps = weight, float(eps)


class _Linear:
    """A projection the plan reads, fused from several of transformers' `nn.Linear`: `weight`, `bias` None."""

    __slots__ = ("weight", "bias", "in_features", "out_features")

    def __init__(self, weight):
        self.weight, self.bias = weight, None
        self.out_features, self.in_features = weight.shape


class _KDA:
    """A transformers `KimiLinearDeltaAttention` as the plan's KDA block reads it: the fused first product W."""

    __slots__ = ("layer", "H", "K", "KC", "W")

    def __init__(self, layer):
        self.layer, self.H, self.K, self.KC = layer, layer.num_heads, layer.head_dim, layer.conv_kernel_size
        m, fg = layer._modules, layer.forget_gate._modules
        self.W = torch.cat([w.weight.detach() for w in (m["q_proj"], m["k_proj"], m["v_proj"], m["b_proj"],
                                                         fg["f_a_proj"], m["g_a_proj"])])


def _plain(m, shape, wdt) -> bool:
    return type(m) is nn.Linear and m.bias is None and m.weight.dtype == wdt and tuple(m.weight.shape) == shape


def _kda_reason(layer, d: int, wdt) -> Optional[str]:
    """Why the plan's KDA block does not compute this layer, or None."""
    if type(layer).__name__ != "KimiLinearDeltaAttention":
        return f"an attention layer of type {type(layer).__name__} (MLA: no latent-attention block kind)"
    m = layer._modules
    fg = m.get("forget_gate")
    H, K, KC = layer.num_heads, layer.head_dim, layer.conv_kernel_size
    HK = H * K
    if type(fg).__name__ != "KimiLinearForgetGate" or fg.num_heads != H or fg.head_dim != K:
        return "a forget gate that is not transformers' KimiLinearForgetGate of the layer's heads"
    f = fg._modules
    shapes = {"q_proj": (HK, d), "k_proj": (HK, d), "v_proj": (HK, d), "b_proj": (H, d), "g_a_proj": (K, d),
              "g_b_proj": (HK, K), "o_proj": (d, HK)}
    if not all(_plain(m.get(n), s, wdt) for n, s in shapes.items()) or not (
            _plain(f.get("f_a_proj"), (K, d), wdt) and _plain(f.get("f_b_proj"), (HK, K), wdt)):
        return "projections that are not bias-free nn.Linear layers of the model's dtype and shapes"
    conv, norm = m.get("conv1d"), m.get("o_norm")
    if (type(conv) is not nn.Conv1d or conv.bias is not None or conv.weight.shape != (3 * HK, 1, KC)
            or conv.groups != 3 * HK or conv.weight.dtype != wdt or layer.activation not in ("silu", "swish")):
        return "a short convolution that is not a bias-free depthwise SiLU nn.Conv1d"
    if (type(norm).__name__ != "KimiLinearRMSNormGated" or getattr(norm, "activation", None) != "sigmoid"
            or norm.weight.shape != (K,)):
        return "an output norm that is not a per-head RMSNorm with a sigmoid gate"
    if fg.A_log.numel() != H or fg.dt_bias.shape != (HK,):
        return "A_log / dt_bias of unexpected shapes"
    return None


def _ffn(mlp: nn.Module, d: int, wdt):
    """(fused gate | up, down) of a dense SwiGLU MLP, or a reason string."""
    if type(mlp).__name__ != "KimiLinearMLP":
        return f"a {type(mlp).__name__} feed-forward (MoE: routed experts are not a plan block)"
    m = mlp._modules
    gate, up, down = m.get("gate_proj"), m.get("up_proj"), m.get("down_proj")
    hid = getattr(gate, "out_features", None)
    if hid is None or not (_plain(gate, (hid, d), wdt) and _plain(up, (hid, d), wdt) and _plain(down, (d, hid), wdt)):
        return "an MLP whose projections are not bias-free nn.Linear layers of the model's dtype"
    if getattr(mlp.config, "hidden_act", None) not in ("silu", "swish"):
        return "an MLP activation other than SiLU"
    return _Linear(torch.cat([gate.weight.detach(), up.weight.detach()])), down


def _describe(model: nn.Module) -> Union[tuple, str]:
    """(ModelDescription, per-layer `_KDA`) or the reason the plan does not compute the model."""
    if type(model).__name__ not in MODELS:
        return f"{type(model).__name__} is not one of {MODELS}"
    base = model.model
    embed = base.embed_tokens
    wdt = embed.weight.dtype
    cdt = _dp.compute_dtype(wdt)
    if cdt is None:
        return f"weights in {wdt} (the plan reads fp32, fp64, bf16)"
    d = embed.weight.shape[1]
    blocks, kdas = [], []
    for i, layer in enumerate(base.layers):
        mixer = layer.self_attn
        why = _kda_reason(mixer, d, wdt)
        ffn = _ffn(layer.mlp, d, wdt)
        if why is None and isinstance(ffn, str):
            why = ffn
        norms = [layer._modules.get(n) for n in ("input_layernorm", "post_attention_layernorm")]
        if why is None and any(type(n).__name__ != "KimiLinearRMSNorm" or n.weight.dtype != wdt for n in norms):
            why = "block norms that are not transformers' KimiLinearRMSNorm"
        if why is not None:
            return f"layer {i}: {why}"
        n1, n2 = (_Norm(n.weight, n.variance_epsilon) for n in norms)
        blocks.append(_dp.BlockDescription(mixer, "kda", n1, n2, "swiglu", ffn[0], ffn[1]))
        kdas.append(_KDA(mixer))
    norm = base.norm
    if type(norm).__name__ != "KimiLinearRMSNorm" or norm.weight.dtype != wdt:
        return "a final norm that is not transformers' KimiLinearRMSNorm"
    head = model.lm_head
    desc = _dp.ModelDescription(embed, blocks, None, None if head.weight is embed.weight else head)
    if not _dp.model_weights_usable(desc, wdt):   # (the final norm checked above: its eps is variance_epsilon)
        return "an embedding or head the plan does not read (a bias, another dtype, a hook)"
    desc.norm = _Norm(norm.weight, norm.variance_epsilon)
    return desc, kdas


def describe_model(model: nn.Module):
    """(ModelDescription, per-layer KDA description) of a transformers Kimi Linear model, or None where the plan
    does not compute some part of it (`undescribed_reason` says which)."""
    got = _describe(model)
    return None if isinstance(got, str) else got


def undescribed_reason(model: nn.Module) -> Optional[str]:
    """Why a Kimi Linear model does not decode through the compiled plan (an MLA layer, an MoE feed-forward, ...),
    or None when it does."""
    got = _describe(model)
    return got if isinstance(got, str) else None


def _kda_plan(k: _KDA, bd: _dp.BlockDescription, B: int, d: int, wdt: torch.dtype):
    """The plan's KDA block (kind 4) for a transformers KDA layer: y = [q | k | v | b | f1 | g1]."""
    layer, cdt, keep = k.layer, _dp.compute_dtype(wdt), []
    m, fg = layer._modules, layer.forget_gate
    addr = _dp.plan_addresser(keep, cdt)
    H, K = k.H, k.K
    p = _cpu_decode.BlockPlan(B=B, H=H, HV=H, K=K, V=K, d=d, ny=k.W.shape[0], KC=k.KC,
                              hid=bd.ffn_down.in_features, kind=4, conv_act=1, scale=K ** -0.5,
                              nthreads=max(1, torch.get_num_threads()), has_ffn=1, wbf16=int(wdt == torch.bfloat16),
                              rank_f=K, rank_g=K, gate_sig=1, l2eps=1e-6, l2conv=0)
    p.W = addr(k.W, wdt)
    conv = m["conv1d"].weight
    p.cw = addr(conv.view(conv.shape[0], -1))
    p.Wf = addr(fg._modules["f_b_proj"].weight, wdt)
    p.Wg2 = addr(m["g_b_proj"].weight, wdt)
    p.neg_a = addr(-torch.exp(fg.A_log.detach().to(cdt)).reshape(H))
    p.dt_bias = addr(fg.dt_bias)
    norm = m["o_norm"]
    p.has_norm, p.nw, p.norm_eps, p.has_gate = 1, addr(norm.weight), float(norm.variance_epsilon), 1
    p.Wo = addr(m["o_proj"].weight, wdt)
    return _dp.finish_block_plan(p, bd, addr, keep, wdt)


class _Slot:
    """The model's plan (`cpu/decode.ModelPlan`), its guard, the layouts per batch size and what it points into.
    Not state: a copy or a pickle gets an empty slot."""

    __slots__ = ("plan", "fn", "guard", "keep", "specs", "layouts", "B", "layout", "cdt", "wdt", "kdas", "failed")

    def __init__(self):
        self.plan, self.failed = None, None

    def __reduce__(self):
        return (_Slot, ())


def _described_modules(model: nn.Module) -> list:
    # every module but the model and its base model, whose own hooks run in their __call__ (kernelize's packing
    # hooks on the base model among them: they do nothing for a cached token)
    return [m for m in model.modules() if m is not model and m is not model.model]


def _build(slot: _Slot, model: nn.Module, B: int) -> bool:
    slot.plan = None
    got = describe_model(model)
    if got is None:
        return False
    desc, kdas = got
    wdt = desc.embed.weight.dtype
    vocab, d = desc.embed.weight.shape
    plans = []
    for bd, k in zip(desc.blocks, kdas):
        if _fast.hooked(*bd.mixer.modules()):
            return False
        plans.append(_kda_plan(k, bd, B, d, wdt))
    cdt = _dp.compute_dtype(wdt)
    mp = _cpu_decode.ModelPlan(L=len(plans), B=B, d=d, vocab=vocab, has_norm=1,
                               nthreads=max(1, torch.get_num_threads()), wbf16=int(wdt == torch.bfloat16),
                               norm_eps=desc.norm.eps)
    head_w = (desc.head if desc.head is not None else desc.embed).weight.detach()
    norm_w = desc.norm.weight.detach().to(cdt).contiguous()
    mp.embed, mp.head, mp.norm_w = desc.embed.weight.data_ptr(), head_w.data_ptr(), norm_w.data_ptr()
    block_ptrs = (ctypes.c_void_p * len(plans))(*[ctypes.addressof(p) for p in plans])
    mp.blocks = ctypes.addressof(block_ptrs)
    direct = {mp.embed, mp.head, mp.norm_w} | {getattr(p, f) for p in plans for f in _dp.PLAN_POINTERS}
    slot.guard = _dp.PlanGuard(model.model, _described_modules(model), [], direct)
    if not slot.guard.valid() or any(t.device.type != "cpu" for t in slot.guard.tensors):
        return False
    slot.keep = (plans, block_ptrs, head_w, norm_w)
    slot.plan, slot.fn, slot.cdt, slot.wdt = mp, _cpu_decode.model_function(cdt), cdt, wdt
    slot.specs = [("delta", k.H, k.K, k.K, k.KC, (k.H * k.K,) * 3) for k in kdas]
    slot.layouts, slot.B, slot.kdas = {}, None, kdas
    _set_batch(slot, B)
    return True


def _set_batch(slot: _Slot, B: int) -> None:
    got = slot.layouts.get(B)
    if got is None:
        lo = _dp.state_layout(slot.specs, B, slot.cdt, slot.plan.vocab)
        got = slot.layouts[B] = (lo, ((ctypes.c_int64 * lo.L)(*[lay.s_off for lay in lo.layers]),
                                      (ctypes.c_int64 * lo.L)(*[lay.w_off for lay in lo.layers])))
    lo, offs = got
    slot.plan.B = B
    for p in slot.keep[0]:
        p.B = B
    slot.plan.s_off, slot.plan.w_off = ctypes.addressof(offs[0]), ctypes.addressof(offs[1])
    slot.B, slot.layout = B, lo


def model_token(model: nn.Module, input_ids, cache, attention_mask, position_ids) -> Optional[torch.Tensor]:
    """The logits `[B, 1, vocab]` of one decoded token per row through the compiled plan, `cache` (a transformers
    `DynamicCache` holding the prompt) advanced as transformers' forward would; None where the plan does not
    cover the call (module docstring), the cache untouched."""
    if (torch.is_grad_enabled() or torch.compiler.is_compiling() or not _cpu_decode.switched_on()
            or not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[1] != 1
            or not input_ids.is_cpu or input_ids.dtype not in (torch.int64, torch.int32)
            or not isinstance(position_ids, torch.Tensor)):
        return None
    from transformers.cache_utils import DynamicCache, LinearAttentionLayer
    if type(cache) is not DynamicCache:
        return None
    B = input_ids.shape[0]
    if type(attention_mask) is dict:   # (the per-layer-type masks transformers' forward takes as they are)
        attention_mask = attention_mask.get("linear_attention", 0)
    if attention_mask is not None and not (isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2
                                           and attention_mask.shape[0] == B and bool(attention_mask.all())):
        return None   # (left padding: transformers' masked path)
    slot = model.__dict__.get("_linattn_model_plan")
    if type(slot) is not _Slot:
        slot = model.__dict__["_linattn_model_plan"] = _Slot()
    if slot.plan is None or not slot.guard.valid():
        if slot.failed is not None and slot.failed.valid():
            return None   # (nothing changed since the plan could not be built)
        mods = _described_modules(model)
        if _fast.hooked(*mods):
            return None   # (before the copies a build makes: a hooked model would make them on every token)
        if not _build(slot, model, B):
            slot.failed = _dp.PlanGuard(model.model, mods, [], ())
            return None
        slot.failed = None
    elif slot.B != B:
        _set_batch(slot, B)
    layers, lo = cache.layers, slot.layout
    if len(layers) != lo.L:
        return None
    S_parts, W_parts = [], []
    for c, k, lay in zip(layers, slot.kdas, lo.layers):
        if type(c) is not LinearAttentionLayer or c.record_past or not c.has_previous_state[0]:
            return None
        rs, cs = c.recurrent_states[0], c.conv_states[0]
        if (not isinstance(rs, torch.Tensor) or not isinstance(cs, torch.Tensor) or rs.shape != lay.sshape
                or cs.shape != (B, lay.wshape[1], k.KC) or not (rs.is_cpu and cs.is_cpu)):
            return None
        S_parts.append(rs)
        W_parts.append(cs)
    cdt = slot.cdt
    # the states in the plan's layout: in place when they are the views the last token left, else gathered
    prev = cache.__dict__.get("_linattn_states")
    if prev is not None and prev[0] is lo and all(map(lambda a, b: a is b, S_parts, prev[1])):
        S_in = prev[2]
    else:
        S_in = torch.cat([s.to(cdt).reshape(-1) for s in S_parts])
    W_in = torch.cat([w[..., 1:].to(cdt).reshape(-1) for w in W_parts])
    ids = input_ids if input_ids.dtype == torch.int64 and input_ids.is_contiguous() else \
        input_ids.to(torch.int64).contiguous()
    buf = torch.empty(lo.n_state + lo.n_win, dtype=cdt)
    logits = torch.empty(B, 1, lo.vocab, dtype=slot.wdt)
    out = buf.data_ptr()
    rc = slot.fn(ctypes.byref(slot.plan), ids.data_ptr(), S_in.data_ptr(), W_in.data_ptr(), out,
                 out + lo.n_state * buf.element_size(), logits.data_ptr(), None)
    if rc == 2:
        return None   # a token id out of range: transformers' embedding reports it
    if rc:
        raise MemoryError("linattn: the compiled decoding step could not allocate its work buffer")
    # transformers' cache: states as views of the new buffer (a copy where the layer keeps another dtype), conv
    # states shifted by one column
    S_new, views = buf[:lo.n_state], []
    for c, k, lay in zip(layers, slot.kdas, lo.layers):
        st = S_new[lay.s_off:lay.s_off + B * k.H * k.K * k.K].view(lay.sshape)
        if c.recurrent_states[0].dtype == cdt:
            c.recurrent_states[0] = st
        else:
            c.recurrent_states[0].copy_(st)
        views.append(c.recurrent_states[0])
        cs = c.conv_states[0]
        cs[..., :1].copy_(cs[..., 1:2])
        cs[..., 1:].copy_(buf[lo.n_state + lay.w_off:lo.n_state + lay.w_off + B * lay.wshape[1] * (k.KC - 1)]
                          .view(lay.wshape))
    cache.__dict__["_linattn_states"] = (lo, views, S_new)
    return logits


_FAST_KWARGS = frozenset({"input_ids", "attention_mask", "position_ids", "cache", "past_key_values", "use_cache",
                          "logits_to_keep", "return_dict", "output_attentions", "output_hidden_states"})

_HOOKED_FORWARDS: dict = {}   # model class -> its forward with the decode hook in front


def _hooked_forward(cls: type):
    fn = _HOOKED_FORWARDS.get(cls)
    if fn is not None:
        return fn
    from transformers.modeling_outputs import MoeCausalLMOutputWithPast
    inner = cls.forward

    @functools.wraps(inner)   # (inspect.signature follows __wrapped__: the class forward's exact signature)
    def forward(self, *args, **kwargs):
        if torch.compiler.is_compiling() or len(args) > 1 or (args and "input_ids" in kwargs):
            return inner(self, *args, **kwargs)
        if args:
            kwargs["input_ids"] = args[0]
        if (kwargs.keys() <= _FAST_KWARGS and kwargs.get("use_cache", True) is not False
                and kwargs.get("return_dict", True) is not False and not kwargs.get("output_attentions")
                and not kwargs.get("output_hidden_states") and type(kwargs.get("logits_to_keep", 0)) is int):
            cache = kwargs.get("cache", kwargs.get("past_key_values"))
            logits = model_token(self, kwargs.get("input_ids"), cache, kwargs.get("attention_mask"),
                                 kwargs.get("position_ids"))
            if logits is not None:
                return MoeCausalLMOutputWithPast(logits=logits, cache=cache)
        return inner(self, **kwargs)

    fn = _HOOKED_FORWARDS[cls] = forward
    return fn


def hook_model(model: nn.Module) -> bool:
    """Gives a Kimi Linear model the plan describes (`describe_model`) the decode hook: an instance `forward` (a
    method bound to the model, so a deep copy is bound to the copy) with the class forward's signature that decodes
    a cached one-token call through the compiled plan (`model_token`) and runs transformers' forward otherwise.
    Returns whether the model is hooked (False with an MLA layer or an MoE feed-forward: `undescribed_reason`)."""
    if type(model).__name__ not in MODELS:
        return False
    fn = _hooked_forward(type(model))
    own = model.__dict__.get("forward")
    if own is not None:
        return getattr(own, "__func__", None) is fn
    if describe_model(model) is None or not _cpu_decode.available():
        return False
    model.forward = types.MethodType(fn, model)
    return True
