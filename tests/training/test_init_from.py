"""`linattn train --init-from RUN_OR_CHECKPOINT` (issue 37.2): a new run from a checkpoint's weights and
tokenizer, its model config taken from the checkpoint, contradicting model flags refused up front."""
import json
from pathlib import Path

import pytest
import torch

from linattn import checkpoint as ckpt
from linattn.cli import main
from linattn.training import TrainConfig, train

pytestmark = pytest.mark.usefixtures("one_thread_module")

SMALL = ["--seq-len", "16", "--batch-size", "2", "--log-every", "2", "--eval-every", "0", "--eval-batches", "1",
         "--threads", "1", "--no-progress", "--warmup", "1"]


def argv(corpus, out, *extra):
    return ["train", "--data", str(corpus), "--out", str(out), *SMALL, *extra]


@pytest.fixture(scope="module")
def source(tmp_path_factory, corpus):
    """A finished tiny run: d_model 32, mixer gla, max_seq_len 64, 4 steps."""
    out = tmp_path_factory.mktemp("init") / "src"
    assert main(argv(corpus, out, "--mixer", "gla", "--d-model", "32", "--n-layers", "2", "--n-heads", "2",
                     "--vocab-size", "260", "--max-seq-len", "64", "--steps", "4", "--save-every", "0")) == 0
    return out


def one_error_line(capsys):
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "error" in err[0], err
    return err[0]


def _weights(path):
    return ckpt.load_checkpoint(path).model.state_dict()


def test_new_run_starts_from_the_checkpoints_weights_and_tokenizer(source, corpus, tmp_path, capsys):
    out = tmp_path / "ft"
    # lr 1e-12: the first step barely moves the weights, so the new run's step-1 weights ~ the source's
    assert main(argv(corpus, out, "--init-from", str(source), "--steps", "1", "--lr", "1e-12",
                     "--weight-decay", "0", "--save-every", "0")) == 0
    new = ckpt.load_checkpoint(out)
    assert new.step == 1                                           # a new run: step 0 + 1, not the source's 4 + 1
    src = ckpt.load_checkpoint(source)
    assert new.model_config == src.model_config                    # the checkpoint's config (d 32, gla, ...)
    assert (out / "step_00000001" / "tokenizer.json").read_text() == \
        (Path(src.path) / "tokenizer.json").read_text()
    for k, v in src.model.state_dict().items():
        assert torch.allclose(new.model.state_dict()[k], v, atol=1e-9), k
    meta = json.loads((new.path / "config.json").read_text())
    assert meta["train"]["init_from"] == str(Path(source).resolve())
    # fresh optimizer and schedule: the state's optimizer counts 1 step, the run's metrics start at step 1
    state = ckpt.load_training_state(new.path)
    steps = [s["step"] for s in state["optimizer"]["state"].values()]
    assert steps and all(int(s) == 1 for s in steps)
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert recs[0]["step"] == 1


def test_without_init_from_the_weights_differ(source, corpus, tmp_path):
    # the test above can tell: a run from scratch with the same config does not have the source's weights
    out = tmp_path / "scratch"
    assert main(argv(corpus, out, "--mixer", "gla", "--d-model", "32", "--n-layers", "2", "--n-heads", "2",
                     "--vocab-size", "260", "--max-seq-len", "64", "--steps", "1", "--lr", "1e-12")) == 0
    a, b = _weights(out), _weights(source)
    assert any(not torch.allclose(a[k], b[k], atol=1e-6) for k in b if a[k].shape == b[k].shape)


def test_step_folder_and_free_flags(source, corpus, tmp_path):
    step = ckpt.find_latest_checkpoint(source)
    out = tmp_path / "ft2"
    # training flags and the non-architecture model fields are fine; seq-len within max_seq_len 64
    assert main(argv(corpus, out, "--init-from", str(step), "--steps", "2", "--lr", "1e-4", "--chunk-size", "8",
                     "--d-model", "32", "--mixer", "gla", "--seq-len", "64", "--batch-size", "1")) == 0
    ck = ckpt.load_checkpoint(out)
    assert ck.step == 2 and ck.model_config.chunk_size == 8 and ck.model_config.d_model == 32


@pytest.mark.parametrize("flags,field,value", [
    (["--d-model", "128"], "--d-model", "d_model = 32"),
    (["--mixer", "gated-deltanet"], "--mixer", "mixer = 'gla'"),
    (["--n-layers", "3"], "--n-layers", "n_layers = 2"),
    (["--max-seq-len", "128"], "--max-seq-len", "max_seq_len = 64"),
    (["--model", "tlinformer"], "--arch", "arch = 'lm'"),
    (["--vocab-size", "999"], "--vocab-size", "vocab_size = "),
])
def test_contradicting_model_flags_are_refused_up_front(source, corpus, tmp_path, capsys, flags, field, value):
    out = tmp_path / "bad"
    assert main(argv(corpus, out, "--init-from", str(source), "--steps", "1", *flags)) == 2
    line = one_error_line(capsys)
    assert field in line and value in line and "checkpoint" in line, line
    assert not out.exists()                                      # refused before anything ran


@pytest.mark.parametrize("extra,needle", [
    (["--resume"], "--init-from and --resume"),
    (["--seq-len", "128"], "--seq-len 128 exceeds the checkpoint's max_seq_len 64"),
    (["--tokenizer", "x.json"], "--tokenizer"),
    (["--preset", "ela-gpt"], "--preset"),
])
def test_other_refusals(source, corpus, tmp_path, capsys, extra, needle):
    out = tmp_path / "bad2"
    assert main(argv(corpus, out, "--init-from", str(source), "--steps", "1", *extra)) == 2
    assert needle in one_error_line(capsys)
    assert not out.exists()


def test_missing_checkpoint_and_own_out(source, corpus, tmp_path, capsys):
    assert main(argv(corpus, tmp_path / "o", "--init-from", str(tmp_path / "nope"), "--steps", "1")) == 2
    assert "nope" in one_error_line(capsys)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(argv(corpus, tmp_path / "o", "--init-from", str(empty), "--steps", "1")) == 2
    assert "no readable checkpoint" in one_error_line(capsys)
    # --out holding the checkpoint itself: a new run there would replace it
    assert main(argv(corpus, source, "--init-from", str(source), "--steps", "1", "--overwrite")) == 2
    assert "lies in --out" in one_error_line(capsys)
    assert ckpt.find_latest_checkpoint(source) is not None


def test_python_api_and_resume_of_an_init_from_run(source, corpus, tmp_path):
    out = tmp_path / "api"
    cfg = TrainConfig(data=str(corpus), out=str(out), init_from=str(source), seq_len=16, batch_size=2, steps=2,
                      save_every=1, eval_every=0, eval_batches=1, progress=False, warmup=1)
    res = train(cfg)
    assert res.step == 2
    # model_config given in Python: a contradicting one is refused the same way
    from linattn.models import LMConfig
    from linattn.training import TrainError
    with pytest.raises(TrainError, match="d_model"):
        train(TrainConfig(**{**cfg.to_dict(), "out": str(tmp_path / "api2")}),
              LMConfig(vocab_size=260, d_model=64, n_layers=2, n_heads=2, mixer="gla", max_seq_len=64))
    # resuming the new run continues it (its saved init_from is not applied again)
    res2 = train(TrainConfig(**{**cfg.to_dict(), "steps": 3}), resume=True)
    assert res2.step == 3
