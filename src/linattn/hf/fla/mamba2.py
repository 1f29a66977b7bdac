"""`mamba2` folders: fla's Mamba2ForCausalLM (fla/models/mamba2) and transformers' Mamba2ForCausalLM, both
model_type "mamba2" with the same tensor names (backbone.embeddings, backbone.layers.{i}.norm / .mixer.*,
backbone.norm_f, lm_head; no MLP), as linattn's mixer `mamba2` (`layers/mamba2.Mamba2Block`) with `ffn="none"`.

The mixer's names map by `layers.mamba2.HF_NAMES` (conv1d -> conv, out_proj -> o_proj). The configs differ in a
few names, read both ways: fla's norm_eps / dt_limit, transformers' layer_norm_epsilon / time_step_limit; fla's
options D_has_hdim, rmsnorm and norm_before_gate are Mamba2Block's d_per_channel, gated_norm and
norm_before_gate. residual_in_fp32 (the residual stream kept in fp32 under bf16) is a precision choice that
linattn's block does not make: the weights are the same, a bf16 run can differ in rounding.
"""
from __future__ import annotations

import sys
from typing import Any, Dict

from ...layers.mamba2 import HF_NAMES
from .core import FlaLayout, LayerParams, MixerConversion, cfg_get, register_fla, require

LAYOUT = FlaLayout(embed="backbone.embeddings.weight", layer="backbone.layers.{i}.", mixer="mixer.",
                   attn_norm="norm.weight", mlp_norm=None, mlp=None, final_norm="backbone.norm_f.weight")


def _first(cfg: Dict[str, Any], names, default):
    for n in names:
        if cfg.get(n) is not None:
            return cfg[n]
    return default


def _float(v) -> float:
    """A config number; transformers writes an infinite one as {"__float__": "Infinity"}."""
    return float(v["__float__"]) if isinstance(v, dict) and "__float__" in v else float(v)


@register_fla("mamba2", layout=LAYOUT)
def convert_mamba2(cfg: dict, layer_idx: int, p: LayerParams) -> MixerConversion:
    d = int(cfg["hidden_size"])
    expand, head_dim = int(cfg_get(cfg, "expand", 2)), int(cfg_get(cfg, "head_dim", 64))
    require((expand * d) % head_dim == 0, cfg, f"expand * hidden_size {expand * d} not divisible by head_dim "
            f"{head_dim}")
    H = int(cfg.get("num_heads") or expand * d // head_dim)
    require(H * head_dim == expand * d, cfg, f"num_heads * head_dim {H * head_dim} != expand * hidden_size "
            f"{expand * d}")
    require(cfg_get(cfg, "hidden_act", "silu") in ("silu", "swish"), cfg, f"hidden_act {cfg.get('hidden_act')!r}")
    require(not cfg.get("attn"), cfg, "hybrid layouts")
    lim = _first(cfg, ("dt_limit", "time_step_limit"), (0.0, float("inf")))
    gated_norm = bool(_first(cfg, ("rmsnorm", "rms_norm"), True))
    eps = float(_first(cfg, ("norm_eps", "layer_norm_epsilon"), 1e-5))
    kwargs: Dict[str, Any] = {
        "state_size": int(cfg_get(cfg, "state_size", 128)), "n_groups": int(cfg_get(cfg, "n_groups", 1)),
        "conv_size": int(cfg_get(cfg, "conv_kernel", 4)), "conv_bias": bool(cfg_get(cfg, "use_conv_bias", True)),
        "proj_bias": bool(cfg_get(cfg, "use_bias", False)), "norm_eps": eps}
    lo, hi = _float(lim[0]), _float(lim[1])
    if (lo, hi) != (0.0, float("inf")):
        # JSON has no infinity: an unbounded top is the largest float, the same clamp for every finite dt
        kwargs["dt_limit"] = [lo, min(hi, sys.float_info.max)]
    # the options beyond Mamba2's defaults, only when set (so a plain Mamba2 gives plain kwargs)
    if cfg.get("D_has_hdim"):
        kwargs["d_per_channel"] = True
    if not gated_norm:
        kwargs["gated_norm"] = False
    if cfg.get("norm_before_gate"):
        kwargs["norm_before_gate"] = True
    state = {}
    for fla_name, ours in HF_NAMES.items():
        if fla_name == "norm.weight" and not gated_norm:
            continue
        if fla_name.endswith(".bias") and fla_name not in p:
            continue                      # no bias (use_bias / use_conv_bias False): the module has none either
        state[ours] = p[fla_name]
    return MixerConversion("mamba2", kwargs, state, {"n_heads": H, "head_dim": head_dim, "short_conv": True,
                                                     "norm_eps": eps})
