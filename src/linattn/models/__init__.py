"""Language models built from the layers: `LMConfig`, `LanguageModel`, the mixer registry, MoE
and the ELA memory lobe. (`models/tlinformer.py` is a separate model.)"""
from .config import PRESETS, LMConfig
from .generation import sample_next
from .lm import Block, LanguageModel, LMOutput
from .lobe import MemoryLobe
from .moe import MoE, Routing
from .registry import build_mixer, mixer_spec, mixers, register_mixer
from .tlinformer import TLinFormerCache, TLinFormerConfig, TLinFormerLM
from .family import (CausalLM, build_model, config_from_dict, config_to_dict, families, family_of, get_family,
                     register_family)

register_family("lm", LMConfig, LanguageModel, "decoder-only LM: a mixer per layer (linear, delta, softmax, hybrids)")
register_family("tlinformer", TLinFormerConfig, TLinFormerLM, "TLinFormer: windowed exact attention with history compression")

__all__ = [
    "LMConfig", "PRESETS", "LanguageModel", "LMOutput", "Block", "MoE", "Routing", "MemoryLobe",
    "mixers", "build_mixer", "register_mixer", "mixer_spec", "sample_next",
    "TLinFormerConfig", "TLinFormerLM", "TLinFormerCache",
    "CausalLM", "register_family", "families", "get_family", "family_of", "build_model", "config_from_dict",
    "config_to_dict",
]
