"""What the architecture descriptions of the kernelized whole-model plan share (hf/kernelize_plan.py and its
per-architecture modules import this; it imports none of them)."""
from __future__ import annotations

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


def fused_linear(*weights: torch.Tensor) -> _dp.StackedRows:
    """A projection the plan reads, fused from several of transformers' bias-free `nn.Linear` weights stacked by
    rows: read in place (no copy), or one matrix when a single weight is given (e.g. rows regrouped once)."""
    return _dp.StackedRows(weights)


def plain_linear(m, shape, wdt) -> bool:
    """m is exactly a bias-free `nn.Linear` of weight dtype wdt and weight shape `shape` ([out, in])."""
    return type(m) is nn.Linear and m.bias is None and m.weight.dtype == wdt and tuple(m.weight.shape) == shape


def swiglu_ffn(mlp: nn.Module, cls_name: str, d: int, wdt) -> Union[tuple, str]:
    """(fused gate | up, down) of transformers' dense SwiGLU MLP of class `cls_name` (`gate_proj`, `up_proj`,
    `down_proj`, `config.hidden_act` SiLU), or why the plan does not compute it."""
    if type(mlp).__name__ != cls_name:
        return f"a {type(mlp).__name__} feed-forward (MoE: routed experts are not a plan block)"
    m = mlp._modules
    gate, up, down = m.get("gate_proj"), m.get("up_proj"), m.get("down_proj")
    hid = getattr(gate, "out_features", None)
    if hid is None or not (plain_linear(gate, (hid, d), wdt) and plain_linear(up, (hid, d), wdt)
                           and plain_linear(down, (d, hid), wdt)):
        return "an MLP whose projections are not bias-free nn.Linear layers of the model's dtype"
    if getattr(mlp.config, "hidden_act", None) not in ("silu", "swish"):
        return "an MLP activation other than SiLU"
    return fused_linear(gate.weight, up.weight), down


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
    if not plain_linear(sgate, (1, d), wdt):
        return "an MoE block's shared-expert gate that is not a bias-free nn.Linear [1, d]"
    moe = _dp.MoEDescription(router.weight.detach(), experts.gate_up_proj.detach(), experts.down_proj.detach(),
                             router.top_k, router.norm_topk_prob if norm_topk is None else norm_topk, sgate)
    if not _dp.moe_usable(moe, d, wdt):
        return "an MoE block whose router or experts the plan does not read (shapes, dtype, layout)"
    return got[0], got[1], moe


def base_and_embedding(model: nn.Module, models: tuple, base: str, embedding: str) -> Union[tuple, str]:
    """(base model `model.<base>`, its embedding `<embedding>`, the weights' dtype) of a model whose class is one of
    `models`, or why the plan cannot compute it."""
    if type(model).__name__ not in models:
        return f"{type(model).__name__} is not one of {models}"
    inner = getattr(model, base)
    embed = getattr(inner, embedding)
    wdt = embed.weight.dtype
    if _dp.compute_dtype(wdt) is None:
        return f"weights in {wdt} (the plan reads fp32, fp64, bf16)"
    return inner, embed, wdt


def model_description(model: nn.Module, embed: nn.Module, blocks: list, final_norm: nn.Module, norm_class: str,
                      wdt: torch.dtype) -> Union[_dp.ModelDescription, str]:
    """The ModelDescription of described blocks with transformers' plain RMSNorm `final_norm` (of class
    `norm_class`: its eps is `variance_epsilon`) and `model.lm_head` (tied or not), or why the plan cannot read
    them."""
    if type(final_norm).__name__ != norm_class or final_norm.weight.dtype != wdt:
        return f"a final norm that is not transformers' {norm_class}"
    head = model.lm_head
    desc = _dp.ModelDescription(embed, blocks, None, None if head.weight is embed.weight else head)
    if not _dp.model_weights_usable(desc, wdt):   # (the final norm checked above)
        return "an embedding or head the plan does not read (a bias, another dtype, a hook)"
    desc.norm = norm(final_norm.weight, final_norm.variance_epsilon)
    return desc


def description(got: Union[tuple, str]) -> Optional[tuple]:
    """A `describe` answer as `describe_model` returns it: the description, or None."""
    return None if isinstance(got, str) else got


def reason(got: Union[tuple, str]) -> Optional[str]:
    """A `describe` answer as `undescribed_reason` returns it: why not, or None."""
    return got if isinstance(got, str) else None


def unpadded(attention_mask, B: int) -> bool:
    """Whether an attention mask (2-D, B rows, or None) keeps every position: no left padding."""
    return attention_mask is None or (isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2
                                      and attention_mask.shape[0] == B and bool(attention_mask.all()))


