"""`import-hf` under faults and misuse (issue 49.3, 49.4, 49.8): every parameter comes from the folder, a broken
folder is one CheckpointError line (exit 2), and --overwrite never loses the old checkpoints before the new one is
complete; one writer per --out (the run lock `train` uses)."""
from __future__ import annotations

import errno
import json
import os

import pytest
import torch

pytest.importorskip("transformers")

from linattn import LanguageModel, LMConfig, checkpoint as ckpt  # noqa: E402
from linattn.cli import main as cli_main  # noqa: E402
from linattn.errors import CheckpointError  # noqa: E402
from linattn.hf.convert import export_hf, import_hf  # noqa: E402
from linattn.models.family import config_to_dict  # noqa: E402
from linattn.training.lock import RunFolderBusy, RunLock  # noqa: E402
from tests.helpers import error_line  # noqa: E402


def _model(seed=0):
    torch.manual_seed(seed)
    return LanguageModel(LMConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, mixer="gated-deltanet")).eval()


@pytest.fixture
def hf_dir(tmp_path):
    m = _model()
    ckpt.save_checkpoint(tmp_path / "run", 3, m, model_config=config_to_dict(m.config))
    return export_hf(tmp_path / "run", tmp_path / "hf")


def _edit_weights(folder, edit):
    from safetensors.torch import load_file, save_file

    f = folder / "model.safetensors"
    tensors = load_file(str(f))
    edit(tensors)
    save_file(tensors, str(f), metadata={"format": "pt"})


def _cli_error(capsys, *argv):
    assert cli_main(["import-hf", *argv]) == 2
    return error_line(capsys)


def test_missing_tensor_is_refused_naming_it(hf_dir, tmp_path, capsys):
    """Before: the checkpoint held whatever memory was there (|q_proj| = 8.6e17 seen) and generated silently."""
    _edit_weights(hf_dir, lambda t: t.pop("model.blocks.1.mixer.q_proj.weight"))
    line = _cli_error(capsys, "--model", str(hf_dir), "--out", str(tmp_path / "out"))
    assert "lack the tensors" in line and "blocks.1.mixer.q_proj.weight" in line
    assert not ckpt.has_checkpoint(tmp_path / "out")


def test_extra_tensor_is_refused_naming_it(hf_dir, tmp_path):
    _edit_weights(hf_dir, lambda t: t.update({"model.blocks.0.mixer.stray": torch.zeros(3)}))
    with pytest.raises(CheckpointError, match=r"tensors the model has not: .*blocks\.0\.mixer\.stray"):
        import_hf(hf_dir, tmp_path / "out")


def test_wrong_shape_is_one_line(hf_dir, tmp_path, capsys):
    _edit_weights(hf_dir, lambda t: t.update({"model.norm.weight": torch.ones(31)}))
    line = _cli_error(capsys, "--model", str(hf_dir), "--out", str(tmp_path / "out"))
    assert "wrong shape" in line and "model.norm.weight" in line, line


