"""Text corpora for language-model training: read a file or a folder, the embedded default corpus
(the Python standard library's own source), a deterministic train/validation split, and packing
into fixed-length windows whose order is a pure function of (seed, step).

The default corpus
------------------
With no data path, `load_corpus()` returns the `.py` files of the running interpreter's standard
library (`sysconfig.get_paths()["stdlib"]`), which every machine with Python has: about 16 MB
of real source in CPython 3.11. `site-packages`/`dist-packages`, `__pycache__` and the test suites
(`test/`, `tests/`, `idle_test/`) are left out. Files are taken in a fixed order (sorted by the
SHA-256 of their relative path, a stable shuffle, so a capped corpus samples the whole library
rather than its first letters) until `DEFAULT_STDLIB_MAX_BYTES` (8 MiB) of UTF-8 text; the file
that crosses the cap is cut at a line boundary. The same interpreter version always gives the
same corpus.

Reading
-------
Files are read by `sources.scan`: regular files only (a FIFO, a device or a socket, also behind a
symlink, is never opened for reading), in blocks, and never beyond `max_bytes`; binary and
non-UTF-8 files in a folder are skipped and counted in one line on stderr. The same rules, without
holding the text, feed the streaming preparation of training data (`prep.prepare_tokens`).

The split
---------
`split_documents` puts a document in validation when the SHA-256 of its name falls in the first
`val_fraction` of the hash range: it depends on the name only, so it does not move when the cap,
the file order or other files change. A corpus of one document (a single file) is split by text
instead: the last `val_fraction` of it, cut at a line boundary, is validation.

Packing
-------
Each document's tokens are followed by `<|endoftext|>` and all are concatenated into one stream.
Documents are encoded in bounded segments (`sources.segments`, cut where no token changes), the
same way here, in the tokenizer's training and in `prep`, so every path gives the same ids.
`PackedTokens` cuts the stream into non-overlapping windows of `seq_len` inputs (+1 target
token). Training visits the windows epoch by epoch, each epoch in a permutation seeded by
(seed, epoch), so the batch of any step is `get_batch(step, batch_size, seed)`: no iterator
state to save, and a resumed run sees exactly the batches the uninterrupted one would.
"""
from __future__ import annotations

import hashlib
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from .sources import (
    CorpusError,
    report_skipped,
    scan,
    scan_files,
    split_by_name,
    split_text,
    text_split_point,
    walk_files,
)

DEFAULT_STDLIB_MAX_BYTES = 8 * 1024 * 1024
DEFAULT_VAL_FRACTION = 0.05
STDLIB_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "test", "tests",
                                  "idle_test"})
DEFAULT_CORPUS_NAME = "stdlib"


@dataclass(frozen=True)
class Document:
    name: str   # a path relative to the corpus root (posix separators)
    text: str


def _cut_at_line(text: str, max_chars_bytes: int) -> str:
    """The longest prefix of whole lines of `text` whose UTF-8 size is <= max bytes (>= one char)."""
    enc = text.encode("utf-8")[:max_chars_bytes]
    cut = enc.decode("utf-8", errors="ignore")
    nl = cut.rfind("\n")
    return cut[: nl + 1] if nl >= 0 else cut


def cap_documents(docs: Sequence[Document], max_bytes: Optional[int]) -> List[Document]:
    """The longest prefix of `docs` within `max_bytes` of UTF-8 (the crossing one cut at a line); all of
    them when max_bytes is None."""
    if max_bytes is None:
        return list(docs)
    if max_bytes <= 0:
        raise CorpusError(f"max_bytes must be positive, got {max_bytes}")
    out, total = [], 0
    for d in docs:
        n = len(d.text.encode("utf-8"))
        if total + n <= max_bytes:
            out.append(d)
            total += n
            continue
        rest = _cut_at_line(d.text, max_bytes - total)
        if rest:
            out.append(Document(d.name, rest))
        break
    return out


def read_documents(path: Union[str, os.PathLike], max_bytes: Optional[int] = None,
                   extensions: Optional[Sequence[str]] = None, progress: Optional[bool] = False) -> List[Document]:
    """The documents of a text file (one document) or of a folder (every UTF-8 text file under
    it, recursively, sorted by relative path; hidden files skipped).

    `extensions` (e.g. [".txt", ".md"]) keeps only files with those suffixes; `max_bytes` caps the
    total size (the crossing document is cut at a line boundary) and nothing beyond the cap is
    read. Only regular files are read: FIFOs, devices and sockets (also behind symlinks), binary
    and non-UTF-8 files in a folder are skipped and counted in one line on stderr. Raises
    CorpusError when the path does not exist or holds no text, or when a file given directly is not
    a regular UTF-8 text file.
    """
    m = scan(path, max_bytes=max_bytes, extensions=extensions, keep_text=True, progress=progress)
    report_skipped(m)
    if not m.files:
        exts = None if extensions is None else sorted({e if e.startswith(".") else "." + e for e in extensions})
        raise CorpusError(f"no text found in {Path(path)}" + (f" (extensions {exts})" if exts else ""))
    return [Document(f.name, t) for f, t in zip(m.files, m.texts)]


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files() -> List[Tuple[Path, str]]:
    """(path, name) of the default corpus's files, in its fixed order (see the module docstring)."""
    root = stdlib_root()
    if not root.is_dir():
        raise CorpusError(f"the standard library folder {root} does not exist")
    files = [f for f in walk_files(root, STDLIB_EXCLUDED_DIRS) if f.suffix == ".py"]
    names = [(f.relative_to(root).as_posix(), f) for f in files]
    names.sort(key=lambda nf: (hashlib.sha256(nf[0].encode("utf-8")).hexdigest(), nf[0]))
    return [(f, n) for n, f in names]


