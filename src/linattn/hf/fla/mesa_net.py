"""fla's `mesa_net` (fla/models/mesa_net): MesaNet (linattn's mixer `mesanet`), hybrid layouts included.

fla's MesaNet layer: q/k/v projections, a short convolution (SiLU) on q and k only (not v), q and k L2-normalised
in the kernel (x * rsqrt(sum x^2 + 1e-6)), beta = sigmoid(b_proj(x)), g = logsigmoid(a_proj(x)), the ridge
softplus(lambda_params) + lambda_lower_bound (fla's `[H * K]`, linattn's `[H, K]`), o_t = G_t^T (H_t + Diag(lam))^-1
q_t with q unscaled, solved by conjugate gradients (max_cg_step_training iterations), a per-head output RMSNorm
(gated by silu(g_proj(x)) with use_output_gate), o_proj. linattn's MesaNet takes them as options (v_conv=False,
scale=1.0, max_iter). fla's separate decoding cap (max_cg_step_decoding) has no counterpart: linattn's one
max_iter (with its fp64 tolerance 1e-12 / fp32 1e-6) serves both, so a model whose two caps differ decodes with
the training cap. use_short_conv is ignored as fla 0.6.0's layer ignores it (it convolves q and k always).
"""
from __future__ import annotations

from typing import Any, Dict

from .core import LayerParams, MixerConversion, cfg_get, register_fla, require


@register_fla("mesa_net")
def convert_mesa_net(cfg: dict, layer_idx: int, p: LayerParams) -> MixerConversion:
    H, K = int(cfg_get(cfg, "num_heads", 16)), int(cfg_get(cfg, "head_dim", 128))
    require(cfg_get(cfg, "attn_mode", "chunk") == "chunk", cfg, f"attn_mode {cfg.get('attn_mode')!r}")
    # fla 0.6.0's layer builds and applies the q/k convolutions whatever use_short_conv says (module docstring)
    gate = bool(cfg_get(cfg, "use_output_gate", False))
    state = {f"{n}_proj.weight": p[f"{n}_proj.weight"] for n in "qkvoab"}
    state["a_proj.bias"], state["b_proj.bias"] = p["a_proj.bias"], p["b_proj.bias"]
    state["lambda_params"] = p["lambda_params"].reshape(H, K)
    state["o_norm.weight"] = p["o_norm.weight"]
    kwargs: Dict[str, Any] = {"scale": 1.0, "solver": "cg", "max_iter": int(cfg_get(cfg, "max_cg_step_training", 30)),
                              "lambda_lower_bound": float(cfg_get(cfg, "lambda_lower_bound", 0.25)),
                              "rope": False, "output_norm": True}
    kwargs.update(v_conv=False, conv_size=int(p["q_conv1d.weight"].shape[-1]))
    state["q_conv.weight"], state["k_conv.weight"] = p["q_conv1d.weight"], p["k_conv1d.weight"]
    require("q_conv1d.bias" not in p, cfg, "short convolutions with biases")
    if gate:
        kwargs["output_gate"] = True
        state["g_proj.weight"] = p["g_proj.weight"]
    return MixerConversion("mesanet", kwargs, state, {"n_heads": H, "head_dim": K, "short_conv": True})
