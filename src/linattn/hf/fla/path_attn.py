"""fla's `path_attn` (fla/models/path_attn): PaTH attention (linattn's mixer `path`).

fla's PaTHAttention: q/k/v/o projections; w from a low-rank (32) or full-rank projection (use_low_rank_w), through
a causal depthwise convolution (kernel 3, SiLU, no bias; use_w_shortconv) and fla's l2_norm (x * rsqrt(sum x^2 +
1e-6)); beta = 2 sigmoid(bt_proj(x)); an optional FoX gate logsigmoid(g_proj(x)) (use_forget_gate); no RoPE, no
output norm. linattn's PaTH takes them as options (w_rank=None, w_conv, w_conv_act="silu", w_l2norm="rsqrt") and
names them w_down / w_up (or w_proj), w_conv, b_proj, f_proj. Grouped k/v heads (num_kv_heads): w and beta are
per k/v head, as the keys (linattn's n_kv_heads).
"""
from __future__ import annotations

from typing import Any, Dict

from .core import LayerParams, MixerConversion, cfg_get, register_fla, require
from .shared import kv_heads


@register_fla("path_attn")
def convert_path_attn(cfg: dict, layer_idx: int, p: LayerParams) -> MixerConversion:
    d, H = int(cfg["hidden_size"]), int(cfg_get(cfg, "num_heads", 32))
    require(d % H == 0, cfg, f"hidden_size {d} not divisible by num_heads {H}")
    low_rank, conv = bool(cfg_get(cfg, "use_low_rank_w", True)), bool(cfg_get(cfg, "use_w_shortconv", True))
    forget = bool(cfg_get(cfg, "use_forget_gate", False))
    state = {f"{n}_proj.weight": p[f"{n}_proj.weight"] for n in "qkvo"}
    state["b_proj.weight"], state["b_proj.bias"] = p["bt_proj.weight"], p["bt_proj.bias"]
    if low_rank:
        state["w_down.weight"], state["w_up.weight"] = p["w_proj.0.weight"], p["w_proj.1.weight"]
    else:
        state["w_proj.weight"] = p["w_proj.weight"]
    kwargs: Dict[str, Any] = {"rope": False, "short_conv": False, "output_norm": False, "w_l2norm": "rsqrt",
                              "w_rank": int(p["w_proj.0.weight"].shape[0]) if low_rank else None}
    if conv:
        w = p["w_conv1d.weight"]
        state["w_conv.weight"] = w
        kwargs.update(w_conv_act="silu", w_conv_size=int(w.shape[-1]))
        if "w_conv1d.bias" in p:
            kwargs["w_conv_bias"] = True
            state["w_conv.bias"] = p["w_conv1d.bias"]
    else:
        kwargs["w_conv"] = False
    if forget:
        kwargs["use_forget_gate"] = True
        state["f_proj.weight"], state["f_proj.bias"] = p["g_proj.weight"], p["g_proj.bias"]
    kwargs.update(kv_heads(cfg, H))
    return MixerConversion("path", kwargs, state, {"n_heads": H, "head_dim": d // H})
