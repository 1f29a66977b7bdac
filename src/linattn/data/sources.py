"""The files of a corpus, read in bounded blocks: which files (regular files only, the skipped ones
counted with a reason), how much of each (the byte cap is applied while reading, so a capped
corpus never reads more than the cap), the train/validation split, and the canonical cutting of a
document's text into bounded segments for the tokenizer.

Scanning
--------
`scan(path, max_bytes)` opens every candidate file (a file given directly, or every non-hidden
file under a folder, sorted by relative path) without blocking (`O_NONBLOCK`, then `fstat`: a FIFO,
a device or a socket is never read), reads it in blocks of `READ_BLOCK` bytes through an
incremental UTF-8 decoder, and keeps it when it is UTF-8 text without NUL bytes in its first 8 KiB
and not blank. It stops at the cap: the file that crosses it is read only up to the cap and cut
after its last newline (the rules of `corpus.cap_documents`). The result, a `Manifest`, holds for
every file its size, mtime and the number of bytes and characters used (no text unless asked for),
and the skipped files with their reasons (`skipped_summary` makes one line of them). A file given
directly that is not a regular file or not UTF-8 text is a `CorpusError` naming it.

Segments
--------
The tokenizer never sees a whole document: `segments()` cuts a document's text into pieces of at
most `SEGMENT_CHARS` characters, preferably at a *safe boundary*, a position where the byte-level
BPE's pre-tokenizer always starts a new piece whatever surrounds it: a non-space character followed
by one of " \\t\\n\\r", or a single "\\t"/"\\n"/"\\r" between two non-space characters. Cutting there
changes no token, so the tokens of a document are those of its whole text. Only a stretch of more
than `SEGMENT_CHARS` characters without a safe boundary (e.g. one long line without spaces) is cut
at exactly `SEGMENT_CHARS`. The cuts depend on the text alone (never on how it was read), so
training the tokenizer, tokenizing in memory (`corpus.tokenize_documents`) and tokenizing a stream
(`prep`) all see the same segments.
"""
from __future__ import annotations

import codecs
import errno
import hashlib
import os
import re
import stat
import sys
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

from ..errors import DataError

READ_BLOCK = 1 << 20          # bytes per read
SEGMENT_CHARS = 1 << 16       # the longest segment handed to the tokenizer
MARK_EVERY = 1 << 22          # a (char, byte) offset pair is recorded every this many bytes of a file
BINARY_SNIFF = 8192           # NUL bytes in the first this many bytes: a binary file

PathLike = Union[str, os.PathLike]


class CorpusError(DataError):
    """Data that cannot be used: a missing path, no readable text, too few tokens."""


@dataclass(frozen=True)
class SourceFile:
    """One document of a corpus: the first `nbytes` bytes (`nchars` characters) of a file."""
    path: str                     # the file that is opened
    name: str                     # the document's name: the path relative to the corpus root (posix)
    nbytes: int                   # bytes used: all of the file, or the prefix within the cap
    nchars: int
    size: int                     # the file's size and modification time when it was scanned
    mtime_ns: int
    marks: Tuple[Tuple[int, int], ...] = ()   # (char offset, byte offset) pairs along the file

    def identity(self) -> list:
        return [self.name, self.path, self.nbytes, self.size, self.mtime_ns]


@dataclass(frozen=True)
class Part:
    """Bytes [start, end) of a source: a document of the train or validation split."""
    source: SourceFile
    start: int
    end: int
    name: str

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass
class Manifest:
    root: str                                   # the data path, or "stdlib"
    files: List[SourceFile]
    skipped: List[Tuple[str, str]] = field(default_factory=list)   # (name, reason)
    texts: Optional[List[str]] = None           # the files' texts, when scanned with keep_text

    @property
    def nbytes(self) -> int:
        return sum(f.nbytes for f in self.files)


# ----------------------------------------------------------------------------------------------
# Opening files safely
# ----------------------------------------------------------------------------------------------

def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "fifo"), (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"),
                       (stat.S_ISSOCK, "socket"), (stat.S_ISDIR, "folder")):
        if test(mode):
            return name
    return "special file"


