"""Import flash-linear-attention (fla) model folders as linattn checkpoints.

    linattn.hf.import_fla("fla_gla_folder", "runs/gla")        # or: linattn import-hf --model FOLDER --out RUN

`core.py` holds the registry and everything the model types share, `shared.py` the helpers two or more converters
use; each other module of this package converts one fla `model_type` (its mixer) and registers itself with
`@register_fla(...)`: adding a model type means adding a file. Importing this package imports every module in it.
"""
import importlib
import pkgutil

from .core import (  # noqa: F401
    ATTENTION_MIXER,
    FlaLayout,
    LayerParams,
    MixerConversion,
    fla_to_linattn,
    import_fla,
    is_fla_folder,
    refuse_non_float,
    register_fla,
    supported_types,
)

for _m in pkgutil.iter_modules(__path__):
    if _m.name != "core":
        importlib.import_module(f"{__name__}.{_m.name}")

__all__ = ["ATTENTION_MIXER", "FlaLayout", "LayerParams", "MixerConversion", "fla_to_linattn", "import_fla",
           "is_fla_folder", "refuse_non_float", "register_fla", "supported_types"]
