"""fla's `gated_deltaproduct` (fla/models/gated_deltaproduct, fla/layers/gated_deltaproduct.py) as linattn's
`delta-product` mixer: num_householder steps per token, the optional forget gate (use_forget_gate), allow_neg_eigval,
the output gate. fla orders the n keys / values / betas of a token step-major ((n, h, d)), linattn head-major
((h, n, d)): the rows of k_proj, v_proj, their convolutions and b_proj are permuted accordingly."""
from __future__ import annotations

import torch

from .core import LayerParams, MixerConversion, cfg_get, register_fla, require
from .shared import base_state, common_kwargs, delta_config, grouped_heads


def step_major_to_head_major(w: torch.Tensor, n: int, H: int) -> torch.Tensor:
    """Rows ordered (n, H, d) -> (H, n, d); the trailing dimensions are kept."""
    rows = w.shape[0]
    return w.reshape(n, H, rows // (n * H), *w.shape[1:]).transpose(0, 1).reshape(w.shape).contiguous()


@register_fla("gated_deltaproduct")
def convert_gated_deltaproduct(cfg: dict, layer_idx: int, p: LayerParams) -> MixerConversion:
    H, HV, Dk, Dv = grouped_heads(cfg, 6, 256, 2.0)
    require(HV == H, cfg, f"grouped value heads (num_v_heads {HV} != num_heads {H}) for gated_deltaproduct")
    n = int(cfg_get(cfg, "num_householder", 1))
    require(n >= 1, cfg, f"num_householder {n}")
    short_conv, gate = bool(cfg_get(cfg, "use_short_conv", True)), bool(cfg_get(cfg, "use_output_gate", True))
    forget = bool(cfg_get(cfg, "use_forget_gate", False))
    kwargs = common_kwargs(cfg, short_conv)
    kwargs.update(head_dim_v=Dv, output_gate=gate, n_householder=n, gate=forget)
    state = base_state(p, short_conv, gate)
    for name in ("k_proj.weight", "v_proj.weight", "b_proj.weight") + (("k_conv.weight", "v_conv.weight")
                                                                        if short_conv else ()):
        state[name] = step_major_to_head_major(state[name] if name in state else p[name], n, H)
    if forget:
        state.update({name: p[name] for name in ("a_proj.weight", "A_log", "dt_bias")})
    return MixerConversion("delta-product", kwargs, state, delta_config(Dk, short_conv))
