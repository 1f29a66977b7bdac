"""The model-family registry: one entry per kind of causal language model linattn can build,
train, checkpoint and sample from ("lm", "tlinformer", ...).

A family is a config dataclass (with `to_dict` / `from_dict` and a string field or class attribute
`arch` naming the family) and a model class built from it. Everything that handles models
generically (checkpoints, the trainer, generation, the CLI) goes through this registry and the
`CausalLM` protocol below, never through `isinstance` checks or string comparisons of its own.
Adding a family is `register_family("name", ConfigClass, ModelClass)` in the family's module.

Config dicts carry their family in the key "arch"; a dict without it is an "lm" config (the first
version's checkpoints wrote none).
"""
from __future__ import annotations

from typing import Any, Dict, List, NamedTuple, Optional, Protocol, Sequence, Type, Union, runtime_checkable

import torch

from ..errors import ConfigError

DEFAULT_ARCH = "lm"


@runtime_checkable
class CausalLM(Protocol):
    """What a model family's model provides (`LanguageModel` and `TLinFormerLM` do).

    forward(input_ids [B, T], cache=None, *, use_cache=False, targets=None) -> LMOutput
        logits [B, T, vocab], aux_loss (scalar), cache (when decoding), loss (with targets)
    new_cache() -> an empty cache for token-by-token decoding
    generate(input_ids, max_new_tokens, ...) -> LongTensor of prompt + new tokens
    stream(input_ids, max_new_tokens, ...) -> iterator of new token ids
    num_parameters(exclude_embeddings=False) -> int
    is_causal -> bool (False when a layer can see later tokens)
    config -> the family's config dataclass
    """

    config: Any

    def forward(self, input_ids: torch.Tensor, cache: Any = None, *, use_cache: bool = False,
                targets: Optional[torch.Tensor] = None) -> Any: ...

    def new_cache(self) -> Any: ...

    def generate(self, input_ids: Union[torch.Tensor, Sequence[int]], max_new_tokens: int, **kwargs) -> torch.Tensor: ...

    def stream(self, input_ids: Union[torch.Tensor, Sequence[int]], max_new_tokens: int, **kwargs): ...

    def num_parameters(self, exclude_embeddings: bool = False) -> int: ...

    @property
    def is_causal(self) -> bool: ...


class ModelFamily(NamedTuple):
    name: str
    config_cls: Type
    model_cls: Type
    description: str


_FAMILIES: Dict[str, ModelFamily] = {}


def register_family(name: str, config_cls: Type, model_cls: Type, description: str = "", *,
                    overwrite: bool = False) -> None:
    """Register a model family: `model_cls(config_cls(...))` must follow `CausalLM`."""
    if not isinstance(name, str) or not name:
        raise ConfigError(f"a model family name must be a non-empty string, got {name!r}")
    if name in _FAMILIES and not overwrite:
        raise ConfigError(f"model family {name!r} is already registered (pass overwrite=True to replace it)")
    _FAMILIES[name] = ModelFamily(name, config_cls, model_cls, description)


def families() -> List[str]:
    """Names of the registered model families."""
    return list(_FAMILIES)


def get_family(name: str) -> ModelFamily:
    if name not in _FAMILIES:
        raise ConfigError(f"unknown model family {name!r}; known families are: {', '.join(_FAMILIES)}")
    return _FAMILIES[name]


def family_of(config: Any) -> ModelFamily:
    """The family of a config object or of a config dict (key "arch"; none means "lm")."""
    if isinstance(config, dict):
        return get_family(config.get("arch", DEFAULT_ARCH))
    for fam in _FAMILIES.values():
        if type(config) is fam.config_cls:
            return fam
    raise ConfigError(f"{type(config).__name__} is not the config of a registered model family "
                      f"({', '.join(_FAMILIES)})")


def config_from_dict(d: Dict[str, Any]) -> Any:
    """A family config from its dict (as written by `config_to_dict`)."""
    if not isinstance(d, dict):
        raise ConfigError(f"a model config must be a dict, got {type(d).__name__}")
    fam = family_of(d)
    d = dict(d)
    if "arch" in d and "arch" not in getattr(fam.config_cls, "__dataclass_fields__", {}):
        d.pop("arch")
    return fam.config_cls.from_dict(d)


def config_to_dict(config: Any) -> Dict[str, Any]:
    """The config as a JSON-ready dict that names its family under "arch"."""
    fam = family_of(config)
    d = config.to_dict()
    d.setdefault("arch", fam.name)
    return d


def build_model(config: Any) -> torch.nn.Module:
    """The model of a config object or dict."""
    if isinstance(config, dict):
        config = config_from_dict(config)
    return family_of(config).model_cls(config)


__all__ = ["CausalLM", "ModelFamily", "register_family", "families", "get_family", "family_of",
           "config_from_dict", "config_to_dict", "build_model", "DEFAULT_ARCH"]
