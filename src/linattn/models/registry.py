"""The mixer registry: a name for every token mixer a `LanguageModel` block can use.

Naming scheme:

* `softmax`, `swa`                     softmax attention (RoPE, KV cache); `swa` = sliding window
                                       (`LMConfig.window`, default 256)
* `linear-<feature map>`               normalised kernelized linear attention with one feature map
                                       of `linattn.feature_map_names()` (`linear-elu+1`,
                                       `linear-hadamard_exp`, `linear-sum_sq_euclid`, ...); per-head
                                       output norm, no RoPE, no q scaling (FAVOR+: head_dim**-0.5).
                                       `linear-identity` is the unnormalised sum (a normaliser
                                       q . sum k has no sign).
* `ela-hadamard_exp`, `ela-sum_sq_euclid`  the ELA paper's attention: RoPE on q/k, no 1/sqrt(d)
                                       scaling, no output norm, no short conv.
* `retnet`, `mamba2-gla`, `gla`        gated (unnormalised) linear attention: fixed per-head decay,
                                       Mamba2-style scalar data-dependent decay, GLA diagonal decay
* `mamba2`                             Mamba2's own block (`layers/mamba2.py`: in_proj to z, x, B, C, dt; conv;
                                       SSD as grouped scalar-gated linear attention; D skip; grouped gated norm).
                                       A config saved before it existed names `mamba2-gla` `mamba2`; loading
                                       maps it (`LMConfig.mixer_names`)
* `deltanet`, `gated-deltanet`         the delta rule (FLA layer pattern, short conv)
* `efla`, `efla-adaptive`, `efla-loose`    error-free linear attention and its two beta variants
* `fox`, `deltaformer`, `path`         softmax attention fed back by linear attention: FoX's forget gate,
                                       DeltaFormer's delta-rule values, PaTH's Householder positions
                                       (`layers/softmax_family.py`; KV caches that grow like softmax's)
* `comba`, `delta-product`, `kda`      Comba, DeltaProduct (2 Householder steps per token), Kimi Delta
                                       Attention (`layers/delta_family.py`)
* `mesanet`, `ttt-linear`, `ttt-mlp`, `titans`   test-time regression / training: MesaNet (`layers/mesa.py`),
                                       TTT-Linear, TTT-MLP and Titans (`layers/ttt.py`); constant-size states

`build_mixer(name, d_model, n_heads, **kwargs)` builds one; `register_mixer` adds new ones.

Config fields: every mixer declares which fields of the model config it takes, as keyword
arguments of the same name (`config_fields`, by default the layer class's `config_fields`
attribute, see `AttentionBase`). `mixer_config_kwargs(name, config, layer_idx)` collects exactly
those (fields set to None are left out, so the registry default or the layer's own applies),
then the config's `mixer_kwargs[name]`. Adding a mixer therefore needs no change to the model.

Scales: `scale=None` is each layer's default, head_dim**-0.5; entries that use no q scaling
say `scale=1.0`.
"""
from __future__ import annotations

from typing import Any, Dict

from ..layers import EFLA, DeltaNet, GatedDeltaNet, LinearAttention, SoftmaxAttention
from ..layers.delta_family import KDA, Comba, DeltaProduct
from ..layers.mamba2 import Mamba2Block
from ..layers.mesa import MesaNet
from ..layers.registry import (
    LAYER_IDX,
    MixerSpec,
    build_mixer,
    mixer_config_kwargs,
    mixer_spec,
    mixers,
    register_mixer,
    unregister_mixer,
)
from ..layers.rwkv7 import RWKV7
from ..layers.softmax_family import DeltaFormer, FoX, PaTH
from ..layers.ttt import TTT, Titans
from ..ops.feature_maps import feature_map_names, on_feature_map_registered


def _register_linear_mixer(fm: str) -> None:
    """`linear-<fm>`: normalised linear attention with feature map `fm` (a registered name)."""
    defaults: Dict[str, Any] = {"feature_map": fm, "normalize": fm != "identity"}
    if fm != "favor+":
        defaults["scale"] = 1.0   # no q scaling; FAVOR+ keeps the default head_dim**-0.5
    register_mixer(f"linear-{fm}", LinearAttention, defaults,
                   f"normalised linear attention with the {fm} feature map" if fm != "identity"
                   else "unnormalised linear attention (phi = identity)")


