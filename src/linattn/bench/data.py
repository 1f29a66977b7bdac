"""`linattn bench data`: data preparation at scale: peak memory and wall time of reading, training the
tokenizer and tokenizing into the memory-mapped token file, on generated text of --mb megabytes.

Each size runs `linattn.data.prep.prepare_tokens` in a fresh Python process (so that its peak
resident set, `ru_maxrss`, is the preparation's own plus the interpreter and its imports, measured
separately as the baseline), twice: cold (empty cache: every phase runs) and warm (the cache of the
cold run is found). The text is generated from a fixed seed: --text words (lines of words drawn
from a Zipf-distributed synthetic vocabulary, punctuation, numbers) or long-lines (lines of 1 MB of
A/C/G/T without spaces: no line breaks to split at); --data uses an existing file or folder
instead. "ratio" is (peak - baseline) / bytes of the token array, the target being <= 2 (the
tokenizer library's word counts are part of the constant).
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import numpy as np

from ..cli_support import UsageError, finite_float, int_at_least
from ..data.tokenizer import MIN_VOCAB_SIZE
from ..io import atomic_write_text, write_json
from . import common

DESCRIPTION = __doc__
PROG = "linattn bench data"

_CHILD = r"""
import json, resource, sys, time
args = json.loads(sys.argv[1])
import numpy, torch, tokenizers, tqdm  # noqa: F401  (the imports of a training process)
import linattn.data.prep as prep
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t = time.perf_counter()
p = prep.prepare_tokens(args["data"], vocab_size=args["vocab_size"], cache_dir=args["cache"], progress=args["progress"],
                        max_bytes=args["max_bytes"])
wall = time.perf_counter() - t
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
n = len(p.train) + len(p.val)
print(json.dumps({"wall_s": wall, "seconds": p.seconds, "baseline_kb": base, "peak_kb": peak, "tokens": n,
                  "token_bytes": n * p.train.dtype.itemsize, "dtype": str(p.train.dtype), "bytes": p.manifest.nbytes,
                  "reused": p.reused, "vocab_size": p.tokenizer.vocab_size}))
