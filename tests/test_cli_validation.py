"""Issue 19 (points 5, 6 and 9): the command line never crashes with a traceback and never silently
accepts nonsense. A bad value gives one line on stderr naming the flag and what it expects, and exit
code 2. TrainConfig and LMConfig run the same checks for the Python API (ConfigError)."""
import argparse
import json
import math
import types
from pathlib import Path

import pytest
import torch

from linattn import cli
from linattn.errors import ConfigError, LinattnError

WORDS = ["alpha", "beta", "gamma", "delta", "omega", "sigma"]


@pytest.fixture(autouse=True)
def _keep_threads():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    lines = [f"{WORDS[i % 6]} = {WORDS[(i * 5) % 6]} + {i % 10}  # {WORDS[(i * 7) % 6]}" for i in range(60)]
    path = tmp_path_factory.mktemp("data") / "c.txt"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def tiny(corpus, out, *extra):
    """A run that takes about a second: before the fixes, the bad values below trained without a word."""
    return ["train", "--data", str(corpus), "--out", str(out), "--vocab-size", "280", "--d-model", "16",
            "--n-layers", "1", "--n-heads", "2", "--mixer", "linear-elu+1", "--seq-len", "16", "--batch-size", "2",
            "--steps", "2", "--warmup", "1", "--eval-batches", "1", "--threads", "1", "--no-progress", *extra]


@pytest.fixture(scope="module")
def run(tmp_path_factory, corpus):
    out = tmp_path_factory.mktemp("run") / "r"
    assert cli.main(tiny(corpus, out, "--steps", "3")) == 0
    return out


def snapshot(d):
    return {p: p.read_bytes() for p in sorted(Path(d).rglob("*")) if p.is_file()}


def error_line(capsys):
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "error:" in err[0], err
    return err[0]


# ---------------------------------------------------------------------------------- point 5: linattn train

@pytest.mark.parametrize("flag, value, expected", [
    ("--min-lr-ratio", "-1", "in [0, 1]"),          # a negative learning rate: gradient ascent
    ("--min-lr-ratio", "2", "in [0, 1]"),
    ("--warmup", "-10", ">= 0"),
    ("--weight-decay", "-1", ">= 0"),
    ("--grad-clip", "-1", "0: no clipping"),
    ("--threads", "0", ">= 1"),
    ("--threads", "-1", ">= 1"),                     # was a RuntimeError traceback
    ("--keep-last", "0", ">= 1 or none"),
    ("--keep-last", "-1", ">= 1 or none"),
    ("--steps", "0", ">= 1"),
    ("--lr", "inf", "finite"),
    ("--lr", "nan", "finite"),
    ("--beta1", "1.5", "in [0, 1)"),                 # was a ValueError traceback from AdamW
    ("--eps", "0", "> 0"),
    ("--rope-base", "nan", "finite"),
    ("--norm-eps", "-1", "> 0"),
    ("--init-std", "-1", "> 0"),                     # was a RuntimeError traceback from the init
    ("--aux-loss-coef", "nan", "finite"),
])
def test_train_rejects_nonsense(corpus, tmp_path, capsys, flag, value, expected):
    out = tmp_path / "o"
    assert cli.main(tiny(corpus, out, flag, value)) == 2
    line = error_line(capsys)
    assert line.startswith("linattn: error: ") and flag in line and expected in line, line
    assert not out.exists()


def test_documented_meanings_are_accepted(corpus, tmp_path, capsys):
    out = tmp_path / "o"                             # grad_clip 0: no clipping; keep_last none: keep all
    assert cli.main(tiny(corpus, out, "--grad-clip", "0", "--keep-last", "none", "--save-every", "1")) == 0
    assert sorted(p.name for p in out.glob("step_*")) == ["step_00000001", "step_00000002"]


def test_warmup_beyond_steps_warns_on_one_line(corpus, tmp_path, capsys):
    assert cli.main(tiny(corpus, tmp_path / "o", "--warmup", "5")) == 0
    err = [line for line in capsys.readouterr().err.splitlines() if "warn" in line.lower()]
    assert len(err) == 1 and "--warmup" in err[0] and "--steps" in err[0], err


def test_resume_and_overwrite_exclude_each_other(run, capsys):
    before = snapshot(run)
    assert cli.main(["train", "--out", str(run), "--resume", "--overwrite", "--steps", "4", "--no-progress"]) == 2
    line = error_line(capsys)
    assert "--resume" in line and "--overwrite" in line
    assert snapshot(run) == before


def test_resume_below_the_steps_done(run, capsys):
    before = snapshot(run)
    assert cli.main(["train", "--out", str(run), "--resume", "--steps", "2", "--no-progress"]) == 2
    line = error_line(capsys)
    assert "--steps 2" in line and "3 steps" in line
    assert snapshot(run) == before


