"""What the architecture descriptions of the kernelized whole-model plan share (hf/kernelize_plan.py and its
per-architecture modules import this; it imports none of them)."""
from __future__ import annotations

import operator
import types
from typing import Optional, Union

import torch
import torch.nn as nn

from ..cpu import decode as _cpu_decode
from ..models import decode_plan as _dp

#: a softmax layer's KV buffer (the plan's layout, hf/kernelize_plan.py's mirrors) grows by this many rows at a time
KV_CHUNK = 64


def norm(weight: torch.Tensor, eps) -> types.SimpleNamespace:
    """An RMSNorm as the plan reads it: `weight` (what the plan multiplies by), `eps`."""
    return types.SimpleNamespace(weight=weight, eps=float(eps))


def plan_projection(m, shape, wdt) -> bool:
    """m is a bias-free linear layer of weight shape `shape` ([out, in]) whose matrix a plan with weights in wdt reads
    as stored (`decode_plan.plan_linear`): exactly an `nn.Linear` of dtype wdt, or int8 / int4 weights
    (`quant.linear.QuantizedLinear`: fp32 and bf16 models)."""
    return (isinstance(m, nn.Module) and _dp.plan_linear(m, wdt) and getattr(m, "bias", None) is None
            and (m.out_features, m.in_features) == tuple(shape))


#: what projections that are not `plan_projection`'s are (a step-aside reason names them so)
NOT_PLAN_PROJECTIONS = "not bias-free linear layers the plan reads (nn.Linear of the model's dtype, int8, int4)"


def fusion_reason(*linears) -> Optional[str]:
    """Why the plan cannot read these projections (`plan_projection`'s) as one fused product, or None: one product
    reads one format, so parts stored in different ones (e.g. a projection that int4 could not take, left in
    float beside int4 ones) are not fused."""
    fmts = sorted({"/".join(map(str, _dp.stored_format(m))) for m in linears})
    if len(fmts) > 1:
        return f"a fused projection whose parts are stored in different formats ({', '.join(fmts)})"
    return None


class QuantizedRows:
    """int8 / int4 rows of several quantized projections stacked (or regrouped) by rows, their scales with them (a
    copy the plan keeps): read by `decode_plan.set_weight` through `stored_weights`, as a QuantizedLinear is."""

    __slots__ = ("fmt", "qweight", "scales", "group", "out_features", "in_features", "bias")

    def __init__(self, fmt: str, qweight: torch.Tensor, scales: torch.Tensor, group: int, in_features: int):
        self.fmt, self.qweight, self.scales, self.group, self.bias = fmt, qweight, scales, group, None
        self.out_features, self.in_features = qweight.shape[0], in_features

    def stored_weights(self):
        return self.fmt, self.qweight, self.scales, self.group


def fused_linear(*linears: nn.Module, rows: Optional[torch.Tensor] = None):
    """The plan's product of projections (`plan_projection`'s, `fusion_reason` None) stacked by rows in order: float
    weights read in place (`decode_plan.StackedRows`, no copy), or copied once when `rows` (an index into the
    stacked rows: a regrouping) is given; int8 / int4 weights and their scales (int4's group-wise scales follow
    their rows) stacked, and regrouped by `rows`, once into a copy (`QuantizedRows`)."""
    got = [_dp.stored_weights(m) for m in linears]
    if got[0] is None:
        if rows is None:
            return _dp.StackedRows([m.weight for m in linears])
        return _dp.StackedRows([torch.cat([m.weight.detach() for m in linears]).index_select(0, rows)])
    q, s = _dp.stacked_stored(linears, rows)
    return QuantizedRows(got[0][0], q, s, got[0][3], linears[0].in_features)


def swiglu_ffn(mlp: nn.Module, cls_name: str, d: int, wdt) -> Union[tuple, str]:
    """(fused gate | up, down) of transformers' dense SwiGLU MLP of class `cls_name` (`gate_proj`, `up_proj`,
    `down_proj`, `config.hidden_act` SiLU), or why the plan does not compute it."""
    if type(mlp).__name__ != cls_name:
        return f"a {type(mlp).__name__} feed-forward (MoE: routed experts are not a plan block)"
    m = mlp._modules
    gate, up, down = m.get("gate_proj"), m.get("up_proj"), m.get("down_proj")
    hid = getattr(gate, "out_features", None)
    if hid is None or not (plan_projection(gate, (hid, d), wdt) and plan_projection(up, (hid, d), wdt)
                           and plan_projection(down, (d, hid), wdt)):
        return f"an MLP whose projections are {NOT_PLAN_PROJECTIONS}"
    if getattr(mlp.config, "hidden_act", None) not in ("silu", "swish"):
        return "an MLP activation other than SiLU"
    why = fusion_reason(gate, up)
    if why:
        return f"an MLP's gate | up: {why}"
    return fused_linear(gate, up), down


