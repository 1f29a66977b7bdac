"""A kernelized transformers Mamba2 decoded through the compiled decode plan: one call per token for the model.

`Mamba2ForCausalLM`'s blocks (`norm` -> `Mixer` -> residual, no feed-forward) map onto the plan's Mamba2 block
(kind 5, `cpu/csrc/decode_mamba2.h`) as they are: `in_proj` is the plan's `[z | xBC | dt]` product (read in place,
its bias too), `conv1d` the short convolution over xBC (SiLU, its bias), `-exp(A_log)` / `dt_bias` / `D` per head,
groups of B / C shared by H / G heads, the gated norm `RMSNorm_groups(y * silu(z))` (transformers'
`MambaRMSNormGated`), `out_proj`. The final norm `norm_f`, the head (tied or not); the logits are returned in fp32,
as transformers' forward returns them.

What the plan does not compute makes the whole model step aside (every cached token then runs transformers'
forward, as kernelize serves it; `undescribed_reason` says why): an `in_proj` with extra MLP rows (`d_mlp` > 0), a
`time_step_limit` other than (0, inf) (transformers clamps dt in its chunked prefill but not in its one-token step;
the plan would clamp both), an activation other than SiLU, modules that are not exactly transformers'.

transformers' cache stays valid after every token: the plan's state is `[N, P + 1]` per head (linear attention's
kv | z, z unused by Mamba2's output) where transformers keeps `[P, N]`, so each token gathers the states transposed
(z zero) and copies the new ones back in place (`H P N` values per layer and row, the layer's own tensors: their
static addresses kept); the conv state (the last K inputs; the plan keeps K - 1) is shifted and copied. The hook
steps aside for: grad enabled, torch.compile tracing, more than one token, `inputs_embeds`, labels, an attention
mask with a zero (left padding), a cache that is not a `DynamicCache` of these layers or that records its past, a
hook on a described module, non-CPU tensors or dtypes without a plan, `LINATTN_CPU_KERNELS=0`.
"""
from __future__ import annotations

import ctypes
import functools
import math
import types
from typing import Optional, Union

import torch
import torch.nn as nn

from ..cpu import decode as _cpu_decode
from ..layers import fast_decode as _fast
from ..models import decode_plan as _dp

__all__ = ["MODELS", "describe_model", "hook_model", "model_token", "undescribed_reason"]

#: the transformers classes this module describes
MODELS = ("Mamba2ForCausalLM",)


class _Norm:
    """An RMSNorm as the plan reads it: `weight`, `eps`."""

    __slots__ = ("weight", "eps")

    def __init__(self, weight, eps):
        self.weight, self.eps = weight, float(eps)


def _linear(m, shape, wdt) -> bool:
    return (type(m) is nn.Linear and m.weight.dtype == wdt and tuple(m.weight.shape) == shape
            and (m.bias is None or m.bias.dtype == wdt))


def _mixer_reason(mx, d: int, wdt) -> Optional[str]:
    """Why the plan's Mamba2 block does not compute this mixer, or None."""
    if type(mx).__name__ != "Mamba2Mixer":
        return f"a mixer of type {type(mx).__name__}"
    H, P, G, N, KC = mx.num_heads, mx.head_dim, mx.n_groups, mx.ssm_state_size, mx.conv_kernel_size
    DI, CD = mx.intermediate_size, mx.conv_dim
    m = mx._modules
    if DI != H * P or H % G or CD != DI + 2 * G * N:
        return "heads, groups or widths the plan does not lay out (intermediate != heads x head_dim)"
    if not (_linear(m.get("in_proj"), (DI + CD + H, d), wdt) and _linear(m.get("out_proj"), (d, DI), wdt)):
        return "an in_proj with extra rows (d_mlp > 0) or projections that are not nn.Linear of the model's dtype"
    conv, norm = m.get("conv1d"), m.get("norm")
    if (type(conv) is not nn.Conv1d or conv.weight.shape != (CD, 1, KC) or conv.groups != CD
            or conv.weight.dtype != wdt or mx.activation not in ("silu", "swish")):
        return "a short convolution that is not a depthwise SiLU nn.Conv1d"
    if type(norm).__name__ != "MambaRMSNormGated" or norm.weight.shape != (DI,) or norm.group_size != DI // G:
        return "an output norm that is not transformers' MambaRMSNormGated over the groups"
    if tuple(float(x) for x in mx.time_step_limit) != (0.0, math.inf):
        return "a time_step_limit other than (0, inf) (transformers' one-token step does not clamp dt)"
    if mx.A_log.shape != (H,) or mx.dt_bias.shape != (H,) or mx.D.shape != (H,):
        return "A_log / dt_bias / D of unexpected shapes"
    return None


