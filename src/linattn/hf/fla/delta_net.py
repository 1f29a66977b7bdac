"""fla's `delta_net` (fla/models/delta_net, fla/layers/delta_net.py) as linattn's `deltanet` mixer; also the pieces
the delta-family types share (q/k/v projections and short convolutions, the output norm and gate)."""
from __future__ import annotations

import math
from typing import Any, Dict

from .core import LayerParams, MixerConversion, cfg_get, register_fla, require

QK_ACTIVATIONS = ("silu", "relu", "elu", "identity")


def as_int(cfg: Dict[str, Any], value: float, what: str) -> int:
    """A width fla computes as a float product (hidden_size * expand_k, head_dim * expand_v), as an int."""
    n = int(round(value))
    require(math.isclose(value, n, rel_tol=1e-9), cfg, f"{what} = {value} (not an integer)")
    return n


def base_state(p: LayerParams, short_conv: bool, output_gate: bool) -> Dict[str, Any]:
    """The tensors every fla delta layer names alike: q/k/v/o projections, the q/k/v short convolutions
    (`q_conv1d` -> `q_conv`), the output norm and the output gate projection."""
    state = {f"{n}_proj.weight": p[f"{n}_proj.weight"] for n in "qkvo"}
    if short_conv:
        for n in "qkv":
            state[f"{n}_conv.weight"] = p[f"{n}_conv1d.weight"]
    state["o_norm.weight"] = p["o_norm.weight"]
    if output_gate:
        state["g_proj.weight"] = p["g_proj.weight"]
    return state


def common_kwargs(cfg: Dict[str, Any], short_conv: bool) -> Dict[str, Any]:
    """The layer options all fla delta layers share: b_proj without bias, the conv width, and SiLU on q/k/v even
    without a short convolution."""
    kwargs: Dict[str, Any] = {"beta_bias": False, "conv_size": int(cfg_get(cfg, "conv_size", 4))}
    if not short_conv:
        kwargs["activation_without_conv"] = True
    if cfg_get(cfg, "allow_neg_eigval", False):
        kwargs["allow_negative_eigenvalues"] = True
    return kwargs


@register_fla("delta_net")
def convert_delta_net(cfg: dict, layer_idx: int, p: LayerParams) -> MixerConversion:
    d, H = int(cfg["hidden_size"]), int(cfg_get(cfg, "num_heads", 16))
    key_dim = as_int(cfg, d * float(cfg_get(cfg, "expand_k", 1.0)), "hidden_size * expand_k")
    value_dim = as_int(cfg, d * float(cfg_get(cfg, "expand_v", 1.0)), "hidden_size * expand_v")
    require(key_dim % H == 0 and value_dim % H == 0, cfg, f"key/value widths {key_dim}/{value_dim} not divisible by "
            f"num_heads {H}")
    short_conv = bool(cfg_get(cfg, "use_short_conv", True))
    use_gate, use_beta = bool(cfg_get(cfg, "use_gate", False)), bool(cfg_get(cfg, "use_beta", True))
    qk_act, qk_norm = cfg_get(cfg, "qk_activation", "silu"), cfg_get(cfg, "qk_norm", "l2")
    require(qk_act in QK_ACTIVATIONS, cfg, f"qk_activation {qk_act!r}")
    require(qk_norm in ("l2", "sum"), cfg, f"qk_norm {qk_norm!r}")
    kwargs = common_kwargs(cfg, short_conv)
    kwargs["output_gate"] = use_gate
    if value_dim // H != key_dim // H:
        kwargs["head_dim_v"] = value_dim // H
    if not use_beta:
        kwargs["use_beta"] = False
    if qk_act != "silu":
        kwargs["qk_activation"] = qk_act
    if qk_norm != "l2":
        kwargs["qk_norm"] = qk_norm
    state = base_state(p, short_conv, use_gate)
    if use_beta:
        state["b_proj.weight"] = p["b_proj.weight"]
    return MixerConversion("deltanet", kwargs, state,
                           {"head_dim": key_dim // H, "short_conv": short_conv, "l2norm_convention": "rsqrt"})