"""


def add_arguments(p) -> None:
    """The options of `linattn bench data`.

    Args:
        p: The argparse parser to add them to.
    """
    p.add_argument("--mb", type=finite_float(0, low_open=True), nargs="+", default=[100.0],
                   help="sizes of generated text in MB (default 100)")
    p.add_argument("--text", choices=("words", "long-lines"), default="words", help="what text to generate")
    p.add_argument("--data", default=None, help="an existing text file or folder instead of generated text")
    p.add_argument("--max-data-bytes", type=int_at_least(1), default=None, help="cap on the text read (with --data)")
    p.add_argument("--vocab-size", type=int_at_least(MIN_VOCAB_SIZE), default=4096,
                   help="tokenizer vocabulary (default 4096)")
    p.add_argument("--workdir", default=None, help="folder for the generated text and the caches (default: a "
                                                   "temporary folder, removed afterwards)")
    p.add_argument("--progress", action="store_true", help="show the preparation's progress bars")
    p.add_argument("--out", default=None, help="output folder (default results/bench/data/)")
    p.add_argument("--overwrite", action="store_true", help="replace existing output files")


# ----------------------------------------------------------------------------------------------
# Generated text
# ----------------------------------------------------------------------------------------------

def _vocabulary(rng: np.random.Generator, n: int = 20000) -> List[str]:
    letters = np.array(list("etaoinshrdlcumwfgypbvkjxqz"))
    freq = np.array([12.7, 9.1, 8.2, 7.5, 7.0, 6.7, 6.3, 6.1, 6.0, 4.3, 4.0, 2.8, 2.8, 2.4, 2.4, 2.2, 2.0, 2.0,
                     1.9, 1.5, 1.0, 0.8, 0.2, 0.2, 0.1, 0.1])
    freq = freq / freq.sum()
    lengths = rng.integers(1, 11, size=n)
    return ["".join(rng.choice(letters, size=k, p=freq)) for k in lengths]


def generate_words(path: Path, nbytes: int, seed: int = 0) -> None:
    """Lines of Zipf-distributed synthetic words with some punctuation and numbers, `nbytes` bytes."""
    rng = np.random.default_rng(seed)
    vocab = _vocabulary(rng) + [",", ".", "(", ")", ":", "=", "1", "2", "42", "2024"]
    weights = 1.0 / np.arange(1, len(vocab) + 1)
    weights /= weights.sum()
    written = 0
    with open(path, "w", encoding="utf-8") as f:
        while written < nbytes:
            idx = rng.choice(len(vocab), size=200_000, p=weights)
            lens = rng.integers(4, 24, size=len(idx) // 4)
            words = [vocab[i] for i in idx]
            lines, j = [], 0
            for k in lens:
                lines.append(" ".join(words[j:j + k]))
                j += k
            chunk = "\n".join(lines) + "\n"
            chunk = chunk[:nbytes - written]
            f.write(chunk)
            written += len(chunk)


def generate_long_lines(path: Path, nbytes: int, seed: int = 0, line: int = 1_000_000) -> None:
    """Lines of `line` characters of A/C/G/T, no spaces."""
    rng = np.random.default_rng(seed)
    alphabet = np.frombuffer(b"ACGT", dtype=np.uint8)
    written = 0
    with open(path, "wb") as f:
        while written < nbytes:
            n = min(line, nbytes - written)
            f.write(alphabet[rng.integers(0, 4, size=n)].tobytes())
            written += n
            if written < nbytes:
                f.write(b"\n")
                written += 1


# ----------------------------------------------------------------------------------------------
# Measuring
# ----------------------------------------------------------------------------------------------

def _child(data: str, cache: str, vocab_size: int, progress: bool, max_bytes: Optional[int]) -> Dict[str, Any]:
    args = json.dumps({"data": data, "cache": cache, "vocab_size": vocab_size, "progress": progress,
                       "max_bytes": max_bytes})
    proc = subprocess.run([sys.executable, "-c", _CHILD, args], stdout=subprocess.PIPE,
                          stderr=None if progress else subprocess.PIPE, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr or "").strip().splitlines()[-1:] or [f"exit code {proc.returncode}"]
        raise RuntimeError(f"the preparation failed: {tail[0]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _row(mb: Optional[float], data: str, cache: str, args) -> Dict[str, Any]:
    cold = _child(data, cache, args.vocab_size, args.progress, args.max_data_bytes)
    warm = _child(data, cache, args.vocab_size, args.progress, args.max_data_bytes)
    peak_mb = cold["peak_kb"] / 1024
    base_mb = cold["baseline_kb"] / 1024
    return {"mb": mb, "data": data, "bytes": cold["bytes"], "tokens": cold["tokens"], "dtype": cold["dtype"],
            "token_array_mb": cold["token_bytes"] / 2 ** 20, "peak_rss_mb": peak_mb, "baseline_rss_mb": base_mb,
            "ratio": (peak_mb - base_mb) / max(1e-9, cold["token_bytes"] / 2 ** 20), "cold": cold, "warm": warm}


def run(args) -> int:
    """Run the `linattn bench data` benchmark (module docstring).

    Args:
        args: The options parsed with `add_arguments` (`linattn bench data --help` lists them).

    Returns:
        The exit code (0: success).

    Raises:
        UsageError: Bad options.
    """
    if args.data is not None and not Path(args.data).exists():
        raise UsageError(f"--data {args.data} not found", prog=PROG)
    paths = common.output_paths("data", args.out, exts=("txt", "json"), overwrite=args.overwrite)
    info = common.machine_info("cpu")
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="linattn-bench-data-"))
    work.mkdir(parents=True, exist_ok=True)
    rows: List[Dict[str, Any]] = []
    try:
        cases = [(None, args.data)] if args.data is not None else [(mb, None) for mb in args.mb]
        for mb, data in cases:
            if data is None:
                data = str(work / f"{args.text}-{mb:g}MB.txt")
                if not Path(data).is_file() or Path(data).stat().st_size != int(mb * 1e6):
                    t = time.perf_counter()
                    (generate_words if args.text == "words" else generate_long_lines)(Path(data), int(mb * 1e6))
                    print(f"[bench data] generated {data} ({time.perf_counter() - t:.1f} s)", file=sys.stderr)
            cache = work / f"cache-{len(rows)}"
            shutil.rmtree(cache, ignore_errors=True)
            rows.append(_row(mb, data, str(cache), args))
            r = rows[-1]
            print(f"[bench data] {r['bytes'] / 1e6:.1f} MB: peak {r['peak_rss_mb']:.0f} MiB, "
                  f"{r['cold']['wall_s']:.1f} s cold, {r['warm']['wall_s']:.2f} s warm", file=sys.stderr)
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    table = common.format_table(
        ["text MB", "tokens", "tokens MiB", "peak RSS MiB", "baseline MiB", "ratio", "read s", "tokenizer s",
         "tokenize s", "cold s", "warm s"],
        [[f"{r['bytes'] / 1e6:.1f}", f"{r['tokens']:,}", f"{r['token_array_mb']:.1f}", f"{r['peak_rss_mb']:.0f}",
          f"{r['baseline_rss_mb']:.0f}", f"{r['ratio']:.2f}", f"{r['cold']['seconds'].get('reading', 0):.1f}",
          f"{r['cold']['seconds'].get('tokenizer', 0):.1f}", f"{r['cold']['seconds'].get('tokenizing', 0):.1f}",
          f"{r['cold']['wall_s']:.1f}", f"{r['warm']['wall_s']:.2f}"] for r in rows])
    text = (common.describe_machine(info) + "\n\n"
            + f"linattn bench data: text {args.data or args.text}, vocab {args.vocab_size}\n\n" + table + "\n")
    print(text)
    write_json(paths["json"], {"machine": info, "config": vars(args), "rows": rows})
    atomic_write_text(paths["txt"], text)
    return 0


__all__ = ["DESCRIPTION", "add_arguments", "run", "generate_words", "generate_long_lines"]
