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
falls back to the newest complete folder when `latest` is missing or stale (naming, in one warning
line each, the newer step folders it skips and why). With `keep_last` K, the older step folders
beyond K - 1 are removed before the new one is written, so that a full disk can be relieved by a
lower K, but the newest one always stays until the new one is in place: never zero checkpoints.
Every file gets the mode the umask gives (safetensors' private temporary file would leave 0600).

The model config dict names its model family under "arch" (`linattn.models.family`); loading
builds the family's model from it. Dicts without "arch" (the first checkpoints) are "lm" configs.
The weights file records the architecture too (`ARCH_KEY` in its metadata: the family, the mixer
of every layer and the fields that change what the weights mean but not their shapes), and loading
checks it against config.json, so weights of another architecture with the same shapes are refused
(files without the record, written by older versions, load unchecked).

Loading checks what it reads: config.json's step, model and train sections, finite weights, and a
training state that loads with `weights_only=True`; any failure is a one-line CheckpointError. A
failed write of any file of a save (a full disk, whether the writer says so with an OSError, torch's
RuntimeError or safetensors' error) is a one-line `CheckpointWriteError` (also an OSError) naming the
file, that leaves the previous checkpoint in place. Only folders of our format are ever removed
(`is_checkpoint_dir`), and the temporary files and folders of an interrupted save are removed only
when their writer (the pid in their name) is dead (`remove_stale_temps`).
"""
from __future__ import annotations

import errno
import json
import os
import re
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Set, Tuple, Union

import torch

from .errors import CheckpointError  # noqa: F401  (re-exported)
from .io import (  # noqa: F401
    CHECKPOINT_TMP_PREFIX as TMP_PREFIX,
    atomic_write_bytes,
    atomic_write_text,
    fsync_dir,
    give_default_mode,
    pid_alive,
    remove_stale_temps,
    to_json,
)
from .models import family
from .train_config import TrainConfig, legacy_values  # the "train" schema

CHECKPOINT_FORMAT = "linattn-checkpoint/1"
MODEL_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
TOKENIZER_FILE = "tokenizer.json"
STATE_FILE = "training_state.pt"
LATEST_FILE = "latest"
STEP_PREFIX = "step_"
ARCH_KEY = "linattn_arch"          # safetensors metadata: the architecture of the weights (JSON)
# Model config fields that change what the weights compute without changing their shapes (any family).
ARCH_FIELDS = ("mixer_kwargs", "rope", "rope_base", "window", "residual", "hyperlink_ffn_skip", "memory_lobe",
               "lobe_feature_map", "allow_future_leak", "moe_bias", "top_k", "norm_eps", "history_window",
               "generation_window", "mixer_names")

PathLike = Union[str, os.PathLike]


class CheckpointWriteError(CheckpointError, OSError):
    """A checkpoint that could not be written (disk full, no permission): the previous one is intact."""

    def __str__(self) -> str:   # the message, not OSError's "[Errno N] ..." form
        return str(self.args[0]) if self.args else ""


# --------------------------------------------------------------------------- atomic files

def _fsync_file(path: Path) -> None:
    with open(path, "rb+") as f:
        f.flush()
        os.fsync(f.fileno())


def nonfinite_tensors(state_dict: Dict[str, torch.Tensor]) -> List[str]:
    """Names of the floating-point tensors holding NaN or inf."""
    return [k for k, t in state_dict.items()
            if t.is_floating_point() and t.numel() and not bool(torch.isfinite(t).all())]


# --------------------------------------------------------------------------- finding checkpoints

def step_dir_name(step: int) -> str:
    return f"{STEP_PREFIX}{int(step):08d}"


def checkpoint_problem(path: PathLike) -> Optional[str]:
    """Why `path` is not a complete checkpoint folder, in words (None when it is one): a missing file,
    a config.json that is not valid JSON (with the line and column), or one of another format."""
    p = Path(path)
    if not p.is_dir():
        return "it is not a folder" if p.exists() else "it does not exist"
    missing = [f for f in (CONFIG_FILE, MODEL_FILE) if not (p / f).is_file()]
    if missing:
        return f"it has no {' and no '.join(missing)}"
    try:
        meta = json.loads((p / CONFIG_FILE).read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        return f"{CONFIG_FILE} is not valid JSON ({e.msg} at line {e.lineno} column {e.colno})"
    except UnicodeDecodeError:
        return f"{CONFIG_FILE} is not UTF-8 text"
    except OSError as e:
        return f"{CONFIG_FILE} cannot be read ({e.strerror or e})"
    if not isinstance(meta, dict) or meta.get("format") != CHECKPOINT_FORMAT:
        fmt = meta.get("format") if isinstance(meta, dict) else None
        return f"{CONFIG_FILE} is not a linattn checkpoint's (format {fmt!r}, expected {CHECKPOINT_FORMAT!r})"
    return None


def is_checkpoint_dir(path: PathLike) -> bool:
    """A complete checkpoint folder: has config.json (of our format) and model.safetensors."""
    return checkpoint_problem(path) is None


def step_of(path: PathLike) -> Optional[int]:
    """N of a folder named step_N (None for any other name)."""
    name = Path(path).name
    digits = name[len(STEP_PREFIX):]
    return int(digits) if name.startswith(STEP_PREFIX) and digits.isdigit() else None


def damaged_step_dirs(run_dir: PathLike) -> List[Tuple[Path, str]]:
    """(folder, why) of the step_N folders of a run that are not complete checkpoints, oldest first:
    a damaged checkpoint, or a folder someone else put there."""
    d = Path(run_dir)
    if not d.is_dir():
        return []
    out = []
    for p in sorted((p for p in d.iterdir() if step_of(p) is not None and p.is_dir()), key=step_of):
        why = checkpoint_problem(p)
        if why is not None:
            out.append((p, why))
    return out


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


class DanglingLatest(CheckpointError):
    """A run folder whose `latest` names a checkpoint that is not there, and that holds no other."""


def _latest_name(run_dir: Path) -> Optional[str]:
    try:
        return (run_dir / LATEST_FILE).read_text(encoding="utf-8").strip() or None
    except (OSError, UnicodeDecodeError):
        return None


_warned: Set[Tuple[str, str]] = set()   # (folder, why): each skipped folder is reported once per process


def _warn_skipped(chosen: Path, skipped: List[Tuple[Path, str]]) -> None:
    """One line on stderr per folder newer than `chosen` that loading skips, saying why."""
    for p, why in skipped:
        if (str(p), why) in _warned:
            continue
        _warned.add((str(p), why))
        print(f"[linattn] warning: skipping {p}, which is not a readable checkpoint: {why}; using {chosen}",
              file=sys.stderr, flush=True)


def find_latest_checkpoint(path: PathLike) -> Optional[Path]:
    """The checkpoint folder that `path` stands for: `path` itself if it is one, else the run
    folder's `latest`, else its newest complete step folder; None if there is none. Newer step
    folders that are not complete checkpoints are skipped with one warning line each (naming why).
    A `latest` that names a missing or incomplete folder, in a run folder with no other checkpoint,
    raises DanglingLatest (a CheckpointError)."""
    p = Path(path)
    if is_checkpoint_dir(p):
        return p
    if not p.is_dir():
        return None
    name = _latest_name(p)
    chosen = p / name if name and "/" not in name and is_checkpoint_dir(p / name) else None
    if chosen is None:
        ckpts = list_checkpoints(p)
        chosen = ckpts[-1] if ckpts else None
    if chosen is not None:
        n = step_of(chosen)
        _warn_skipped(chosen, [(d, why) for d, why in damaged_step_dirs(p) if n is None or step_of(d) > n])
        return chosen
    if (p / LATEST_FILE).exists():
        why = f" ({checkpoint_problem(p / name)})" if name and "/" not in name else ""
        raise DanglingLatest(f"{p / LATEST_FILE} names {name or 'nothing readable'}, which is not a complete "
                             f"checkpoint{why}, and {p} holds no other; remove {p / LATEST_FILE} (or the whole run) "
                             f"to start over")
    return None


def _looks_like_checkpoint(p: Path) -> bool:
    """A folder meant as one checkpoint (a step_N folder, or one holding a checkpoint's files), as
    opposed to a run folder."""
    return p.is_dir() and (step_of(p) is not None or (p / CONFIG_FILE).exists() or (p / MODEL_FILE).exists())


def no_checkpoint_error(p: Path) -> CheckpointError:
    """The one line for a path that holds no readable checkpoint, saying what is wrong with it."""
    if _looks_like_checkpoint(p):
        return CheckpointError(f"{p} is not a readable checkpoint: {checkpoint_problem(p)}")
    damaged = damaged_step_dirs(p)
    if damaged:
        return CheckpointError(f"no readable checkpoint in {p}: " + "; ".join(f"{d.name}: {why}" for d, why in
                                                                            damaged[-3:]))
    return CheckpointError(f"no readable checkpoint in {p} (expected {CONFIG_FILE} and {MODEL_FILE}, "
                           f"or step_* folders holding them)")


def has_checkpoint(run_dir: PathLike) -> bool:
    """Whether `run_dir` holds any checkpoint of ours (complete or partly: a `latest` file counts)."""
    d = Path(run_dir)
    try:
        return find_latest_checkpoint(d) is not None or (d / LATEST_FILE).exists()
    except DanglingLatest:
        return True


def read_checkpoint_config(path: PathLike) -> Dict[str, Any]:
    """config.json of the checkpoint `path` stands for (see find_latest_checkpoint)."""
    ck = find_latest_checkpoint(path)
    if ck is None:
        raise no_checkpoint_error(Path(path)) if Path(path).is_dir() else \
            CheckpointError(f"no checkpoint found in {path}")
    f = ck / CONFIG_FILE
    try:
        meta = json.loads(f.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {f}: {e}") from None
    check_checkpoint_config(meta, f)
    return meta


def check_checkpoint_config(meta: Any, where: PathLike) -> None:
    """Raise CheckpointError naming the first entry of a config.json (`where`) that is not what
    loading expects: "step" an int >= 0, "model" a dict, "train" a dict of valid TrainConfig values."""
    if not isinstance(meta, dict):
        raise CheckpointError(f"{where} must hold a JSON object, got {type(meta).__name__}")
    step = meta.get("step", 0)
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise CheckpointError(f"{where}: step must be an int >= 0, got {step!r}")
    for key in ("model", "train"):
        if meta.get(key) is not None and not isinstance(meta[key], dict):
            raise CheckpointError(f"{where}: {key} must be a JSON object (a config), got {meta[key]!r}")
    if meta.get("train") and meta.get("kind") is None:   # a language-model run (other kinds check their own)
        _check_train_section(meta["train"], where)


def _check_train_section(train: Dict[str, Any], where: PathLike) -> None:
    try:   # values older versions accepted (grad_clip -1, keep_last 0, threads 0) keep their old meaning
        TrainConfig.from_dict(legacy_values(train)).validate()
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"{where}: train: {' '.join(str(e).split())}") from None


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


def architecture(model_config: Dict[str, Any]) -> Dict[str, Any]:
    """What weights of the model config dict `model_config` mean beyond their names and shapes: the
    family, the mixer of every layer, and the ARCH_FIELDS it sets (as JSON values)."""
    d = model_config if isinstance(model_config, dict) else {}
    arch: Dict[str, Any] = {"family": d.get("arch") or family.DEFAULT_ARCH}
    mixers = d.get("mixer")
    if isinstance(mixers, str) and isinstance(d.get("n_layers"), int):
        mixers = [mixers] * d["n_layers"]
    if mixers is not None:
        arch["mixers"] = mixers
    arch.update({k: d[k] for k in ARCH_FIELDS if k in d})
    return json.loads(json.dumps(arch, sort_keys=True, default=str))


def save_checkpoint(run_dir: PathLike, step: int, model: Optional[torch.nn.Module], *,
                    model_config: Dict[str, Any], tokenizer=None,
                    train_config: Optional[Dict[str, Any]] = None,
                    training_state: Optional[Dict[str, Any]] = None,
                    extra: Optional[Dict[str, Any]] = None, keep_last: Optional[int] = 2,
                    state_dict: Optional[Dict[str, torch.Tensor]] = None) -> Path:
    """Write checkpoint `run_dir/step_<step>` atomically and point `run_dir/latest` at it.

    `keep_last` step folders are kept (None keeps all): the older ones beyond `keep_last - 1` are removed before
    the new one is written (so the disk never holds more than `keep_last` of them, and a run that filled its disk
    makes room by lowering it), but the newest one always stays until the new one is in place.

    Args:
        run_dir: The run folder.
        step: The step number (the folder's name).
        model: The model whose weights are written, or None with `state_dict`.
        model_config: The JSON dict of the model's config.
        tokenizer: Anything with `to_str()` (a BPETokenizer), or None.
        train_config: The run's `TrainConfig` as a dict, or None.
        training_state: A dict for `torch.save` (optimizer state, RNG states, ...), or None.
        extra: More JSON fields for config.json.
        keep_last: The step folders kept (None: all).
        state_dict: The weights (a full one, e.g. gathered from FSDP shards) with model None.

    Returns:
        The step folder.

    Raises:
        CheckpointError: Non-finite weights (refused).
        CheckpointWriteError: A failed write of any file (a full disk, no permission); the previous checkpoint is
            left as it was.
    """
    if (model is None) == (state_dict is None):
        raise CheckpointError("save_checkpoint needs exactly one of model and state_dict")
    run = Path(run_dir)
    name = step_dir_name(step)
    final = run / name
    bad = nonfinite_tensors(state_dict if state_dict is not None else model.state_dict())
    if bad:
        raise CheckpointError(f"refusing to write {final}: the weights are not finite (NaN or inf in {_few(bad)})")
    if final.exists() and not is_checkpoint_dir(final):
        raise CheckpointError(f"{final} exists and is not a linattn checkpoint ({checkpoint_problem(final)}); "
                              f"move it away (it is left as it is)")
    meta = {"format": CHECKPOINT_FORMAT, "step": int(step), "model": model_config, "train": train_config or {},
            **(extra or {})}
    weights_meta = {"format": CHECKPOINT_FORMAT, "step": str(int(step)),
                    ARCH_KEY: json.dumps(architecture(model_config), sort_keys=True)}
    renamed = False
    try:
        try:
            run.mkdir(parents=True, exist_ok=True)
            remove_stale_temps(run)
        except OSError as e:
            raise _FileWriteFailed(run.name + "/", e) from None
        if keep_last is not None and keep_last >= 1:
            _prune(run, keep=max(keep_last - 1, 1), exclude=name)
        _write_step_folder(run, name, lambda path: _save_weights(path, model, state_dict, weights_meta),
                           tokenizer, training_state, meta)
        renamed = True
        _write_file(run / LATEST_FILE, lambda path: atomic_write_text(path, name + "\n"))
    except _FileWriteFailed as e:
        raise _write_error(final, e, renamed) from None
    if keep_last is not None and keep_last >= 1:
        _prune(run, keep=keep_last - 1, exclude=name)   # the new one is the keep_last-th
    return final


def _prune(run: Path, keep: int, exclude: str) -> None:
    """Remove the complete checkpoints of `run` other than `exclude`, but the newest `keep` of them."""
    others = [p for p in list_checkpoints(run) if p.name != exclude]
    for p in others[:max(len(others) - keep, 0)]:
        remove_checkpoint(p)


class _FileWriteFailed(CheckpointError):
    """One file of a save could not be written: its name and the writer's exception (internal: save_checkpoint
    turns it into a CheckpointWriteError)."""

    def __init__(self, file: str, cause: BaseException, folder: Optional[Path] = None):
        super().__init__(file, cause)
        self.file, self.cause = file, cause
        self.errno = _errno_of(cause)
        self.free = _free_bytes(folder) if folder is not None else None   # measured before any cleanup


def _errno_of(e: BaseException) -> Optional[int]:
    """The errno behind a writer's exception: an OSError's, or the "os error N" in safetensors' text."""
    if isinstance(e, OSError) and e.errno is not None:
        return e.errno
    m = re.search(r"os error (\d+)", str(e))
    return int(m.group(1)) if m else None


def _free_bytes(folder: Path) -> Optional[int]:
    """Bytes free on the device of `folder` (None when it cannot be told)."""
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return None


# torch.save reports a short write (a full disk) as a RuntimeError, safetensors as a SafetensorError
_WRITER_ERRORS: Tuple[type, ...] = (OSError, RuntimeError)
try:
    from safetensors import SafetensorError as _SafetensorError
    _WRITER_ERRORS += (_SafetensorError,)
except ImportError:  # pragma: no cover  (older safetensors)
    pass


def _write_file(path: Path, write: Callable[[Path], None]) -> None:
    """write(path), then the mode a plain open() gives (safetensors' private temporary file would leave
    0600) and an fsync; any failure of the writer becomes _FileWriteFailed naming the file."""
    try:
        write(path)
        give_default_mode(path)
        _fsync_file(path)
    except _WRITER_ERRORS as e:
        raise _FileWriteFailed(path.name, e, path.parent) from None


def _write_step_folder(run: Path, name: str, write_weights: Callable[[Path], None], tokenizer,
                       training_state: Optional[Dict[str, Any]], meta: Dict[str, Any]) -> None:
    """Every file in a temporary folder (each fsynced), then one rename to `run/name`."""
    tmp = run / f"{TMP_PREFIX}{name}.{os.getpid()}"
    final = run / name
    try:
        tmp.mkdir()
    except OSError as e:
        raise _FileWriteFailed(tmp.name + "/", e) from None
    try:
        _write_file(tmp / MODEL_FILE, write_weights)
        if tokenizer is not None:
            text = tokenizer.to_str()
            _write_file(tmp / TOKENIZER_FILE, lambda path: path.write_text(text, encoding="utf-8"))
        if training_state is not None:
            _write_file(tmp / STATE_FILE, lambda path: torch.save(training_state, path))
        text_meta = to_json(meta, sort_keys=True)
        _write_file(tmp / CONFIG_FILE, lambda path: path.write_text(text_meta, encoding="utf-8"))
        try:
            fsync_dir(tmp)
            old = None
            if final.exists():  # re-saving the same step: move the old one aside first
                old = run / f"{TMP_PREFIX}old_{name}.{os.getpid()}"
                os.replace(final, old)
            os.replace(tmp, final)
            fsync_dir(run)
        except OSError as e:
            raise _FileWriteFailed(name + "/", e) from None
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _write_error(final: Path, e: _FileWriteFailed, renamed: bool = False) -> CheckpointWriteError:
    """One line: which checkpoint and file failed, why, and which checkpoint is still there."""
    cause = e.cause
    if isinstance(cause, OSError):
        reason = cause.strerror or str(cause) or type(cause).__name__
    else:   # torch's "[enforce fail at inline_container.cc:672] . unexpected pos 909184 vs 909072"
        text = " ".join(str(cause).split())
        text = re.sub(r"^\[enforce fail at [^\]]*\]\s*\.?\s*", "", text)
        reason = f"{type(cause).__name__}: {text[:200]}"
    err_no = e.errno
    if err_no is None and e.free is not None and e.free < (1 << 20):
        err_no = errno.ENOSPC   # a short write with under 1 MiB left on the device: the disk filled up
    if err_no == errno.ENOSPC:
        reason += " (the disk is full)"
    try:
        prev = find_latest_checkpoint(final.parent)
    except CheckpointError:
        prev = None
    if renamed:
        kept = (f"{final} itself is complete but {LATEST_FILE} still names "
                f"{prev.name if prev is not None and prev != final else 'no checkpoint'}")
    elif prev is not None and prev != final:
        kept = f"the previous checkpoint {prev} is intact"
    else:
        kept = "no earlier checkpoint exists"
    err = CheckpointWriteError(f"cannot write checkpoint {final}: writing {e.file} failed: {reason}; {kept}")
    err.errno, err.strerror, err.filename = err_no, reason, str(final)
    return err


def remove_checkpoint(path: PathLike) -> bool:
    """Remove a step folder of ours (never anything else: False then). It is renamed to a temporary
    name first, so a kill midway leaves no half checkpoint behind, only a temporary folder."""
    p = Path(path)
    if not is_checkpoint_dir(p):
        return False
    trash = p.parent / f"{TMP_PREFIX}old_{p.name}.{os.getpid()}"
    try:
        os.replace(p, trash)
    except OSError:
        return False
    shutil.rmtree(trash, ignore_errors=True)
    return True


def _few(names: List[str], n: int = 3) -> str:
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")


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


def load_model_weights(model: torch.nn.Module, ckpt_dir: PathLike, device: Union[str, torch.device] = "cpu",
                       model_config: Optional[Dict[str, Any]] = None) -> None:
    """Load `model.safetensors` into `model` strictly; mismatches raise CheckpointError, and so do
    non-finite weights and (given the model config dict) weights recorded for another architecture."""
    from safetensors.torch import load_model

    f = Path(ckpt_dir) / MODEL_FILE
    if model_config is not None:
        check_architecture(ckpt_dir, model_config)
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
    bad = nonfinite_tensors(model.state_dict())
    if bad:
        raise CheckpointError(f"weights in {f} are not finite (NaN or inf in {_few(bad)})")


def weights_problem(ckpt_dir: PathLike, model_config) -> Optional[str]:
    """Why `model.safetensors` of `ckpt_dir` cannot fill the model of `model_config`, found without loading it
    (its header against the file's size and the model's tensor names and shapes, the model built on the meta
    device), or None. What it cannot see: the values themselves (`load_model_weights` checks them)."""
    f = Path(ckpt_dir) / MODEL_FILE
    try:
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            size = os.fstat(fh.fileno()).st_size
            if not 0 < n <= size - 8:
                return f"{f} is not a safetensors file (header of {n} bytes in a file of {size})"
            header = json.loads(fh.read(n))
    except OSError as e:
        return f"{f} cannot be read ({e.strerror or e})"
    except (ValueError, UnicodeDecodeError):
        return f"{f} has a damaged header"
    try:
        tensors = {k: (tuple(v["shape"]), int(v["data_offsets"][1])) for k, v in header.items() if k != "__metadata__"}
    except (TypeError, KeyError, ValueError, IndexError, AttributeError):
        return f"{f} has a damaged header"
    end = 8 + n + max((e for _, e in tensors.values()), default=0)
    if size < end:
        return f"{f} is truncated ({size} bytes, its header describes {end})"
    with torch.device("meta"):
        state = family.build_model(model_config).state_dict(keep_vars=True)
    want = {k: tuple(t.shape) for k, t in state.items()}
    aliases: Dict[int, List[str]] = {}  # a tensor shared under several names (tied weights) is stored once
    for k, t in state.items():
        aliases.setdefault(id(t), []).append(k)
    missing = sorted(names[0] for names in aliases.values() if not any(k in tensors for k in names))
    extra = sorted(set(tensors) - set(want))
    if missing or extra:
        return f"{f} does not fit the model config: missing {_few(missing)}; unexpected {_few(extra)}"
    wrong = [k for k in want if k in tensors and tensors[k][0] != want[k]]
    if wrong:
        return f"{f} holds {wrong[0]} of shape {tensors[wrong[0]][0]}, the model needs {want[wrong[0]]}"
    return None


def recorded_architecture(ckpt_dir: PathLike) -> Optional[Dict[str, Any]]:
    """The architecture recorded in the weights' metadata (`ARCH_KEY`), or None (older checkpoints)."""
    from safetensors import safe_open

    f = Path(ckpt_dir) / MODEL_FILE
    try:
        with safe_open(str(f), "pt") as h:
            text = (h.metadata() or {}).get(ARCH_KEY)
    except Exception as e:  # OSError, or safetensors' own errors on a corrupt header
        raise CheckpointError(f"cannot read {f}: {type(e).__name__}: {' '.join(str(e).split())[:200]}") from None
    if text is None:
        return None
    try:
        arch = json.loads(text)
    except ValueError:
        arch = None
    if not isinstance(arch, dict):
        raise CheckpointError(f"{f}: the recorded architecture ({ARCH_KEY}) is not a JSON object: {text[:100]!r}")
    return arch


def _current_names(arch: Dict[str, Any]) -> Dict[str, Any]:
    """`arch` in today's names: its family's config class may map what an older version recorded
    (`upgrade_architecture(arch)`, e.g. LMConfig's renamed mixers); unknown families stay as they are."""
    name = arch.get("family", family.DEFAULT_ARCH)
    if name not in family.families():
        return arch
    upgrade = getattr(family.get_family(name).config_cls, "upgrade_architecture", None)
    return upgrade(arch) if callable(upgrade) else arch


def check_architecture(ckpt_dir: PathLike, model_config: Dict[str, Any]) -> None:
    """Raise CheckpointError when the weights in `ckpt_dir` were saved for another architecture than the
    model config dict `model_config` (the family, the mixers, or an ARCH_FIELDS value differs)."""
    saved = recorded_architecture(ckpt_dir)
    if saved is None:
        return
    saved, now = _current_names(saved), _current_names(architecture(model_config))
    differ = [k for k in sorted(set(saved) | set(now))
              if saved.get(k) != now.get(k) and (k in ("family", "mixers") or (k in saved and k in now))]
    if differ:
        def show(a):
            return ", ".join(f"{k}={json.dumps(a.get(k))}" for k in differ)
        raise CheckpointError(f"{Path(ckpt_dir) / MODEL_FILE} holds weights of another architecture ({show(saved)}) "
                              f"than its model config ({show(now)}); the weights and the config do not belong "
                              f"together")


@dataclass
class Checkpoint:
    """What `load_checkpoint` returns.

    Attributes:
        path: The step folder.
        step: Its step.
        model: The model, with the weights loaded.
        model_config: The model's config object.
        config: The whole config.json.
        tokenizer: The tokenizer (a BPETokenizer), or None.
        training_state: The training state (with_training_state=True), or None.
        train_config: The run's TrainConfig as a dict ({} when none was saved).
    """
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
        state = torch.load(f, map_location=map_location, weights_only=True)
    except OSError as e:
        raise CheckpointError(f"cannot read {f}: {e.strerror or e}") from None
    except Exception as e:  # unpickling errors: torch's own text suggests unsafe loading, so it is not shown
        raise CheckpointError(f"cannot read {f}: it is corrupt or not a linattn training state ({type(e).__name__}); "
                              f"resume from another checkpoint or start over") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"cannot read {f}: expected a training state dict, got {type(state).__name__}")
    return state


def load_checkpoint(path: PathLike, device: Union[str, torch.device] = "cpu", *,
                    with_training_state: bool = False,
                    model_factory: Optional[Callable[[Dict[str, Any]], torch.nn.Module]] = None) -> Checkpoint:
    """Load the checkpoint that `path` stands for (a step folder, or a run folder: its latest).

    The model is built from config.json (`model_factory(model_dict)` if given, else the model of
    the config's family) and its weights loaded strictly.

    Args:
        path: A step folder, or a run folder (its latest checkpoint).
        device: Where to load the weights.
        with_training_state: Also load the training state (optimizer, RNG states).
        model_factory: `model_factory(model_dict) -> model` instead of the family's model class.

    Returns:
        A `Checkpoint` (path, step, model, model_config, config, tokenizer, training_state, train_config).

    Raises:
        CheckpointError: Every failure, with a one-line message.

    Examples:
        >>> import tempfile
        >>> from linattn import LanguageModel, LMConfig
        >>> from linattn.checkpoint import load_checkpoint, save_checkpoint
        >>> config = LMConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2, mixer="gla")
        >>> tmp = tempfile.TemporaryDirectory()
        >>> step_dir = save_checkpoint(tmp.name, 10, LanguageModel(config), model_config=config.to_dict())
        >>> ck = load_checkpoint(tmp.name)
        >>> ck.step, ck.model_config == config
        (10, True)
        >>> tmp.cleanup()
    """
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"checkpoint not found: {p}")
    ck = find_latest_checkpoint(p)
    if ck is None:
        raise no_checkpoint_error(p)
    meta = read_checkpoint_config(ck)
    mdict = meta.get("model")
    if not isinstance(mdict, dict):
        raise CheckpointError(f"{ck / CONFIG_FILE} has no model config")
    check_architecture(ck, mdict)
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
    return Checkpoint(path=ck, step=meta.get("step", 0), model=model, model_config=model_config,
                      config=meta, tokenizer=tokenizer, training_state=state,
                      train_config=dict(meta.get("train") or {}))
