"""fla's `delta_net` (fla/models/delta_net, fla/layers/delta_net.py) as linattn's `deltanet` mixer."""
from __future__ import annotations

from .core import LayerParams, MixerConversion, cfg_get, register_fla, require
from .shared import base_state, common_kwargs, delta_config, expand_heads

QK_ACTIVATIONS = ("silu", "relu", "elu", "identity")


@register_fla("delta_net")
def convert_delta_net(cfg: dict, layer_idx: int, p: LayerParams) -> MixerConversion:
    H, dk, dv = expand_heads(cfg, 16, 1.0, 1.0)
    short_conv = bool(cfg_get(cfg, "use_short_conv", True))
    use_gate, use_beta = bool(cfg_get(cfg, "use_gate", False)), bool(cfg_get(cfg, "use_beta", True))
    qk_act, qk_norm = cfg_get(cfg, "qk_activation", "silu"), cfg_get(cfg, "qk_norm", "l2")
    require(qk_act in QK_ACTIVATIONS, cfg, f"qk_activation {qk_act!r}")
    require(qk_norm in ("l2", "sum"), cfg, f"qk_norm {qk_norm!r}")
    kwargs = common_kwargs(cfg, short_conv)
    kwargs["output_gate"] = use_gate
    if dv != dk:
        kwargs["head_dim_v"] = dv
    if not use_beta:
        kwargs["use_beta"] = False
    if qk_act != "silu":
        kwargs["qk_activation"] = qk_act
    if qk_norm != "l2":
        kwargs["qk_norm"] = qk_norm
    state = base_state(p, short_conv, use_gate)
    if use_beta:
        state["b_proj.weight"] = p["b_proj.weight"]
    return MixerConversion("deltanet", kwargs, state, delta_config(dk, short_conv))
