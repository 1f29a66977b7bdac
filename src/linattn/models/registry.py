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

from .. import layers  # noqa: F401  (importing the layers registers the built-in mixers)
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

__all__ = ["MixerSpec", "LAYER_IDX", "register_mixer", "unregister_mixer", "mixers", "mixer_spec",
           "mixer_config_kwargs", "build_mixer"]
