"""Decoding one token through a whole block, or a whole model, in one compiled call: the decode plan.

A model describes itself (`BlockDescription` per block, `ModelDescription` for the model: norms, mixer and its
kind, FFN kind, residual order, embedding, final norm, head), and the plans are built from those descriptions
only, so any model that can describe its blocks this way (a transformers model, later) decodes through the same
compiled calls (`cpu/csrc/decode.c`):

* `block_token(block, x, cache)`, the one hook of `Block.forward` (models/lm.py): one decoded token through a
  pre-norm block, ``h = x + mixer(norm1(x)); out = h + w_down(silu(a) * b), [a | b] = w_gate_up(norm2(h))``, as
  one compiled call (`linattn_decode_block`) where the mixer has a compiled step, else the same operations in
  PyTorch (the mixer's own fast step inside), else None (the block's usual path runs);
* `model_step(model, ids, cache, logits_to_keep)`, the hook of `LanguageModel.forward`: the embedding, every
  block, the final norm and the head as one compiled call (`linattn_decode_model`), the cache's entries written
  lazily (`ModelPending`).

What a plan depends on is checked on every token by one class, `PlanGuard` (identity of every submodule,
parameter and buffer, their storages, the versions of what the plan copied, configuration values, the fused
weights, the switches, hooks, the thread count, train/eval). The batch size is not part of a plan: the compiled
calls take it per call and the state layout per batch size is kept, so a server whose batch changes every step
never rebuilds (`rebuilds` counts the plans built, for tests).

Weights: fp32 and fp64 models compute in their dtype; a bf16 model's matrices are read as stored (bf16) by the
matrix-vector products, which accumulate in fp32, with fp32 activations and states (the small vectors, norms and
conv weights are converted once into the plan).
"""
from __future__ import annotations

import ctypes
import math
import operator
import sys
from typing import Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.hooks import RemovableHandle

from ..cpu import decode as _cpu_decode, guard as _guard, hugepages as _hugepages, prefetch as _prefetch
from ..cpu.qlayout import step_scales as _step_scales
from ..errors import LinattnError
from ..layers import fast_decode as _fast
from ..layers.cache import Cache, KVCache, LayerCache
from ..layers.common import GatedRMSNorm, RMSNorm, RotaryEmbedding, ShortConv, mamba_neg_a
from ..layers.delta_family import KDA
from ..layers.mamba2 import Mamba2Block
from ..layers.softmax import SoftmaxAttention
from ..ops import LinearAttentionState
from ..ops.feature_maps import HadamardExp, MagnitudeDirection, SubSqEuclid, SumSqEuclid
from ..ops.l2norm import L2NORM_CONVENTIONS, L2NORM_EPS

__all__ = ["AttentionDescription", "BlockDescription", "BlockPlanSlot", "ModelDescription", "ModelFastState",
           "ModelPending", "ModelPlanSlot", "PlanGuard", "block_token", "compute_dtype", "describe_softmax",
           "finish_block_plan", "model_greedy", "model_step", "model_weights_usable", "new_softmax_plan",
           "plan_addresser", "plan_linear", "plan_pointers", "plan_scales", "PLAN_POINTERS", "rebuilds", "set_weight",
           "StackedRows", "state_layout", "stored_weights", "MoEDescription", "moe_usable"]

#: the dtypes a plan reads weights in, and the dtype it computes in for each (bf16: fp32 accumulation and states)
_COMPUTE = {torch.float32: torch.float32, torch.float64: torch.float64, torch.bfloat16: torch.float32}
#: plans built so far (every build adds one): the tests check that what should not rebuild does not
rebuilds = [0]


def stored_weights(linear: nn.Module):
    """(mode, qweight, scales, group) of a linear whose weights are stored quantized (a module with a
    `stored_weights()` method: quant/linear.QuantizedLinear, which describes itself so that this module need not
    import it), else None."""
    fn = getattr(type(linear), "stored_weights", None)
    return None if fn is None else fn(linear)


class StackedRows:
    """A fused projection read from its parts in place: the matrices `parts` (each `[rows_i, in_features]`, one
    dtype, bias-free) stacked by rows in order. A plan points at the parts (`BlockPlan.parts_<M>`, for the fused
    products `cpu.decode.FUSED_PRODUCTS`), so the fused matrix is never copied: a model holds its weights once,
    and a weight written in place is read by the next token."""

    __slots__ = ("parts", "bias", "out_features", "in_features")

    def __init__(self, parts: Sequence[torch.Tensor]):
        self.parts = tuple(p.detach() for p in parts)
        self.bias = None
        self.out_features = sum(p.shape[0] for p in self.parts)
        self.in_features = self.parts[0].shape[1]


def plan_linear(linear, wdt: torch.dtype) -> bool:
    """Whether a plan with weights in wdt reads this linear layer's matrix: an `nn.Linear` in wdt, int8 / int4
    weights (`stored_weights`; fp32 and bf16 plans, which compute in fp32), parts stacked by rows in wdt
    (`StackedRows`), or a matrix a description prepared itself (not a module: an object with a `weight` in wdt).
    Any other module (a subclass of nn.Linear, an adapter) is not read: its forward may compute something else."""
    if type(linear) is nn.Linear:
        return linear.weight.dtype == wdt
    if type(linear) is StackedRows:
        return all(p.dtype == wdt and p.shape[1] == linear.in_features for p in linear.parts)
    if stored_weights(linear) is not None:
        return compute_dtype(wdt) is torch.float32
    w = None if isinstance(linear, nn.Module) else getattr(linear, "weight", None)
    return isinstance(w, torch.Tensor) and w.dtype == wdt


def compute_dtype(weight_dtype: torch.dtype) -> Optional[torch.dtype]:
    """The dtype a compiled plan computes in for weights stored in `weight_dtype` (float32, float64: the same;
    bfloat16: float32), or None when there is no compiled plan for it."""
    return _COMPUTE.get(weight_dtype)


# -- descriptions ------------------------------------------------------------------------------------------------
class BlockDescription:
    """What a decode plan needs to know about one block: ``h = x + mixer(norm1(x))`` then, with an FFN,
    ``out = h + ffn_down(silu(a) * b)``, ``[a | b] = ffn_gate_up(norm2(h))`` (residual "prenorm"); or, residual
    "postnorm" (OLMo-hybrid's attention blocks), ``h = x + norm1(mixer(x))``, ``out = h + norm2(ffn_down(silu(a) *
    b))``, ``[a | b] = ffn_gate_up(h)``.

    Attributes:
        mixer: The attention layer (an `AttentionBase` whose `fast_step_kind()` is `kind`).
        kind: "delta" or "linear" (`layers/fast_decode.STEPS`), "softmax", "kda" or "mamba2" (the compiled
            block kinds 4 and 5; a block of linattn's `KDA` / `Mamba2Block`, whose `fast_step_kind` is None or
            absent, is of that kind).
        norm1: The norm before the mixer (post-norm: on its output): an RMSNorm (`weight` or None, `eps`).
        norm2: The norm before the FFN (post-norm: on its output; None without an FFN).
        ffn: "swiglu", "moe" (a mixture of experts, `moe`; the compiled whole-model plans of transformers models
            only), "relu2" (non-gated, ``ffn_down(relu(ffn_gate_up(xn))^2)``: `ffn_gate_up` is the up projection
            `[hidden, d]`; those plans only) or None.
        ffn_gate_up: The FFN's fused gate | up projection `[2 * hidden, d]` (an nn.Linear, or a `StackedRows` of
            the gate's and the up projection's weights), or None (with "moe": the shared expert's).
        ffn_down: The FFN's down projection `[d, hidden]`, or None (with "moe": the shared expert's).
        modules: Every module whose forward the plan computes instead of calling it (checked for hooks).
        residual: The residual order: "prenorm" or "postnorm" (above). The compiled block computes both (the
            `postnorm` field of its plan); the per-block paths of linattn's own blocks (`block_token`) and the
            whole-model step of its models take pre-norm blocks only.
        attention: For kind "softmax", the mixer's parts (`AttentionDescription`); None: built from the mixer
            when the plan needs it (`describe_softmax`, linattn's `SoftmaxAttention`). A block of linattn's
            `SoftmaxAttention` (kind None from its `fast_step_kind`) is of kind "softmax".
        moe: For ffn "moe", the router and the routed experts (`MoEDescription`); pre-norm blocks only.
    """

    __slots__ = ("mixer", "kind", "norm1", "norm2", "ffn", "ffn_gate_up", "ffn_down", "modules", "residual",
                 "attention", "moe")

    def __init__(self, mixer, kind: str, norm1, norm2=None, ffn: Optional[str] = None, ffn_gate_up=None,
                 ffn_down=None, modules: Sequence[nn.Module] = (), residual: str = "prenorm", attention=None,
                 moe=None):
        if kind is None and (attention is not None or type(mixer) is SoftmaxAttention):
            kind = "softmax"
        elif kind is None:
            kind = _OWN_KINDS.get(type(mixer))
        self.mixer, self.kind, self.norm1, self.norm2 = mixer, kind, norm1, norm2
        self.ffn, self.ffn_gate_up, self.ffn_down, self.modules = ffn, ffn_gate_up, ffn_down, tuple(modules)
        self.residual, self.attention, self.moe = residual, attention, moe


class MoEDescription:
    """A mixture-of-experts feed-forward as the compiled decode computes it (csrc/decode_moe.h), on xn = norm2(h):

        p = softmax(router xn) (in float);  the k largest p as torch.topk picks them (renormalised: `norm_topk`)
        out = sum over the chosen e of p_e down_e(silu(a) * b), [a | b] = gate_up_e xn    (+ the block's shared
              expert `ffn_gate_up` / `ffn_down`, times sigmoid(shared_gate xn) when `shared_gate` is given)

    Attributes:
        router: The router's weight `[E, d]` (a tensor, read in place).
        gate_up: The experts' fused gate | up weights `[E, 2 * hidden, d]` (read in place; gate rows first).
        down: The experts' down weights `[E, d, hidden]` (read in place).
        top_k: k, the experts each token takes.
        norm_topk: Whether the k probabilities are divided by their sum.
        shared_gate: The shared expert's gate (an nn.Linear `[1, d]`, bias-free, or int8 weights), or None (ungated).
        gated: False: non-gated experts, `gate_up` holds only the up rows `[E, hidden, d]` and the hidden row is
            relu(up xn)^2 (Nemotron-H's; the block plan's `ffn_act` 1, the shared expert alike).
    """

    __slots__ = ("router", "gate_up", "down", "top_k", "norm_topk", "shared_gate", "gated")

    def __init__(self, router: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, top_k: int, norm_topk: bool,
                 shared_gate=None, gated: bool = True):
        self.router, self.gate_up, self.down, self.top_k = router, gate_up, down, int(top_k)
        self.norm_topk, self.shared_gate, self.gated = bool(norm_topk), shared_gate, bool(gated)


#: mixers with a compiled block kind of their own but no per-layer fast step (kind None from the block)
_OWN_KINDS = {KDA: "kda", Mamba2Block: "mamba2"}


