"""A run's data: read, split, tokenize and pack (`prepare_data` -> `TrainData`).

The preparation streams (`linattn.data.prep`): the files are read in blocks up to --max-data-bytes,
the tokenizer is trained on a stream of bounded segments, and the tokens go to a memory-mapped
file in OUT/data_cache/ (reused by a rerun or a --resume on the same data), from which the
training windows are read.
"""
from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Tuple

import torch

from ..checkpoint import find_latest_checkpoint
from ..data.corpus import PackedTokens
from ..data.prep import CACHE_DIR_NAME, prepare_tokens
from ..data.tokenizer import TOKENIZER_FILE, BPETokenizer, load_tokenizer
from ..errors import LinattnError
from .config import TrainConfig, TrainError


@dataclass
class TrainData:
    """A run's prepared data (`prepare_data`).

    Attributes:
        tokenizer: The tokenizer.
        train: The packed training tokens.
        val: The packed validation tokens (None: no validation split).
        fingerprint: Of the token streams: a resume must see the same data.
        source: Where the text came from.
        cache: The memory-mapped token file (OUT/data_cache/...), if any.
        reused: The tokens were found in the cache.
    """
    tokenizer: BPETokenizer
    train: PackedTokens
    val: Optional[PackedTokens]
    fingerprint: str                      # of the token streams: a resume must see the same data
    source: str
    cache: Optional[Path] = None          # the memory-mapped token file (OUT/data_cache/...), if any
    reused: bool = False                  # the tokens were found in the cache


def tokenizer_path(path: str) -> Path:
    """`path` itself, or for a run folder without tokenizer.json its latest checkpoint's folder."""
    p = Path(path)
    if p.is_dir() and not (p / TOKENIZER_FILE).is_file():
        ck = find_latest_checkpoint(p)
        if ck is not None:
            return ck
    return p


def data_cache_dir(out: Optional[str]) -> Optional[Path]:
    """Where a run keeps its prepared data: OUT/data_cache (None without an output folder)."""
    return Path(out) / CACHE_DIR_NAME if out else None


def prepare_data(cfg: TrainConfig, tokenizer: Optional[BPETokenizer] = None,
                 progress: Optional[bool] = None, write_cache: bool = True) -> TrainData:
    """Read, split, tokenize and pack the run's data.

    The tokenizer is `tokenizer`, else the one at `cfg.tokenizer`, else one trained on the training split with
    `cfg.vocab_size`.

    Args:
        cfg: The run's config (data, max_data_bytes, val_fraction, seq_len, tokenizer, vocab_size, out).
        tokenizer: The tokenizer to use.
        progress: Show a bar per phase (default `cfg.progress`).
        write_cache: False (the ranks other than 0) reads the cache in the run folder but writes nothing there,
            and shows no progress.

    Returns:
        The `TrainData`: tokenizer, packed training and validation tokens, their fingerprint.

    Raises:
        DataError: Missing or unusable data.
    """
    if tokenizer is None and cfg.tokenizer:
        tokenizer = load_tokenizer(tokenizer_path(cfg.tokenizer))
    progress = (cfg.progress if progress is None else progress) if write_cache else False
    new_out = write_cache and cfg.out is not None and not Path(cfg.out).exists()
    try:
        p = prepare_tokens(cfg.data, max_bytes=cfg.max_data_bytes, val_fraction=cfg.val_fraction,
                           tokenizer=tokenizer, vocab_size=cfg.vocab_size, cache_dir=data_cache_dir(cfg.out),
                           progress=progress, write_cache=write_cache)
        train = PackedTokens(p.train, cfg.seq_len, name="the training data")
        train.check_trainable()
    except LinattnError:
        if new_out:   # bad data: leave no run folder behind (it held only this call's cache)
            shutil.rmtree(cfg.out, ignore_errors=True)
        raise
    val = PackedTokens(p.val, cfg.seq_len, name="the validation data") if len(p.val) >= 2 else None
    fp = p.train_fingerprint + ("/" + p.val_fingerprint if val is not None else "")
    return TrainData(tokenizer=p.tokenizer, train=train, val=val, fingerprint=fp,
                     source=cfg.data if cfg.data is not None else "stdlib", cache=p.cache, reused=p.reused)


def rank_batch(data: PackedTokens, step: int, batch_size: int, seed: int, rank: int = 0,
               world_size: int = 1) -> Tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s contiguous share of the global batch of `step` (`PackedTokens.get_batch`).

    Only these windows are read.

    Args:
        data: The packed tokens.
        step: The optimizer step (it picks the batch).
        batch_size: The global batch, in windows.
        seed: The run's seed (the batch order).
        rank: This process's rank.
        world_size: The number of processes.

    Returns:
        (inputs, targets) int64 `[batch_size / world_size, seq_len]`.
    """
    if batch_size % world_size:
        raise TrainError(f"batch_size {batch_size} does not split into {world_size} processes")
    per = batch_size // world_size
    idx = data.batch_indices(step, batch_size, seed)[rank * per:(rank + 1) * per]
    rows = data.windows(idx)
    return rows[:, :-1], rows[:, 1:]


__all__ = ["TrainData", "prepare_data", "tokenizer_path", "rank_batch", "data_cache_dir"]
