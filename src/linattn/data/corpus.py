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

The split
---------
`split_documents` puts a document in validation when the SHA-256 of its name falls in the first
`val_fraction` of the hash range: it depends on the name only, so it does not move when the cap,
the file order or other files change. A corpus of one document (a single file) is split by text
instead: the last `val_fraction` of it, cut at a line boundary, is validation.

Packing
-------
Each document's tokens are followed by `<|endoftext|>` and all are concatenated into one stream.
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

import torch

from ..errors import DataError

DEFAULT_STDLIB_MAX_BYTES = 8 * 1024 * 1024
DEFAULT_VAL_FRACTION = 0.05
STDLIB_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "test", "tests",
                                  "idle_test"})
DEFAULT_CORPUS_NAME = "stdlib"


class CorpusError(DataError):
    """Data that cannot be used: a missing path, no readable text, too few tokens."""


@dataclass(frozen=True)
class Document:
    name: str   # a path relative to the corpus root (posix separators)
    text: str


def _hash01(name: str, salt: str = "") -> float:
    h = hashlib.sha256((salt + name).encode("utf-8")).digest()
    return int.from_bytes(h[:8], "big") / 2.0 ** 64


def _read_text(path: Path) -> Optional[str]:
    """The file's text if it is UTF-8 text (no NUL bytes), else None."""
    try:
        raw = path.read_bytes()
    except OSError:
        return None
    if b"\x00" in raw[:8192]:
        return None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return None


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


def _walk_files(root: Path, excluded_dirs=frozenset()) -> List[Path]:
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d not in excluded_dirs]
        for f in filenames:
            if not f.startswith("."):
                files.append(Path(dirpath) / f)
    return files


def read_documents(path: Union[str, os.PathLike], max_bytes: Optional[int] = None,
                   extensions: Optional[Sequence[str]] = None) -> List[Document]:
    """The documents of a text file (one document) or of a folder (every UTF-8 text file under
    it, recursively, sorted by relative path; hidden files, binary and non-UTF-8 files skipped).

    `extensions` (e.g. [".txt", ".md"]) keeps only files with those suffixes; `max_bytes` caps the
    total size (the crossing document is cut at a line boundary). Raises CorpusError when the
    path does not exist or holds no text.
    """
    p = Path(path)
    if not p.exists():
        raise CorpusError(f"data path not found: {p}")
    exts = None if extensions is None else {e if e.startswith(".") else "." + e for e in extensions}
    if p.is_file():
        text = _read_text(p)
        if text is None:
            raise CorpusError(f"data file is not UTF-8 text or cannot be read: {p}")
        docs = [Document(p.name, text)]
    elif p.is_dir():
        docs = []
        for f in sorted(_walk_files(p), key=lambda f: f.relative_to(p).as_posix()):
            if exts is not None and f.suffix not in exts:
                continue
            text = _read_text(f)
            if text is not None and text.strip():
                docs.append(Document(f.relative_to(p).as_posix(), text))
    else:
        raise CorpusError(f"data path is neither a file nor a folder: {p}")
    docs = [d for d in cap_documents(docs, max_bytes) if d.text.strip()]
    if not docs:
        raise CorpusError(f"no text found in {p}" + (f" (extensions {sorted(exts)})" if exts else ""))
    return docs


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_documents(max_bytes: Optional[int] = DEFAULT_STDLIB_MAX_BYTES) -> List[Document]:
    """The embedded default corpus: the standard library's `.py` sources (see the module docstring)."""
    root = stdlib_root()
    if not root.is_dir():
        raise CorpusError(f"the standard library folder {root} does not exist")
    files = [f for f in _walk_files(root, STDLIB_EXCLUDED_DIRS) if f.suffix == ".py"]
    names = [(f.relative_to(root).as_posix(), f) for f in files]
    names.sort(key=lambda nf: (hashlib.sha256(nf[0].encode("utf-8")).hexdigest(), nf[0]))
    docs = []
    for name, f in names:
        text = _read_text(f)
        if text is not None and text.strip():
            docs.append(Document(name, text))
    docs = cap_documents(docs, max_bytes)
    if not docs:
        raise CorpusError(f"no Python sources found under {root}")
    return docs


