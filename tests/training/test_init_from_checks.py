"""`train --init-from` checks the checkpoint's weights before it tokenises the corpus (issue 49.8)."""
import os

import pytest

from linattn import LanguageModel, LMConfig, checkpoint as ckpt
from linattn.cli import main
from linattn.data.tokenizer import train_tokenizer
from linattn.models.family import config_to_dict
from linattn.training import loop

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def source(tmp_path):
    tok = train_tokenizer(["def f(x):\n    return x + 1\n" * 20], vocab_size=260)
    m = LanguageModel(LMConfig(vocab_size=tok.vocab_size, d_model=32, n_layers=2, n_heads=2, mixer="gla",
                               max_seq_len=64))
    return ckpt.save_checkpoint(tmp_path / "src", 4, m, model_config=config_to_dict(m.config), tokenizer=tok)


def _never_tokenise(monkeypatch):
    monkeypatch.setattr(loop, "prepare_data", lambda *a, **k: pytest.fail("the corpus was tokenised first"))


def _init_from(corpus, out, source, *extra):
    return main(["train", "--data", str(corpus), "--out", str(out), "--init-from", str(source), "--steps", "1",
                 "--seq-len", "16", "--batch-size", "2", "--threads", "1", "--no-progress", *extra])


@pytest.mark.parametrize("damage", ["truncate", "garbage", "other_model"])
def test_damaged_weights_fail_before_the_corpus_is_tokenised(source, corpus, tmp_path, capsys, monkeypatch, damage):
    f = source / ckpt.MODEL_FILE
    if damage == "truncate":
        os.truncate(f, f.stat().st_size - 100)
    elif damage == "garbage":
        f.write_bytes(b"\xff" * 64)
    else:  # another model's weights under this config
        m = LanguageModel(LMConfig(vocab_size=260, d_model=48, n_layers=2, n_heads=2, mixer="gla"))
        from safetensors.torch import save_model

        save_model(m, str(f))
    _never_tokenise(monkeypatch)
    assert _init_from(corpus, tmp_path / "ft", source) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and f"--init-from {source}" in err and "model.safetensors" in err, err
    assert {"truncate": "truncated", "garbage": "header", "other_model": "shape"}[damage] in err


def test_sound_weights_pass_the_check(source):
    assert ckpt.weights_problem(source, ckpt.model_config_from_dict(ckpt.read_checkpoint_config(source)["model"])) \
        is None


def test_init_from_takes_an_explicit_tokenizer_of_the_same_vocabulary(source, corpus, tmp_path, capsys, monkeypatch):
    tok_file = tmp_path / "tok.json"
    ckpt.load_checkpoint(source).tokenizer.save(tok_file)
    assert _init_from(corpus, tmp_path / "ft", source, "--tokenizer", str(tok_file)) == 0
    other = tmp_path / "other.json"
    train_tokenizer(["x = 1\n" * 30], vocab_size=258).save(other)
    _never_tokenise(monkeypatch)
    assert _init_from(corpus, tmp_path / "ft2", source, "--tokenizer", str(other)) == 2
    assert "needs a tokenizer of the same vocabulary" in capsys.readouterr().err
