"""Language models built from the layers: `LMConfig`, `LanguageModel`, the mixer registry, MoE
and the ELA memory lobe; `models/tlinformer.py` is a second model family. Both follow the
`CausalLM` protocol and are registered in the model-family registry (`models/family.py`)."""
from .config import PRESETS, LMConfig
from .family import (
    CausalLM,
    build_model,
    config_from_dict,
    config_to_dict,
    families,
    family_of,
    get_family,
    register_family,
)
from .generation import sample_next
from .lm import Block, LanguageModel, LMOutput
from .lobe import MemoryLobe
from .moe import MoE, Routing
from .registry import build_mixer, mixer_config_kwargs, mixer_spec, mixers, register_mixer, unregister_mixer
from .tlinformer import TLinFormerCache, TLinFormerConfig, TLinFormerLM

# the model families register themselves in their modules: "lm" (lm.py), "tlinformer" (tlinformer.py)

__all__ = [
    "LMConfig", "PRESETS", "LanguageModel", "LMOutput", "Block", "MoE", "Routing", "MemoryLobe",
    "mixers", "build_mixer", "register_mixer", "unregister_mixer", "mixer_spec", "mixer_config_kwargs",
    "sample_next",
    "TLinFormerConfig", "TLinFormerLM", "TLinFormerCache",
    "CausalLM", "register_family", "families", "get_family", "family_of", "build_model", "config_from_dict",
    "config_to_dict",
]