#: transformers' sparse MoE blocks whose router is a softmax top-k (`<Model>TopKRouter`), fused 3-D experts
#: (`gate_up_proj [E, 2I, d]`, `down_proj [E, d, I]`) and a sigmoid-gated shared expert; the value: whether the
#: router renormalises its top-k probabilities (None: its `norm_topk_prob`)
QWEN_SPARSE_MOE = {"Qwen3NextSparseMoeBlock": None, "Qwen3_5MoeSparseMoeBlock": True}


def qwen_sparse_moe(mlp: nn.Module, d: int, wdt) -> Union[tuple, str]:
    """(shared expert's fused gate | up, its down, `decode_plan.MoEDescription`) of a Qwen3-Next / Qwen3.5-MoE
    sparse MoE block (`QWEN_SPARSE_MOE`), read as it is (the experts in place), or why the plan does not compute
    it."""
    norm_topk = QWEN_SPARSE_MOE.get(type(mlp).__name__, False)
    if norm_topk is False:
        return f"a {type(mlp).__name__} feed-forward (neither a dense SwiGLU MLP nor a described MoE block)"
    m = mlp._modules
    router, experts, shared, sgate = (m.get(n) for n in ("gate", "experts", "shared_expert", "shared_expert_gate"))
    if (router is None or experts is None or type(router).__name__ != type(mlp).__name__.replace("SparseMoeBlock",
                                                                                                    "TopKRouter")
            or set(router._parameters) != {"weight"} or set(experts._parameters) != {"gate_up_proj", "down_proj"}
            or type(getattr(experts, "act_fn", None)).__name__ not in ("SiLU", "SiLUActivation")):
        return "an MoE block whose router or experts are not transformers' softmax top-k router and fused experts"
    got = swiglu_ffn(shared, type(shared).__name__, d, wdt) if shared is not None else "no shared expert"
    if isinstance(got, str):
        return f"an MoE block's shared expert: {got}"
    sgate = shared_gate_row(sgate, d, wdt)
    if isinstance(sgate, str):
        return sgate
    moe = _dp.MoEDescription(router.weight.detach(), experts.gate_up_proj.detach(), experts.down_proj.detach(),
                             router.top_k, router.norm_topk_prob if norm_topk is None else norm_topk, sgate)
    if not _dp.moe_usable(moe, d, wdt):
        return "an MoE block whose router or experts the plan does not read (shapes, dtype, layout)"
    return got[0], got[1], moe


def shared_gate_row(sgate, d: int, wdt) -> Union[nn.Module, str]:
    """A shared expert's gate `[1, d]` as the plan's MoE reads it (`decode_plan.MoEDescription`, the block plan's
    `Wsg` with its format: float, or int8 with either activation kind; int4 takes no single row), or why not."""
    if not plan_projection(sgate, (1, d), wdt):
        return f"an MoE block's shared-expert gate [1, d] that is {NOT_PLAN_PROJECTIONS}"
    return sgate


def base_and_embedding(model: nn.Module, models: tuple, base: str, embedding: str) -> Union[tuple, str]:
    """(base model `model.<base>`, its embedding `<embedding>`, the weights' dtype) of a model whose class is one of
    `models` and whose config does not ask for router logits (the plan returns none), or why the plan cannot
    compute it."""
    if type(model).__name__ not in models:
        return f"{type(model).__name__} is not one of {models}"
    if getattr(model.config, "output_router_logits", False):
        return "output_router_logits set (the plan returns no router logits)"
    inner = getattr(model, base)
    embed = getattr(inner, embedding)
    wdt = embed.weight.dtype
    if _dp.compute_dtype(wdt) is None:
        return f"weights in {wdt} (the plan reads fp32, fp64, bf16)"
    return inner, embed, wdt


def model_description(model: nn.Module, embed: nn.Module, blocks: list, final_norm: nn.Module, norm_class: str,
                      wdt: torch.dtype, parts: list) -> Union[tuple, str]:
    """A `describe` answer: (the ModelDescription of described blocks with transformers' plain RMSNorm `final_norm`
    (of class `norm_class`: its eps is `variance_epsilon`) and `model.lm_head` (tied or not), the per-layer `parts`),
    or why the plan cannot read them."""
    if type(final_norm).__name__ != norm_class or final_norm.weight.dtype != wdt:
        return f"a final norm that is not transformers' {norm_class}"
    head = model.lm_head
    desc = _dp.ModelDescription(embed, blocks, None, None if tied_head(head, embed) else head)
    if not _dp.model_weights_usable(desc, wdt):   # (the final norm checked above)
        return "an embedding or head the plan does not read (a bias, another dtype, a hook)"
    desc.norm = norm(final_norm.weight, final_norm.variance_epsilon)
    return desc, parts


def tied_head(head: nn.Module, embed: nn.Module) -> bool:
    """Whether a head reads the embedding's matrix (tied; a quantized head holds its own integers: not tied)."""
    return getattr(head, "weight", None) is embed.weight