def _register_builtins() -> None:
    register_mixer("softmax", SoftmaxAttention, {}, "causal softmax attention with RoPE and a KV cache", rope=True)
    register_mixer("swa", SoftmaxAttention, {"window": 256},
                   "sliding-window softmax attention (LMConfig.window sets the window)", rope=True)
    for fm in feature_map_names():
        _register_linear_mixer(fm)
    on_feature_map_registered(_register_linear_mixer)   # a map registered later gets its linear-<name> too
    for fm in ("hadamard_exp", "sum_sq_euclid"):
        register_mixer(f"ela-{fm}", LinearAttention, {"feature_map": fm, "output_norm": False, "scale": 1.0},
                       f"the ELA paper's layer: {fm} kernel, RoPE, no scaling, no output norm", rope=True)
    gated = {"feature_map": "identity", "normalize": False}   # scale: the default head_dim**-0.5
    register_mixer("retnet", LinearAttention, dict(gated, gate="retnet"),
                   "RetNet: fixed per-head decay 1 - 2^(-5-h)")
    register_mixer("mamba2-gla", LinearAttention, dict(gated, gate="scalar", output_gate=True),
                   "gated linear attention with a Mamba2-style scalar data-dependent decay per head (the mixer "
                   "named mamba2 before issue 37)", short_conv=True)
    register_mixer("mamba2", Mamba2Block, {}, "Mamba2's block: in_proj, conv, SSD (grouped scalar-gated linear "
                   "attention), D skip, grouped gated RMSNorm, out_proj", short_conv=True)
    register_mixer("gla", LinearAttention, dict(gated, gate="diagonal", output_gate=True),
                   "GLA: data-dependent decay per feature, logsigmoid(.)/16")
    register_mixer("deltanet", DeltaNet, {}, "DeltaNet: delta rule, sigmoid beta, L2-normalised q/k", short_conv=True)
    register_mixer("gated-deltanet", GatedDeltaNet, {}, "Gated DeltaNet: delta rule with a scalar decay",
                   short_conv=True)
    register_mixer("efla", EFLA, {"beta_mode": "sigmoid"}, "EFLA: exactly integrated delta rule", short_conv=True)
    register_mixer("efla-adaptive", EFLA, {"beta_mode": "adaptive"}, "EFLA + adaptive decay softplus(alpha)*beta",
                   short_conv=True)
    register_mixer("efla-loose", EFLA, {"beta_mode": "loose"}, "EFLA + loose beta (softplus)", short_conv=True)
    register_mixer("fox", FoX, {}, "FoX: softmax attention with a sigmoid forget gate per head (no RoPE)")
    register_mixer("deltaformer", DeltaFormer, {}, "DeltaFormer: softmax attention over delta-rule pseudo-values",
                   rope=True)
    register_mixer("path", PaTH, {}, "PaTH: softmax attention with accumulated Householder position encoding")
    register_mixer("comba", Comba, {}, "Comba: gated delta rule with state feedback p = sigmoid(c) k and "
                   "output correction q - d p", short_conv=True)
    register_mixer("delta-product", DeltaProduct, {"n_householder": 2},
                   "DeltaProduct: 2 Householder (delta-rule) steps per token", short_conv=True)
    register_mixer("kda", KDA, {}, "Kimi Delta Attention: gated delta rule with a per-channel decay",
                   short_conv=True)
    register_mixer("mesanet", MesaNet, {}, "MesaNet: ridge regression H^-1 G per token, chunkwise conjugate "
                   "gradients", short_conv=True)
    register_mixer("ttt-linear", TTT, {"inner": "linear"}, "TTT-Linear: a linear inner model + LayerNorm trained "
                   "by mini-batch gradient descent", short_conv=True)
    register_mixer("ttt-mlp", TTT, {"inner": "mlp"}, "TTT-MLP: a 2-layer MLP inner model + LayerNorm trained by "
                   "mini-batch gradient descent", short_conv=True)
    register_mixer("titans", Titans, {}, "Titans: TTT-MLP memory with momentum and weight decay, L2-normalised q/k",
                   short_conv=True)
    register_mixer("rwkv7", RWKV7, {}, "RWKV-7 time mixing: token shift, low-rank w/a/g, S <- D S + b (a^T S) + k v^T, "
                   "value residual, group norm, bonus")


_register_builtins()

__all__ = ["MixerSpec", "LAYER_IDX", "register_mixer", "unregister_mixer", "mixers", "mixer_spec",
           "mixer_config_kwargs", "build_mixer"]
