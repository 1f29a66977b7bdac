"""Atomic checkpoints: safetensors weights + config JSON + tokenizer + optimizer/training state.

Layout of a run folder DIR:

    DIR/step_00001000/model.safetensors   the weights (tied tensors stored once)
    DIR/step_00001000/config.json         {"format", "step", "model": model config dict, "train": {...}}
    DIR/step_00001000/tokenizer.json      the byte-level BPE tokenizer
    DIR/step_00001000/training_state.pt   optimizer, step, RNG states, data position (resume only)
    DIR/latest                            the name of the newest complete step folder

A checkpoint is written into a hidden temporary folder (every file flushed and fsynced), which is
then renamed to `step_N` (one atomic rename), and only then is `latest` replaced (write a temp
file, rename). A crash at any point leaves either the previous checkpoint or the new one, never a
half-written one: readers only look at complete `step_*` folders, and `find_latest_checkpoint`
falls back to the newest complete folder when `latest` is missing or stale. Older step folders
beyond `keep_last` are removed only after the new one is in place.

The model config dict names its model family under "arch" (`linattn.models.family`); loading
builds the family's model from it. Dicts without "arch" (the first checkpoints) are "lm" configs.
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Union

import torch

from .errors import CheckpointError  # noqa: F401  (re-exported)
from .io import atomic_write_bytes, atomic_write_text, fsync_dir  # noqa: F401  (re-exported)
from .models import family

CHECKPOINT_FORMAT = "linattn-checkpoint/1"
MODEL_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
TOKENIZER_FILE = "tokenizer.json"
STATE_FILE = "training_state.pt"
LATEST_FILE = "latest"
STEP_PREFIX = "step_"
TMP_PREFIX = ".tmp_"

PathLike = Union[str, os.PathLike]


# --------------------------------------------------------------------------- atomic files

def _fsync_file(path: Path) -> None:
    with open(path, "rb+") as f:
        f.flush()
        os.fsync(f.fileno())


def atomic_write_json(path: PathLike, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


# --------------------------------------------------------------------------- finding checkpoints

def step_dir_name(step: int) -> str:
    return f"{STEP_PREFIX}{int(step):08d}"


def is_checkpoint_dir(path: PathLike) -> bool:
    """A complete checkpoint folder: has config.json (of our format) and model.safetensors."""
    p = Path(path)
    if not (p / CONFIG_FILE).is_file() or not (p / MODEL_FILE).is_file():
        return False
    try:
        meta = json.loads((p / CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and meta.get("format") == CHECKPOINT_FORMAT


def list_checkpoints(run_dir: PathLike) -> List[Path]:
    """Complete step folders of a run, oldest first."""
    d = Path(run_dir)
    if not d.is_dir():
        return []
    out = []
    for p in d.iterdir():
        if p.is_dir() and p.name.startswith(STEP_PREFIX) and p.name[len(STEP_PREFIX):].isdigit() \
                and is_checkpoint_dir(p):
            out.append(p)
    return sorted(out, key=lambda p: int(p.name[len(STEP_PREFIX):]))


def find_latest_checkpoint(path: PathLike) -> Optional[Path]:
    """The checkpoint folder that `path` stands for: `path` itself if it is one, else the run
    folder's `latest`, else its newest complete step folder; None if there is none."""
    p = Path(path)
    if is_checkpoint_dir(p):
        return p
    if not p.is_dir():
        return None
    latest = p / LATEST_FILE
    if latest.is_file():
        try:
            name = latest.read_text(encoding="utf-8").strip()
        except OSError:
            name = ""
        if name and "/" not in name and is_checkpoint_dir(p / name):
            return p / name
    ckpts = list_checkpoints(p)
    return ckpts[-1] if ckpts else None


def has_checkpoint(run_dir: PathLike) -> bool:
    """Whether `run_dir` holds any checkpoint of ours (complete or partly: a `latest` file counts)."""
    d = Path(run_dir)
    return find_latest_checkpoint(d) is not None or (d / LATEST_FILE).exists()