def describe_layers(model: nn.Module, models: tuple, base: str, embedding: str, block, final_norm: str,
                    norm_class: str) -> Union[tuple, str]:
    """A `describe` answer for a model whose class is one of `models` (`base_and_embedding`'s `base`, `embedding`),
    each of whose layers `block(layer, base model, d, wdt)` describes as (BlockDescription, per-layer part) or
    says why not, with the final norm `<base>.<final_norm>` of class `norm_class` (`model_description`)."""
    got = base_and_embedding(model, models, base, embedding)
    if isinstance(got, str):
        return got
    inner, embed, wdt = got
    d = embed.weight.shape[1]
    blocks, parts = [], []
    for i, layer in enumerate(inner.layers):
        got = block(layer, inner, d, wdt)
        if isinstance(got, str):
            return f"layer {i}: {got}"
        blocks.append(got[0])
        parts.append(got[1])
    return model_description(model, embed, blocks, getattr(inner, final_norm), norm_class, wdt, parts)


def description(got: Union[tuple, str]) -> Optional[tuple]:
    """A `describe` answer as `describe_model` returns it: the description, or None."""
    return None if isinstance(got, str) else got


def reason(got: Union[tuple, str]) -> Optional[str]:
    """A `describe` answer as `undescribed_reason` returns it: why not, or None."""
    return got if isinstance(got, str) else None


def public_description(describe, what: str):
    """(describe_model, undescribed_reason) of an architecture whose `describe(model)` gives (ModelDescription,
    per-layer parts) or the reason the plan does not compute the model; `what` names its models in their
    docstrings."""

    def describe_model(model: nn.Module):
        return description(describe(model))

    def undescribed_reason(model: nn.Module) -> Optional[str]:
        return reason(describe(model))

    describe_model.__doc__ = (f"(ModelDescription, per-layer parts) of {what}, or None where the plan does not "
                              "compute some part of it (`undescribed_reason` says which).")
    undescribed_reason.__doc__ = f"Why {what} does not decode through the compiled plan, or None when it does."
    return describe_model, undescribed_reason


def rms_norm(module: nn.Module, norm_class: str, wdt, shape: Optional[tuple] = None):
    """transformers' plain RMSNorm `module` of class `norm_class` (weights of dtype wdt, of `shape` when given) as
    the plan reads it (`norm`), or None."""
    if (type(module).__name__ != norm_class or module.weight.dtype != wdt
            or (shape is not None and tuple(module.weight.shape) != shape)):
        return None
    return norm(module.weight, module.variance_epsilon)


def block_norms(layer: nn.Module, names: tuple, norm_class: str, wdt) -> Union[tuple, str]:
    """The two norms of a block, `layer.<names[0]>` and `layer.<names[1]>`, as the plan reads them (`rms_norm`), or
    why not."""
    n1, n2 = (rms_norm(layer._modules.get(n), norm_class, wdt) for n in names)
    if n1 is None or n2 is None:
        return f"block norms that are not transformers' {norm_class}"
    return n1, n2


def gqa_projections_reason(modules, H: int, G: int, D: int, d: int, wdt) -> Optional[str]:
    """Why an attention's q / k / v / o projections (`modules`: its `_modules`) are not the softmax kind's: H query
    and G key / value heads of D, `plan_projection`'s of the softmax kind's shapes; None when they are (each
    matrix is its own product: formats may differ)."""
    shapes = {"q_proj": (H * D, d), "k_proj": (G * D, d), "v_proj": (G * D, d), "o_proj": (d, H * D)}
    if H % G or not all(plan_projection(modules.get(n), s, wdt) for n, s in shapes.items()):
        return f"attention projections of the softmax kind's shapes that are {NOT_PLAN_PROJECTIONS}"
    return None


def softmax_attention(att, cls_name: str, d: int, wdt, rotary=None,
                      rope: Optional[str] = None) -> Union[_dp.AttentionDescription, str]:
    """transformers' softmax attention `att` of class `cls_name` as the softmax kind computes it, or why not: H
    query and G key / value heads of `att.head_dim` (its config's `num_attention_heads`, `num_key_value_heads`),
    `gqa_projections_reason`'s projections, the score scale `att.scaling`, no sliding window, no output gate.
    `rope`: None (no position encoding), "whole" (RoPE over every dim of a head) or "part" (over its first dims);
    then `rotary` (the base model's rotary embedding) must be transformers' default RoPE of the class named as the
    attention's (`<Model>RotaryEmbedding`), its angles in fp32. No q / k norm (a description that has them sets
    them)."""
    if type(att).__name__ != cls_name:
        return f"an attention layer of type {type(att).__name__}"
    cfg, m = att.config, att._modules
    H, G, D = cfg.num_attention_heads, cfg.num_key_value_heads, att.head_dim
    why = gqa_projections_reason(m, H, G, D, d, wdt)
    if why:
        return why
    if getattr(cfg, "sliding_window", None) is not None:
        return "a sliding window"
    rot, inv, scale = 0, None, 1.0
    if rope is not None:
        if (type(rotary).__name__ != cls_name.replace("Attention", "RotaryEmbedding")
                or getattr(rotary, "rope_type", None) != "default"):
            return "a rotary embedding other than the default RoPE"
        inv, scale = rotary.inv_freq.detach().to(torch.float64), float(rotary.attention_scaling)
        rot = 2 * inv.numel()
        if rope == "whole" and rot != D:
            return "a rotary embedding over part of a head"
        if rot > D:
            return "a rotary embedding wider than a head"
    return _dp.AttentionDescription(
        q_proj=m["q_proj"], k_proj=m["k_proj"], v_proj=m["v_proj"], o_proj=m["o_proj"], heads=H, kv_heads=G,
        head_dim=D, head_dim_v=D, scale=float(att.scaling), window=None, norm_offset=0, rot=rot, inv_freq=inv,
        rope_f32=True, rope_scale=scale, gate=None, g_proj=None, gate_act="silu", kv_chunk=KV_CHUNK)


