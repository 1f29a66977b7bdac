"""fla's `kda` (Kimi Delta Attention; fla/models/kda, fla/layers/kda.py) as linattn's `kda` mixer: the low-rank
per-channel gate f_proj (rank head_v_dim), the low-rank output gate g_proj with a bias and the sigmoid-gated
RMSNorm, grouped value heads, allow_neg_eigval, and the bounded gate of safe_gate / lower_bound."""
from __future__ import annotations

from .core import LayerParams, MixerConversion, cfg_get, register_fla, require
from .shared import base_state, common_kwargs, delta_config, grouped_heads


@register_fla("kda")
def convert_kda(cfg: dict, layer_idx: int, p: LayerParams) -> MixerConversion:
    H, HV, Dk, Dv = grouped_heads(cfg, 16, 128, 1.0)
    short_conv = bool(cfg_get(cfg, "use_short_conv", True))
    kwargs = common_kwargs(cfg, short_conv)
    # fla's layer: f_proj d -> head_v_dim -> HV * head_k_dim; g_proj d -> head_v_dim -> HV * head_v_dim (+ bias)
    kwargs.update(head_dim_v=Dv, gate_rank=Dv, output_gate=True, output_gate_rank=Dv, gate_act="sigmoid")
    bound = cfg.get("lower_bound")
    if bound is not None:   # fla's kernels take the bounded gate whenever lower_bound is set (safe_gate or not)
        require(float(bound) < 0, cfg, f"lower_bound {bound!r} (must be negative)")
        kwargs["gate_lower_bound"] = float(bound)
    state = base_state(p, short_conv, output_gate=False)
    state.update({n: p[n] for n in ("f_proj.0.weight", "f_proj.1.weight", "g_proj.0.weight", "g_proj.1.weight",
                                    "g_proj.1.bias", "b_proj.weight", "A_log", "dt_bias")})
    return MixerConversion("kda", kwargs, state, delta_config(Dk, short_conv, HV))