class _Skip(CorpusError):
    """A file that is not read, with the reason (internal: it never leaves a scan)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def _open_regular(path: PathLike):
    """(binary file object, os.stat_result) of a regular file (symlinks followed); raises _Skip with
    the reason otherwise. Never blocks: a FIFO is opened with O_NONBLOCK and closed unread."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise _Skip(f"unreadable ({e.strerror or e})") from None
    if not stat.S_ISREG(st.st_mode):
        raise _Skip(f"not a regular file ({_kind(st.st_mode)})")
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)
    try:
        fd = os.open(path, flags)
    except OSError as e:
        raise _Skip(f"unreadable ({e.strerror or e})") from None
    try:
        st = os.fstat(fd)             # what was opened, not what was stat'ed a moment ago
        if not stat.S_ISREG(st.st_mode):
            raise _Skip(f"not a regular file ({_kind(st.st_mode)})")
        return os.fdopen(fd, "rb", buffering=0), st
    except BaseException:
        os.close(fd)
        raise


def missing_data_error(path: PathLike) -> CorpusError:
    """The error for a data path that cannot be reached, saying why: a symbolic link loop, a link to
    nothing, no permission, or not found (Path.exists() is False for all of them)."""
    p = Path(path)
    try:
        os.stat(p)
    except OSError as e:
        if e.errno == errno.ELOOP:
            return CorpusError(f"data path is a symbolic link loop (following its links never reaches a file or "
                               f"folder): {p}")
        if os.path.islink(p):
            return CorpusError(f"data path is a symbolic link to {os.readlink(p)}, which does not exist: {p}")
        if e.errno in (errno.EACCES, errno.EPERM):
            return CorpusError(f"data path cannot be reached ({e.strerror}): {p}")
    return CorpusError(f"data path not found: {p}")


# ----------------------------------------------------------------------------------------------
# Scanning
# ----------------------------------------------------------------------------------------------

_NONSPACE = re.compile(r"\S")


def _scan_file(path: Path, name: str, want: Optional[int], keep_text: bool, bar=None):
    """(SourceFile or None for a blank file, text or None, capped) for one file; `want` is the room
    left under the cap (None: no cap). Raises _Skip for a file that is not UTF-8 text."""
    f, st = _open_regular(path)
    with f:
        size = st.st_size
        capped = want is not None and size > want
        limit = want if capped else size
        dec = codecs.getincrementaldecoder("utf-8")()
        nread = nchars = 0
        parts: List[str] = []
        first_text: Optional[int] = None          # char offset of the first non-space character
        last_nl: Optional[Tuple[int, int]] = None  # (char, byte) offsets just after the last newline
        marks: List[Tuple[int, int]] = []
        next_mark = MARK_EVERY
        while nread < limit:
            try:
                block = f.read(min(READ_BLOCK, limit - nread) if nread else max(min(READ_BLOCK, limit), BINARY_SNIFF))
            except OSError as e:
                raise _Skip(f"unreadable ({e.strerror or e})") from None
            if not block:
                limit = nread                     # the file shrank since the stat
                break
            if nread == 0:
                if b"\x00" in block[:BINARY_SNIFF]:
                    raise _Skip("binary (NUL bytes)")
                block = block[:limit]
            nread += len(block)
            try:
                s = dec.decode(block, final=not capped and nread >= limit)
            except UnicodeDecodeError:
                raise _Skip("not UTF-8 text") from None
            if bar is not None:
                bar.update(len(block))
            if first_text is None:
                m = _NONSPACE.search(s)
                if m is not None:
                    first_text = nchars + m.start()
            if capped:
                i = s.rfind("\n")
                if i >= 0:
                    last_nl = (nchars + i + 1, nread - len(block) + block.rfind(b"\n") + 1)
            nchars += len(s)
            if keep_text:
                parts.append(s)
            if nread >= next_mark:
                marks.append((nchars, nread - len(dec.getstate()[0])))
                next_mark += MARK_EVERY
        if not capped:
            try:
                dec.decode(b"", final=True)
            except UnicodeDecodeError:
                raise _Skip("not UTF-8 text") from None
        used_chars, used_bytes = nchars, nread - len(dec.getstate()[0])
        if capped and last_nl is not None:
            used_chars, used_bytes = last_nl
        if first_text is None or first_text >= used_chars:
            return None, None, capped
        text = None
        if keep_text:
            text = "".join(parts)
            if len(text) != used_chars:
                text = text[:used_chars]
        src = SourceFile(path=str(path), name=name, nbytes=used_bytes, nchars=used_chars, size=size,
                         mtime_ns=st.st_mtime_ns, marks=tuple(m for m in marks if m[1] <= used_bytes))
        return src, text, capped


