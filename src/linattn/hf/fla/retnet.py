"""fla's `retnet` (fla/layers/multiscale_retention.py, MultiScaleRetention) as linattn's `retnet` mixer
(LinearAttention with RetNet's fixed decay gamma_h = 1 - 2^(-5-h)): q/k/v projections (key width hidden *
expand_k, value width hidden * expand_v), RoPE (base 10000) on q and k, scale head_k_dim**-0.5, a per-head RMSNorm
and the swish output gate (or the norm alone)."""
from __future__ import annotations

from typing import Any, Dict

from .core import LayerParams, MixerConversion, cfg_get, register_fla, require
from .shared import expand_heads, kv_heads, output_norm_state


@register_fla("retnet")
def convert_retnet(cfg: dict, layer_idx: int, p: LayerParams) -> MixerConversion:
    H, dk, dv = expand_heads(cfg, 4, 1.0, 2.0)
    require(cfg.get("feature_map") is None, cfg, f"feature_map {cfg.get('feature_map')!r}")
    require(cfg_get(cfg, "elementwise_affine", True), cfg, "an output norm without a weight (elementwise_affine)")
    out_gate = bool(cfg_get(cfg, "use_output_gate", True))
    # fla's RetNet block never passes use_short_conv to its layer: no short convolution whatever the config says
    kwargs: Dict[str, Any] = {"head_dim": dk, "head_dim_v": dv, "output_gate": out_gate, "rope": True,
                              "rope_base": 10000.0, "short_conv": False, **kv_heads(cfg, H)}
    state = {f"{n}_proj.weight": p[f"{n}_proj.weight"] for n in "qkvo"}
    state.update(output_norm_state(p))
    if out_gate:
        state["g_proj.weight"] = p["g_proj.weight"]
    return MixerConversion("retnet", kwargs, state, {"n_heads": H})
