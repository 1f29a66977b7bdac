"""fla's `linear_attn` (fla/layers/linear_attn.py, LinearAttention) as linattn's `linear-<map>` mixers: q/k/v
projections (key width hidden * expand_k, value width hidden * expand_v), the feature map on q and k, the
unnormalised causal sum with the scale K_phi**-0.5 on phi(q) (`scale_after_map`), a per-head RMSNorm, o_proj.

Supported feature maps: identity, elu (elu+1), relu. fla's learnable maps (elementwise_product, the default;
hedgehog, t2r) and dpfp have no linattn counterpart yet, nor do norm_q / norm_k, norm_feature_map (its normaliser
adds 1e-10 where linattn's floors at eps): each is a CheckpointError naming it."""
from __future__ import annotations

from typing import Any, Dict

from .core import LayerParams, MixerConversion, cfg_get, register_fla, require
from .gla import _heads

#: fla's feature_map -> linattn's map of the same phi = psi
FEATURE_MAPS = {"identity": "identity", "elu": "elu+1", "relu": "relu"}


@register_fla("linear_attn")
def convert_linear_attn(cfg: dict, layer_idx: int, p: LayerParams) -> MixerConversion:
    H, dk, dv = _heads({"expand_k": 1.0, "expand_v": 1.0, **{k: v for k, v in cfg.items() if v is not None}})
    fm = cfg_get(cfg, "feature_map", "elementwise_product")
    require(fm in FEATURE_MAPS, cfg, f"feature_map {fm!r} (supported: {', '.join(FEATURE_MAPS)})")
    for name in ("norm_q", "norm_k", "norm_feature_map"):
        require(not cfg_get(cfg, name, False), cfg, name)
    require(cfg_get(cfg, "elementwise_affine", True), cfg, "an output norm without a weight (elementwise_affine)")
    # these maps keep the width: K_phi = head_k_dim
    kwargs: Dict[str, Any] = {"head_dim": dk, "head_dim_v": dv, "normalize": False, "scale": dk ** -0.5,
                              "scale_after_map": True, "output_norm": True, "short_conv": False, "rope": False}
    kv = cfg.get("num_kv_heads")
    if kv is not None and int(kv) != H:   # grouped k/v heads (and GLA's decay): k_proj / v_proj are smaller
        kwargs["n_kv_heads"] = int(kv)
    state = {f"{n}_proj.weight": p[f"{n}_proj.weight"] for n in "qkvo"}
    state["o_norm.weight"] = p["norm.weight"]
    return MixerConversion(f"linear-{FEATURE_MAPS[fm]}", kwargs, state, {"n_heads": H})
