"""The pieces of linattn.training on their own: schedule, Trainer (train_step / evaluate /
state_dict / load_state_dict), the run folder and metrics, the stop flag, flag parsing from
dataclasses, and model-family dispatch in checkpoints and generation (CPU, tiny models)."""
import argparse
import ast
import copy
import os
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Union

import pytest
import torch

from linattn import checkpoint as ckpt
from linattn.cli_support import add_dataclass_arguments, given_values, type_converter
from linattn.data import PackedTokens
from linattn.models import LanguageModel, LMConfig, TLinFormerConfig, TLinFormerLM, build_model
from linattn.training import (
    METRICS_FILE,
    TrainConfig,
    Trainer,
    TrainError,
    TrainingDiverged,
    evaluate,
    lr_at,
    make_optimizer,
    read_metrics,
    training_tokens_per_second,
)
from linattn.training.run import RunFolder, StopFlag

SRC = Path(__file__).resolve().parents[2] / "src" / "linattn"


pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_lm(**kw):
    args = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=2, mixer="linear-elu+1", max_seq_len=32)
    args.update(kw)
    return LMConfig(**args)


def tiny_cfg(**kw):
    args = dict(seq_len=16, batch_size=2, steps=10, lr=3e-3, warmup=2, device="cpu", progress=False)
    args.update(kw)
    return TrainConfig(**args)