def gdn_plan(layer, W: _dp.StackedRows, norm: nn.Module, out_proj: nn.Module, bd: _dp.BlockDescription, B: int, d: int,
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
    p.Wo = addr(out_proj.weight, wdt)
    return _dp.finish_block_plan(p, bd, addr, keep, wdt)


def kda_plan(H: int, K: int, KC: int, W: _dp.StackedRows, conv: nn.Module, A_log: torch.Tensor, dt_bias: torch.Tensor,
             norm: nn.Module, out_proj: nn.Module, bd: _dp.BlockDescription, B: int, d: int, wdt: torch.dtype, *,
             Wf: Optional[torch.Tensor] = None, Wg2: Optional[torch.Tensor] = None, gate_lb: Optional[float] = None):
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
                              rank_f=0 if Wf is None else Wf.shape[1], rank_g=0 if Wg2 is None else Wg2.shape[1],
                              gate_sig=1, l2eps=1e-6, l2conv=0)
    _dp.set_weight(p, "W", W, wdt, addr)
    p.cw = addr(conv.weight.view(conv.weight.shape[0], -1))
    if Wf is not None:
        p.Wf = addr(Wf, wdt)
    if Wg2 is not None:
        p.Wg2 = addr(Wg2, wdt)
    if gate_lb is not None:
        p.gate_lb_on, p.gate_lb = 1, float(gate_lb)
    p.neg_a = addr(-torch.exp(A_log.detach().to(cdt)).reshape(H))
    p.dt_bias = addr(dt_bias)
    p.has_norm, p.nw, p.norm_eps, p.has_gate = 1, addr(norm.weight), float(norm.variance_epsilon), 1
    p.Wo = addr(out_proj.weight, wdt)
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


def describe_kda_model(model: nn.Module, models: tuple, kda_reason, part, mlp_class: str,
                       norm_class: str) -> Union[tuple, str]:
    """(ModelDescription, per-layer `part(mixer)`) of a transformers model whose pre-norm blocks are a KDA mixer
    (`layer.self_attn`, `kda_reason(mixer, d, wdt)` None) and a dense SwiGLU MLP of class `mlp_class`, with plain
    RMSNorms of class `norm_class` (Kimi Linear's, Bailing hybrid's), or the reason the plan does not compute it."""
    got = base_and_embedding(model, models, "model", "embed_tokens")
    if isinstance(got, str):
        return got
    base, embed, wdt = got
    d = embed.weight.shape[1]
    blocks, parts = [], []
    for i, layer in enumerate(base.layers):
        mixer = layer.self_attn
        why = kda_reason(mixer, d, wdt)
        ffn = swiglu_ffn(layer.mlp, mlp_class, d, wdt)
        if why is None and isinstance(ffn, str):
            why = ffn
        norms = [layer._modules.get(n) for n in ("input_layernorm", "post_attention_layernorm")]
        if why is None and any(type(n).__name__ != norm_class or n.weight.dtype != wdt for n in norms):
            why = f"block norms that are not transformers' {norm_class}"
        if why is not None:
            return f"layer {i}: {why}"
        n1, n2 = (norm(n.weight, n.variance_epsilon) for n in norms)
        blocks.append(_dp.BlockDescription(mixer, "kda", n1, n2, "swiglu", ffn[0], ffn[1]))
        parts.append(part(mixer))
    desc = model_description(model, embed, blocks, base.norm, norm_class, wdt)
    return desc if isinstance(desc, str) else (desc, parts)


def cached_call_usable(cache, B: int, L: Optional[int], attention_mask, position_ids) -> bool:
    """A description's `call_usable` for a model whose forward takes the position from the cache (transformers'
    `cache.get_seq_length()`, L when the model has softmax layers): no left padding, position ids (if given) at the
    cache's length."""
    if L is None:
        L = cache.get_seq_length()
    if attention_mask is not None and not (isinstance(attention_mask, torch.Tensor)
                                           and attention_mask.shape == (B, L + 1) and bool(attention_mask.all())):
        return False   # (left padding: transformers' masked path)
    return position_ids is None or (isinstance(position_ids, torch.Tensor) and bool((position_ids == L).all()))


#: the keywords of a causal LM's forward the hook serves
CAUSAL_LM_KWARGS = frozenset({"input_ids", "attention_mask", "position_ids", "cache", "past_key_values", "use_cache",
                              "logits_to_keep", "return_dict", "output_attentions", "output_hidden_states"})


def hookable(describe):
    """A description's `hookable(model)` where every model `describe` describes is hooked: described, and the
    compiled decode available."""
    return lambda model: not isinstance(describe(model), str) and _cpu_decode.available()