def _describe(model: nn.Module) -> Union[tuple, str]:
    """(ModelDescription, per-layer mixer) or the reason the plan does not compute the model."""
    if type(model).__name__ not in MODELS:
        return f"{type(model).__name__} is not one of {MODELS}"
    base = model.backbone
    embed = base.embeddings
    wdt = embed.weight.dtype
    if _dp.compute_dtype(wdt) is None:
        return f"weights in {wdt} (the plan reads fp32, fp64, bf16)"
    d = embed.weight.shape[1]
    blocks, mixers = [], []
    for i, block in enumerate(base.layers):
        mx, norm = block._modules.get("mixer"), block._modules.get("norm")
        why = _mixer_reason(mx, d, wdt)
        if why is None and (type(block).__name__ != "Mamba2Block" or type(norm).__name__ != "Mamba2RMSNorm"
                            or norm.weight.dtype != wdt):
            why = "a block that is not transformers' Mamba2Block with its Mamba2RMSNorm"
        if why is not None:
            return f"layer {i}: {why}"
        blocks.append(_dp.BlockDescription(mx, "mamba2", _Norm(norm.weight, norm.variance_epsilon)))
        mixers.append(mx)
    norm = base.norm_f
    if type(norm).__name__ != "Mamba2RMSNorm" or norm.weight.dtype != wdt:
        return "a final norm that is not transformers' Mamba2RMSNorm"
    head = model.lm_head
    desc = _dp.ModelDescription(embed, blocks, None, None if head.weight is embed.weight else head)
    if not _dp.model_weights_usable(desc, wdt):   # (the final norm checked above: its eps is variance_epsilon)
        return "an embedding or head the plan does not read (a bias, another dtype, a hook)"
    desc.norm = _Norm(norm.weight, norm.variance_epsilon)
    return desc, mixers


def describe_model(model: nn.Module):
    """(ModelDescription, per-layer mixer) of a transformers Mamba2 model, or None where the plan does not compute
    some part of it (`undescribed_reason` says which)."""
    got = _describe(model)
    return None if isinstance(got, str) else got


def undescribed_reason(model: nn.Module) -> Optional[str]:
    """Why a Mamba2 model does not decode through the compiled plan, or None when it does."""
    got = _describe(model)
    return got if isinstance(got, str) else None


def _mamba2_plan(mx, bd: _dp.BlockDescription, B: int, d: int, wdt: torch.dtype):
    """The plan's Mamba2 block (kind 5) for a transformers Mamba2 mixer."""
    cdt, keep, m = _dp.compute_dtype(wdt), [], mx._modules
    addr = _dp.plan_addresser(keep, cdt)
    H, P, G, N, CD = mx.num_heads, mx.head_dim, mx.n_groups, mx.ssm_state_size, mx.conv_dim
    p = _cpu_decode.BlockPlan(B=B, H=H, HV=H, K=N, V=P, d=d, ny=H * P + CD + H, KC=mx.conv_kernel_size, hid=0,
                              kind=5, conv_act=1, nthreads=max(1, torch.get_num_threads()), has_ffn=0,
                              wbf16=int(wdt == torch.bfloat16), n_groups=G, d_per_channel=0, dt_lo=0.0,
                              dt_hi=math.inf, norm_mode=1)
    inp, out, conv, norm = m["in_proj"], m["out_proj"], m["conv1d"], m["norm"]
    p.W, p.Wb = addr(inp.weight, wdt), addr(inp.bias)
    p.cw, p.cb = addr(conv.weight.detach().view(CD, -1)), addr(conv.bias)
    p.neg_a = addr(-torch.exp(mx.A_log.detach().to(cdt)))
    p.dt_bias, p.Dsk = addr(mx.dt_bias), addr(mx.D)
    p.nw, p.norm_eps = addr(norm.weight), float(norm.variance_epsilon)
    p.Wo, p.bo = addr(out.weight, wdt), addr(out.bias)
    return _dp.finish_block_plan(p, bd, addr, keep, wdt)


class _Slot:
    """The model's plan (`cpu/decode.ModelPlan`), its guard, the layouts per batch size and what it points into.
    Not state: a copy or a pickle gets an empty slot."""

    __slots__ = ("plan", "fn", "guard", "keep", "specs", "layouts", "B", "layout", "cdt", "wdt", "mixers", "failed")

    def __init__(self):
        self.plan, self.failed = None, None

    def __reduce__(self):
        return (_Slot, ())


def _described_modules(model: nn.Module) -> list:
    # every module but the model and its backbone, whose own hooks run in their __call__
    return [m for m in model.modules() if m is not model and m is not model.backbone]


def _build(slot: _Slot, model: nn.Module, B: int) -> bool:
    slot.plan = None
    got = describe_model(model)
    if got is None:
        return False
    desc, mixers = got
    wdt = desc.embed.weight.dtype
    vocab, d = desc.embed.weight.shape
    plans = []
    for bd, mx in zip(desc.blocks, mixers):
        if _fast.hooked(*bd.mixer.modules()):
            return False
        plans.append(_mamba2_plan(mx, bd, B, d, wdt))
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
    slot.guard = _dp.PlanGuard(model.backbone, _described_modules(model), [], direct)
    if not slot.guard.valid() or any(t.device.type != "cpu" for t in slot.guard.tensors):
        return False
    slot.keep = (plans, block_ptrs, head_w, norm_w)
    slot.plan, slot.fn, slot.cdt, slot.wdt = mp, _cpu_decode.model_function(cdt), cdt, wdt
    slot.specs = [("linear", mx.num_heads, mx.ssm_state_size, mx.head_dim, mx.conv_kernel_size, (mx.conv_dim,),
                   ("conv",)) for mx in mixers]
    slot.layouts, slot.B, slot.mixers = {}, None, mixers
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