def stdlib_documents(max_bytes: Optional[int] = DEFAULT_STDLIB_MAX_BYTES) -> List[Document]:
    """The embedded default corpus: the standard library's `.py` sources (see the module docstring)."""
    m = scan_files(stdlib_files(), DEFAULT_CORPUS_NAME, max_bytes, keep_text=True)
    if not m.files:
        raise CorpusError(f"no Python sources found under {stdlib_root()}")
    return [Document(f.name, t) for f, t in zip(m.files, m.texts)]


def is_stdlib(path: Union[str, os.PathLike, None]) -> bool:
    """Whether `path` names the default corpus (None, or "stdlib" when no such file exists)."""
    return path is None or (str(path) == DEFAULT_CORPUS_NAME and not Path(str(path)).exists())


def load_corpus(path: Union[str, os.PathLike, None] = None, max_bytes: Optional[int] = None) -> List[Document]:
    """`read_documents(path)`, or the standard-library corpus when `path` is None or "stdlib"
    (capped at `max_bytes`, default DEFAULT_STDLIB_MAX_BYTES)."""
    if is_stdlib(path):
        return stdlib_documents(DEFAULT_STDLIB_MAX_BYTES if max_bytes is None else max_bytes)
    return read_documents(path, max_bytes=max_bytes)


def split_documents(docs: Sequence[Document], val_fraction: float = DEFAULT_VAL_FRACTION
                    ) -> Tuple[List[Document], List[Document]]:
    """(train, validation), deterministic (see the module docstring). Both are non-empty when
    `0 < val_fraction < 1`; `val_fraction == 0` gives an empty validation set."""
    if not 0.0 <= val_fraction < 1.0:
        raise CorpusError(f"val_fraction must be in [0, 1), got {val_fraction}")
    docs = list(docs)
    if not docs:
        raise CorpusError("no documents to split")
    if val_fraction == 0.0:
        return docs, []
    if len(docs) == 1:
        d = docs[0]
        cut = text_split_point(d.text, val_fraction)
        return [Document(d.name, d.text[:cut])], [Document(d.name + "#val", d.text[cut:])]
    in_val = split_by_name([d.name for d in docs], val_fraction)
    train = [d for d, v in zip(docs, in_val) if not v]
    val = [d for d, v in zip(docs, in_val) if v]
    return train, val


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype that holds every id of a vocabulary (uint16 up to 65536 ids)."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def encode_segments(tokenizer, items: Sequence[Tuple[str, bool]]) -> np.ndarray:
    """int32 ids of `items` ((segment, last segment of its document) pairs) encoded as one batch,
    with `eos_id` after the last segment of each document."""
    ids = tokenizer.encode_batch([t for t, _ in items]) if items else []
    flat: List[int] = []
    eos = tokenizer.eos_id
    for seq, (_, last) in zip(ids, items):
        flat.extend(seq)
        if last:
            flat.append(eos)
    return np.asarray(flat, dtype=np.int32)


def tokenize_documents(docs: Sequence[Document], tokenizer, batch_chars: int = 1 << 20) -> torch.Tensor:
    """One int32 stream: each document's tokens followed by the tokenizer's `eos_id`.

    Documents are encoded in segments (`sources.segments`), batches of about `batch_chars`
    characters at a time, so memory stays bounded by the output and a Ctrl-C acts between batches."""
    parts: List[np.ndarray] = []
    batch: List[Tuple[str, bool]] = []
    size = 0
    for d in docs:
        segs = split_text(d.text) or [""]
        for j, seg in enumerate(segs):
            batch.append((seg, j == len(segs) - 1))
            size += len(seg)
            if size >= batch_chars:
                parts.append(encode_segments(tokenizer, batch))
                batch, size = [], 0
    if batch:
        parts.append(encode_segments(tokenizer, batch))
    if not parts:
        return torch.zeros(0, dtype=torch.int32)
    return torch.from_numpy(np.concatenate(parts) if len(parts) > 1 else parts[0])


class Fingerprint:
    """`token_fingerprint` of a stream fed in pieces."""

    def __init__(self):
        self._h = hashlib.sha256()
        self.n = 0

    def update(self, ids: np.ndarray) -> None:
        a = np.ascontiguousarray(ids, dtype="<i4")
        self._h.update(a.tobytes())
        self.n += int(a.size)

    def value(self) -> str:
        return f"{self.n}:{self._h.hexdigest()[:16]}"