def batch(step, vocab=64, b=2, t=16):
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, vocab, (b, t + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def weights(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# ----------------------------------------------------------------------------- schedule

def test_schedule_and_optimizer_groups():
    cfg = TrainConfig(lr=2.0, warmup=4, steps=104, min_lr_ratio=0.5)
    assert [lr_at(s, cfg) for s in range(4)] == [0.5, 1.0, 1.5, 2.0]
    assert lr_at(54, cfg) == pytest.approx(1.5) and lr_at(104, cfg) == pytest.approx(1.0)
    assert lr_at(500, cfg) == pytest.approx(1.0)                       # stays at the floor
    model = LanguageModel(tiny_lm())
    opt = make_optimizer(model, cfg)
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == cfg.weight_decay and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() < 2 for p in no_decay["params"])
    n = len({id(p) for p in model.parameters()})
    assert len(decay["params"]) + len(no_decay["params"]) == n         # tied weights once


# ----------------------------------------------------------------------------- Trainer

def test_train_step_output_and_learning():
    torch.manual_seed(0)
    cfg = tiny_cfg(steps=30, warmup=0)
    tr = Trainer(build_model(tiny_lm(ffn="moe", n_experts=2, top_k=1)), cfg)
    x, y = batch(0)
    outs = [tr.train_step(x, y) for _ in range(30)]
    assert [o.step for o in outs] == list(range(1, 31)) and tr.step == 30
    assert outs[-1].loss < outs[0].loss - 1.0                          # memorises one batch
    assert [o.lr for o in outs] == [lr_at(s, cfg) for s in range(30)] and outs[0].lr == pytest.approx(3e-3)
    assert outs[0].grad_norm > 0 and outs[0].aux_loss is not None
    assert tr.tokens_seen == 30 * x.numel()
    assert tr.interval_loss() == pytest.approx(sum(o.loss for o in outs) / 30)
    assert tr.interval_loss() == 0.0 and tr.loss_count == 0             # reset after reading
    assert Trainer(build_model(tiny_lm()), tiny_cfg(grad_clip=0)).train_step(x, y).grad_norm is None


def test_state_dict_resume_is_exact():
    """2 steps, save (weights + state_dict), 3 more == a fresh Trainer loading them, then 3 steps."""
    torch.manual_seed(0)
    a = Trainer(build_model(tiny_lm()), tiny_cfg())
    for s in range(2):
        a.train_step(*batch(s))
    saved_w, saved_state = weights(a.model), copy.deepcopy(a.state_dict())  # (optimizer tensors are live)
    assert set(saved_state) == {"step", "optimizer", "torch_rng", "cuda_rng", "loss_acc", "tokens_seen", "elapsed_s",
                                "world_size"}
    for s in range(2, 5):
        a.train_step(*batch(s))
    torch.manual_seed(123)                                             # a different init: overwritten
    b = Trainer(build_model(tiny_lm()), tiny_cfg())
    b.model.load_state_dict(saved_w)
    b.load_state_dict(saved_state)
    assert b.step == 2 and b.tokens_seen == 2 * 32
    for s in range(2, 5):
        b.train_step(*batch(s))
    wa, wb = weights(a.model), weights(b.model)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert b.interval_loss() == pytest.approx(a.interval_loss())       # the interval accumulator too


def test_load_state_dict_rejects_a_foreign_optimizer():
    a = Trainer(build_model(tiny_lm()), tiny_cfg())
    a.train_step(*batch(0))
    b = Trainer(build_model(tiny_lm(d_model=64, n_layers=3)), tiny_cfg())
    with pytest.raises(ckpt.CheckpointError, match="optimizer state"):
        b.load_state_dict(a.state_dict())


def test_trainer_any_family_and_divergence():
    tl = TLinFormerConfig(vocab_size=64, d_model=32, n_heads=2, n_blocks=1, inner_depth=2, history_window=4,
                          generation_window=8, max_seq_len=16)
    tr = Trainer(build_model(tl), tiny_cfg())
    assert type(tr.model) is TLinFormerLM and tr.train_step(*batch(0)).loss > 0
    bad = Trainer(build_model(tiny_lm()), tiny_cfg())
    with torch.no_grad():
        bad.model.embed.weight.fill_(float("nan"))
    with pytest.raises(TrainingDiverged, match="nan"):
        bad.train_step(*batch(0))
    assert bad.step == 0
    with pytest.raises(TrainError, match="seq_len"):
        Trainer(build_model(tiny_lm()), tiny_cfg(seq_len=0))


def test_evaluate_deterministic_and_restores_mode():
    model = build_model(tiny_lm()).train()
    tokens = torch.randint(0, 64, (400,), generator=torch.Generator().manual_seed(0))
    r1 = evaluate(model, tokens, seq_len=16, batch_size=4)
    r2 = Trainer(model, tiny_cfg(batch_size=4)).evaluate(PackedTokens(tokens, 16), max_batches=100)
    assert model.training and r1.loss == pytest.approx(r2.loss, rel=1e-6) and r1.tokens == r2.tokens
    assert r1.ppl == pytest.approx(torch.tensor(r1.loss).exp().item(), rel=1e-6)
    with pytest.raises(TrainError, match="seq_len"):
        evaluate(model, tokens)


def test_throughput_uses_the_one_train_step(monkeypatch):
    calls = []
    real = Trainer.train_step

    def counting(self, x, y):
        calls.append(tuple(x.shape))
        return real(self, x, y)

    monkeypatch.setattr(Trainer, "train_step", counting)
    r = training_tokens_per_second(tiny_lm(), seq_len=16, batch_size=2, steps=2, warmup=1, return_all=True)
    assert calls == [(2, 16)] * 3 and len(r["step_s"]) == 2 and r["tokens_per_s"] > 0


# ----------------------------------------------------------------------------- run folder, metrics, signals

def test_run_folder_refuses_clears_and_cuts_metrics(tmp_path):
    out = tmp_path / "run"
    folder = RunFolder(out)
    assert folder.checkpoint_to_resume(resume=False, overwrite=False) is None   # a new folder is fine
    folder.begin(None)
    for s in (5, 10, 15):
        folder.append_metrics({"step": s, "loss": 1.0 / s})
    with open(folder.metrics_path, "a") as f:
        f.write('{"step": 20, "lo')                                    # a torn last line (killed mid-write)
    assert [r["step"] for r in read_metrics(out)] == [5, 10, 15] == [r["step"] for r in folder.metrics()]
    with pytest.raises(TrainError, match="--resume"):
        folder.checkpoint_to_resume(resume=False, overwrite=False)
    model = build_model(tiny_lm())
    ck = ckpt.save_checkpoint(out, 10, model, model_config=tiny_lm().to_dict())
    assert folder.checkpoint_to_resume(resume=True, overwrite=False) == ck
    folder.begin(10)                                                   # a resume at step 10
    assert [r["step"] for r in read_metrics(out / METRICS_FILE)] == [5, 10]
    assert folder.checkpoint_to_resume(resume=False, overwrite=True) is None
    folder.begin(None)                                                 # overwrite: a clean folder
    assert sorted(os.listdir(out)) == [METRICS_FILE] and read_metrics(out) == []
    (tmp_path / "file").write_text("x")
    with pytest.raises(TrainError, match="not a folder"):
        RunFolder(tmp_path / "file").checkpoint_to_resume(resume=False, overwrite=True)


def test_stop_flag_sets_and_restores_handlers():
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    with StopFlag() as stop:
        assert stop.signum is None
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.signum == signal.SIGTERM                           # a flag, not an exit
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)                        # a second signal aborts
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before
    with StopFlag(enabled=False) as off:
        assert signal.getsignal(signal.SIGTERM) == before[0] and off.signum is None


# ----------------------------------------------------------------------------- model families in checkpoints

def test_checkpoints_dispatch_on_the_family_and_read_old_dicts(tmp_path):
    lm = tiny_lm()
    d = ckpt.model_config_to_dict(lm)
    assert d["arch"] == "lm" and ckpt.model_config_from_dict(d) == lm
    old = lm.to_dict()                                                 # first-version dicts had no "arch"
    assert "arch" not in old and ckpt.model_config_from_dict(old) == lm
    tl = TLinFormerConfig(vocab_size=64, d_model=32, n_heads=2, n_blocks=1, inner_depth=2, history_window="auto",
                          generation_window=8, max_seq_len=16)
    assert ckpt.model_config_from_dict(tl.to_dict()) == tl             # TLinFormer dicts: arch="tlinformer"
    with pytest.raises(ckpt.CheckpointError, match="not valid"):
        ckpt.model_config_from_dict({"arch": "nope", "vocab_size": 3})
    for name, cfg, cls in (("lm_old", old, LanguageModel), ("tl", tl.to_dict(), TLinFormerLM)):
        model = build_model(cfg)
        ckpt.save_checkpoint(tmp_path / name, 1, model, model_config=cfg)
        loaded = ckpt.load_checkpoint(tmp_path / name)
        assert type(loaded.model) is cls
        ids = torch.randint(0, 64, (1, 12))
        with torch.no_grad():
            assert torch.equal(loaded.model(ids).logits, model.eval()(ids).logits)


