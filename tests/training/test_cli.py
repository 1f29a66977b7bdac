"""`linattn train / eval / generate` end to end on a tiny corpus, bad inputs, and a real SIGTERM."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from linattn.cli import main
from tests.helpers import make_corpus, train_argv

ROOT = Path(__file__).resolve().parents[2]


pytestmark = pytest.mark.usefixtures("one_thread")


def snapshot(d):
    return {p: p.read_bytes() for p in sorted(Path(d).rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def trained(tmp_path_factory, corpus):
    out = tmp_path_factory.mktemp("cli") / "run"
    assert main(train_argv(corpus, out)) == 0
    return out


def test_train_eval_generate(trained, corpus, capsys):
    out = trained
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
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
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
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
    assert "--top-p" in one_error_line(capsys)


def test_sigterm_subprocess_then_resume(corpus, tmp_path, capsys):
    out = tmp_path / "run"
    argv = train_argv(corpus, out, "--steps", "100000", "--log-every", "1", "--save-every", "0", "--eval-every", "0",
                      "--mixer", "linear-elu+1")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, "-m", "linattn", *argv], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 600   # generous: a loaded 2-core machine starts Python and torch slowly
        metrics = out / "metrics.jsonl"
        while time.time() < deadline and proc.poll() is None:
            if metrics.is_file() and len(metrics.read_text().splitlines()) >= 3:
                break
            time.sleep(0.1)
        assert proc.poll() is None, proc.communicate()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=300)
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


# ----------------------------------------------------------------------------- flags from the configs

def _train_parser():
    from linattn.cli_support import ArgParser
    from linattn.training.cli import add_arguments

    p = ArgParser(prog="linattn train")
    add_arguments(p)
    return p


def test_every_config_field_has_a_flag():
    import dataclasses

    from linattn.cli_support import flag_name
    from linattn.models import LMConfig, TLinFormerConfig
    from linattn.training import TrainConfig

    p = _train_parser()
    options = {opt: a for a in p._actions for opt in a.option_strings}
    seen = {"arch"}  # --arch is --model's alias; a field shared by several configs has one flag
    for cls in (TrainConfig, LMConfig, TLinFormerConfig):
        for f in dataclasses.fields(cls):
            flag = flag_name(f.name)
            assert flag in options, f"{cls.__name__}.{f.name} has no flag {flag}"
            assert options[flag].dest == f.name
            assert f.metadata.get("help"), f"{cls.__name__}.{f.name} has no help text"
            if f.name not in seen:                          # the help text is the field's doc
                assert f.metadata["help"].replace("%", "%%") in options[flag].help
            seen.add(f.name)
    for legacy in ("--mixer", "--steps", "--preset", "--model", "--model-config", "--no-progress", "--resume",
                   "--overwrite", "--n-blocks", "--inner-depth", "--history-window", "--generation-window"):
        assert legacy in options


def test_flags_round_trip_into_the_configs(tmp_path):
    from linattn.models import LMConfig, TLinFormerConfig
    from linattn.training import TrainConfig
    from linattn.training.cli import model_config_from_args, train_config_from_args

    p = _train_parser()
    args = p.parse_args([
        "--mixer", "gated-deltanet,softmax", "--n-layers", "2", "--d-model", "32", "--n-heads", "2",
        "--mixer-kwargs", '{"softmax": {"window": 16}}', "--rope", "none", "--short-conv", "true",
        "--head-dim", "8", "--window", "none", "--ffn", "moe", "--n-experts", "2", "--top-k", "1",
        "--moe-bias", "eq14", "--memory-lobe", "causal", "--tie-embeddings", "false", "--rope-base", "500",
        "--hyperlink-ffn-skip", "yes", "--chunk-size", "16", "--aux-loss-coef", "0.5", "--vocab-size", "300",
        "--seq-len", "32", "--beta2", "0.99", "--eps", "1e-6", "--progress", "false", "--threads", "none",
        "--dtype", "bfloat16", "--max-data-bytes", "1000", "--out", str(tmp_path / "o")])
    cfg = train_config_from_args(args)
    assert (cfg.beta2, cfg.eps, cfg.progress, cfg.threads, cfg.dtype) == (0.99, 1e-6, False, None, "bfloat16")
    assert (cfg.vocab_size, cfg.seq_len, cfg.max_data_bytes, cfg.out) == (300, 32, 1000, str(tmp_path / "o"))
    assert cfg.steps == 1000 and cfg.lr == 1e-3                            # not given: the defaults
    mc = model_config_from_args(args, cfg)
    assert type(mc) is LMConfig
    assert mc.mixer == ["gated-deltanet", "softmax"] and mc.mixer_kwargs == {"softmax": {"window": 16}}
    assert (mc.rope, mc.short_conv, mc.head_dim, mc.window, mc.tie_embeddings) == (None, True, 8, None, False)
    assert (mc.ffn, mc.n_experts, mc.top_k, mc.moe_bias, mc.memory_lobe) == ("moe", 2, 1, "eq14", "causal")
    assert (mc.rope_base, mc.hyperlink_ffn_skip, mc.chunk_size, mc.aux_loss_coef) == (500.0, True, 16, 0.5)
    assert (mc.vocab_size, mc.max_seq_len) == (300, 32)                   # max_seq_len raised to --seq-len
    assert model_config_from_args(p.parse_args(["--mixer", "efla"]), cfg).mixer == "efla"  # one name: a str

    args = p.parse_args(["--model", "tlinformer", "--history-window", "auto", "--generation-window", "16",
                         "--n-blocks", "1", "--inner-depth", "3", "--qkv-bias", "true", "--d-model", "32",
                         "--n-heads", "2", "--max-seq-len", "64", "--ffn-hidden", "none"])
    mc = model_config_from_args(args, train_config_from_args(args))
    assert type(mc) is TLinFormerConfig
    assert (mc.history_window, mc.generation_window, mc.n_blocks, mc.inner_depth) == ("auto", 16, 1, 3)
    assert (mc.qkv_bias, mc.max_seq_len, mc.ffn_hidden, mc.arch) == (True, 256, None, "tlinformer")
    assert model_config_from_args(p.parse_args(["--arch", "tlinformer", "--history-window", "12"]), TrainConfig(),
                                  ).history_window == 12


def test_readme_commands_parse(tmp_path):
    from linattn.cli import build_parser
    from linattn.models import LMConfig
    from linattn.training.cli import model_config_from_args, train_config_from_args

    parser = build_parser()
    a = parser.parse_args(["train", "--data", "corpus.txt", "--mixer", "efla", "--out", "runs/efla", "--steps", "2000"])
    cfg = train_config_from_args(a, out=Path(a.out))
    assert cfg.steps == 2000 and cfg.data == os.path.abspath("corpus.txt") and cfg.out == "runs/efla"
    assert model_config_from_args(a, cfg).mixer == "efla"
    a = parser.parse_args(["train", "--preset", "ela-gpt", "--out", "runs/ela"])
    cfg = train_config_from_args(a, out=Path(a.out))
    mc = model_config_from_args(a, cfg)
    assert mc == LMConfig.ela_gpt(6400, max_seq_len=512) and cfg.vocab_size == 6400
    a = parser.parse_args(["eval", "--checkpoint", "runs/efla", "--data", "valid.txt"])
    assert (a.checkpoint, a.data) == ("runs/efla", "valid.txt")
    a = parser.parse_args(["generate", "--checkpoint", "runs/efla", "--prompt", "def main(", "--max-new-tokens", "100"])
    assert (a.prompt, a.max_new_tokens) == ("def main(", 100)


def test_bad_flag_values_exit_2(tmp_path, capsys):
    capsys.readouterr()
    for extra, why in ((["--tie-embeddings", "maybe"], "true or false"), (["--ffn", "bogus"], "swiglu"),
                       (["--mixer-kwargs", "[1]"], "JSON object"), (["--d-model", "x"], "int"),
                       (["--history-window", "soon"], "auto"), (["--dtype", "fp8"], "float32")):
        assert main(["train", "--out", str(tmp_path / "x"), *extra]) == 2, extra
        assert why in one_error_line(capsys), extra
    corpus = make_corpus(tmp_path / "c.txt", n_lines=20)
    assert main(["train", "--data", str(corpus), "--out", str(tmp_path / "y"), "--n-blocks", "2"]) == 2
    assert "--n-blocks is not a setting of model family 'lm'" in one_error_line(capsys)
    assert main(["train", "--data", str(corpus), "--out", str(tmp_path / "y"), "--model", "tlinformer",
                 "--mixer", "efla"]) == 2
    assert "--mixer is not a setting of model family 'tlinformer'" in one_error_line(capsys)
    assert main(["train", "--data", str(corpus), "--out", str(tmp_path / "y"), "--preset", "nope"]) == 2
    assert "unknown preset" in one_error_line(capsys)
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()