def renormalised_topk_moe(router: nn.Module, experts: nn.Module, d: int, wdt) -> Union[_dp.MoEDescription, str]:
    """A softmax top-k `router` (`weight`, `top_k`) whose k probabilities are renormalised, over fused 3-D `experts`
    (`gate_up_proj`, `down_proj`) without a shared expert, as the plan's MoE reads it (router mode 0 or 1: Granite's
    top-k-of-logits router picks the same experts with the same weights), or why not."""
    moe = _dp.MoEDescription(router.weight.detach(), experts.gate_up_proj.detach(), experts.down_proj.detach(),
                             router.top_k, True)
    if not _dp.moe_usable(moe, d, wdt):
        return "an MoE block whose router or experts the plan does not read (shapes, dtype, layout)"
    return moe


def moe_output_class():
    """The output class of a mixture-of-experts model's unpatched forward (router logits and aux loss left None)."""
    from transformers.modeling_outputs import MoeCausalLMOutputWithPast
    return MoeCausalLMOutputWithPast


def causal_lm_output_class():
    """The output class of a dense causal LM's unpatched forward."""
    from transformers.modeling_outputs import CausalLMOutputWithPast
    return CausalLMOutputWithPast


#: the base model of a `<Model>ForCausalLM` (a description's `base`)
base_model = operator.attrgetter("model")


def unpadded(attention_mask, B: int) -> bool:
    """Whether an attention mask (2-D, B rows, or None) keeps every position: no left padding."""
    return attention_mask is None or (isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2
                                      and attention_mask.shape[0] == B and bool(attention_mask.all()))


def gdn_plan(layer, W, norm: nn.Module, out_proj: nn.Module, bd: _dp.BlockDescription, B: int, d: int,
             wdt: torch.dtype, beta_mode: str = "sigmoid"):
    """The plan's delta block (kind 0, gated) for a transformers Gated DeltaNet layer (Qwen3.5's, Qwen3-Next's,
    OLMo-hybrid's: `num_k_heads`, `num_v_heads`, `head_k_dim`, `head_v_dim`, `conv_kernel_size`, `conv1d`, `A_log`,
    `dt_bias`): W its projections fused by rows as the plan reads them, `[q | k | v | b | a | z]`; norm its gated
    output RMSNorm (`weight`, `variance_epsilon`, SiLU gate), out_proj its output projection; beta_mode one of
    `cpu/decode.BETA_MODES` ("doubled": beta = 2 sigmoid(b))."""
    cdt, keep = _dp.compute_dtype(wdt), []
    addr = _dp.plan_addresser(keep, cdt)
    H, HV, K = layer.num_k_heads, layer.num_v_heads, layer.head_k_dim
    p = _cpu_decode.BlockPlan(B=B, H=H, HV=HV, K=K, V=layer.head_v_dim, d=d, ny=W.out_features,
                              KC=layer.conv_kernel_size, hid=bd.ffn_down.in_features, kind=0, conv_act=1,
                              scale=K ** -0.5, nthreads=max(1, torch.get_num_threads()), has_ffn=1,
                              wbf16=int(wdt == torch.bfloat16), beta_mode=_cpu_decode.BETA_MODES.index(beta_mode))
    _dp.set_weight(p, "W", W, wdt, addr)
    conv = layer._modules["conv1d"].weight
    p.cw = addr(conv.view(conv.shape[0], -1))
    # transformers' l2norm: x * rsqrt(sum x^2 + 1e-6) on q and k ("rsqrt", L2NORM_EPS)
    p.dkind, p.l2conv, p.l2eps, p.gated = 0, 0, 1e-6, 1
    p.neg_a, p.dt_bias = addr(-torch.exp(layer.A_log.detach().to(cdt))), addr(layer.dt_bias)
    p.has_norm, p.nw, p.norm_eps, p.has_gate = 1, addr(norm.weight), float(norm.variance_epsilon), 1
    _dp.set_weight(p, "Wo", out_proj, wdt, addr)
    return _dp.finish_block_plan(p, bd, addr, keep, wdt)