def model_token(model: nn.Module, input_ids, cache, attention_mask) -> Optional[torch.Tensor]:
    """The fp32 logits `[B, 1, vocab]` of one decoded token per row through the compiled plan, `cache` (a
    transformers `DynamicCache` holding the prompt) advanced as transformers' forward would; None where the plan
    does not cover the call (module docstring), the cache untouched."""
    if (torch.is_grad_enabled() or torch.compiler.is_compiling() or not _cpu_decode.switched_on()
            or not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[1] != 1
            or not input_ids.is_cpu or input_ids.dtype not in (torch.int64, torch.int32)):
        return None
    from transformers.cache_utils import DynamicCache, LinearAttentionLayer
    if type(cache) is not DynamicCache:
        return None
    B = input_ids.shape[0]
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
            slot.failed = _dp.PlanGuard(model.backbone, mods, [], ())
            return None
        slot.failed = None
    elif slot.B != B:
        _set_batch(slot, B)
    layers, lo = cache.layers, slot.layout
    if len(layers) != lo.L:
        return None
    cdt, S_parts, W_parts = slot.cdt, [], []
    for c, mx, lay in zip(layers, slot.mixers, lo.layers):
        if type(c) is not LinearAttentionLayer or c.record_past or not c.has_previous_state[0]:
            return None
        rs, cs = c.recurrent_states[0], c.conv_states[0]
        _, H, N, P1 = lay.sshape
        if (not isinstance(rs, torch.Tensor) or not isinstance(cs, torch.Tensor) or rs.shape != (B, H, P1 - 1, N)
                or cs.shape != (B, lay.wshape[1], mx.conv_kernel_size) or not (rs.is_cpu and cs.is_cpu)):
            return None
        S_parts.append(rs)
        W_parts.append(cs)
    # the states in the plan's layout [B, H, N, P + 1]: transposed, the unused z column zero
    S_in = torch.zeros(lo.n_state, dtype=cdt)
    for rs, lay in zip(S_parts, lo.layers):
        S_in[lay.s_off:lay.s_off + math.prod(lay.sshape)].view(lay.sshape)[..., :-1].copy_(rs.transpose(-1, -2))
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
    for c, mx, lay in zip(layers, slot.mixers, lo.layers):
        st = buf[lay.s_off:lay.s_off + math.prod(lay.sshape)].view(lay.sshape)
        c.recurrent_states[0].copy_(st[..., :-1].transpose(-1, -2))
        cs, KC = c.conv_states[0], mx.conv_kernel_size
        cs[..., :1].copy_(cs[..., 1:2])
        cs[..., 1:].copy_(buf[lo.n_state + lay.w_off:lo.n_state + lay.w_off + B * lay.wshape[1] * (KC - 1)]
                          .view(lay.wshape))
    return logits.float()


_FAST_KWARGS = frozenset({"input_ids", "attention_mask", "cache", "past_key_values", "use_cache", "logits_to_keep",
                          "return_dict", "output_hidden_states"})

_HOOKED_FORWARDS: dict = {}   # model class -> its forward with the decode hook in front


def _hooked_forward(cls: type):
    fn = _HOOKED_FORWARDS.get(cls)
    if fn is not None:
        return fn
    from transformers.models.mamba2.modeling_mamba2 import Mamba2CausalLMOutput
    inner = cls.forward

    @functools.wraps(inner)   # (inspect.signature follows __wrapped__: the class forward's exact signature)
    def forward(self, *args, **kwargs):
        if torch.compiler.is_compiling() or len(args) > 1 or (args and "input_ids" in kwargs):
            return inner(self, *args, **kwargs)
        if args:
            kwargs["input_ids"] = args[0]
        if (kwargs.keys() <= _FAST_KWARGS and kwargs.get("use_cache", True) is not False
                and kwargs.get("return_dict", True) is not False and not kwargs.get("output_hidden_states")
                and type(kwargs.get("logits_to_keep", 0)) is int):
            cache = kwargs.get("cache", kwargs.get("past_key_values"))
            logits = model_token(self, kwargs.get("input_ids"), cache, kwargs.get("attention_mask"))
            if logits is not None:
                return Mamba2CausalLMOutput(logits=logits, cache=cache)
        return inner(self, **kwargs)

    fn = _HOOKED_FORWARDS[cls] = forward
    return fn


def hook_model(model: nn.Module) -> bool:
    """Gives a Mamba2 model the plan describes (`describe_model`) the decode hook: an instance `forward` (a method
    bound to the model, so a deep copy is bound to the copy) with the class forward's signature that decodes a
    cached one-token call through the compiled plan (`model_token`) and runs transformers' forward otherwise.
    Returns whether the model is hooked."""
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