def test_generation_needs_a_causal_lm():
    from linattn.generate import GenerateError, stream_tokens

    with pytest.raises(GenerateError, match="no stream"):
        list(stream_tokens(torch.nn.Linear(2, 2), torch.tensor([[1, 2]]), 3))
    model = build_model(tiny_lm()).eval()
    got = list(stream_tokens(model, torch.tensor([[1, 2, 3]]), 5, temperature=0, top_k=0))
    assert got == model.generate([1, 2, 3], 5, temperature=0)[3:].tolist()


# ----------------------------------------------------------------------------- flags from dataclasses

@dataclass
class _Demo:
    n: int = field(default=1, metadata={"help": "a count"})
    x: float = 0.5
    flag: bool = False
    maybe: Optional[bool] = None
    name: str = field(default="a", metadata={"choices": ("a", "b")})
    opt: Optional[int] = None
    names: List[str] = field(default_factory=list)
    one_or_many: Union[str, List[str]] = "a"
    window: Union[int, str] = field(default=4, metadata={"choices": ("auto",)})
    kw: Dict[str, int] = field(default_factory=dict, metadata={"help": "100% JSON"})


def test_dataclass_flags_parse_each_type():
    from linattn.cli_support import ArgParser, UsageError

    p = ArgParser(prog="t")
    assert add_dataclass_arguments(p, _Demo, skip=("x",)) == ["n", "flag", "maybe", "name", "opt", "names",
                                                               "one_or_many", "window", "kw"]
    a = p.parse_args(["--n", "3", "--flag", "on", "--maybe", "none", "--name", "b", "--opt", "7", "--names", "p,q",
                      "--one-or-many", "z", "--window", "auto", "--kw", '{"k": 1}'])
    assert vars(a) == {"n": 3, "flag": True, "maybe": None, "name": "b", "opt": 7, "names": ["p", "q"],
                       "one_or_many": "z", "window": "auto", "kw": {"k": 1}}
    assert given_values(p.parse_args(["--window", "12", "--one-or-many", "a,b"]), ["window", "one_or_many", "n"]) \
        == {"window": 12, "one_or_many": ["a", "b"]}                   # flags not given are absent
    for bad in (["--n", "1.5"], ["--flag", "perhaps"], ["--name", "c"], ["--window", "later"], ["--kw", "[]"],
                ["--x", "1"]):
        with pytest.raises(UsageError):
            p.parse_args(bad)
    helps = {a.dest: a.help for a in p._actions}
    assert helps["n"] == "a count (default: 1)" and helps["kw"] == "100%% JSON (default: {})"
    conv, metavar = type_converter(Optional[int])
    assert conv("none") is None and conv("5") == 5 and metavar == "INT|none"
    with pytest.raises(argparse.ArgumentTypeError):
        conv("five")


# ----------------------------------------------------------------------------- code shape

def test_no_long_functions_in_training():
    """The package replaced a 238-line train(): keep every function short (its docstring not counted: the
    public pieces document Args / Returns / an example)."""
    long = []
    for path in sorted((SRC / "training").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - min([d.lineno for d in node.decorator_list] + [node.lineno]) + 1
                first = node.body[0]
                if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                        and isinstance(first.value.value, str):
                    n -= first.end_lineno - first.lineno + 1
                if n > 60:
                    long.append(f"{path.name}:{node.name} ({n} lines)")
    assert not long, long
    assert not (SRC / "train.py").exists()


def test_no_model_specific_dispatch():
    """Checkpoints, training and generation go through the model-family registry: their code names
    no model class and compares no string with a family name."""
    names = {"tlinformer", "lm", "LanguageModel", "LMConfig", "TLinFormerLM", "TLinFormerConfig"}
    for path in [*(SRC / "training").glob("*.py"), SRC / "checkpoint.py", SRC / "generate.py"]:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Compare):
                consts = [c.value for c in [node.left, *node.comparators] if isinstance(c, ast.Constant)]
                assert not names & set(consts), f"{path.name}:{node.lineno} compares with a family name"
            elif isinstance(node, (ast.Name, ast.alias)):
                ident = node.id if isinstance(node, ast.Name) else node.name
                assert ident not in names, f"{path.name}:{node.lineno} names {ident}"
            elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance":
                assert not names & {getattr(a, "id", None) for a in ast.walk(node.args[1])}
