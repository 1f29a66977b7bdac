"""A kernelized transformers model decoded through the compiled decode plan: one call per token for the whole model.

`kernelize` serves the linear mixers of a transformers model with linattn's operators, but a decoded token still
runs one transformers module at a time (most of it torch's one-row `nn.Linear`). For the models described here
(`Qwen3_5ForCausalLM`, `Qwen3_5MoeForCausalLM` and `Qwen3NextForCausalLM`: Gated DeltaNet and gated softmax
attention, zero-centred RMSNorms, SwiGLU MLPs or sparse mixtures of experts with a gated shared expert), the
model's `forward` is given a hook (`hook_model`, an instance attribute with the class forward's signature) that
decodes one token per row as ONE compiled call (`cpu/csrc/decode.c`, `linattn_decode_model`), built by
`models/decode_plan.py` from a description of transformers' own modules:

* the GDN layer: `in_proj_qkv | in_proj_b | in_proj_a | in_proj_z` read in place as the parts of the plan's
  `[q | k | v | b | a | gate]` projection (Qwen3-Next: `in_proj_qkvz`, `in_proj_ba`, rows grouped per key head,
  regrouped once into a copy), the
  depthwise `conv1d`, `A_log` / `dt_bias`, the gated output RMSNorm;
* the attention: `decode_plan.AttentionDescription` (q-interleaved sigmoid gate, `1 + w` q/k norms, partial
  rotary with fp32 angles);
* the block norms and the final norm: zero-centred, so `1 + w` is precomputed into the plan; `gate_proj` and
  `up_proj` read in place as the two parts of one product; the head tied or not;
* a sparse MoE block (`kernelize_plan_parts.qwen_sparse_moe`): the router's weight and the experts' fused 3-D
  `gate_up_proj` / `down_proj` read in place (a token reads its top-k experts' rows only), the shared expert's
  gate | up read in place as parts, its sigmoid gate.

Quantized projections (`linattn.quantize`: int8 / int4 `QuantizedLinear`s) are read as stored wherever the plan reads
a matrix: one layer's integers and scales in place, a fused product's parts stacked or regrouped once into a copy
(`kernelize_plan_parts.plan_projection`, `fused_linear`).

Copies (`1 + w`, `-exp(A_log)`, Qwen3-Next's regrouped projections) are guarded by the versions of their sources
(`decode_plan.PlanGuard`): an in-place weight update rebuilds the plan.

transformers' cache objects stay valid after every token, each written on that token:
* a GDN layer's recurrent state becomes a view of the step's output buffer (a dict assignment, no copy; made once
  per buffer, two alternating); its conv state (the last K inputs, where the plan keeps K - 1) is read and
  advanced in place by the compiled call (`[old[1:] | x]`, fp32 / fp64 states), else shifted and copied after it;
* a softmax layer's `keys` / `values` become `[B, KV heads, T, D]` views (permuted, no copy) of a buffer of
  linattn's `[B, T, KV heads, D]` layout into which the compiled call writes the new row; it is reused while the
  layer still holds the views of the last token, else rebuilt from what the layer holds (a crop, a reorder, a
  cache filled by transformers' own code).

The hook steps aside (transformers' forward runs, the cache untouched) for anything it does not compute: grad
enabled, torch.compile tracing, more than one token, `inputs_embeds`, labels, an attention mask with a zero (left
padding), position ids that are not the cache length, a cache that is not a `DynamicCache` of exactly these
layer types or that records its past (speculative decoding), a hook on a described module, non-CPU or dtypes
without a plan, `LINATTN_CPU_KERNELS=0`.

Other architectures are described in their own modules (hf/kernelize_plan_kimi.py, hf/kernelize_plan_mamba2.py,
hf/kernelize_plan_olmo.py, hf/kernelize_plan_bailing.py, hf/kernelize_plan_bamba.py, hf/kernelize_plan_minimax.py;
what descriptions share: hf/kernelize_plan_parts.py); this
module holds what every described model runs: the hooked forward, the plan slot and its guard, the batch switch, the
cache checks and writes (`_ARCHITECTURES`).
"""
from __future__ import annotations

import ctypes
import functools
import importlib
import math
import operator
import os
import pkgutil
import sys
import types
import weakref
from typing import Optional, Union

import torch
import torch.nn as nn

from ..cpu import decode as _cpu_decode, hugepages as _hugepages
from ..layers import fast_decode as _fast
from ..layers.cache import KVCache
from ..models import decode_plan as _dp
from . import kernelize_plan_parts as _parts

__all__ = ["describe_model", "hook_model", "model_token"]

_KV_CHUNK = _parts.KV_CHUNK


def _zero_centred(norm: nn.Module, cdt: torch.dtype):
    return _parts.norm(norm.weight.detach().to(cdt) + 1, norm.eps)


#: the GDN projections of each described architecture, in the order `_GDN` reads them
_GDN_PROJECTIONS = {
    "Qwen3_5ForCausalLM": ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"),
    "Qwen3NextForCausalLM": ("in_proj_qkvz", "in_proj_ba", "out_proj"),
    "Qwen3_5MoeForCausalLM": ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"),
}


#: the projections of each described architecture's plan rows `[q | k | v | b | a | z]`, in the order they stack
_GDN_FUSED = {"Qwen3_5ForCausalLM": ("in_proj_qkv", "in_proj_b", "in_proj_a", "in_proj_z"),
              "Qwen3NextForCausalLM": ("in_proj_qkvz", "in_proj_ba"),
              "Qwen3_5MoeForCausalLM": ("in_proj_qkv", "in_proj_b", "in_proj_a", "in_proj_z")}


