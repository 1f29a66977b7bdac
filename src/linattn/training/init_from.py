"""`linattn train --init-from RUN_OR_CHECKPOINT`: a new run that starts from a checkpoint's weights and tokenizer.

The new run has its own --out, starts at step 0 with a fresh optimizer and schedule, and takes the model config
from the checkpoint. A model setting that contradicts it (another --d-model, --mixer, --model, ...) is refused
before anything runs, naming the flag and the checkpoint's value; the settings in `FREE_MODEL_FIELDS` change how
the model is computed or trained but not its weights, and may differ. --seq-len may not exceed the checkpoint's
max_seq_len (the length the model was built for). The checkpoint's tokenizer is used, unless --tokenizer gives one
of the same vocabulary size (a --vocab-size other than the checkpoint's is refused). `TrainConfig.init_from`
records where the run started.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

from .. import checkpoint as ckpt
from ..cli_support import flag_name
from ..data.tokenizer import BPETokenizer, TokenizerError, load_tokenizer, tokenizer_for_model
from ..errors import CheckpointError
from ..models.family import config_from_dict, config_to_dict
from .config import TrainConfig, TrainError

#: model-config fields that do not change the weights' meaning: an --init-from run may set them
FREE_MODEL_FIELDS = ("chunk_size", "init_std", "aux_loss_coef")


def _checkpoint_of(path: str) -> Path:
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"--init-from {p}: no such run or checkpoint folder")
    ck = ckpt.find_latest_checkpoint(p)
    if ck is None:
        raise ckpt.no_checkpoint_error(p)
    return ck


def checkpoint_model_config(path: str) -> Tuple[Path, Any]:
    """(the checkpoint folder, its model config) for --init-from `path` (a run folder: its latest checkpoint)."""
    ck = _checkpoint_of(path)
    saved = ckpt.read_checkpoint_config(ck).get("model")
    if not isinstance(saved, dict):
        raise CheckpointError(f"{ck / ckpt.CONFIG_FILE} has no model config")
    return ck, ckpt.model_config_from_dict(saved)


def _contradiction(field: str, value: Any, ck_value: Any, ck: Path) -> TrainError:
    return TrainError(f"{flag_name(field)} {value!r} contradicts the checkpoint's {field} = {ck_value!r} ({ck}); "
                      f"--init-from takes the model config from the checkpoint (leave the flag out)")


def model_config_with_flags(path: str, given: Dict[str, Any], arch: Optional[str] = None):
    """The checkpoint's model config with the model flags `given` (field -> value) applied: refused, naming the
    first flag, when one changes a field outside FREE_MODEL_FIELDS or when `arch` names another family."""
    ck, base = checkpoint_model_config(path)
    d = config_to_dict(base)
    if arch is not None and arch != d.get("arch"):
        raise _contradiction("arch", arch, d.get("arch"), ck)
    for k, v in given.items():
        try:
            trial = config_from_dict({**d, k: v})
        except (TypeError, ValueError) as e:
            raise TrainError(f"{flag_name(k)} {v!r} does not fit the checkpoint's model ({ck}): "
                             f"{' '.join(str(e).split())}") from None
        if getattr(trial, k) != getattr(base, k) and k not in FREE_MODEL_FIELDS:
            raise _contradiction(k, v, getattr(base, k), ck)
        d = config_to_dict(trial)
    return config_from_dict(d)


def init_setup(cfg: TrainConfig, model_config, tokenizer: Optional[BPETokenizer],
               have_data: bool) -> Tuple[Path, Any, Optional[BPETokenizer]]:
    """(checkpoint folder, model config, tokenizer) of a run that starts from `cfg.init_from`.

    model_config (None: the checkpoint's) must agree with the checkpoint's outside FREE_MODEL_FIELDS and
    vocab_size (the tokenizer's); the free fields it sets are kept."""
    ck, base = checkpoint_model_config(cfg.init_from)
    damaged = ckpt.weights_problem(ck, base)  # before the corpus is tokenised, not after
    if damaged is not None:
        raise CheckpointError(f"--init-from {ck}: {damaged}")
    if cfg.out is not None and Path(cfg.out).resolve() in Path(ck).resolve().parents:
        raise TrainError(f"--init-from {ck} lies in --out {cfg.out}: a new run there would replace it; pass "
                         f"another --out (or --resume to continue that run)")
    if model_config is None:
        model_config = base
    else:
        want, have = config_to_dict(model_config), config_to_dict(base)
        for k in sorted(set(want) | set(have)):
            if k not in FREE_MODEL_FIELDS and k != "vocab_size" and want.get(k) != have.get(k):
                raise _contradiction(k, want.get(k), have.get(k), ck)
        free = {k: getattr(model_config, k) for k in FREE_MODEL_FIELDS if hasattr(model_config, k)}
        model_config = dataclasses.replace(base, **free) if free else base
    max_len = getattr(model_config, "max_seq_len", None)
    if isinstance(max_len, int) and cfg.seq_len > max_len:
        raise TrainError(f"--seq-len {cfg.seq_len} exceeds the checkpoint's max_seq_len {max_len} ({ck}): the model "
                         f"was built for sequences up to that length")
    if cfg.tokenizer is not None and tokenizer is None:  # one given explicitly, instead of the checkpoint's
        tokenizer = tokenizer_for_model(cfg.tokenizer, int(model_config.vocab_size))
        if tokenizer.vocab_size != model_config.vocab_size:  # the run sizes the model by its tokenizer
            raise TrainError(f"--tokenizer {cfg.tokenizer} has {tokenizer.vocab_size} tokens, the checkpoint's model "
                             f"{model_config.vocab_size} ({ck}): --init-from needs a tokenizer of the same vocabulary")
    if tokenizer is None and not have_data:
        try:
            tokenizer = load_tokenizer(ck)
        except TokenizerError as e:
            raise CheckpointError(f"--init-from {ck}: {e}") from None
    return ck, model_config, tokenizer


__all__ = ["FREE_MODEL_FIELDS", "checkpoint_model_config", "model_config_with_flags", "init_setup"]
