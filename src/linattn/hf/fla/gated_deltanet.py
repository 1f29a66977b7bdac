"""fla's `gated_deltanet` (fla/models/gated_deltanet, fla/layers/gated_deltanet.py) as linattn's `gated-deltanet`:
grouped value heads (num_v_heads), expand_v (head_dim_v), the output gate (FusedRMSNormGated, swish or sigmoid) or
a plain RMSNorm, allow_neg_eigval, with or without the short convolutions."""
from __future__ import annotations

from .core import LayerParams, MixerConversion, cfg_get, register_fla, require
from .shared import base_state, common_kwargs, delta_config, grouped_heads


@register_fla("gated_deltanet")
def convert_gated_deltanet(cfg: dict, layer_idx: int, p: LayerParams) -> MixerConversion:
    H, HV, Dk, Dv = grouped_heads(cfg, 6, 256, 2.0)
    short_conv, use_gate = bool(cfg_get(cfg, "use_short_conv", True)), bool(cfg_get(cfg, "use_gate", True))
    act = cfg_get(cfg, "output_gate_activation", "swish")
    require(act in ("swish", "silu", "sigmoid"), cfg, f"output_gate_activation {act!r}")
    kwargs = common_kwargs(cfg, short_conv)
    kwargs.update(head_dim_v=Dv, output_gate=use_gate)
    if use_gate and act == "sigmoid":
        kwargs["gate_act"] = "sigmoid"
    state = base_state(p, short_conv, use_gate)
    state.update({n: p[n] for n in ("a_proj.weight", "b_proj.weight", "A_log", "dt_bias")})
    return MixerConversion("gated-deltanet", kwargs, state, delta_config(Dk, short_conv, HV))
