"""fla's `rwkv7` (fla/models/rwkv7): RWKV-7 time mixing (linattn's mixer `rwkv7`) in RWKV-7's own block.

The block is not fla's usual one: LayerNorms with biases (attn_norm, ffn_norm, the final norm), a LayerNorm on the
embeddings in the first block (`pre_norm`, RWKV's ln0) and RWKV-7's channel mix as the feed-forward block (token
shift, key, squared ReLU, value). linattn has them as `LMConfig(norm="layernorm", embed_norm=True, ffn="rwkv7")`;
their tensors come through the layout's `extra`.

Names: fla's LoRA is `lora.0` (down), activation, `lora.2` (up, with the bias w0 / a0 / v0), linattn's `_LoRA`
`down`, `up` and `bias`; fla's token-shift mixes are `[1, 1, C]`, linattn's `[C]`. The conversion maps both, so
linattn's parameter names (and existing RWKV-7 checkpoints) stay as they are. fla's fused kernels normalise kk with
x * rsqrt(sum x^2 + 1e-6) (fuse_norm=True, fla's default), its unfused path with F.normalize: the mixer option
`kk_norm`.
"""
from __future__ import annotations

from typing import Any, Callable, Dict

import torch

from .core import FlaLayout, LayerParams, MixerConversion, cfg_get, register_fla, require

Tensor = torch.Tensor
_MIX = ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g")


def _lora(p: LayerParams, name: str, bias: bool) -> Dict[str, Tensor]:
    out = {f"{name}.down.weight": p[f"{name}.lora.0.weight"], f"{name}.up.weight": p[f"{name}.lora.2.weight"]}
    if bias:
        out[f"{name}.bias"] = p[f"{name}.lora.2.bias"]
    return out


def _block_extras(cfg: Dict[str, Any], take: Callable[[str], Tensor]) -> Dict[str, Tensor]:
    """RWKV-7's block tensors besides the mixer and attn_norm.weight (module docstring)."""
    bias = bool(cfg_get(cfg, "norm_bias", True))

    def norm(fla: str, ours: str) -> Dict[str, Tensor]:
        w = take(fla + ".weight")
        # a LayerNorm without bias (norm_bias=False) is linattn's with a zero bias: the same function
        return {ours + ".weight": w, ours + ".bias": take(fla + ".bias") if bias else torch.zeros_like(w)}

    out: Dict[str, Tensor] = {}
    for i in range(int(cfg["num_hidden_layers"])):
        lp, bp = f"model.layers.{i}.", f"blocks.{i}."
        w = take(lp + "attn_norm.weight")          # core maps it to norm1.weight; the bias is ours to map
        out[bp + "norm1.bias"] = take(lp + "attn_norm.bias") if bias else torch.zeros_like(w)
        out.update(norm(lp + "ffn_norm", bp + "norm2"))
        out[bp + "ffn.x_k"] = take(lp + "ffn.x_k").reshape(-1)
        out[bp + "ffn.key.weight"] = take(lp + "ffn.key.weight")
        out[bp + "ffn.value.weight"] = take(lp + "ffn.value.weight")
        if i == 0 and cfg_get(cfg, "norm_first", True):
            out.update(norm(lp + "pre_norm", bp + "pre_norm"))
    out["norm.bias"] = take("model.norm.bias") if bias else torch.zeros_like(take("model.norm.weight"))
    return out


@register_fla("rwkv7", layout=FlaLayout(mlp=None, mlp_norm=None, extra=_block_extras))
def convert_rwkv7(cfg: dict, layer_idx: int, p: LayerParams) -> MixerConversion:
    d = int(cfg["hidden_size"])
    head_dim = int(cfg_get(cfg, "head_dim", 64))
    require(d % head_dim == 0, cfg, f"hidden_size {d} not divisible by head_dim {head_dim}")
    value_dim = cfg.get("value_dim")
    vd = value_dim[layer_idx] if isinstance(value_dim, list) else value_dim
    # fla 0.6.0 cannot build a model with wider values itself (its init fails), so that mapping (to the layer's
    # head_dim_v) could not be checked against fla: refused
    require(vd in (None, d), cfg, f"value_dim {vd} != hidden_size {d}")
    require(cfg_get(cfg, "hidden_act", "sqrelu") == "sqrelu", cfg, f"hidden_act {cfg.get('hidden_act')!r} "
            f"(RWKV-7's channel mix uses sqrelu)")
    require(not cfg.get("attn"), cfg, "hybrid layouts (softmax layers between RWKV-7 layers, which have no value "
            "residual to pass on)")
    H = d // head_dim
    state: Dict[str, Tensor] = {n: p[n].reshape(-1) for n in _MIX}        # fla [1, 1, C] -> linattn [C]
    for n in ("k_k", "k_a", "r_k", "g_norm.weight", "g_norm.bias"):
        state[n] = p[n]
    for n in "rkvo":
        state[f"{n}_proj.weight"] = p[f"{n}_proj.weight"]
    state.update(_lora(p, "w_lora", True))
    state.update(_lora(p, "a_lora", True))
    state.update(_lora(p, "g_lora", False))
    if layer_idx > 0:
        state.update(_lora(p, "v_lora", True))
    ranks = {"decay_rank": p["w_lora.lora.0.weight"].shape[0], "a_rank": p["a_lora.lora.0.weight"].shape[0],
             "gate_rank": p["g_lora.lora.0.weight"].shape[0]}
    # fla's layer 0 has no v_lora: every layer must give the same kwargs, so the rank comes from the config
    ranks["value_rank"] = int(cfg_get(cfg, "v_low_rank_dim", 16))
    if layer_idx > 0:
        require(p["v_lora.lora.0.weight"].shape[0] == ranks["value_rank"], cfg,
                f"v_lora rank {p['v_lora.lora.0.weight'].shape[0]} != v_low_rank_dim {ranks['value_rank']}")
    kwargs: Dict[str, Any] = {**{k: int(v) for k, v in ranks.items()},
                              "norm_eps": float(cfg_get(cfg, "norm_eps", 1e-5)),
                              "kk_norm": "rsqrt" if cfg_get(cfg, "fuse_norm", True) else "normalize"}
    config = {"n_heads": H, "head_dim": head_dim, "norm": "layernorm",
              "embed_norm": bool(cfg_get(cfg, "norm_first", True)), "ffn": "rwkv7",
              "ffn_hidden": int(_ffn_hidden(cfg)), "norm_eps": float(cfg_get(cfg, "norm_eps", 1e-5))}
    return MixerConversion("rwkv7", kwargs, state, config)


def _ffn_hidden(cfg: Dict[str, Any]) -> int:
    """RWKV-7's channel-mix width: intermediate_size, else hidden_ratio (default 4) * hidden_size rounded up to 32."""
    if cfg.get("intermediate_size") is not None:
        return int(cfg["intermediate_size"])
    h = int(int(cfg["hidden_size"]) * cfg_get(cfg, "hidden_ratio", 4))
    return 32 * ((h + 31) // 32)
