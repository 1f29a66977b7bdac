"""`LinattnConfig`: a transformers config (`model_type="linattn"`) that wraps a whole `LMConfig`.

The `LMConfig` lives under the key `linattn` (its `to_dict()`), so nothing of it is lost or renamed;
the usual transformers names (`vocab_size`, `hidden_size`, `num_hidden_layers`, ...) are derived
from it for tools that read them. `layer_types` tells transformers' `DynamicCache(config=...)`
which of its cache layers each block needs:

* `"linear_attention"` (`LinearAttentionLayer`): the mixer's recurrent state and short-convolution
  states (and a causal memory lobe's state);
* `"hybrid"` (`LinearAttentionAndFullAttentionLayer`): a softmax mixer's growing key/value cache
  next to those states;
* `"hybrid_sliding"` (`LinearAttentionAndSlidingWindowAttentionLayer`): the same for a sliding
  window (keeps the last `window - 1` keys).

Block 0 is always a hybrid layer: transformers reads the sequence length (`get_seq_length`) from an
attention layer only, so when block 0 has no softmax mixer its key/value part holds zero-width
keys, one per position (no memory), which count the positions for `generate`.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

from transformers import PreTrainedConfig

from ..layers import SoftmaxAttention
from ..models.config import LMConfig
from ..models.registry import mixer_config_kwargs, mixer_spec

#: state slots per transformers cache layer (short-conv states and recurrent-state tensors)
STATE_SLOTS = 32


_NO_KV = object()


def _windows(lm: LMConfig) -> list:
    """Per block: its softmax mixer's window (None: every key), or `_NO_KV` for a mixer that keeps no keys/values."""
    out = []
    for i, name in enumerate(lm.mixer_list()):
        spec = mixer_spec(name)
        kv = isinstance(spec.cls, type) and issubclass(spec.cls, SoftmaxAttention)
        out.append(mixer_config_kwargs(name, lm, i).get("window", spec.defaults.get("window")) if kv else _NO_KV)
    return out


def layer_types_of(lm: LMConfig) -> List[str]:
    """The transformers cache-layer type of every block of `lm` (module docstring)."""
    return ["linear_attention" if w is _NO_KV else "hybrid" if w is None else "hybrid_sliding" for w in _windows(lm)]


def sliding_window_of(lm: LMConfig) -> Optional[int]:
    """The window of the sliding softmax layers (transformers keeps one `sliding_window` per config; different
    windows per layer: None, every key kept, the layers mask them)."""
    windows = {int(w) for w in _windows(lm) if w is not _NO_KV and w is not None}
    return windows.pop() if len(windows) == 1 else None


class LinattnConfig(PreTrainedConfig):
    """A transformers config holding a linattn `LMConfig` (`lm_config()` rebuilds it).

    The transformers fields (vocab_size, hidden_size, num_hidden_layers, num_attention_heads, head_dim,
    max_position_embeddings, layer_types, sliding_window, tie_word_embeddings, ...) are derived from the LMConfig.

    Args:
        linattn: The `LMConfig` as a dict (`LMConfig.to_dict()`; an `LMConfig` is accepted too); None: a default
            LMConfig(vocab_size=256).
        **kwargs: transformers' `PretrainedConfig` options (pad_token_id, eos_token_id, num_labels, ...); those
            derived from the LMConfig are ignored.

    Examples:
        >>> from linattn import LMConfig
        >>> from linattn.hf import LinattnConfig
        >>> cfg = LinattnConfig(linattn=LMConfig(vocab_size=256, mixer="efla").to_dict())
        >>> cfg = LinattnConfig.from_lm_config(LMConfig(vocab_size=256, mixer="efla"))
        >>> cfg.lm_config().mixer, cfg.vocab_size
        ('efla', 256)
    """

    model_type = "linattn"

    def __init__(self, linattn: Optional[Dict[str, Any]] = None, **kwargs):
        if isinstance(linattn, LMConfig):
            linattn = linattn.to_dict()
        lm = LMConfig.from_dict(dict(linattn)) if linattn is not None else LMConfig(vocab_size=256)
        self.linattn = lm.to_dict()
        for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim",
                    "max_position_embeddings", "layer_types", "sliding_window", "number_of_conv_states",
                    "tie_word_embeddings"):
            kwargs.pop(key, None)  # derived from the LMConfig, below
        self.vocab_size = lm.vocab_size
        self.hidden_size = lm.d_model
        self.num_hidden_layers = lm.n_layers
        self.num_attention_heads = lm.n_heads
        self.head_dim = lm.head_dim if lm.head_dim is not None else lm.d_model // lm.n_heads
        self.max_position_embeddings = lm.max_seq_len
        self.layer_types = layer_types_of(lm)
        if self.layer_types[0] == "linear_attention":
            self.layer_types[0] = "hybrid"   # counts the positions (module docstring)
        self.sliding_window = sliding_window_of(lm)
        if "hybrid_sliding" in self.layer_types and self.sliding_window is None:
            self.layer_types = ["hybrid" if t == "hybrid_sliding" else t for t in self.layer_types]
        self.number_of_conv_states = STATE_SLOTS
        self.use_cache = bool(kwargs.pop("use_cache", True))
        # a tied head is the embedding itself inside LanguageModel: transformers has nothing to tie
        super().__init__(tie_word_embeddings=False, **kwargs)

    @classmethod
    def from_lm_config(cls, lm: LMConfig, **kwargs) -> "LinattnConfig":
        """A config wrapping `lm`.

        Args:
            lm: The linattn model config.
            **kwargs: transformers config options.

        Returns:
            The `LinattnConfig`.
        """
        return cls(linattn=lm.to_dict(), **kwargs)

    def lm_config(self) -> LMConfig:
        """The wrapped linattn `LMConfig`.

        Returns:
            A new `LMConfig` equal to the wrapped one.
        """
        return LMConfig.from_dict(dict(self.linattn))


__all__ = ["LinattnConfig", "layer_types_of", "STATE_SLOTS"]
