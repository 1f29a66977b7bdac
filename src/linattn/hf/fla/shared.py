"""The pieces two or more fla converters share: the delta family's projections, convolutions, output norm and
gate (`base_state`), its common options (`common_kwargs`) and model config (`delta_config`), grouped value heads
(`grouped_heads`); head widths from expand_k / expand_v (`expand_heads`), grouped k/v heads (`kv_heads`) and the
GLA family's output norm (`output_norm_state`)."""
from __future__ import annotations

import math
from typing import Any, Dict

from .core import LayerParams, cfg_get, require


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


def delta_config(head_dim: int, short_conv: bool, n_value_heads: int = 0) -> Dict[str, Any]:
    """The model config fields the delta layers set (their q/k L2 norm is LMConfig's default, fla's rsqrt form)."""
    config = {"head_dim": head_dim, "short_conv": short_conv}
    return {**config, "n_value_heads": n_value_heads} if n_value_heads else config


def grouped_heads(cfg: dict, default_heads: int, default_head_dim: int, default_expand_v: float):
    """(H, HV, head_dim, head_dim_v) of the layers with head_dim / num_heads / num_v_heads / expand_v."""
    H, Dk = int(cfg_get(cfg, "num_heads", default_heads)), int(cfg_get(cfg, "head_dim", default_head_dim))
    HV = int(cfg_get(cfg, "num_v_heads", H))
    require(HV % H == 0, cfg, f"num_v_heads {HV} not a multiple of num_heads {H}")
    Dv = as_int(cfg, Dk * float(cfg_get(cfg, "expand_v", default_expand_v)), "head_dim * expand_v")
    return H, HV, Dk, Dv


def expand_heads(cfg: Dict[str, Any], heads: int, expand_k: float, expand_v: float):
    """(H, head_dim, head_dim_v) of the layers whose key / value widths are hidden_size * expand_k / expand_v over
    num_heads (GLA, RetNet, LinearAttention, DeltaNet; the arguments are the layer's defaults)."""
    d, H = int(cfg["hidden_size"]), int(cfg_get(cfg, "num_heads", heads))
    kd = as_int(cfg, d * float(cfg_get(cfg, "expand_k", expand_k)), "hidden_size * expand_k")
    vd = as_int(cfg, d * float(cfg_get(cfg, "expand_v", expand_v)), "hidden_size * expand_v")
    require(kd % H == 0 and vd % H == 0, cfg, f"key / value widths {kd} / {vd} not divisible by num_heads {H}")
    return H, kd // H, vd // H


def kv_heads(cfg: Dict[str, Any], H: int) -> Dict[str, int]:
    """The layer option of grouped k/v heads (num_kv_heads below num_heads: k_proj / v_proj are smaller), or none."""
    kv = cfg.get("num_kv_heads")
    return {"n_kv_heads": int(kv)} if kv is not None and int(kv) != H else {}


def output_norm_state(p: LayerParams) -> Dict[str, Any]:
    """The per-head output norm's weight: fla's fused norm-and-gate (g_norm_swish_gate) or its plain g_norm."""
    name = "g_norm_swish_gate.weight" if "g_norm_swish_gate.weight" in p else "g_norm.weight"
    return {"o_norm.weight": p[name]}