class _GDN:
    """A transformers Gated DeltaNet layer as the plan's delta block needs it: its projections with the plan's rows
    `[q | k | v | b | a | z]` (`W`: Qwen3.5's four projections read in place; Qwen3-Next's regrouped once into a
    copy, its rows interleave per key head; quantized ones: their integers and scales stacked or regrouped alike,
    `kernelize_plan_parts.fused_linear`)."""

    __slots__ = ("layer", "H", "HV", "K", "V", "KC", "W")

    def __init__(self, layer, arch: str):
        self.layer, self.H, self.HV = layer, layer.num_k_heads, layer.num_v_heads
        self.K, self.V, self.KC = layer.head_k_dim, layer.head_v_dim, layer.conv_kernel_size
        lins = [layer._modules[n] for n in _GDN_FUSED[arch]]
        self.W = _parts.fused_linear(*lins, rows=self._regrouped() if arch == "Qwen3NextForCausalLM" else None)

    def _regrouped(self) -> torch.Tensor:
        """Qwen3-Next's fused projections hold their rows per key head h: `[q_h (K) | k_h (K) | v (r V) | z (r V)]`
        and `[b (r) | a (r)]` with r = HV / H value heads per key head (value head h r + j, as its
        `fix_query_key_value_ordering` splits them); the plan reads every q, then every k, v, b, a, z: the index of
        each of the plan's rows in `in_proj_qkvz`'s rows followed by `in_proj_ba`'s."""
        H, K, V, r = self.H, self.K, self.V, self.HV // self.H
        n = 2 * K + 2 * r * V
        g = torch.arange(H * n).view(H, n)
        q, k, v, z = torch.split(g, [K, K, r * V, r * V], dim=1)
        b, a = torch.split(H * n + torch.arange(H * 2 * r).view(H, 2 * r), [r, r], dim=1)
        return torch.cat([x.reshape(-1) for x in (q, k, v, b, a, z)])


def _gdn_usable(layer, arch: str, wdt) -> bool:
    m = layer._modules
    lins = [m.get(n) for n in _GDN_PROJECTIONS[arch]]
    conv, norm = m.get("conv1d"), m.get("norm")
    HV, H = layer.num_v_heads, layer.num_k_heads
    return (all(_dp.plan_linear(x, wdt) and x.bias is None for x in lins)
            and _parts.fusion_reason(*(m[n] for n in _GDN_FUSED[arch])) is None
            and type(conv) is nn.Conv1d and conv.bias is None and layer.activation in ("silu", "swish")
            and conv.weight.shape == (layer.conv_dim, 1, layer.conv_kernel_size)
            and type(norm).__name__.endswith("RMSNormGated") and getattr(norm, "activation", None) == "silu"
            and HV % H == 0 and lins[0].out_features == (2 * H * layer.head_k_dim + HV * layer.head_v_dim
                                                         * (2 if arch == "Qwen3NextForCausalLM" else 1)))


def _gdn_plan(g: _GDN, bd: _dp.BlockDescription, B: int, d: int, wdt: torch.dtype):
    """The plan's delta block (kind 0, gated) for a transformers GDN layer: y = [q | k | v | b | a | z]."""
    m = g.layer._modules
    return _parts.gdn_plan(g.layer, g.W, m["norm"], m["out_proj"], bd, B, d, wdt)


