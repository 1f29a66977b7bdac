"""Data preparation that scales: from files to a memory-mapped token file, in bounded memory.

    p = prepare_tokens("corpus/", max_bytes=10**9, vocab_size=4096, cache_dir="runs/x/data_cache")
    PackedTokens(p.train, seq_len=256)       # p.train, p.val: numpy arrays over the token file

Three phases, each with a progress bar in bytes on stderr (`progress`: True shows them, None only
on a terminal, where a line per phase is printed otherwise, False shows nothing):

1. reading: `sources.scan` reads the files in blocks up to the byte cap (regular UTF-8 text files
   only; one line on stderr counts the skipped ones) and keeps only their sizes;
2. tokenizer: unless a tokenizer is given, a byte-level BPE is trained on the training split,
   streamed to `train_tokenizer` segment by segment (`sources.segments`);
3. tokenizing: the documents are read again and encoded in batches of about `BATCH_CHARS`
   characters (`encode_batch`), each document followed by `<|endoftext|>`; the ids are appended to
   a raw token file (uint16 for vocabularies up to 65536, else uint32), training split first,
   hashed on the way (`corpus.token_fingerprint` of each split).

Peak memory is the tokenizer library's own (its word counts while training) plus a constant: the
text is never held whole, and the token file is written as it is produced and then memory-mapped.

The cache
---------
With a `cache_dir` (the training command uses `<--out>/data_cache/`), the token file and the trained
tokenizer are kept there under a key: the SHA-256 of the data files (names, paths, sizes, mtimes,
bytes used), the cap, the validation fraction and the tokenizer (its JSON). A rerun, a resume and
another run with the same data find them and skip the work. Files are written to a temporary name
(`.tmp-...`) and renamed into place, so an interrupted preparation (Ctrl-C: KeyboardInterrupt,
which the tokenizing and training loops let through between bounded batches) leaves no partial
cache file; temporary files of dead processes are removed on the next run. Only the newest entry
is kept. Without a `cache_dir`, the tokens are collected in memory (at most twice their size).
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np

from ..io import TMP_PREFIX, fsync_dir, read_json, remove_stale_temps, write_json
from .corpus import (
    DEFAULT_CORPUS_NAME,
    DEFAULT_STDLIB_MAX_BYTES,
    DEFAULT_VAL_FRACTION,
    Fingerprint,
    encode_segments,
    is_stdlib,
    stdlib_files,
    token_dtype,
)
from .sources import (
    SEGMENT_CHARS,
    CorpusError,
    Manifest,
    Part,
    part_text,
    progress_bar,
    report_skipped,
    scan,
    scan_files,
    segments,
    split_parts,
)
from .tokenizer import BPETokenizer, TokenizerError, tokenizer_from_str, train_tokenizer

CACHE_DIR_NAME = "data_cache"
FORMAT_VERSION = 1
BATCH_CHARS = 1 << 20


@dataclass
class PreparedTokens:
    tokenizer: BPETokenizer
    train: np.ndarray                 # the training split's ids (a view of the memory-mapped token file)
    val: np.ndarray                   # the validation split's ids (may be empty)
    train_fingerprint: str            # corpus.token_fingerprint of each split
    val_fingerprint: str
    manifest: Manifest
    cache: Optional[Path] = None      # the token file, when cached
    reused: bool = False              # the tokens came from the cache
    seconds: Dict[str, float] = field(default_factory=dict)   # per phase


def _say(progress: Optional[bool], msg: str) -> None:
    """A line per phase where no progress bar shows (progress None and stderr not a terminal)."""
    if progress is None and not (hasattr(sys.stderr, "isatty") and sys.stderr.isatty()):
        print(f"[linattn] {msg}", file=sys.stderr, flush=True)


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


# ----------------------------------------------------------------------------------------------
# Keys and the cache folder
# ----------------------------------------------------------------------------------------------

def _sha(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode("utf-8")).hexdigest()


def data_key(manifest: Manifest, max_bytes: Optional[int], val_fraction: float) -> str:
    return _sha({"version": FORMAT_VERSION, "root": manifest.root, "files": [f.identity() for f in manifest.files],
                 "max_bytes": max_bytes, "val_fraction": val_fraction, "segment_chars": SEGMENT_CHARS})


def tokenizer_key(tokenizer: BPETokenizer) -> str:
    return _sha(json.loads(tokenizer.to_str()))


def _remove_others(folder: Path, prefix: str, keep: Sequence[str]) -> None:
    for p in folder.glob(prefix + "*"):
        if p.name not in keep:
            try:
                p.unlink()
            except OSError:
                pass


def _cache_folder(cache_dir: Optional[Union[str, os.PathLike]], create: bool = True) -> Optional[Path]:
    if cache_dir is None:
        return None
    folder = Path(cache_dir)
    if not create:   # read only: use the folder if it is there, touch nothing
        return folder if folder.is_dir() else None
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        print(f"[linattn] cannot use the data cache {folder} ({e.strerror or e}); tokenizing in memory",
              file=sys.stderr, flush=True)
        return None
    remove_stale_temps(folder)
    return folder


def _load_tokens(folder: Path, key: str) -> Optional[Tuple[np.ndarray, np.ndarray, dict]]:
    meta = read_json(folder / f"tokens-{key}.json")
    path = folder / f"tokens-{key}.bin"
    if not isinstance(meta, dict) or meta.get("version") != FORMAT_VERSION or not path.is_file():
        return None
    try:
        dtype = np.dtype(meta["dtype"])
        n_train, n_val = int(meta["n_train"]), int(meta["n_val"])
        if path.stat().st_size != (n_train + n_val) * dtype.itemsize or n_train + n_val == 0:
            return None
        mm = np.memmap(path, dtype=dtype, mode="r", shape=(n_train + n_val,))
    except (KeyError, TypeError, ValueError, OSError):
        return None
    return mm[:n_train], mm[n_train:], meta


# ----------------------------------------------------------------------------------------------
# Phases
# ----------------------------------------------------------------------------------------------

def scan_data(data: Union[str, os.PathLike, None], max_bytes: Optional[int] = None,
              progress: Optional[bool] = False) -> Manifest:
    """Phase 1: the manifest of `data` (a file, a folder, or None / "stdlib" for the default corpus)."""
    if is_stdlib(data):
        cap = DEFAULT_STDLIB_MAX_BYTES if max_bytes is None else max_bytes
        m = scan_files(stdlib_files(), DEFAULT_CORPUS_NAME, cap, progress=progress)
    else:
        m = scan(data, max_bytes=max_bytes, progress=progress)
        report_skipped(m)
    if not m.files:
        raise CorpusError(f"no text found in {m.root}")
    return m


def _training_texts(parts: Sequence[Part], bar) -> Iterator[str]:
    for part in parts:
        for seg in segments(part_text(part)):
            bar.update(len(seg.encode("utf-8")))
            yield seg
    bar.set_description("tokenizer (merges)")


def train_on_parts(parts: Sequence[Part], vocab_size: int, progress: Optional[bool] = False) -> BPETokenizer:
    """Phase 2: a byte-level BPE trained on the parts' text, streamed."""
    bar = progress_bar(sum(p.nbytes for p in parts), "tokenizer", progress)
    try:
        return train_tokenizer(_training_texts(parts, bar), vocab_size=vocab_size)
    finally:
        bar.close()


