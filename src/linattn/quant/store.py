"""Saving and loading a quantized linattn `LanguageModel`: a folder of its own (not a training checkpoint).

    OUT/quantized.json          the manifest: {"format": "linattn-quantized", "version": 1, "family": "lm",
                                "model": LMConfig dict, "mode", "group_size", "compute", "activations" ("float"
                                or "int8"; absent in folders written before it: "float"),
                                "modules": {name: {"in_features", "out_features", "bias"}},
                                "moe": [names of quantized MoEs], "skipped": {name: reason},
                                "source": {"checkpoint", "step", "train_config"} of the float checkpoint or {}}
    OUT/quantized.safetensors   the state dict: for each quantized linear NAME.qweight (int8 [N, K], or uint8
                                [N, K/2] for int4: q + 8, even column in the low nibble), NAME.scales (bf16 [N]
                                or [N, K/group]), NAME.bias (fp32); every other tensor as the float model has it
    OUT/tokenizer.json          the tokenizer, when one is given

Weights q * scale (int4: (nibble - 8) * scale) are the dequantized weights; torch's packed int4 layout is
derived on load, never saved, so the files do not depend on the CPU or the torch version.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Optional, Tuple, Union

import torch

from ..errors import CheckpointError, LinattnError, LinattnTypeError
from ..models.config import LMConfig
from ..models.lm import LanguageModel
from .linear import QuantizedLinear
from .model import QuantizedMoE, quantization_summary, quantized_modules

FORMAT = "linattn-quantized"
VERSION = 1
MANIFEST_FILE = "quantized.json"
WEIGHTS_FILE = "quantized.safetensors"
TOKENIZER_FILE = "tokenizer.json"

PathLike = Union[str, os.PathLike]


def is_quantized_dir(path: PathLike) -> bool:
    """Whether `path` is a folder written by `save_quantized`.

    Args:
        path: A folder.

    Returns:
        True when it holds a quantized model's manifest.
    """
    return (Path(path) / MANIFEST_FILE).is_file()


def refuse_quantized(path: PathLike, command: str) -> None:
    """Refuse a quantized folder where only a float checkpoint will do.

    Args:
        path: The checkpoint path given to `command`.
        command: What needs the float checkpoint (named in the message).

    Raises:
        CheckpointError: `path` holds a quantized model.
    """
    if is_quantized_dir(path):
        raise CheckpointError(f"{path} holds a quantized model (linattn's {FORMAT} format); {command} needs the "
                              f"float checkpoint it was quantized from")


def save_quantized(model: LanguageModel, out: PathLike, *, tokenizer=None, source: Optional[dict] = None,
                   overwrite: bool = False) -> Path:
    """Write a quantized `LanguageModel` (and its tokenizer) to the folder `out`.

    Args:
        model: A `LanguageModel` after `linattn.quantize`.
        out: The folder to write (written beside, then renamed into place).
        tokenizer: Anything with `save(path)` (a BPETokenizer), or None.
        source: What the model was quantized from ({"checkpoint", "step", "train_config"}), kept in the manifest.
        overwrite: Replace an existing `out`.

    Returns:
        `out`.

    Raises:
        LinattnTypeError: model is not a LanguageModel.
        LinattnError: model is not quantized.
        CheckpointError: `out` exists without overwrite.
    """
    if not isinstance(model, LanguageModel):
        raise LinattnTypeError(f"model must be a quantized linattn LanguageModel, got {type(model).__name__}")
    summary = quantization_summary(model)
    if summary["mode"] is None:
        raise LinattnError("model is not quantized: call linattn.quantize(model, 'int8' | 'int4') first")
    out = Path(out)
    if out.exists() and not overwrite:
        raise CheckpointError(f"{out} exists; pass overwrite=True (--overwrite) to replace it")
    manifest = {"format": FORMAT, "version": VERSION, "family": "lm", "model": model.config.to_dict(),
                "mode": summary["mode"], "group_size": summary["group_size"], "compute": summary["compute"],
                "activations": summary["activations"],
                "modules": {n: {"in_features": m.in_features, "out_features": m.out_features,
                                "bias": m.bias is not None} for n, m in quantized_modules(model).items()},
                "moe": sorted(n for n, m in model.named_modules() if isinstance(m, QuantizedMoE)),
                "skipped": summary["skipped"], "source": dict(source or {})}
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        from safetensors.torch import save_file  # here, not at import: `import linattn` stays light

        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp / WEIGHTS_FILE))
        (tmp / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2), encoding="utf-8")
        if tokenizer is not None:
            tokenizer.save(tmp / TOKENIZER_FILE)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def read_manifest(path: PathLike) -> dict:
    """The manifest of a folder written by `save_quantized`.

    Args:
        path: The folder.

    Returns:
        The manifest (quantized.json) as a dict.

    Raises:
        CheckpointError: Not such a folder, or an unknown format version.
    """
    path = Path(path)
    try:
        manifest = json.loads((path / MANIFEST_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path} is not a quantized linattn model ({MANIFEST_FILE}: {e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise CheckpointError(f"{path / MANIFEST_FILE}: expected format {FORMAT!r} version {VERSION}")
    return manifest


def load_quantized(path: PathLike) -> Tuple[LanguageModel, Optional[object]]:
    """Load a folder written by `save_quantized`.

    Args:
        path: The folder.

    Returns:
        (the quantized LanguageModel in eval mode, its tokenizer or None).

    Raises:
        CheckpointError: Not such a folder, an unknown format version, or files that do not match the manifest.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    manifest = read_manifest(path)
    try:
        state = load_file(str(path / WEIGHTS_FILE))
        model = _build(manifest, state)
        model.load_state_dict(state, strict=True)
    except (OSError, RuntimeError, KeyError, TypeError, SafetensorError, LinattnError) as e:
        raise CheckpointError(f"cannot load the quantized model in {path}: {' '.join(str(e).split())}") from None
    tokenizer = None
    if (path / TOKENIZER_FILE).is_file():
        from ..data.tokenizer import load_tokenizer
        tokenizer = load_tokenizer(path / TOKENIZER_FILE)
    model._linattn_quant_skipped = dict(manifest.get("skipped") or {})
    return model.eval(), tokenizer


def _build(manifest, state) -> LanguageModel:
    """The float model of the manifest's config, with its quantized modules put in place from `state`."""
    model = LanguageModel(LMConfig.from_dict(manifest["model"]))
    how = (manifest["mode"], manifest["group_size"], manifest["compute"], manifest.get("activations", "float"))
    for name in manifest["moe"]:
        parent, attr = _parent(model, name)
        moe = getattr(parent, attr)
        with torch.no_grad():   # placeholders of the right shapes; the state dict fills them
            setattr(parent, attr, QuantizedMoE(moe, *how))
    for name, info in manifest["modules"].items():
        q, s = state[f"{name}.qweight"], state[f"{name}.scales"]
        b = state.get(f"{name}.bias") if info["bias"] else None
        parent, attr = _parent(model, name)
        setattr(parent, attr, QuantizedLinear(q, s, b, *how))
    return model


def _parent(model, name: str):
    *path, attr = name.split(".")
    mod = model
    for p in path:
        mod = getattr(mod, p)
    return mod, attr
