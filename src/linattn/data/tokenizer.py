"""Byte-level BPE tokenizer (GPT-2 style) built on the `tokenizers` library: train one or load one.

Byte-level means every string round-trips: the base alphabet is the 256 bytes, so no text is ever
out of vocabulary, and the smallest useful vocabulary is 256 + the special tokens. The one special
token, `<|endoftext|>`, separates packed documents and starts generation from an empty prompt.

    tok = train_tokenizer(texts, vocab_size=4096)
    ids = tok.encode("def f(x):\\n    return x")
    tok.decode(ids)
    tok.save("run/tokenizer.json"); tok = load_tokenizer("run/tokenizer.json")

Bounded pieces. The pre-tokenizer first isolates every run of `MAX_PIECE_CHARS` non-space (or
space) characters, then applies GPT-2's byte-level rule. Ordinary text has no such runs and is
pre-tokenized exactly as by GPT-2's rule alone; a long line without spaces (a 1 MB line of "a",
DNA) becomes pieces of at most `MAX_PIECE_CHARS` characters instead of one huge piece, whose BPE
training cost grows with the square of its length. The rule lives in tokenizer.json, so training,
encoding, generation and the transformers export all apply it. Tokenizers trained before it
(plain byte-level pre-tokenizer) load and work as before.

Training reads `texts` through `sources.segments` (pieces of at most 64 Ki characters, cut where
the tokens do not change), in a worker thread: the calling thread waits in short slices, so a
Ctrl-C (KeyboardInterrupt) is acted on at once, in every phase of the training.
"""
from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Callable, Iterable, Iterator, List, Optional, Sequence, Union

from ..errors import DataError
from ..signals import StopFlag
from .sources import segments

EOS_TOKEN = "<|endoftext|>"
#: the end-of-text tokens a loaded tokenizer may use, the first one it has wins: linattn's own, then those of the
#: Llama / Mistral (SentencePiece), Llama 3 and Gemma families, which fla's published checkpoints use
END_OF_TEXT_TOKENS = (EOS_TOKEN, "</s>", "<|end_of_text|>", "<eos>")
SPECIAL_TOKENS = (EOS_TOKEN,)
TOKENIZER_FILE = "tokenizer.json"
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)
MAX_PIECE_CHARS = 256   # runs of more non-space (or space) characters are cut into pieces of this length


class TokenizerError(DataError):
    """A tokenizer that cannot be trained or loaded (bad vocab size, missing or unreadable file)."""