def test_model_config_file_errors(corpus, tmp_path, capsys):
    listing = tmp_path / "list.json"
    listing.write_text("[1, 2]")
    notjson = tmp_path / "bad.json"
    notjson.write_text("d_model: 16")
    for path, needle in ((listing, "JSON object"), (notjson, "cannot read"), (tmp_path, "not a file"),
                         (tmp_path / "missing.json", "no such file")):
        assert cli.main(tiny(corpus, tmp_path / "o", "--model-config", str(path))) == 2, path
        line = error_line(capsys)
        assert "--model-config" in line and needle in line, line
    assert not (tmp_path / "o").exists()


# ---------------------------------------------------------------------------------- the same checks in Python

@pytest.mark.parametrize("field, value", [
    ("lr", float("inf")), ("lr", 0.0), ("min_lr_ratio", -1.0), ("min_lr_ratio", 2.0), ("warmup", -1),
    ("weight_decay", -1.0), ("grad_clip", -1.0), ("grad_clip", float("nan")), ("threads", 0), ("keep_last", 0),
    ("steps", 0), ("beta1", 1.0), ("beta2", -0.1), ("eps", 0.0), ("val_fraction", 1.0), ("max_data_bytes", 0),
    ("vocab_size", 0), ("seed", 1.5), ("compile", "yes"),
])
def test_train_config_validate(field, value):
    from linattn.training import TrainConfig, TrainError

    cfg = TrainConfig(**{field: value})
    with pytest.raises(ConfigError, match=field) as e:
        cfg.validate()
    assert isinstance(e.value, TrainError) and e.value.field == field


def test_train_config_accepts_documented_values():
    from linattn.training import TrainConfig

    TrainConfig(grad_clip=0.0, keep_last=None, threads=None, warmup=0, min_lr_ratio=0.0, val_fraction=0.0,
                weight_decay=0.0, lr=1e9, save_every=0, eval_every=-1).validate()
    assert TrainConfig(warmup=10, steps=5).advice() and not TrainConfig(warmup=5, steps=5).advice()


def test_legacy_checkpoint_values_keep_their_meaning():
    from linattn.training.config import TrainConfig, check_resume_compatible, legacy_values

    saved = legacy_values({"grad_clip": -1.0, "keep_last": 0, "threads": 0})
    assert (saved["grad_clip"], saved["keep_last"], saved["threads"]) == (0.0, None, None)
    check_resume_compatible(TrainConfig(grad_clip=0.0), {"grad_clip": -1.0})     # not a mismatch


@pytest.mark.parametrize("field, value", [
    ("rope_base", float("nan")), ("norm_eps", 0.0), ("init_std", -1.0), ("aux_loss_coef", float("nan")),
    ("tie_embeddings", "yes"), ("rope", 1),
])
def test_lm_config_validate(field, value):
    from linattn.models import LMConfig

    with pytest.raises(ConfigError, match=field):
        LMConfig(vocab_size=64, **{field: value})


# ---------------------------------------------------------------------------------- point 6: eval and generate

@pytest.mark.parametrize("flag, value", [
    ("--seq-len", "0"),            # was silently the training seq_len
    ("--batch-size", "0"),         # was a ValueError traceback
    ("--threads", "-1"),           # was a RuntimeError traceback
    ("--threads", "0"),            # was silently torch's default
    ("--max-batches", "0"),
    ("--max-data-bytes", "0"),
])
def test_eval_rejects_bad_numbers(run, corpus, capsys, flag, value):
    assert cli.main(["eval", "--checkpoint", str(run), "--data", str(corpus), flag, value]) == 2
    line = error_line(capsys)
    assert line.startswith("linattn eval: error: ") and flag in line and ">= 1" in line, line


@pytest.mark.parametrize("flag, value, expected", [
    ("--temperature", "nan", "finite"),  # was a RuntimeError traceback from torch.multinomial
    ("--temperature", "inf", "finite"),
    ("--temperature", "-1", ">= 0"),
    ("--top-k", "-1", "0 = off"),
    ("--top-p", "0", "> 0 and <= 1"),
    ("--top-p", "1.5", "> 0 and <= 1"),
    ("--top-p", "nan", "> 0 and <= 1"),
    ("--threads", "-1", ">= 1"),         # was a RuntimeError traceback
    ("--max-new-tokens", "-1", ">= 0"),
])
def test_generate_rejects_bad_sampling(run, capsys, flag, value, expected):
    assert cli.main(["generate", "--checkpoint", str(run), "--max-new-tokens", "2", flag, value]) == 2
    line = error_line(capsys)
    assert line.startswith("linattn generate: error: ") and flag in line and expected in line, line


def test_check_sampling_rejects_non_finite():
    from linattn.generate import GenerateError, check_sampling

    for kw in (dict(temperature=math.nan), dict(temperature=math.inf), dict(top_p=math.nan), dict(top_k=1.5)):
        args = {**dict(temperature=1.0, top_k=None, top_p=None, max_new_tokens=1), **kw}
        with pytest.raises(GenerateError):
            check_sampling(**args)
    check_sampling(0.0, 0, 1.0, 0)                   # greedy, top-k off, top-p off, nothing to generate


