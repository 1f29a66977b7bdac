"""fla's `gla` (fla/layers/gla.py, GatedLinearAttention) as linattn's `gla` mixer (LinearAttention with the
diagonal gate): q/k/v projections (key width hidden * expand_k, value width hidden * expand_v), optional short
convolutions, the low-rank gate logsigmoid(gk_proj(x)) / 16 (optionally clamped below: clamp_min), the
recurrence with scale head_k_dim**-0.5, a per-head RMSNorm and the swish output gate (or the norm alone)."""
from __future__ import annotations

from typing import Any, Dict

from .core import LayerParams, MixerConversion, cfg_get, register_fla, require
from .shared import expand_heads, kv_heads, output_norm_state


def conv_state(p: LayerParams, names=("q", "k", "v")) -> Dict[str, Any]:
    """fla's ShortConvolution weights `{x}_conv1d.weight` [D, 1, W] as linattn's `{x}_conv.weight` (same layout)."""
    return {f"{n}_conv.weight": p[f"{n}_conv1d.weight"] for n in names}


@register_fla("gla")
def convert_gla(cfg: dict, layer_idx: int, p: LayerParams) -> MixerConversion:
    H, dk, dv = expand_heads(cfg, 4, 0.5, 1.0)
    fm = cfg.get("feature_map")
    require(fm in (None, "relu"), cfg, f"feature_map {fm!r} (supported: None, relu)")
    require(cfg_get(cfg, "elementwise_affine", True), cfg, "an output norm without a weight (elementwise_affine)")
    short_conv, out_gate = bool(cfg_get(cfg, "use_short_conv", False)), bool(cfg_get(cfg, "use_output_gate", True))
    low_rank = int(p["gk_proj.0.weight"].shape[0])
    kwargs: Dict[str, Any] = {"head_dim": dk, "head_dim_v": dv, "short_conv": short_conv, "output_gate": out_gate,
                              "gate_low_rank": low_rank}
    if short_conv:
        kwargs["conv_size"] = int(cfg_get(cfg, "conv_size", 4))
    if fm == "relu":   # fla: relu on q and k after the gate, the scale on relu(q) (the same as relu(scale q))
        kwargs["feature_map"] = "relu"
    if cfg.get("clamp_min") is not None:
        kwargs["gate_min"] = float(cfg["clamp_min"])
    kwargs.update(kv_heads(cfg, H))   # (GLA's decay is per k/v head then)
    state = {f"{n}_proj.weight": p[f"{n}_proj.weight"] for n in "qkvo"}
    state.update({"gk_proj.0.weight": p["gk_proj.0.weight"], "gk_proj.1.weight": p["gk_proj.1.weight"],
                  "gk_proj.1.bias": p["gk_proj.1.bias"]})
    state.update(output_norm_state(p))
    if out_gate:
        state["g_proj.weight"] = p["g_proj.weight"]
    if short_conv:
        state.update(conv_state(p))
    return MixerConversion("gla", kwargs, state, {"n_heads": H})
