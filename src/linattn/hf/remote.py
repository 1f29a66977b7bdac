"""The two modules `save_pretrained` writes next to the weights, so that a saved folder loads with
`AutoModelForCausalLM` / `AutoModel` / `AutoModelForSequenceClassification.from_pretrained(DIR,
trust_remote_code=True)` in a process that never ran
`import linattn.hf`. They only re-export the classes of `linattn.hf` (linattn must be installed;
the model code is linattn's, not a copy that could drift from it)."""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Union

from ..io import atomic_write_text, give_default_mode

CONFIG_MODULE = "configuration_linattn.py"
MODEL_MODULE = "modeling_linattn.py"

_CONFIG_SRC = '''"""linattn's transformers config (trust_remote_code entry point; needs `pip install linattn[hf]`)."""
from linattn.hf.configuration_linattn import LinattnConfig

__all__ = ["LinattnConfig"]
'''

_MODEL_SRC = '''"""linattn's transformers model (trust_remote_code entry point; needs `pip install linattn[hf]`)."""
from linattn.hf.modeling_linattn import LinattnForCausalLM, LinattnForSequenceClassification, LinattnModel

from .configuration_linattn import LinattnConfig

__all__ = ["LinattnConfig", "LinattnForCausalLM", "LinattnForSequenceClassification", "LinattnModel"]
'''


def write_remote_code(directory: Union[str, os.PathLike]) -> None:
    """Write configuration_linattn.py and modeling_linattn.py into `directory`, the last step of
    `save_pretrained`; the weights it wrote then get the mode the umask gives (`_give_weights_default_mode`)."""
    d = Path(directory)
    atomic_write_text(d / CONFIG_MODULE, _CONFIG_SRC)
    atomic_write_text(d / MODEL_MODULE, _MODEL_SRC)
    _give_weights_default_mode(d)


def _give_weights_default_mode(directory: Path) -> None:
    """safetensors writes through a private temporary file, so transformers' weights files come out 0600
    whatever the umask; give them the mode every other file of the folder has (only the weights files
    save_pretrained names, so that nothing else a user keeps in the folder is touched)."""
    for p in directory.iterdir():
        if re.fullmatch(r"model(-\d+-of-\d+)?\.safetensors", p.name) and p.is_file() and not p.is_symlink():
            give_default_mode(p)


__all__ = ["write_remote_code", "CONFIG_MODULE", "MODEL_MODULE"]
