"""Tokenizers the serve tests share (module-scoped: trained once per test module)."""
import pytest

from linattn.data.tokenizer import MIN_VOCAB_SIZE, train_tokenizer


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(["def f(x):\n    return x + 1\n" * 20], vocab_size=280)


@pytest.fixture(scope="module")
def byte_tok():
    """No merges: every byte is its own token, so a multi-byte character spans tokens."""
    return train_tokenizer(["abc"], vocab_size=MIN_VOCAB_SIZE)