def walk_files(root: Path, excluded_dirs=frozenset()) -> List[Path]:
    """Every non-hidden file name under `root` (symlinked folders are not entered)."""
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d not in excluded_dirs]
        for f in filenames:
            if not f.startswith("."):
                files.append(Path(dirpath) / f)
    return files


def _file_sizes(paths: Sequence[Path]) -> int:
    total = 0
    for p in paths:
        try:
            st = os.stat(p)
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode):
            total += st.st_size
    return total


def progress_bar(total: int, desc: str, progress: Optional[bool]):
    """A tqdm bar in bytes on stderr: shown when `progress` is True, or None and stderr is a terminal."""
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, dynamic_ncols=True,
                disable=None if progress is None else not progress, leave=False, file=sys.stderr)


def scan_files(candidates: Sequence[Tuple[Path, str]], root: str, max_bytes: Optional[int] = None,
               keep_text: bool = False, progress: Optional[bool] = False) -> Manifest:
    """The manifest of `candidates` ((path, name) pairs, in corpus order) under the byte cap."""
    if max_bytes is not None and max_bytes <= 0:
        raise CorpusError(f"max_bytes must be positive, got {max_bytes}")
    files: List[SourceFile] = []
    texts: List[str] = []
    skipped: List[Tuple[str, str]] = []
    total = 0
    size = _file_sizes([p for p, _ in candidates])
    bar = progress_bar(min(size, max_bytes) if max_bytes is not None else size, "reading", progress)
    try:
        for path, name in candidates:
            want = None if max_bytes is None else max_bytes - total
            try:
                src, text, capped = _scan_file(path, name, want, keep_text, bar)
            except _Skip as e:
                skipped.append((name, e.reason))
                continue
            if src is not None:
                files.append(src)
                total += src.nbytes
                if keep_text:
                    texts.append(text)
            if capped:
                break
    finally:
        bar.close()
    return Manifest(root=root, files=files, skipped=skipped, texts=texts if keep_text else None)


def scan(path: PathLike, max_bytes: Optional[int] = None, extensions: Optional[Sequence[str]] = None,
         keep_text: bool = False, progress: Optional[bool] = False) -> Manifest:
    """The manifest of a text file (one document) or of a folder (its non-hidden files, recursively,
    sorted by relative path; with `extensions` only those suffixes). Raises CorpusError when the
    path does not exist, is neither a regular file nor a folder, or (a file given directly) is not
    UTF-8 text."""
    p = Path(path)
    if not p.exists():
        raise missing_data_error(p)
    if p.is_dir():
        exts = None if extensions is None else {e if e.startswith(".") else "." + e for e in extensions}
        files = sorted(((f, f.relative_to(p).as_posix()) for f in walk_files(p)), key=lambda fn: fn[1])
        if exts is not None:
            files = [(f, n) for f, n in files if f.suffix in exts]
        return scan_files(files, str(p), max_bytes, keep_text, progress)
    try:
        _open_regular(p)[0].close()
    except _Skip as e:
        raise CorpusError(f"data path is {e.reason}: {p}") from None
    m = scan_files([(p, p.name)], str(p), max_bytes, keep_text, progress)
    if m.skipped:
        raise CorpusError(f"data file is {m.skipped[0][1]}: {p}")
    return m


_REASON_GROUPS = ("not a regular file", "binary", "not UTF-8 text", "unreadable")


def skipped_summary(skipped: Sequence[Tuple[str, str]], where: str = "", examples: int = 3) -> Optional[str]:
    """One line on the skipped files, e.g. "skipped 3 files in d: 1 not a regular file (fifo: x),
    2 not UTF-8 text (a.bin, b.dat)"; None when nothing was skipped."""
    if not skipped:
        return None
    groups: "OrderedDict[str, List[Tuple[str, str]]]" = OrderedDict()
    for name, reason in skipped:
        key = next((g for g in _REASON_GROUPS if reason.startswith(g)), reason)
        groups.setdefault(key, []).append((name, reason))
    parts = []
    for key, items in groups.items():
        shown = []
        for name, reason in items[:examples]:
            detail = reason[len(key):].strip().strip("()")
            shown.append(f"{name}: {detail}" if detail else name)
        more = f", +{len(items) - examples} more" if len(items) > examples else ""
        parts.append(f"{len(items)} {key} ({', '.join(shown)}{more})")
    n = len(skipped)
    return f"skipped {n} file{'s' if n != 1 else ''}" + (f" in {where}" if where else "") + ": " + "; ".join(parts)


