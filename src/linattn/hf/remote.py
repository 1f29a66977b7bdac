"""The two modules `save_pretrained` writes next to the weights, so that a saved folder loads with
`AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)` in a process that never ran
`import linattn.hf`. They only re-export the classes of `linattn.hf` (linattn must be installed;
the model code is linattn's, not a copy that could drift from it)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Union

from ..io import atomic_write_text

CONFIG_MODULE = "configuration_linattn.py"
MODEL_MODULE = "modeling_linattn.py"

_CONFIG_SRC = '''"""linattn's transformers config (trust_remote_code entry point; needs `pip install linattn[hf]`)."""
from linattn.hf.configuration_linattn import LinattnConfig

__all__ = ["LinattnConfig"]
'''

_MODEL_SRC = '''"""linattn's transformers model (trust_remote_code entry point; needs `pip install linattn[hf]`)."""
from linattn.hf.modeling_linattn import LinattnForCausalLM

from .configuration_linattn import LinattnConfig

__all__ = ["LinattnConfig", "LinattnForCausalLM"]
'''


def write_remote_code(directory: Union[str, os.PathLike]) -> None:
    """Write configuration_linattn.py and modeling_linattn.py into `directory`."""
    d = Path(directory)
    atomic_write_text(d / CONFIG_MODULE, _CONFIG_SRC)
    atomic_write_text(d / MODEL_MODULE, _MODEL_SRC)


__all__ = ["write_remote_code", "CONFIG_MODULE", "MODEL_MODULE"]