def kda_plan(H: int, K: int, KC: int, W, conv: nn.Module, A_log: torch.Tensor, dt_bias: torch.Tensor,
             norm: nn.Module, out_proj: nn.Module, bd: _dp.BlockDescription, B: int, d: int, wdt: torch.dtype, *,
             Wf: Optional[nn.Module] = None, Wg2: Optional[nn.Module] = None, gate_lb: Optional[float] = None):
    """The plan's KDA block (kind 4, csrc/decode_kda.h) for a transformers KDA layer of H heads of K (Kimi Linear's,
    Bailing hybrid's): W its first products fused by rows, `[q | k | v | b | f | gate]` where f and the gate are the
    low-rank first stages when `Wf` / `Wg2` (their second stages `[H K, rank]`) are given, else the full-rank
    gates; conv its depthwise `nn.Conv1d` (SiLU); beta = sigmoid(b); the decay `-exp(A_log)` softplus(f + dt_bias),
    or `gate_lb` sigmoid(exp(A_log) (f + dt_bias)) (the lower-bounded "safe" gate); norm its per-head RMSNorm
    (`weight`, `variance_epsilon`) times sigmoid(gate); q / k L2-normalised as transformers' (`x * rsqrt(sum x^2 +
    1e-6)`), scale `K ** -0.5`."""
    cdt, keep = _dp.compute_dtype(wdt), []
    addr = _dp.plan_addresser(keep, cdt)
    p = _cpu_decode.BlockPlan(B=B, H=H, HV=H, K=K, V=K, d=d, ny=W.out_features, KC=KC, hid=bd.ffn_down.in_features,
                              kind=4, conv_act=1, scale=K ** -0.5, nthreads=max(1, torch.get_num_threads()),
                              has_ffn=1, wbf16=int(wdt == torch.bfloat16),
                              rank_f=0 if Wf is None else Wf.in_features,
                              rank_g=0 if Wg2 is None else Wg2.in_features,
                              gate_sig=1, l2eps=1e-6, l2conv=0)
    _dp.set_weight(p, "W", W, wdt, addr)
    p.cw = addr(conv.weight.view(conv.weight.shape[0], -1))
    if Wf is not None:
        _dp.set_weight(p, "Wf", Wf, wdt, addr)
    if Wg2 is not None:
        _dp.set_weight(p, "Wg2", Wg2, wdt, addr)
    if gate_lb is not None:
        p.gate_lb_on, p.gate_lb = 1, float(gate_lb)
    p.neg_a = addr(-torch.exp(A_log.detach().to(cdt)).reshape(H))
    p.dt_bias = addr(dt_bias)
    p.has_norm, p.nw, p.norm_eps, p.has_gate = 1, addr(norm.weight), float(norm.variance_epsilon), 1
    _dp.set_weight(p, "Wo", out_proj, wdt, addr)
    return _dp.finish_block_plan(p, bd, addr, keep, wdt)


def kda_conv_norm_reason(layer, norm_class: str, wdt) -> Optional[str]:
    """Why a transformers KDA layer's short convolution, gated output norm (of class `norm_class`) or A_log / dt_bias
    are not what the plan's KDA block computes (a bias-free depthwise SiLU conv of the model's dtype, a per-head
    RMSNorm with a sigmoid gate, A_log per head, dt_bias per channel), or None."""
    H, K, KC = layer.num_heads, layer.head_dim, layer.conv_kernel_size
    HK, m, fg = H * K, layer._modules, layer._modules["forget_gate"]
    conv, onorm = m.get("conv1d"), m.get("o_norm")
    if (type(conv) is not nn.Conv1d or conv.bias is not None or conv.weight.shape != (3 * HK, 1, KC)
            or conv.groups != 3 * HK or conv.weight.dtype != wdt or layer.activation not in ("silu", "swish")):
        return "a short convolution that is not a bias-free depthwise SiLU nn.Conv1d"
    if (type(onorm).__name__ != norm_class or getattr(onorm, "activation", None) != "sigmoid"
            or onorm.weight.shape != (K,)):
        return "an output norm that is not a per-head RMSNorm with a sigmoid gate"
    if fg.A_log.numel() != H or fg.dt_bias.shape != (HK,):
        return "A_log / dt_bias of unexpected shapes"
    return None


def call_usable(positions="cache", attention_free: Optional[str] = "unpadded"):
    """A description's `call_usable(cache, B, L, attention_mask, position_ids)` (L: the softmax layers' length, None
    without them): no left padding (an attention mask, if given, keeps the L cached positions and the new one) and
    the token's position as the model's forward takes it. `positions`: "cache" (position ids, if given, at the
    cache's length: the forward takes the position from the cache), "required" (given, at the cache's length),
    "ignored" (not read: no RoPE), or a function `(cache, L, position_ids)` that gives the position or None (the
    description's `position`). `attention_free`, for L None: "unpadded" (a 2-D mask, if given, keeps every
    position), "cache" (L is the cache's `get_seq_length()`), None (the call steps aside)."""

    def usable(cache, B: int, L: Optional[int], attention_mask, position_ids) -> bool:
        if L is None:
            if attention_free is None:
                return False
            if attention_free == "unpadded":
                return unpadded(attention_mask, B)
            L = cache.get_seq_length()
        if attention_mask is not None and not (isinstance(attention_mask, torch.Tensor)
                                               and attention_mask.shape == (B, L + 1) and bool(attention_mask.all())):
            return False   # (left padding: transformers' masked path)
        if callable(positions):
            return positions(cache, L, position_ids) is not None
        if positions == "ignored" or position_ids is None:
            return positions != "required"
        return isinstance(position_ids, torch.Tensor) and bool((position_ids == L).all())

    return usable