class _Sink:
    """Where the ids go: a raw file (temporary name until `commit`) or a list of arrays in memory."""

    def __init__(self, dtype: np.dtype, path: Optional[Path]):
        self.dtype, self.path = dtype, path
        self.tmp = None if path is None else path.parent / f"{TMP_PREFIX}{path.name}.{os.getpid()}"
        self.f = None if self.tmp is None else open(self.tmp, "wb")
        self.arrays: List[np.ndarray] = []
        self.n = 0

    def write(self, ids: np.ndarray) -> None:
        a = ids.astype(self.dtype)
        if self.f is not None:
            self.f.write(a.tobytes())
        else:
            self.arrays.append(a)
        self.n += int(a.size)

    def commit(self) -> Optional[np.ndarray]:
        """The file renamed into place (None returned), or the ids in memory."""
        if self.f is None:
            return np.concatenate(self.arrays) if self.arrays else np.zeros(0, dtype=self.dtype)
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        os.replace(self.tmp, self.path)
        fsync_dir(self.path.parent)
        return None

    def discard(self) -> None:
        if self.f is not None:
            self.f.close()
            try:
                self.tmp.unlink()
            except OSError:
                pass


def _encode_parts(parts: Sequence[Part], tokenizer: BPETokenizer, sink: _Sink, bar) -> str:
    """Encode the parts (documents) into `sink` in batches; returns the split's fingerprint."""
    fp = Fingerprint()
    batch: List[Tuple[str, bool]] = []
    size = 0

    def flush():
        ids = encode_segments(tokenizer, batch)
        fp.update(ids)
        sink.write(ids)

    for part in parts:
        prev = None
        for seg in segments(part_text(part)):
            if prev is not None:
                batch.append((prev, False))
                size += len(prev)
            prev = seg
            bar.update(len(seg.encode("utf-8")))
            if size >= BATCH_CHARS:
                flush()
                batch, size = [], 0
        batch.append((prev or "", True))
        size += len(prev or "")
        if size >= BATCH_CHARS:
            flush()
            batch, size = [], 0
    if batch:
        flush()
    return fp.value()


def tokenize_parts(train_parts: Sequence[Part], val_parts: Sequence[Part], tokenizer: BPETokenizer,
                   path: Optional[Path] = None, progress: Optional[bool] = False
                   ) -> Tuple[Optional[np.ndarray], int, str, str]:
    """Phase 3: (ids in memory or None when written to `path`, n_train, train fingerprint, val
    fingerprint). The file appears at `path` only when complete."""
    sink = _Sink(token_dtype(tokenizer.vocab_size), path)
    bar = progress_bar(sum(p.nbytes for p in train_parts) + sum(p.nbytes for p in val_parts), "tokenizing",
                        progress)
    try:
        train_fp = _encode_parts(train_parts, tokenizer, sink, bar)
        n_train = sink.n
        val_fp = _encode_parts(val_parts, tokenizer, sink, bar)
        ids = sink.commit()
    except BaseException:
        sink.discard()
        raise
    finally:
        bar.close()
    return ids, n_train, train_fp, val_fp