def report_skipped(manifest: Manifest, print_fn: Optional[Callable[[str], None]] = None) -> Optional[str]:
    """Print the skipped-files line on stderr (or through `print_fn`); return it."""
    line = skipped_summary(manifest.skipped, manifest.root)
    if line is not None:
        if print_fn is None:
            print(f"[linattn] {line}", file=sys.stderr, flush=True)
        else:
            print_fn(line)
    return line


# ----------------------------------------------------------------------------------------------
# Reading text back
# ----------------------------------------------------------------------------------------------

def iter_text(src: SourceFile, start: int = 0, end: Optional[int] = None,
              block: int = READ_BLOCK) -> Iterator[Tuple[int, str]]:
    """(byte offset, text) blocks of bytes [start, end) of `src` (both at character boundaries)."""
    end = src.nbytes if end is None else end
    try:
        f, _ = _open_regular(src.path)
    except _Skip as e:
        raise CorpusError(f"{src.path} changed while the data was prepared: now {e.reason}") from None
    dec = codecs.getincrementaldecoder("utf-8")()
    with f:
        f.seek(start)
        pos = off = start
        while pos < end:
            b = f.read(min(block, end - pos))
            if not b:
                raise CorpusError(f"{src.path} changed while the data was prepared (shorter than when it was read)")
            pos += len(b)
            try:
                s = dec.decode(b, final=pos >= end)
            except UnicodeDecodeError:
                raise CorpusError(f"{src.path} changed while the data was prepared (no longer UTF-8 text)") from None
            if s:
                yield off, s
            off = pos - len(dec.getstate()[0])


def part_text(part: Part, block: int = READ_BLOCK) -> Iterator[str]:
    for _, s in iter_text(part.source, part.start, part.end, block):
        yield s


def _mark_before(src: SourceFile, char: int) -> Tuple[int, int]:
    best = (0, 0)
    for m in src.marks:
        if m[0] <= char:
            best = m
    return best


def _byte_of(src: SourceFile, char: int) -> int:
    """The byte offset of character `char` of `src`."""
    c, b = _mark_before(src, char)
    if c == char:
        return b
    for off, s in iter_text(src, b):
        if c + len(s) >= char:
            return off + len(s[:char - c].encode("utf-8"))
        c += len(s)
    return src.nbytes


def _last_newline_before(src: SourceFile, char: int) -> Optional[int]:
    """The char offset of the last "\\n" before character `char` (text.rfind("\\n", 0, char)), or None."""
    bounds = sorted({0, *(m[0] for m in src.marks if m[0] < char)})
    for lo in reversed(bounds):           # scan back one stretch between marks at a time
        hi = min(char, next((b for b in bounds if b > lo), char))
        c, found = lo, None
        for _, s in iter_text(src, _byte_of(src, lo), _byte_of(src, hi)):
            i = s.rfind("\n")
            if i >= 0:
                found = c + i
            c += len(s)
        if found is not None:
            return found
    return None


def _text_after(src: SourceFile, char: int) -> bool:
    """Whether `src` has a non-space character at a char offset >= `char`."""
    for _, s in iter_text(src, _byte_of(src, char)):
        if _NONSPACE.search(s):
            return True
    return False


def _hash01(name: str, salt: str = "") -> float:
    h = hashlib.sha256((salt + name).encode("utf-8")).digest()
    return int.from_bytes(h[:8], "big") / 2.0 ** 64


def split_by_name(names: Sequence[str], val_fraction: float) -> List[bool]:
    """For each document name, whether it goes to validation (the rule of `corpus.split_documents`
    for several documents)."""
    scores = [_hash01(n, "val:") for n in names]
    val_idx = {i for i, s in enumerate(scores) if s < val_fraction}
    if not val_idx:
        val_idx = {min(range(len(names)), key=lambda i: scores[i])}
    if len(val_idx) == len(names):
        val_idx.discard(max(range(len(names)), key=lambda i: scores[i]))
    return [i in val_idx for i in range(len(names))]


