"""The command line's quantization: `generate` / `eval --quantize`, `linattn quantize` and its folder (loaded by
generate and eval as it is), and the refusals (quantizing twice, --group-size without int4, export-hf)."""
import json

import pytest

from linattn import cli
from linattn.quant import is_quantized_dir, load_quantized, quantization_summary
from tests.helpers import make_corpus

pytestmark = pytest.mark.usefixtures("one_thread")   # the CLI sets torch's threads: restored after each test


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return make_corpus(tmp_path_factory.mktemp("data") / "c.txt", n_lines=80)


@pytest.fixture(scope="module")
def run(tmp_path_factory, corpus):
    out = tmp_path_factory.mktemp("run") / "r"
    argv = ["train", "--data", str(corpus), "--out", str(out), "--vocab-size", "288", "--d-model", "32",
            "--n-layers", "1", "--n-heads", "2", "--mixer", "gated-deltanet", "--seq-len", "16", "--batch-size", "2",
            "--steps", "3", "--warmup", "1", "--eval-batches", "1", "--threads", "1", "--no-progress"]
    assert cli.main(argv) == 0
    return out


def _json_out(capsys):
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def _error(capsys):
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "error:" in err[0], err
    return err[0]


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_generate_and_eval_quantize(run, corpus, capsys, mode):
    gen = ["generate", "--checkpoint", str(run), "--max-new-tokens", "5", "--temperature", "0", "--json"]
    assert cli.main(gen + ["--quantize", mode]) == 0
    assert _json_out(capsys)["tokens"] == 5
    ev = ["eval", "--checkpoint", str(run), "--data", str(corpus), "--json"]
    assert cli.main(ev) == 0
    fp32 = _json_out(capsys)
    assert cli.main(ev + ["--quantize", mode]) == 0
    q = _json_out(capsys)
    assert q["tokens"] == fp32["tokens"] and q["loss"] != fp32["loss"]        # the quantized weights ran


def test_quantize_command_writes_a_folder_generate_and_eval_load(run, corpus, tmp_path, capsys):
    out = tmp_path / "q"
    assert cli.main(["quantize", "--checkpoint", str(run), "--mode", "int4", "--group-size", "32",
                     "--out", str(out)]) == 0
    assert "int4 linear layers" in capsys.readouterr().out
    assert is_quantized_dir(out) and (out / "tokenizer.json").is_file()
    model, tok = load_quantized(out)
    assert quantization_summary(model)["mode"] == "int4" and tok is not None
    assert cli.main(["eval", "--checkpoint", str(out), "--data", str(corpus), "--json"]) == 0
    from_folder = _json_out(capsys)
    assert cli.main(["eval", "--checkpoint", str(run), "--data", str(corpus), "--json", "--quantize", "int4"]) == 0
    assert _json_out(capsys)["loss"] == from_folder["loss"]       # the folder holds what --quantize computes
    assert cli.main(["generate", "--checkpoint", str(out), "--max-new-tokens", "3", "--json"]) == 0
    assert cli.main(["quantize", "--checkpoint", str(run), "--mode", "int8", "--out", str(out)]) == 2
    assert "exists" in _error(capsys)


def test_refusals(run, tmp_path, capsys):
    out = tmp_path / "q"
    assert cli.main(["quantize", "--checkpoint", str(run), "--mode", "int8", "--out", str(out)]) == 0
    capsys.readouterr()
    assert cli.main(["generate", "--checkpoint", str(out), "--quantize", "int4", "--max-new-tokens", "1"]) == 2
    assert "already quantized" in _error(capsys)
    assert cli.main(["quantize", "--checkpoint", str(out), "--mode", "int4", "--out", str(tmp_path / "x")]) == 2
    assert "already quantized" in _error(capsys)
    assert cli.main(["generate", "--checkpoint", str(run), "--quantize", "int8", "--group-size", "32",
                     "--max-new-tokens", "1"]) == 2
    assert "group_size applies to int4 only" in _error(capsys)
    assert cli.main(["generate", "--checkpoint", str(run), "--group-size", "32", "--max-new-tokens", "1"]) == 2
    assert "--group-size needs --quantize int4" in _error(capsys)
    assert cli.main(["generate", "--checkpoint", str(run), "--quantize", "int2"]) == 2
    assert "--quantize: invalid choice" in _error(capsys)
    pytest.importorskip("transformers")
    assert cli.main(["export-hf", "--checkpoint", str(out), "--out", str(tmp_path / "hf")]) == 2
    line = _error(capsys)
    assert "holds a quantized model" in line and "export-hf needs the float checkpoint" in line


def test_activations_flag(run, corpus, tmp_path, capsys):
    """--activations int8 / float: generate / eval run it (int4's default: int8), `linattn quantize` saves it (the
    folder loads with it, and eval of the folder equals eval --quantize --activations); without --quantize it is
    refused."""
    ev = ["eval", "--checkpoint", str(run), "--data", str(corpus), "--json", "--quantize", "int4"]
    assert cli.main(ev + ["--activations", "float"]) == 0
    exact = _json_out(capsys)
    assert cli.main(ev + ["--activations", "int8"]) == 0
    a8 = _json_out(capsys)
    assert a8["tokens"] == exact["tokens"] and a8["loss"] != exact["loss"]
    assert cli.main(ev) == 0
    assert _json_out(capsys)["loss"] == a8["loss"]
    out = tmp_path / "q"
    assert cli.main(["quantize", "--checkpoint", str(run), "--mode", "int4", "--activations", "int8",
                     "--out", str(out)]) == 0
    capsys.readouterr()
    assert json.loads((out / "quantized.json").read_text())["activations"] == "int8"
    assert quantization_summary(load_quantized(out)[0])["activations"] == "int8"
    assert cli.main(["eval", "--checkpoint", str(out), "--data", str(corpus), "--json"]) == 0
    assert _json_out(capsys)["loss"] == a8["loss"]
    assert cli.main(["generate", "--checkpoint", str(run), "--quantize", "int8", "--activations", "int8",
                     "--max-new-tokens", "3", "--temperature", "0", "--json"]) == 0
    assert _json_out(capsys)["tokens"] == 3
    assert cli.main(["generate", "--checkpoint", str(run), "--activations", "int8", "--max-new-tokens", "1"]) == 2
    assert "--activations needs --quantize" in _error(capsys)
    assert cli.main(["generate", "--checkpoint", str(out), "--activations", "int8", "--max-new-tokens", "1"]) == 2
    assert "--activations needs --quantize" in _error(capsys)
