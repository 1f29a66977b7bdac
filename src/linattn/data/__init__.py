"""Data for language-model training: corpora (files, folders, the embedded stdlib default),
deterministic splitting and packing, and the byte-level BPE tokenizer."""
from .corpus import (
    DEFAULT_STDLIB_MAX_BYTES,
    DEFAULT_VAL_FRACTION,
    CorpusError,
    Document,
    PackedTokens,
    load_corpus,
    read_documents,
    split_documents,
    stdlib_documents,
    token_fingerprint,
    tokenize_documents,
)
from .tokenizer import EOS_TOKEN, BPETokenizer, TokenizerError, load_tokenizer, tokenizer_from_str, train_tokenizer

__all__ = [
    "Document", "CorpusError", "PackedTokens", "load_corpus", "read_documents", "stdlib_documents",
    "split_documents", "tokenize_documents", "token_fingerprint", "DEFAULT_STDLIB_MAX_BYTES",
    "DEFAULT_VAL_FRACTION", "BPETokenizer", "TokenizerError", "EOS_TOKEN", "train_tokenizer",
    "load_tokenizer", "tokenizer_from_str",
]
