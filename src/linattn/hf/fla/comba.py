"""fla's `comba` (fla/models/comba, fla/layers/comba.py) as linattn's `comba` mixer: fla's order (p = sigmoid(c) k
and q - D p from the raw q, k, then q, k, p L2-normalised in the kernel: `correction_before_norm`), the
sigmoid-gated output norm, grouped value heads, the inner decay and output correction when the weights have them."""
from __future__ import annotations

from .core import LayerParams, MixerConversion, cfg_get, register_fla
from .shared import base_state, common_kwargs, delta_config, grouped_heads


@register_fla("comba")
def convert_comba(cfg: dict, layer_idx: int, p: LayerParams) -> MixerConversion:
    H, HV, Dk, Dv = grouped_heads(cfg, 6, 256, 2.0)
    short_conv = bool(cfg_get(cfg, "use_short_conv", True))
    gate = bool(cfg_get(cfg, "use_output_gate", True))
    # fla's CombaBlock does not pass use_inner_decay / use_output_correction to its layer (the layer's defaults,
    # True, apply whatever config.json says): the weights tell
    inner, correction = "decay" in p, "D" in p
    kwargs = common_kwargs(cfg, short_conv)
    kwargs.update(head_dim_v=Dv, output_gate=gate, correction_before_norm=True, inner_decay=inner,
                  output_correction=correction)
    if gate:
        kwargs["gate_act"] = "sigmoid"
    state = base_state(p, short_conv, gate)
    state.update({n: p[n] for n in ("a_proj.weight", "b_proj.weight", "A_log", "dt_bias")})
    if inner:
        state["p_gain"] = p["decay"]
    if correction:
        state["d"] = p["D"]
    return MixerConversion("comba", kwargs, state, delta_config(Dk, short_conv, HV))