# ----------------------------------------------------------------------------------------------
# The whole preparation
# ----------------------------------------------------------------------------------------------

def _cached_tokenizer(folder: Optional[Path], key: str) -> Optional[BPETokenizer]:
    if folder is None or not (folder / f"tokenizer-{key}.json").is_file():
        return None
    try:
        return tokenizer_from_str((folder / f"tokenizer-{key}.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, TokenizerError):
        return None


def prepare_tokens(data: Union[str, os.PathLike, None], *, max_bytes: Optional[int] = None,
                   val_fraction: float = DEFAULT_VAL_FRACTION, tokenizer: Optional[BPETokenizer] = None,
                   vocab_size: int = 4096, cache_dir: Optional[Union[str, os.PathLike]] = None,
                   progress: Optional[bool] = False, write_cache: bool = True) -> PreparedTokens:
    """Read, split, (train a tokenizer,) tokenize: see the module docstring. The splits are those of
    `corpus.split_documents` and the ids those of `corpus.tokenize_documents` on the same files.
    write_cache=False only reads `cache_dir` (the other processes of a multi-process run: one writer)."""
    seconds: Dict[str, float] = {}
    t = time.perf_counter()
    manifest = scan_data(data, max_bytes, progress)
    train_parts, val_parts = split_parts(manifest, val_fraction)
    seconds["reading"] = time.perf_counter() - t
    _say(progress, f"data {manifest.root}: {_mb(manifest.nbytes)} in {len(manifest.files)} file(s)")
    folder = _cache_folder(cache_dir, create=write_cache)
    dkey = data_key(manifest, max_bytes, val_fraction)
    if tokenizer is None:
        tkey = _sha([dkey, vocab_size])[:24]
        tokenizer = _cached_tokenizer(folder, tkey)
        if tokenizer is None:
            t = time.perf_counter()
            _say(progress, f"training the tokenizer (vocab {vocab_size}) on {_mb(sum(p.nbytes for p in train_parts))}")
            tokenizer = train_on_parts(train_parts, vocab_size, progress)
            seconds["tokenizer"] = time.perf_counter() - t
            if folder is not None and write_cache:
                tokenizer.save(folder / f"tokenizer-{tkey}.json")
                _remove_others(folder, "tokenizer-", [f"tokenizer-{tkey}.json"])
    key = _sha([dkey, tokenizer_key(tokenizer)])[:24]
    if folder is not None:
        hit = _load_tokens(folder, key)
        if hit is not None:
            train, val, meta = hit
            _say(progress, f"tokens from the cache {folder / f'tokens-{key}.bin'}")
            return PreparedTokens(tokenizer, train, val, meta["train_fingerprint"], meta["val_fingerprint"], manifest,
                                  cache=folder / f"tokens-{key}.bin", reused=True,
                                  seconds=seconds)
    t = time.perf_counter()
    _say(progress, f"tokenizing {_mb(manifest.nbytes)}")
    path = None if folder is None or not write_cache else folder / f"tokens-{key}.bin"
    ids, n_train, train_fp, val_fp = tokenize_parts(train_parts, val_parts, tokenizer, path, progress)
    seconds["tokenizing"] = time.perf_counter() - t
    if ids is not None:
        return PreparedTokens(tokenizer, ids[:n_train], ids[n_train:], train_fp, val_fp, manifest,
                              seconds=seconds)
    dtype = token_dtype(tokenizer.vocab_size)
    n = path.stat().st_size // dtype.itemsize
    write_json(folder / f"tokens-{key}.json", {
        "version": FORMAT_VERSION, "dtype": dtype.name, "n_train": n_train, "n_val": n - n_train,
        "train_fingerprint": train_fp, "val_fingerprint": val_fp, "vocab_size": tokenizer.vocab_size,
        "data": manifest.root, "files": len(manifest.files), "bytes": manifest.nbytes,
        "max_bytes": max_bytes, "val_fraction": val_fraction})
    _remove_others(folder, "tokens-", [f"tokens-{key}.bin", f"tokens-{key}.json"])
    hit = _load_tokens(folder, key)
    if hit is None:
        raise CorpusError(f"the token file {path} could not be read back")
    train, val, _ = hit
    return PreparedTokens(tokenizer, train, val, train_fp, val_fp, manifest, cache=path, reused=False,
                          seconds=seconds)


__all__ = ["CACHE_DIR_NAME", "PreparedTokens", "prepare_tokens", "scan_data", "train_on_parts", "tokenize_parts",
           "data_key", "tokenizer_key"]