class BPETokenizer:
    """A thin wrapper over `tokenizers.Tokenizer` with the few methods training and generation use."""

    def __init__(self, tokenizer):
        self._tok = tokenizer
        self.eos_token: str = next((t for t in END_OF_TEXT_TOKENS if tokenizer.token_to_id(t) is not None), "")
        if not self.eos_token:
            raise TokenizerError(f"the tokenizer has no end-of-text token (one of {', '.join(END_OF_TEXT_TOKENS)}); "
                                 f"train it with linattn or add one")
        self.eos_id: int = int(tokenizer.token_to_id(self.eos_token))

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    @property
    def backend(self):
        """The underlying `tokenizers.Tokenizer`."""
        return self._tok

    def encode(self, text: str) -> List[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def encode_batch(self, texts: Sequence[str]) -> List[List[int]]:
        enc = getattr(self._tok, "encode_batch_fast", None) or self._tok.encode_batch  # fast: no offsets
        return [list(e.ids) for e in enc(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def to_str(self) -> str:
        return self._tok.to_str()

    def save(self, path: Union[str, os.PathLike]) -> Path:
        """Write `tokenizer.json` (to `path`, or into `path` if it is a directory); atomic (write then rename)."""
        path = Path(path)
        if path.is_dir():
            path = path / TOKENIZER_FILE
        from ..io import atomic_write_text
        atomic_write_text(path, self.to_str())
        return path

    def check_fits(self, vocab_size: int, source: str) -> None:
        """Refuse (TokenizerError naming `source`) a tokenizer with more tokens than a model's vocabulary: its ids
        beyond the vocabulary would index past the embedding."""
        if self.vocab_size > vocab_size:
            raise TokenizerError(f"{source}: the tokenizer has {self.vocab_size} tokens, the model's vocabulary "
                                 f"{vocab_size}: its ids beyond {vocab_size - 1} would index past the embedding")

    def __len__(self) -> int:
        return self.vocab_size

    def __repr__(self) -> str:
        return f"BPETokenizer(vocab_size={self.vocab_size}, eos_id={self.eos_id})"


def _new_byte_level_bpe():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.BPE())
    n = MAX_PIECE_CHARS
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(rf"\S{{{n}}}|\s{{{n}}}"), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    return tok


def _segmented(texts: Iterable[str], stop: StopFlag) -> Iterator[str]:
    for text in texts:
        for seg in segments([text]):
            stop.raise_if_set()  # ends the training iterator early (the caller was interrupted)
            yield seg


def _train_in_thread(tok, items: Iterator[str], trainer, stop: StopFlag, poll_s: float = 0.1) -> None:
    """`tok.train_from_iterator(items)` in a daemon thread (the library releases the GIL while it
    trains); the caller waits in slices of `poll_s`, so KeyboardInterrupt (or any signal handler's
    exception) is raised here promptly. On such an exception the iterator is told to stop and the
    exception propagates; a worker still busy in the final merges is abandoned (it ends with the
    process)."""
    errors: List[BaseException] = []

    def work():
        try:
            tok.train_from_iterator(items, trainer=trainer)
        except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
            errors.append(e)

    worker = threading.Thread(target=work, name="linattn-tokenizer-training", daemon=True)
    try:
        worker.start()
        while worker.is_alive():
            worker.join(poll_s)
    except BaseException:
        stop.set()
        raise
    if errors:
        raise errors[0]


def train_tokenizer(texts: Iterable[str], vocab_size: int = 4096, min_frequency: int = 2,
                    show_progress: bool = False) -> BPETokenizer:
    """Train a byte-level BPE tokenizer on `texts` (any iterable of strings, e.g. documents or
    `sources.segments` of them).

    `vocab_size` counts the 256 byte tokens and `<|endoftext|>`; it is an upper bound (a small
    corpus may run out of merges that occur `min_frequency` times). Training is deterministic for
    a given input. A KeyboardInterrupt
    stops it in any phase (see the module docstring).
    """
    from tokenizers import pre_tokenizers, trainers

    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size < MIN_VOCAB_SIZE:
        raise TokenizerError(f"vocab_size must be an int >= {MIN_VOCAB_SIZE} (256 bytes + "
                             f"{len(SPECIAL_TOKENS)} special), got {vocab_size!r}")
    tok = _new_byte_level_bpe()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=min_frequency, show_progress=show_progress,
        special_tokens=list(SPECIAL_TOKENS), initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    stop = StopFlag(enabled=False)  # set by the waiting thread, polled by the iterator
    if isinstance(texts, str):
        texts = [texts]
    _train_in_thread(tok, _segmented(texts, stop), trainer, stop)
    return BPETokenizer(tok)


def tokenizer_from_str(text: str) -> BPETokenizer:
    from tokenizers import Tokenizer

    try:
        return BPETokenizer(Tokenizer.from_str(text))
    except TokenizerError:
        raise
    except Exception as e:  # tokenizers raises its own Exception subclass on bad JSON
        raise TokenizerError(f"not a valid tokenizer.json: {str(e).splitlines()[0] if str(e) else e}") from None


def load_tokenizer(path: Union[str, os.PathLike]) -> BPETokenizer:
    """Load a tokenizer from a `tokenizer.json` file or from a folder holding one (e.g. a checkpoint's
    step folder; for a run folder, resolve its checkpoint first with
    `linattn.checkpoint.find_latest_checkpoint`: the data layer does not import the checkpoints)."""
    p = Path(path)
    if p.is_dir():
        p = p / TOKENIZER_FILE
    if not p.is_file():
        raise TokenizerError(f"tokenizer file not found: {p}")
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise TokenizerError(f"cannot read tokenizer {p}: {e}") from None
    try:
        return tokenizer_from_str(text)
    except TokenizerError as e:
        raise TokenizerError(f"{p}: {e}") from None


def tokenizer_for_model(path: Union[str, os.PathLike], vocab_size: int, flag: str = "--tokenizer",
                        reader: Optional[Callable[[Path], Optional[BPETokenizer]]] = None) -> BPETokenizer:
    """`--tokenizer PATH` of a command on a model with `vocab_size` tokens: `reader(path)` (default
    `load_tokenizer`), refused (a TokenizerError naming the flag) when missing, unusable, absent (the reader gave
    None) or larger than the vocabulary."""
    p = Path(path)
    if not p.exists():
        raise TokenizerError(f"{flag} {p}: not found")
    try:
        tok = (reader or load_tokenizer)(p)
    except TokenizerError as e:
        raise TokenizerError(f"{flag} {p}: {e}") from None
    if tok is None:
        raise TokenizerError(f"{flag} {p}: holds no tokenizer")
    tok.check_fits(vocab_size, f"{flag} {p}")
    return tok