def text_split_point(text: str, val_fraction: float) -> int:
    """Where a single document is cut into train / validation (char offset; see `corpus`)."""
    cut = int(len(text) * (1.0 - val_fraction))
    nl = text.rfind("\n", 0, cut)
    if nl > 0 and text[nl + 1:].strip():
        cut = nl + 1
    return max(1, min(cut, len(text) - 1))


def _source_split_point(src: SourceFile, val_fraction: float) -> int:
    """`text_split_point` of a source's text, as a byte offset, reading only around the cut."""
    cut = int(src.nchars * (1.0 - val_fraction))
    nl = _last_newline_before(src, cut)
    if nl is not None and nl > 0 and _text_after(src, nl + 1):
        cut = nl + 1
    cut = max(1, min(cut, src.nchars - 1))
    return _byte_of(src, cut)


def split_parts(manifest: Manifest, val_fraction: float) -> Tuple[List[Part], List[Part]]:
    """(train parts, validation parts): `corpus.split_documents` on a manifest, without its text."""
    if not 0.0 <= val_fraction < 1.0:
        raise CorpusError(f"val_fraction must be in [0, 1), got {val_fraction}")
    files = manifest.files
    if not files:
        raise CorpusError("no documents to split")
    whole = [Part(f, 0, f.nbytes, f.name) for f in files]
    if val_fraction == 0.0:
        return whole, []
    if len(files) == 1:
        f = files[0]
        if f.nchars < 2:
            cut = f.nbytes
        else:
            cut = _source_split_point(f, val_fraction)
        return [Part(f, 0, cut, f.name)], [Part(f, cut, f.nbytes, f.name + "#val")]
    in_val = split_by_name([f.name for f in files], val_fraction)
    return ([p for p, v in zip(whole, in_val) if not v], [p for p, v in zip(whole, in_val) if v])


# ----------------------------------------------------------------------------------------------
# Segments
# ----------------------------------------------------------------------------------------------

# A safe boundary is the position p (zero-width match) with: text[p-1] not a space and text[p] one of
# " \t\n\r"; or text[p-1] one of "\t\n\r" between two non-space characters. Python's \s contains the
# tokenizer's (Oniguruma's) \s, so "not a space" here is not a space there either.
_SAFE = re.compile(r"(?<=\S)(?=[ \t\n\r])|(?<=\S[\t\n\r])(?=\S)")
_TAIL = 4096


def _cut(buf: str, i: int, limit: int) -> int:
    """The last safe boundary p with i + 2 <= p <= i + limit (buf has more than i + limit chars), else
    i + limit. Looking only at buf[i:], it depends on the text from i alone."""
    end = i + limit
    for lo in (max(i, end - _TAIL), i):
        last = None
        for m in _SAFE.finditer(buf, lo, end + 1):
            last = m.start()
        if last is not None and last >= i + 2:
            return last
        if lo == i:
            break
    return end


def segments(blocks: Iterable[str], max_chars: int = SEGMENT_CHARS) -> Iterator[str]:
    """The segments of one document whose text arrives in `blocks` (see the module docstring);
    the same segments however the text is cut into blocks."""
    if max_chars < 2:
        raise CorpusError(f"max_chars must be >= 2, got {max_chars}")
    buf, i = "", 0
    for block in blocks:
        if not block:
            continue
        buf = buf[i:] + block if i < len(buf) else block
        i = 0
        while len(buf) - i > max_chars:
            p = _cut(buf, i, max_chars)
            yield buf[i:p]
            i = p
    if i < len(buf):
        yield buf[i:]


def split_text(text: str, max_chars: int = SEGMENT_CHARS) -> List[str]:
    """`segments` of one document given whole."""
    return list(segments([text], max_chars))


__all__ = ["CorpusError", "missing_data_error", "SourceFile", "Part", "Manifest", "scan", "scan_files",
           "skipped_summary", "report_skipped", "iter_text", "part_text", "split_parts", "split_by_name",
           "text_split_point", "segments", "split_text", "READ_BLOCK", "SEGMENT_CHARS"]