class AttentionDescription:
    """A softmax-attention mixer as the compiled decode computes it, for one token at position p with the keys
    and values of the earlier tokens in a KV cache:

        q, k, v = q_proj(x), k_proj(x), v_proj(x)   (q_proj also yields the gate: `gate` "q")
        q, k = rope(q_norm(q), p), rope(k_norm(k), p)   per head; RoPE on the first `rot` channels (rotate-half)
        o_h = softmax(scale q_h . K_g) V_g   over the visible cached keys and the new one, g = h // (H / kv_heads)
        out = o_proj(o * act(gate))

    Attributes:
        q_proj, k_proj, v_proj, o_proj: nn.Linear layers (q_proj `[H * D]`, or `[H * 2D]` rows when the gate
            is "q": per head D query rows then D gate rows, Qwen3-Next's layout).
        heads, kv_heads, head_dim, head_dim_v: H, the key/value heads, D, Dv.
        scale: The score scale.
        window: A sliding window w (keys at distance < w), or None.
        q_norm, k_norm: RMSNorm modules (`weight` or None, `eps`), or None: per head (`weight` [D]), or over the
            whole projection when `norm_whole` (`weight` [H * D] / [kv_heads * D], before RoPE; OLMo-hybrid's).
        norm_whole: True when q_norm / k_norm normalise the whole projection, not each head.
        norm_offset: 1 when those norms scale by (1 + weight) (zero-centred weights), else 0.
        rot: The rotated channels per head (0: no RoPE; partial rotary: < D).
        inv_freq: float64 `[rot / 2]` frequencies.
        rope_f32: True: angles, cos and sin in float32 (times rope_scale), as transformers; False: in float64,
            as `layers/common.RotaryEmbedding`.
        rope_scale: transformers' attention_scaling (1.0 otherwise).
        gate: None, "proj" (`g_proj`, an nn.Linear `[H * Dv, d]`) or "q" (from q_proj).
        g_proj: The gate's projection (gate "proj").
        gate_act: "silu" or "sigmoid".
        kv_chunk: The KV cache's growth step (a new `KVCache`).
    """

    __slots__ = ("q_proj", "k_proj", "v_proj", "o_proj", "heads", "kv_heads", "head_dim", "head_dim_v", "scale",
                 "window", "q_norm", "k_norm", "norm_offset", "rot", "inv_freq", "rope_f32", "rope_scale", "gate",
                 "g_proj", "gate_act", "kv_chunk", "norm_whole")

    def __init__(self, **fields):
        for k in self.__slots__:
            setattr(self, k, fields.pop(k, None))
        if fields:
            raise TypeError(f"unknown fields {sorted(fields)}")


