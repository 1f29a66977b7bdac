"""Issue 38's housekeeping: one copy each of resolve_device, count_parameters, the JSON(-lines) writers and
the `python -m linattn.<package>` command line."""
import json

import pytest
import torch

import linattn.experiments.common as exp_common
import linattn.training.config as train_config
from linattn import bench, experiments, io
from linattn.devices import resolve_device
from linattn.errors import ConfigError
from linattn.experiments.common import ExperimentError
from linattn.models import LanguageModel, LMConfig
from linattn.models.lm import count_parameters
from linattn.vision.model import YOLOLAT, count_parameters as vision_count


def test_one_resolve_device():
    assert train_config.resolve_device is resolve_device and exp_common.resolve_device is resolve_device
    want = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device(None) == resolve_device("auto") == resolve_device("") == want
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(ConfigError, match="unknown device 'tpu9'"):
        resolve_device("tpu9")
    with pytest.raises(ExperimentError, match="unknown device"):        # the caller's error class
        resolve_device("tpu9", ExperimentError)
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="'cuda' requested but CUDA is not available"):
            resolve_device("cuda")


def test_one_count_parameters():
    assert vision_count is count_parameters
    vm = YOLOLAT(num_classes=3, width=16, heads=2)
    assert count_parameters(vm) == sum(p.numel() for p in vm.parameters())
    lm = LanguageModel(LMConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2))
    emb = lm.embed.weight.numel() + (lm.lm_head.weight.numel() if lm.lm_head is not None
                                     and lm.lm_head.weight is not lm.embed.weight else 0)
    assert count_parameters(lm) == sum(p.numel() for p in lm.parameters())
    assert count_parameters(lm, exclude_embeddings=True) == count_parameters(lm) - emb


def test_json_lines(tmp_path):
    p = tmp_path / "m.jsonl"
    assert io.read_jsonl(p) == []
    io.write_jsonl(p, [{"step": 1, "loss": float("nan")}])
    io.append_jsonl(p, {"step": 2, "loss": torch.tensor(0.5), "out": tmp_path})
    assert io.read_jsonl(p) == [{"step": 1, "loss": None}, {"step": 2, "loss": 0.5, "out": str(tmp_path)}]
    with open(p, "a", encoding="utf-8") as f:
        f.write('\n{"step": 3, "lo')                    # a blank line, then a torn last line (a kill mid-write)
    assert [r["step"] for r in io.read_jsonl(p)] == [1, 2]
    assert all(json.loads(line) for line in p.read_text().splitlines()[:2])


def test_checkpoint_config_is_strict_json(tmp_path):
    """The checkpoint's config.json goes through linattn.io's writer: non-finite floats become null, not the
    NaN / Infinity tokens that strict JSON readers refuse."""
    from linattn import checkpoint as ckpt

    lm = LanguageModel(LMConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2))
    path = ckpt.save_checkpoint(tmp_path / "run", 1, lm, model_config=ckpt.model_config_to_dict(lm.config),
                                extra={"best": float("inf")})
    text = (path / ckpt.CONFIG_FILE).read_text()
    json.loads(text, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))


@pytest.mark.parametrize("package, prog", [(bench, "linattn bench"), (experiments, "linattn experiment")])
def test_one_command_line(package, prog, capsys, monkeypatch):
    assert package.command_line(["no-such-name"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(prog) and "no-such-name" in err[0]
    calls = []
    monkeypatch.setattr(package.cli_support, "command_line", lambda *a: calls.append(a) or 0)
    assert package.command_line(["x"]) == 0 and calls[0][0] == prog and calls[0][-1] == ["x"]


def test_checkpoint_imports_the_train_schema_not_the_trainer():
    """checkpoint.py validated a checkpoint's train section through an import of linattn.training inside a
    function; the schema now lives in linattn.train_config, imported at the top, and the trainer is not loaded."""
    import ast
    import subprocess
    import sys
    from pathlib import Path

    import linattn.checkpoint as ckpt

    tree = ast.parse(Path(ckpt.__file__).read_text(encoding="utf-8"))
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not any(m == "training" or m.startswith("training.") for m in imported), imported
    code = "import sys, linattn.checkpoint; print('linattn.training' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
    with pytest.raises(ckpt.CheckpointError, match="train: TrainConfig.lr must be finite"):
        ckpt._check_train_section({"lr": -1}, "x")


def test_the_dev_extra_does_not_install_fla():
    """Issue 49.9: with flash-linear-attention installed, transformers binds fla's GPU-only kernels into Qwen3.5,
    Qwen3-Next and Kimi Linear at import, and those models then fail on a CPU. A user who installs linattn's
    `dev` extra must not meet that: fla's models come only with the `fla-models` extra, which `make test`
    installs for the fla-import tests."""
    import re
    from pathlib import Path

    try:
        import tomllib
    except ImportError:  # Python < 3.11
        pytest.importorskip("tomli")
        import tomli as tomllib

    root = Path(__file__).resolve().parents[1]
    extras = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    names = {e: {re.split(r"[<>=!;\[ ]", r, maxsplit=1)[0].strip().lower() for r in reqs} for e, reqs in extras.items()}
    assert not names["dev"] & {"flash-linear-attention", "fla-core"}
    assert names["fla-models"] == {"flash-linear-attention"}
    assert re.search(r"pip install -q -e \"\.\[[^\]]*fla-models", (root / "Makefile").read_text())