def test_truncated_weights_are_one_line(hf_dir, tmp_path, capsys):
    f = hf_dir / "model.safetensors"
    os.truncate(f, f.stat().st_size // 2)
    line = _cli_error(capsys, "--model", str(hf_dir), "--out", str(tmp_path / "out"))
    assert f"cannot load {hf_dir}" in line


def test_config_without_model_type_is_one_line(hf_dir, tmp_path, capsys):
    cfg = json.loads((hf_dir / "config.json").read_text())
    del cfg["model_type"]
    (hf_dir / "config.json").write_text(json.dumps(cfg))
    line = _cli_error(capsys, "--model", str(hf_dir), "--out", str(tmp_path / "out"))
    assert "no model_type" in line


def test_nonexistent_model_folder_says_not_found(tmp_path, capsys):
    line = _cli_error(capsys, "--model", str(tmp_path / "nonexistent"), "--out", str(tmp_path / "out"))
    assert "not found" in line and "config.json" not in line


def test_a_good_folder_still_imports_exactly(hf_dir, tmp_path):
    step = import_hf(hf_dir, tmp_path / "out")
    ids = torch.randint(0, 64, (1, 7))
    assert step.name == ckpt.step_dir_name(3)
    assert torch.equal(ckpt.load_checkpoint(tmp_path / "out").model(ids).logits, _model()(ids).logits)


# ------------------------------------------------------------------------------------------------ --overwrite

def _training_run(folder, seed=5):
    m = _model(seed)
    ckpt.save_checkpoint(folder, 10, m, model_config=config_to_dict(m.config), keep_last=None)
    ckpt.save_checkpoint(folder, 20, m, model_config=config_to_dict(m.config), keep_last=None)
    (folder / "metrics.jsonl").write_text('{"step": 10, "loss": 3.0}\n')
    return m


def test_overwrite_with_a_full_disk_keeps_the_old_checkpoints(hf_dir, tmp_path, monkeypatch):
    """Before: the old checkpoints were deleted first; the failed write left a dangling `latest` and said
    "no earlier checkpoint exists". After: the old run is as it was, and the message says so."""
    out = tmp_path / "out"
    old = _training_run(out)

    def full(path, *a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ckpt, "_save_weights", full)
    with pytest.raises(CheckpointError, match=r"the disk is full.*previous checkpoint .*step_0*20 is intact"):
        import_hf(hf_dir, out, overwrite=True)
    assert [p.name for p in ckpt.list_checkpoints(out)] == [ckpt.step_dir_name(10), ckpt.step_dir_name(20)]
    ids = torch.randint(0, 64, (1, 5))
    assert torch.equal(ckpt.load_checkpoint(out).model(ids).logits, old(ids).logits)
    assert (out / "metrics.jsonl").exists()


def test_overwrite_replaces_the_run_and_drops_its_metrics(hf_dir, tmp_path):
    out = tmp_path / "out"
    _training_run(out)
    (out / "notes.txt").write_text("mine")
    step = import_hf(hf_dir, out, overwrite=True)
    assert [p.name for p in ckpt.list_checkpoints(out)] == [ckpt.step_dir_name(3)]
    assert ckpt.find_latest_checkpoint(out) == step
    assert not (out / "metrics.jsonl").exists() and (out / "notes.txt").read_text() == "mine"


def test_overwrite_of_the_same_step(hf_dir, tmp_path):
    out = tmp_path / "out"
    import_hf(hf_dir, out)
    assert import_hf(hf_dir, out, overwrite=True).name == ckpt.step_dir_name(3) and ckpt.has_checkpoint(out)


def test_without_overwrite_an_occupied_run_is_refused(hf_dir, tmp_path):
    out = tmp_path / "out"
    _training_run(out)
    with pytest.raises(CheckpointError, match="pass --overwrite"):
        import_hf(hf_dir, out)
    (tmp_path / "ran").mkdir()
    (tmp_path / "ran" / "metrics.jsonl").write_text("")  # a run that saved nothing yet is a run too
    with pytest.raises(CheckpointError, match="pass --overwrite"):
        import_hf(hf_dir, tmp_path / "ran")


@pytest.mark.parametrize("model_type", ["linattn", "gla"])
def test_a_second_writer_is_refused_by_the_run_lock(hf_dir, tmp_path, capsys, model_type):
    """Before: two simultaneous imports into one --out both said "wrote" and one silently won."""
    if model_type != "linattn":  # the fla path takes the same lock before it reads a weight
        cfg = json.loads((hf_dir / "config.json").read_text())
        (hf_dir / "config.json").write_text(json.dumps({**cfg, "model_type": model_type}))
    out = tmp_path / "out"
    out.mkdir()
    with RunLock(out):
        with pytest.raises(RunFolderBusy, match="in use by another run"):
            import_hf(hf_dir, out)
        assert _cli_error(capsys, "--model", str(hf_dir), "--out", str(out))
    assert not ckpt.has_checkpoint(out)


def test_out_that_is_the_model_folder_or_a_file_is_refused(hf_dir, tmp_path, capsys):
    before = sorted(p.name for p in hf_dir.iterdir())
    line = _cli_error(capsys, "--model", str(hf_dir), "--out", str(hf_dir), "--overwrite")
    assert "is the model folder" in line and sorted(p.name for p in hf_dir.iterdir()) == before
    (tmp_path / "afile").write_text("x")
    line = _cli_error(capsys, "--model", str(hf_dir), "--out", str(tmp_path / "afile"), "--overwrite")
    assert "is a file" in line and (tmp_path / "afile").read_text() == "x"


def test_import_warnings_are_one_line_each(hf_dir, tmp_path, capsys, monkeypatch):
    """Before: a warning of the import printed its Python source line in the CLI output."""
    from linattn.hf import convert

    real = convert.import_hf

    def warning_import(*a, **k):
        import warnings

        warnings.warn("the tokenizer is left out", UserWarning, stacklevel=2)
        return real(*a, **k)

    monkeypatch.setattr(convert, "import_hf", warning_import)
    assert cli_main(["import-hf", "--model", str(hf_dir), "--out", str(tmp_path / "out")]) == 0
    err = capsys.readouterr().err
    assert "[linattn] warning: the tokenizer is left out" in err and "warnings.warn" not in err
    assert "UserWarning" not in err, err


@pytest.mark.parametrize("value", [0, -2, "4", True])
def test_fla_sizes_must_be_positive_numbers(value):
    """Before: num_heads 0 raised a raw ZeroDivisionError from the converters."""
    from linattn.hf.fla import fla_to_linattn, supported_types

    for model_type in supported_types():
        cfg = {"model_type": model_type, "hidden_size": 32, "num_hidden_layers": 1, "vocab_size": 10,
               "num_heads": value}
        with pytest.raises(CheckpointError, match=r"num_heads must be a number > 0"):
            fla_to_linattn(cfg, {})


# ------------------------------------------------------------------------------------------------ dtypes

NON_FLOAT = [torch.int32, torch.bool, torch.complex64]


@pytest.mark.parametrize("dtype", NON_FLOAT)
def test_non_float_weights_are_refused_by_name(hf_dir, tmp_path, dtype):
    """Before: int32, bool and complex tensors were cast to float without a word."""
    _edit_weights(hf_dir, lambda t: t.update({"model.norm.weight": t["model.norm.weight"].to(dtype)}))
    with pytest.raises(CheckpointError, match=r"'model\.norm\.weight' is .*not floating point"):
        import_hf(hf_dir, tmp_path / "out")


def test_fp8_weights_are_converted(hf_dir, tmp_path):
    want = {}

    def to_fp8(t):
        t["model.norm.weight"] = t["model.norm.weight"].to(torch.float8_e4m3fn)
        want["norm"] = t["model.norm.weight"].float()

    _edit_weights(hf_dir, to_fp8)
    import_hf(hf_dir, tmp_path / "out")
    assert torch.equal(ckpt.load_checkpoint(tmp_path / "out").model.norm.weight, want["norm"])


def _fla_folder(tmp_path):
    pytest.importorskip("fla", reason="flash-linear-attention (the dev extra) builds the fla model")
    from fla.models import TransformerConfig

    from tests.fla_cpu import build_fla, fla_cpu

    with fla_cpu():
        model = build_fla(TransformerConfig(hidden_size=32, num_hidden_layers=1, num_heads=2, vocab_size=50))
        model.save_pretrained(tmp_path / "fla", safe_serialization=True)
    return tmp_path / "fla"


@pytest.mark.parametrize("dtype", NON_FLOAT + [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fla_weights_of_any_float_dtype_import_and_others_are_refused(tmp_path, dtype):
    """Before: fp8 crashed with NotImplementedError; ints, bool and complex were cast silently."""
    folder = _fla_folder(tmp_path)
    name = "model.layers.0.attn.q_proj.weight"
    _edit_weights(folder, lambda t: t.update({name: t[name].to(dtype)}))
    if dtype in NON_FLOAT:
        with pytest.raises(CheckpointError, match=rf"'{name}' is .*not floating point"):
            import_hf(folder, tmp_path / "out")
        assert not (tmp_path / "out").exists()
        return
    import_hf(folder, tmp_path / "out")
    from safetensors.torch import load_file

    src = load_file(str(folder / "model.safetensors"))[name].float()
    got = ckpt.load_checkpoint(tmp_path / "out").model.blocks[0].mixer.q_proj.weight
    assert torch.equal(got.float(), src)


# ------------------------------------------------------------------------------------------------ tokenizers

TEXT = ["def add(x, y):\n    return x + y\n", "class Point:\n    x = 0\n    y = 0\n",
        "the quick brown fox jumps over the lazy dog\n"] * 40


def _wide_hf_dir(tmp_path, vocab=160):
    m = LanguageModel(LMConfig(vocab_size=vocab, d_model=32, n_layers=1, n_heads=2, mixer="gated-deltanet")).eval()
    ckpt.save_checkpoint(tmp_path / "run", 1, m, model_config=config_to_dict(m.config))
    return export_hf(tmp_path / "run", tmp_path / "hf")


def _llama_style_tokenizer_json(path, vocab=120, added=0):
    """A Llama-style tokenizer.json built offline: BPE over Metaspace pieces, <unk> <s> </s> as special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(TEXT, trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<unk>", "<s>", "</s>"]))
    tok.add_tokens([f"<extra_{i}>" for i in range(added)])
    tok.save(str(path))
    return Tokenizer.from_file(str(path))


def _sentencepiece_model(folder):
    spm = pytest.importorskip("sentencepiece", reason="a SentencePiece tokenizer.model needs sentencepiece")
    spm.SentencePieceTrainer.train(sentence_iterator=iter(TEXT), model_prefix=str(folder / "tokenizer"),
                                   vocab_size=90, model_type="bpe", unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
                                   minloglevel=2)
    (folder / "tokenizer.vocab").unlink()
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "LlamaTokenizer", "eos_token": "</s>", "bos_token": "<s>", "unk_token": "<unk>"}))


def _generates(capsys, out):
    assert cli_main(["generate", "--checkpoint", str(out), "--prompt", "def add", "--max-new-tokens", "4",
                     "--temperature", "0", "--json", "--threads", "1"]) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_llama_style_tokenizer_json_comes_along(tmp_path, capsys):
    """Before: a tokenizer without <|endoftext|> was dropped, and generate then refused the checkpoint."""
    hf = _wide_hf_dir(tmp_path)
    want = _llama_style_tokenizer_json(hf / "tokenizer.json")
    import_hf(hf, tmp_path / "out")
    tok = ckpt.load_checkpoint(tmp_path / "out").tokenizer
    assert tok.eos_token == "</s>" and tok.eos_id == want.token_to_id("</s>")
    assert tok.encode("def add(x, y)") == want.encode("def add(x, y)", add_special_tokens=False).ids
    assert _generates(capsys, tmp_path / "out")


def test_sentencepiece_tokenizer_model_comes_along(tmp_path, capsys):
    hf = _wide_hf_dir(tmp_path)
    (hf / "tokenizer.json").unlink(missing_ok=True)  # the export of a checkpoint without one has none
    _sentencepiece_model(hf)
    import_hf(hf, tmp_path / "out")
    tok = ckpt.load_checkpoint(tmp_path / "out").tokenizer
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(str(hf))
    text = "class Point: x = 0"
    assert tok.eos_token == "</s>" and tok.eos_id == ref.eos_token_id
    assert tok.encode(text) == ref(text, add_special_tokens=False)["input_ids"]
    assert _generates(capsys, tmp_path / "out")


def test_explicit_tokenizer_and_its_refusals(tmp_path, capsys):
    hf = _wide_hf_dir(tmp_path)
    (hf / "tokenizer.json").unlink(missing_ok=True)  # the export of a checkpoint without one has none
    elsewhere = tmp_path / "tok" / "tokenizer.json"
    elsewhere.parent.mkdir()
    want = _llama_style_tokenizer_json(elsewhere)
    assert cli_main(["import-hf", "--model", str(hf), "--out", str(tmp_path / "out"), "--tokenizer",
                     str(elsewhere)]) == 0
    assert ckpt.load_checkpoint(tmp_path / "out").tokenizer.encode("fox") == want.encode("fox").ids
    line = _cli_error(capsys, "--model", str(hf), "--out", str(tmp_path / "o2"), "--tokenizer", str(tmp_path / "no"))
    assert "--tokenizer" in line and "not found" in line
    big = tmp_path / "big.json"
    assert _llama_style_tokenizer_json(big, added=100).get_vocab_size() > 160  # more tokens than the model's
    line = _cli_error(capsys, "--model", str(hf), "--out", str(tmp_path / "o3"), "--tokenizer", str(big))
    assert "tokens, the model's vocabulary 160" in line and not (tmp_path / "o3").exists()


def test_generate_and_eval_take_an_explicit_tokenizer(tmp_path, capsys):
    """A checkpoint imported without a tokenizer: generate and eval take one with --tokenizer (refused when larger
    than the model's vocabulary, one line)."""
    hf = _wide_hf_dir(tmp_path)
    (hf / "tokenizer.json").unlink(missing_ok=True)
    import_hf(hf, tmp_path / "out")
    assert ckpt.load_checkpoint(tmp_path / "out").tokenizer is None
    tok_file = tmp_path / "tok.json"
    _llama_style_tokenizer_json(tok_file)
    assert cli_main(["generate", "--checkpoint", str(tmp_path / "out"), "--tokenizer", str(tok_file), "--prompt",
                     "def", "--max-new-tokens", "3", "--temperature", "0", "--json", "--threads", "1"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["tokens"] == 3
    data = tmp_path / "text.txt"
    data.write_text("".join(TEXT))
    assert cli_main(["eval", "--checkpoint", str(tmp_path / "out"), "--tokenizer", str(tok_file), "--data", str(data),
                     "--seq-len", "16", "--max-batches", "1", "--json", "--threads", "1"]) == 0
    capsys.readouterr()
    big = tmp_path / "big.json"
    _llama_style_tokenizer_json(big, added=100)
    for cmd in (["generate", "--prompt", "x"], ["eval", "--data", str(data), "--seq-len", "16"]):
        assert cli_main([*cmd, "--checkpoint", str(tmp_path / "out"), "--tokenizer", str(big)]) == 2
        assert "the model's vocabulary 160" in error_line(capsys)


def test_kill_during_an_overwrite_keeps_the_old_run(hf_dir, tmp_path):
    """kill -9 while the new weights are written: the old checkpoints, `latest` and the metrics are as they were, and
    the next import (the dead one's lock is free) replaces them."""
    import signal
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "out"
    old = _training_run(out)
    code = ("import sys, time\n"
            "from linattn import checkpoint as ckpt\n"
            "from linattn.hf.convert import import_hf\n"
            "real = ckpt._save_weights\n"
            "def slow(path, *a, **k):\n"
            "    real(path, *a, **k)\n"
            "    print('writing', flush=True)\n"
            "    time.sleep(120)\n"
            "ckpt._save_weights = slow\n"
            "import_hf(sys.argv[1], sys.argv[2], overwrite=True)\n")
    import linattn

    env = dict(os.environ, PYTHONPATH=str(Path(linattn.__file__).resolve().parents[1]))  # the linattn under test
    proc = subprocess.Popen([sys.executable, "-c", code, str(hf_dir), str(out)], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        assert proc.stdout.readline().strip() == "writing"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    assert [p.name for p in ckpt.list_checkpoints(out)] == [ckpt.step_dir_name(10), ckpt.step_dir_name(20)]
    ids = torch.randint(0, 64, (1, 5))
    assert torch.equal(ckpt.load_checkpoint(out).model(ids).logits, old(ids).logits)
    assert (out / "metrics.jsonl").exists()
    assert import_hf(hf_dir, out, overwrite=True).name == ckpt.step_dir_name(3)
    assert [p.name for p in ckpt.list_checkpoints(out)] == [ckpt.step_dir_name(3)]
