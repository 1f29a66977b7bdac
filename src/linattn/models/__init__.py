"""Language models built from the layers: `LMConfig`, `LanguageModel`, the mixer registry, MoE
and the ELA memory lobe. (`models/tlinformer.py` is a separate model.)"""
from .config import PRESETS, LMConfig
from .generation import sample_next
from .lm import Block, LanguageModel, LMOutput
from .lobe import MemoryLobe
from .moe import MoE, Routing
from .registry import build_mixer, mixer_spec, mixers, register_mixer
from .tlinformer import TLinFormerCache, TLinFormerConfig, TLinFormerLM

__all__ = [
    "LMConfig", "PRESETS", "LanguageModel", "LMOutput", "Block", "MoE", "Routing", "MemoryLobe",
    "mixers", "build_mixer", "register_mixer", "mixer_spec", "sample_next",
    "TLinFormerConfig", "TLinFormerLM", "TLinFormerCache",
]
