"""The model-family registry: one entry per kind of causal language model linattn can build,
train, checkpoint and sample from ("lm", "tlinformer", ...).

A family is a config dataclass (with `to_dict` / `from_dict` and a string field or class attribute
`arch` naming the family) and a model class built from it. Everything that handles models
generically (checkpoints, the trainer, generation, the CLI) goes through this registry and the
`CausalLM` protocol below, never through `isinstance` checks or string comparisons of its own.
Adding a family is `register_family("name", ConfigClass, ModelClass, tiny_config=...)` in the
family's module ("lm" in `models/lm.py`, "tlinformer" in `models/tlinformer.py`). The model class
follows `CausalLM` explicitly (it subclasses it) and is checked against it when registered;
`tiny_config(vocab_size)` gives a small config the test suite builds and checks automatically
for every registered family.

Config dicts carry their family in the key "arch"; a dict without it is an "lm" config (the first
version's checkpoints wrote none).
"""
from __future__ import annotations

import inspect
from typing import (
    Any,
    Callable,
    Dict,
    Iterator,
    List,
    NamedTuple,
    Optional,
    Protocol,
    Sequence,
    Type,
    Union,
    runtime_checkable,
)

import torch

from ..errors import ConfigError

DEFAULT_ARCH = "lm"


@runtime_checkable
class CausalLM(Protocol):
    """What a model family's model provides (`LanguageModel` and `TLinFormerLM` do).

    forward(input_ids [B, T], cache=None, *, use_cache=False, targets=None, cu_seqlens=None) -> LMOutput
        logits [B, T, vocab], aux_loss (scalar), cache (when decoding), loss (with targets);
        cu_seqlens (int64 [N+1], input_ids [1, T_total]) packs N documents that must not see each
        other; a family that cannot keep them apart raises LinattnError (and says so with a class
        attribute `supports_cu_seqlens = False`)
    new_cache() -> an empty cache for token-by-token decoding
    generate(input_ids, max_new_tokens, ...) -> LongTensor of prompt + new tokens
    stream(input_ids, max_new_tokens, ...) -> iterator of new token ids
    num_parameters(exclude_embeddings=False) -> int
    is_causal -> bool (False when a layer can see later tokens)
    config -> the family's config dataclass
    """

    config: Any

    def forward(self, input_ids: torch.Tensor, cache: Any = None, *, use_cache: bool = False,
                targets: Optional[torch.Tensor] = None, cu_seqlens: Optional[torch.Tensor] = None) -> Any: ...

    def new_cache(self) -> Any: ...

    def generate(self, input_ids: Union[torch.Tensor, Sequence[int]], max_new_tokens: int,
                 **kwargs) -> torch.Tensor: ...

    def stream(self, input_ids: Union[torch.Tensor, Sequence[int]], max_new_tokens: int,
               **kwargs) -> Iterator: ...

    def num_parameters(self, exclude_embeddings: bool = False) -> int: ...

    @property
    def is_causal(self) -> bool: ...


class ModelFamily(NamedTuple):
    name: str
    config_cls: Type
    model_cls: Type
    description: str
    #: tiny_config(vocab_size) -> a small config of this family (for tests and smoke checks)
    tiny_config: Optional[Callable[[int], Any]] = None


_FAMILIES: Dict[str, ModelFamily] = {}

_PROTOCOL_METHODS = ("forward", "new_cache", "generate", "stream", "num_parameters")