#: `call_usable` for a model whose forward takes the position from the cache (transformers' `cache.get_seq_length()`,
#: L when the model has softmax layers)
cached_call_usable = call_usable("cache", "cache")


#: the keywords of a causal LM's forward the hook serves
CAUSAL_LM_KWARGS = frozenset({"input_ids", "attention_mask", "position_ids", "cache", "past_key_values", "use_cache",
                              "logits_to_keep", "return_dict", "output_attentions", "output_hidden_states"})


def hookable(describe):
    """A description's `hookable(model)` where every model `describe` describes is hooked: described, and the
    compiled decode available."""
    return lambda model: not isinstance(describe(model), str) and _cpu_decode.available()


# -- multi-head latent attention (kind 7) and DeepSeek-V3's routed experts (router mode 2): Kimi Linear's and
#    Bailing hybrid's ---------------------------------------------------------------------------------------------

class MLA:
    """A transformers MLA layer (DeepSeek-V3's attention as Kimi Linear's `KimiLinearAttention` and Bailing
    hybrid's `BailingHybridAttention` compute it) as the plan's latent-attention block reads it: the fused first
    product `W = [q_proj (or q_a_proj) | kv_a_proj_with_mqa | g_proj (the head-wise gate, when `gated`)]`
    (`fused_linear`), and the base model's rotary embedding (None: no position, Kimi's NoPE)."""

    __slots__ = ("layer", "W", "rotary", "gated")

    def __init__(self, layer, rotary, gated: bool):
        self.layer, self.rotary, self.gated = layer, rotary, gated
        self.W = fused_linear(*mla_first(layer, gated))


def mla_first(layer, gated: bool) -> tuple:
    """The projections of an MLA layer's fused first product, in the plan's order."""
    m = layer._modules
    first = m["q_proj"] if layer.q_lora_rank is None else m["q_a_proj"]
    return (first, m["kv_a_proj_with_mqa"]) + ((m["g_proj"],) if gated else ())