def token_fingerprint(tokens: Union[torch.Tensor, np.ndarray], chunk: int = 1 << 22) -> str:
    """A short SHA-256 of a token stream (detects a resume on different data or tokenizer); a tensor
    or a numpy array (e.g. a memory-mapped token file, hashed a chunk at a time)."""
    if isinstance(tokens, torch.Tensor):
        tokens = tokens.to(torch.int32).contiguous().numpy()
    fp = Fingerprint()
    for i in range(0, len(tokens), chunk):
        fp.update(tokens[i:i + chunk])
    return fp.value()


class PackedTokens:
    """A token stream cut into non-overlapping windows of `seq_len` inputs plus one target token.

    `tokens` is a 1-D tensor or a 1-D numpy array of integer ids; a numpy array (e.g. a read-only
    `np.memmap` of a token file, `prep.prepare_tokens`) is kept as it is, and only the windows a batch
    needs are read and converted.

    get_batch(step, batch_size, seed)   the training batch of a step (pure function, see module doc)
    windows(indices)                    int64 rows [len(indices), seq_len + 1] of the given windows
    eval_batches(batch_size, max_batches)  the windows in order, for a deterministic validation loss
    """

    def __init__(self, tokens: Union[torch.Tensor, np.ndarray], seq_len: int, name: str = "data"):
        if tokens.ndim != 1:
            raise CorpusError(f"tokens must be 1-D, got shape {tuple(tokens.shape)}")
        if seq_len < 1:
            raise CorpusError(f"seq_len must be >= 1, got {seq_len}")
        if isinstance(tokens, np.ndarray):
            if tokens.dtype.kind not in "iu":
                raise CorpusError(f"tokens must be integer ids, got dtype {tokens.dtype}")
            self.tokens = tokens
        else:
            self.tokens = tokens.to(torch.int32).contiguous()
        self.seq_len = int(seq_len)
        self.name = name
        self._perm_epoch = -1
        self._perm: Optional[torch.Tensor] = None

    def __len__(self) -> int:
        return self.n_windows

    @property
    def n_tokens(self) -> int:
        return int(len(self.tokens))

    @property
    def n_windows(self) -> int:
        return max(0, (self.n_tokens - 1) // self.seq_len)

    def check_trainable(self) -> None:
        if self.n_windows < 1:
            raise CorpusError(f"{self.name} has {self.n_tokens} tokens, fewer than seq_len + 1 = "
                              f"{self.seq_len + 1}; use more data or a smaller --seq-len")

    def _rows(self, indices: Sequence[int], L: int) -> torch.Tensor:
        """int64 [len(indices), L + 1]: window i is tokens[i * L : i * L + L + 1]."""
        if isinstance(self.tokens, np.ndarray):
            rows = np.stack([self.tokens[i * L:i * L + L + 1] for i in indices]).astype(np.int64)
            return torch.from_numpy(rows)
        return torch.stack([self.tokens[i * L:i * L + L + 1] for i in indices]).long()

    def windows(self, indices: Sequence[int]) -> torch.Tensor:
        """The training windows `indices` as int64 rows of seq_len + 1 tokens."""
        return self._rows(indices, self.seq_len)

    def _epoch_perm(self, seed: int, epoch: int) -> torch.Tensor:
        if self._perm_epoch != epoch or self._perm_seed != seed:
            g = torch.Generator().manual_seed((int(seed) * 1_000_003 + int(epoch) * 7919 + 12345) % (2 ** 63))
            self._perm = torch.randperm(self.n_windows, generator=g)
            self._perm_epoch, self._perm_seed = epoch, seed
        return self._perm

    _perm_seed = None

    def batch_indices(self, step: int, batch_size: int, seed: int) -> List[int]:
        """Window indices of training step `step` (0-based)."""
        self.check_trainable()
        n = self.n_windows
        out = []
        for j in range(step * batch_size, (step + 1) * batch_size):
            epoch, pos = divmod(j, n)
            out.append(int(self._epoch_perm(seed, epoch)[pos]))
        return out

    def get_batch(self, step: int, batch_size: int, seed: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), int64 `[batch_size, seq_len]` each."""
        rows = self.windows(self.batch_indices(step, batch_size, seed))
        return rows[:, :-1], rows[:, 1:]

    def eval_batches(self, batch_size: int, max_batches: Optional[int] = None
                     ) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
        """The windows in stream order, `batch_size` at a time (the last batch may be smaller).
        A stream shorter than one window gives a single shorter window."""
        if self.n_tokens < 2:
            raise CorpusError(f"{self.name} has {self.n_tokens} tokens; evaluation needs at least 2")
        L = self.seq_len if self.n_windows >= 1 else self.n_tokens - 1
        n = max(1, (self.n_tokens - 1) // L)
        nb = 0
        for b in range(0, n, batch_size):
            if max_batches is not None and nb >= max_batches:
                return
            rows = self._rows(range(b, min(n, b + batch_size)), L)
            yield rows[:, :-1], rows[:, 1:]
            nb += 1
