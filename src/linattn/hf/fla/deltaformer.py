"""fla's `deltaformer` (fla/models/deltaformer): DeltaFormer attention (linattn's mixer `deltaformer`).

fla's DeltaFormerAttention: q/k/v/o projections (qkv_bias), an optional per-head q/k RMSNorm (weight [head_dim],
eps 1e-5) applied before RoPE (rotate-half, base rope_theta), beta = b_proj(x) passed to the kernel as it is (no
sigmoid), stage one scored by the queries (u_t = v_t - beta_t sum_{j<t} softmax_j(q_t . k_j / sqrt(D)) u_j), stage
two causal softmax attention over u. linattn's DeltaFormer takes them as options (stage1_query="q",
beta_act=None, qk_norm_before_rope, qk_norm_eps). Grouped k/v heads (num_kv_heads) are refused.
"""
from __future__ import annotations

from typing import Any, Dict

from .core import LayerParams, MixerConversion, biases_and_qk_norm, cfg_get, register_fla, require


@register_fla("deltaformer")
def convert_deltaformer(cfg: dict, layer_idx: int, p: LayerParams) -> MixerConversion:
    d, H = int(cfg["hidden_size"]), int(cfg_get(cfg, "num_heads", 32))
    require(d % H == 0, cfg, f"hidden_size {d} not divisible by num_heads {H}")
    require(int(cfg_get(cfg, "num_kv_heads", H)) == H, cfg, "grouped k/v heads (num_kv_heads)")
    kwargs: Dict[str, Any] = {"rope": True, "short_conv": False, "output_norm": False, "stage1_query": "q",
                              "beta_act": None}
    state = {f"{n}_proj.weight": p[f"{n}_proj.weight"] for n in "qkvob"}
    state["b_proj.bias"] = p["b_proj.bias"]
    biases_and_qk_norm(p, kwargs, state, cfg_get(cfg, "qkv_bias", False), cfg_get(cfg, "qk_norm", False),
                       qk_norm_eps=1e-5, qk_norm_before_rope=True)
    config = {"n_heads": H, "head_dim": d // H, "rope_base": float(cfg_get(cfg, "rope_theta", 10000.0))}
    return MixerConversion("deltaformer", kwargs, state, config)