def _attention(att: nn.Module, rotary: nn.Module, wdt: torch.dtype) -> Optional[_dp.AttentionDescription]:
    m = att._modules
    lins = [m.get(n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
    if any(x is None or not _dp.plan_linear(x, wdt) for x in lins):
        return None
    cfg = att.config
    H, G, D = cfg.num_attention_heads, cfg.num_key_value_heads, att.head_dim
    if lins[0].out_features != 2 * H * D or getattr(rotary, "rope_type", "default") != "default":
        return None
    inv = rotary.inv_freq
    return _dp.AttentionDescription(
        q_proj=lins[0], k_proj=lins[1], v_proj=lins[2], o_proj=lins[3], heads=H, kv_heads=G, head_dim=D,
        head_dim_v=D, scale=float(att.scaling), window=None, q_norm=m["q_norm"], k_norm=m["k_norm"], norm_offset=1,
        rot=2 * inv.numel(), inv_freq=inv.detach().to(torch.float64), rope_f32=True,
        rope_scale=float(rotary.attention_scaling), gate="q", g_proj=None, gate_act="sigmoid", kv_chunk=_KV_CHUNK)


def _describe(model: nn.Module) -> Union[tuple, str]:
    """(ModelDescription, per-layer GDN or None) or why the plan does not compute the model."""
    arch = type(model).__name__
    got = _parts.base_and_embedding(model, tuple(_GDN_PROJECTIONS), "model", "embed_tokens")
    if isinstance(got, str):
        return got
    base, embed, wdt = got
    if getattr(model.config, "output_router_logits", False):
        return "output_router_logits set (the plan returns no router logits)"
    cdt, d = _dp.compute_dtype(wdt), embed.weight.shape[1]
    blocks, gdns = [], []
    for i, layer in enumerate(base.layers):
        moe = None
        if type(layer.mlp).__name__ in _parts.QWEN_SPARSE_MOE:
            ffn = _parts.qwen_sparse_moe(layer.mlp, d, wdt)
            if isinstance(ffn, str):
                return f"layer {i}: {ffn}"
            moe = ffn[2]
        else:
            ffn = _parts.swiglu_ffn(layer.mlp, type(layer.mlp).__name__, d, wdt)
            if isinstance(ffn, str):
                return f"layer {i}: {ffn}"
        n1, n2 = (_zero_centred(layer._modules[n], cdt) for n in ("input_layernorm", "post_attention_layernorm"))
        if layer.block_type == "linear_attention":
            mixer = layer.linear_attn
            if not _gdn_usable(mixer, arch, wdt):
                why = _parts.fusion_reason(*map(mixer._modules.get, _GDN_FUSED[arch]))
                return f"layer {i}: a Gated DeltaNet layer the plan's delta block does not compute" + (
                    f" ({why})" if why else "")
            g, att, kind = _GDN(mixer, arch), None, "delta"
        else:
            mixer = layer.self_attn
            att = _attention(mixer, base.rotary_emb, wdt)
            if att is None:
                return f"layer {i}: an attention layer the plan's softmax block does not compute"
            g, kind = None, "softmax"
        blocks.append(_dp.BlockDescription(mixer, kind, n1, n2, "swiglu" if moe is None else "moe", ffn[0], ffn[1],
                                           attention=att, moe=moe))
        gdns.append(g)
    head = model.lm_head
    desc = _dp.ModelDescription(embed, blocks, base.norm, None if _parts.tied_head(head, embed) else head)
    if not _dp.model_weights_usable(desc, wdt):
        return "an embedding, final norm or head the plan does not read (a bias, another dtype, a hook)"
    desc.norm = _zero_centred(base.norm, cdt)   # (the plan reads 1 + w)
    return desc, gdns


def describe_model(model: nn.Module):
    """(ModelDescription, per-layer GDN or None) of a described transformers model, or None (another
    architecture, or a part the compiled plan does not compute: then the hook always steps aside)."""
    return _parts.description(_describe(model))


def _described_ffns(model: nn.Module) -> bool:
    """Whether every layer's feed-forward is a dense gated MLP (float or quantized projections) or one of the sparse
    MoE blocks the plan computes (`kernelize_plan_parts.QWEN_SPARSE_MOE`)."""
    return all(type(layer.mlp).__name__ in _parts.QWEN_SPARSE_MOE
               or all(type(m) is nn.Linear or _dp.stored_weights(m) is not None
                      for m in map(layer.mlp._modules.get, ("gate_proj", "up_proj", "down_proj")))
               for layer in model.model.layers)


def _qwen_output(moe: bool):
    """The output class of the unpatched forward: Qwen3-Next's and Qwen3.5-MoE's are `MoeCausalLMOutputWithPast`
    (the hook leaves its aux_loss and router_logits None: the plan steps aside when they are asked for)."""
    from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast
    return MoeCausalLMOutputWithPast if moe else CausalLMOutputWithPast


#: Qwen3.5 as an architecture description (the protocol: `_ARCHITECTURES`)
_QWEN = types.SimpleNamespace(
    MODELS=("Qwen3_5ForCausalLM",),
    FAST_KWARGS=_parts.CAUSAL_LM_KWARGS,
    base=lambda model: model.model, describe=_describe, hookable=_described_ffns, call_usable=_parts.cached_call_usable,
    block_plan=lambda g, bd, B, d, wdt: (_gdn_plan(g, bd, B, d, wdt) if g is not None
                                         else _dp.new_softmax_plan(bd, B, d, wdt)),
    state_spec=lambda g: (("delta", g.HV, g.K, g.V, g.KC, (g.H * g.K, g.H * g.K, g.HV * g.V)) if g is not None
                          else ("softmax", 0, 0, 0, 0, ())),
    output_class=lambda: _qwen_output(False), FP32_LOGITS=False)
#: Qwen3-Next / Qwen3.5-MoE: Qwen3.5's description with the MoE models' output class
_QWEN_MOE = types.SimpleNamespace(**{**vars(_QWEN), "MODELS": ("Qwen3NextForCausalLM", "Qwen3_5MoeForCausalLM"),
                                     "output_class": lambda: _qwen_output(True)})

#: every described architecture. A description (a module or a namespace; the per-architecture modules import
#: nothing from here) gives: `MODELS` (transformers class names), `FAST_KWARGS` (the forward's keywords the hook
#: serves), `base(model)` (the base model, whose own hooks run in its __call__), `describe(model)` ((ModelDescription
#: with the final norm as the plan reads it, per-layer part) or why not), `hookable(model)`, `block_plan(part, bd,
#: B, d, wdt)` (a BlockPlan or None), `state_spec(part)` (`decode_plan.state_layout`'s), `call_usable(cache, B, L,
#: attention_mask, position_ids)` (L the softmax layers' length or None), `output_class()`, `FP32_LOGITS`; and,
#: optionally, `cache_type()` (a cache class of its own, MiniMax's, instead of `DynamicCache`: its recurrent states
#: are `get_state(cache, i)` / `set_state(cache, i, state)`, no conv windows), `position(cache, L, position_ids)`
#: (the token's position, where the forward does not take it as L) and `model_fields(model)` (ModelPlan fields to
#: set: Granite's multipliers). A layer's
#: plan state (`state_spec`'s layout) has the shape and order of transformers' recurrent state tensor. Every module
#: of this package named `kernelize_plan_<arch>` with a `MODELS` tuple is such a description and joins on import.
_ARCHITECTURES = {name: a for a in (_QWEN, _QWEN_MOE) for name in a.MODELS}


def _join_descriptions() -> None:
    """Every description module of this package (`kernelize_plan_<arch>.py` with a `MODELS` tuple) joins
    `_ARCHITECTURES` on import: describing an architecture is adding its module."""
    for info in pkgutil.iter_modules([os.path.dirname(__file__)]):
        if info.name.startswith("kernelize_plan_"):
            mod = importlib.import_module(f"{__package__}.{info.name}")
            for name in getattr(mod, "MODELS", ()):
                _ARCHITECTURES.setdefault(name, mod)


_join_descriptions()


class _Slot:
    """The model's plan (`cpu/decode.ModelPlan`), its guard, the layout per batch size and what it points into.
    Not state: a copy or a pickle gets an empty slot."""

    __slots__ = ("plan", "fn", "guard", "keep", "specs", "layouts", "B", "layout", "cdt", "wdt", "recurrent", "att",
                 "failed", "last", "spent", "alike", "io", "io_table", "last_views", "spent_views", "logits_last",
                 "logits_spent", "kv_bound", "shapes", "tensor_type", "cdts")

    def __init__(self):
        self.plan, self.failed = None, None
        self.last = self.spent = None   # the last token's state buffer, and the one before (`_dp.reusable_buffer`)
        self.io_table = None   # `_conv_io`'s last table
        self.last_views = self.spent_views = None   # (S_new, the layers' state views) made of last / spent
        self.logits_last = self.logits_spent = None   # the logits the last token and the one before returned

    def __reduce__(self):
        return (_Slot, ())


def _described_modules(model: nn.Module, arch) -> list:
    # every module but the model and its base model, whose own hooks run in their __call__ (kernelize's packing
    # hooks on the base model among them: they do nothing for a cached token)
    base = arch.base(model)
    return [m for m in model.modules() if m is not model and m is not base]


def _build(slot: _Slot, arch, model: nn.Module, B: int) -> bool:
    slot.plan = None
    _hugepages.place_module(model)   # (before any pointer is taken: the plan reads every weight per token)
    got = arch.describe(model)
    if isinstance(got, str):
        return False
    desc, parts = got
    wdt = desc.embed.weight.dtype
    vocab, d = desc.embed.weight.shape
    plans = []
    for bd, part in zip(desc.blocks, parts):
        if _fast.hooked(*bd.mixer.modules()):
            return False
        p = arch.block_plan(part, bd, B, d, wdt)
        if p is None:
            return False
        plans.append(p)
    cdt = _dp.compute_dtype(wdt)
    mp = _cpu_decode.ModelPlan(L=len(plans), B=B, d=d, vocab=vocab, has_norm=1,
                               nthreads=max(1, torch.get_num_threads()), wbf16=int(wdt == torch.bfloat16),
                               norm_eps=float(desc.norm.eps))
    for name, value in arch.model_fields(model).items() if hasattr(arch, "model_fields") else ():
        setattr(mp, name, value)   # (Granite's multipliers)
    head, head_q = desc.head if desc.head is not None else desc.embed, None
    if type(head) in (nn.Linear, nn.Embedding):
        head_w = head.weight.detach()
    else:   # (a quantized head: its own integers and scales)
        fmt, head_w, head_q, mp.grp_head = _dp.stored_weights(head)
        head_q = _dp.plan_scales("head", fmt, head_q)
        mp.fmt_head, mp.sc_head = _cpu_decode.WEIGHT_FORMATS[fmt], head_q.data_ptr()
    norm_w = desc.norm.weight.detach().to(cdt).contiguous()
    mp.embed, mp.head, mp.norm_w = desc.embed.weight.data_ptr(), head_w.data_ptr(), norm_w.data_ptr()
    block_ptrs = (ctypes.c_void_p * len(plans))(*[ctypes.addressof(p) for p in plans])
    mp.blocks = ctypes.addressof(block_ptrs)
    direct = {mp.embed, mp.head, mp.norm_w, mp.sc_head}.union(*map(_dp.plan_pointers, plans))
    slot.guard = _dp.PlanGuard(arch.base(model), _described_modules(model, arch), [], direct)
    if not slot.guard.valid() or any(t.device.type != "cpu" for t in slot.guard.tensors):
        return False
    slot.keep = (plans, block_ptrs, head_w, norm_w, head_q)
    slot.plan, slot.fn, slot.cdt, slot.wdt = mp, _cpu_decode.model_function(cdt), cdt, wdt
    slot.specs, slot.layouts, slot.B = [arch.state_spec(part) for part in parts], {}, None
    slot.recurrent = [i for i, p in enumerate(plans) if p.kind not in _KV_KINDS and not p.ffn_only]
    slot.att = [(i, p) for i, p in enumerate(plans) if p.kind in _KV_KINDS]
    slot.kv_bound = [None] * len(slot.att)   # (per softmax plan: the buffers its pointers were last set to)
    # whether the call can read and advance transformers' conv states in place (`_conv_io`): every recurrent layer a
    # delta, linear, KDA or Mamba2 block (kinds 0, 1, 4, 5) with a short convolution
    slot.io = bool(slot.recurrent) and all(plans[i].kind in (0, 1, 4, 5) and plans[i].KC > 0
                                           for i in slot.recurrent)
    _set_batch(slot, B)
    return True


def _set_batch(slot: _Slot, B: int) -> None:
    got = slot.layouts.get(B)
    if got is None:
        lo = _dp.state_layout(slot.specs, B, slot.cdt, slot.plan.vocab)
        got = slot.layouts[B] = (lo, ((ctypes.c_int64 * lo.L)(*[lay.s_off for lay in lo.layers]),
                                      (ctypes.c_int64 * lo.L)(*[lay.w_off for lay in lo.layers])),
                                 _alike_states(lo, slot.recurrent))
    lo, offs, slot.alike = got
    # (the recurrent layers' state and conv state shapes at B, in `slot.recurrent`'s order, as `model_token`
    # compares them)
    rec = [lo.layers[i] for i in slot.recurrent]
    slot.shapes = ([torch.Size(lay.sshape) for lay in rec],
                   [torch.Size((B, lay.wshape[1], lay.wshape[2] + 1)) if lay.wshape is not None else None
                    for lay in rec])
    # (isinstance's second argument and the compute dtype, per layer, for `map`)
    slot.tensor_type, slot.cdts = [torch.Tensor] * len(rec), [slot.cdt] * len(rec)
    slot.plan.B = B
    for p in slot.keep[0]:
        p.B = B
    slot.plan.s_off, slot.plan.w_off = ctypes.addressof(offs[0]), ctypes.addressof(offs[1])
    slot.B, slot.layout = B, lo


def _alike_states(lo, recurrent: list) -> Optional[tuple]:
    """(n, shape) when the n recurrent layers' states have one shape and follow each other from the start of the
    step's buffer (Qwen3.5's: their views are made in one unbind a token), else None."""
    if not recurrent:
        return None
    shape = lo.layers[recurrent[0]].sshape
    size = math.prod(shape)
    if any(lo.layers[i].sshape != shape or lo.layers[i].s_off != j * size for j, i in enumerate(recurrent)):
        return None
    return len(recurrent), shape


def _usable_slot(model: nn.Module, arch, B: int) -> Optional[_Slot]:
    """The model's slot with a valid plan at batch B (built when needed), or None."""
    slot = model.__dict__.get("_linattn_model_plan")
    if type(slot) is not _Slot:
        slot = model.__dict__["_linattn_model_plan"] = _Slot()
    _dp.set_plan_threads(slot)
    if slot.plan is None or not slot.guard.valid():
        if slot.failed is not None and slot.failed.valid():
            return None   # (nothing changed since the plan could not be built)
        mods = _described_modules(model, arch)
        if _fast.hooked(*mods):
            return None   # (before the copies a build makes: a hooked model would make them on every token)
        if not _build(slot, arch, model, B):
            slot.failed = _dp.PlanGuard(arch.base(model), mods, [], ())
            return None
        slot.failed = None
    elif slot.B != B:
        _set_batch(slot, B)
    return slot


def _cache_types():
    global _CACHE_TYPES
    if _CACHE_TYPES is None:   # (once: an import statement is ~15 us a token)
        from transformers.cache_utils import DynamicCache, DynamicLayer, LinearAttentionLayer
        _CACHE_TYPES = DynamicCache, DynamicLayer, LinearAttentionLayer
    return _CACHE_TYPES


_CACHE_TYPES = None


#: the block kinds whose layers keep keys and values in transformers' cache (softmax 2; latent attention 7, whose
#: "keys" are the normed latents and "values" the shared rotary keys: `kernelize_plan_parts.mla_plan`)
_KV_KINDS = (2, 7)


class _Mirror:
    """A softmax layer's keys and values in the plan's layout (`KVCache`, `[B, T, G, D]`), valid while the
    transformers layer still holds the views made of it after the last token (`keys`, `values`); `bufs` the
    buffers `views` last described."""

    __slots__ = ("kv", "keys", "values", "bufs", "shapes")

    def __init__(self, kv, keys, values):
        self.kv, self.keys, self.values, self.bufs = kv, keys, values, None

    def views(self, n: int) -> tuple:
        """(keys, values) as transformers holds them, `[B, G, n, D]` views of the buffers' first n rows: one
        `as_strided` each (a slice and a transpose are two dispatches, ~2.5x the time), with the sizes and strides of
        `kv.k[:, :n].transpose(1, 2)`, worked out again when the buffers grew."""
        kv = self.kv
        k, v = kv.k, kv.v
        if self.bufs is None or self.bufs[0] is not k or self.bufs[1] is not v:
            self.bufs = (k, v)
            self.shapes = [(b.shape[0], b.shape[2], b.shape[3], (b.stride(0), b.stride(2), b.stride(1), b.stride(3)))
                           for b in (k, v)]
        (B, G, D, ks), (_, _, Dv, vs) = self.shapes
        return k.as_strided((B, G, n, D), ks), v.as_strided((B, G, n, Dv), vs)


def _mirror(store: dict, i: int, layer, B: int, G: int, D: int, dt: torch.dtype, Dv: int) -> Optional[_Mirror]:
    keys, values = layer.keys, layer.values
    mir = store.get(i)
    if mir is not None and mir.keys is keys and mir.values is values:
        return mir
    if not (keys.shape[0] == B and keys.shape[1] == G and keys.shape[3] == D
            and values.shape == keys.shape[:3] + (Dv,)
            and keys.dtype == dt and values.dtype == dt and keys.is_cpu):
        return None
    kv = KVCache(chunk=_KV_CHUNK)
    kv.append(keys.transpose(1, 2), values.transpose(1, 2))
    mir = store[i] = _Mirror(kv, keys, values)
    return mir


def model_token(model: nn.Module, input_ids, cache, attention_mask, position_ids=None) -> Optional[torch.Tensor]:
    """The logits `[B, 1, vocab]` of one decoded token per row through the compiled plan, `cache` (a transformers
    `DynamicCache` holding the prompt) advanced as transformers' forward would; None where the plan does not
    cover the call (the modules' docstrings), the cache untouched."""
    arch = _ARCHITECTURES.get(type(model).__name__)
    if (arch is None or torch.is_grad_enabled() or torch.compiler.is_compiling() or not _cpu_decode.switched_on()
            or not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[1] != 1
            or not input_ids.is_cpu or input_ids.dtype not in (torch.int64, torch.int32)):
        return None
    DynamicCache, DynamicLayer, LinearAttentionLayer = _cache_types()
    own = getattr(arch, "cache_type", None)   # (a cache class of the architecture's own: `_ARCHITECTURES`)
    if type(cache) is not (DynamicCache if own is None else own()):
        return None
    B = input_ids.shape[0]
    slot = _usable_slot(model, arch, B)
    if slot is None:
        return None
    layers, lo = cache.layers, slot.layout
    if len(layers) != lo.L if own is None else len(layers) > lo.L:
        return None
    # the cache: every recurrent layer past its prompt, every softmax layer at the same length L
    S_parts, W_parts, rdicts = [], [], []
    if own is not None:
        for i in slot.recurrent:   # (a state tensor per layer, no conv window)
            lay = lo.layers[i]
            rs = arch.get_state(cache, i)
            if rs is None or rs.shape != lay.sshape or not rs.is_cpu or lay.wshape is not None:
                return None
            S_parts.append(rs)
    else:
        for i in slot.recurrent:
            c = layers[i]
            if type(c) is not LinearAttentionLayer or c.record_past or not c.has_previous_state[0]:
                return None
            d = c.recurrent_states
            S_parts.append(d[0])
            W_parts.append(c.conv_states[0])
            rdicts.append(d)
        # (each a CPU tensor of its layer's shape, the states' and the conv states' as a few `map`s over the lists:
        # no Python step per layer)
        if not (all(map(isinstance, S_parts, slot.tensor_type)) and all(map(isinstance, W_parts, slot.tensor_type))
                and list(map(_shape, S_parts)) == slot.shapes[0] and list(map(_shape, W_parts)) == slot.shapes[1]
                and all(map(_is_cpu, S_parts)) and all(map(_is_cpu, W_parts))):
            return None
        if not all(map(operator.is_, map(_dtype, S_parts), slot.cdts)):
            rdicts = None   # (a state kept in another dtype: `_write_recurrent` copies into it)
    L, store, hits = None, cache.__dict__.get("_linattn_kv") if slot.att else None, []
    for i, _ in slot.att:
        c = layers[i] if i < len(layers) else None
        if type(c) is not DynamicLayer or not c.is_initialized:
            return None
        mir = store.get(i) if store else None
        if mir is not None and mir.keys is c.keys and mir.values is c.values:
            n = mir.kv.length   # (its own views, `[B, G, length, D]`: `_Mirror.views`)
        else:
            if c.keys is None or c.keys.dim() != 4:
                return None
            n, mir = c.keys.shape[2], None
        if L is not None and n != L:
            return None
        L = n
        hits.append(mir)
    if not arch.call_usable(cache, B, L, attention_mask, position_ids):
        return None
    mirrors = []
    for (i, p), mir in zip(slot.att, hits):
        if mir is None:
            att = p.att
            mir = _mirror(cache.__dict__.setdefault("_linattn_kv", {}), i, layers[i], B, att.kv_heads,
                          att.head_dim, slot.wdt, att.head_dim_v)
            if mir is None or mir.kv.length != L:
                return None
        mirrors.append((i, p, mir))
    cdt = slot.cdt
    # the token's position: the softmax layers' length, or where the architecture's forward takes it from
    pos = arch.position(cache, L, position_ids) if hasattr(arch, "position") else L
    S_in, s_at = _states_in(cache, lo, S_parts, cdt, slot.recurrent)
    io = _conv_io(lo, slot, W_parts) if slot.io and own is None else None
    convs = None if io is not None else _conv_stack(cache, lo, slot, W_parts)
    W_in = W_ptr = None
    slot.plan.w_io_at = io   # (every call: none left from another)
    if io is not None:
        cache.__dict__.pop("_linattn_conv", None)   # (its stack, if the layers hold its views, is written in place now)
    elif convs is not None:
        prev = cache.__dict__.get("_linattn_conv")
        if prev is not None and prev[1] is convs:   # (unwritten since: the windows are the last buffer's, as written)
            W_ptr = prev[4].data_ptr() + lo.n_state * prev[4].element_size()
        else:
            W_in = _windows_of(convs, cdt)
    elif W_parts:
        W_in = torch.cat([w[..., 1:].to(cdt).reshape(-1) for w in W_parts])
    if W_in is not None:
        W_ptr = W_in.data_ptr()
    bound, grown = slot.kv_bound, []
    for j, (_, p, mir) in enumerate(mirrors):
        kv, b = mir.kv, bound[j]
        # (the buffers' pointers and capacity only where the plan last had others, or the next row needs more room;
        # weak references: the slot keeps no cache's buffers alive)
        if b is None or b[0]() is not kv.k or b[1]() is not kv.v or kv.length >= b[2]:
            kv.reserve(1, kv.k, kv.v)
            p.kc, p.vc, p.kv_cap = kv.k.data_ptr(), kv.v.data_ptr(), kv.k.shape[1]
            p.pos, p.lo, p.lo0 = None, None, 0
            bound[j] = (weakref.ref(kv.k), weakref.ref(kv.v), kv.k.shape[1])
        p.kv_len, p.pos0 = kv.length, pos
        # (the views of the rows after the call made now, while these objects are in the caches: the call's weight
        # stream evicts them; the layers take them only after it)
        grown.append(mir.views(kv.length + 1))
    ids = input_ids if input_ids.dtype == torch.int64 and input_ids.is_contiguous() else \
        input_ids.to(torch.int64).contiguous()
    # the token before last's buffer when nothing holds it any more (the cache's states are views of the last one's)
    spent, slot.spent = slot.spent, None
    sv, slot.spent_views = slot.spent_views, None
    if sv is not None and not _unheld(sv):
        sv = None
    buf = _dp.reusable_buffer(spent, lo.n_state + lo.n_win, cdt, 0 if sv is None else 1 + len(sv[1]))
    if buf is not spent:
        sv = None
    del spent
    # (the logits the token before last returned, when the caller let go of them and every view: no allocation)
    spent, slot.logits_spent = slot.logits_spent, None
    logits = spent if _dp.unheld_buffer(spent, B * lo.vocab, slot.wdt) else torch.empty(B, 1, lo.vocab,
                                                                                         dtype=slot.wdt)
    del spent
    out = buf.data_ptr()
    slot.plan.s_in_at = None if s_at is None else ctypes.addressof(s_at[0])   # (every call: none left from another)
    rc = slot.fn(ctypes.byref(slot.plan), ids.data_ptr(), None if S_in is None else S_in.data_ptr(), W_ptr, out,
                 out + lo.n_state * buf.element_size() if lo.n_win else None, logits.data_ptr(), None)
    if rc == 2:
        return None   # a token id out of range: transformers' embedding reports it
    if rc:
        raise MemoryError("linattn: the compiled decoding step could not allocate its work buffer")
    slot.spent, slot.last = slot.last, buf
    slot.logits_spent, slot.logits_last = slot.logits_last, logits
    slot.spent_views, slot.last_views = slot.last_views, None
    _write_recurrent(cache, lo, slot, buf, convs, arch if own is not None else None, io is not None, sv,
                     rdicts if own is None else None)
    for (i, _, mir), kvs in zip(mirrors, grown):
        mir.kv.length += 1
        mir.keys, mir.values = kvs
        layers[i].keys, layers[i].values = kvs
    return logits.float() if arch.FP32_LOGITS else logits


_shape, _is_cpu, _dtype = operator.attrgetter("shape"), operator.attrgetter("is_cpu"), operator.attrgetter("dtype")


def _states_in(cache, lo, S_parts: list, cdt: torch.dtype, recurrent: list) -> tuple:
    """(buffer, table): the recurrent states as the buffer the last token left when they are still its views (table
    None), else as a table of each layer's own state (`ModelPlan.s_in_at`: L addresses, NULL for the layers without
    one, and the tensors they point into), read in place where it is in cdt and contiguous (transformers' prompt
    leaves them so), converted otherwise: no copy of every state gathered into one buffer. (None, None) without
    recurrent layers."""
    if not S_parts:
        return None, None
    prev = cache.__dict__.get("_linattn_states")
    if prev is not None and prev[0] is lo and all(map(operator.is_, S_parts, prev[1])):
        return prev[2], None
    own = [s if s.dtype == cdt and s.is_contiguous() else s.to(cdt).contiguous() for s in S_parts]
    at = [None] * lo.L
    for i, s in zip(recurrent, own):
        at[i] = s.data_ptr()
    return None, ((ctypes.c_void_p * lo.L)(*at), own)


def _conv_io(lo, slot: _Slot, W_parts: list) -> Optional[int]:
    """The address of a table of the layers' conv states for the call to read and advance in place
    (`ModelPlan.w_io_at`: L addresses, NULL for the layers without one), when every one is contiguous in cdt (as
    transformers' prompt leaves them in an fp32 / fp64 model), else None (the buffers' path: `_conv_stack`). The
    last table is kept in the slot (not in the cache, which is copied and pickled) while the layers hold the same
    tensors at the same addresses: transformers' own step writes them in place too; a reorder, a crop or a copy
    makes new ones. (The slot holds the tensors, so an address it compares cannot be another tensor's.)"""
    ptrs = [w.data_ptr() for w in W_parts]
    prev = slot.io_table
    if prev is not None and prev[0] is lo and prev[1] == ptrs and all(map(operator.is_, W_parts, prev[2])):
        return prev[3]
    if not all(w.dtype == slot.cdt and w.is_contiguous() for w in W_parts):
        return None
    at = [None] * lo.L
    for i, a in zip(slot.recurrent, ptrs):
        at[i] = a
    table = (ctypes.c_void_p * lo.L)(*at)
    slot.io_table = (lo, ptrs, list(W_parts), ctypes.addressof(table), table)
    return slot.io_table[3]


def _conv_stack(cache, lo, slot: _Slot, W_parts: list) -> Optional[torch.Tensor]:
    """The recurrent layers' conv states as one `[n, B, C, KC]` tensor when they are alike and their windows follow
    each other in the plan's buffer (Qwen3.5's: one conversion and two copies a token instead of three small
    strided ones per layer): the tensor the last token left them views of, while nothing wrote them since (the
    shared version counter), else a stack of them; None otherwise (the per-layer path)."""
    if not W_parts:
        return None
    prev = cache.__dict__.get("_linattn_conv")
    if (prev is not None and prev[0] is lo and prev[1]._version == prev[3]
            and all(map(operator.is_, W_parts, prev[2])) and W_parts[0].data_ptr() == prev[1].data_ptr()
            and W_parts[-1].data_ptr() == prev[1].data_ptr() + (len(W_parts) - 1) * prev[1].stride(0)
            * prev[1].element_size()):   # (still its views: a deep copy keeps them)
        return prev[1]
    w0 = W_parts[0]
    size = math.prod(lo.layers[slot.recurrent[0]].wshape)
    if any(w.shape != w0.shape or w.dtype != w0.dtype or lo.layers[i].w_off != j * size
           for j, (i, w) in enumerate(zip(slot.recurrent, W_parts))):
        return None
    return torch.stack(W_parts)


def _windows_of(convs: torch.Tensor, cdt: torch.dtype) -> torch.Tensor:
    """The plan's conv windows `[n B C (KC - 1)]` in cdt: the last KC - 1 columns of `_conv_stack`'s `[n, B, C,
    KC]`, copied a column at a time (one strided copy with an inner loop of KC - 1 elements costs ~3x more)."""
    KC = convs.shape[3]
    rows = convs.view(-1, KC)
    out = torch.empty(rows.shape[0], KC - 1, dtype=cdt)
    for j in range(KC - 1):
        out[:, j].copy_(rows[:, j + 1])
    return out.view(-1)


def _unheld(sv: tuple) -> bool:
    """Whether `slot.spent_views`' (S_new, views) are held by nothing but the slot: the references `getrefcount`
    sees then are the tuple's or the list's, the loop's name and its argument."""
    return _getrefcount(sv[0]) == 2 and all(_getrefcount(v) == 3 for v in sv[1])


_getrefcount = sys.getrefcount


def _write_recurrent(cache, lo, slot: _Slot, buf: torch.Tensor, convs: Optional[torch.Tensor] = None,
                     own=None, io: bool = False, sv: Optional[tuple] = None, states: Optional[list] = None) -> None:
    """transformers' recurrent layers after the step: states as views of the new buffer (a copy where the layer
    keeps another dtype or layout), conv states shifted by one column (all at once in `convs`, `_conv_stack`'s,
    whose views they become, the buffer kept with them: the next token reads its windows while they are unwritten),
    or nothing to do for them with `io` (the call advanced them in place: `_conv_io`). Alike layers' state views
    are made once per buffer (`slot.last_views`) and given again with it (`sv`) while no one else held them.
    `own`: the description of a cache of the architecture's own, whose states it gets and sets (`get_state` /
    `set_state`; no conv windows), a new tensor where it keeps another dtype. `states`: the layers'
    `recurrent_states` dicts, read before the call, when every state they held was in cdt (each takes its view; no
    layer, dict or old state read again after the call's weight stream)."""
    # (S_new detached: a view would hold buf's object, which `_dp.reusable_buffer` counts, while the slot keeps it)
    S_new, views, layers = buf[:lo.n_state].detach() if sv is None else sv[0], [], cache.layers
    if convs is not None:
        _shift_in(convs, buf[lo.n_state:lo.n_state + convs.numel() // convs.shape[3] * (convs.shape[3] - 1)])
        prev = cache.__dict__.get("_linattn_conv")
        if prev is not None and prev[1] is convs:
            conv_views = prev[2]
        else:   # (detached: transformers' own step under grad writes them in place)
            conv_views = [c.detach() for c in convs.unbind(0)]
            for i, c in zip(slot.recurrent, conv_views):
                layers[i].conv_states[0] = c
        cache.__dict__["_linattn_conv"] = (lo, convs, conv_views, convs._version, buf)
    if own is None and slot.alike is not None and (convs is not None or io or not lo.n_win):
        # (alike layers: their views in one unbind, each detached as below; or the ones made of this buffer
        # before, which no one held since)
        n, shape = slot.alike
        news = list(map(_detach, S_new[:n * math.prod(shape)].view((n,) + shape).unbind(0))) if sv is None \
            else sv[1]
        if states is not None:
            for d, st in zip(states, news):
                d[0] = st
            cache.__dict__["_linattn_states"] = (lo, list(news), S_new)
            slot.last_views = (S_new, news)
            return
        for i, st in zip(slot.recurrent, news):
            rs = layers[i].recurrent_states
            if rs[0].dtype == slot.cdt:
                rs[0] = st
            else:
                rs[0].copy_(st)
            views.append(rs[0])
        cache.__dict__["_linattn_states"] = (lo, views, S_new)
        if all(map(operator.is_, views, news)):
            slot.last_views = (S_new, news)
        return
    for i in slot.recurrent:
        lay = lo.layers[i]
        st = S_new[lay.s_off:lay.s_off + math.prod(lay.sshape)].view(lay.sshape)
        if own is not None:
            dt = own.get_state(cache, i).dtype
            own.set_state(cache, i, st.detach() if dt == slot.cdt else st.to(dt))
            views.append(own.get_state(cache, i))
            continue
        c = layers[i]
        if c.recurrent_states[0].dtype == slot.cdt:
            # (detached: a view made under no_grad could not be written in place by transformers' own step
            # under grad)
            c.recurrent_states[0] = st.detach()
        else:
            c.recurrent_states[0].copy_(st)
        views.append(c.recurrent_states[0])
        if convs is None and not io:
            cs, n = c.conv_states[0], lay.wshape[1] * lay.wshape[2]
            cs[..., :1].copy_(cs[..., 1:2])
            cs[..., 1:].copy_(buf[lo.n_state + lay.w_off:lo.n_state + lay.w_off + lay.wshape[0] * n]
                              .view(lay.wshape))
    if views:
        cache.__dict__["_linattn_states"] = (lo, views, S_new)


def _shift_in(convs: torch.Tensor, wins: torch.Tensor) -> None:
    """`_conv_stack`'s `[n, B, C, KC]` advanced by the step: each row's columns 1.. move left by one and the step's
    input (the last column of the plan's new windows `wins`, `[n B C (KC - 1)]` in cdt) goes last; the row as
    transformers' conv update leaves it, `[old[1:] | x]`. The plan's new window is the old one shifted (its first
    KC - 2 columns are the row's last KC - 2, as stored: `_windows_of` converts them exactly, or they are the last
    token's windows, which these rows were written from), so one overlapping memmove of the whole contiguous stack
    (row r's first column takes row r + 1's, overwritten next) and one strided column copy write what KC column
    copies would, bit for bit, at ~0.6x their time."""
    KC, es = convs.shape[3], convs.element_size()
    ctypes.memmove(convs.data_ptr(), convs.data_ptr() + es, (convs.numel() - 1) * es)
    convs.view(-1, KC)[:, KC - 1].copy_(wins.view(-1, KC - 1)[:, KC - 2])   # (also bumps convs' version)


_detach = torch.Tensor.detach
_HOOKED_FORWARDS: dict = {}   # model class -> its forward with the decode hook in front


def _output_maker(cls: type):
    """`(logits, cache) -> cls(logits=logits, cache=cache)`: the object transformers' output class builds, made
    without its dataclass `__init__` and `ModelOutput.__post_init__` (a field set, then every field looked up
    again, by name, in Python: ~0.1 ms a token on caches the weights' stream has emptied): the instance's attributes
    (every field, None but the two) and its mapping's items (the two, in field order) set as those leave them. It is
    checked once against the class itself (attributes, items and their order, the tuple); where they differ (another
    transformers), the class builds every output."""
    import dataclasses
    from collections import OrderedDict

    names = [f.name for f in dataclasses.fields(cls)]
    blank = dict.fromkeys(names)
    items = [n for n in names if n in ("logits", "cache")]
    new, setitem = cls.__new__, OrderedDict.__setitem__

    def make(logits, cache):
        out = new(cls)
        attrs = out.__dict__
        attrs.update(blank)
        attrs["logits"], attrs["cache"] = logits, cache
        for n in items:
            setitem(out, n, attrs[n])
        return out

    logits, cache = torch.zeros(1), object()
    want = cls(logits=logits, cache=cache)
    try:
        got = make(logits, cache)
        same = (type(got) is cls and list(vars(got).items()) == list(vars(want).items())
                and list(got.items()) == list(want.items()) and got.to_tuple() == want.to_tuple())
    except Exception:   # pragma: no cover - a class that cannot be built so: its own constructor
        same = False
    return make if same else (lambda logits, cache: cls(logits=logits, cache=cache))


def _hooked_forward(cls: type, arch):
    fn = _HOOKED_FORWARDS.get(cls)
    if fn is not None:
        return fn
    output, fast_kwargs, inner = _output_maker(arch.output_class()), arch.FAST_KWARGS, cls.forward

    @functools.wraps(inner)   # (inspect.signature follows __wrapped__: the class forward's exact signature)
    def forward(self, *args, **kwargs):
        packing = self.__dict__.get("_linattn_packing_calls")
        if packing is None:
            return step(self, args, kwargs)
        # kernelize's packing hooks, which this model's forward runs instead of its __call__ (kernelize._hook_packing)
        got = packing[0](self, args, kwargs)
        if got is None:   # (nothing stashed for the base model: nothing for the post-hook to clear)
            return step(self, args, kwargs)
        try:
            return step(self, *got)
        finally:
            packing[1](self, *got, None)

    def step(self, args, kwargs):
        if torch.compiler.is_compiling() or len(args) > 1 or (args and "input_ids" in kwargs):
            return inner(self, *args, **kwargs)
        if args:
            kwargs["input_ids"] = args[0]
        if (kwargs.keys() <= fast_kwargs and kwargs.get("use_cache", True) is not False
                and kwargs.get("return_dict", True) is not False and not kwargs.get("output_attentions")
                and not kwargs.get("output_hidden_states") and type(kwargs.get("logits_to_keep", 0)) is int):
            cache = kwargs.get("cache", kwargs.get("past_key_values"))
            logits = model_token(self, kwargs.get("input_ids"), cache, kwargs.get("attention_mask"),
                                 kwargs.get("position_ids"))
            if logits is not None:
                return output(logits, cache)
        return inner(self, **kwargs)

    fn = _HOOKED_FORWARDS[cls] = forward
    return fn


def hook_model(model: nn.Module) -> bool:
    """Gives a described model (`_ARCHITECTURES`: `Qwen3_5ForCausalLM`, `Qwen3_5MoeForCausalLM`,
    `Qwen3NextForCausalLM`; Kimi Linear, Mamba2, OLMo-hybrid and Bailing hybrid through their
    hf/kernelize_plan_<arch>.py modules) the decode hook: an instance `forward` (a method bound to the model, so a
    deep copy is bound to the copy) with the class forward's signature that decodes a cached one-token call through
    the compiled plan (`model_token`) and runs transformers' forward otherwise. Returns whether the model is hooked."""
    arch = _ARCHITECTURES.get(type(model).__name__)
    if arch is None:
        return False
    fn = _hooked_forward(type(model), arch)
    own = model.__dict__.get("forward")
    if own is not None:
        return getattr(own, "__func__", None) is fn
    if not arch.hookable(model):
        return False
    model.forward = types.MethodType(fn, model)
    return True
