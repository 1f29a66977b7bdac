"""fla's `forgetting_transformer` (fla/models/forgetting_transformer): FoX attention (linattn's mixer `fox`).

fla's ForgettingAttention: q/k/v projections (qkv_bias; grouped k/v heads num_kv_heads), the forget gate
logsigmoid(f_proj(x)) per head, optional q/k norm (fla's GroupNorm(is_rms_norm=True): one weight per channel
[H * D], eps 1e-5), softmax with the 1/sqrt(head_dim) scale, an optional output gate sigmoid(g_proj(x)) * o (no
output norm), o_proj; no RoPE, no short convolution. linattn's FoX takes them as options (n_kv_heads, qkv_bias,
qk_norm with qk_norm_weight="channel", output_gate with gate_act="sigmoid").

window_size is refused: fla's forward (training, prefill) ignores it while its decoding cache applies it, so no
single linattn model gives both.
"""
from __future__ import annotations

from typing import Any, Dict

from .core import LayerParams, MixerConversion, biases_and_qk_norm, cfg_get, register_fla, require
from .shared import kv_heads


@register_fla("forgetting_transformer")
def convert_forgetting_transformer(cfg: dict, layer_idx: int, p: LayerParams) -> MixerConversion:
    d, H = int(cfg["hidden_size"]), int(cfg_get(cfg, "num_heads", 32))
    require(d % H == 0, cfg, f"hidden_size {d} not divisible by num_heads {H}")
    require(cfg.get("window_size") is None, cfg, "window_size (fla applies it when decoding only)")
    kwargs: Dict[str, Any] = {"rope": False, "short_conv": False, "output_norm": False, **kv_heads(cfg, H)}
    state = {f"{n}_proj.weight": p[f"{n}_proj.weight"] for n in "qkvof"}
    state["f_proj.bias"] = p["f_proj.bias"]
    biases_and_qk_norm(p, kwargs, state, cfg_get(cfg, "qkv_bias", False), cfg_get(cfg, "qk_norm", False),
                       qk_norm_weight="channel", qk_norm_eps=1e-5)
    if cfg_get(cfg, "use_output_gate", False):
        kwargs.update(output_gate=True, gate_act="sigmoid")
        state["g_proj.weight"] = p["g_proj.weight"]
    return MixerConversion("fox", kwargs, state, {"n_heads": H, "head_dim": d // H})
