"""fla's `transformer` (fla/models/transformer): softmax attention with RoPE, GQA, optional q/k norm and window."""
from __future__ import annotations

from .core import LayerParams, MixerConversion, cfg_get, convert_attention, register_fla


@register_fla("transformer")
def convert_transformer(cfg: dict, layer_idx: int, p: LayerParams) -> MixerConversion:
    return convert_attention(cfg, layer_idx, p, num_heads=int(cfg_get(cfg, "num_heads", 32)),
                             num_kv_heads=cfg.get("num_kv_heads"), qkv_bias=bool(cfg_get(cfg, "qkv_bias", False)),
                             qk_norm=bool(cfg_get(cfg, "qk_norm", False)), window_size=cfg.get("window_size"),
                             rope_theta=cfg.get("rope_theta", 10000.0))