def load_corpus(path: Union[str, os.PathLike, None] = None, max_bytes: Optional[int] = None) -> List[Document]:
    """`read_documents(path)`, or the standard-library corpus when `path` is None or "stdlib"
    (capped at `max_bytes`, default DEFAULT_STDLIB_MAX_BYTES)."""
    if path is None or (str(path) == DEFAULT_CORPUS_NAME and not Path(str(path)).exists()):
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
        cut = int(len(d.text) * (1.0 - val_fraction))
        nl = d.text.rfind("\n", 0, cut)
        if nl > 0 and d.text[nl + 1:].strip():
            cut = nl + 1
        cut = max(1, min(cut, len(d.text) - 1))
        return [Document(d.name, d.text[:cut])], [Document(d.name + "#val", d.text[cut:])]
    scores = [_hash01(d.name, "val:") for d in docs]
    val_idx = {i for i, s in enumerate(scores) if s < val_fraction}
    if not val_idx:
        val_idx = {min(range(len(docs)), key=lambda i: scores[i])}
    if len(val_idx) == len(docs):
        val_idx.discard(max(range(len(docs)), key=lambda i: scores[i]))
    train = [d for i, d in enumerate(docs) if i not in val_idx]
    val = [d for i, d in enumerate(docs) if i in val_idx]
    return train, val


def tokenize_documents(docs: Sequence[Document], tokenizer, batch_docs: int = 256) -> torch.Tensor:
    """One int32 stream: each document's tokens followed by the tokenizer's `eos_id`."""
    parts: List[torch.Tensor] = []
    eos = torch.tensor([tokenizer.eos_id], dtype=torch.int32)
    for i in range(0, len(docs), batch_docs):
        chunk = docs[i:i + batch_docs]
        for ids in tokenizer.encode_batch([d.text for d in chunk]):
            parts.append(torch.tensor(ids, dtype=torch.int32))
            parts.append(eos)
    if not parts:
        return torch.zeros(0, dtype=torch.int32)
    return torch.cat(parts)


def token_fingerprint(tokens: torch.Tensor) -> str:
    """A short SHA-256 of a token stream (detects a resume on different data or tokenizer)."""
    t = tokens.to(torch.int32).contiguous()
    h = hashlib.sha256(t.numpy().tobytes()).hexdigest()
    return f"{t.numel()}:{h[:16]}"


class PackedTokens:
    """A token stream cut into non-overlapping windows of `seq_len` inputs plus one target token.

    get_batch(step, batch_size, seed)   the training batch of a step (pure function, see module doc)
    eval_batches(batch_size, max_batches)  the windows in order, for a deterministic validation loss
    """

    def __init__(self, tokens: torch.Tensor, seq_len: int, name: str = "data"):
        if tokens.dim() != 1:
            raise CorpusError(f"tokens must be 1-D, got shape {tuple(tokens.shape)}")
        if seq_len < 1:
            raise CorpusError(f"seq_len must be >= 1, got {seq_len}")
        self.tokens = tokens.to(torch.int32).contiguous()
        self.seq_len = int(seq_len)
        self.name = name
        self._perm_epoch = -1
        self._perm: Optional[torch.Tensor] = None

    def __len__(self) -> int:
        return self.n_windows

    @property
    def n_tokens(self) -> int:
        return int(self.tokens.numel())

    @property
    def n_windows(self) -> int:
        return max(0, (self.n_tokens - 1) // self.seq_len)

    def check_trainable(self) -> None:
        if self.n_windows < 1:
            raise CorpusError(f"{self.name} has {self.n_tokens} tokens, fewer than seq_len + 1 = "
                              f"{self.seq_len + 1}; use more data or a smaller --seq-len")

    def _window(self, i: int, seq_len: Optional[int] = None) -> torch.Tensor:
        L = self.seq_len if seq_len is None else seq_len
        s = i * L
        return self.tokens[s:s + L + 1]

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
        rows = torch.stack([self._window(i) for i in self.batch_indices(step, batch_size, seed)]).long()
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
            rows = torch.stack([self._window(i, L) for i in range(b, min(n, b + batch_size))]).long()
            yield rows[:, :-1], rows[:, 1:]
            nb += 1