def test_threads_everywhere(tmp_path, capsys):
    for argv in (["bench", "ops", "--threads", "-1"], ["bench", "decode", "--threads", "-1"],
                 ["bench", "tlinformer", "--threads", "-2"], ["bench", "vision", "--threads", "-1"],
                 ["demo", "--threads", "-1", "--skip-bench", "--skip-train", "--out", str(tmp_path / "d")],
                 ["vision", "eval", "--checkpoint", str(tmp_path), "--threads", "-1"],
                 ["vision", "detect", "--checkpoint", str(tmp_path), "--threads", "0", "x.png"]):
        assert cli.main(argv) == 2, argv
        assert "--threads" in error_line(capsys)


# ---------------------------------------------------------------------------------- point 9: small things

def test_no_progress_keeps_the_step_lines_and_quiet_hides_them(corpus, tmp_path, capsys):
    assert cli.main(tiny(corpus, tmp_path / "a", "--log-every", "1")) == 0       # --no-progress
    err = capsys.readouterr().err
    assert "step 1/2 loss" in err and "step 2/2 loss" in err
    assert cli.main(tiny(corpus, tmp_path / "b", "--log-every", "1", "--quiet")) == 0
    assert capsys.readouterr().err == ""                                         # no warnings here either


class _EosModel(torch.nn.Module):
    """Generates "alpha", the end-of-text token, then "beta" (no parameters: decoding runs on the CPU)."""

    def __init__(self, ids):
        super().__init__()
        self.ids = ids

    def stream(self, input_ids, max_new_tokens, **kw):
        yield from self.ids[:max_new_tokens]


def test_generate_does_not_print_special_tokens(monkeypatch, capsys):
    from linattn import generate
    from linattn.data.tokenizer import EOS_TOKEN, train_tokenizer

    tok = train_tokenizer(["alpha beta gamma " * 20], vocab_size=280)
    ids = tok.encode("alpha") + [tok.eos_id] + tok.encode(" beta")
    ck = types.SimpleNamespace(model=_EosModel(ids), tokenizer=tok, path="fake", step=1)
    monkeypatch.setattr(generate, "load_generator", lambda checkpoint, device=None, tokenizer=None, *quant: ck)
    argv = ["generate", "--checkpoint", "fake", "--prompt", "x ", "--max-new-tokens", str(len(ids))]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert EOS_TOKEN not in out and out == "x alpha beta\n"
    assert cli.main([*argv, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["text"] == "alpha beta"
    text, _ = generate.generate_text(ck.model, tok, "", len(ids))            # the API keeps them unless asked
    assert EOS_TOKEN in text


def test_bench_decode_says_slower_when_slower():
    from linattn.bench import common
    from linattn.bench.decode import _speedup_lines

    ms = {"softmax": 1.0, "fast": 0.5, "slow": 2.5}
    lines = _speedup_lines(["softmax", "fast", "slow"], [64], lambda name, N, key: ms[name])
    assert lines == ["at N = 64: fast decodes 2.0x faster than softmax + KV cache",
                     "at N = 64: slow decodes 2.5x slower than softmax + KV cache"]
    assert common.speed_ratio(1.0, 4.0) == "4.0x slower" and common.speed_ratio(4.0, 1.0) == "4.0x faster"


def test_bench_ops_threads(tmp_path, capsys):
    torch.set_num_threads(2)
    argv = ["bench", "ops", "--T", "32", "--families", "softmax", "--passes", "fwd", "--repeats", "1", "--warmup",
            "0", "--min-time", "0", "--matmul-n", "32", "--no-memory", "--quiet", "--threads", "1",
            "--out", str(tmp_path)]
    assert cli.main(argv) == 0
    report = json.loads((tmp_path / "ops.json").read_text())
    assert report["config"]["threads"] == 1 and report["machine"]["torch_threads"] == 1
    assert torch.get_num_threads() == 1


def _all_parsers():
    """(name, parser) of every command, benchmark, experiment and vision action."""
    from linattn import bench, experiments
    from linattn.cli_support import ArgParser
    from linattn.vision import commands as vision

    top = cli.build_parser()
    yield "linattn", top
    for name, p in top._subparsers._group_actions[0].choices.items():
        yield name, p
    for name in bench.BENCHMARKS:
        p = ArgParser(prog=name)
        bench.load(name).add_arguments(p)
        yield f"bench {name}", p
    for name in experiments.EXPERIMENTS:
        yield f"experiment {name}", experiments.build_parser(name)[1]
    for name, (add, _, _) in vision._ACTIONS.items():
        p = ArgParser(prog=name)
        add(p)
        yield f"vision {name}", p


def test_every_option_has_help():
    missing = []
    for name, parser in _all_parsers():
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            if not (action.help or "").strip() or action.help == argparse.SUPPRESS:
                missing.append(f"{name} {'/'.join(action.option_strings) or action.dest}")
    assert not missing, missing


def test_pyproject_license_is_an_spdx_string():
    text = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    assert 'license = "MIT"' in text and "license = {" not in text


def test_errors_are_linattn_errors():
    from linattn.training.config import TrainConfigError

    assert issubclass(TrainConfigError, ConfigError) and issubclass(TrainConfigError, LinattnError)