def protocol_problems(model_cls: Type) -> List[str]:
    """What keeps `model_cls` from following `CausalLM`: a missing member, or a method whose
    signature does not accept the protocol's parameters (same names, same kinds; extra ones
    need defaults). Empty when it conforms."""
    problems = []
    for name in _PROTOCOL_METHODS:
        impl = getattr(model_cls, name, None)
        if impl is None or impl is getattr(CausalLM, name):
            problems.append(f"{name}() is missing")
            continue
        want = inspect.signature(getattr(CausalLM, name))
        have = inspect.signature(impl)
        params = have.parameters
        var_kw = any(p.kind is p.VAR_KEYWORD for p in params.values())
        for p in want.parameters.values():
            if p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL):
                continue
            q = params.get(p.name)
            if q is None:
                if not (var_kw and p.kind is p.KEYWORD_ONLY):
                    problems.append(f"{name}() lacks the parameter {p.name!r}")
            elif q.kind is not p.kind and not (p.kind is p.KEYWORD_ONLY and q.kind is q.POSITIONAL_OR_KEYWORD):
                problems.append(f"{name}() takes {p.name!r} as {q.kind.description}, the protocol as "
                                f"{p.kind.description}")
            elif p.default is not p.empty and q.default is q.empty:
                problems.append(f"{name}() needs a default for {p.name!r}")
        for q in params.values():
            if q.name not in want.parameters and q.default is q.empty and q.kind not in (q.VAR_KEYWORD,
                                                                                      q.VAR_POSITIONAL):
                problems.append(f"{name}() has an extra parameter {q.name!r} without a default")
    causal = inspect.getattr_static(model_cls, "is_causal", None)
    if causal is None or causal is inspect.getattr_static(CausalLM, "is_causal"):
        problems.append("is_causal is missing")
    return problems


def register_family(name: str, config_cls: Type, model_cls: Type, description: str = "", *,
                    tiny_config: Optional[Callable[[int], Any]] = None, overwrite: bool = False) -> None:
    """Register a model family: `model_cls(config_cls(...))` must follow `CausalLM` (checked here).

    Training, checkpoints, evaluation and generation then work for it by name (the checkpoint records the
    family; `build_model` rebuilds it).

    Args:
        name: The family's name (recorded as "arch" in config dicts).
        config_cls: Its config class, with `to_dict` / `from_dict`.
        model_cls: Its model class (`model_cls(config)`), following `CausalLM`.
        description: One line for listings.
        tiny_config: `tiny_config(vocab_size)` returns a small config for the automatic tests.
        overwrite: Replace a family already registered under `name`.

    Raises:
        ConfigError: An empty or taken name, a config class without to_dict / from_dict, or a model class that
            does not follow `CausalLM`.
    """
    if not isinstance(name, str) or not name:
        raise ConfigError(f"a model family name must be a non-empty string, got {name!r}")
    if name in _FAMILIES and not overwrite:
        raise ConfigError(f"model family {name!r} is already registered (pass overwrite=True to replace it)")
    if not isinstance(config_cls, type) or not callable(getattr(config_cls, "from_dict", None)) \
            or not callable(getattr(config_cls, "to_dict", None)):
        raise ConfigError(f"model family {name!r}: the config class must have to_dict / from_dict, got {config_cls!r}")
    problems = protocol_problems(model_cls) if isinstance(model_cls, type) else [f"{model_cls!r} is not a class"]
    if problems:
        raise ConfigError(f"model family {name!r}: {getattr(model_cls, '__name__', model_cls)} does not follow "
                          f"CausalLM: " + "; ".join(problems))
    if tiny_config is not None and not callable(tiny_config):
        raise ConfigError(f"model family {name!r}: tiny_config must be callable(vocab_size), got {tiny_config!r}")
    _FAMILIES[name] = ModelFamily(name, config_cls, model_cls, description, tiny_config)


def families() -> List[str]:
    """Names of the registered model families.

    Returns:
        The names, in registration order.

    Examples:
        >>> from linattn.models import families
        >>> "lm" in families()
        True
    """
    return list(_FAMILIES)


def get_family(name: str) -> ModelFamily:
    """The registered family `name`.

    Args:
        name: A name of `families()`.

    Returns:
        Its `ModelFamily` (config class, model class, description).

    Raises:
        ConfigError: An unknown family.
    """
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
    """The model of a config object or dict.

    Args:
        config: A family config (`LMConfig`, ...) or its dict (`config_to_dict`; key "arch" names the family,
            none means "lm").

    Returns:
        The model, freshly initialised.

    Raises:
        ConfigError: An unknown family or a bad config.

    Examples:
        >>> from linattn import LMConfig
        >>> from linattn.models import build_model
        >>> type(build_model(LMConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2))).__name__
        'LanguageModel'
    """
    if isinstance(config, dict):
        config = config_from_dict(config)
    return family_of(config).model_cls(config)


__all__ = ["CausalLM", "ModelFamily", "register_family", "protocol_problems", "families", "get_family", "family_of",
           "config_from_dict", "config_to_dict", "build_model", "DEFAULT_ARCH"]
