"""A run's data: read, split, tokenize and pack (`prepare_data` -> `TrainData`)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Tuple

import torch

from ..checkpoint import find_latest_checkpoint
from ..data.corpus import PackedTokens, load_corpus, split_documents, token_fingerprint, tokenize_documents
from ..data.tokenizer import TOKENIZER_FILE, BPETokenizer, load_tokenizer, train_tokenizer
from .config import TrainConfig, TrainError


@dataclass
class TrainData:
    tokenizer: BPETokenizer
    train: PackedTokens
    val: Optional[PackedTokens]
    fingerprint: str                      # of the token streams: a resume must see the same data
    source: str


def tokenizer_path(path: str) -> Path:
    """`path` itself, or for a run folder without tokenizer.json its latest checkpoint's folder."""
    p = Path(path)
    if p.is_dir() and not (p / TOKENIZER_FILE).is_file():
        ck = find_latest_checkpoint(p)
        if ck is not None:
            return ck
    return p


def prepare_data(cfg: TrainConfig, tokenizer: Optional[BPETokenizer] = None) -> TrainData:
    """Read, split, tokenize and pack the run's data. The tokenizer is `tokenizer`, else the one at
    `cfg.tokenizer`, else one trained on the training split with `cfg.vocab_size`."""
    docs = load_corpus(cfg.data, max_bytes=cfg.max_data_bytes)
    train_docs, val_docs = split_documents(docs, cfg.val_fraction)
    if tokenizer is None:
        if cfg.tokenizer:
            tokenizer = load_tokenizer(tokenizer_path(cfg.tokenizer))
        else:
            tokenizer = train_tokenizer((d.text for d in train_docs), vocab_size=cfg.vocab_size)
    train_tok = tokenize_documents(train_docs, tokenizer)
    train = PackedTokens(train_tok, cfg.seq_len, name="the training data")
    train.check_trainable()
    val = None
    if val_docs:
        vt = tokenize_documents(val_docs, tokenizer)
        val = PackedTokens(vt, cfg.seq_len, name="the validation data") if vt.numel() >= 2 else None
    fp = token_fingerprint(train_tok) + ("/" + token_fingerprint(val.tokens) if val is not None else "")
    return TrainData(tokenizer=tokenizer, train=train, val=val, fingerprint=fp,
                     source=cfg.data if cfg.data is not None else "stdlib")


def rank_batch(data: PackedTokens, step: int, batch_size: int, seed: int, rank: int = 0,
               world_size: int = 1) -> Tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) int64 `[batch_size / world_size, seq_len]`: rank `rank`'s contiguous share of
    the global batch of `step` (`PackedTokens.get_batch`); only these windows are read."""
    if batch_size % world_size:
        raise TrainError(f"batch_size {batch_size} does not split into {world_size} processes")
    per = batch_size // world_size
    idx = data.batch_indices(step, batch_size, seed)[rank * per:(rank + 1) * per]
    L = data.seq_len
    rows = torch.stack([data.tokens[i * L:i * L + L + 1] for i in idx]).long()
    return rows[:, :-1], rows[:, 1:]


__all__ = ["TrainData", "prepare_data", "tokenizer_path", "rank_batch"]