def mla_reason(layer, cls_name: str, d: int, wdt, rotary=None, gated: bool = False) -> Optional[str]:
    """Why the plan's latent-attention block (kind 7, csrc/decode_mla.h) does not compute this transformers MLA
    layer of class `cls_name` (bias-free projections of the model's dtype, plain RMSNorms on the latent and the low-
    rank q, one key/value head group per head; `rotary` the base model's default RoPE
    for a layer that rotates its rope part, `gated` a head-wise sigmoid gate `g_proj`), or None."""
    if type(layer).__name__ != cls_name:
        return f"an attention layer of type {type(layer).__name__}"
    H, r, R, dn, dv = layer.num_heads, layer.kv_lora_rank, layer.qk_rope_head_dim, layer.qk_nope_head_dim, \
        layer.v_head_dim
    qr, m = layer.q_lora_rank, layer._modules
    if layer.num_key_value_groups != 1 or R % 2 or min(H, r, dn, dv) < 1:
        return "an MLA layer with grouped key/value heads or an odd rope dim"
    shapes = {"kv_a_proj_with_mqa": (r + R, d), "kv_b_proj": (H * (dn + dv), r), "o_proj": (d, H * dv)}
    shapes.update({"q_proj": (H * (dn + R), d)} if qr is None
                  else {"q_a_proj": (qr, d), "q_b_proj": (H * (dn + R), qr)})
    if gated:
        shapes["g_proj"] = (H, d)
    if not all(plan_projection(m.get(n), s, wdt) for n, s in shapes.items()):
        return f"MLA projections of the expected shapes that are {NOT_PLAN_PROJECTIONS}"
    why = fusion_reason(*mla_first(layer, gated))
    if why:
        return f"MLA's first product: {why}"
    norms = [m.get("kv_a_layernorm")] + ([] if qr is None else [m.get("q_a_layernorm")])
    if any(not type(n).__name__.endswith("RMSNorm") or n.weight.dtype != wdt or set(n._parameters) != {"weight"}
           for n in norms) or norms[0].weight.shape != (r,):
        return "MLA latent norms that are not plain RMSNorms of the model's dtype"
    if rotary is not None and (getattr(rotary, "rope_type", "default") != "default"
                               or rotary.inv_freq.numel() != R // 2):
        return "an MLA rotary embedding that is not a default RoPE over the rope dims"
    return None


def mla_plan(part: MLA, bd: _dp.BlockDescription, B: int, d: int, wdt: torch.dtype):
    """The plan's latent-attention block (kind 7) for `part`: its cache rows are transformers' (`keys` the normed
    latents `[B, 1, T, kv_lora_rank]`, `values` the rotated shared keys `[B, 1, T, qk_rope_head_dim]`; `p.att` says
    so to hf/kernelize_plan.py's mirrors)."""
    layer, m = part.layer, part.layer._modules
    cdt, keep = _dp.compute_dtype(wdt), []
    addr = _dp.plan_addresser(keep, cdt)
    H, r, R, dn, dv = layer.num_heads, layer.kv_lora_rank, layer.qk_rope_head_dim, layer.qk_nope_head_dim, \
        layer.v_head_dim
    qr = layer.q_lora_rank or 0
    rot = part.rotary
    p = _cpu_decode.BlockPlan(B=B, H=H, HV=H, K=dn + R, V=dv, d=d, ny=part.W.out_features,
                              hid=bd.ffn_down.in_features, kind=7, scale=float(layer.scaling),
                              nthreads=max(1, torch.get_num_threads()), has_ffn=1, wbf16=int(wdt == torch.bfloat16),
                              kvh=1, rot=R if rot is not None else 0, kv_bf16=int(wdt == torch.bfloat16), rope_f32=1,
                              rope_scale=float(getattr(rot, "attention_scaling", 1.0) or 1.0), mla_rank=r, mla_nope=dn,
                              mla_rope=R, mla_qr=qr, mla_gate=int(part.gated))
    _dp.set_weight(p, "W", part.W, wdt, addr)
    kvn = m["kv_a_layernorm"]
    p.mla_kvnw, p.mla_kv_eps = addr(kvn.weight), float(kvn.variance_epsilon)
    _dp.set_weight(p, "mla_Wkb", m["kv_b_proj"], wdt, addr)
    if qr:
        qn = m["q_a_layernorm"]
        p.mla_qnw, p.mla_q_eps = addr(qn.weight), float(qn.variance_epsilon)
        _dp.set_weight(p, "mla_Wqb", m["q_b_proj"], wdt, addr)
    if rot is not None:
        p.inv_freq = addr(rot.inv_freq, torch.float64)
    _dp.set_weight(p, "Wo", m["o_proj"], wdt, addr)
    p.att = types.SimpleNamespace(kv_heads=1, head_dim=r, head_dim_v=R)
    return _dp.finish_block_plan(p, bd, addr, keep, wdt)


#: transformers' DeepSeek-V3-style MoE blocks: a sigmoid `<Model>TopkRouter` (correction bias, groups, routed
#: scaling), fused 3-D experts `gate_up_proj [E, 2I, d]` / `down_proj [E, d, I]`, an ungated shared expert
DEEPSEEK_MOE = ("KimiLinearMoE", "BailingHybridMoE")


def grouped_router_moe(router: nn.Module, up: torch.Tensor, down: torch.Tensor, d: int, wdt,
                       gated: bool = True) -> Union[_dp.MoEDescription, str]:
    """The `decode_plan.MoEDescription` of a DeepSeek-V3-style sigmoid `router` (`num_experts` E in `num_group`
    groups of which `topk_group` are kept, `top_k`; its weight `[E, d]` of the model's dtype or fp32, the float
    correction bias `[E]`: router mode 2, `set_router2`) over fused 3-D experts `up` (`gate_up_proj`, or `up_proj`
    when not `gated`) and `down`, read in place, or why the plan does not compute it."""
    E = getattr(router, "num_experts", 0)
    G, kg, k = getattr(router, "num_group", 0), getattr(router, "topk_group", 0), getattr(router, "top_k", 0)
    if not (G >= 1 and E % G == 0 and E // G >= 2 and 1 <= kg <= G and 1 <= k <= kg * (E // G)):
        return "an MoE router whose groups the plan does not choose among (E / groups < 2, k too large)"
    bias, w = router.e_score_correction_bias, router.weight
    if (tuple(w.shape) != (E, d) or w.dtype not in (wdt, torch.float32) or not w.is_contiguous()
            or tuple(bias.shape) != (E,) or not bias.dtype.is_floating_point):
        return "an MoE router whose weight or correction bias the plan does not read (shapes, dtype)"
    # (the router's weight as `MoEDescription` checks it: the plan reads the router itself, `set_router2`)
    moe = _dp.MoEDescription(w.detach().to(wdt) if w.dtype != wdt else w.detach(), up.detach(), down.detach(), k,
                             router.norm_topk_prob, gated=gated)
    if not _dp.moe_usable(moe, d, wdt):
        return "an MoE block whose experts the plan does not read (shapes, dtype, layout)"
    return moe


def deepseek_moe(mlp: nn.Module, d: int, wdt) -> Union[tuple, str]:
    """(shared expert's fused gate | up, its down, `decode_plan.MoEDescription`, the router module) of a
    DeepSeek-V3-style MoE block (`DEEPSEEK_MOE`), the experts read in place, or why the plan does not compute it.
    The router (router mode 2) is set into the block plan by `set_router2`."""
    name = type(mlp).__name__
    if name not in DEEPSEEK_MOE:
        return f"a {name} feed-forward (neither a dense SwiGLU MLP nor a described MoE block)"
    m = mlp._modules
    router, experts, shared = (m.get(n) for n in ("gate", "experts", "shared_experts"))
    if (type(router).__name__ != name.replace("MoE", "TopkRouter") or set(router._parameters) != {"weight"}
            or set(router._buffers) != {"e_score_correction_bias"} or experts is None
            or set(experts._parameters) != {"gate_up_proj", "down_proj"}
            or type(getattr(experts, "act_fn", None)).__name__ not in ("SiLU", "SiLUActivation")):
        return "an MoE block whose router or experts are not transformers' sigmoid top-k router and fused experts"
    got = swiglu_ffn(shared, type(shared).__name__, d, wdt) if shared is not None else "no shared expert"
    if isinstance(got, str):
        return f"an MoE block's shared expert: {got}"
    moe = grouped_router_moe(router, experts.gate_up_proj, experts.down_proj, d, wdt)
    return moe if isinstance(moe, str) else (got[0], got[1], moe, router)


def set_router2(p, router: nn.Module, wdt: torch.dtype):
    """Router mode 2 (csrc/decode_moe.h) into block plan p: DeepSeek-V3's sigmoid grouped top-k `router` (its
    weight read in place in fp32 or the model's dtype, as transformers' router reads it in fp32; the correction
    bias in float), its groups and routed scaling factor. Returns p."""
    cdt = _dp.compute_dtype(wdt)
    w = router.weight.detach()
    if not (w.dtype == torch.bfloat16 and cdt == torch.float32) and w.dtype != cdt:
        w = w.to(cdt).contiguous()   # (an fp64 plan's router: its products are in the plan's type)
    b = router.e_score_correction_bias.detach()
    if b.dtype != torch.float32:
        b = b.float().contiguous()
    p.keep.extend((w, b))
    p.router, p.router_wbf16, p.Wr, p.e_bias = 2, int(w.dtype == torch.bfloat16), w.data_ptr(), b.data_ptr()
    p.moe_groups, p.moe_topk_groups = router.num_group, router.topk_group
    p.routed_scale = float(router.routed_scaling_factor)
    return p


def describe_mla_kda_model(model: nn.Module, models: tuple, kda_reason, kda_part, mla_class: str, mlp_class: str,
                           norm_class: str, rotary=None, gated: bool = False) -> Union[tuple, str]:
    """(ModelDescription, per-layer part) of a transformers Kimi-Linear-like model: pre-norm blocks whose mixer
    (`layer.self_attn`) is a KDA layer (`kda_reason(mixer, d, wdt)` None; part `kda_part(mixer)`) or an MLA layer
    of class `mla_class` (part `MLA`), and whose feed-forward is a dense SwiGLU MLP of class `mlp_class` or a
    DeepSeek-V3-style MoE block (`DEEPSEEK_MOE`: the part is then `(part, router)`), with plain RMSNorms of class
    `norm_class`; or the reason the plan does not compute it."""

    def block(layer, base, d: int, wdt):
        mixer = layer.self_attn
        is_mla = type(mixer).__name__ == mla_class
        why = mla_reason(mixer, mla_class, d, wdt, rotary, gated) if is_mla else kda_reason(mixer, d, wdt)
        moe = None
        if type(layer.mlp).__name__ in DEEPSEEK_MOE:
            ffn = deepseek_moe(layer.mlp, d, wdt)
            moe = None if isinstance(ffn, str) else ffn[2]
        else:
            ffn = swiglu_ffn(layer.mlp, mlp_class, d, wdt)
        if why is None and isinstance(ffn, str):
            why = ffn
        norms = block_norms(layer, ("input_layernorm", "post_attention_layernorm"), norm_class, wdt)
        if why is None and isinstance(norms, str):
            why = norms
        if why is not None:
            return why
        bd = _dp.BlockDescription(mixer, "mla" if is_mla else "kda", *norms, "swiglu" if moe is None else "moe",
                                  ffn[0], ffn[1], moe=moe)
        part = MLA(mixer, rotary, gated) if is_mla else kda_part(mixer)
        return bd, part if moe is None else (part, ffn[3])

    return describe_layers(model, models, "model", "embed_tokens", block, "norm", norm_class)


def mla_kda_block_plan(kda_plan):
    """A description's `block_plan` for `describe_mla_kda_model`'s parts: MLA parts through `mla_plan`, the others
    through `kda_plan(part, bd, B, d, wdt)`, then router mode 2 where the part carries a router."""
    def block_plan(part, bd, B: int, d: int, wdt: torch.dtype):
        router = None
        if type(part) is tuple:
            part, router = part
        p = mla_plan(part, bd, B, d, wdt) if type(part) is MLA else kda_plan(part, bd, B, d, wdt)
        return p if p is None or router is None else set_router2(p, router, wdt)
    return block_plan


def mla_kda_state_spec(kda_spec):
    """A description's `state_spec` for `describe_mla_kda_model`'s parts (an MLA layer keeps no recurrent state:
    its cache rows are the KV mirrors')."""
    def state_spec(part) -> tuple:
        part = part[0] if type(part) is tuple else part
        return ("softmax", 0, 0, 0, 0, ()) if type(part) is MLA else kda_spec(part)
    return state_spec
