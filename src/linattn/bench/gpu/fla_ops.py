"""fla (flash-linear-attention) for the bench: its version, its op modules imported without running
`fla/__init__.py` (which imports fla's layers and models, and through them transformers), the direct chunk
functions the timing step compares against, and its `GatedDeltaNetForCausalLM` for the LM step."""
from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any, Dict, Optional

DIRECT = {"chunk_simple_gla": "simple_gla", "chunk_delta_rule": "delta_rule",
          "chunk_gated_delta_rule": "gated_delta_rule", "chunk_kda": "kda"}
OP_MODULES = tuple(DIRECT.values())


def fla_version() -> Optional[str]:
    """The installed fla-core (fla's ops; flash-linear-attention adds its layers and models)."""
    from importlib.metadata import version

    for dist in ("fla-core", "flash-linear-attention"):
        try:
            return version(dist)
        except Exception:
            continue
    return None


def _fla_init_version(origin: Optional[str]) -> str:
    """`__version__ = '...'` read from fla/__init__.py without running it (fla's ops compare versions)."""
    try:
        m = re.search(r"__version__\s*=\s*['\"]([^'\"]+)['\"]", Path(origin).read_text())
        return m.group(1) if m else "0.0.0"
    except Exception:
        return "0.0.0"


def import_fla_ops(names=OP_MODULES) -> Dict[str, Any]:
    """fla's op modules, without running fla/__init__.py; the ops need torch, triton, einops and packaging
    only. -> {name: module or the exception its import raised}."""
    import importlib
    import importlib.util
    import types

    if sys.modules.get("fla") is None:
        spec = importlib.util.find_spec("fla")
        if spec is None or not spec.submodule_search_locations:
            err = ImportError("fla (flash-linear-attention) is not installed and not on PYTHONPATH")
            return {n: err for n in names}
        pkg = types.ModuleType("fla")  # a bare package object: its submodules import, its __init__ never runs
        pkg.__path__ = list(spec.submodule_search_locations)
        pkg.__file__, pkg.__spec__ = spec.origin, spec
        pkg.__version__ = fla_version() or _fla_init_version(spec.origin)
        sys.modules["fla"] = pkg
    out: Dict[str, Any] = {}
    for n in names:
        try:
            out[n] = importlib.import_module(f"fla.ops.{n}")
        except Exception as e:
            out[n] = e
    return out


def fla_fns() -> Dict[str, Any]:
    """{fla function name: the function, or the exception that keeps it from importing}."""
    mods = import_fla_ops()
    fns: Dict[str, Any] = {}
    for name, mod in DIRECT.items():
        m = mods[mod]
        fns[name] = getattr(m, name, None) if not isinstance(m, Exception) else m
        if fns[name] is None:
            fns[name] = AttributeError(f"fla.ops.{mod} has no {name}")
    return fns


def fla_summary() -> str:
    """One line for the machine table: the version, and whether the ops import."""
    fv = fla_version()
    ops = import_fla_ops()
    bad = {n: f"{type(e).__name__}: {e}" for n, e in ops.items() if isinstance(e, Exception)}
    if len(set(bad.values())) == 1 and len(bad) == len(ops):  # one cause (typically: not installed)
        return f"{fv or 'no wheel installed'}; ops not importable: {next(iter(bad.values()))}"
    return (fv or "on PYTHONPATH") + ("; ops import" if not bad else "; not importable: "
                                      + "; ".join(f"{n}: {e}" for n, e in bad.items()))


def fla_gated_deltanet_lm():
    """fla's own (GatedDeltaNetConfig, GatedDeltaNetForCausalLM): needs the flash-linear-attention wheel and
    transformers. Raises ImportError naming what is missing."""
    import_fla_ops(())  # the bare package, if fla is not imported yet
    import importlib.util

    if importlib.util.find_spec("transformers") is None:  # fla's models import it (linattn itself never does here)
        raise ImportError("fla's models need transformers, which is not installed here")
    from fla.models.gated_deltanet import GatedDeltaNetConfig, GatedDeltaNetForCausalLM

    return GatedDeltaNetConfig, GatedDeltaNetForCausalLM
