"""`linattn train / eval / generate` end to end on a tiny corpus, bad inputs, and a real SIGTERM."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from linattn.cli import main

sys.path.insert(0, os.path.dirname(__file__))
from test_train import make_corpus  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return make_corpus(tmp_path_factory.mktemp("data") / "corpus.txt")


def train_argv(corpus, out, *extra):
    return ["train", "--data", str(corpus), "--out", str(out), "--mixer", "efla", "--vocab-size", "300",
            "--d-model", "32", "--n-layers", "2", "--n-heads", "2", "--seq-len", "32", "--batch-size", "4",
            "--steps", "12", "--lr", "3e-3", "--warmup", "2", "--log-every", "4", "--save-every", "6",
            "--eval-every", "6", "--eval-batches", "2", "--threads", "1", "--no-progress", *extra]


def snapshot(d):
    return {p: p.read_bytes() for p in sorted(Path(d).rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def trained(tmp_path_factory, corpus):
    out = tmp_path_factory.mktemp("cli") / "run"
    assert main(train_argv(corpus, out)) == 0
    return out


def test_train_eval_generate(trained, corpus, capsys):
    out = trained
    recs = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [4, 6, 8, 12]
    assert "val_loss" in recs[1] and all("tokens_per_s" in r for r in recs)
    assert (out / "latest").read_text().strip() == "step_00000012"
    capsys.readouterr()

    assert main(["eval", "--checkpoint", str(out), "--data", str(corpus), "--json", "--max-batches", "3"]) == 0
    ev = json.loads(capsys.readouterr().out)
    assert ev["step"] == 12 and ev["batches"] == 3 and ev["ppl"] == pytest.approx(2.718281828 ** ev["loss"], rel=1e-6)
    assert main(["eval", "--checkpoint", str(out)]) == 0             # its own validation split
    assert "perplexity" in capsys.readouterr().out

    argv = ["generate", "--checkpoint", str(out), "--prompt", "alpha = ", "--max-new-tokens", "6", "--seed", "3"]
    assert main(argv) == 0
    o1 = capsys.readouterr()
    assert o1.out.startswith("alpha = ") and "tokens/s" in o1.err
    assert main(argv) == 0
    assert capsys.readouterr().out == o1.out                          # same seed, same text
    assert main(["generate", "--checkpoint", str(out / "step_00000006"), "--max-new-tokens", "3", "--json",
                 "--temperature", "0"]) == 0
    g = json.loads(capsys.readouterr().out)
    assert g["tokens"] == 3 and g["step"] == 6


def test_resume_extends_run(trained, corpus, tmp_path, capsys):
    out = tmp_path / "run"
    import shutil

    shutil.copytree(trained, out)
    assert main(["train", "--out", str(out), "--resume", "--steps", "14", "--no-progress", "--threads", "1"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["step"] == 14
    steps = [json.loads(l)["step"] for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [4, 6, 8, 12, 14]


def one_error_line(capsys):
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "error" in err[0], err
    return err[0]


def test_bad_inputs_exit_2(trained, corpus, tmp_path, capsys):
    capsys.readouterr()
    assert main(train_argv(tmp_path / "missing.txt", tmp_path / "o1")) == 2
    assert "not found" in one_error_line(capsys)
    (tmp_path / "empty.txt").write_text("\n")
    assert main(train_argv(tmp_path / "empty.txt", tmp_path / "o2")) == 2
    assert "no text" in one_error_line(capsys)
    (tmp_path / "tiny.txt").write_text("x = 1\n")
    assert main(train_argv(tmp_path / "tiny.txt", tmp_path / "o3")) == 2
    assert "seq_len" in one_error_line(capsys)
    assert main(train_argv(corpus, tmp_path / "o4", "--mixer", "no-such-mixer")) == 2
    assert "unknown mixer" in one_error_line(capsys)
    assert not any((tmp_path / f"o{i}").exists() for i in range(1, 5))

    before = snapshot(trained)
    assert main(train_argv(corpus, trained)) == 2                      # occupied, no --resume
    assert "--overwrite" in one_error_line(capsys)
    assert main(train_argv(corpus, trained, "--resume", "--d-model", "64")) == 2
    assert "mismatch" in one_error_line(capsys)
    assert main(train_argv(corpus, trained, "--resume", "--seed", "5")) == 2
    assert "mismatch" in one_error_line(capsys)
    assert snapshot(trained) == before                                 # nothing overwritten

    assert main(["eval", "--checkpoint", str(tmp_path / "nope"), "--data", str(corpus)]) == 2
    assert "not found" in one_error_line(capsys)
    bad = tmp_path / "bad"
    (bad / "step_00000001").mkdir(parents=True)
    for name in ("config.json", "tokenizer.json"):
        (bad / "step_00000001" / name).write_bytes((trained / "step_00000012" / name).read_bytes())
    (bad / "step_00000001" / "model.safetensors").write_bytes(b"\x00" * 64)
    assert main(["eval", "--checkpoint", str(bad), "--data", str(corpus)]) == 2
    assert "cannot read" in one_error_line(capsys)
    cfg = json.loads((trained / "step_00000012" / "config.json").read_text())
    cfg["model"]["d_model"] = 64
    (bad / "step_00000001" / "model.safetensors").write_bytes(
        (trained / "step_00000012" / "model.safetensors").read_bytes())
    (bad / "step_00000001" / "config.json").write_text(json.dumps(cfg))
    assert main(["generate", "--checkpoint", str(bad), "--max-new-tokens", "2"]) == 2
    assert "do not match" in one_error_line(capsys)
    assert main(["generate", "--checkpoint", str(trained), "--top-p", "0"]) == 2
    assert "top_p" in one_error_line(capsys)


def test_sigterm_subprocess_then_resume(corpus, tmp_path, capsys):
    out = tmp_path / "run"
    argv = train_argv(corpus, out, "--steps", "100000", "--log-every", "1", "--save-every", "0", "--eval-every", "0",
                      "--mixer", "linear-elu+1")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, "-m", "linattn", *argv], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        metrics = out / "metrics.jsonl"
        while time.time() < deadline and proc.poll() is None:
            if metrics.is_file() and len(metrics.read_text().splitlines()) >= 3:
                break
            time.sleep(0.1)
        assert proc.poll() is None, proc.communicate()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "continue with --resume" in err
    step = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])["step"]
    latest = (out / "latest").read_text().strip()
    assert latest == f"step_{step:08d}"
    assert main(["train", "--out", str(out), "--resume", "--steps", str(step + 2), "--no-progress"]) == 0
    assert json.loads(capsys.readouterr().out)["step"] == step + 2
