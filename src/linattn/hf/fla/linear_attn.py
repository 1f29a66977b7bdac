"""fla's `linear_attn` (fla/layers/linear_attn.py, LinearAttention) as linattn's `linear-<map>` mixers: q/k/v
projections (key width hidden * expand_k, value width hidden * expand_v, grouped k/v heads), the feature map on q and
k, the unnormalised causal sum with the scale K_phi**-0.5 on phi(q) (`scale_after_map`), a per-head RMSNorm, o_proj.

Feature maps: identity, elu (elu+1) and relu map to linattn's maps of the same name; fla's maps with weights
(elementwise_product, its default; hedgehog; t2r) and dpfp to LinearAttention's `learned_map` (on the
`linear-identity` mixer, tied or not as fla's tie_feature_map_qk); norm_q / norm_k to `sum_norm_q` / `sum_norm_k`;
norm_feature_map (the normaliser + 1e-10) to `normalize_add`."""
from __future__ import annotations

from typing import Any, Dict

import torch

from ...errors import CheckpointError
from .core import LayerParams, MixerConversion, cfg_get, register_fla, require
from .shared import expand_heads, kv_heads

#: fla's feature_map -> linattn's map of the same phi = psi
FEATURE_MAPS = {"identity": "identity", "elu": "elu+1", "relu": "relu"}
#: fla's feature_map -> LinearAttention's learned_map, and K_phi / head_k_dim
LEARNED = {"elementwise_product": ("hadamard", 1), "hedgehog": ("hedgehog", 2), "t2r": ("t2r", 1), "dpfp": ("dpfp", 8)}


def _learned_state(p: LayerParams, tied: bool) -> Dict[str, Any]:
    """fla's feature_map_q.* / feature_map_k.* as LearnedMap's q.* / k.*; tied, fla saves the one module under
    either name (transformers keeps one of tied tensors), both read."""
    q = {k[len("feature_map_q."):]: k for k in p if k.startswith("feature_map_q.")}
    k = {k[len("feature_map_k."):]: k for k in p if k.startswith("feature_map_k.")}
    out = {f"feature_map.q.{n}": p[name] for n, name in q.items()}
    if tied:
        for n, name in k.items():
            t = p[name]
            if f"feature_map.q.{n}" in out and not torch.equal(out[f"feature_map.q.{n}"], t):
                raise CheckpointError(f"tie_feature_map_qk is set, but {p.prefix + name!r} differs from its q twin")
            out.setdefault(f"feature_map.q.{n}", t)
    else:
        out.update({f"feature_map.k.{n}": p[name] for n, name in k.items()})
    return out


@register_fla("linear_attn")
def convert_linear_attn(cfg: dict, layer_idx: int, p: LayerParams) -> MixerConversion:
    H, dk, dv = expand_heads(cfg, 4, 1.0, 1.0)
    fm = cfg_get(cfg, "feature_map", "elementwise_product")
    require(fm in FEATURE_MAPS or fm in LEARNED, cfg,
            f"feature_map {fm!r} (supported: {', '.join(list(FEATURE_MAPS) + list(LEARNED))})")
    require(cfg_get(cfg, "elementwise_affine", True), cfg, "an output norm without a weight (elementwise_affine)")
    kphi = dk * (LEARNED[fm][1] if fm in LEARNED else 1)
    kwargs: Dict[str, Any] = {"head_dim": dk, "head_dim_v": dv, "normalize": False, "scale": kphi ** -0.5,
                              "scale_after_map": True, "output_norm": True, "short_conv": False, "rope": False}
    if cfg_get(cfg, "norm_q", False) or cfg_get(cfg, "norm_k", False):   # phi / (sum phi + 1e-4), before the scale
        kwargs.update(sum_norm_q=bool(cfg_get(cfg, "norm_q", False)), sum_norm_k=bool(cfg_get(cfg, "norm_k", False)))
    if cfg_get(cfg, "norm_feature_map", False):   # fla: o / (phi(q) . sum phi(k) + 1e-10)
        kwargs["normalize_add"] = 1e-10
    state: Dict[str, Any] = {}
    if fm in LEARNED:
        tied = bool(cfg_get(cfg, "tie_feature_map_qk", False)) or fm == "dpfp"
        kwargs.update(learned_map=LEARNED[fm][0], learned_map_tied=tied)
        state.update(_learned_state(p, tied))
    kwargs.update(kv_heads(cfg, H))
    state.update({f"{n}_proj.weight": p[f"{n}_proj.weight"] for n in "qkvo"})
    state["o_norm.weight"] = p["norm.weight"]
    return MixerConversion("linear-" + FEATURE_MAPS.get(fm, "identity"), kwargs, state, {"n_heads": H})
