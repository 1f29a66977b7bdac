"""The tokenizer an import brings along (`import-hf`, the linattn and the fla folders alike).

Looked for in `--tokenizer PATH` when given (a folder, a tokenizer.json or a SentencePiece tokenizer.model), else in
the model folder: a `tokenizer.json` is read with the `tokenizers` library; a folder with only a SentencePiece
`tokenizer.model` goes through transformers' `AutoTokenizer` (offline; it needs the `sentencepiece` package), whose
fast tokenizer is what the checkpoint keeps. The end-of-text token is the first of
`data.tokenizer.END_OF_TEXT_TOKENS` the tokenizer has (it also pads). A tokenizer with more tokens than the model's
vocabulary is refused here, not at generation.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, Union

from ..data.tokenizer import TOKENIZER_FILE, BPETokenizer, TokenizerError, tokenizer_for_model, tokenizer_from_str
from ..errors import CheckpointError

PathLike = Union[str, os.PathLike]
SENTENCEPIECE_FILE = "tokenizer.model"


def _from_sentencepiece(folder: Path) -> BPETokenizer:
    import importlib.util

    if importlib.util.find_spec("sentencepiece") is None:
        raise TokenizerError(f"{folder / SENTENCEPIECE_FILE} is a SentencePiece model: pip install sentencepiece "
                             f"(in linattn's hf extra) to import it")
    from transformers import AutoTokenizer

    try:
        fast = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        return tokenizer_from_str(fast.backend_tokenizer.to_str())
    except TokenizerError:
        raise
    except Exception as e:  # transformers' and sentencepiece's own errors
        raise TokenizerError(f"cannot read the SentencePiece tokenizer in {folder}: {type(e).__name__}: "
                             f"{' '.join(str(e).split())[:200]}") from None


def find_tokenizer(source: Path) -> Optional[BPETokenizer]:
    """The tokenizer at `source` (a folder or a file), or None when it holds none. Raises TokenizerError when
    one is there but cannot be used."""
    if source.is_file():
        if source.name.endswith(".model"):
            if source.name != SENTENCEPIECE_FILE:
                raise TokenizerError(f"{source}: transformers reads a SentencePiece model named {SENTENCEPIECE_FILE}")
            return _from_sentencepiece(source.parent)
        folder, json_file = source.parent, source
    else:
        folder, json_file = source, source / TOKENIZER_FILE
    if json_file.is_file():
        try:
            return tokenizer_from_str(json_file.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError) as e:
            raise TokenizerError(f"cannot read {json_file}: {e}") from None
        except TokenizerError as e:
            raise TokenizerError(f"{json_file}: {e}") from None
    if (folder / SENTENCEPIECE_FILE).is_file():
        return _from_sentencepiece(folder)
    return None


def import_tokenizer(model_dir: PathLike, vocab_size: int,
                     explicit: Optional[PathLike] = None) -> Optional[BPETokenizer]:
    """The tokenizer of an import: `explicit` (required to hold one), else the model folder's (None if it has none).

    Args:
        model_dir: The model folder imported.
        vocab_size: The model's vocabulary size (a larger tokenizer is refused).
        explicit: `--tokenizer PATH`: a folder, a tokenizer.json or a tokenizer.model.

    Returns:
        The tokenizer, or None when `explicit` is None and the model folder holds no tokenizer.

    Raises:
        CheckpointError: An explicit path without a tokenizer, a tokenizer that cannot be read or has no
            end-of-text token (from the model folder: TokenizerError, which the fla import turns into a warning),
            or one larger than the model's vocabulary.
    """
    if explicit is not None:
        try:
            return tokenizer_for_model(explicit, vocab_size, reader=find_tokenizer)
        except TokenizerError as e:  # an explicit one is required to be usable
            raise CheckpointError(str(e)) from None
    tok = find_tokenizer(Path(model_dir))
    if tok is not None:
        try:
            tok.check_fits(vocab_size, str(model_dir))
        except TokenizerError as e:  # not the fla import's warning: this one is refused
            raise CheckpointError(f"{e}; pass the model's own tokenizer with --tokenizer") from None
    return tok


__all__ = ["find_tokenizer", "import_tokenizer", "SENTENCEPIECE_FILE"]