def read_checkpoint_config(path: PathLike) -> Dict[str, Any]:
    """config.json of the checkpoint `path` stands for (see find_latest_checkpoint)."""
    ck = find_latest_checkpoint(path)
    if ck is None:
        raise CheckpointError(f"no checkpoint found in {path}")
    try:
        return json.loads((ck / CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {ck / CONFIG_FILE}: {e}") from None


# --------------------------------------------------------------------------- saving

def _save_weights(path: Path, model: Optional[torch.nn.Module], state_dict: Optional[Dict[str, torch.Tensor]],
                  metadata: Dict[str, str]) -> None:
    """model.safetensors from the model, or from a full state dict (tensors shared under several names,
    like tied weights, are stored once, as safetensors' save_model does)."""
    from safetensors.torch import save_file, save_model

    if state_dict is None:
        save_model(model, str(path), metadata=metadata)
        return
    seen: Dict[Any, str] = {}
    out: Dict[str, torch.Tensor] = {}
    for name, t in state_dict.items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape)) if t.numel() else None
        if key is not None and key in seen:
            continue
        if key is not None:
            seen[key] = name
        out[name] = t.detach().to("cpu").contiguous()
    save_file(out, str(path), metadata=metadata)


def save_checkpoint(run_dir: PathLike, step: int, model: Optional[torch.nn.Module], *,
                    model_config: Dict[str, Any], tokenizer=None,
                    train_config: Optional[Dict[str, Any]] = None,
                    training_state: Optional[Dict[str, Any]] = None,
                    extra: Optional[Dict[str, Any]] = None, keep_last: Optional[int] = 2,
                    state_dict: Optional[Dict[str, torch.Tensor]] = None) -> Path:
    """Write checkpoint `run_dir/step_<step>` atomically and point `run_dir/latest` at it.

    `model_config` is the JSON dict of the model's config; `tokenizer` anything with `to_str()`
    (a BPETokenizer); `training_state` a dict for `torch.save` (optimizer state, RNG states, ...).
    The weights are `model`'s, or `state_dict` (a full one, e.g. gathered from FSDP shards) with
    model None. `keep_last` step folders are kept (None keeps all). Returns the step folder.
    """
    if (model is None) == (state_dict is None):
        raise CheckpointError("save_checkpoint needs exactly one of model and state_dict")

    run = Path(run_dir)
    run.mkdir(parents=True, exist_ok=True)
    for stale in run.glob(TMP_PREFIX + "*"):  # left over by an interrupted save
        if stale.is_dir():
            shutil.rmtree(stale, ignore_errors=True)
    name = step_dir_name(step)
    tmp = run / f"{TMP_PREFIX}{name}.{os.getpid()}"
    final = run / name
    tmp.mkdir()
    try:
        _save_weights(tmp / MODEL_FILE, model, state_dict, {"format": CHECKPOINT_FORMAT, "step": str(int(step))})
        _fsync_file(tmp / MODEL_FILE)
        if tokenizer is not None:
            (tmp / TOKENIZER_FILE).write_text(tokenizer.to_str(), encoding="utf-8")
            _fsync_file(tmp / TOKENIZER_FILE)
        if training_state is not None:
            torch.save(training_state, tmp / STATE_FILE)
            _fsync_file(tmp / STATE_FILE)
        meta = {"format": CHECKPOINT_FORMAT, "step": int(step), "model": model_config,
                "train": train_config or {}, **(extra or {})}
        (tmp / CONFIG_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        _fsync_file(tmp / CONFIG_FILE)
        fsync_dir(tmp)
        old = None
        if final.exists():  # re-saving the same step: move the old one aside first
            old = run / f"{TMP_PREFIX}old_{name}.{os.getpid()}"
            os.replace(final, old)
        os.replace(tmp, final)
        fsync_dir(run)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    atomic_write_text(run / LATEST_FILE, name + "\n")
    if keep_last is not None and keep_last >= 1:
        for p in list_checkpoints(run)[:-keep_last]:
            if p.name != name:
                shutil.rmtree(p, ignore_errors=True)
    return final


# --------------------------------------------------------------------------- loading

def model_config_from_dict(d: Dict[str, Any]):
    """The model-family config of a checkpoint's model dict (raises CheckpointError when it does not fit)."""
    try:
        return family.config_from_dict(dict(d))
    except (TypeError, ValueError, KeyError) as e:
        raise CheckpointError(f"model config in checkpoint is not valid: {e}") from None


def model_config_to_dict(cfg) -> Dict[str, Any]:
    """The JSON dict of a model-family config, naming its family under "arch"."""
    return family.config_to_dict(cfg)


def build_model(model_config):
    """The model of a model-family config (or of its dict)."""
    return family.build_model(model_config)


def load_model_weights(model: torch.nn.Module, ckpt_dir: PathLike, device: Union[str, torch.device] = "cpu") -> None:
    """Load `model.safetensors` into `model` strictly; mismatches raise CheckpointError."""
    from safetensors.torch import load_model

    f = Path(ckpt_dir) / MODEL_FILE
    try:
        load_model(model, str(f), strict=True, device=str(device))
    except (RuntimeError, ValueError, KeyError) as e:
        msg = " ".join(str(e).split())
        if len(msg) > 300:
            msg = msg[:300] + "..."
        raise CheckpointError(f"weights in {f} do not match the model config: {msg}") from None
    except OSError as e:
        raise CheckpointError(f"cannot read {f}: {e}") from None
    except Exception as e:  # safetensors' own errors on a corrupt header
        raise CheckpointError(f"cannot read {f}: {type(e).__name__}: {e}") from None


@dataclass
class Checkpoint:
    path: Path
    step: int
    model: torch.nn.Module
    model_config: Any
    config: Dict[str, Any]                 # the whole config.json
    tokenizer: Any = None                  # BPETokenizer or None
    training_state: Optional[Dict[str, Any]] = None
    train_config: Dict[str, Any] = field(default_factory=dict)


def load_training_state(ckpt_dir: PathLike, map_location: Union[str, torch.device] = "cpu") -> Dict[str, Any]:
    f = Path(ckpt_dir) / STATE_FILE
    if not f.is_file():
        raise CheckpointError(f"{ckpt_dir} has no {STATE_FILE} (a weights-only checkpoint cannot be resumed)")
    try:
        return torch.load(f, map_location=map_location, weights_only=True)
    except Exception as e:
        first = str(e).splitlines()[0] if str(e) else ""
        raise CheckpointError(f"cannot read {f}: {type(e).__name__}: {first}") from None


def load_checkpoint(path: PathLike, device: Union[str, torch.device] = "cpu", *,
                    with_training_state: bool = False,
                    model_factory: Optional[Callable[[Dict[str, Any]], torch.nn.Module]] = None) -> Checkpoint:
    """Load the checkpoint that `path` stands for (a step folder, or a run folder: its latest).

    The model is built from config.json (`model_factory(model_dict)` if given, else the model of
    the config's family) and its weights loaded strictly. Every failure is a CheckpointError with
    a one-line message.
    """
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"checkpoint not found: {p}")
    ck = find_latest_checkpoint(p)
    if ck is None:
        raise CheckpointError(f"no readable checkpoint in {p} (expected {CONFIG_FILE} and {MODEL_FILE}, "
                              f"or step_* folders holding them)")
    meta = read_checkpoint_config(ck)
    mdict = meta.get("model")
    if not isinstance(mdict, dict):
        raise CheckpointError(f"{ck / CONFIG_FILE} has no model config")
    if model_factory is not None:
        model_config = mdict
        model = model_factory(mdict)
    else:
        model_config = model_config_from_dict(mdict)
        try:
            model = build_model(model_config)
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"cannot build the model of {ck}: {e}") from None
    load_model_weights(model, ck, device="cpu")
    model.to(device)
    tokenizer = None
    if (ck / TOKENIZER_FILE).is_file():
        from .data.tokenizer import TokenizerError, load_tokenizer

        try:
            tokenizer = load_tokenizer(ck / TOKENIZER_FILE)
        except TokenizerError as e:
            raise CheckpointError(str(e)) from None
    state = load_training_state(ck, map_location="cpu") if with_training_state else None
    return Checkpoint(path=ck, step=int(meta.get("step", 0)), model=model, model_config=model_config,
                      config=meta, tokenizer=tokenizer, training_state=state,
                      train_config=dict(meta.get("train") or {}))