def describe_softmax(layer) -> Optional[AttentionDescription]:
    """linattn's `SoftmaxAttention` layer as an `AttentionDescription`, or None where the compiled step does not
    compute it (a subclass, a short convolution, an output norm, grouped value heads, modules that are not exactly
    the library's, `fast_decode` / `compiled_decode` off)."""
    if type(layer) is not SoftmaxAttention or not (layer.fast_decode and layer.compiled_decode):
        return None
    mods = layer._modules
    if layer.short_conv or mods.get("o_norm") is not None or layer.n_value_heads != layer.n_heads:
        return None
    lins = [mods[n] for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
    g = mods.get("g_proj")
    if any(type(m) is not nn.Linear and stored_weights(m) is None for m in lins + ([g] if g is not None else [])):
        return None
    qn, kn, rope = mods.get("q_norm"), mods.get("k_norm"), mods.get("rope")
    if (qn is None) != (kn is None) or any(m is not None and type(m) is not RMSNorm for m in (qn, kn)):
        return None
    if rope is not None and type(rope) is not RotaryEmbedding:
        return None
    inv = None
    if rope is not None:   # as RotaryEmbedding._build
        inv = 1.0 / (rope.base ** (torch.arange(0, rope.dim, 2, dtype=torch.float64) / rope.dim))
    return AttentionDescription(
        q_proj=lins[0], k_proj=lins[1], v_proj=lins[2], o_proj=lins[3], heads=layer.n_heads,
        kv_heads=layer.n_kv_heads, head_dim=layer.head_dim, head_dim_v=layer.head_dim_v, scale=layer.scale,
        window=layer.window, q_norm=qn, k_norm=kn, norm_offset=0, rot=0 if rope is None else rope.dim,
        inv_freq=inv, rope_f32=False, rope_scale=1.0, gate=None if g is None else "proj", g_proj=g,
        gate_act=layer.gate_act, kv_chunk=layer.kv_chunk)


class ModelDescription:
    """What a whole-model decode plan needs: ``x = embed[ids]``, the blocks, ``logits = head(norm(x))``.

    Attributes:
        embed: The token embedding (an nn.Embedding).
        blocks: One `BlockDescription` per block, in order.
        norm: The final RMSNorm, or None.
        head: The output projection (an nn.Linear without bias `[vocab, d]`), or None for the tied embedding.
    """

    __slots__ = ("embed", "blocks", "norm", "head")

    def __init__(self, embed, blocks: Sequence[BlockDescription], norm=None, head=None):
        self.embed, self.blocks, self.norm, self.head = embed, list(blocks), norm, head


# -- the guard ---------------------------------------------------------------------------------------------------
_version_of = operator.attrgetter("_version")
_fused_value = operator.attrgetter("_value")
_fast_on, _compiled_on = operator.attrgetter("fast_decode"), operator.attrgetter("compiled_decode")
_data_ptr = torch.Tensor.data_ptr
_Handle = RemovableHandle   # (its class counter numbers every hook handle made)


def _probe_dict_version():
    """torch's reader of a dict's version tag (dynamo's guards use it: a number that changes whenever the dict is
    written), or None where this torch or Python lacks it or it does not behave so (then every token looks up
    every entry)."""
    fn = getattr(getattr(getattr(torch._C, "_dynamo", None), "guards", None), "dict_version", None)
    if fn is None:
        return None
    try:   # (a private function: checked on a dict of our own before it is trusted)
        d = {"k": object()}
        v0 = fn(d)
        v1 = fn(d) if d["k"] is not None else None
        d["k"] = object()
        ok = type(v0) is int and v0 == v1 != fn(d)
    except Exception:
        return None
    return fn if ok else None


_dict_version = _probe_dict_version()
# configuration values a plan reads from a module's __dict__ (mixers, norms), checked by identity on every token
_CONFIG_KEYS = ("scale", "l2norm_convention", "beta_mode", "q_l2norm", "qk_l2norm", "exact", "gate", "gate_act",
                "normalize", "eps", "feature_map", "_gamma", "norm_group_size", "short_conv", "causal", "_fused",
                "plain", "residual", "qk_norm", "window", "n_kv_heads", "kv_chunk",
                # KDA, Mamba2 and their gated norms
                "gate_lower_bound", "dt_limit", "d_per_channel", "gate_before_norm", "group_size", "activation",
                "qk_activation", "activation_without_conv", "use_beta", "allow_negative_eigenvalues",
                # a mixture of experts' router
                "top_k", "norm_topk_prob", "num_experts",
                # Granite's multipliers
                "embedding_multiplier", "residual_multiplier")


class PlanGuard:
    """Whether a plan still describes the modules it was built from, cheap enough for every token (`valid`: a few
    `map` passes over prepared lists, no Python loop). A plan is invalid when, since it was built:

    * a submodule of `owner` or of `modules` was replaced, or a parameter / buffer that was None was set (identity);
    * a parameter or buffer was replaced, or its storage was (`.data =`, `.to()`: the guard holds the old storages,
      so a new tensor cannot take their address);
    * a tensor the plan copied (fused projections, converted or derived vectors) was updated in place (its
      version; the tensors the plan reads in place, `direct`, need no check);
    * a configuration value (`_CONFIG_KEYS` in a module's __dict__) was replaced, or a mixer's fused weights were
      (`LanguageModel.new_cache` clears them, for writes through `p.data`);
    * a mixer's `fast_decode` or `compiled_decode` was switched off;
    * a forward hook was registered on one of `modules` or globally (`owner`'s own hooks run in its `__call__`);
    * the thread count, or `owner.training`, changed.

    The batch size is not checked: plans take it per call.

    Cost: after a decoded token has streamed every weight through the caches, each object the check reads is a
    cache miss, so `valid` reads as few as it can: the entries (identity) are looked up only when one of their dicts
    was written since the last look (the dicts' version tags, `torch._C._dynamo.guards.dict_version`, where this
    torch has it); the modules' hook dicts only when a hook handle was made anywhere since the last look (torch
    numbers every `RemovableHandle`; a hook registered through the module API takes one); and the objects it does
    read are first read in one pass that the CPU overlaps (`tuple` of them: a reference count write each).

    Where csrc/guard.c is built and this torch's and Python's layouts are recognised (`cpu/guard.py`), the common
    case is one call first (`words`): every dict's version tag and the machine words each tensor's data pointer and
    version are made of, compared with their values at the build; all equal, only the flags above are left to read.
    Any difference runs the Python check (`checked`), which decides."""

    __slots__ = ("owner", "training", "nthreads", "idicts", "inames", "iobjs", "tensors", "ptrs", "vtensors",
                 "versions", "aliases", "hookdicts", "mixers", "fusedobjs", "fused", "touched", "handles", "dicts",
                 "dversions", "prefetch", "words")

    def __init__(self, owner: nn.Module, modules: Sequence[nn.Module], mixers: Sequence[nn.Module], direct=()):
        modules = list(dict.fromkeys(m for m in modules if m is not None and m is not owner))
        self.owner, self.training, self.nthreads = owner, owner.training, torch.get_num_threads()
        tensors = [(h, k, t) for m in modules for h in (m._parameters, m._buffers) for k, t in h.items()
                   if t is not None]
        ident = [(m._modules, k, c) for m in [owner] + modules for k, c in m._modules.items()]
        ident += [(h, k, t) for m in modules for h in (m._parameters, m._buffers) for k, t in h.items() if t is None]
        ident += tensors + [(m.__dict__, k, m.__dict__[k]) for m in [owner] + modules for k in _CONFIG_KEYS
                            if k in m.__dict__]
        self.idicts, self.inames, self.iobjs = (list(z) for z in zip(*ident)) if ident else ([], [], [])
        # (an empty tensor holds nothing a plan reads or copies: its identity, above, is all there is to check;
        # skipping its pointer and version saves two cache misses a token each, QuantizedLinear's `_float_like`)
        self.tensors = [t for _, _, t in tensors if t.numel()]
        self.ptrs = list(map(_data_ptr, self.tensors))
        direct = set(direct) - {None}
        self.vtensors = [t for t in self.tensors if t.data_ptr() not in direct]
        self.versions = list(map(_version_of, self.vtensors))
        self.aliases = [t.detach() for t in self.tensors]   # keeps the storages alive
        self.hookdicts = [h for m in modules for h in (m._forward_hooks, m._forward_pre_hooks)]
        self.mixers = list(mixers)
        self.fusedobjs = [m._fused for m in self.mixers if getattr(m, "_fused", None) is not None]
        self.fused = list(map(_fused_value, self.fusedobjs))
        self.dicts = list({id(d): d for d in self.idicts}.values())
        self.dversions = None if _dict_version is None else list(map(_dict_version, self.dicts))
        self.touched = list({id(o): o for o in (*self.dicts, *self.tensors, *self.mixers, *self.fusedobjs)}.values())
        self.handles = -1   # (no hook dict looked at yet)
        self.prefetch = _prefetch.prefetcher(self.lines)
        # (every dict version, data pointer and version below as machine words compared in one call: cpu/guard.py)
        self.words = _guard.word_guard(self.dicts, _dict_version, self.tensors, self.vtensors)

    def lines(self) -> list:
        """The addresses `valid` reads, in its order (`cpu/prefetch.py`): the objects of its touch pass, the dicts'
        version tags and the numbers they are compared with, each tensor's objects (its TensorImpl, StorageImpl and,
        where the plan copied it, its version counter) and the pointers and versions they are compared with."""
        out = [id(self.owner), id(self.owner.__dict__)] + _prefetch.list_addresses(self.touched)
        out += [a for d in self.dicts for a in (id(d), id(d) + 31)] + _prefetch.list_addresses(self.dicts)
        out += _prefetch.list_addresses(self.dversions or [])
        copied = set(map(id, self.vtensors))
        for t in self.tensors:
            out += _prefetch.tensor_addresses(t, id(t) in copied)
        for items in (self.tensors, self.ptrs, self.vtensors, self.versions, self.fusedobjs, self.fused, self.mixers):
            out += _prefetch.list_addresses(items)
        return out

    def valid(self) -> bool:
        """Whether nothing the plan depends on changed (class docstring)."""
        if (self.nthreads != torch.get_num_threads() or self.training is not self.owner.training
                or _fast.GLOBAL_HOOKS[0] or _fast.GLOBAL_HOOKS[1]):
            return False
        handles = _Handle.next_id
        if handles != self.handles:
            if any(self.hookdicts):
                return False
            self.handles = handles
        if self.words is not None and self.words():   # (no dict written, every pointer and version as built)
            return self._flags()
        ok = self.checked()
        if ok and self.words is not None:
            self.words.dicts_again(self.dversions)
            if not self.words():   # (a change the words see and the check does not: the check alone from now on)
                self.words = None
        return ok

    def _flags(self) -> bool:
        return (all(map(operator.is_, map(_fused_value, self.fusedobjs), self.fused))
                and all(map(_fast_on, self.mixers)) and all(map(_compiled_on, self.mixers)))

    def checked(self) -> bool:
        """`valid`'s dicts, data pointers and versions read by Python (the reference the words only shortcut), then
        the fused weights and mixers' flags."""
        if self.prefetch is not None:
            self.prefetch()   # (every line read below asked for at once: the misses overlap; no result changes)
        tuple(self.touched)   # (the cache misses of every object below, overlapped)
        if self.dversions is None or list(map(_dict_version, self.dicts)) != self.dversions:
            try:
                if not all(map(operator.is_, map(operator.getitem, self.idicts, self.inames), self.iobjs)):
                    return False
            except KeyError:
                return False
            if _dict_version is not None:   # (every entry as built: these versions stand for them until a write)
                self.dversions = list(map(_dict_version, self.dicts))
                if self.prefetch is not None:   # (the new numbers are new objects)
                    self.prefetch = _prefetch.prefetcher(self.lines)
        return (list(map(_data_ptr, self.tensors)) == self.ptrs
                and list(map(_version_of, self.vtensors)) == self.versions and self._flags())


def _slot(owner: nn.Module, name: str, cls):
    slot = owner.__dict__.get(name)
    if type(slot) is not cls:
        slot = owner.__dict__[name] = cls()
    return slot


# -- ELA's maps: log-space (block kind 3, csrc/decode_log.h), linear-space (kind 6, csrc/decode_ela.h) ----------
#: the log-space maps the compiled decode computes itself, by class -> the plan's `ela_map` code
LOG_MAPS = {HadamardExp: 0}
#: ELA's linear-space maps (features wider than K: not the linear kind's elementwise maps) -> `ela_map`
ELA_MAPS = {SumSqEuclid: 1, SubSqEuclid: 2, MagnitudeDirection: 3}
#: the columns a linear layer's state adds to V in the step's buffers: z; z and the log-scale
_STATE_EXTRA = {"linear": 1, "linear_log": 2}


def _ela_map(layer) -> bool:
    """Whether a LinearAttention layer's map is one of ELA's the compiled decode computes (kind 3 or 6; gates none,
    RetNet's, the scalar one)."""
    return (type(layer.feature_map) in LOG_MAPS or type(layer.feature_map) in ELA_MAPS) and layer.gate != "diagonal"


def _ela_fields(p, layer, cdt: torch.dtype, addr) -> None:
    """Plan p as block kind 3 (a log-space map) or 6 (a linear-space one) for a layer with one of ELA's maps: the map,
    normalisation and gate (RetNet's as log gamma for kind 3, the operator's log-gate, and as the decay for kind 6;
    the scalar gate as the linear kind's)."""
    HV, fm = layer.n_value_heads, type(layer.feature_map)
    p.kind, p.ela_map = (3, LOG_MAPS[fm]) if fm in LOG_MAPS else (6, ELA_MAPS[fm])
    p.normalize, p.eps = int(bool(layer.normalize)), float(layer.eps)
    if layer.gate == "retnet":
        p.gate_kind = 1
        if p.kind == 3:
            p.log_decay = addr(torch.log(layer._gamma_on(torch.device("cpu")).to(cdt)).reshape(-1).expand(HV))
        else:
            p.decay = addr(_fast.linear_decay(layer, cdt, torch.device("cpu")).reshape(-1).expand(HV))
    elif layer.gate == "scalar":
        p.gate_kind = 2
        p.neg_a = addr(mamba_neg_a(layer.A_log, cdt, layer).reshape(-1).expand(HV))
        p.dt_bias = addr(layer.dt_bias.reshape(-1).expand(HV))


def _log_state_in(st, shape, cdt: torch.dtype) -> Optional[torch.Tensor]:
    """[kv | z | log-scale] `[B, HV, Kf, V + 2]` (contiguous, cdt) of a log-space layer's state, or None when st is
    not a state of that shape (B, HV, Kf, V) on the CPU."""
    B, HV, Kf, V = shape
    if not (isinstance(st, LinearAttentionState) and isinstance(st.log_scale, torch.Tensor)
            and st.kv.shape == (B, HV, Kf, V) and st.z.shape == (B, HV, Kf) and st.log_scale.shape == (B, HV, Kf)
            and st.kv.device.type == "cpu" and st.offset.shape == (B,)):
        return None
    return torch.cat([st.kv, st.z.unsqueeze(-1), st.log_scale.unsqueeze(-1)], -1).to(cdt)


# -- one block ---------------------------------------------------------------------------------------------------
# the BlockPlan fields that hold data addresses
PLAN_POINTERS = ("n1w", "W", "Wb", "cw", "cb", "alpha", "neg_a", "dt_bias", "decay", "nw", "Wo", "n2w", "Wgu", "bgu",
                  "Wd", "bd", "Wq", "bq", "Wk", "bk", "Wv", "bv", "Wg", "qnw", "knw") + tuple(
                  f"sc_{n}" for n in _cpu_decode.WEIGHT_MATRICES) + (
                  "Wf", "Wg2", "bg2", "Dsk", "bo") + tuple(f"sc_{n}" for n in _cpu_decode.KDA_MATRICES) + ("log_decay",)
# (a mixture of experts' router, experts and shared gate)
PLAN_POINTERS += ("Wr", "Weg", "Wed", "Wsg")
# (latent attention's and router mode 2's)
PLAN_POINTERS += ("mla_Wkb", "mla_kvnw", "mla_Wqb", "mla_qnw", "e_bias")


def plan_pointers(p) -> set:
    """Every data address block plan p reads: its `PLAN_POINTERS` fields and its fused products' parts."""
    out = {getattr(p, f) for f in PLAN_POINTERS}
    for name in _cpu_decode.FUSED_PRODUCTS:
        out.update(getattr(p, f"parts_{name}")[:getattr(p, f"nparts_{name}")])
    return out


class BlockPlanSlot:
    """A block's whole-block decoding plan (`cpu/decode.BlockPlan`), its `PlanGuard`, the compiled function and
    the tensors the plan points into. Not state: a copy or a pickle gets an empty slot, rebuilt on first use."""

    __slots__ = ("plan", "fn", "guard", "wdtype")

    def __init__(self):
        self.plan = self.fn = self.guard = self.wdtype = None

    def __reduce__(self):
        return (BlockPlanSlot, ())


def _compiled_mixer(desc: BlockDescription, wdt: torch.dtype):
    """The mixer's fused projections when the compiled block step covers it in weight dtype wdt, else None."""
    layer, kind = desc.mixer, desc.kind
    if kind is None or kind != layer.fast_step_kind() or layer.rope is not None or not (
            layer.fast_decode and layer.compiled_decode):
        return None
    if kind == "linear" and ((type(layer.feature_map) not in _fast.COMPILED_MAPS and not _ela_map(layer))
                             or layer.gate == "diagonal"):
        return None
    if not _ffn_usable(desc, wdt):
        return None
    lins = _fast.usable_projections(layer, wdt, kind, accept=lambda m: plan_linear(m, wdt))
    if lins is None or _fused_format(lins) is None:
        return None
    return lins


def stored_format(linear) -> tuple:
    """(format, int4 group) of a linear layer's matrix as stored: ("plan", 0) for a float one, else its
    `stored_weights`' mode ("int8", "int4", ...) and group."""
    got = stored_weights(linear)
    return ("plan", 0) if got is None else (got[0], got[3])


def _fused_format(lins):
    """The stored format the fused projections share (`stored_format`); None when they differ (the fused product
    has one format)."""
    fmts = {stored_format(m) for m in lins}
    return next(iter(fmts)) if len(fmts) == 1 else None


def stacked_stored(lins, rows: Optional[torch.Tensor] = None) -> tuple:
    """(integers, scales) of int8 / int4 linears of one format stacked by rows in order (regrouped by the row
    index `rows` when given; int4's group-wise scales follow their rows): a copy the plan keeps, its integers on
    huge pages (every decoded token reads them)."""
    parts = [stored_weights(m) for m in lins]
    q, scales = (torch.cat([w[i].detach() for w in parts]) for i in (1, 2))
    if rows is not None:
        q, scales = q.index_select(0, rows), scales.index_select(0, rows)
    return _hugepages.place_copy(q.contiguous()), scales.contiguous()


def _set_parts(p, name: str, parts, wdt: torch.dtype, addr) -> None:
    """Points fused product `name` of plan p at its parts in place (`parts_<name>`, `rows_<name>`; `name` at the
    first). Where the plan cannot read them so (not one of `FUSED_PRODUCTS`, more than `PLAN_PARTS` parts, a part
    in another dtype or not contiguous) they are concatenated once into a copy the plan keeps."""
    if len(parts) == 1 or len(parts) > _cpu_decode.PLAN_PARTS or name not in _cpu_decode.FUSED_PRODUCTS or any(
            w.dtype != wdt or not w.is_contiguous() for w in parts):
        setattr(p, name, addr(parts[0] if len(parts) == 1 else torch.cat(parts), wdt))
        return
    ptrs, rows = getattr(p, f"parts_{name}"), getattr(p, f"rows_{name}")
    for i, w in enumerate(parts):
        ptrs[i], rows[i] = addr(w, wdt), w.shape[0]
    setattr(p, f"nparts_{name}", len(parts))
    setattr(p, name, ptrs[0])


#: plan matrices the compiled decode reads by rows (decode_mla.h), never through a whole product's steps: their
#: int4-a8 scales stay by rows
_SCALES_BY_ROWS = frozenset({"mla_Wkb"})


def plan_scales(name: str, mode: str, scales: torch.Tensor) -> torch.Tensor:
    """The scales plan matrix `name` of stored format `mode` reads: int4-a8's in the order of the product's steps
    (a copy, cpu/qlayout.step_scales, on huge pages: read every token), any other as stored."""
    if mode == "int4_a8" and name not in _SCALES_BY_ROWS:
        return _hugepages.place_copy(_step_scales(scales))
    return scales


def set_weight(p, name: str, linear: nn.Module, wdt: torch.dtype, addr) -> None:
    """Points plan field `name` (and its format, scales and group fields) at linear's matrix as stored (a
    `StackedRows`: at its parts)."""
    if type(linear) is StackedRows:
        _set_parts(p, name, linear.parts, wdt, addr)
        return
    got = stored_weights(linear) if type(linear) is not nn.Linear else None
    if got is None:
        setattr(p, name, addr(linear.weight, wdt))
        return
    mode, q, scales, group = got
    setattr(p, name, addr(q, q.dtype))
    setattr(p, f"fmt_{name}", _cpu_decode.WEIGHT_FORMATS[mode])
    setattr(p, f"sc_{name}", addr(plan_scales(name, mode, scales), torch.bfloat16))
    setattr(p, f"grp_{name}", group)


def _fused_quantized(layer, lins, cdt):
    """(convs, q, scales, bias, cw, cb) for projections stored quantized, as `_fast.fused_weights` gives for float
    ones: their integer weights and scales concatenated by rows (copies, kept by the plan), the biases (zeros where
    one has none) in cdt."""
    mods = layer._modules
    convs = (mods["q_conv"], mods["k_conv"], mods["v_conv"]) if layer.short_conv else ()
    q, scales = stacked_stored(lins)
    b = None
    if any(m.bias is not None for m in lins):
        b = torch.cat([m.bias.to(cdt) if m.bias is not None else torch.zeros(m.out_features, dtype=cdt)
                       for m in lins])
    cw = torch.cat([c.weight.detach() for c in convs]) if convs else None
    cb = torch.cat([c.bias.detach() for c in convs if c.bias is not None]) if convs and convs[0].bias is not None \
        else None
    return convs, q, scales, b, cw, cb


def _fused_input(layer, lins, cdt):
    """(convs, w, scales, bias, cw, cb): the block's input projections fused by rows, quantized ones as stored
    (concatenated; scales their scales) or float ones read in place (w a `StackedRows`, scales None), with the
    biases and conv weights fused by the layer's `FusedParams` (small; a `p.data` write there is seen through it)."""
    if type(lins[0]) is not nn.Linear:
        return _fused_quantized(layer, lins, cdt)
    mods = layer._modules
    convs = (mods["q_conv"], mods["k_conv"], mods["v_conv"]) if layer.short_conv else ()
    _, b, cw, cb = layer._fused.get([], [m.bias if m.bias is not None else m.out_features for m in lins]
                                    if any(m.bias is not None for m in lins) else [],
                                    [c.weight for c in convs], [c.bias for c in convs if c.bias is not None])
    return convs, StackedRows([m.weight for m in lins]), None, b, cw, cb


def _rows(w) -> int:
    """The rows of a fused input projection as `_fused_input` returns it."""
    return w.out_features if type(w) is StackedRows else w.shape[0]


def _point_input(p, addr, lins, wdt, convs, w, scales, b, cw, cb):
    """Points plan p's fused input projection (W, Wb, and the stored format when scales is given) and its short
    convolution (cw, cb, when cw is given) at what `_fused_input` returned."""
    if scales is None:
        set_weight(p, "W", w, wdt, addr)
    else:
        p.W = addr(w, w.dtype)
    p.Wb = addr(b)
    if scales is not None:
        mode, _, _, group = stored_weights(lins[0])
        p.fmt_W, p.sc_W, p.grp_W = _cpu_decode.WEIGHT_FORMATS[mode], addr(plan_scales("W", mode, scales),
                                                                           torch.bfloat16), group
    if convs:
        p.cw, p.cb = addr(cw.view(cw.shape[0], -1)), addr(cb)


def _new_block_plan(desc: BlockDescription, B: int, d: int, wdt: torch.dtype):
    """A BlockPlan (holding what it points into in `plan.keep`) for the described block at batch B with weights in
    wdt, or None when the compiled block step does not cover it."""
    if (desc.residual != "prenorm" or desc.ffn not in (None, "swiglu") or compute_dtype(wdt) is None
            or not _cpu_decode.available()):
        return None
    if desc.kind == "softmax":
        return new_softmax_plan(desc, B, d, wdt)
    if desc.kind in _OWN_PLANS:
        if not (_ffn_usable(desc, wdt) and desc.mixer.fast_decode and desc.mixer.compiled_decode) or _fast.hooked(
                *desc.mixer.modules()):
            return None
        return _OWN_PLANS[desc.kind](desc, B, d, wdt)
    lins = _compiled_mixer(desc, wdt)
    if lins is None or _fast.hooked(*desc.mixer.modules()):
        return None
    layer, cdt, keep = desc.mixer, compute_dtype(wdt), []
    addr = plan_addresser(keep, cdt)
    convs, w, scales, b, cw, cb = _fused_input(layer, lins, cdt)
    H, HV, K, V = layer.n_heads, layer.n_value_heads, layer.head_dim, layer.head_dim_v
    down = desc.ffn_down
    p = _cpu_decode.BlockPlan(B=B, H=H, HV=HV, K=K, V=V, d=d, ny=_rows(w), KC=convs[0].kernel_size if convs else 0,
                              hid=down.in_features if down is not None else 0, kind=0 if desc.kind == "delta" else 1,
                              conv_act=int(bool(convs) and convs[0].activation is not None), scale=layer.scale,
                              nthreads=max(1, torch.get_num_threads()), has_ffn=int(down is not None),
                              wbf16=int(wdt == torch.bfloat16))
    _point_input(p, addr, lins, wdt, convs, w, scales, b, cw, cb)
    if desc.kind == "delta":
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
    elif _ela_map(layer):
        _ela_fields(p, layer, cdt, addr)
    else:
        fm = layer.feature_map
        p.fmap, p.normalize = _cpu_decode.FEATURE_MAPS[fm.name], int(bool(layer.normalize))
        p.nonneg, p.eps = int(isinstance(fm, _fast.NONNEGATIVE_MAPS)), float(layer.eps)
        if layer.gate == "retnet":
            p.gate_kind, p.decay = 1, addr(_fast.linear_decay(layer, cdt, torch.device("cpu")).reshape(-1).expand(HV))
        elif layer.gate == "scalar":
            p.gate_kind = 2
            p.neg_a = addr(mamba_neg_a(layer.A_log, cdt, layer).reshape(-1).expand(HV))
            p.dt_bias = addr(layer.dt_bias.reshape(-1).expand(HV))
    has_norm, nw, neps = _fast.output_norm_args(layer, cdt)
    p.has_norm, p.nw, p.norm_eps = int(has_norm), addr(nw), neps
    p.has_gate = int(layer._modules.get("g_proj") is not None)
    set_weight(p, "Wo", layer._modules["o_proj"], wdt, addr)
    Kf = K if desc.kind == "delta" else layer.feature_map.feature_dim(K)
    p.spec = _state_spec("linear_log" if p.kind == 3 else desc.kind, HV, Kf, V, p.KC, (H * K, H * K, HV * V))
    return finish_block_plan(p, desc, addr, keep, wdt)


#: the `LayerCache.conv` streams of a mixer's windows: q | k | v (linattn's AttentionBase layers), or Mamba2's "in"
QKV_CONV = ("q", "k", "v")


def _state_spec(kind: str, HV: int, Kf: int, V: int, KC: int, sizes, keys=QKV_CONV) -> tuple:
    """What a recurrent block plan reads from and writes to its cache (`state_layout`'s spec): the state's kind
    ("delta": a tensor [B, HV, Kf, V]; "linear": a `LinearAttentionState`, [kv | z] [B, HV, Kf, V + 1];
    "linear_log": one with a log scale, [kv | z | log-scale] [B, HV, Kf, V + 2]), the conv window's width KC (0:
    none), its channels per entry and the entries' keys."""
    return (kind, HV, Kf, V, KC, tuple(sizes), tuple(keys))


def _ffn_usable(desc: BlockDescription, wdt: torch.dtype) -> bool:
    """Whether the block's FFN matrices (if any) are read by a plan in wdt."""
    return all(m is None or (plan_linear(m, wdt) and (type(m) is not nn.Linear or m.bias is None
                                                       or m.bias.dtype == wdt))
               for m in (desc.ffn_gate_up, desc.ffn_down))


def _linear_ok(m, wdt: torch.dtype, shape, bias: Optional[bool] = None) -> bool:
    """m is a linear layer the plan reads in wdt (`plan_linear`) of shape [out, in]; bias True / False: must have
    one / none (None: either)."""
    if m is None or not plan_linear(m, wdt) or (m.out_features, m.in_features) != tuple(shape):
        return False
    has_b = getattr(m, "bias", None) is not None
    return bias is None or has_b == bias


def _conv_ok(c, dim: int, wdt: torch.dtype) -> bool:
    return (type(c) is ShortConv and c.dim == dim and c.weight.dtype == wdt and c.activation in (None, "silu")
            and not _fast.hooked(c))


def _new_kda_plan(desc: BlockDescription, B: int, d: int, wdt: torch.dtype):
    """A BlockPlan of kind 4 (KDA, csrc/decode_kda.h), or None where the compiled step does not compute the layer:
    the layer's defaults for q / k / v and beta (silu features, beta = sigmoid, L2 q / k norm), no RoPE, the per-head
    output norm (plain, or sigmoid-gated) or none."""
    layer, mods = desc.mixer, desc.mixer._modules
    H, HV, K, V = layer.n_heads, layer.n_value_heads, layer.head_dim, layer.head_dim_v
    if (layer.rope is not None or not layer._plain_features or not layer.use_beta or layer.allow_negative_eigenvalues
            or not layer.qk_l2norm or layer.norm_group_size is not None or layer.gate_act not in ("silu", "sigmoid")):
        return None
    norm, g, f = mods.get("o_norm"), mods.get("g_proj"), mods["f_proj"]
    if norm is not None and (type(norm) is not GatedRMSNorm or norm.gate_before_norm or norm.group_size is not None
                             or norm.gate_act != layer.gate_act):
        return None
    if not (type(f) is nn.Sequential and len(f) == 2 and _linear_ok(f[0], wdt, (layer.gate_rank, d), False)
            and _linear_ok(f[1], wdt, (HV * K, layer.gate_rank), False)):
        return None
    g1 = g2 = None
    if g is not None:
        if type(g) is nn.Sequential:
            if not (len(g) == 2 and _linear_ok(g[0], wdt, (g[0].out_features, d), False)
                    and _linear_ok(g[1], wdt, (HV * V, g[0].out_features), True)):
                return None
            g1, g2 = g
        elif _linear_ok(g, wdt, (HV * V, d), False):
            g1 = g
        else:
            return None
    lins = (mods["q_proj"], mods["k_proj"], mods["v_proj"], mods["b_proj"], f[0]) + ((g1,) if g1 is not None else ())
    shapes = [(H * K, d), (H * K, d), (HV * V, d), (HV, d)]
    if not all(_linear_ok(m, wdt, s) for m, s in zip(lins, shapes)) or not _linear_ok(mods["o_proj"], wdt,
                                                                                      (d, HV * V), False):
        return None
    if _fused_format(lins) is None:
        return None
    convs = (mods["q_conv"], mods["k_conv"], mods["v_conv"]) if layer.short_conv else ()
    if convs and not (all(_conv_ok(c, n, wdt) for c, n in zip(convs, (H * K, H * K, HV * V)))
                      and len({(c.kernel_size, c.activation, c.bias is None) for c in convs}) == 1):
        return None
    cdt, keep = compute_dtype(wdt), []
    addr = plan_addresser(keep, cdt)
    convs, w, scales, b, cw, cb = _fused_input(layer, lins, cdt)
    p = _cpu_decode.BlockPlan(B=B, H=H, HV=HV, K=K, V=V, d=d, ny=_rows(w), KC=convs[0].kernel_size if convs else 0,
                              hid=desc.ffn_down.in_features if desc.ffn_down is not None else 0, kind=4,
                              conv_act=int(bool(convs) and convs[0].activation is not None), scale=layer.scale,
                              nthreads=max(1, torch.get_num_threads()), has_ffn=int(desc.ffn_down is not None),
                              wbf16=int(wdt == torch.bfloat16), rank_f=layer.gate_rank,
                              rank_g=g1.out_features if g2 is not None else 0,
                              gate_sig=int(layer.gate_act == "sigmoid"),
                              l2eps=L2NORM_EPS, l2conv=L2NORM_CONVENTIONS.index(layer.l2norm_convention))
    _point_input(p, addr, lins, wdt, convs, w, scales, b, cw, cb)
    set_weight(p, "Wf", f[1], wdt, addr)
    if g2 is not None:
        set_weight(p, "Wg2", g2, wdt, addr)
        p.bg2 = addr(g2.bias)
    p.neg_a, p.dt_bias = addr(mamba_neg_a(layer.A_log, cdt, layer)), addr(layer.dt_bias)
    if layer.gate_lower_bound is not None:
        p.gate_lb_on, p.gate_lb = 1, layer.gate_lower_bound
    has_norm, nw, neps = _fast.output_norm_args(layer, cdt)
    p.has_norm, p.nw, p.norm_eps, p.has_gate = int(has_norm), addr(nw), neps, int(g is not None)
    set_weight(p, "Wo", mods["o_proj"], wdt, addr)
    p.spec = _state_spec("delta", HV, K, V, p.KC, (H * K, H * K, HV * V))
    return finish_block_plan(p, desc, addr, keep, wdt)


def _new_mamba2_plan(desc: BlockDescription, B: int, d: int, wdt: torch.dtype):
    """A BlockPlan of kind 5 (Mamba2's mixer, csrc/decode_mamba2.h), or None where the compiled step does not compute
    the layer (RoPE on B / C, modules that are not exactly the library's)."""
    layer, mods = desc.mixer, desc.mixer._modules
    H, P, G, N = layer.n_heads, layer.head_dim, layer.n_groups, layer.state_size
    DI, CD = layer.d_inner, layer.conv_dim
    conv, norm, inp, out = mods.get("conv"), mods.get("norm"), mods["in_proj"], mods["o_proj"]
    if layer.rope is not None or not (_linear_ok(inp, wdt, (DI + CD + H, d)) and _linear_ok(out, wdt, (d, DI))):
        return None
    if conv is not None and not _conv_ok(conv, CD, wdt):
        return None
    if norm is not None and (type(norm) is not GatedRMSNorm or norm.gate_act != "silu"
                             or (norm.weight is not None and norm.weight.shape != (DI,))
                             or (norm.group_size or DI) != DI // G):
        return None
    cdt, keep = compute_dtype(wdt), []
    addr = plan_addresser(keep, cdt)
    p = _cpu_decode.BlockPlan(B=B, H=H, HV=H, K=N, V=P, d=d, ny=DI + CD + H, KC=conv.kernel_size if conv else 0,
                              hid=desc.ffn_down.in_features if desc.ffn_down is not None else 0, kind=5,
                              conv_act=int(conv is not None and conv.activation is not None),
                              nthreads=max(1, torch.get_num_threads()), has_ffn=int(desc.ffn_down is not None),
                              wbf16=int(wdt == torch.bfloat16), n_groups=G, d_per_channel=int(layer.d_per_channel),
                              dt_lo=layer.dt_limit[0], dt_hi=layer.dt_limit[1],
                              norm_mode=0 if norm is None else 1 if norm.gate_before_norm else 2)
    set_weight(p, "W", inp, wdt, addr)
    p.Wb = addr(inp.bias)
    if conv is not None:
        p.cw, p.cb = addr(conv.weight.detach().view(CD, -1)), addr(conv.bias)
    p.neg_a, p.dt_bias, p.Dsk = addr(mamba_neg_a(layer.A_log, cdt, layer)), addr(layer.dt_bias), addr(layer.D)
    if norm is not None:
        p.nw, p.norm_eps = addr(norm.weight), float(norm.eps)
    set_weight(p, "Wo", out, wdt, addr)
    p.bo = addr(out.bias)
    p.spec = _state_spec("linear", H, N, P, p.KC, (CD,), ("in",))
    return finish_block_plan(p, desc, addr, keep, wdt)


#: the builders of the block kinds that have no per-layer fast step
_OWN_PLANS = {"kda": _new_kda_plan, "mamba2": _new_mamba2_plan}


def finish_block_plan(p, desc: BlockDescription, addr, keep: list, wdt: torch.dtype):
    """The block's norms and FFN into plan p (addr: a tensor's address in the plan, kept in keep)."""
    up, down = desc.ffn_gate_up, desc.ffn_down
    p.n1w, p.n1eps = addr(desc.norm1.weight), float(desc.norm1.eps)
    p.postnorm = int(desc.residual == "postnorm")
    if down is not None:
        p.n2w, p.n2eps = addr(desc.norm2.weight), float(desc.norm2.eps)
        set_weight(p, "Wgu", up, wdt, addr)
        set_weight(p, "Wd", down, wdt, addr)
        p.bgu, p.bd = addr(up.bias), addr(down.bias)
    if desc.ffn == "moe":
        _set_moe(p, desc.moe, wdt, addr)
    elif desc.ffn == "relu2":   # (a non-gated relu^2 MLP, Nemotron-H's: Wgu holds the up rows only)
        p.ffn_act = 1
    p.keep = keep   # the plan holds what it points into (a call in flight keeps it alive)
    rebuilds[0] += 1
    return p


def _set_moe(p, moe: MoEDescription, wdt: torch.dtype, addr) -> None:
    """A mixture-of-experts feed-forward (ffn_kind 1) into plan p: the router, the experts' weights and the shared
    gate read in place (their stored dtype must be wdt: `moe_usable`)."""
    E, rows, _ = moe.gate_up.shape
    p.ffn_kind, p.n_experts, p.top_k, p.moe_hid = 1, E, moe.top_k, rows // 2 if moe.gated else rows
    p.ffn_act = 0 if moe.gated else 1
    p.norm_topk, p.has_ffn = int(moe.norm_topk), 1
    p.Wr, p.Weg, p.Wed = addr(moe.router, wdt), addr(moe.gate_up, wdt), addr(moe.down, wdt)
    if moe.shared_gate is not None:   # (its format too: a quantized gate, `set_weight`)
        set_weight(p, "Wsg", moe.shared_gate, wdt, addr)


def moe_usable(moe: MoEDescription, d: int, wdt: torch.dtype) -> bool:
    """Whether the compiled plan reads the described experts as they are: contiguous weights of dtype wdt and the
    shapes `MoEDescription` gives, 1 <= k <= E."""
    E = moe.router.shape[0] if moe.router.dim() == 2 else 0
    hid = moe.down.shape[-1] if moe.down.dim() == 3 else 0
    return (E > 0 and hid > 0 and 1 <= moe.top_k <= E and tuple(moe.router.shape) == (E, d)
            and tuple(moe.gate_up.shape) == (E, (2 if moe.gated else 1) * hid, d)
            and tuple(moe.down.shape) == (E, d, hid)
            and all(t.dtype == wdt and t.is_contiguous() and t.device.type == "cpu"
                    for t in (moe.router, moe.gate_up, moe.down))
            and (moe.shared_gate is None or (plan_linear(moe.shared_gate, wdt) and moe.shared_gate.bias is None
                                             and tuple(moe.shared_gate.weight.shape) == (1, d))))


def plan_addresser(keep: list, cdt: torch.dtype):
    """`addr(t, dtype=cdt)`: the data address of t in dtype (a vector: the compute dtype; a matrix: pass its stored
    dtype), converted and made contiguous where needed; what it points into is kept alive in keep (the plan's)."""
    def addr(t, dtype=cdt):   # a vector in the compute dtype, a matrix as stored (wdt)
        if t is None:
            return None
        t = t.detach()
        if t.dtype != dtype or not t.is_contiguous():
            t = _hugepages.place_copy(t.to(dtype).contiguous())
        keep.append(t)
        return t.data_ptr()
    return addr


def new_softmax_plan(desc: BlockDescription, B: int, d: int, wdt: torch.dtype):
    """A BlockPlan of kind 2 (softmax attention) for the described block, or None when the compiled step does not
    cover it. The KV cache's buffers and the token's positions are set per call (`_kv_args`)."""
    att = desc.attention if desc.attention is not None else describe_softmax(desc.mixer)
    if att is None or _fast.hooked(*desc.mixer.modules()):
        return None
    H, G, D, Dv = att.heads, att.kv_heads, att.head_dim, att.head_dim_v
    gq = att.gate == "q"
    if H % G or (gq and Dv != D) or att.rot % 2 or att.rot > D or att.gate_act not in ("silu", "sigmoid"):
        return None
    lins = (att.q_proj, att.k_proj, att.v_proj, att.o_proj) + ((att.g_proj,) if att.gate == "proj" else ())
    shapes = [(H * D * (2 if gq else 1), d), (G * D, d), (G * Dv, d), (d, H * Dv)] + [(H * Dv, d)] * (len(lins) - 4)
    if any(not plan_linear(m, wdt) or (m.out_features, m.in_features) != s for m, s in zip(lins, shapes)):
        return None
    if att.o_proj.bias is not None or (att.gate == "proj" and att.g_proj.bias is not None):
        return None
    if not _ffn_usable(desc, wdt):
        return None
    cdt, keep = compute_dtype(wdt), []
    addr = plan_addresser(keep, cdt)
    ng = H * Dv if att.gate == "proj" else 0
    p = _cpu_decode.BlockPlan(B=B, H=H, HV=H, K=D, V=Dv, d=d, ny=H * D * (2 if gq else 1) + G * (D + Dv) + ng,
                              hid=desc.ffn_down.in_features if desc.ffn_down is not None else 0, kind=2,
                              scale=float(att.scale), nthreads=max(1, torch.get_num_threads()),
                              has_ffn=int(desc.ffn_down is not None), wbf16=int(wdt == torch.bfloat16),
                              kvh=G, rot=att.rot, att_gate={None: 0, "proj": 1, "q": 2}[att.gate],
                              gate_sig=int(att.gate_act == "sigmoid"), kv_bf16=int(wdt == torch.bfloat16),
                              rope_f32=int(bool(att.rope_f32)), rope_scale=float(att.rope_scale or 1.0))
    for name, m in (("Wq", att.q_proj), ("Wk", att.k_proj), ("Wv", att.v_proj)):
        set_weight(p, name, m, wdt, addr)
    p.bq, p.bk, p.bv = addr(att.q_proj.bias), addr(att.k_proj.bias), addr(att.v_proj.bias)
    if att.gate == "proj":
        set_weight(p, "Wg", att.g_proj, wdt, addr)
    if att.q_norm is not None:
        qw, kw = att.q_norm.weight, att.k_norm.weight
        if att.norm_offset:   # (1 + w) once into the plan; the guard sees the weights' versions
            qw, kw = (None if w is None else w.detach().to(cdt) + 1 for w in (qw, kw))
        if float(att.q_norm.eps) != float(att.k_norm.eps) or (att.norm_whole and gq):
            return None   # (a whole-projection norm of q rows interleaved with the gate's: no model has one)
        p.qk_norm, p.qk_eps, p.qnw, p.knw = 2 if att.norm_whole else 1, float(att.q_norm.eps), addr(qw), addr(kw)
    if att.rot:
        p.inv_freq = addr(att.inv_freq, torch.float64)
    set_weight(p, "Wo", att.o_proj, wdt, addr)
    p.att = att   # (a ctypes Structure takes new attributes) what `_kv_args` reads per call
    return finish_block_plan(p, desc, addr, keep, wdt)


def _block_guard(owner: nn.Module, desc: BlockDescription, plan) -> PlanGuard:
    mods = [*desc.modules, *desc.mixer.modules()]
    return PlanGuard(owner, mods, [desc.mixer], plan_pointers(plan))


def _compiled_block(block: nn.Module, x: torch.Tensor, cache: LayerCache) -> Optional[torch.Tensor]:
    """`block_token`'s compiled call, or None where it does not apply. A bf16 block computes in fp32 (its input
    widened, its output rounded back to bf16, its state fp32)."""
    if torch.compiler.is_compiling() or not _cpu_decode.switched_on():
        return None
    slot = _slot(block, "_block_plan", BlockPlanSlot)
    if slot.plan is None or slot.wdtype is not x.dtype or not slot.guard.valid():
        slot.plan = None
        desc = block.decode_description(x.dtype)
        if desc is None or desc.kind == "softmax":   # (its KV cache: the whole-model step only)
            return None
        plan = _new_block_plan(desc, x.shape[0], x.shape[2], x.dtype)
        if plan is None:
            return None
        slot.guard = _block_guard(block, desc, plan)
        if not slot.guard.valid():
            return None
        slot.plan, slot.fn, slot.wdtype = plan, _cpu_decode.block_function(compute_dtype(x.dtype)), x.dtype
    plan = slot.plan
    layer = block._modules["mixer"]
    kind, HV, Kf, V, KC, sizes, keys = plan.spec
    B, d, cdt = x.shape[0], x.shape[2], compute_dtype(x.dtype)
    if plan.B != B:
        plan.B = B   # a new batch size: the same plan
    st = cache.state
    if kind == "delta":
        S = st
        if S is not None and not (isinstance(S, torch.Tensor) and S.shape == (B, HV, Kf, V)
                                  and S.device == x.device):
            return None   # the general path checks it and says what is wrong
        S_out = torch.empty(B, HV, Kf, V, dtype=cdt)
    elif kind == "linear_log":
        S = None if st is None else _log_state_in(st, (B, HV, Kf, V), cdt)
        if st is not None and S is None:
            return None
        S_out = torch.empty(B, HV, Kf, V + 2, dtype=cdt)
    else:
        if st is not None and not (isinstance(st, LinearAttentionState) and st.log_scale is None
                                   and st.kv.shape == (B, HV, Kf, V) and st.z.shape == (B, HV, Kf)
                                   and st.kv.device == x.device and st.offset.shape == (B,)):
            return None
        S = None if st is None else _fast.linear_state(cache, st, cdt)
        S_out = torch.empty(B, HV, Kf, V + 1, dtype=cdt)
    if S is not None and (S.dtype != cdt or not S.is_contiguous()):
        S = S.to(cdt).contiguous()
    window = w_out = None
    mods = layer._modules
    if KC:
        Cc = sum(sizes)
        window = _fast.conv_window(cache, cdt) if keys == QKV_CONV else cache.conv.get(keys[0])
        if window is not None:
            if not isinstance(window, torch.Tensor) or window.shape != (B, Cc, KC - 1):
                return None   # not this layer's windows: the general path says what is wrong
            if window.dtype != cdt or not window.is_contiguous():
                window = window.to(cdt).contiguous()
        w_out = torch.empty(B, Cc, KC - 1, dtype=cdt)
    xin = x.reshape(B, d)
    if xin.dtype != cdt or not xin.is_contiguous():
        xin = xin.to(cdt).contiguous()
    x_out = torch.empty(B, 1, d, dtype=cdt)
    _cpu_decode.block_step(plan, slot.fn, xin, window, S, w_out, S_out, x_out)
    if kind == "delta":
        cache.state = S_out
    else:
        offset = torch.zeros(B, dtype=torch.int64) if st is None else (
            st.offset if st.offset.dtype == torch.int64 else st.offset.to(torch.int64))
        if plan.kind == 3:
            _fast.store_linear_state(cache, S_out[..., :V + 1], offset, V, log_scale=S_out[..., V + 1])
        else:
            _fast.store_linear_state(cache, S_out, offset, V)
    if w_out is not None:
        if keys == QKV_CONV:
            _fast.store_conv_window(cache, (mods["q_conv"], mods["k_conv"], mods["v_conv"]), w_out)
        else:
            cache.conv[keys[0]] = w_out
    cache.offset = cache.offset + 1
    return x_out if x_out.dtype == x.dtype else x_out.to(x.dtype)


def _torch_block(desc: BlockDescription, x: torch.Tensor, cache: LayerCache) -> Optional[torch.Tensor]:
    """The described block's operations in PyTorch for one token (the mixer's own fast step inside); None for a
    residual order other than pre-norm or an FFN not in nn.Linear layers."""
    if desc.residual != "prenorm" or desc.ffn not in (None, "swiglu") or any(
            m is not None and type(m) is not nn.Linear for m in (desc.ffn_gate_up, desc.ffn_down)):
        return None   # (quantized FFN weights: the block's usual path calls the modules)
    n1, n2 = desc.norm1, desc.norm2
    h = x + desc.mixer(F.rms_norm(x, (x.shape[-1],), n1.weight, n1.eps), cache=cache)
    if desc.ffn_down is None:
        return h
    up, down = desc.ffn_gate_up, desc.ffn_down
    a, b = F.linear(F.rms_norm(h, (h.shape[-1],), n2.weight, n2.eps), up.weight, up.bias).chunk(2, dim=-1)
    return h + F.linear(F.silu(a) * b, down.weight, down.bias)


def block_token(block: nn.Module, x: torch.Tensor, cache: LayerCache) -> Optional[torch.Tensor]:
    """The hook of a model block's forward for one decoded token x `[B, 1, d]` (grad off, the mixer's
    `LayerCache`): the block's output, or None when the block must run its usual path (which finds the cache
    untouched). The block describes itself (`block.decode_description(dtype)` -> `BlockDescription` or None: not a
    pre-norm block with a SwiGLU or no FFN, norms / FFN not exactly the library's, a hook); the described block runs
    as one compiled call (`linattn_decode_block`) where the mixer has a compiled step, in fp32 / fp64 / bf16
    weights, on the CPU, with the plan kept in the block (`BlockPlanSlot`, checked by its `PlanGuard`); else as
    the same operations in PyTorch (fp32 / fp64 only: a bf16 block not covered runs its usual path)."""
    if not (x.dim() == 3 and x.shape[1] == 1 and x.device.type == "cpu" and not torch.is_grad_enabled()):
        return None
    if compute_dtype(x.dtype) is None:
        return None
    out = _compiled_block(block, x, cache)
    if out is not None or x.dtype == torch.bfloat16:
        return out
    desc = block.decode_description(x.dtype)
    return None if desc is None else _torch_block(desc, x, cache)


# -- the whole model ---------------------------------------------------------------------------------------------
class _Layer:
    """Where one layer's state and conv window sit in a model step's buffers, and their shapes."""

    __slots__ = ("kind", "sshape", "wshape", "sizes", "s_off", "w_off", "V", "keys")

    def __init__(self, kind, sshape, wshape, sizes, s_off, w_off, V, keys=QKV_CONV):
        self.kind, self.sshape, self.wshape, self.sizes = kind, sshape, wshape, sizes
        self.s_off, self.w_off, self.V, self.keys = s_off, w_off, V, keys


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


def state_layout(specs, B: int, cdt: torch.dtype, vocab: int) -> _Layout:
    """The layout of a model step's buffers at batch B; specs: per layer (kind, HV, Kf, V, KC, [H*K, H*K, HV*V]) and
    optionally the conv entries' keys (default q | k | v: `QKV_CONV`; one per size), as `_state_spec` gives."""
    layers, s_off, w_off = [], 0, 0
    for spec in specs:
        kind, HV, Kf, V, KC, sizes = spec[:6]
        lay = _Layer(kind, (B, HV, Kf, V + _STATE_EXTRA.get(kind, 0)), None, None, s_off, -1, V,
                     tuple(spec[6]) if len(spec) > 6 else QKV_CONV)
        if KC:
            lay.wshape, lay.sizes, lay.w_off = (B, sum(sizes), KC - 1), list(sizes), w_off
            w_off += B * lay.wshape[1] * lay.wshape[2]
        s_off += math.prod(lay.sshape)
        layers.append(lay)
    lo = _Layout()
    lo.layers, lo.L, lo.B, lo.dtype, lo.vocab, lo.n_state, lo.n_win = layers, len(layers), B, cdt, vocab, s_off, w_off
    first = layers[0]
    lo.same = first.kind != "softmax" and all(lay.kind == first.kind and lay.sshape == first.sshape
                                              and lay.wshape == first.wshape and lay.sizes == first.sizes
                                              and lay.keys == first.keys for lay in layers)
    lo.lin = [i for i, lay in enumerate(layers) if lay.kind in _STATE_EXTRA]
    lo.key = (B, cdt, vocab, tuple((lay.kind, lay.sshape, lay.wshape, lay.sizes and tuple(lay.sizes), lay.s_off,
                                    lay.w_off, lay.keys) for lay in layers))
    lo.sbuf, lo.wbuf, lo.wmode = (s_off,), (w_off,), 0   # the buffers' shapes (`_views`)
    if lo.same:
        lo.sbuf = (lo.L,) + first.sshape
        if first.wshape is not None:
            C, KW = first.wshape[1:]
            lo.wmode = 1 if B == 1 and len(first.sizes) == 3 and first.sizes[0] == first.sizes[2] else 2
            lo.wbuf = (3 * lo.L, 1, C // 3, KW) if lo.wmode == 1 else (lo.L,) + first.wshape
    return lo


class ModelPlanSlot:
    """A model's whole-model decoding plan (`cpu/decode.ModelPlan` with its L block plans), its `PlanGuard`, the
    layouts of the step's state / window buffers by batch size, and the batch size the plan is set for. Not state:
    a copy or a pickle gets an empty slot, rebuilt on first use."""

    __slots__ = ("plan", "fn", "keep", "guard", "B", "dtype", "ldtype", "specs", "layouts", "layout", "spent",
                 "planref", "att", "gfn", "kv_win", "spare")

    def __init__(self):
        self.plan = self.spent = self.spare = None   # (spare: `model_greedy`'s third buffer between its calls)

    def __reduce__(self):
        return (ModelPlanSlot, ())

    def set_batch(self, B: int) -> None:
        """Points the plan at batch B (no rebuild: the block plans' and the model plan's B, the offset arrays)."""
        got = self.layouts.get(B)
        if got is None:   # the layout and the C offset arrays (kept here: a pending cache pickles its layout)
            lo = state_layout(self.specs, B, self.dtype, self.plan.vocab)
            got = self.layouts[B] = (lo, ((ctypes.c_int64 * lo.L)(*[lay.s_off for lay in lo.layers]),
                                          (ctypes.c_int64 * lo.L)(*[lay.w_off for lay in lo.layers])))
        lo, offs = got
        mp = self.plan
        mp.B = B
        for p in self.keep[0]:
            p.B = B
        mp.s_off, mp.w_off = ctypes.addressof(offs[0]), ctypes.addressof(offs[1])
        self.B, self.layout = B, lo


def set_plan_threads(slot) -> None:
    """Point a slot's built whole-model plan (`slot.plan`; None: none yet) and its block plans (`slot.keep[0]`) at
    torch's thread count when it changed, and have its guard (`slot.guard`) hold it: the count is only a field of
    those plans, read per call (nothing is sized by it), so a `torch.set_num_threads` change needs no rebuild, which
    would copy the fused quantized weights again (the 530M shape: 0.1-0.7 s of CPU time). linattn's models
    (`ModelPlanSlot`) and kernelized transformers models (`kernelize_plan`'s slot) both call it before their
    guard's check."""
    n = torch.get_num_threads()
    if slot.plan is None or slot.guard.nthreads == n:
        return
    for p in (slot.plan, *slot.keep[0]):
        p.nthreads = max(1, n)
    slot.guard.nthreads = n


class ModelFastState:
    """What the whole-model step keeps in `Cache.fast` between tokens: the buffers its entries are views of (all
    layers' states `S`, conv windows `W`, the linear layers' offsets `offsets` `[n_linear, B]`) in the layout
    `layout`, valid while the layers' cache entries are still `entries`, the objects it stored (by identity)."""

    __slots__ = ("entries", "S", "W", "offsets", "layout")

    def __init__(self, entries, S, W, offsets, layout):
        self.entries, self.S, self.W, self.offsets, self.layout = entries, S, W, offsets, layout


def model_weights_usable(desc: ModelDescription, wdt: torch.dtype) -> bool:
    """Whether the embedding, final norm and head are what the compiled model step computes, in wdt."""
    embed, norm, head = desc.embed, desc.norm, desc.head
    if type(embed) is not nn.Embedding or embed.max_norm is not None or not desc.blocks:
        return False
    if compute_dtype(wdt) is None or embed.weight.device.type != "cpu" or not _cpu_decode.available():
        return False
    vocab, d = embed.weight.shape
    if norm is not None and (not hasattr(norm, "eps") or (norm.weight is not None and norm.weight.dtype != wdt)):
        return False
    if head is not None and (not plan_linear(head, wdt) or head.bias is not None
                             or (head.out_features, head.in_features) != (vocab, d)):
        return False
    head_w = _head_matrix(desc)
    if head is not None and type(head) is nn.Linear and head_w.shape != (vocab, d):
        return False
    return embed.weight.is_contiguous() and head_w.is_contiguous() and not _fast.hooked(embed, norm, head)


def _head_matrix(desc: ModelDescription) -> torch.Tensor:
    """The matrix the head's product reads as stored: the head's weight (its integer weights when quantized) or the
    tied embedding's."""
    head = desc.head
    got = None if head is None or type(head) is nn.Linear else stored_weights(head)
    return got[1] if got is not None else (head if head is not None else desc.embed).weight.detach()


def _build_model_plan(slot: ModelPlanSlot, model: nn.Module, desc: ModelDescription, B: int) -> bool:
    """Fills slot with a plan for the described model at batch B, or returns False when some part of it is not
    covered (then the per-block path runs): the embedding, norm and head (`model_weights_usable`) and every block
    (`_new_block_plan`: a covered mixer, RoPE off), all in the embedding's dtype."""
    slot.plan = None
    wdt = desc.embed.weight.dtype
    if not model_weights_usable(desc, wdt):
        return False
    _hugepages.place_module(model)   # (before any pointer is taken: the step reads every weight per token)
    cdt = compute_dtype(wdt)
    vocab, d = desc.embed.weight.shape
    plans, keep, specs = [], [], []
    for bd in desc.blocks:
        plan = _new_block_plan(bd, B, d, wdt)
        if plan is None:
            return False
        plans.append(plan)
        if plan.kind == 2:   # softmax attention: its KV cache, not the step's buffers
            specs.append(("softmax", 0, 0, 0, 0, ()))
            continue
        specs.append(plan.spec)
    norm = desc.norm
    mp = _cpu_decode.ModelPlan(L=len(plans), B=B, d=d, vocab=vocab, has_norm=int(norm is not None),
                               nthreads=max(1, torch.get_num_threads()), wbf16=int(wdt == torch.bfloat16),
                               norm_eps=float(norm.eps) if norm is not None else 0.0)
    head_w, head_sc = _head_matrix(desc), None
    if desc.head is not None and type(desc.head) is not nn.Linear:
        mode, _, head_sc, mp.grp_head = stored_weights(desc.head)
        head_sc = plan_scales("head", mode, head_sc)
        mp.fmt_head, mp.sc_head = _cpu_decode.WEIGHT_FORMATS[mode], head_sc.data_ptr()
    norm_w = None
    if norm is not None and norm.weight is not None:
        norm_w = norm.weight.detach().to(cdt).contiguous()
    mp.embed, mp.head = desc.embed.weight.data_ptr(), head_w.data_ptr()
    mp.norm_w = None if norm_w is None else norm_w.data_ptr()
    block_ptrs = (ctypes.c_void_p * len(plans))(*[ctypes.addressof(p) for p in plans])
    mp.blocks = ctypes.addressof(block_ptrs)
    direct = {mp.embed, mp.head, mp.norm_w, mp.sc_head}.union(*map(plan_pointers, plans))
    # (the switches and fused weights of linattn's layers; a described module of another library has neither)
    mixers = [bd.mixer for bd in desc.blocks if hasattr(bd.mixer, "compiled_decode")]
    slot.guard = PlanGuard(model, list(model.modules()), mixers, direct)
    if not slot.guard.valid() or any(t.device.type != "cpu" for t in slot.guard.tensors):
        return False   # (a hook on a module the step would not call)
    slot.keep = (plans, keep, block_ptrs, desc.embed.weight, head_w, norm_w, head_sc)
    slot.fn, slot.dtype, slot.ldtype = _cpu_decode.model_function(cdt), cdt, wdt
    slot.specs, slot.layouts = specs, {}
    slot.att = [(i, p) for i, p in enumerate(plans) if p.kind == 2]
    slot.gfn = None   # (the greedy loop's function: bound on first use, `model_greedy`)
    wins = [(p.att.window or 0) if p.kind == 2 else 0 for p in plans]
    slot.kv_win = (ctypes.c_int64 * len(plans))(*wins) if any(wins) else None
    slot.plan, slot.planref = mp, ctypes.byref(mp)
    slot.set_batch(B)
    return True


def _entries(lo: _Layout, lcs) -> list:
    """The cache entries a step reads, in a fixed order: per layer its state, then its conv windows (`_Layer.keys`)."""
    out = []
    for lay, lc in zip(lo.layers, lcs):
        if lay.kind == "softmax":   # (its KV cache is written on every token, in place)
            continue
        out.append(lc.state)
        if lay.wshape is not None:
            out += [lc.conv.get(k) for k in lay.keys]
    return out
def _gather(lo: _Layout, lcs, cdt):
    """(states, W_in, offsets) from cache entries that another path wrote (a prefill, the per-block step, a
    reorder or restore): per layer its input state in the plan's layout (`[B, HV, Kf, V(+1, +2)]`, contiguous, cdt:
    a delta layer's own entry when it is that already, so the call reads it in place, `ModelPlan.s_in_at`, instead
    of a gathered copy of every state; None for a softmax layer) and the conv windows in a fresh buffer; (None, None,
    None) before the first token; None when an entry is missing or not this layer's (then the per-block path runs
    and reports it)."""
    states, wins, offs, empty, n_rec = [], [], [], 0, 0
    for lay, lc in zip(lo.layers, lcs):
        if lay.kind == "softmax":
            states.append(None)
            continue
        n_rec += 1
        st = lc.state
        conv = tuple(lc.conv.get(k) for k in lay.keys) if lay.wshape is not None else ()
        if st is None and all(c is None for c in conv):
            empty += 1
            continue
        if st is None or any(c is None for c in conv):
            return None
        if lay.kind == "delta":
            if not (isinstance(st, torch.Tensor) and st.shape == lay.sshape and st.device.type == "cpu"):
                return None
            states.append(st if st.dtype == cdt and st.is_contiguous() else st.to(cdt).contiguous())
        elif lay.kind == "linear_log":
            S = _log_state_in(st, lay.sshape[:3] + (lay.V,), cdt)
            if S is None:
                return None
            states.append(S)
            offs.append(st.offset.to(torch.int64))
        else:
            B, HV, Kf, V1 = lay.sshape
            if not (isinstance(st, LinearAttentionState) and st.log_scale is None
                    and st.kv.shape == (B, HV, Kf, V1 - 1) and st.z.shape == (B, HV, Kf)
                    and st.kv.device.type == "cpu" and st.offset.shape == (B,)):
                return None
            states.append(torch.cat([st.kv, st.z.unsqueeze(-1)], -1).to(cdt))
            offs.append(st.offset.to(torch.int64))
        if conv:
            B, _, W = lay.wshape
            if any(not isinstance(c, torch.Tensor) or c.shape != (B, n, W) for c, n in zip(conv, lay.sizes)):
                return None
            wins.append(torch.cat(conv, 1))
    if empty == n_rec:
        return None, None, None
    if empty:
        return None
    W = torch.cat([w.to(cdt).reshape(-1) for w in wins]) if wins else None
    return states, W, (torch.stack(offs) if offs else None)


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
            mus = S[..., V + 1].unbind(0) if lay.kind == "linear_log" else (None,) * lo.L
            states = list(map(_linear_state_of, S[..., :V].unbind(0), S[..., V].unbind(0), offsets.unbind(0), mus))
        if W is None:
            return states, ()
        if lo.wmode == 1:
            return states, W.unbind(0)
        parts = [t.unbind(0) for t in W.split_with_sizes(lay.sizes, dim=2)]
        return states, [t for entries in zip(*parts) for t in entries]
    states, convs, j = [], [], 0
    for lay in lays:
        if lay.kind == "softmax":
            states.append(None)
            continue
        Sl = S[lay.s_off:lay.s_off + math.prod(lay.sshape)].view(lay.sshape)
        if lay.kind == "delta":
            states.append(Sl)
        else:
            states.append(_linear_state_of(Sl[..., :lay.V], Sl[..., lay.V], offsets[j],
                                           Sl[..., lay.V + 1] if lay.kind == "linear_log" else None))
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
        if lay.kind == "softmax":   # its KV cache and offset are written on every token (`_kv_args`)
            continue
        lc.state = st
        out.append(st)
        if lay.wshape is not None:
            nk = len(lay.keys)
            for key, c in zip(lay.keys, convs[j:j + nk]):
                lc.conv[key] = c
            out += convs[j:j + nk]
            j += nk
        lc.offset = lc.offset + n
        if lc.fast is not None:
            lc.fast = None   # the per-block step's views of the old entries
    return out


def _linear_state_of(kv, z, offset, log_scale=None):
    return LinearAttentionState(kv=kv, z=z, log_scale=log_scale, offset=offset)


def _mixer_caches(cache: Cache, L: int) -> list:
    layers = cache.layers
    try:
        return [d["mixer"] for d in layers]
    except KeyError:
        return [cache.layer(i, "mixer") for i in range(L)]


def _kv_args(slot: ModelPlanSlot, cache: Cache, B: int) -> Optional[list]:
    """Points every softmax layer's plan at its KV cache for this token (`linattn_block_plan`'s per-call fields:
    the buffers, made room for one more row, the row, the token's position and first visible key per batch row)
    and returns what `model_step` advances after the call: (plan, LayerCache, KVCache, offset, positions). None
    when an entry is not what the step writes (then the per-block path runs and reports it): the KV cache is
    written in place at its next row, as `KVCache.append` writes it, so its entries stay valid for every other
    path (a copy of the cache holds copied buffers), and its offset advances with it, on every token."""
    out = _kv_check(slot, cache, B)
    if out is not None:
        _kv_point(slot, out, B)
    return out


def _kv_check(slot: ModelPlanSlot, cache: Cache, B: int) -> Optional[list]:
    """`_kv_args`' checks: [plan, LayerCache, KVCache or None, offset, None] per softmax layer, or None when an entry
    is not what the step writes; nothing written but a missing `LayerCache`."""
    layers, out = cache._layers, []
    for i, p in slot.att:
        att, d = p.att, layers[i]
        lc = d.get("mixer")
        if lc is None:
            lc = d["mixer"] = LayerCache()   # (as Cache.layer would; harmless when the step then steps aside)
        kv, off = lc.kv, lc.offset
        G, D, Dv, dt = att.kv_heads, att.head_dim, att.head_dim_v, slot.ldtype
        if kv is None:
            if not (type(off) is int and off == 0):
                return None
        elif type(kv) is not KVCache or (kv.k is not None and not (
                kv.k.shape[0] == B and kv.k.shape[2:] == (G, D) and kv.v.shape[2:] == (G, Dv) and kv.k.dtype == dt
                and kv.v.dtype == dt and kv.k.is_cpu and kv.v.is_cpu)) or kv.window != att.window:
            return None
        if type(off) is int:
            if kv is not None and off != kv.start + kv.length:
                return None
        elif not (off.shape == (B,) and off.dtype in (torch.int32, torch.int64) and off.device.type == "cpu"):
            return None
        out.append([p, lc, kv, off, None])
    return out


def _kv_point(slot: ModelPlanSlot, out: list, B: int) -> None:
    """`_kv_args`' writes, once every layer is checked (`_kv_check`): a new `KVCache` where there was none, room for
    one more row, the plans' per-call fields."""
    for rec in out:
        p, lc, kv, off, _ = rec
        att = p.att
        if kv is None:
            kv = rec[2] = lc.kv = KVCache(chunk=att.kv_chunk, window=att.window)
        if kv.k is not None and not (kv.k.is_contiguous() and kv.v.is_contiguous()):
            kv.k, kv.v = kv.k.contiguous(), kv.v.contiguous()   # (a trimmed view: the same tokens, one buffer)
        if kv.k is None:
            kv.reserve(1, torch.empty(B, 0, att.kv_heads, att.head_dim, dtype=slot.ldtype),
                       torch.empty(B, 0, att.kv_heads, att.head_dim_v, dtype=slot.ldtype))
        else:
            kv.reserve(1, kv.k, kv.v)
        L = kv.length + 1
        p.kc, p.vc, p.kv_cap, p.kv_len = kv.k.data_ptr(), kv.v.data_ptr(), kv.k.shape[1], kv.length
        if type(off) is int:
            p.pos, p.lo, p.pos0, p.lo0 = None, None, off, 0 if att.window is None else max(0, L - att.window)
        else:   # rows at different lengths: row b's tokens are the last off[b] + 1 slots (SoftmaxAttention._row_mask)
            pos = off.to(torch.int64).contiguous()
            lo = (L - 1 - pos).clamp(min=0 if att.window is None else max(0, L - att.window))
            rec[4] = (pos, lo)
            p.pos, p.lo = pos.data_ptr(), lo.data_ptr()


#: torch's count of the references to a storage (private: without it every token's buffer is a fresh one)
_storage_use_count = getattr(torch._C, "_storage_Use_Count", None)
#: the references to the spent tensor object itself while `reusable_buffer` looks at it (the caller's name, the
#: argument, getrefcount's): one more is another holder (a ModelPending of a shallow copy of the cache)
_SPENT_REFS = 3


def reusable_buffer(spent, n: int, dtype: torch.dtype, held: int = 0) -> torch.Tensor:
    """A buffer of n elements for a whole-model step's new states: the one the token before last wrote (`spent`, a
    plan slot's, the caller's only reference) when nothing else holds its memory (no view of it in a cache entry or
    anywhere: the tensor and the storage object asked here are the only references, besides `held` views of it the
    caller keeps and has found no one else holding), else a fresh one. A fresh 18 MiB buffer a token (the 530M
    shape's states) is 3,200 page faults on 4 KiB pages, or nine 2 MiB pages the kernel zeroes: the allocator hands
    the freed one back to the system. Used by linattn's and the kernelized plans."""
    return spent if unheld_buffer(spent, n, dtype, held, _SPENT_REFS + 1) else _hugepages.empty(n, dtype)


def unheld_buffer(spent, n: int, dtype: torch.dtype, held: int = 0, refs: int = _SPENT_REFS) -> bool:
    """Whether `spent` (held by the caller's name alone, passed straight here; `refs`: the references that leaves,
    one more per frame in between) is a tensor of n elements in dtype whose memory nothing else holds
    (`reusable_buffer`'s test; also the kernelized token's logits)."""
    return (type(spent) is torch.Tensor and _storage_use_count is not None and spent.dtype == dtype
            and spent.numel() == n and sys.getrefcount(spent) <= refs
            and _storage_use_count(spent.untyped_storage()._cdata) == 2 + held)


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


def model_step(model: nn.Module, ids: torch.Tensor, cache, logits_to_keep) -> Optional[tuple]:
    """The hook of a model's forward for one decoded token per row, ids `[B, 1]`: the embedding, every block, the
    final norm and the head as ONE compiled call (csrc/decode.c, linattn_decode_model), the cache advanced as the
    per-block steps advance it. The model describes itself (`model.decode_description()` -> `ModelDescription` or
    None). Returns (logits `[B, 1, vocab]`, the zero aux loss), or None where that does not cover the call (then
    forward runs as usual and finds the cache untouched): grad enabled, not a plain `Cache` or one with rollback, a
    block the compiled block step would not take, a hook, `model.compiled_decode = False`, `LINATTN_CPU_KERNELS=0`,
    a token id out of range, or cache entries that are not this model's.

    The plan is built once and checked on every token (`PlanGuard`); a new batch size only re-points it
    (`ModelPlanSlot.set_batch`). The new states and conv windows of all layers are one buffer per token, never the
    one it reads (a copy of the cache may share that): a fresh one, or the token before last's when nothing holds
    it any more (`reusable_buffer`). The cache's entries are written lazily
    (`ModelPending`): a token leaves its buffer in `Cache.pending`, the next token reads it from there, and the
    entries (views of the buffer) are made only when something reads `Cache.layers`. After that, while the entries
    are still those views, the next token reads the buffer directly (`ModelFastState` in `Cache.fast`), else it
    gathers the entries. The blocks' arithmetic is the per-block step's (bit for bit); the final norm and head are
    C loops (the logits agree with torch's to rounding). A bf16 model computes in fp32 (states too) and returns
    bf16 logits."""
    if type(logits_to_keep) is not int or logits_to_keep < 0:
        return None
    got = _step_inputs(model, ids, cache)
    if got is None:
        return None
    slot, lo, buf_in, offsets, n, S_ptr, W_ptr, s_at = got
    B = ids.shape[0]
    kvs = _kv_args(slot, cache, B) if slot.att else ()
    if kvs is None:
        return None
    if ids.dtype != torch.int64 or not ids.is_contiguous():
        ids = ids.to(torch.int64).contiguous()
    # every torch call before the compiled one: it streams all the weights through the caches, after which each
    # torch call costs several times more (its code and data are fetched again); the same for freeing the
    # previous step's buffers (`slot.spent` keeps them until the next token)
    spent, slot.spent = slot.spent, None
    cdt = lo.dtype
    buf = reusable_buffer(spent, lo.n_state + lo.n_win, cdt)
    logits = torch.empty(B, 1, lo.vocab, dtype=slot.ldtype)
    aux = torch.empty((), dtype=torch.float32)   # zeroed by the call (torch.zeros costs a fill kernel's code)
    out_ptr = buf.data_ptr()
    slot.plan.s_in_at = None if s_at is None else ctypes.addressof(s_at)   # (every call: none left from another)
    rc = slot.fn(slot.planref, ids.data_ptr(), S_ptr, W_ptr, out_ptr,
                 out_ptr + lo.n_state * buf.element_size() if lo.n_win else None, logits.data_ptr(), aux.data_ptr())
    if rc == 2:
        return None   # a token id out of range: forward's checks report it
    if rc:
        raise MemoryError("linattn: the compiled decoding step could not allocate its work buffer")
    slot.spent = buf_in
    for _, lc, kv, off, _ in kvs:   # the row the call wrote
        kv.length += 1
        lc.offset = off + 1
    cache.pending = ModelPending(lo, buf, offsets, n)
    cache.seen_tokens += 1
    return logits, aux


def _step_inputs(model: nn.Module, ids: torch.Tensor, cache) -> Optional[tuple]:
    """What a whole-model step on `cache` reads, after `model_step`'s coverage checks (the plan built, or checked by
    its guard, and set to the batch of ids `[B, 1]`): (slot, layout, the input buffer(s) the step's caller keeps
    alive, the linear layers' offsets before the pending tokens, the pending tokens after this one, the states' and
    windows' addresses, the per-layer state addresses `s_in_at` or None), or None where the step does not cover the
    call. Writes nothing but a plan (and, through `Cache.layers`, a pending step of another layout)."""
    if (torch.is_grad_enabled() or type(cache) is not Cache or cache.rollback or not ids.is_cpu
            or not getattr(model, "compiled_decode", True) or torch.compiler.is_compiling()
            or not _cpu_decode.switched_on()):
        return None
    B = ids.shape[0]
    slot = _slot(model, "_model_plan", ModelPlanSlot)
    set_plan_threads(slot)
    if slot.plan is None or not slot.guard.valid():
        desc = model.decode_description()
        if desc is None or not _build_model_plan(slot, model, desc, B):
            return None
    elif slot.B != B:
        slot.set_batch(B)
    lo, s_at = slot.layout, None
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
        if type(S_in) is list:   # (each layer's own state, read in place: `ModelPlan.s_in_at`)
            s_at = (ctypes.c_void_p * lo.L)(*[None if t is None else t.data_ptr() for t in S_in])
            S_in = None
        S_ptr = None if S_in is None else S_in.data_ptr()
        W_ptr = None if W_in is None else W_in.data_ptr()
    return slot, lo, buf_in, offsets, n, S_ptr, W_ptr, s_at


def model_greedy(model: nn.Module, ids: torch.Tensor, cache, n: int,
                 eos_token_id: Optional[int] = None) -> Optional[tuple]:
    """Greedy decoding of up to n tokens in ONE compiled call (csrc/decode.c, linattn_decode_model_greedy): n times
    `model_step` on ids `[B, 1]` and then on each step's pick, the pick `argmax` of the step's logits as torch picks
    it (the first index of the largest; a NaN counts as the largest; a bf16 model's picks on its bf16 logits), with
    no Python between the tokens. With `eos_token_id` a row is finished once its input id or a pick was eos, a
    finished row's pick is eos (as the models' `stream` feeds it), and the loop stops after the step where every row
    is finished.

    Returns (tokens `[B, steps]` int64, the last step's logits `[B, 1, vocab]`), steps <= n; the cache is left as
    `steps` calls of `model_step` with those picks leave it (`seen_tokens`, the KV caches' rows, lengths, offsets
    and capacities, the linear layers' offsets, a `ModelPending` counting every step). None where `model_step` would
    return None (the cache then untouched but for a KV cache's room for one row: with grad enabled too, so call it
    under `torch.no_grad`), and where softmax layers' offsets are per row (a tensor: rows at different lengths). The
    plan's guard is checked once for the call: nothing may change the model while it runs. The KV caches make room
    at the tokens where the per-token step makes it (a full buffer grows by half, a sliding window drops its old
    rows every `kv_chunk` tokens): the loop is one compiled call per stretch between those tokens, so a long decode
    is a few calls, and its KV memory grows as the per-token step's, not by n rows up front. The loop writes two
    buffers in turn, never the one it reads; calls on one cache rotate three that the plan keeps (the pending one,
    the token before last's and `ModelPlanSlot.spare`), each taken again only while nothing else holds it
    (`reusable_buffer`), so such calls map and fault in no new memory.

    Raises:
        LinattnError: ids not an int64 / int32 `[B, 1]` tensor, n not a positive int, eos_token_id not None or an
            int >= 0.
    """
    if not (isinstance(ids, torch.Tensor) and ids.dim() == 2 and ids.shape[1] == 1
            and ids.dtype in (torch.int64, torch.int32)):
        raise LinattnError(f"model_greedy: ids must be an int64 tensor [B, 1], got "
                           f"{getattr(ids, 'dtype', type(ids).__name__)} {tuple(getattr(ids, 'shape', ()))}")
    if type(n) is not int or n < 1:
        raise LinattnError(f"model_greedy: n must be an int >= 1 (the most tokens to decode), got {n!r}")
    if eos_token_id is not None and (type(eos_token_id) is not int or eos_token_id < 0):
        raise LinattnError(f"model_greedy: eos_token_id must be None or an int >= 0, got {eos_token_id!r}")
    got = _step_inputs(model, ids, cache)
    if got is None:
        return None
    slot, lo, buf_in, offsets, n0, S_ptr, W_ptr, s_at = got
    B = ids.shape[0]
    kvs = _kv_check(slot, cache, B) if slot.att else []
    if kvs is None or any(type(rec[3]) is not int for rec in kvs):
        return None
    fn = slot.gfn
    if fn is None:
        fn = slot.gfn = _cpu_decode.greedy_function(lo.dtype)
        if fn is None:
            return None
    if ids.dtype != torch.int64 or not ids.is_contiguous():
        ids = ids.to(torch.int64).contiguous()
    spent, slot.spent = slot.spent, None
    spare, slot.spare = slot.spare, None
    size, cdt, esz = lo.n_state + lo.n_win, lo.dtype, lo.dtype.itemsize
    # the pair the loop writes: the token before last's buffer and the slot's spare (the last call's input buffer)
    # when nothing else holds them, so that calls on one cache rotate three buffers; a fresh one is a new mapping
    # whose pages the loop's first write faults in (the global pool keeps only 64 MiB)
    pair = [reusable_buffer(spent, size, cdt), None]
    if n > 1:
        pair[1], spare = reusable_buffer(spare, size, cdt), None
    logits = torch.empty(B, 1, lo.vocab, dtype=slot.ldtype)
    aux = torch.empty((), dtype=torch.float32)
    eos = -1 if eos_token_id is None else eos_token_id
    win = None if slot.kv_win is None else ctypes.addressof(slot.kv_win)
    parts, done, last = [], 0, None
    while done < n:
        seg = n - done
        if kvs:   # room for one row, made as the per-token step makes it (a window drops its old rows, a full
            _kv_point(slot, kvs, B)   # buffer grows by half): the stretch runs while every cache has room as is
            for p, _, kv, _, _ in kvs:
                seg = min(seg, kv.k.shape[1] - kv.length)
                if p.att.window is not None:   # (the rows it can take before its next drop)
                    seg = min(seg, p.att.window - 1 + kv.keep_extra + kv.chunk - kv.length)
        a, b = pair if last is None else (pair[1] if last is pair[0] else pair[0], last)
        tok = torch.empty(B, seg, dtype=torch.int64)
        slot.plan.s_in_at = None if s_at is None or last is not None else ctypes.addressof(s_at)
        a_ptr, b_ptr = a.data_ptr(), None if b is None else b.data_ptr()
        got = fn(slot.planref, ids.data_ptr(), S_ptr, W_ptr, a_ptr, a_ptr + lo.n_state * esz if lo.n_win else None,
                 b_ptr, b_ptr + lo.n_state * esz if lo.n_win and b_ptr is not None else None, logits.data_ptr(),
                 aux.data_ptr(), seg, eos, win, tok.data_ptr())
        if got == -2:
            slot.spent, slot.spare = spent, spare if pair[1] is None else pair[1]
            return None   # a token id out of range (the first call only): forward's checks report it
        if got < 0:
            raise MemoryError("linattn: the compiled greedy decoding could not allocate its work buffers") \
                if got == -1 else RuntimeError(f"internal: linattn_decode_model_greedy returned {got}")
        last = a if got % 2 else b   # (the buffer of its last step: a after an odd count)
        for rec in kvs:   # the rows the call wrote
            rec[2].length += got
            rec[1].offset = rec[3] = rec[3] + got
        parts.append(tok if got == seg else tok[:, :got])
        done += got
        S_ptr = last.data_ptr()
        W_ptr = S_ptr + lo.n_state * esz if lo.n_win else None
        ids = parts[-1][:, -1:].contiguous()
        if got < seg or (eos >= 0 and bool((ids == eos).all())):   # (every row finished, at the stretch's end)
            break
    # the token before last's buffer, for the next step (`reusable_buffer`); buf_in when one step ran
    slot.spent = buf_in if done == 1 else pair[1] if last is pair[0] else pair[0]
    # and the one left for the next call's pair: the input buffer (a previous call's last; a copy of the cache may
    # still hold it: `reusable_buffer` looks) or the pair's unused one
    left = pair[1] if done == 1 else buf_in
    slot.spare = left if type(left) is torch.Tensor else spare
    cache.pending = ModelPending(lo, last, offsets, n0 + done - 1)
    cache.seen_tokens += done
    return (parts[0] if len(parts) == 1 else torch.cat(parts, 1)), logits
